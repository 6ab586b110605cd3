"""The background peer's handle (see peer.background): each blocking call enters the
peer's loop through ``trio.from_thread`` and waits there, and an interruption in the
caller's thread cancels it on the loop."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from protocol.identity import Identity, PeerID

from .background_dht import BackgroundDHT
from .errors import PeerStoppedError
from .node import Peer

__all__ = ["BackgroundClock", "BackgroundPeer", "PeerThreadError"]

T = TypeVar("T")

# "peer.background", not __name__: these were its records before they moved here
logger = logging.getLogger("peer.background")

_STILL_UNWINDING = (
    "interrupted: waiting for the call to unwind on the peer's loop (an averaging step "
    "stops writing into your tensors; parts already averaged keep the mean); press Ctrl-C "
    "once more to stop waiting"
)
_ON_PEER_THREAD = (
    "this blocking call was made on the background peer's own thread (inside a function "
    "given to node.run or node.run_sync), where it would wait for itself: there, await "
    "the async peer's methods instead (node.peer.dht.get(...), not node.dht.get(...))"
)
_IN_TRIO_RUN = (
    "this blocking call was made inside a trio run on this thread (trio.run(...)), whose "
    "loop it would block: in async code use `async with peer.open_peer(...)` and await its "
    "methods, or call the background peer from a plain thread (`await "
    "trio.to_thread.run_sync(node.dht.get, key)`)"
)
_ABANDONED = (
    "stopped waiting: the interrupted call may still run on the peer's loop (and write "
    "into your tensors) until it unwinds"
)


class BackgroundPeer:
    """A peer running on a background thread; every method blocks until done."""

    def __init__(self, peer: Peer, token: trio.lowlevel.TrioToken) -> None:
        self._peer = peer
        self._token = token
        self._pid = os.getpid()  # a forked child has a copy of this object, not the thread
        # built on the peer's loop (the object, not its ident: a thread started after the
        # loop's ended may get the same ident)
        self._loop_thread = threading.current_thread()
        self.abandoned_calls = 0  # interrupted calls given up on before they unwound
        self.identity: Identity = peer.identity
        self.peer_id: PeerID = peer.peer_id
        self.address: str = peer.address
        self.client_mode: bool = peer.client_mode
        self.dht = BackgroundDHT(self)
        self.clock = BackgroundClock(self)

    @property
    def peer(self) -> Peer:
        """The underlying async Peer; use its methods only from coroutines given to run()."""
        return self._peer

    @property
    def token(self) -> trio.lowlevel.TrioToken:
        """The trio token of the peer's own loop (code running there may use ``peer``)."""
        return self._token

    def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``async_fn(*args)`` on the peer's loop and return its result.

        A KeyboardInterrupt (SIGINT), or any exception a signal handler raises while it
        waits, cancels the call on the loop, waits for it to unwind, and is re-raised.

        Raises:
            PeerStoppedError: if the peer is no longer running, or stops during the call.
            RuntimeError: if called in a forked child process, on the peer's own thread
                (PeerThreadError), or inside a trio run on this thread.
            TypeError: if ``async_fn`` is not a function (a coroutine object, say).
            Exception: whatever ``async_fn`` raises.
        """
        self._check_process()
        if not callable(async_fn):  # node.run(fn(x)) instead of node.run(fn, x)
            if inspect.iscoroutine(async_fn):
                async_fn.close()  # no "never awaited" warning on top of the error
            raise TypeError(
                f"run() takes an async function and its arguments, not a"
                f" {type(async_fn).__name__}: node.run(fn, arg), not node.run(fn(arg))"
            )
        call = _InterruptibleCall()
        try:
            return trio.from_thread.run(call.run, async_fn, *args, trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise PeerStoppedError("the background peer has stopped") from exc
        except trio.Cancelled as exc:  # the peer stopped while the call ran (its system task)
            raise PeerStoppedError("the background peer stopped during the call") from exc
        except BaseException:
            # raised in this thread while the call still runs: Ctrl-C (a notebook's
            # interrupt), or a signal handler's exception (SystemExit on SIGTERM, a
            # "preempted" error on SIGUSR1). It must stop the call, not leave it running
            # on the loop: an averaging step would go on writing into the caller's
            # tensors (while the caller saves a checkpoint), and refuse the next step.
            # A second Ctrl-C while it unwinds (`timeout` sends the signal on once more,
            # an impatient user) must not cut that short: the first one is raised. A
            # third gives up waiting (an unwind that hangs must not trap the user). CPython
            # runs signal handlers at calls and backward jumps: the first such point here
            # is inside the try, so a second Ctrl-C cannot slip in before it.
            waited_through = 0
            while True:
                try:
                    if not call.finished:
                        call.cancel()
                    break
                except KeyboardInterrupt:
                    waited_through += 1
                    if waited_through > 1:
                        logger.warning(_ABANDONED)
                        self.abandoned_calls += 1  # (the stop does not wait for it)
                        raise
                    logger.warning(_STILL_UNWINDING)
            raise

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``fn(*args)`` on the peer's loop (to read its state safely).

        Raises:
            PeerStoppedError: if the peer is no longer running.
            RuntimeError: if called in a forked child process, on the peer's own thread
                (PeerThreadError), or inside a trio run on this thread.
            Exception: whatever ``fn`` raises.
        """
        self._check_process()
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise PeerStoppedError("the background peer has stopped") from exc

    def _check_process(self) -> None:
        # in a forked child the call would go to the parent's loop and never come back
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this background peer runs in process {self._pid}, not in this forked child "
                f"({os.getpid()}): start a peer with run_in_background() in the child"
            )
        # on the loop a blocking call would wait for itself: trio refuses it with a message
        # that names neither the peer nor the way out
        if threading.current_thread() is self._loop_thread:
            raise PeerThreadError(_ON_PEER_THREAD)
        # inside another trio run trio's own refusal ("this is a blocking function; call it
        # from a thread") names neither the peer nor the way out (an outside tester)
        if trio.lowlevel.in_trio_run():
            raise RuntimeError(_IN_TRIO_RUN)

    def __repr__(self) -> str:
        return f"<BackgroundPeer {self.address}>"

    def __reduce__(self) -> Any:
        # sent to a spawned process (a DataLoader worker's dataset holding it, a Pool
        # argument): say so, rather than "cannot pickle ... Ed25519PrivateKey"
        raise TypeError(
            "a background peer cannot be sent to another process (it lives on this "
            "process's thread): start one with run_in_background() in that process"
        )


