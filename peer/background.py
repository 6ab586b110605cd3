"""A blocking facade for plain (non-async) scripts: the peer lives on a background thread.

    with run_in_background(initial_peers=["PEERID@10.0.0.2:4000"]) as node:
        print(node.address)
        node.dht.store("run/x", 1, ttl=30.0)       # blocks until done, no await
        node.dht.get("run/x")                      # 1
        node.run(some_async_function, arg)         # any coroutine function, on the peer's loop

One thread runs ``trio.run``; each call enters that loop through
``trio.from_thread.run`` and blocks the calling thread until it returns. Errors raised
on the loop propagate to the caller, and a KeyboardInterrupt (Ctrl-C), or another
exception a signal handler raises in the caller, cancels its call on the loop. Leaving the
``with`` block stops the peer and joins the thread; a call still running in another thread
then raises PeerStoppedError.

A process forked while the peer runs (a ``DataLoader`` worker, ``multiprocessing`` with
``fork``) cannot use it, and lets go of its sockets at once (see ``peer.network``: the
child's copies would keep the peer's connections open after the parent closed them).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import inspect
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any, TypeVar

import trio

from protocol.address import Address
from protocol.dhtid import DHTID
from protocol.identity import Identity, PeerID
from protocol.records import Subkey

from .dht import EntriesRead, LookupStats
from .dht.lookup import LookupResult
from .dht.node import address_list
from .errors import PeerStoppedError
from .netclock import wall_clock
from .network import Network
from .node import Peer, PeerConfig, as_list, open_peer

__all__ = [
    "BackgroundClock",
    "BackgroundContext",
    "BackgroundDHT",
    "BackgroundPeer",
    "PeerThreadError",
    "PeerStoppedError",
    "run_in_background",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)

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
_ABANDONED_JOIN_S = 2.0  # how long a stop waits for a loop that a given-up call holds
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


class _LeftAtOnce(Exception):
    """Raised inside the peer's ``open_peer`` block to leave it without draining."""


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


class BackgroundDHT:
    """The blocking twin of :class:`peer.dht.DHT`: same methods, no ``await`` (but for the
    ones the peer runs itself: ``serve``, ``bootstrap``, ``hand_over``)."""

    def __init__(self, owner: BackgroundPeer) -> None:
        self._owner = owner

    def store(self, key: str, value: Any, ttl: float = 60.0, subkey: Subkey = None) -> bool:
        """See :meth:`peer.dht.DHT.store`.

        Raises:
            RecordTooLargeError: (a ValueError) a key, subkey or value over its limit.
            RecordError: a subkey or key bound to another peer; a key that is not a str.
            ValueError: a ttl out of range. TypeError: a value msgpack cannot serialize.
            PeerStoppedError: the peer is no longer running.
        """
        dht = self._owner.peer.dht
        return self._owner.run(dht.store, key, value, ttl, subkey)

    def get(self, key: str, *, latest: bool = True) -> Any:
        """See :meth:`peer.dht.DHT.get`.

        Raises:
            RecordTooLargeError: (a ValueError) the key is over its limit.
            RecordError: the key is not a str.
            PeerStoppedError: the peer is no longer running.
        """
        dht = self._owner.peer.dht

        async def get() -> Any:
            return await dht.get(key, latest=latest)

        return self._owner.run(get)

    def get_entries(self, key: str, *, latest: bool = True) -> dict[Subkey, tuple[Any, float]]:
        """See :meth:`peer.dht.DHT.get_entries`.

        Raises:
            RecordTooLargeError: (a ValueError) the key is over its limit.
            RecordError: the key is not a str.
            PeerStoppedError: the peer is no longer running.
        """
        dht = self._owner.peer.dht

        async def get_entries() -> dict[Subkey, tuple[Any, float]]:
            return await dht.get_entries(key, latest=latest)

        return self._owner.run(get_entries)

    def read_entries(self, key: str, *, latest: bool = True) -> EntriesRead:
        """See :meth:`peer.dht.DHT.read_entries`.

        Raises:
            RecordTooLargeError: (a ValueError) the key is over its limit.
            RecordError: the key is not a str.
            PeerStoppedError: the peer is no longer running.
        """
        dht = self._owner.peer.dht

        async def read_entries() -> EntriesRead:
            return await dht.read_entries(key, latest=latest)

        return self._owner.run(read_entries)

    def find_peers(self) -> list[tuple[PeerID, str]]:
        """See :meth:`peer.dht.DHT.find_peers`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(self._owner.peer.dht.find_peers)

    def contact(self, addresses: Sequence[Address | str]) -> list[Address]:
        """See :meth:`peer.dht.DHT.contact`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(self._owner.peer.dht.contact, address_list(addresses))

    @property
    def contact_errors(self) -> dict[str, str]:
        """See :attr:`peer.dht.DHT.contact_errors`."""
        return self._owner.run_sync(lambda: dict(self._owner.peer.dht.contact_errors))

    @property
    def stats(self) -> LookupStats:
        """A copy of :attr:`peer.dht.DHT.stats` (this node's lookups so far), read on the
        peer's loop."""
        return self._owner.run_sync(lambda: copy.copy(self._owner.peer.dht.stats))

    def find_nodes(self, target: DHTID) -> LookupResult:
        """See :meth:`peer.dht.DHT.find_nodes`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(self._owner.peer.dht.find_nodes, target)

    def refresh(self) -> None:
        """See :meth:`peer.dht.DHT.refresh`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        self._owner.run(self._owner.peer.dht.refresh)

    def republish(self) -> int:
        """See :meth:`peer.dht.DHT.republish`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(self._owner.peer.dht.republish)

    def drop_silent_contacts(self) -> int:
        """See :meth:`peer.dht.DHT.drop_silent_contacts`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(self._owner.peer.dht.drop_silent_contacts)

    def now(self) -> float:
        """See :meth:`peer.dht.DHT.now`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run_sync(self._owner.peer.dht.now)

    def routing_table_peers(self) -> list[tuple[PeerID, str]]:
        """See :meth:`peer.dht.DHT.routing_table_peers`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run_sync(self._owner.peer.dht.routing_table_peers)


