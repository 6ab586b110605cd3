"""An in-memory network for tests: latency, partitions, crashes and stalls, on virtual time.

A :class:`MemoryNetwork` is a switchboard keyed by ``(host, port)``. Each simulated peer takes
its own host name and talks through its own interface, so that partitions and crashes are per
peer::

    net = MemoryNetwork(latency=0.05)
    a = net.interface("10.0.0.1")            # a Network: connect() comes from 10.0.0.1
    async with open_rpc_host(identity, listen=Address("10.0.0.1", 0), network=a) as host:
        ...
    net.partition(["10.0.0.1"], ["10.0.0.2", "10.0.0.3"])   # cross-group streams break
    net.kill_host("10.0.0.2")                                # listener gone, streams break
    net.drop_connections("10.0.0.3")                         # its streams reset, dials work

Rules:

- Every chunk written is delivered ``latency`` seconds later (in order); ``receive_some`` sleeps
  until the head chunk is due, so there are no background tasks and ``MockClock`` jumps straight
  to the delivery time. Buffers are unbounded (no flow control) unless the network has a
  ``window``: then ``send_all`` waits while that many bytes or more are unread in its
  direction (in flight or buffered), and queues its data whole once fewer are, so a peer
  that stops reading stalls its writers, as with TCP. ``slow_host`` adds a per-host delay
  on top (a peer behind a far link).
- ``connect`` to an address with no listener, a killed host, or across a partition raises
  ``ConnectionRefusedError``. ``connect`` to or from a frozen host waits until it is unfrozen.
- A broken stream raises ``trio.BrokenResourceError`` on send and receive; ``__cause__`` is a
  ``ConnectionResetError`` saying why.
- A frozen host's streams stay open but nothing is delivered to or from it until it is unfrozen.
- Hosts named in no group of :meth:`MemoryNetwork.partition` reach everyone.
- ``MemoryNetwork`` itself is also a :class:`Network`; its ``connect`` comes from a fresh
  anonymous host (``anon-N``) each time, which partitions and kills do not name.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
from collections import Counter, deque
from collections.abc import Iterable

import trio

from protocol.noise import BUSY_SIGNAL

from .network import AdmitFilter, ConnectionHandler

__all__ = ["MemoryInterface", "MemoryNetwork", "MemoryStream"]

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
_FIRST_EPHEMERAL_PORT = 40000
_EOF = b""


class _Pipe:
    """One direction of a connection: chunks with their due times; ``b""`` marks EOF."""

    __slots__ = ("chunks", "eof_received", "eof_sent", "last_due", "reader_closed", "unread")

    def __init__(self) -> None:
        self.chunks: deque[tuple[float, bytes]] = deque()
        self.unread = 0  # bytes in ``chunks``
        self.last_due = 0.0
        self.eof_sent = False
        self.eof_received = False
        self.reader_closed = False


class _Connection:
    __slots__ = ("broken", "hosts", "lot", "pipes")

    def __init__(self, client_host: str, server_host: str) -> None:
        self.hosts = (client_host, server_host)
        self.pipes = (_Pipe(), _Pipe())  # [0]: client -> server, [1]: server -> client
        self.broken: ConnectionResetError | None = None
        self.lot = trio.lowlevel.ParkingLot()

    def break_(self, why: str) -> None:
        if self.broken is None:
            self.broken = ConnectionResetError(errno.ECONNRESET, why)
            self.lot.unpark_all()

    @property
    def finished(self) -> bool:
        return self.broken is not None or all(p.reader_closed for p in self.pipes)


class MemoryStream(trio.abc.HalfCloseableStream):
    """One end of an in-memory connection."""

    def __init__(
        self, network: MemoryNetwork, conn: _Connection, side: int, ports: tuple[int, int]
    ) -> None:
        self._network = network
        self._conn = conn
        self._out = conn.pipes[side]
        self._in = conn.pipes[1 - side]
        self.local_host = conn.hosts[side]
        self.remote_host = conn.hosts[1 - side]
        self.local_port = ports[side]
        self.remote_port = ports[1 - side]
        self._closed = False
        self._receiving = False

    def __repr__(self) -> str:
        local = f"{self.local_host}:{self.local_port}"
        return f"<MemoryStream {local} -> {self.remote_host}:{self.remote_port}>"

    def _check_broken(self) -> None:
        if self._conn.broken is not None:
            raise trio.BrokenResourceError("connection broken") from self._conn.broken

    def _frozen(self) -> bool:
        frozen = self._network._frozen
        return self.local_host in frozen or self.remote_host in frozen

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        if self._closed or self._out.eof_sent:
            raise trio.ClosedResourceError("stream closed for sending")
        self._check_broken()
        if self._out.reader_closed:
            raise trio.BrokenResourceError("peer closed the stream") from ConnectionResetError(
                errno.EPIPE, "peer closed the stream"
            )
        if data:
            await self._wait_for_window()
            self._push(bytes(data))
            self._network.bytes_sent += len(data)
            self._network.bytes_sent_by[self.local_host] += len(data)

    async def send_some(self, data: bytes | bytearray | memoryview) -> int:
        """``send_all`` that says how much it sent: all of ``data``, or (cancelled) none,
        as a socket's ``send`` (see :func:`peer.network.partial_sender`)."""
        await self.send_all(data)
        return memoryview(data).nbytes

    async def _wait_for_window(self) -> None:
        """Wait while the network's ``window`` or more bytes are unread in our direction.

        Raises:
            trio.ClosedResourceError: if this end was closed meanwhile.
            trio.BrokenResourceError: if the connection broke or the peer closed its end.
        """
        window = self._network.window
        while window is not None and self._out.unread >= window:
            await self._conn.lot.park()
            if self._closed:
                raise trio.ClosedResourceError("stream closed while sending")
            self._check_broken()
            if self._out.reader_closed:
                raise trio.BrokenResourceError("peer closed the stream")

    def _push(self, chunk: bytes) -> None:
        network = self._network
        delay = network.latency + network.extra_latency(self.local_host, self.remote_host)
        due = max(trio.current_time() + delay, self._out.last_due)
        self._out.last_due = due
        self._out.chunks.append((due, chunk))
        self._out.unread += len(chunk)
        self._conn.lot.unpark_all()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()
        await self._wait_for_window()

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        if not self._out.eof_sent and self._conn.broken is None:
            self._out.eof_sent = True
            self._push(_EOF)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving")
        self._receiving = True
        try:
            return await self._receive(max_bytes)
        finally:
            self._receiving = False

    async def _receive(self, max_bytes: int | None) -> bytes:
        pipe = self._in
        while True:
            if self._closed:
                raise trio.ClosedResourceError("stream closed while receiving")
            self._check_broken()
            if pipe.eof_received:
                return b""
            if self._frozen() or not pipe.chunks:
                await self._conn.lot.park()
                continue
            due = pipe.chunks[0][0]
            if due > trio.current_time():
                with trio.move_on_at(due):
                    await self._conn.lot.park()
                continue
            data = self._take_due(pipe, max_bytes)
            pipe.unread -= len(data)
            if data and self._network.window is not None:
                self._conn.lot.unpark_all()  # a writer may wait for room
            return data

    @staticmethod
    def _take_due(pipe: _Pipe, max_bytes: int | None) -> bytes:
        now = trio.current_time()
        budget = max_bytes if max_bytes is not None else 1 << 30
        parts: list[bytes] = []
        while pipe.chunks and budget > 0 and pipe.chunks[0][0] <= now:
            due, chunk = pipe.chunks[0]
            if chunk == _EOF:
                if not parts:
                    pipe.chunks.popleft()
                    pipe.eof_received = True
                break
            if len(chunk) > budget:
                parts.append(chunk[:budget])
                pipe.chunks[0] = (due, chunk[budget:])
                break
            parts.append(chunk)
            budget -= len(chunk)
            pipe.chunks.popleft()
        return b"".join(parts)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if not self._out.eof_sent and self._conn.broken is None:
                self._out.eof_sent = True
                self._push(_EOF)
            self._in.reader_closed = True
            self._in.chunks.clear()
            self._in.unread = 0
            self._conn.lot.unpark_all()
            if self._conn.finished:
                self._network._connections.discard(self._conn)
        await trio.lowlevel.checkpoint()


