"""The checks a chunk passes before it counts (``ChunkChecks``, a base class of
:class:`~.reducer.PartReducer`): its sender is expected and pending, its header carries
the epoch and weight the sender declared and an index not seen yet, its payload is
exactly the round codec's blob of the chunk and decodes to that many values; a retry's
resend of the same bytes is told apart from a repeat. See reducer.py's rules."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from protocol.codecs import Codec, NoneCodec
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.identity import PeerID

from .layout import Float32Array, chunk_span
from .pieces import RangeCodec
from .senders import ChunkRejected, DropReason, Member, _Sender


class ChunkChecks:
    """The chunk checks of :class:`~.reducer.PartReducer`, one of its base classes (the
    attributes below are the reducer's)."""

    length: int
    chunk_elements: int
    n_chunks: int
    codec: Codec
    ranges: RangeCodec
    base: int
    members: dict[PeerID, Member]
    senders: dict[PeerID, _Sender]
    finalized: bool
    _scratch: Float32Array
    _blob_sizes: dict[int, int]
    # and one of its methods
    drop: Callable[[PeerID, DropReason], None]

    def is_resend(
        self, peer_id: PeerID, index: int, blob: bytes | memoryview, raw: bool = False
    ) -> bool:
        """Whether a pending sender's chunk ``index`` already arrived with exactly these
        bytes. For a call the sender marks as retried (its connection broke before the
        answer came back) that chunk is acknowledged again and changes nothing; any other
        repeat of a chunk is garbage."""
        sender = self.senders.get(peer_id)
        if sender is None or sender.done or sender.reason is not None or self.finalized:
            return False
        if not 0 <= index < self.n_chunks or not sender.received[index]:
            return False
        for kept_index, kept, kept_raw, _added in sender.retained:
            if kept_index == index:
                return kept_raw == raw and memoryview(kept).cast("B") == memoryview(blob).cast("B")
        return False

    def check_chunk(
        self,
        peer_id: PeerID,
        index: int,
        epoch: int,
        weight: float,
        blob: bytes | memoryview,
        raw: bool = False,
    ) -> None:
        """What :meth:`add_chunk` checks before decoding (a cheap look at the header and the
        payload's size), e.g. before a call waits for admission; drops the sender on failure.
        The chunk is then expected (a second one with the same index is refused) until
        :meth:`add_chunk` or :meth:`forget_chunk`.

        Raises:
            ChunkRejected: as :meth:`add_chunk` (the sender was dropped for this part).
            KeyError: ``peer_id`` is not an expected, pending sender (nothing changes).
        """
        sender = self._expect(peer_id)
        try:
            if index in sender.waiting:
                raise ChunkRejected(DropReason.GARBAGE, f"chunk {index} sent twice")
            self._check_header(peer_id, sender, index, epoch, weight, blob, raw)
        except ChunkRejected as exc:
            self.drop(peer_id, exc.reason)
            raise
        sender.waiting.add(index)

    def forget_chunk(self, peer_id: PeerID, index: int) -> None:
        """The call that :meth:`check_chunk` let wait is over."""
        sender = self.senders.get(peer_id)
        if sender is not None:
            sender.waiting.discard(index)

    def _check_header(
        self,
        peer_id: PeerID,
        sender: _Sender,
        index: int,
        epoch: int,
        weight: float,
        blob: bytes | memoryview,
        raw: bool,
    ) -> None:
        member = self.members[peer_id]
        if epoch != member.epoch or weight != member.weight:
            raise ChunkRejected(DropReason.GARBAGE, "epoch or weight differ from declared")
        if not 0 <= index < self.n_chunks:
            raise ChunkRejected(DropReason.GARBAGE, f"chunk {index} out of range")
        if sender.received[index]:  # (the same bytes again are a retry: see is_resend)
            raise ChunkRejected(DropReason.GARBAGE, f"chunk {index} sent twice")
        start, stop = chunk_span(self.length, self.chunk_elements, index)
        expected = 4 * (stop - start) if raw else self._blob_size(start, stop)
        size = memoryview(blob).nbytes
        if size != expected:  # (the kept bytes stay what admission counted)
            raise ChunkRejected(
                DropReason.GARBAGE, f"chunk {index} of {size} bytes, not {expected}"
            )

    def _blob_size(self, start: int, stop: int) -> int:
        """Bytes of the round codec's payload of the part's ``[start, stop)``."""
        if self.ranges.cuts:  # the size depends on where the chunk lies
            return self.ranges.encoded_size(self.base + start, self.base + stop)
        size = self._blob_sizes.get(stop - start)
        if size is None:
            size = self._blob_sizes[stop - start] = self.codec.encoded_size(stop - start)
        return size

    def _expect(self, peer_id: PeerID) -> _Sender:
        sender = self.senders.get(peer_id)
        if sender is None or sender.done or sender.reason is not None or self.finalized:
            raise KeyError(peer_id)
        return sender

    def _decode(
        self, blob: bytes | memoryview, start: int, stop: int, raw: bool = False
    ) -> Float32Array:
        """The values of the part's chunk ``[start, stop)`` from its payload.

        Raises:
            ChunkRejected: (garbage) undecodable, or not the chunk's size.
        """
        count = stop - start
        try:
            if raw and self.codec.name != "none":
                raise ChunkRejected(DropReason.GARBAGE, "raw values need the none codec")
            if raw or isinstance(self.codec, NoneCodec):
                values = decode_raw(blob, count) if raw else self.codec.decode(blob).reshape(-1)
                if values.size != count:
                    raise ChunkRejected(DropReason.GARBAGE, f"{values.size} values, not {count}")
                return values
            return self.ranges.decode_into(blob, self._scratch[:count], self.base + start)
        except ProtocolError as exc:
            raise ChunkRejected(DropReason.GARBAGE, str(exc)) from None


def decode_raw(payload: bytes | memoryview, count: int) -> Float32Array:
    """A read-only float32 view of a raw payload (``count`` values, little-endian).

    Raises:
        RemoteProtocolError: if the payload is not exactly ``4 * count`` bytes.
    """
    if memoryview(payload).nbytes != 4 * count:
        raise RemoteProtocolError(
            f"raw payload of {memoryview(payload).nbytes} bytes, not {count} values"
        )
    values: Float32Array = np.frombuffer(payload, dtype="<f4", count=count)
    return values
