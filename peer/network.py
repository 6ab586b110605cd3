"""Pluggable byte transports: everything above runs on ``trio.abc.Stream``.

:class:`TcpNetwork` is the real thing; :class:`peer.memnet.MemoryNetwork` is an in-memory
switchboard with latency, partitions and crashes for tests. Both implement :class:`Network`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import trio

from protocol.noise import BUSY_SIGNAL

__all__ = [
    "AdmitFilter",
    "ConnectionHandler",
    "Network",
    "PartialSender",
    "TcpNetwork",
    "open_files_limit",
    "partial_sender",
    "remote_host_of",
]

logger = logging.getLogger(__name__)

ConnectionHandler = Callable[[trio.abc.Stream], Awaitable[None]]
PartialSender = Callable[[memoryview], Awaitable[int]]
"""Sends a prefix of the bytes given and returns its length; cancelled, it sent nothing."""
AdmitFilter = Callable[[str], bool]
"""Called with an accepted connection's remote host before anything else is spent on it;
False turns the connection away at once (``BUSY_SIGNAL``, then closed)."""


@runtime_checkable
class Network(Protocol):
    """Where connections come from: dial out, or accept in."""

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """Open a stream to ``host:port``.

        Raises:
            OSError: if the address cannot be reached.
        """
        ...

    async def serve(
        self,
        host: str,
        port: int,
        handler: ConnectionHandler,
        *,
        admit: AdmitFilter | None = None,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections on ``host:port`` forever, running ``handler`` on each.

        Reports the bound port with ``task_status.started(port)`` (``port=0`` picks one).
        The handler owns the stream and must close it. ``admit``, when given, sees each
        connection's remote host first and may refuse it: it is sent
        ``protocol.noise.BUSY_SIGNAL`` (the dialer learns we are up but busy) and closed
        at once, no task made.

        Raises:
            OSError: if the address cannot be bound.
        """
        ...


FD_RESERVE = 32
"""File descriptors a process keeps for other uses than connections (listeners, the event
loop, files, a thread's pipes): see :meth:`TcpNetwork.connection_budget`."""
_MIN_RESERVED_BUDGET = 8
"""Below this many connections after ``FD_RESERVE``, the budget counts the free files."""
_TIGHT_SPARE = 4
"""Files kept aside under a tight limit: the listener (not open yet when the budget is
asked), a newcomer waiting for an idle connection to close, a dial, a file write."""
_OUT_OF_FILES = {errno.EMFILE, errno.ENFILE}
_OUT_OF_FILES_EVERY = 60.0
"""Seconds between two warnings that this process is out of file descriptors."""


class _OutOfFiles:
    """Warns, at most once a minute, that sockets fail for want of file descriptors: each
    accept and dial then fails, and one line each (every 100 ms while accepting) buried
    the log, while dials failed at DEBUG only, reading as the remote peer's fault."""

    def __init__(self) -> None:
        self._last = -float("inf")
        self._missed = 0

    def warn(self, what: str) -> None:
        now = time.monotonic()  # (any trio run's: a process may run several)
        if now - self._last < _OUT_OF_FILES_EVERY:
            self._missed += 1
            return
        missed = f" ({self._missed} more since the last warning)" if self._missed else ""
        self._last, self._missed = now, 0
        logger.warning(
            "this process is out of file descriptors (%s): cannot %s%s; raise the limit "
            "(ulimit -n, or LimitNOFILE= in a systemd unit)", open_files_limit(), what, missed
        )  # fmt: skip


_OUT_OF_FILES_LOG = _OutOfFiles()


def _soft_file_limit() -> int | None:
    """This process's soft limit on open files; None when unlimited or unknown."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def _open_files() -> int | None:
    """How many file descriptors this process holds now (None where /proc does not say)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)
    except OSError:
        return None


def open_files_limit() -> str:
    """This process's file limit, for messages: ``"ulimit -n 1024"``."""
    soft = _soft_file_limit()
    return "no limit (or unknown)" if soft is None else f"ulimit -n {soft}"