class _Listener:
    __slots__ = ("admit", "handler", "nursery")

    def __init__(
        self, handler: ConnectionHandler, nursery: trio.Nursery, admit: AdmitFilter | None
    ) -> None:
        self.handler = handler
        self.nursery = nursery
        self.admit = admit


class MemoryNetwork:
    """A switchboard of in-memory streams keyed by ``(host, port)``, for tests on virtual time.

    Each simulated peer takes ``interface(host)`` as its network and listens on that host.
    Every chunk written arrives ``latency`` seconds later, in order (plus ``slow_host``'s
    extra delay); ``window`` bounds the unread bytes per direction (None: unbounded). Faults:
    ``partition(*groups)`` / ``heal()``, ``kill_host`` / ``revive_host``, ``freeze_host`` /
    ``unfreeze_host`` (streams stay open, nothing moves to or from the host meanwhile;
    what the other side already received stays received), ``drop_connections``. The
    module docstring gives the exact rules."""

    def __init__(self, *, latency: float = 0.0, window: int | None = None) -> None:
        self.latency = latency
        self.window = window
        """Most unread bytes per direction of a connection before ``send_all`` waits
        (None: no limit)."""
        self._listeners: dict[tuple[str, int], _Listener] = {}
        self._connections: set[_Connection] = set()
        self._groups: dict[str, int] = {}
        self._dead: set[str] = set()
        self._frozen: set[str] = set()
        self._slow: dict[str, float] = {}
        self._thaw = trio.lowlevel.ParkingLot()
        self._anon = itertools.count()
        self._ports: Counter[str] = Counter()
        self.bytes_sent = 0
        self.bytes_sent_by: Counter[str] = Counter()
        self.connections_opened = 0
        self.connections_refused = 0

    # -- topology -------------------------------------------------------------------------

    def interface(self, host: str) -> MemoryInterface:
        """A :class:`Network` whose connections come from (and listen on) ``host``."""
        return MemoryInterface(self, host)

    def set_latency(self, latency: float) -> None:
        """One-way delay for chunks written from now on."""
        self.latency = latency

    def slow_host(self, host: str, extra: float) -> None:
        """Add ``extra`` seconds to the one-way delay of every chunk ``host`` sends or
        receives from now on (a peer behind a slow, far link)."""
        self._slow[host] = extra

    def extra_latency(self, a: str, b: str) -> float:
        return self._slow.get(a, 0.0) + self._slow.get(b, 0.0)

    def partition(self, *groups: Iterable[str]) -> None:
        """Split hosts into groups that cannot reach each other; breaks cross-group streams."""
        self._groups = {host: i for i, group in enumerate(groups) for host in group}
        for conn in list(self._connections):
            if not self._reachable(*conn.hosts):
                self._break(conn, "network partitioned")

    def heal(self) -> None:
        """Undo :meth:`partition`."""
        self._groups = {}

    def drop_connections(self, host: str, other: str | None = None) -> int:
        """Reset every open connection of ``host`` (only those with ``other``, when given),
        as a NAT that forgets its mappings or a flaky link does; new dials go through.
        Returns how many were reset."""
        dropped = 0
        for conn in list(self._connections):
            if host in conn.hosts and (other is None or other in conn.hosts) and not conn.finished:
                self._break(conn, f"connection of {host} dropped")
                dropped += 1
        return dropped

    def kill_host(self, host: str) -> None:
        """Crash ``host``: its listeners vanish, its streams break, it cannot dial or be dialed."""
        self._dead.add(host)
        for key in [k for k in self._listeners if k[0] == host]:
            del self._listeners[key]
        for conn in list(self._connections):
            if host in conn.hosts:
                self._break(conn, f"host {host} died")

    def revive_host(self, host: str) -> None:
        """Let a killed host serve and connect again (a restart)."""
        self._dead.discard(host)

    def freeze_host(self, host: str) -> None:
        """Stall ``host``: its streams stay open but nothing reaches it or leaves it."""
        self._frozen.add(host)

    def unfreeze_host(self, host: str) -> None:
        """Resume delivery for ``host``; chunks that fell due meanwhile arrive at once."""
        self._frozen.discard(host)
        self._thaw.unpark_all()
        for conn in list(self._connections):
            if host in conn.hosts:
                conn.lot.unpark_all()

    @property
    def open_connections(self) -> int:
        """Connections not yet closed on both ends nor broken."""
        for conn in [c for c in self._connections if c.finished]:
            self._connections.discard(conn)
        return len(self._connections)

    def _reachable(self, a: str, b: str) -> bool:
        ga, gb = self._groups.get(a), self._groups.get(b)
        return ga is None or gb is None or ga == gb

    def _break(self, conn: _Connection, why: str) -> None:
        conn.break_(why)
        self._connections.discard(conn)

    # -- Network --------------------------------------------------------------------------

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """Connect from a fresh anonymous host.

        Raises:
            ConnectionRefusedError: no listener, dead host, or across a partition.
        """
        return await self._connect(f"anon-{next(self._anon)}", host, port)

    async def serve(
        self,
        host: str,
        port: int,
        handler: ConnectionHandler,
        *,
        admit: AdmitFilter | None = None,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` until cancelled (or until the host is killed); ``admit``
        as in :meth:`peer.network.Network.serve` (a refused dialer sees its stream end).

        Raises:
            OSError: if the address is taken or the host is dead.
        """
        await self._serve(host, port, handler, task_status, admit)

    async def _connect(self, source: str, host: str, port: int) -> trio.abc.Stream:
        await trio.lowlevel.checkpoint()
        while source in self._frozen or host in self._frozen:
            await self._thaw.park()
        if source in self._dead:
            raise OSError(errno.ENETDOWN, f"host {source} is down")
        listener = self._listeners.get((host, port))
        if listener is None or host in self._dead or not self._reachable(source, host):
            self.connections_refused += 1
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"connection to {host}:{port} refused")
        conn = _Connection(source, host)
        self._connections.add(conn)
        self.connections_opened += 1
        ports = (self._allocate_port(source), port)
        client = MemoryStream(self, conn, 0, ports)
        server = MemoryStream(self, conn, 1, ports)
        if listener.admit is not None and not listener.admit(source):
            listener.nursery.start_soon(_turn_away, server)
        else:
            listener.nursery.start_soon(_run_handler, listener.handler, server)
        return client

    async def _serve(
        self,
        host: str,
        port: int,
        handler: ConnectionHandler,
        task_status: trio.TaskStatus[int],
        admit: AdmitFilter | None = None,
    ) -> None:
        if host in self._dead:
            raise OSError(errno.EADDRNOTAVAIL, f"host {host} is down")
        if port == 0:
            port = self._allocate_port(host)
        key = (host, port)
        if key in self._listeners:
            raise OSError(errno.EADDRINUSE, f"{host}:{port} is already in use")
        async with trio.open_nursery() as nursery:
            listener = _Listener(handler, nursery, admit)
            self._listeners[key] = listener
            try:
                task_status.started(port)
                await trio.sleep_forever()
            finally:
                if self._listeners.get(key) is listener:
                    del self._listeners[key]
                nursery.cancel_scope.cancel()

    def _allocate_port(self, host: str) -> int:
        while True:
            port = _FIRST_EPHEMERAL_PORT + self._ports[host]
            self._ports[host] += 1
            if (host, port) not in self._listeners:
                return port


class MemoryInterface:
    """A :class:`Network` bound to one host of a :class:`MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, host: str) -> None:
        self.network = network
        self.host = host

    def __repr__(self) -> str:
        return f"<MemoryInterface {self.host}>"

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """Connect from this interface's host.

        Raises:
            ConnectionRefusedError: no listener, dead host, or across a partition.
            OSError: if this host is dead.
        """
        return await self.network._connect(self.host, host, port)

    async def serve(
        self,
        host: str,
        port: int,
        handler: ConnectionHandler,
        *,
        admit: AdmitFilter | None = None,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on this interface's host (``host`` must be it or a wildcard).

        Raises:
            OSError: if ``host`` is another host, the port is taken or the host is dead.
        """
        if host not in _WILDCARD_HOSTS and host != self.host:
            raise OSError(errno.EADDRNOTAVAIL, f"{host} is not this interface ({self.host})")
        await self.network._serve(self.host, port, handler, task_status, admit)


async def _run_handler(handler: ConnectionHandler, stream: MemoryStream) -> None:
    try:
        await handler(stream)
    except trio.BrokenResourceError:
        logger.debug("memnet handler for %r: stream broke", stream, exc_info=True)


async def _turn_away(stream: MemoryStream) -> None:
    """What TcpNetwork does to a refused connection: ``BUSY_SIGNAL``, then close."""
    try:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(BUSY_SIGNAL)
    finally:  # closed even when cancelled (the listener stopped first): else the dialer hangs
        await stream.aclose()