def run_in_background(
    listen: str | None = "127.0.0.1:0",
    initial_peers: Iterable[str | Address] | None = (),
    identity: Identity | str | os.PathLike[str] | None = None,
    client_mode: bool = False,
    network: Network | None = None,
    config: PeerConfig | None = None,
    *,
    announce_host: str | None = None,
    clock: Callable[[], float] = wall_clock,
    ensure_bootstrap_success: bool = True,
) -> BackgroundContext:
    """Start a peer (see :func:`peer.open_peer` for the arguments) on a background thread.

    Use it as ``with run_in_background(...) as node:``: entering returns once the peer is
    up and bootstrapped; leaving the block stops it and joins the thread. A
    KeyboardInterrupt (Ctrl-C), or another exception a signal handler raises, during the
    start stops the half-started peer before it propagates, as one during a call cancels
    that call (see :meth:`BackgroundPeer.run`). A process forked meanwhile (DataLoader
    workers) lets go of the peer's sockets (see the module's docstring).
    ``node = run_in_background(...).__enter__()`` (a notebook) keeps the peer running until
    the interpreter's exit, even once the context object is garbage; keep the context
    (``ctx = run_in_background(...)``) to stop it earlier with ``ctx.__exit__(None, None,
    None)``.

    Raises:
        ProtocolError, IdentityFileError, OSError, PeerUnavailableError: as
            :func:`peer.open_peer`, when entered.
        RuntimeError: if entered inside a trio run (it would block that loop: use
            ``async with peer.open_peer(...)`` there).
    """
    start = partial(
        _start_in_background,
        listen,
        initial_peers,
        identity,
        client_mode,
        network,
        config,
        announce_host=announce_host,
        clock=clock,
        ensure_bootstrap_success=ensure_bootstrap_success,
    )
    return BackgroundContext(start)


class BackgroundContext:
    """What :func:`run_in_background` returns: a context manager whose ``__enter__`` starts
    the peer. A class, not a generator, so that the peer does not stop when this object is
    garbage collected (``node = run_in_background().__enter__()`` stopped at once, and the
    first call said "the background peer has stopped")."""

    def __init__(self, start: Callable[[], tuple[BackgroundPeer, Callable[[bool], None]]]) -> None:
        self._start = start
        self._stop: Callable[[bool], None] | None = None
        self._entered = False

    def __enter__(self) -> BackgroundPeer:
        """Start the peer and return it.

        Raises:
            RuntimeError: if entered a second time (even after leaving: a peer once
                stopped does not come back, and a new one would have a new identity
                unless one was given), or inside a trio run.
            Exception: what :func:`peer.open_peer` raises at startup.
        """
        if self._stop is not None:
            raise RuntimeError("this run_in_background() block is already entered")
        if self._entered:
            raise RuntimeError(
                "this run_in_background() block has already run: call"
                " peer.run_in_background(...) again for a new peer"
            )
        node, self._stop = self._start()
        self._entered = True
        return node

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        """Stop the peer and join its thread. Leaving the block normally first lets the
        peer finish the requests it serves and write what it queued (as leaving
        ``open_peer`` does, at most ``HostConfig.drain_timeout``); leaving it by an
        exception (Ctrl-C) stops it at once.

        Raises:
            RuntimeError: if called on the peer's own thread (the peer keeps running).
            Exception: what crashed the peer's loop while the block ran (when the block
                itself raised nothing).
        """
        stop, self._stop = self._stop, None
        if stop is not None:
            try:
                stop(exc_type is None)
            except PeerThreadError:
                self._stop = stop  # nothing stopped: an exit from another thread still can
                raise

    def __getattr__(self, name: str) -> Any:
        # node = run_in_background(...); node.dht.store(...): the `with` was forgotten
        raise AttributeError(
            f"run_in_background() returns a context manager, which has no {name!r}: use "
            "`with peer.run_in_background(...) as node:` and call node's methods inside"
        )