def out_of_files(exc: BaseException | None, depth: int = 0) -> bool:
    """Whether ``exc`` (or what caused it, or one of a group's) is EMFILE or ENFILE: this
    process's (or machine's) want of file descriptors, no sign of the remote peer."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, OSError) and exc.errno in _OUT_OF_FILES:
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(out_of_files(e, depth + 1) for e in exc.exceptions)
    return out_of_files(exc.__cause__ or exc.__context__, depth + 1)


class TcpNetwork:
    """Real TCP through trio; ``TCP_NODELAY`` on every stream."""

    def connection_budget(self) -> int | None:
        """Connections this process can hold beside its other files: the file limit's
        soft value less ``FD_RESERVE``; None without a limit. The host takes it as its
        ``max_connections`` when lower, so that a full node evicts an idle connection for
        a newcomer instead of failing every accept.

        Under a limit too small for that reserve (below 40), what is free now less
        ``_TIGHT_SPARE``, at most 8 and at least 1: a floor of 8 promised connections that did not
        exist (``ulimit -n 12``: 9 descriptors held idle, 3 free, 2 of 10 peers joined
        and the rest timed out, never evicted for: an outside tester)."""
        soft = _soft_file_limit()
        if soft is None:
            return None
        if soft - FD_RESERVE >= _MIN_RESERVED_BUDGET:
            return soft - FD_RESERVE
        held = _open_files()
        if held is None:  # (no /proc: not Linux)
            return _MIN_RESERVED_BUDGET
        # at most what the reserve gives at 40 (no jump from 30 at 39 down to 8 at 40)
        return max(min(soft - held - _TIGHT_SPARE, _MIN_RESERVED_BUDGET), 1)

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """Open a TCP stream to ``host:port``.

        Raises:
            OSError: on refusal, unreachable host or a failed lookup; ``EMFILE`` naming this
                process's file limit when it has no descriptor left for a socket.
        """
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            if not out_of_files(exc):
                raise
            _OUT_OF_FILES_LOG.warn(f"dial {host}:{port}")
            raise OSError(
                errno.EMFILE,
                f"this process is out of file descriptors ({open_files_limit()}): no socket to "
                f"dial {host}:{port}",
            ) from exc
        _set_nodelay(stream)
        _OPEN_SOCKETS.add(stream.socket)
        return stream

    async def serve(
        self,
        host: str,
        port: int,
        handler: ConnectionHandler,
        *,
        admit: AdmitFilter | None = None,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` and run ``handler`` on each accepted stream (``admit``
        first, see :meth:`Network.serve`).

        Raises:
            OSError: if the address cannot be bound.
        """
        try:
            listeners = await trio.open_tcp_listeners(port, host=host or None)
        except OSError as exc:  # say which address: "[Errno 98] Address in use" alone does not
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise OSError(exc.errno, exc.strerror or str(exc), where) from exc
        bound_port: int = listeners[0].socket.getsockname()[1]
        if port == 0 and len(listeners) > 1:
            listeners = await _on_one_port(listeners, bound_port)

        async def accepted(stream: trio.SocketStream) -> None:
            _set_nodelay(stream)
            await handler(stream)

        _OPEN_SOCKETS.update(listener.socket for listener in listeners)
        task_status.started(bound_port)
        try:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(_accept_loop, listener.socket, accepted, admit, nursery)
        finally:
            for listener in listeners:
                listener.socket.close()


