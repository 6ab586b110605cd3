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

The handle (``BackgroundPeer``, ``BackgroundClock``) lives in ``peer.background_peer`` and
``BackgroundDHT`` in ``peer.background_dht``; every name is importable from here.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import trio

from protocol.address import Address
from protocol.identity import Identity

from .background_dht import BackgroundDHT
from .background_peer import BackgroundClock, BackgroundPeer, PeerThreadError, _InterruptibleCall
from .errors import PeerStoppedError
from .netclock import wall_clock
from .network import Network, open_files_limit, out_of_files
from .node import PeerConfig, as_list, open_peer

__all__ = [
    "BackgroundClock",
    "BackgroundContext",
    "BackgroundDHT",
    "BackgroundPeer",
    "PeerThreadError",
    "PeerStoppedError",
    "run_in_background",
]

logger = logging.getLogger(__name__)

_ABANDONED_JOIN_S = 2.0  # how long a stop waits for a loop that a given-up call holds


class _LeftAtOnce(Exception):
    """Raised inside the peer's ``open_peer`` block to leave it without draining."""


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
        try:
            node, self._stop = self._start()
        except OSError as exc:
            if not out_of_files(exc) or exc.strerror != os.strerror(exc.errno or 0):
                raise  # (an open_peer message of ours, which says what failed, goes as it is)
            # trio's own files for the loop (a bare "[Errno 24] Too many open files" named
            # neither what failed nor the limit: an outside tester)
            raise OSError(
                exc.errno,
                f"this process is out of file descriptors ({open_files_limit()}): cannot start"
                " the background peer; raise the limit (ulimit -n)",
            ) from exc
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


_RUNNING: dict[int, Callable[..., None]] = {}
"""Each background peer not stopped yet: how to stop it (its ``shut_down``), by start order."""
_PEER_KEYS = itertools.count()
_hooks_lock = threading.Lock()
_hooks_registered = False


def _stop_running_peers() -> None:
    """At exit: stop every background peer a script left running, the newest first."""
    while _RUNNING:
        try:
            stop_it = _RUNNING.pop(max(_RUNNING))
        except (KeyError, ValueError):  # a leave() in another thread took it
            continue
        try:
            stop_it()
        except Exception:  # the others still stop (a hook of its own each did before)
            logger.exception("stopping a background peer at exit failed")


def _register_exit_hooks() -> None:
    """Once per process: a script that ends inside a block stops its peers at exit, while
    their threads still run (once the interpreter finalizes, a thread is frozen and
    joining it hangs). Also before Python waits for the script's own (non-daemon)
    threads: one that loops until the peer stops (PeerStoppedError) held the exit
    forever, atexit's hooks coming only after it (``threading._register_atexit``: what
    concurrent.futures uses). One hook for all peers: those lists keep what is registered
    (a hook per peer left ~0.5 KB behind at each open and close)."""
    global _hooks_registered
    with _hooks_lock:
        if _hooks_registered:
            return
        _hooks_registered = True
        atexit.register(_stop_running_peers)
        with contextlib.suppress(AttributeError, RuntimeError):  # too late: atexit's will do
            threading._register_atexit(_stop_running_peers)  # type: ignore[attr-defined]


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

    key = next(_PEER_KEYS)
    _RUNNING[key] = shut_down  # until stopped: by leave() or at exit, whichever comes first

    def leave(raise_failure: bool) -> None:
        if threading.current_thread() is thread:  # its join would wait for itself
            raise PeerThreadError(
                "a run_in_background() block cannot be left from the peer's own thread "
                "(inside a function given to node.run or node.run_sync): leave it from "
                "the thread that entered it, or any other"
            )
        stop_it = _RUNNING.pop(key, None)
        if stop_it is not None and not sys.is_finalizing():  # else an exit hook stopped it
            stop_it(now=not raise_failure)
        if failure and raise_failure:  # the loop crashed while the block ran
            raise failure[0]

    _register_exit_hooks()
    return node, leave
