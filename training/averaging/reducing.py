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

import logging
import math
from collections.abc import AsyncGenerator, Callable

import numpy as np
import trio

from peer import RemoteError, Reply
from protocol.codecs import Codec, NoneCodec, NonFiniteError, TopKCodec
from protocol.identity import PeerID

from .buffers import SharedBuffer
from .config import AveragerConfig, default_retain_budget
from .layout import FlatVector, Float32Array, Span, chunk_span
from .messages import ChunkHeader, ResultHeader
from .pieces import RangeCodec
from .plan import Liveness, Plan
from .reducer import (
    ChunkRejected,
    DropReason,
    Member,
    PartOutcome,
    PartReducer,
    effective_weights,
    wide_sum_wanted,
)
from .scans import overflow_note

logger = logging.getLogger(__name__)

_FLT_MAX = np.finfo(np.float32).max


class ReducerService:
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

    # -- chunks in -----------------------------------------------------------------------

    async def on_chunk(
        self, sender: PeerID, header: ChunkHeader, payload: bytes | memoryview
    ) -> Reply:
        """Take one chunk (or a withdrawal) from ``sender``.

        Raises:
            RemoteError: ``dropped`` (with the reason) once the sender no longer counts for
                this part; ``bad_request`` for a chunk that is not for this part.
        """
        reducer = self.reducer
        if header.part != self.part or sender not in reducer.senders:
            raise RemoteError("bad_request", f"part {header.part} is not reduced here for you")
        if header.abort is not None:
            if header.abort is DropReason.TIMEOUT:
                # its step ended (Butterfly._withdraw): it will not fetch our result either,
                # nor serve its own part. (Its group tag says it is this step's word: one of
                # its step before, in a round of the same number, is not_found.)
                self.liveness.mark_left(sender, DropReason.TIMEOUT)
            self._drop(sender, header.abort)
            return Reply({})
        self._check_pending(sender)
        key = (sender, header.chunk)
        retried = not header.retry and key in self._retries
        if retried and (
            key in self._waiting_calls
            or reducer.is_resend(sender, header.chunk, payload, header.raw)
        ):
            # The first call of a chunk whose retry came first: both were parked until our
            # group was confirmed, and the retry woke first (it now waits, or was taken).
            # It is superseded, as in _supersede, not a second copy (that dropped an honest
            # sender as garbage and benched it: a review).
            raise RemoteError("bad_request", f"chunk {header.chunk} was sent again")
        placed = False  # holds the sender's place in the admission queue (see _supersede)
        try:
            if header.retry:
                if reducer.is_resend(sender, header.chunk, payload, header.raw):
                    return Reply({})  # its first answer was lost with a reset connection
                placed = await self._supersede(sender, header.chunk)
                self._check_pending(sender)
            # a lying header or a payload of the wrong size is refused before the call
            # waits (holding its payload) for admission, and so is a second call for the
            # same chunk: what waits for a sender is at most the encoded part that
            # admission counts
            self._refuse_if(reducer.check_chunk, sender, header, payload)
        except BaseException:
            if placed:
                self._stop_waiting(sender)
            raise
        if header.retry:
            self._retries.add(key)
        scope, over = self._waiting_calls[key] = (trio.CancelScope(), trio.Event())
        try:
            with scope:
                await self._admit(sender, placed)
                await self.loaded.wait()
            if scope.cancelled_caught:
                raise RemoteError("bad_request", f"chunk {header.chunk} was sent again")
            if not reducer.loaded:
                raise RemoteError("dropped", DropReason.TIMEOUT.value)
            self._check_pending(sender)
            self._refuse_if(reducer.add_chunk, sender, header, payload)
        finally:
            reducer.forget_chunk(sender, header.chunk)
            if self._waiting_calls.get(key) == (scope, over):  # (not superseded)
                del self._waiting_calls[key]
            over.set()
        self.progress.setdefault(sender, [0.0])[0] = trio.current_time()
        if not reducer.is_pending(sender):  # that chunk completed its part
            self._release(sender)
        return Reply({})

    async def _supersede(self, sender: PeerID, index: int) -> bool:
        """A retried chunk whose first call still waits here (for admission, or for our
        own values): that call's connection broke, silently for us (a NAT dropped it), and
        its answer could not reach the sender anyway. The retry takes its place (one
        payload held, as before), rather than being refused as a second copy, which
        dropped an honest sender as garbage.

        It takes the sender's place in the admission queue too: the sender is counted as
        waiting (for the retry) before the first call leaves, which would otherwise take
        it out of the queue, to the back of the line. Returns whether it was counted so:
        pass that on to :meth:`_admit`, or undo it with :meth:`_stop_waiting`."""
        waiting = self._waiting_calls.get((sender, index))
        if waiting is None:
            return False
        scope, over = waiting
        self._waiters[sender] = self._waiters.get(sender, 0) + 1
        try:
            scope.cancel()
            await over.wait()
        except BaseException:
            self._stop_waiting(sender)
            raise
        return True

    def _refuse_if(
        self,
        check: Callable[[PeerID, int, int, float, bytes | memoryview, bool], object],
        sender: PeerID,
        header: ChunkHeader,
        payload: bytes | memoryview,
    ) -> None:
        """Run ``check`` (a chunk's check, or its addition) for ``sender``'s chunk.

        Raises:
            RemoteError: ``dropped`` with the reason, when it refused the chunk.
        """
        try:
            check(sender, header.chunk, header.epoch, header.weight, payload, header.raw)
        except ChunkRejected as exc:
            logger.debug("round %d: dropping %s: %s", self.plan.round, sender.short(), exc)
            self._after_drop(sender)
            raise RemoteError("dropped", exc.reason.value) from None

    def _check_pending(self, sender: PeerID) -> None:
        if not self.reducer.is_pending(sender):
            reason = self.reducer.reason(sender)
            raise RemoteError("dropped", "complete" if reason is None else reason.value)

    async def _admit(self, sender: PeerID, placed: bool = False) -> None:
        """Wait until ``sender`` is admitted (``placed``: already counted as waiting, see
        :meth:`_supersede`)."""
        if sender in self._admitted:
            if placed:
                self._stop_waiting(sender)
            return
        if sender not in self._queue:
            self._queue.append(sender)
            self._notify()  # the holders of admission now have somebody waiting
        if not placed:
            self._waiters[sender] = self._waiters.get(sender, 0) + 1
        try:
            while sender not in self._admitted:
                # dropped while queued (a withdrawal, a failed probe): out of the queue
                self._check_pending(sender)
                if self._queue[0] == sender and (
                    self._reserved == 0 or self._reserved + self.part_bytes <= self.budget
                ):
                    self._queue.pop(0)
                    self._admitted.add(sender)
                    self._reserved += self.part_bytes
                    self._admitted_at[sender] = trio.current_time()
                    self.progress[sender] = [trio.current_time()]
                    self._notify()
                    break
                await self._changed.wait()
        finally:
            self._stop_waiting(sender)

    def _stop_waiting(self, sender: PeerID) -> None:
        """One call of ``sender`` no longer waits for admission; with none left waiting,
        the sender leaves the queue (its calls gave up while queued)."""
        self._waiters[sender] -= 1
        if not self._waiters[sender] and sender in self._queue:
            self._queue.remove(sender)
            self._notify()

    def _release(self, sender: PeerID) -> None:
        if sender in self._admitted and sender not in self._released:
            self._released.add(sender)
            self._reserved -= self.part_bytes
        if sender in self._queue:
            self._queue.remove(sender)
        self._notify()

    def drop_sender(self, sender: PeerID, reason: DropReason) -> None:
        """Leave a pending sender out of the part (nothing happens for anyone else)."""
        if self.reducer.is_pending(sender):
            self._drop(sender, reason)

    def _drop(self, sender: PeerID, reason: DropReason) -> None:
        self.reducer.drop(sender, reason)
        self._after_drop(sender)

    def _after_drop(self, sender: PeerID) -> None:
        self._release(sender)

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
            due = self.liveness.mark_gone_clients(p for p in fetching if p in self.progress)
            unconnected = self.liveness.unconnected_servers(
                p for p in fetching if p in self.progress
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
        due = self.liveness.mark_gone_clients(p for p in pending if p in self.progress)
        unconnected = self.liveness.unconnected_servers(p for p in pending if p in self.progress)
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

    async def _wait_for_news(self) -> None:
        """Until a chunk or a download came, a member was found bad, or a connection ended
        (a client-mode sender that sent us chunks and has no connection left is dead soon
        after: it cannot be probed sooner, see ``Liveness.mark_gone_clients``)."""
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


def _shifted(span: Span, by: int) -> Span:
    return span[0] + by, span[1] + by


async def _wait_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