def _start_in_background(
    listen: str | None,
    initial_peers: Iterable[str | Address] | None,
    identity: Identity | str | os.PathLike[str] | None,
    client_mode: bool,
    network: Network | None,
    config: PeerConfig | None,
    *,
    announce_host: str | None,
    clock: Callable[[], float],
    ensure_bootstrap_success: bool,
) -> tuple[BackgroundPeer, Callable[[bool], None]]:
    """Start the peer's thread; returns the peer, and what stops it (and re-raises a crash
    of its loop when told to).

    Raises:
        RuntimeError: inside a trio run. Exception: what open_peer raises at startup.
    """
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        pass  # not inside trio: the intended use
    else:
        raise RuntimeError(
            "run_in_background() blocks the calling thread and cannot run inside trio; "
            "use `async with peer.open_peer(...)` in async code"
        )
    initial = as_list(initial_peers)
    ready = threading.Event()
    started: list[BackgroundPeer] = []
    failure: list[BaseException] = []
    stop: list[trio.Event] = []
    at_once: list[bool] = []  # the block was left by an exception: no drain
    startup = _InterruptibleCall()

    async def main() -> None:
        with contextlib.suppress(_LeftAtOnce):
            await startup.run(start_and_serve)

    async def start_and_serve() -> None:
        async with open_peer(
            listen,
            initial,
            identity,
            client_mode,
            network,
            config,
            announce_host=announce_host,
            clock=clock,
            ensure_bootstrap_success=ensure_bootstrap_success,
        ) as peer:
            stop.append(trio.Event())
            started.append(BackgroundPeer(peer, trio.lowlevel.current_trio_token()))
            ready.set()
            await stop[0].wait()
            if at_once:  # leave open_peer by an exception too: it closes without draining
                raise _LeftAtOnce

    def thread_main() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=thread_main, name="swarm-peer", daemon=True)
    try:
        # thread.start() too: a busy machine may run the new thread up to its first dial
        # (and a Ctrl-C come) before this thread returns from start()
        thread.start()
        ready.wait()
    except BaseException:  # Ctrl-C (or a signal handler's error) during the start: no
        startup.cancel()  # peer may live on unseen
        with contextlib.suppress(RuntimeError):  # interrupted before the thread existed
            thread.join()
        raise
    if not started:
        thread.join()
        raise failure[0]
    node = started[0]

    def shut_down(now: bool = False) -> None:
        if os.getpid() != node._pid:  # a forked child exiting: the peer is the parent's
            return
        if now:
            at_once.append(True)  # (read by the loop after stop is set: ordered)
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(stop[0].set, trio_token=node._token)
        # A call given up on (a third Ctrl-C) may never unwind, and the loop's end waits
        # for it: the user who insisted is not held here either (the thread is a daemon).
        thread.join(_ABANDONED_JOIN_S if node.abandoned_calls else None)
        if thread.is_alive():
            logger.warning(
                "the peer's thread still waits for an interrupted call to unwind: left behind"
            )

    pending = [shut_down]  # emptied once stopped: the hook left behind then holds nothing

    def at_exit() -> None:
        if pending:
            pending.pop()()

    def leave(raise_failure: bool) -> None:
        if threading.current_thread() is thread:  # its join would wait for itself
            raise PeerThreadError(
                "a run_in_background() block cannot be left from the peer's own thread "
                "(inside a function given to node.run or node.run_sync): leave it from "
                "the thread that entered it, or any other"
            )
        atexit.unregister(at_exit)
        if pending and not sys.is_finalizing():  # else an exit hook already stopped it
            pending.pop()(now=not raise_failure)
        pending.clear()
        if failure and raise_failure:  # the loop crashed while the block ran
            raise failure[0]

    # A script that ends inside the block: stop the peer at exit, while its thread still
    # runs (once the interpreter finalizes, the thread is frozen and joining it hangs).
    # Before Python waits for the script's own (non-daemon) threads, too: one that loops
    # until the peer stops (PeerStoppedError) held the exit forever, atexit's hooks coming
    # only after it. (``threading._register_atexit``: what concurrent.futures uses; it has
    # no unregister, hence ``pending``.)
    atexit.register(at_exit)
    with contextlib.suppress(AttributeError, RuntimeError):  # too late: atexit's will do
        threading._register_atexit(at_exit)  # type: ignore[attr-defined]
    return node, leave
