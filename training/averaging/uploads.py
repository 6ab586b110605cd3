"""A member's uploads (``Uploads``, a base class of :class:`~.butterfly.Butterfly`): our
values of each remote part, encoded a chunk at a time with several calls in flight, sent
again after a reset connection and, backing off, after ``busy``; a withdrawal from a part
whose values NaN or infinity keep from being encoded; and, after a step cut short, the
"we left" notes to the reducers. The round itself is butterfly.py's."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import trio

from peer import Peer, PeerUnavailableError, RemoteError
from protocol.address import Address
from protocol.codecs import Codec, NoneCodec, NonFiniteError

from .buffers import BufferPool
from .config import AveragerConfig
from .feedback import ErrorFeedback
from .layout import FlatVector, chunk_count, chunk_span
from .messages import ChunkHeader
from .pieces import RangeCodec
from .plan import Liveness, Plan
from .reducer import DropReason

logger = logging.getLogger("training.averaging.butterfly")  # (the log names stay as they were)

WITHDRAW_BOUND = 2.0
"""Seconds a step cut short gives its "we left" notes to the reducers (after it returned)."""

_BUSY_BACKOFF, _BUSY_BACKOFF_MAX = 0.02, 0.5
"""Seconds before a chunk refused as ``busy`` (the reducer parks no more early chunks)
goes again, doubling up to the maximum."""


class Uploads:
    """The uploads of :class:`~.butterfly.Butterfly`, one of its base classes (the
    attributes below are the round's)."""

    node: Peer
    plan: Plan
    flat: FlatVector
    codec: Codec
    ranges: RangeCodec
    config: AveragerConfig
    methods: str
    liveness: Liveness
    pool: BufferPool
    feedback: ErrorFeedback | None
    per_part_inflight: int
    _encoding: dict[int, trio.CancelScope]

    async def _upload(self, index: int, address: Address, encoded: trio.Event) -> None:
        """Send our values of part ``index``; stops early when the reducer is gone or has
        dropped us (what it did with them, its result header will say), and encodes no
        more chunks once the header came. Sets ``encoded`` once the flat vector's span is
        no longer read (blobs are copies, or views of tensors)."""
        try:
            await self._send_part(index, address, encoded)
        finally:
            encoded.set()

    async def _withdraw(self, parts: list[int]) -> None:
        """Tell the reducers of ``parts`` that we left the round midway (our step's deadline,
        or a cancellation, cut our upload or download short): each drops what it has of
        ours (``timeout``; a whole contribution stands) and serves us no result, at once,
        instead of waiting ``stall_timeout`` for chunks that will not come and a download
        that will not start (a member whose own timeout ended mid-upload cost the others
        5 s of a 0.15 s round: an outside tester). Runs after our step returned, best
        effort, for ``WITHDRAW_BOUND``."""
        me = self.plan.member(self.plan.me)
        if me is None:
            return
        with trio.move_on_after(WITHDRAW_BOUND):
            async with trio.open_nursery() as nursery:
                for index in parts:
                    header = ChunkHeader(
                        self.plan.round, index, 0, me.epoch, me.weight,
                        abort=DropReason.TIMEOUT, group_id=self.plan.group_id,
                    )  # fmt: skip
                    nursery.start_soon(self._tell, index, header.to_body())

    async def _tell(self, index: int, body: dict[str, object]) -> None:
        address = self.plan.address(self.plan.reducers[index].peer_id)
        assert address is not None
        try:
            await self.node.rpc.call(address, f"{self.methods}.chunk", body, memoryview(b""))
        except (PeerUnavailableError, RemoteError) as exc:  # gone, done, or it dropped us
            logger.debug("round %d: withdrawal from part %d: %s", self.plan.round, index, exc)

    async def _send_part(self, index: int, address: Address, encoded: trio.Event) -> None:
        reducer = self.plan.reducers[index].peer_id
        start, stop = self.plan.spans[index]
        length = stop - start
        me = self.plan.member(self.plan.me)
        assert me is not None
        progress = [trio.current_time()]
        slots = trio.Semaphore(self.per_part_inflight)
        zero_copy = isinstance(self.codec, NoneCodec)
        pool = self.pool

        async def send(
            body: dict[str, object], buffer: bytearray | None, payload: memoryview,
            scope: trio.CancelScope,
        ) -> None:  # fmt: skip
            answered = False
            backoff = _BUSY_BACKOFF
            try:
                while True:  # again after a reset connection (the same bytes: see reducer)
                    try:
                        await self.node.rpc.call(address, f"{self.methods}.chunk", body, payload)
                    except PeerUnavailableError:
                        if await self.liveness.reconnect(reducer):
                            body = {**body, "retry": True}
                            continue
                        scope.cancel()
                        break
                    except RemoteError as exc:
                        if exc.code == "busy":
                            # Its group is not confirmed yet and it parks no more early
                            # chunks (others', maybe a stranger's, fill the room): that
                            # passes once it is. The liveness watch and the step's
                            # deadline bound the retries.
                            await trio.sleep(backoff)
                            backoff = min(2 * backoff, _BUSY_BACKOFF_MAX)
                            continue
                        answered = True
                        logger.debug("round %d: part %d refused: %s", self.plan.round, index, exc)
                        scope.cancel()
                        break
                    answered = True
                    progress[0] = trio.current_time()
                    break
            finally:
                if answered and buffer is not None:  # the peer read it all: free again
                    pool.give(buffer)
                slots.release()

        async with trio.open_nursery() as outer:
            stall = self.config.stall_timeout
            outer.start_soon(self.liveness.watch, reducer, progress, stall, outer.cancel_scope)
            async with trio.open_nursery() as senders:
                with self._encoding[index]:  # cancelled by the result header
                    for chunk in range(chunk_count(length, self.config.chunk_elements)):
                        a, b = chunk_span(length, self.config.chunk_elements, chunk)
                        if self.feedback is None:
                            values = self.flat.source(start + a, start + b)
                        else:
                            values = self.flat.array[start + a : start + b]
                        # the none codec sends a tensor's values as they are (no copy), unless
                        # they sit in the flat vector, which results overwrite. NaN/Inf: int8
                        # and topk refuse to encode them (we withdraw); none and float16 carry
                        # them, and the reducer, which checks every chunk anyway, drops us.
                        raw = zero_copy and not np.may_share_memory(values, self.flat.array)
                        header = ChunkHeader(
                            self.plan.round, index, chunk, me.epoch, me.weight, raw=raw,
                            group_id=self.plan.group_id,
                        )  # fmt: skip
                        await slots.acquire()  # released by send() when its call is over
                        size = 0 if raw else self.ranges.encoded_size(start + a, start + b)
                        buffer = None if raw else pool.take(size)
                        try:
                            if buffer is None:
                                payload = memoryview(values).cast("B")  # type: ignore[arg-type]
                            else:
                                size = self.ranges.encode_into(values, buffer, start + a)
                                payload = memoryview(buffer)[:size]
                        except NonFiniteError:  # withdraw from the part instead
                            if buffer is not None:
                                pool.give(buffer)
                            body = replace(header, abort=DropReason.NONFINITE).to_body()
                            senders.start_soon(
                                send, body, None, memoryview(b""), senders.cancel_scope
                            )
                            break
                        if self.feedback is not None:
                            self.feedback.record(index, start + a, bytes(payload))
                        senders.start_soon(
                            send, header.to_body(), buffer, payload, senders.cancel_scope
                        )
                encoded.set()
            outer.cancel_scope.cancel()
