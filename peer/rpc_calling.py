"""The calling side of an RPC connection: our calls, their deadlines, and the silence rule.

:class:`Calling` is mixed into :class:`~peer.rpc.RpcConnection` (rules in ``peer/rpc.py``).
A call takes one of our call slots, sends its request (with the time left before its
deadline), and waits for the answer the reader delivers. A call that ends unanswered, or
waits long in silence, may start a probe of the peer (:meth:`Calling._note_unanswered`): a
link that drops what we write without a reset is closed, not waited on for minutes.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

import trio

from protocol.rpc import MAX_REQUEST_ID, MAX_TIMEOUT, FrameKind, RpcFrame

from .calls import ConnectionClosedError, PendingCall, PendingStream, Reply, ReplyStream
from .errors import PeerSilentError, PeerUnavailableError, RemoteError
from .rpc_link import PEER_SILENCE, RpcLink, call_finished

logger = logging.getLogger("peer.rpc")

T = TypeVar("T")

WRONG_KIND = "wrong_kind"
"""The code of the :class:`RemoteError` a call gets when the peer answers it as the other
kind of method (stream items for ``call()``, one reply for ``stream()``); raised here, never
sent."""
_STREAMED = "the peer answers this method with a stream: call it with stream(), not call()"
_ANSWERED = "the peer answers this method with one reply: call it with call(), not stream()"

_MIN_TIMEOUT = 1e-3
_PROBE_METHOD = "swarm.silence_probe"
"""A method no peer serves: every peer answers it at once (``unknown_method``), which shows
it alive before a connection is taken for silent (see ``Calling._probe``)."""


class Calling(RpcLink):
    """Our calls over the connection (``call``, ``stream``) and the delivery of their
    answers."""

    async def call(
        self, method: str, body: dict[str, Any] | None = None, payload: bytes | memoryview = b""
    ) -> Reply:
        """Call ``method`` on the peer and wait for its reply.

        Raises:
            RemoteError: the peer's handler failed or refused (typed by ``code``).
            PeerUnavailableError: the connection is closed or died before the reply.
            LimitExceededError: the request is larger than the maximum frame.
        """
        await self._acquire_slot()
        return await self._call_in_slot(method, body, payload)

    async def _call_in_slot(
        self,
        method: str,
        body: dict[str, Any] | None,
        payload: bytes | memoryview,
        *,
        release: bool = True,
    ) -> Reply:
        """:meth:`call`, its call slot acquired (and released here, unless ``release`` is
        False: the probe's slot, kept apart)."""
        try:
            pending = PendingCall()
            sent_at = trio.current_time()
            request_id, request = await self._send_request(method, body, payload, pending)
            try:
                await self._await_answer(pending.done.wait, sent_at)
            except BaseException:
                self._cancel_remote(request_id, pending, request)
                self._note_unanswered(sent_at)
                raise
            finally:
                self._pending.pop(request_id, None)
                # a peer may answer before it read the whole request (a hostile one knows
                # the ids: they count up): the rest goes out from a copy
                self._outbox.detach(request)
        finally:
            if release:
                self._call_slots.release()
        if pending.error is not None:
            raise pending.error from pending.error.__cause__
        assert pending.reply is not None
        return pending.reply

    async def _acquire_slot(self) -> None:
        # No scheduler pass when a slot is free: the call checkpoints when it sends.
        try:
            self._call_slots.acquire_nowait()
        except trio.WouldBlock:
            await self._call_slots.acquire()

    async def _send_request(
        self,
        method: str,
        body: dict[str, Any] | None,
        payload: bytes | memoryview,
        pending: PendingCall | PendingStream,
    ) -> tuple[int, list[bytes | memoryview]]:
        """Send a request frame; its id, and its pieces (to withdraw it on cancellation).

        Raises:
            ConnectionClosedError: closed, or closing after our ``bye`` (the peer would
                not read the request): never sent, the host sends it on another connection.
        """
        self._check_open()
        if self._bye_cause is not None:
            raise ConnectionClosedError(
                f"connection to {self.peer_id.short()} is closing"
            ) from self._bye_cause
        request_id = self._allocate_id()
        frame = RpcFrame(
            FrameKind.REQUEST,
            request_id,
            method=method,
            body={} if body is None else body,
            payload=payload,
            timeout=_time_left(),
        )
        pieces, size = self._encode(frame)
        self._pending[request_id] = pending
        try:
            await self._send(pieces, size, urgent=True, request_id=request_id)
        except trio.ClosedResourceError:
            self._pending.pop(request_id, None)
            self._check_open()
            raise
        except BaseException as exc:
            self._pending.pop(request_id, None)
            if isinstance(pending.error, ConnectionClosedError):  # the write failed on a
                raise pending.error from exc  # connection the peer closed for idleness: retry
            raise
        return request_id, pieces

    def _allocate_id(self) -> int:
        while True:
            request_id = self._next_id
            self._next_id = (self._next_id + 1) & MAX_REQUEST_ID
            if request_id not in self._pending:
                return request_id

    def _cancel_remote(
        self,
        request_id: int,
        pending: PendingCall | PendingStream,
        request: list[bytes | memoryview],
    ) -> None:
        """Tell the peer a call was given up (nothing when the request was still queued:
        withdrawn). The caller then detaches the request from the writer, given up or not
        (a peer may answer before it read all of it), so that its payload is never read
        after the call returned."""
        finished = call_finished(pending)
        if finished or self.closed:
            return
        if self._outbox.withdraw(request):
            return  # never sent: the peer knows nothing of it
        # The writer may be sealing this payload slice by slice from the caller's buffer:
        # it finishes from a copy (the peer then gets the request, and the cancel). The
        # cancel goes with the requests (urgent, in order): our slot is free once we return,
        # and a request sent in it must not reach the peer first (one more than
        # max_inflight_requests in flight there: it ends the connection, a review found).
        self._outbox.put_nowait(
            self._encode(RpcFrame(FrameKind.CANCEL, request_id))[0], urgent=True
        )

    async def _await_answer(self, receive: Callable[[], Awaitable[T]], since: float) -> T:
        """``await receive()`` (a reply, or a stream's next item): each time nothing at all
        came from the peer for ``silence_timeout`` since ``since`` (the request, or the
        stream's last item), the silence rule runs as for a call that ended unanswered
        (:meth:`_note_unanswered`: a probe, and the connection closed unless the peer
        answers). Before, the rule ran only when a call ended: one long call to a frozen
        peer waited out its whole deadline, and without one forever (an outside tester).
        A peer that talks meanwhile (the probe's answer included) restarts the count."""
        while True:
            with trio.move_on_at(since + self.silence_timeout):
                return await receive()
            now = trio.current_time()
            writing = self._outbox.writing_since
            if self.last_received > since:
                since = self.last_received
            elif writing is not None and writing < now:
                # our own write is going out (a large frame on a slow uplink: perhaps this
                # very request): the peer may not have the request yet, and a probe would
                # wait behind the write (a 2 MiB call at 100 KiB/s was cut off at 15 s; a
                # review). A write that stalls is the send timeout's (HostConfig).
                since = now
            else:
                self._note_unanswered(since)
                since += self.silence_timeout / 2  # look again once a probe had its time

    def _note_unanswered(self, sent_at: float) -> None:
        """A call sent at ``sent_at`` ended unanswered (its deadline passed, or it was
        cancelled). When calls that waited long enough to expect an answer (a second, or
        a quarter of ``silence_timeout``) got none, and nothing at all came from the peer
        since the first of them was sent, for ``silence_timeout``, the peer is probed
        (:meth:`_probe`) and the connection closed unless it answers: a NAT or middlebox
        that dropped it loses what we write without a reset, and every call would time
        out on it for ~15 minutes (an averaging member was alone round after round). A
        call cancelled sooner (a hedged lookup's) proves nothing: the peer does not answer
        what we cancelled."""
        if self.not_reading or self.closed:
            # not reading: a stream's consumer lags, and the peer may be talking; closed:
            # nothing to probe (a second probe task started on a connection the first had
            # just closed: a review)
            return
        now, received = trio.current_time(), self.last_received
        if self._unanswered_since is not None and received > self._unanswered_since:
            self._unanswered_since = None  # the peer spoke since: slow, not gone
        if self._unanswered_since is None:
            # only a call that waited long enough starts the clock; once it runs, any call
            # ending unanswered checks it (calls queued for a slot on a dead link spent
            # their deadlines waiting, went out for under a second each, and the clock,
            # started once, was never checked again; a review)
            if received > sent_at or now - sent_at < min(1.0, self.silence_timeout / 4):
                return
            self._unanswered_since = sent_at
        silent = now - self._unanswered_since
        if silent >= self.silence_timeout and not self._probing and self._tasks is not None:
            self._probing = True
            self._tasks.start_soon(self._guard, self._probe)

    async def _probe(self) -> None:
        """Ask the peer for a method no peer serves, which a live one answers at once
        (``unknown_method``), and close the connection when nothing at all comes from it
        within half ``silence_timeout`` (more than the pace of a paused reader's
        keepalives): one long call whose handler outlived its deadline on a live peer with
        nothing else to say looked just like a dead link, and the close failed every other
        call on the connection (a review)."""
        wait = self.silence_timeout / 2
        try:
            if not self.probe_slot_kept:  # (few slots in all: wait for one)
                with trio.move_on_after(wait) as slot_wait:
                    await self._acquire_slot()
                if slot_wait.cancelled_caught:
                    # held by a live peer's long handler, maybe: no probe, no verdict
                    self._unanswered_since = None
                    return
            # otherwise in the slot kept for it: waiting for one behind our calls, the
            # probe was never sent while a live peer's long handlers held them all, and
            # the connection closed all the same (a review); giving up then kept a dead
            # connection open for another silence_timeout under steady calls (another)
            asked = trio.current_time()
            with trio.move_on_after(wait):
                with contextlib.suppress(RemoteError):
                    await self._call_in_slot(
                        _PROBE_METHOD, None, b"", release=not self.probe_slot_kept
                    )
        except PeerUnavailableError:
            return  # closed meanwhile
        finally:
            self._probing = False
        if self.closed or self.last_received >= asked or self.not_reading:
            # (>=: an answer in the same instant, as on a network without latency)
            return
        writing = self._outbox.writing_since
        if writing is not None and writing <= asked:
            # a write of ours that began before the probe is still going out: the probe
            # waits behind it, unsent; no verdict (a write that stalls: the send timeout)
            self._unanswered_since = None
            return
        since = asked if self._unanswered_since is None else self._unanswered_since
        silent = trio.current_time() - since
        logger.debug("%r: nothing from the peer for %.1f s while calls waited", self, silent)
        self.abort(PeerSilentError(f"nothing from the peer for {silent:.1f} s while calls waited"))

    def stream(
        self, method: str, body: dict[str, Any] | None = None, payload: bytes | memoryview = b""
    ) -> AbstractAsyncContextManager[ReplyStream]:
        """Call a streaming ``method``; iterate the context's value for the reply items.

        Leaving the context early cancels the call on the peer. Iteration raises what
        :meth:`call` raises.
        """
        return self._stream(method, body, payload)

    @asynccontextmanager
    async def _stream(
        self, method: str, body: dict[str, Any] | None, payload: bytes | memoryview
    ) -> AsyncIterator[ReplyStream]:
        await self._acquire_slot()
        try:
            pending = PendingStream()
            sent_at = trio.current_time()
            request_id, request = await self._send_request(method, body, payload, pending)
            try:
                yield ReplyStream(pending, self._await_answer, sent_at)
            finally:
                if not call_finished(pending):  # left unanswered: as a call's (see call)
                    self._note_unanswered(sent_at)
                self._cancel_remote(request_id, pending, request)
                self._pending.pop(request_id, None)
                self._outbox.detach(request)  # (see call)
                pending.receive.close()
                pending.taken.set()  # a reader waiting for room: the send now fails
        finally:
            self._call_slots.release()

    async def _deliver(self, frame: RpcFrame) -> None:
        pending = self._pending.get(frame.request_id)
        if pending is None:
            return  # a late answer to a call we gave up on
        kind = frame.kind
        error = None
        if kind is FrameKind.ERROR:
            error = RemoteError(frame.error_code, frame.error_message)
        if isinstance(pending, PendingCall):
            if kind is FrameKind.RESPONSE:
                pending.reply = Reply(frame.body, frame.payload)
            elif error is not None:
                pending.error = error
            else:
                # items or an end: the peer serves this method as a stream and our caller
                # used call() (a mistake on our side, most likely). That call fails, and is
                # cancelled; the connection stays (closing it failed every other call on it
                # with "connection lost", which named no mistake: an outside tester).
                pending.error = RemoteError(WRONG_KIND, _STREAMED)
                self._outbox.put_nowait(
                    self._encode(RpcFrame(FrameKind.CANCEL, frame.request_id))[0], urgent=True
                )
            del self._pending[frame.request_id]
            pending.done.set()
            return
        if kind is FrameKind.ITEM:
            # the consumer may have left (it sent a cancel): drop the item
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._hand_over(pending, Reply(frame.body, frame.payload))
            return
        if kind is FrameKind.RESPONSE:  # a plain method called with stream(): as above
            error = RemoteError(WRONG_KIND, _ANSWERED)
        del self._pending[frame.request_id]
        pending.finish(error)

    async def _hand_over(self, pending: PendingStream, item: Reply) -> None:
        """Hand ``item`` to a stream's consumer. When its buffer is full (in items, or in
        payload bytes: ``PendingStream.has_room``), our reader stops until the consumer
        takes one (the backpressure that bounds what a stream holds): nothing is read from
        the peer meanwhile, which is our pause, not the peer's silence (see
        ``_note_unanswered``)."""
        size = memoryview(item.payload).nbytes
        if pending.has_room(size):
            pending.send.send_nowait(item)  # (room for it: no wait, nothing to cancel)
            pending.held += size
            # the consumer's turn before the next frame is read, as the awaited send gave
            # it (without: a member whose link reset mid result stream lost the part in
            # half of the runs of test_averaging_bad_networks's reset test); shielded, so
            # a cancel cannot come between the count and the item
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        self._reader_paused = True
        try:
            # paced for the peer's silence rule, not ours (the protocol's 10 s at most:
            # with ours longer, or off, the peer took us for silent; a review)
            interval = min(self.silence_timeout, PEER_SILENCE) / 4
            while True:
                with trio.move_on_after(interval):  # (an item not sent when it fires)
                    while not pending.has_room(size):
                        if not pending.send.statistics().open_receive_channels:
                            break  # the consumer left: the send below raises
                        await pending.taken.wait()
                    # no checkpoint from here on: a cancel between counting the bytes and
                    # the send left them counted for an item never buffered, and the
                    # stream stuck once they added up (a review)
                    pending.send.send_nowait(item)
                    pending.held += size
                    return
                self._keepalive()
        finally:
            self._reader_paused = False
            self._frame_received = trio.current_time()

    def _peer_said_bye(self) -> None:
        """The peer closes this connection, idle on its side: every call of ours still
        waiting crossed its ``bye`` unread; they fail as never sent (the host sends them
        again on a fresh connection). Not a departure: ``lost`` stays False."""
        self._fail_as_unread(p for p in self._pending.values() if not call_finished(p))
        self._shutdown(PeerUnavailableError("the peer closed the idle connection"))


def _time_left() -> float | None:
    deadline = trio.current_effective_deadline()
    if math.isinf(deadline):
        return None
    return min(max(deadline - trio.current_time(), _MIN_TIMEOUT), MAX_TIMEOUT)
