"""The reducer side of a round: take chunks in, decide who counts, serve the mean back.

    chunk RPCs --admission--> PartReducer (sum as they arrive)
    all senders complete or dropped, or the cutoff  ->  finalize: mean, encoded once
    result streams  <-  the same header and the same blobs for every member

Senders are admitted while the bytes kept for exact exclusion fit ``retain_budget`` (one
sender always fits), first come first served. An admitted sender that delivers nothing for
``stall_timeout`` is pinged: no answer, dropped as frozen; connection refused, as dead.
While others wait for admission, an admitted sender must keep the pace that completes its
part by the cutoff (with a chunk to spare): having ``r`` of ``n`` chunks in, it is dropped
as ``timeout`` once ``(r + 1) / n`` of the time from its admission to the cutoff has passed.
One that would miss the cutoff anyway gives its slot up early; one that sent a chunk and
then only answered pings held the slot until the cutoff, and every sender queued behind it
was dropped.
"""

from __future__ import annotations

import math

import numpy as np
import trio

from protocol.codecs import Codec, NoneCodec, NonFiniteError, TopKCodec
from protocol.identity import PeerID

from .admission import Admission
from .buffers import SharedBuffer
from .config import AveragerConfig, default_retain_budget
from .layout import FlatVector, Float32Array, Span, chunk_span
from .messages import ResultHeader
from .pieces import RangeCodec
from .plan import Liveness, Plan
from .publishing import Publishing
from .reducer import (
    DropReason,
    Member,
    PartOutcome,
    PartReducer,
    effective_weights,
    wide_sum_wanted,
)
from .scans import overflow_note