async def _on_one_port(
    listeners: list[trio.SocketListener], port: int
) -> list[trio.SocketListener]:
    """``listeners`` (a host that resolved to several addresses, e.g. ``::1`` and
    ``127.0.0.1``, bound with port 0) all on ``port``, the first one's: with port 0 each
    address got a port of its own, and the one address announced named only the first (an
    outside tester: IPv4 dialers were refused at the printed address). An address where
    ``port`` is taken is left out, with a warning."""
    kept = [listeners[0]]
    for listener in listeners[1:]:
        address = listener.socket.getsockname()
        if address[1] == port:
            kept.append(listener)
            continue
        listener.socket.close()
        try:
            kept += await trio.open_tcp_listeners(port, host=address[0])
        except OSError as exc:
            logger.warning(
                "not listening on %s: port %d is taken there (%s)", address[0], port, exc
            )
    return kept


_ACCEPT_RETRY = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM}
"""The connection died before we took it (or a firewall refused it): take the next one."""
_ACCEPT_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_RESOURCE_PAUSE = 0.1
"""Seconds to wait before accepting again when out of file descriptors or memory (the
pending connections wait in the kernel's backlog meanwhile)."""


async def _accept_loop(
    sock: trio.socket.SocketType,
    accepted: Callable[[trio.SocketStream], Awaitable[None]],
    admit: AdmitFilter | None,
    nursery: trio.Nursery,
) -> None:
    """``trio.serve_listeners`` for one socket, plus ``admit``: a refused connection costs
    an accept and a close, not a stream object and a task (~4x less CPU measured here,
    which matters when one host floods us with connections)."""
    while True:
        try:
            conn, address = await sock.accept()
        except OSError as exc:
            if exc.errno in _ACCEPT_RETRY:
                continue
            if exc.errno in _OUT_OF_FILES:
                _OUT_OF_FILES_LOG.warn("accept a connection")
                await trio.sleep(_RESOURCE_PAUSE)
                continue
            if exc.errno in _ACCEPT_OUT_OF_RESOURCES:
                logger.error("cannot accept a connection (%s); retrying shortly", exc)
                await trio.sleep(_RESOURCE_PAUSE)
                continue
            raise
        if admit is not None and not admit(_host_of(address)):
            _turn_away(conn)
            continue
        _OPEN_SOCKETS.add(conn)
        nursery.start_soon(accepted, trio.SocketStream(conn))


def _turn_away(conn: trio.socket.SocketType) -> None:
    """Send ``BUSY_SIGNAL`` on a fresh socket (its buffer takes it at once) and close it,
    reading first what the dialer sent: closing with unread bytes resets the connection,
    and a reset may discard the signal before the dialer reads it (on some systems)."""
    fd = conn.fileno()
    with contextlib.suppress(OSError):
        os.write(fd, BUSY_SIGNAL)
    with contextlib.suppress(OSError):
        os.read(fd, 1 << 12)
    conn.close()


_OPEN_SOCKETS: weakref.WeakSet[trio.socket.SocketType] = weakref.WeakSet()
"""Every socket TcpNetwork made (connected, accepted, listening) that is still alive."""


def _release_sockets_in_child() -> None:
    """After ``os.fork()`` (a DataLoader worker, multiprocessing's "fork"), in the child:
    point the descriptors of the parent's peer sockets at /dev/null. The child cannot use
    its peers (their trio loop is not in it), and its copies of their sockets would keep
    the connections open after the parent closed them (no FIN: the other side kept calling
    a peer that left) and the listeners accepting dials that nobody answers (a dial waited
    for the handshake timeout instead of being refused). The parent's sockets stay as they
    are; the child's socket objects, if ever closed, close /dev/null."""
    descriptors = {fd for sock in list(_OPEN_SOCKETS) if (fd := sock.fileno()) >= 0}
    _OPEN_SOCKETS.clear()  # a grandchild must not touch these numbers again
    if not descriptors:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in descriptors - {null}:
            with contextlib.suppress(OSError):
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):  # (subprocess's fork+exec runs no such handler)
    os.register_at_fork(after_in_child=_release_sockets_in_child)


def _host_of(address: object) -> str:
    """The host part of a socket address (IPv4 or IPv6 tuple; a string otherwise)."""
    return str(address[0]) if isinstance(address, tuple) else str(address)


