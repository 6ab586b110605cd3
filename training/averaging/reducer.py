"""The reduction of one part, pure: weighted sums as chunks arrive, exact exclusion, the mean.

Rules (what a reducer promises):

- A sender's contribution counts only if *all* its chunks for the part arrived, decoded
  cleanly, were finite, were exactly what the round's codec makes of a chunk (its size: no
  other block size or ``k``), and carried the epoch and weight it declared. Chunks are added
  to the running sum as they arrive (so reduction overlaps the network) and kept until the
  sender's part is complete; a sender that fails midway is subtracted again chunk by chunk.
- Subtraction is exact only up to rounding of what was added: a chunk far larger than the
  contributions settled so far (ours, and complete senders') waits, kept, and is added
  when its sender completes, so that a hostile sender cannot add huge values, get itself
  dropped, and leave their rounding error (2**-24 of *its* values) in the others' mean.
- Staleness: with ``E`` the largest epoch declared in the group, a sender at epoch ``e``
  is dropped as ``stale`` when ``E - e > max_staleness``, else weighted by
  ``weight * decay ** (E - e)``. Everybody derives this from the same member list.
- Convex sums: each contribution is added as ``share * values`` (one fused multiply-add;
  ours scaled in place), the shares float32 factors in [0, 1] summing to at most 1 (exact
  ratios to our own weight over a power of two when the weights allow, else each weight
  over a power of two at least the total: ``scans.convex_shares``), so the running sum
  never exceeds the largest
  ``|value|`` (but by rounding) whatever the weights (any positive finite float64).
  With ``wide`` (see :func:`wide_sum_wanted`) the sum is float64 and so are the shares
  (each weight over a power of two, exact), every product rounded alike; the mean is
  rounded to float32 once, in :meth:`PartReducer.divide`.
  :meth:`PartReducer.finalize` divides by the shares of the senders that counted (no
  division when they sum to exactly 1), which cannot overflow unless
  their mean does, and checks that the mean fits what the codec can send back (float16:
  +-65504); when it does not, the part has no result and its note says so.
- The mean is what every member receives (encoded once), so they all get the same values.

No I/O and no clock here: the trio glue decides when a sender is frozen or dead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from protocol.codecs import Codec
from protocol.identity import PeerID

from .chunk_checks import ChunkChecks
from .chunk_checks import decode_raw as decode_raw
from .layout import Float32Array, chunk_count, chunk_span
from .pieces import RangeCodec
from .scans import (
    PIECE,
    as_tensor,
    convex_shares,
    magnitude,
    overflow_note,
    result_limit,
    scale_magnitude,
)
from .senders import ChunkRejected, DropReason, Member, PartOutcome, _Sender
from .weights import _wide_shares, effective_weights
from .weights import wide_sum_wanted as wide_sum_wanted

SUBTRACT_FACTOR = 4.0
"""A pending sender's chunk is added as it arrives only if its scaled values are at most
this many times the largest scaled contribution settled so far; else when it completes.
Subtracting a dropped sender then leaves at most a few float32 roundings of the settled
contributions' magnitude in the sum."""

MIN_SHARE = 2.0**-64
"""Below this share of the senders' total weight, the contributors' sum is too small to be
scaled back up in float32 (a sender that outweighed them by 2**64 was dropped)."""


