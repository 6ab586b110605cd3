"""One butterfly all-reduce round, the member side: send every part, fetch every mean.

    for each part j (reduced by member j), concurrently:
        upload:   chunks of flat[span j], encoded, several calls in flight -> member j
        download: member j's result stream -> decoded straight into flat[span j]
                  (into one float32 tensor: into the tensor itself)
    our own part: a ReducerService (see reducing) runs beside them

A part whose upload failed is still downloaded (the reducer averaged the others). Its
result header stops the encoding of our remaining chunks of the part (it is final), so
that the results are read while our last calls wait for their answers: both ways share
one connection, whose reader stops behind 32 unread result items; once the download has
ended, those calls are cancelled (their answers change nothing). A part
whose download did not complete keeps our local values: ``FlatVector.store`` copies back
into the tensors only the spans that were fully received, and a part decoded into its
tensor as it came gets its local values back from flat[span j], where each chunk's were
kept before it was overwritten; so the tensors are exactly what the report says.
Everything ends by the round's deadline.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import numpy as np
import trio

from peer import Peer, PeerUnavailableError, RemoteError
from protocol.address import Address
from protocol.codecs import Codec, Float16Codec, Int8Codec, NoneCodec, NonFiniteError
from protocol.errors import ProtocolError, RemoteProtocolError

from .buffers import BufferPool
from .config import AveragerConfig
from .feedback import ErrorFeedback
from .layout import FlatVector, Float32Array, chunk_count, chunk_span
from .messages import ChunkHeader, ResultHeader, raw_flag
from .pieces import RangeCodec
from .plan import Liveness, Plan
from .reducer import DropReason, decode_raw
from .reducing import ReducerService
from .report import PartReport, part_status
from .scans import all_finite, copy_finite

logger = logging.getLogger(__name__)

SOLO_NOTE = "only our own values reached this part: nothing to average them with"

WITHDRAW_BOUND = 2.0
"""Seconds a step cut short gives its "we left" notes to the reducers (after it returned)."""

_BUSY_BACKOFF, _BUSY_BACKOFF_MAX = 0.02, 0.5
"""Seconds before a chunk refused as ``busy`` (the reducer parks no more early chunks)
goes again, doubling up to the maximum."""


class Butterfly:
    """Runs one round for this member (its reducer, if any, is ``self.service``)."""

    def __init__(
        self,
        node: Peer,
        plan: Plan,
        flat: FlatVector,
        codec: Codec,
        config: AveragerConfig,
        methods: str,
        service: ReducerService | None,
        liveness: Liveness,
        zeros: Float32Array,
        pool: BufferPool,
        feedback: ErrorFeedback | None = None,
    ) -> None:
        self.node = node
        self.plan = plan
        self.flat = flat
        self.codec = codec
        self.ranges = RangeCodec(codec, flat.offsets)  # int8: a blob per tensor of a chunk
        self.config = config
        self.methods = methods
        self.service = service
        self.liveness = liveness
        self._zeros = zeros
        self.pool = pool
        self.feedback = feedback  # topk: we send flat (values + residual) and note the blobs
        self.reports: dict[int, PartReport] = {}
        self.counted: set[int] = set()  # parts whose result header lists us (error feedback)
        self._fetched: dict[int, list[ResultHeader]] = {}  # part -> its header, once it came
        # parts decoded into their tensor as they came: elements done (see _fetch)
        self.in_tensor: dict[int, int] = {}
        # per part: cancelled by the result header, it ends the encoding of our chunks
        self._encoding: dict[int, trio.CancelScope] = {}
        remote = max(1, len(plan.reducers) - (service is not None))
        self.per_part_inflight = max(1, math.ceil(config.max_inflight / remote))
        self._downloads = trio.Semaphore(config.max_downloads)
        # remote parts whose exchange (upload and download) ended by itself: the others
        # were cut short by our deadline or a cancellation (see _withdraw)
        self._exchanged: set[int] = set()
        self.cut_by_deadline = 0  # parts whose report our step's deadline cut short

    async def run(self, cutoff: float, deadline: float) -> tuple[PartReport, ...]:
        try:
            with trio.move_on_at(deadline):
                async with trio.open_nursery() as nursery:
                    for index, reducer in enumerate(self.plan.reducers):
                        if reducer.peer_id != self.plan.me:
                            nursery.start_soon(self._exchange, index)
                    if self.service is not None:  # it loads our part while uploads start
                        nursery.start_soon(self._reduce, cutoff)
            for index, reducer in enumerate(self.plan.reducers):
                if index in self.reports:
                    continue
                self.cut_by_deadline += 1
                if reducer.peer_id == self.plan.me:
                    note = "the deadline passed before our own reduction finished"
                else:  # frozen, or too slow: out of this part either way
                    self.liveness.mark(reducer.peer_id, DropReason.TIMEOUT)
                    note = "the deadline passed before the reducer's result arrived"
                fetched = self._fetched.get(index)
                header = fetched[0] if fetched else None
                self.reports[index] = self._report(index, header, False, note)
            return tuple(self.reports[i] for i in range(len(self.plan.reducers)))
        finally:
            cut = [
                i for i, r in enumerate(self.plan.reducers)
                if r.peer_id != self.plan.me and i not in self._exchanged
                and self.liveness.bad.get(r.peer_id) is not DropReason.DEAD
            ]  # fmt: skip
            if cut:
                self.node.start_background(self._withdraw, cut, name="withdraw")
            # a part whose whole result came, then the deadline (or a cancellation) cut
            # its report short, does not count: its tensor gets our values back too
            for index in list(self.in_tensor):
                report = self.reports.get(index)
                if report is None or not report.received:
                    self._restore(index)

    def _report(
        self, index: int, header: ResultHeader | None, received: bool, note: str = ""
    ) -> PartReport:
        reducer = self.plan.reducers[index].peer_id
        counted = header is not None and self.plan.me in header.contributors
        if counted:
            self.counted.add(index)
        # no result received: nobody's values are in ours (the header's drops still explain)
        contributors = header.contributors if header is not None and received else ()
        dropped = dict(header.dropped) if header is not None else {}
        if not received and reducer in self.liveness.bad:
            dropped.setdefault(reducer, self.liveness.bad[reducer])
        return PartReport(
            index=index,
            reducer=reducer,
            span=self.plan.spans[index],
            status=part_status(self.plan.group, contributors, received),
            contributors=contributors,
            dropped=dropped,
            received=received,
            weight=header.weight if header is not None and received else 0.0,
            note="" if received else note,
            counted=counted,
        )

    async def _reduce(self, cutoff: float) -> None:
        assert self.service is not None
        part = self.service.part
        await self.service.load()
        outcome = await self.service.reduce(cutoff)
        received = outcome.weight > 0 and not self.service.solo
        note = outcome.note or "no contributions"
        if self.service.solo and not outcome.note:  # (an overflow's note says more)
            note = SOLO_NOTE
        self.reports[part] = self._report(part, self.service.header, received, note)
        await self.service.publish()
        await self.service.serve()

    # -- one remote part -----------------------------------------------------------------

    async def _exchange(self, index: int) -> None:
        reducer = self.plan.reducers[index]
        address = self.plan.address(reducer.peer_id)
        assert address is not None
        encoded = trio.Event()  # our values of the part are all encoded: results may land
        self._encoding[index] = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            if self.plan.weights[self.plan.me] is not None:
                nursery.start_soon(self._upload, index, address, encoded)
            else:
                encoded.set()
            header, received, note = await self._download(index, address, encoded)
            if header is not None:
                # The part is final: our chunk calls still under way change nothing (the
                # reducer refuses them), so they are not waited for. A member with a slow
                # uplink that reduces a part too had its last calls queued behind its own
                # result stream, and its step waited for them until its deadline.
                nursery.cancel_scope.cancel()
        self.reports[index] = self._report(index, header, received, note)
        self._exchanged.add(index)  # not reached when the deadline cut it short

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

    async def _download(
        self, index: int, address: Address, encoded: trio.Event
    ) -> tuple[ResultHeader | None, bool, str]:
        """Fetch the mean of part ``index`` into the flat vector (once ``encoded``); from
        the start again after a reset connection (see ``Liveness.reconnect``)."""
        reducer = self.plan.reducers[index].peer_id
        progress = [trio.current_time()]
        # the header, once it came (kept on self: a report made after our deadline cut
        # the download short must still say the reducer counted us; a review)
        fetched = self._fetched.setdefault(index, [])
        received = False
        note = "the reducer did not answer in time"
        async with self._downloads, trio.open_nursery() as nursery:
            # the stall clock starts with the download, not while it waited for a slot
            # (max_downloads): a member with one slot probed each reducer at once, found
            # it done serving, and dropped a part whose items were on their way (a review)
            progress[0] = trio.current_time()
            nursery.start_soon(
                self.liveness.watch,
                reducer,
                progress,
                self.config.stall_timeout,
                nursery.cancel_scope,
            )
            retried = False
            while True:
                try:
                    received, note = await self._fetch(index, address, encoded, progress, fetched)
                except RemoteError as exc:
                    note = f"the reducer refused: {exc}"
                    if retried:  # the step that served us may have ended and another begun
                        note = (
                            "the connection broke during the download, and by our retry the "
                            f"reducer no longer served this round's result ({exc})"
                        )
                    if exc.code in ("not_found", "unknown_method"):
                        # its step ended (or its averager is closed): gone from the round,
                        # as a ping would find (Liveness.probe), and dropped as such
                        self.liveness.mark_left(reducer)
                except PeerUnavailableError as exc:
                    if await self.liveness.reconnect(reducer):
                        retried = True
                        continue
                    note = f"the reducer is unreachable: {exc}"
                except ProtocolError as exc:
                    note = f"the reducer sent garbage: {exc}"
                    self.liveness.mark(reducer, DropReason.GARBAGE)
                finally:
                    if not received:  # chunks decoded into its tensor: our values back
                        self._restore(index)
                break
            nursery.cancel_scope.cancel()
        if not received and reducer in self.liveness.bad:
            reason = self.liveness.bad[reducer]
            # ("the reducer is timeout" read as nonsense: an outside tester)
            left = reason is DropReason.TIMEOUT
            note = "the reducer left the round (timeout)" if left else f"the reducer is {reason}"
        return (fetched[0] if fetched else None), received, note

    async def _fetch(
        self,
        index: int,
        address: Address,
        encoded: trio.Event,
        progress: list[float],
        fetched: list[ResultHeader],
    ) -> tuple[bool, str]:
        """One result stream of part ``index``: (received, note). The header goes into
        ``fetched``; a stream started again must announce the same one. The header ends
        the encoding of our chunks of the part (see the module's docstring): the result
        chunks wait for ``encoded``, unread, and the connection stops reading behind 32
        of them, the answers to our chunk calls too, which the encoding waits for (a
        member dropped at the cutoff then found its reducer dead, the part lost).

        Raises:
            RemoteError, PeerUnavailableError: as the stream's call.
            ProtocolError: the reducer sent garbage.
        """
        start, stop = self.plan.spans[index]
        length = stop - start
        expected_chunks = chunk_count(length, self.config.chunk_elements)
        # Results that one float32 tensor will hold are decoded (none: copied) into it as
        # they come (``encoded`` is set once our uploads of the part are over: encoded
        # copies, or none's raw views of the tensor whose calls have all returned), each
        # chunk's local values kept in the flat vector first (its span of a remote part is
        # unused): no pass after the last chunk, which held the step ~10 ms at 32 MiB int8;
        # with none, the copy into the tensor is made while the chunk is in cache instead of
        # a pass over the cold flat vector at the end (2 peers, 64 MiB: ~6 % less time, 7 of
        # 8 alternated runs). Unless the whole part counts, _restore puts the local values
        # back (see _download and run).
        tensor = None
        codecs = (NoneCodec, Int8Codec, Float16Codec)
        if isinstance(self.codec, codecs) and self.feedback is None:
            tensor = self.flat.view(start, stop)
        header: ResultHeader | None = None
        body = {"round": self.plan.round, "group": self.plan.group_id, "part": index}
        async with self.node.rpc.stream(address, f"{self.methods}.result", body) as items:
            chunk = -1
            try:
                async for item in items:
                    progress[0] = trio.current_time()
                    if header is None:
                        header = ResultHeader.from_body(item.body)
                        if fetched and header != fetched[0]:
                            raise RemoteProtocolError("the result header changed")
                        self._check_header(header, expected_chunks)
                        fetched[:] = [header]
                        # the part is final: chunks not sent yet would be refused (a sender
                        # it lists had sent them all); the calls under way end with the
                        # download (_exchange)
                        self._encoding[index].cancel()
                        continue
                    await encoded.wait()
                    chunk += 1
                    number = item.body.get("chunk")
                    if type(number) is not int or number != chunk or chunk >= header.chunks:
                        raise RemoteProtocolError("result chunks out of order")
                    a, b = chunk_span(length, self.config.chunk_elements, chunk)
                    if tensor is not None:
                        # the bytes the round's codec makes of the chunk (int8 with block 1 is
                        # 5x: more to read and decode); the decoding checks the rest
                        size = self.ranges.encoded_size(start + a, start + b)
                        if raw_flag(item.body) and isinstance(self.codec, NoneCodec):
                            size = 4 * (b - a)  # the chunk's float32 values, no header
                        if memoryview(item.payload).nbytes != size:
                            raise RemoteProtocolError("a result chunk of the wrong size")
                        np.copyto(self.flat.array[start + a : start + b], tensor[a:b])
                        self.in_tensor[index] = b  # before the decoding: a failed one is undone
                        self._take(item.body, item.payload, start + a, start + b, tensor[a:b])
                    else:
                        self._take(item.body, item.payload, start + a, start + b)
            except PeerUnavailableError:
                # the connection broke after the last chunk, before the stream's end: every
                # chunk came and was checked, so the part counts (a reducer killed as it
                # finished serving us took nothing of it with it)
                if header is None or header.weight <= 0 or chunk + 1 != header.chunks:
                    raise
            if header is None:
                raise RemoteProtocolError("empty result stream")
            received = header.weight > 0 and chunk + 1 == header.chunks
            note = "" if received else header.note or "the reducer had no contributions"
            if header.weight > 0 and not received:  # (its deadline may have cut it short)
                note = f"the result stream ended after {chunk + 1} of {header.chunks} chunks"
            if received and header.contributors == (self.plan.me,):
                # our own values back (through the codec): no group result, we keep ours.
                # (Fetched all the same: the reducer serves until every member has it.)
                received, note = False, SOLO_NOTE
            return received, note

    def _take(
        self,
        body: dict[str, object],
        payload: bytes | memoryview,
        start: int,
        stop: int,
        target: Float32Array | None = None,
    ) -> None:
        """Decode one result chunk into ``flat[start:stop]`` (or ``target``, of its size).

        Raises:
            RemoteProtocolError: undecodable, of the wrong size, or not finite.
        """
        if target is None:
            target = self.flat.array[start:stop]
        if raw_flag(body) and self.codec.name in ("none", "topk"):  # (topk: a dense chunk)
            finite = copy_finite(target, decode_raw(payload, stop - start), self._zeros)
        else:
            self.ranges.decode_into(payload, target, start)
            finite = self.codec.finite_output or all_finite(target, self._zeros[: stop - start])
        if not finite:
            raise RemoteProtocolError("the reducer sent non-finite values")

    def in_its_tensor(self, index: int) -> bool:
        """Whether part ``index`` (received) is in its tensor already; False when it was
        decoded into the flat vector (store it from there)."""
        return index in self.in_tensor

    def _restore(self, index: int) -> None:
        """Put back the local values of part ``index``'s chunks decoded into its tensor
        (kept in the flat vector by _fetch)."""
        done = self.in_tensor.pop(index, 0)
        if done:
            start, stop = self.plan.spans[index]
            tensor = self.flat.view(start, stop)
            assert tensor is not None
            np.copyto(tensor[:done], self.flat.array[start : start + done])

    def _check_header(self, header: ResultHeader, expected_chunks: int) -> None:
        """What a member can check of a result header: it names group members only, each
        once, nobody both counted and dropped, no stale contributor; a result (weight > 0)
        has contributors, their weight from the plan, and every chunk; no result (weight 0,
        e.g. every sender was dropped or their weights underflowed), no chunks.

        Raises:
            RemoteProtocolError: when it does not hold (the reducer sent garbage).
        """
        group = set(self.plan.group)
        contributors = set(header.contributors)
        dropped = [p for p, _ in header.dropped]
        if (
            not contributors | set(dropped) <= group
            or len(contributors) != len(header.contributors)
            or len(set(dropped)) != len(dropped)
            or contributors & set(dropped)
            or header.chunks not in (0, expected_chunks)
        ):
            raise RemoteProtocolError("the result header does not match the group")
        weights = [self.plan.weights[p] for p in header.contributors]
        if any(w is None for w in weights):
            raise RemoteProtocolError("the result header counts a stale member")
        if header.weight > 0:
            if not contributors:
                raise RemoteProtocolError("the result header has a weight but no contributors")
            if header.weight != math.fsum(w for w in weights if w is not None):
                raise RemoteProtocolError("the result header's weight is not its contributors'")
            if header.chunks != expected_chunks:
                raise RemoteProtocolError("the result header announces too few chunks")
        elif header.chunks:
            raise RemoteProtocolError("the result header announces chunks but no weight")