class PeerThreadError(RuntimeError):
    """A blocking call, or the block's exit, tried on the peer's own thread, where it would
    wait for itself: refused before anything ran or stopped."""


class _InterruptibleCall:
    """One call onto the loop, which the thread that waits for it may cancel (it runs in
    trio's system nursery, or is the loop's main task: out of reach otherwise)."""

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancelled = False  # set before the call started: it never enters async_fn
        self._done = threading.Event()

    async def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        try:
            with trio.CancelScope() as scope:
                self._token = trio.lowlevel.current_trio_token()
                self._scope = scope
                if not self._cancelled:
                    return await async_fn(*args)
            raise PeerStoppedError("the call was interrupted")  # its caller has gone
        finally:
            self._done.set()

    @property
    def finished(self) -> bool:
        """Whether the call has returned or raised (what the waiting thread then gets is
        its outcome, not an interruption)."""
        return self._done.is_set()

    def cancel(self) -> None:
        """Cancel the call from another thread and wait until it has unwound."""
        self._cancelled = True  # before reading _scope, which run() sets before reading this
        scope, token = self._scope, self._token
        if scope is None or token is None:
            return  # not started: it will see _cancelled and never enter async_fn
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(scope.cancel, trio_token=token)
        self._done.wait()


class BackgroundClock:
    """The blocking twin of the peer's network clock (:class:`peer.netclock.NetworkClock`),
    read on the peer's own loop: there "this machine's clock" is the system time read once,
    moving on monotonically (``wall_clock``), while a read from another thread would take
    the system time as it is now, jumps included."""

    def __init__(self, owner: BackgroundPeer) -> None:
        self._owner = owner

    def now(self) -> float:
        """Network time: this machine's clock plus ``offset`` (see ``NetworkClock.now``).

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run_sync(self._owner.peer.clock.now)

    @property
    def offset(self) -> float:
        """Seconds added to this machine's clock (positive: it is behind its peers').

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        clock = self._owner.peer.clock
        return self._owner.run_sync(lambda: clock.offset)
