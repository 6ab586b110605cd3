"""A reducer's result (``Publishing``, a base class of
:class:`~.reducing.ReducerService`): the result header, once the part is final; the mean
encoded once, a chunk at a time, and written back into our tensor; topk's lossless
result blobs; and the result streams that serve the same header and blobs to every
member."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable

import numpy as np
import trio

from peer import RemoteError, Reply
from protocol.codecs import Codec, NonFiniteError, TopKCodec
from protocol.identity import PeerID

from .buffers import SharedBuffer
from .config import AveragerConfig
from .layout import Float32Array, Span, chunk_span
from .messages import ResultHeader
from .pieces import RangeCodec
from .plan import Plan
from .reducer import PartOutcome, PartReducer

logger = logging.getLogger("training.averaging.reducing")  # (the log names stay as they were)

_FLT_MAX = np.finfo(np.float32).max


class Publishing:
    """The result side of :class:`~.reducing.ReducerService`, one of its base classes (the
    attributes below are the service's)."""

    plan: Plan
    part: int
    span: Span
    codec: Codec
    ranges: RangeCodec
    config: AveragerConfig
    reducer: PartReducer
    target: Float32Array | None
    in_place: bool
    solo: bool
    raw: bool
    outcome: PartOutcome | None
    header: ResultHeader | None
    blobs: list[bytes | memoryview]
    publish_ended: bool
    raw_chunks: set[int]
    ready: trio.Event
    closed: bool
    downloaded: set[PeerID]
    last_download: float
    part_bytes: int
    _results: SharedBuffer
    _flat_span: Float32Array
    _mean_bytes: bytearray | None
    _changed: trio.Event
    # and one of its methods
    _notify: Callable[[], None]

    def _announce(self, outcome: PartOutcome) -> PartOutcome:
        """Fix the result header (who counted, how many chunks) and open the result streams;
        :meth:`publish` then encodes the chunks while they are being served."""
        chunks = 0
        if outcome.weight > 0:  # the mean fits the codec (finalize checked)
            # (topk's blobs are made before: see reduce)
            chunks = len(self.blobs) if isinstance(self.codec, TopKCodec) else self.reducer.n_chunks
        if outcome.note:  # refused before a chunk is served
            logger.warning("round %d: part %d: %s", self.plan.round, self.part, outcome.note)
        self.outcome = outcome
        # none: publish (or its cleanup) copies the whole mean into our tensor
        self.in_place = (
            self.raw and self.target is not None and outcome.weight > 0 and not self.solo
        )
        self.header = ResultHeader(
            outcome.contributors, outcome.dropped, outcome.weight, chunks, outcome.note
        )
        self.last_download = trio.current_time()
        self.ready.set()
        self._notify()  # (result streams wait on _changed: see results)
        return outcome

    async def publish(self) -> None:
        """Encode the mean a chunk at a time, each served as soon as it is encoded, with a
        checkpoint after each (our uploads and reads go on meanwhile); what the others
        decode is written back (into our tensor when ``target`` is set, else into the mean).
        Call after :meth:`reduce`.

        The blobs are slices of one buffer, reused next round once unreferenced. With the
        none codec it is where the mean formed (raw float32, no codec header), copied from
        there into our tensor: a result item may still sit in a slow member's outbox after
        our step returned and the caller changed its tensors, so the items must not be
        views of them.
        """
        assert self.header is not None
        chunks = self.header.chunks
        if not chunks or self.blobs:  # nothing to send, or topk (encoded whole)
            self.in_place = self.target is not None and chunks > 0 and not self.solo
            self.publish_ended = True
            return
        mean = self.reducer.mean()
        if self.raw:  # the mean itself is in the results' buffer (see __init__)
            assert self._mean_bytes is not None
            view = memoryview(self._mean_bytes)
            # it goes into our tensor, or the flat vector's span, from where it is stored
            out = mean if self.solo else self.target if self.target is not None else self._flat_span
        else:
            view = memoryview(self._results.get(self.part_bytes))
            out = mean if self.target is None or self.solo else self.target
        offset = 0
        written = 0  # elements of the mean decoded back into our tensor (``out``) so far
        try:
            for index in range(chunks):
                a, b = chunk_span(len(mean), self.config.chunk_elements, index)
                self.reducer.divide(index)
                if self.raw:
                    size = 4 * (b - a)
                    if out is not mean:
                        np.copyto(out[a:b], mean[a:b])
                        written = b
                else:
                    size = self._encode(mean[a:b], view[offset:], self.span[0] + a)
                    self.ranges.decode_into(
                        view[offset : offset + size], out[a:b], self.span[0] + a
                    )
                    written = b
                self.blobs.append(view[offset : offset + size])
                offset += size
                self._notify()
                await trio.lowlevel.checkpoint()
        finally:  # cancelled midway (the round's deadline): the streams stop waiting,
            self.reducer.divide_all()  # and the whole mean is there to be stored
            if self.raw and out is not mean:  # all of it, as when the division wrote it
                np.copyto(out[written:], mean[written:])
            elif written and out is not mean:
                # Our tensor lost its local values up to ``written``: it keeps the part.
                # Cut short, the rest gets the mean too (a caller that cancelled the step
                # stores nothing: a trial found 20-30 of 46 chunks averaged, the rest
                # not), and no member got the whole stream. After the last chunk, it holds
                # what every member decodes: the mean stored over it differed from theirs
                # by up to the codec's error (a review).
                np.copyto(out[written:], mean[written:])
                self.in_place = True
            self.publish_ended = True
            self._notify()
        self.in_place = self.in_place or (self.target is not None and not self.solo)

    def _encode(self, values: Float32Array, out: memoryview, start: int) -> int:
        """Encode one chunk of the mean, ``flat[start:start + len(values)]``. ``finalize``
        checked that the mean fits the codec, with a margin for rounding; should a value
        near FLT_MAX still round up to infinity, it is clamped back, for the codecs that
        refuse infinity."""
        try:
            return self.ranges.encode_into(values, out, start)
        except NonFiniteError:
            np.clip(values, -_FLT_MAX, _FLT_MAX, out=values)
            return self.ranges.encode_into(values, out, start)

    async def _sparse_results(self, mean: Float32Array) -> list[bytes | memoryview]:
        """topk: the mean of sparse contributions, sent without loss: every non-zero as a
        top-k blob, or, for a chunk more than half non-zero (where the blob would be the
        larger), the chunk's float32 values (``raw``). Keeping only the largest half there
        lost the rest of the mean, while the senders' error feedback counted it delivered
        (2 peers, fraction 1.0: 511 of 1024 values wrong, reported averaged). A chunk at a
        time, with checkpoints: the whole part in one go held the event loop ~0.6 s for a
        5.6M-element part, and steps ran past their timeout (an outside tester).

        Raises:
            NonFiniteError: the mean overflowed.
        """
        blobs: list[bytes | memoryview] = []
        self.raw_chunks = set()
        for index in range(self.reducer.n_chunks):
            a, b = chunk_span(len(mean), self.config.chunk_elements, index)
            nonzero = int(np.count_nonzero(mean[a:b]))
            if nonzero > (b - a) // 2:
                self.raw_chunks.add(index)
                if not np.isfinite(mean[a:b]).all():
                    raise NonFiniteError("the mean overflowed float32")
                blobs.append(mean[a:b].astype("<f4", copy=False).tobytes())
                continue
            codec = TopKCodec(max(1, nonzero), max_elements=self.codec.max_elements)
            blobs.append(codec.encode(mean[a:b]))
            await trio.lowlevel.checkpoint()
        return blobs

    # -- results out ---------------------------------------------------------------------

    def close(self) -> None:
        """Our step left the round: result streams still waiting for the header end at
        once (``not_found``, as for a member that asks after the step ended) instead of
        holding the member until its stall timeout. Streams under way go on."""
        self.closed = True
        self._notify()

    async def results(self, member: PeerID) -> AsyncGenerator[Reply, None]:
        """The result stream for ``member``: the header, then every blob as it is ready.

        Raises:
            RemoteError: ``not_found`` when our step left the round before the mean was
                ready (see :meth:`close`).
        """
        while not self.ready.is_set():
            if self.closed:
                raise RemoteError("not_found", f"round {self.plan.round} ended here first")
            await self._changed.wait()
        assert self.header is not None
        self.last_download = trio.current_time()
        yield Reply(self.header.to_body())
        for index in range(self.header.chunks):
            while len(self.blobs) <= index:
                if self.publish_ended:
                    raise RemoteError("unavailable", "the round ended before the result did")
                await self._changed.wait()
            raw = self.raw or index in self.raw_chunks
            body = {"chunk": index, "raw": True} if raw else {"chunk": index}
            yield Reply(body, self.blobs[index])
            self.last_download = trio.current_time()
        self.downloaded.add(member)
        self._notify()