def _set_nodelay(stream: trio.abc.Stream) -> None:
    if isinstance(stream, trio.SocketStream):
        try:
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        except OSError:  # pragma: no cover - e.g. a non-TCP socket
            logger.debug("could not set TCP_NODELAY", exc_info=True)


def remote_host_of(stream: trio.abc.Stream) -> str:
    """The remote host (IP) of a stream, for per-host limits; ``"?"`` when unknown."""
    if isinstance(stream, trio.SocketStream):
        try:
            peer = stream.socket.getpeername()
        except OSError:
            return "?"
        return str(peer[0]) if isinstance(peer, tuple) else str(peer)
    host = getattr(stream, "remote_host", None)
    return host if isinstance(host, str) else "?"


_CLOSED_ERRNOS = {errno.EBADF, errno.ENOTSOCK}


def _stream_error(exc: OSError) -> trio.ClosedResourceError | trio.BrokenResourceError:
    """A socket's error as trio's SocketStream.send_all translates it."""
    if exc.errno in _CLOSED_ERRNOS:
        return trio.ClosedResourceError("socket was already closed")
    return trio.BrokenResourceError(f"socket connection broken: {exc}")


def partial_sender(stream: trio.abc.Stream) -> PartialSender | None:
    """A way to write to ``stream`` that tells how much went out before a cancellation,
    or None when the stream cannot tell (``send_all`` cancelled midway leaves it unknown).

    A TCP stream writes to its socket as much as the kernel takes now, waiting (the only
    point where it can be cancelled, having sent nothing) while it takes nothing; a stream
    with a ``send_some`` method of that contract (the memory network's) defined on its
    class uses it. Errors are those of ``send_all``.
    """
    if isinstance(stream, trio.SocketStream):
        if os.name == "posix":  # (os.write on a socket's fileno is POSIX only)
            return _SocketSender(stream.socket)
        sock = stream.socket

        async def send_some(data: memoryview) -> int:
            try:
                return await sock.send(data)
            except OSError as exc:
                raise _stream_error(exc) from exc

        return send_some
    # Looked up on the class: a wrapper that forwards unknown attributes to the stream it
    # wraps (a rate limiter) must not hand out the inner stream's method, bypassing itself.
    if callable(getattr(type(stream), "send_some", None)):
        return stream.send_some  # type: ignore[attr-defined]
    return None


class _SocketSender:
    """``send_some`` for a TCP socket, with one pass through trio's scheduler per call.

    The kernel takes a large write a part at a time (trio sets ``TCP_NOTSENT_LOWAT`` to
    16 KiB, which keeps the unsent backlog short: on loopback ~130-196 KiB per ``send``),
    and writing the next part right away mostly succeeds. trio's ``socket.send`` yields to
    the scheduler after each part: ~800 passes per 64 MiB, each costing more than the write
    itself. This writes again at once while the kernel takes more, and waits for room only
    when it takes nothing."""

    __slots__ = ("_sock",)

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._sock = sock

    async def __call__(self, data: memoryview) -> int:
        await trio.lowlevel.checkpoint_if_cancelled()
        if type(data) is not memoryview or data.format != "B" or data.ndim != 1:
            data = memoryview(data).cast("B")  # slices below count bytes (bytes, float views)
        size = data.nbytes
        sent = 0
        while True:
            # -1 once closed; asked again after each wait (a closed number may be reused)
            fd = self._sock.fileno()
            try:
                while sent < size:
                    sent += os.write(fd, data[sent:] if sent else data)
            except BlockingIOError:
                if not sent:
                    await trio.lowlevel.wait_writable(self._sock)  # cancelled: sent nothing
                    continue
            except OSError as exc:
                if sent:  # what went out counts; the next call meets the error
                    break
                if fd < 0:
                    raise trio.ClosedResourceError("socket was already closed") from None
                raise _stream_error(exc) from exc
            break
        await trio.lowlevel.cancel_shielded_checkpoint()
        return sent