class ReducerService(Admission, Publishing):
    """Reduces this peer's part of one round."""

    def __init__(
        self,
        plan: Plan,
        part: int,
        flat: FlatVector,
        codec: Codec,
        config: AveragerConfig,
        liveness: Liveness,
        scratch: Float32Array,
        results: SharedBuffer | None = None,
        wide: SharedBuffer | None = None,
    ) -> None:
        self.plan = plan
        self.part = part
        self.span = plan.spans[part]
        self.flat = flat
        self.codec = codec
        self.ranges = RangeCodec(codec, flat.offsets)  # int8: a blob per tensor of a chunk
        self.config = config
        self.liveness = liveness
        self._results = results or SharedBuffer()
        start, stop = self.span
        length = stop - start
        members = [Member(m.peer_id, m.weight, m.epoch) for m in plan.members]
        # When one float32 tensor holds our span, our values are loaded from it as the sum
        # starts, and the mean goes straight back into it (no copy afterwards: ``in_place``).
        self.target = None if isinstance(codec, TopKCodec) else flat.view(start, stop)
        self.in_place = False
        # Only our own values count in the part (every other sender dropped): that is no
        # group result for us, and our tensor keeps its values (members that fetch the
        # part still get them: the mean over its one contributor).
        self.solo = False
        # The sum builds up in place, in our own span of the flat vector (it holds our values;
        # the tensors keep them too, for when the round fails), or in float64 beside it
        # (``none`` with three senders or more: see wide_sum_wanted); with ``none`` (below)
        # in the results' buffer instead.
        wide_sum = None
        weights = effective_weights(members, config.max_staleness, config.staleness_decay)
        if wide_sum_wanted(codec, weights, plan.me):
            wide_sum = np.frombuffer((wide or SharedBuffer()).get(8 * length), np.float64, length)
        self.raw = isinstance(codec, NoneCodec)  # results are raw views of the mean
        # none: the mean forms in the buffer the results are served from (their blobs are
        # views of it, no copy), and goes from there into our tensor
        acc = self._flat_span = flat.array[start:stop]
        local_values = self.target  # None: ours are in the flat vector (copied in by load)
        self._mean_bytes: bytearray | None = None
        if self.raw:
            self._mean_bytes = self._results.get(4 * length)
            acc = np.frombuffer(self._mean_bytes, np.float32, length)
            if local_values is None:  # (not where the sum builds up any more)
                local_values = self._flat_span
        self.reducer = PartReducer(
            length=length,
            chunk_elements=config.chunk_elements,
            codec=codec,
            ranges=self.ranges,
            base=start,
            members=members,
            senders=[m.peer_id for m in members],
            max_staleness=config.max_staleness,
            decay=config.staleness_decay,
            acc=acc,
            scratch=scratch,
            local=plan.me,
            local_values=local_values,
            defer_load=True,  # see load(): after our uploads are under way
            wide=wide_sum,
        )
        # spans of several tensors (or other dtypes) are copied into the flat vector first;
        # topk: the averager already put our sparsified values there
        self._copy_in = self.target is None and not isinstance(codec, TopKCodec)
        self.loaded = trio.Event()
        chunks = self.reducer.n_chunks
        self.part_bytes = sum(
            self.ranges.encoded_size(*_shifted(chunk_span(length, config.chunk_elements, i), start))
            for i in range(chunks)
        )
        budget = config.retain_budget
        self.budget = default_retain_budget(flat.array.nbytes) if budget is None else budget
        self.start = trio.current_time()
        self.progress: dict[PeerID, list[float]] = {}
        self._admitted: set[PeerID] = set()
        self._admitted_at: dict[PeerID, float] = {}
        self._loaded_at = math.inf  # when our own values were in (chunks wait for them)
        self.cutoff = math.inf  # set by reduce()
        self._released: set[PeerID] = set()
        self._queue: list[PeerID] = []
        self._waiters: dict[PeerID, int] = {}
        # a chunk's call while it waits (admission, our load): its scope, and an event set
        # when it is over (see _supersede)
        self._waiting_calls: dict[tuple[PeerID, int], tuple[trio.CancelScope, trio.Event]] = {}
        self._retries: set[tuple[PeerID, int]] = set()  # chunks a retry call came for
        self._reserved = 0
        self._changed = trio.Event()
        self.outcome: PartOutcome | None = None
        self.header: ResultHeader | None = None
        self.blobs: list[bytes | memoryview] = []
        self.publish_ended = False  # publish() returned or was cancelled: no more blobs
        self.raw_chunks: set[int] = set()  # topk: result chunks sent dense (raw float32)
        self.ready = trio.Event()
        self.closed = False  # our step left the round (see close)
        self.cut: set[PeerID] = set()  # senders dropped by our cutoff (see reduce)
        self.downloaded: set[PeerID] = set()
        self.last_download = trio.current_time()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def load(self) -> None:
        """Load and check our own values of the part, a chunk at a time with checkpoints in
        between (so that the uploads, started first, keep the link busy meanwhile); chunks
        from others wait for it."""
        try:
            if self._copy_in:
                self.flat.load_span(self.span)
            for _ in self.reducer.load_steps():
                await trio.lowlevel.checkpoint()
        finally:  # cancelled (the round is over): waiting chunks are refused
            self._loaded_at = trio.current_time()
            self.loaded.set()
            self._notify()

    # -- the reduction -------------------------------------------------------------------

    async def reduce(self, cutoff: float) -> PartOutcome:
        """Reduce until every sender is in or out (or ``cutoff``), then publish the mean
        (and write it into our own flat vector). Call :meth:`load` first."""
        await self.loaded.wait()
        self.cutoff = cutoff
        with trio.move_on_at(cutoff):
            while self.reducer.pending():
                self._drop_known_bad()
                if self.reducer.pending():
                    await self._watch_once()
        reasons = {p: self.liveness.bad.get(p, DropReason.TIMEOUT) for p in self.reducer.pending()}
        # still sending when our cutoff came (the step's timeout, less the result's share)
        self.cut = {p for p in self.reducer.pending() if p not in self.liveness.bad}
        self.solo = self.reducer.complete_senders() == [self.plan.me]
        # the division runs chunk by chunk in publish(), right before each is encoded
        outcome = self.reducer.finalize(reasons, divide=False)
        for sender in list(self._admitted):
            self._release(sender)
        if isinstance(self.codec, TopKCodec) and outcome.weight > 0:
            self.reducer.divide_all()
            try:
                self.blobs = await self._sparse_results(self.reducer.mean())
            except NonFiniteError:
                outcome = PartOutcome((), outcome.dropped, 0.0, overflow_note(self.codec))
        return self._announce(outcome)

    async def serve(self) -> None:
        """Serve the mean until every member fetched it, or downloads stall (the caller
        bounds it by the round's deadline). Call :meth:`publish` first."""
        expected = {m.peer_id for m in self.plan.members} - {self.plan.me}
        if self.header is None:
            return
        # A header without chunks (an empty part, or no result) is served until fetched
        # too: a member that fetches its parts one at a time (max_downloads=1) found our
        # step ended and reported us dead, while the others reported the part "all".
        stall = self.config.stall_timeout
        # extensions for members that have not fetched yet but answer (below): as many as
        # a member with one download slot (max_downloads is each member's own setting)
        # could need to come to our part, no more (one that never fetches, hostile or
        # having given up on the part, held every reducer's step to its deadline, and a
        # cap by our own max_downloads cut off a member with fewer slots: two reviews)
        extensions = len(self.plan.reducers)
        while True:
            fetching = expected - self.downloaded
            due = self.liveness.mark_gone_clients(p for p in fetching if self._heard_from(p))
            unconnected = self.liveness.unconnected_servers(
                p for p in fetching if self._heard_from(p)
            )
            if unconnected:  # perhaps killed: a dead one's dial is refused
                async with trio.open_nursery() as nursery:
                    for peer_id in unconnected:
                        nursery.start_soon(self.liveness.probe, peer_id)
            gone = {p for p in expected if p in self.liveness.bad}
            if expected <= self.downloaded | gone:
                return
            if trio.current_time() >= self.last_download + stall:
                # No download for a stall timeout: serve on while a member that has not
                # fetched the result answers that it is in the round (a slow member whose
                # one download slot other parts held asked after we stopped, and lost the
                # part, reporting us dead: a review); stop once none does.
                if extensions <= 0:
                    return
                extensions -= 1
                async with trio.open_nursery() as nursery:
                    for peer_id in fetching - gone:
                        nursery.start_soon(self.liveness.probe, peer_id)
                if not fetching - set(self.liveness.bad):
                    return
                self.last_download = trio.current_time()
                continue
            # a member found dead meanwhile (by our own upload or download to it, or a
            # client whose connection ended) will not fetch: wake for that too
            with trio.move_on_at(min(self.last_download + stall, due)):
                await self._wait_for_news()

    def _drop_known_bad(self) -> None:
        for peer_id in self.reducer.pending():
            reason = self.liveness.bad.get(peer_id)
            if reason is not None:
                self._drop(peer_id, reason)

    async def _watch_once(self) -> None:
        """Wait for a change; probe senders that stalled (admitted and quiet, or silent)."""
        stall = self.config.stall_timeout
        now = trio.current_time()
        slot_ends = self._slot_ends()
        overdue = [p for p, end in slot_ends.items() if end <= now]
        if overdue:  # others wait for the slot it will not use in time
            for peer_id in overdue:
                self._drop(peer_id, DropReason.TIMEOUT)
            return
        pending = self.reducer.pending()
        due = self.liveness.mark_gone_clients(p for p in pending if self._heard_from(p))
        unconnected = self.liveness.unconnected_servers(p for p in pending if self._heard_from(p))
        if unconnected:  # perhaps killed (see serve)
            async with trio.open_nursery() as nursery:
                for peer_id in unconnected:
                    nursery.start_soon(self._probe, peer_id)
            return
        if any(p in self.liveness.bad for p in pending):
            return  # the caller drops them
        # senders waiting for admission are waiting on us, not stalled
        watched = [p for p in self.reducer.pending() if p not in self._queue]
        deadlines = {p: self.progress.get(p, [self.start])[0] + stall for p in watched}
        stalled = [p for p, at in deadlines.items() if at <= now]
        if stalled:
            async with trio.open_nursery() as nursery:
                for peer_id in stalled:
                    nursery.start_soon(self._probe, peer_id)
            return
        next_check = min([*deadlines.values(), *slot_ends.values(), due])
        with trio.move_on_at(next_check):
            await self._wait_for_news()

    def _heard_from(self, peer_id: PeerID) -> bool:
        """Whether ``peer_id`` sent us chunks this round, or had a connection to us that its
        side ended since the round began: a client killed while its first chunk calls were
        on their way (it cannot be pinged) is then found gone after the grace of
        ``Liveness.mark_gone_clients``, not when it has been quiet for a stall timeout."""
        return peer_id in self.progress or self.liveness.node.rpc.lost_at(peer_id) >= self.start

    async def _wait_for_news(self) -> None:
        """Until a chunk or a download came, a member was found bad, or a connection ended
        (a client-mode sender we heard from, see :meth:`_heard_from`, with no connection left
        is dead soon after: it cannot be probed sooner, see ``Liveness.mark_gone_clients``)."""
        events = (self._changed, self.liveness.changed, self.liveness.node.rpc.disconnected)
        async with trio.open_nursery() as nursery:
            for event in events:
                nursery.start_soon(_wait_then_cancel, event, nursery.cancel_scope)

    def _slot_ends(self) -> dict[PeerID, float]:
        """While senders wait for admission: when each admitted, pending sender falls behind
        the pace that completes its part by the cutoff (a chunk to spare), see the module's
        docstring."""
        if not self._queue:
            return {}
        ends = {}
        chunks = max(1, self.reducer.n_chunks)
        for peer_id in self.reducer.pending():
            admitted = self._admitted_at.get(peer_id)
            if admitted is not None and peer_id not in self._released:
                # The pace counts from when its chunks could be taken: admitted while we
                # still loaded our own part (358 MB took ~1 s), a sender was dropped as
                # `timeout` with none of its chunks read (a trial at 1 GiB, 3 peers).
                start = max(admitted, self._loaded_at)
                if start >= self.cutoff:
                    continue
                pace = min(1.0, (self.reducer.received_chunks(peer_id) + 1) / chunks)
                ends[peer_id] = start + (self.cutoff - start) * pace
        return ends

    async def _probe(self, peer_id: PeerID) -> None:
        reason = await self.liveness.probe(peer_id)
        if reason is None:  # due again a stall timeout after it was last heard
            progress = self.progress.setdefault(peer_id, [0.0])
            progress[0] = max(progress[0], self.liveness.alive_at(peer_id))
        elif self.reducer.is_pending(peer_id):
            self._drop(peer_id, reason)


def _shifted(span: Span, by: int) -> Span:
    return span[0] + by, span[1] + by


async def _wait_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