class PartReducer(ChunkChecks):
    """Accumulates one part into ``acc`` (caller-owned: the reducer's own span of its flat
    vector, holding ``local``'s values on entry and the mean after :meth:`finalize`);
    ``scratch`` is a reused chunk buffer."""

    def __init__(
        self,
        *,
        length: int,
        chunk_elements: int,
        codec: Codec,
        members: Iterable[Member],
        senders: Iterable[PeerID],
        max_staleness: int,
        decay: float,
        acc: Float32Array,
        scratch: Float32Array,
        local: PeerID | None = None,
        local_values: Float32Array | None = None,
        defer_load: bool = False,
        ranges: RangeCodec | None = None,
        base: int = 0,
        wide: np.ndarray | None = None,
    ) -> None:
        self.length = length
        self.chunk_elements = chunk_elements
        self.n_chunks = chunk_count(length, chunk_elements)
        self.codec = codec
        # the part is flat[base:base + length]; int8 chunks that span tensors are a blob
        # per tensor (see pieces.py): without ``ranges``, one tensor holds the part
        self.ranges = ranges if ranges is not None else RangeCodec(codec, ())
        self.base = base
        self.members = {m.peer_id: m for m in members}
        # the running sum: in place in ``acc`` (float32), or in ``wide`` (float64, see
        # wide_sum_wanted); the mean goes to ``acc`` (or finalize's ``out``) either way
        mean: Float32Array = acc[:length]
        self._acc_array: np.ndarray = mean if wide is None else wide[:length]
        if wide is not None and (wide.dtype != np.float64 or len(wide) < length):
            raise ValueError(f"wide must be float64 of at least {length} elements")
        self._acc = torch.from_numpy(self._acc_array)
        # float64 products of a piece of a chunk (see _accumulate)
        self._product = None if wide is None else torch.empty(PIECE, dtype=torch.float64)
        self._scratch = scratch
        weights = effective_weights(self.members.values(), max_staleness, decay)
        senders = list(senders)
        counted = {p: w for p in senders if (w := weights[p]) is not None}
        # float64 sums take float64 shares (each weight over a power of two: products with
        # float32 values exact for weights of up to 29 significant bits, else rounded at
        # 2**-53), float32 ones exact float32 shares where possible
        shares = _wide_shares(counted) if wide is not None else convex_shares(counted, own=local)
        self.senders: dict[PeerID, _Sender] = {}
        for peer_id in senders:
            member = self.members[peer_id]
            weight = weights[peer_id]
            sender = _Sender(weight or 0.0, member.epoch, self.n_chunks)
            if weight is None:
                sender.reason = DropReason.STALE
            else:
                sender.share = shares[peer_id]
                sender.done = self.n_chunks == 0
            self.senders[peer_id] = sender
        self.finalized = False
        self._mean = mean
        self._share = 1.0  # the contributors' shares together, once finalized
        self._largest = 0.0  # the largest |value| added (ours included): overflow is possible
        # only when it nears what the codec can send back
        self._settled = 0.0  # the largest share * |value| of ours and of complete senders
        self._blob_sizes: dict[int, int] = {}  # elements -> bytes of the round codec's blob
        self._undivided: set[int] = set()  # chunks of the sum not turned into the mean yet
        self._local = local
        self._local_values = local_values
        self.loaded = False
        if not defer_load:
            for _ in self.load_steps():
                pass

    # -- state ---------------------------------------------------------------------------

    def pending(self) -> list[PeerID]:
        """Senders still expected (neither complete nor dropped)."""
        return [p for p, s in self.senders.items() if not s.done and s.reason is None]

    def complete_senders(self) -> list[PeerID]:
        """Senders whose whole part is in (and not dropped): the contributors, once final."""
        return [p for p, s in self.senders.items() if s.done and s.reason is None]

    def is_pending(self, peer_id: PeerID) -> bool:
        sender = self.senders.get(peer_id)
        return sender is not None and not sender.done and sender.reason is None

    def reason(self, peer_id: PeerID) -> DropReason | None:
        sender = self.senders.get(peer_id)
        return None if sender is None else sender.reason

    def received_chunks(self, peer_id: PeerID) -> int:
        """How many chunks of its part ``peer_id`` has delivered (0 for a stranger)."""
        sender = self.senders.get(peer_id)
        return 0 if sender is None else sum(sender.received)

    def retained_bytes(self) -> int:
        return sum(s.retained_bytes for s in self.senders.values())

    # -- contributions -------------------------------------------------------------------

    def load_steps(self, step: int | None = None) -> Iterator[None]:
        """Take in our own values (with ``defer_load``: before any chunk is added), yielding
        after every ``step`` elements (default: a chunk) so that the caller can let other work
        run in between. ``acc`` holds ``local``'s values (the reducer's own), or gets them from
        ``local_values``: scaled by our share in place; the sum starts from zero instead when
        there are none, or they are stale or not finite."""
        if self.loaded:
            return
        sender = None if self._local is None else self.senders.get(self._local)
        if sender is not None and sender.reason is None:
            values = self._acc_array
            source = self._local_values
            if source is None and values is not self._mean:  # float64 sum: ours are in acc
                source = self._mean
            step = max(1, step or self.chunk_elements)
            share = sender.share
            finite = True
            for i in range(0, self.length, step):
                piece = None if source is None else source[i : i + step]
                size = scale_magnitude(values[i : i + step], piece, share)  # NaN stays NaN
                finite = math.isfinite(size)
                if not finite:
                    break
                if share > 0:  # (with no share, our values do not enter the sum)
                    self._largest = max(self._largest, size / share)
                    self._settled = max(self._settled, size)
                if i + step < self.length:
                    yield
            if finite:
                sender.received[:] = b"\x01" * self.n_chunks
                sender.done = True
                self.loaded = True
                return
            sender.reason = DropReason.NONFINITE
        self._acc.zero_()
        self.loaded = True

    def add_chunk(
        self,
        peer_id: PeerID,
        index: int,
        epoch: int,
        weight: float,
        blob: bytes | memoryview,
        raw: bool = False,
    ) -> bool:
        """Decode and add one chunk; True when it completed the sender's part.

        ``blob`` is kept (not copied) until the part is complete: pass an owned buffer. It
        must be exactly the round codec's blob of the chunk (``raw``: the chunk's float32
        values without a codec header, only with the ``none`` codec). A chunk whose values
        dwarf the contributions settled so far is added when its sender completes (see
        ``SUBTRACT_FACTOR``).

        Raises:
            ChunkRejected: the chunk is refused and the sender was dropped for this part
                (its earlier chunks already subtracted).
            KeyError: ``peer_id`` is not an expected, pending sender (nothing changes).
            RuntimeError: before our own values were loaded (see :meth:`load_steps`).
        """
        if not self.loaded:
            raise RuntimeError("add_chunk before our own values were loaded (load_steps)")
        sender = self._expect(peer_id)
        try:
            self._check_header(peer_id, sender, index, epoch, weight, blob, raw)
            start, stop = chunk_span(self.length, self.chunk_elements, index)
            values = as_tensor(self._decode(blob, start, stop, raw))
            size = magnitude(values)  # NaN or infinity when it holds any
            if not math.isfinite(size):
                raise ChunkRejected(DropReason.NONFINITE, f"chunk {index} is not finite")
        except ChunkRejected as exc:
            self.drop(peer_id, exc.reason)
            raise
        self._largest = max(self._largest, size)
        scaled = sender.share * size
        sender.largest = max(sender.largest, scaled)
        added = scaled <= SUBTRACT_FACTOR * self._settled
        if added:  # else kept aside until the sender completes (see SUBTRACT_FACTOR)
            self._accumulate(start, values, sender.share)
        sender.received[index] = 1
        sender.retained.append((index, blob, raw, added))
        sender.retained_bytes += memoryview(blob).nbytes
        if all(sender.received):
            self._complete(sender)
            return True
        return False

    def _complete(self, sender: _Sender) -> None:
        """The sender's part is all in: add what was kept aside, forget the blobs."""
        for index, blob, raw, added in sender.retained:
            if not added:
                start, stop = chunk_span(self.length, self.chunk_elements, index)
                values = as_tensor(self._decode(blob, start, stop, raw))
                self._accumulate(start, values, sender.share)
        self._settled = max(self._settled, sender.largest)
        sender.done = True
        sender.retained.clear()
        sender.retained_bytes = 0

    def drop(self, peer_id: PeerID, reason: DropReason) -> None:
        """Exclude a pending sender from the part, subtracting what it already added."""
        sender = self.senders.get(peer_id)
        if sender is None or sender.done or sender.reason is not None or self.finalized:
            return
        sender.reason = reason
        for index, blob, raw, added in sender.retained:
            if not added:  # kept aside: never in the sum
                continue
            start, stop = chunk_span(self.length, self.chunk_elements, index)
            values = self._decode(blob, start, stop, raw)
            self._accumulate(start, as_tensor(values), -sender.share)
        sender.retained.clear()
        sender.retained_bytes = 0

    def finalize(
        self,
        reasons: Mapping[PeerID, DropReason],
        out: Float32Array | None = None,
        *,
        divide: bool = True,
    ) -> PartOutcome:
        """Drop every sender still pending (with ``reasons[p]``, default ``timeout``), then
        turn the sum into the mean, in place or (given ``out``, and only when there were
        contributions) into ``out``; see :meth:`mean`. With ``divide=False`` the division
        waits for :meth:`divide` (a chunk at a time, e.g. right before each is encoded, while
        it is in cache) or :meth:`divide_all`. A mean beyond what the codec can send back is
        no result: no contributors, weight 0, and a ``note`` naming the overflow.

        Raises:
            RuntimeError: before our own values were loaded (see :meth:`load_steps`).
        """
        if not self.loaded:
            raise RuntimeError("finalize before our own values were loaded (load_steps)")
        for peer_id in self.pending():
            self.drop(peer_id, reasons.get(peer_id, DropReason.TIMEOUT))
        self.finalized = True
        contributors = tuple(p for p, s in self.senders.items() if s.done and s.reason is None)
        dropped = tuple((p, s.reason) for p, s in self.senders.items() if s.reason is not None)
        weight = math.fsum(self.senders[p].weight for p in contributors)
        if weight > 0:
            self._share = math.fsum(self.senders[p].share for p in contributors)
            note = self._out_of_range()
            if note:
                return PartOutcome((), dropped, 0.0, note)
            if out is not None:
                self._mean = out
            self._undivided = set(range(self.n_chunks))
            if divide:
                self.divide_all()
        return PartOutcome(contributors, dropped, weight)

    def divide(self, index: int) -> None:
        """Turn chunk ``index`` of the sum into the mean (once; after ``finalize``)."""
        if index not in self._undivided:
            return
        self._undivided.discard(index)
        start, stop = chunk_span(self.length, self.chunk_elements, index)
        total = self._acc[start:stop]
        # the sum of shares * values; their sum is exactly 1 for equal weights of 2**k peers
        # (a float64 sum is rounded to float32 here, once)
        if self._mean is self._acc_array:
            if self._share != 1.0:
                total.div_(self._share)
        elif self._share != 1.0:
            torch.div(total, self._share, out=torch.from_numpy(self._mean[start:stop]))
        else:
            torch.from_numpy(self._mean[start:stop]).copy_(total)

    def divide_all(self) -> None:
        """Every chunk not divided yet (see :meth:`divide`)."""
        for index in sorted(self._undivided):
            self.divide(index)

    def mean(self) -> Float32Array:
        """The part's values after :meth:`finalize` (a view of ``acc``, or ``out``); with
        ``divide=False``, only the chunks divided so far."""
        return self._mean

    def _out_of_range(self) -> str:
        """Why the mean (the sum divided by ``_share``) exceeds what the codec can send
        back, or "" when it does not. Without a pass over the sum when the values added
        were well below that limit: the sum is then at most their largest magnitude, times
        the shares that counted, plus rounding (of the order of 2**-24 of it, for each sender
        added or subtracted, which the division by ``_share`` magnifies)."""
        if self._share < MIN_SHARE:
            return (
                f"the contributors' share of the weight ({self._share:.3g}) is too small to "
                "scale their sum back up in float32 (underflow)"
            )
        limit = result_limit(self.codec)
        if self._largest <= limit * min(0.5, self._share):
            return ""
        # values near the limit, or a sum scaled far back up: measure every element (the
        # division by the share, when there is one, rounds too)
        largest = limit if self._share == 1.0 else limit * self._share / (1 + 2**-20)
        for index in range(self.n_chunks):
            start, stop = chunk_span(self.length, self.chunk_elements, index)
            if not magnitude(self._acc[start:stop]) <= largest:  # NaN too
                return overflow_note(self.codec)
        return ""

    # -- helpers -------------------------------------------------------------------------

    def _accumulate(self, start: int, values: torch.Tensor, share: float) -> None:
        """``sum[start:start + len(values)] += share * values``: one fused multiply-add in
        float32; in float64, the product rounded first (in a small scratch, while in
        cache), as our own scaled values are, so that opposite contributions cancel
        exactly whatever the shares (a fused one left 2**-53 of them: a review)."""
        target = self._acc[start : start + len(values)]
        if self._product is None:
            target.add_(values, alpha=share)
            return
        for i in range(0, len(values), PIECE):
            piece = values[i : i + PIECE]
            product = self._product[: len(piece)]
            product.copy_(piece)
            product.mul_(share)
            target[i : i + len(piece)].add_(product)
