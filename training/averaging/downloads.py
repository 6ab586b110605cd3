"""A member's downloads (``Downloads``, a base class of :class:`~.butterfly.Butterfly`):
each remote part's result stream, its header checked against the plan and each chunk
decoded (into its tensor as it comes, the local values kept aside and put back unless
the whole part counts); from the start again after a reset connection. "The module's
docstring" below is butterfly.py's."""

from __future__ import annotations

import math

import numpy as np
import trio

from peer import Peer, PeerUnavailableError, RemoteError
from protocol.address import Address
from protocol.codecs import Codec, Float16Codec, Int8Codec, NoneCodec
from protocol.errors import ProtocolError, RemoteProtocolError

from .config import AveragerConfig
from .feedback import ErrorFeedback
from .layout import FlatVector, Float32Array, chunk_count, chunk_span
from .messages import ResultHeader, raw_flag
from .pieces import RangeCodec
from .plan import Liveness, Plan
from .reducer import DropReason, decode_raw
from .scans import all_finite, copy_finite

SOLO_NOTE = "only our own values reached this part: nothing to average them with"


class Downloads:
    """The downloads of :class:`~.butterfly.Butterfly`, one of its base classes (the
    attributes below are the round's)."""

    node: Peer
    plan: Plan
    flat: FlatVector
    codec: Codec
    ranges: RangeCodec
    config: AveragerConfig
    methods: str
    liveness: Liveness
    feedback: ErrorFeedback | None
    in_tensor: dict[int, int]
    _zeros: Float32Array
    _fetched: dict[int, list[ResultHeader]]
    _encoding: dict[int, trio.CancelScope]
    _downloads: trio.Semaphore

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
