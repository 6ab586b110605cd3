"""The RPC host: a listener, a pool of secure connections (one per peer), and the handlers.

    async with open_rpc_host(identity, listen=Address("0.0.0.0", 0)) as host:
        host.register("ping", ping)
        reply = await host.call(Address.parse("PEERID@10.0.0.2:4000"), "ping", {"x": 1})

Rules:

- One connection per peer pair, used both ways: inbound connections serve our outbound calls
  too. When both peers dialed each other at once, both keep using the connection dialed by
  the peer with the smaller PeerID; the other one idles out.
- Concurrent calls to a peer we are not connected to share one dial. A dial (connect and
  handshake) is bounded by ``dial_timeout``; with ``address.peer_id`` set, the handshake must
  prove that identity.
- Inbound: at ``max_connections_per_ip`` from one host (one /64 for IPv6: a single
  subscriber holds a whole /64), a new connection from it takes the slot of that host's own
  oldest handshake still in progress after a second (a silent connection: an honest
  handshake takes a round trip), else of its inbound connection idle the longest (no call
  in flight, quiet for a second at least: a crowd behind one NAT must not wait a minute for
  one to idle out); failing both, the new one is closed at once. (Idle connections went
  first before: 1,000 silent connections from the address of 50 honest peers left 44-78 %
  of their calls to the node busy until the handshakes timed out, 10 s.) Another host's
  connections are never closed for it. Over ``max_connections`` in all, the oldest
  connection still in its handshake a second after it opened is cut off to make room
  (connections that send nothing must not lock every other peer out; one we had not
  answered yet gets the busy signal, as refused ones do); else the inbound connection idle
  the longest gives its slot; else the oldest handshake not answered yet (a connection that
  sent nothing we could answer, told busy); failing all, the new one is closed at once,
  after the busy signal (a handshake we answered is never cut for it before it stalls: its
  dialer would not be told busy). An idle connection closes for a newcomer (after a
  ``bye``) only once the newcomer's handshake has completed, each idle connection for one
  newcomer at a time, so that connections that send nothing close none (up to 4 newcomers
  of one host wait so at once, 16 in all; beyond, or while every idle connection is
  promised, a newcomer takes the place of the oldest handshake not answered yet, or is
  turned away); when it got busy meanwhile, the newcomer is closed
  after a ``bye`` instead (its dialer sends what crossed it again on a fresh connection).
  A handshake not done within ``handshake_timeout`` is cut off. A host that opens
  connections faster than ``handshake_rate_per_ip`` per second (beyond a burst of
  ``handshake_burst_per_ip``) has the new ones closed at once, before the handshake's CPU
  is spent on them (loopback addresses only with ``rate_limit_loopback``).
- A peer that stops reading what we send is cut off once a write to it has stalled for
  ``send_timeout`` (checked every quarter of it; the idle timer spares a connection with
  calls in flight, so it would otherwise keep its connection slot, its requests and their
  queued replies forever).
- Each connection lives in its own task; whatever a peer does, only its connection ends.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

import trio

from protocol.address import Address, canonical_host
from protocol.errors import ProtocolError
from protocol.identity import Identity, PeerID
from protocol.noise import IdentityMismatchError
from protocol.rpc import MAX_INFLIGHT_REQUESTS

from .errors import (
    DuplicateIdentityError,
    PeerBusyError,
    PeerStoppedError,
    PeerUnavailableError,
    SelfDialError,
)
from .host_config import HostConfig
from .network import Network, TcpNetwork, open_files_limit, remote_host_of
from .ratelimit import HostRateLimiter
from .receive_budget import ReceiveBudget
from .remote_hosts import host_group, is_loopback_host
from .rpc import (
    ConnectionClosedError,
    Handler,
    HandlerRegistry,
    QuickHandler,
    Reply,
    ReplyStream,
    RpcConnection,
    StreamHandler,
)
from .secure import SecureStream, secure_handshake, turn_away
from .send_budget import SendBudget

__all__ = ["HostConfig", "RpcHost", "open_rpc_host"]

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
"""Listen hosts that mean every interface, and the host announced for them by default."""

_MAX_REMEMBERED_ADDRESSES = 4096
"""``HOST:PORT -> PeerID`` learnt by dialing, so later calls without a PeerID reuse the pool."""
_ECHO_WAIT = 1.0
"""Seconds a dial that met our own PeerID waits for its other end to come in here."""
_OWN_DIAL_WINDOW = 10.0
"""Seconds after a dial of ours met our own PeerID during which a connection that comes in
proving it is taken for that dial's other end, not another process with our key."""
_EVICT_AFTER = 1.0
"""Seconds an inbound connection must have been idle to be closed for a newcomer when every
slot is taken (a flood of new connections must not evict each other at once)."""
_ONE_HOSTS_WAITING = 4
"""Newcomers of one host at most that wait at once for an idle connection's slot (see
``_DEFERRED_EVICTIONS``); beyond, that host's next newcomers are turned away, told busy."""
_DEFERRED_EVICTIONS = 16
"""Newcomers at most, at a node with every slot taken, whose handshakes go on while an idle
connection waits to give them its slot once they complete (``_ONE_HOSTS_WAITING`` of
them from one host): a connection that never completes its handshake then
closes no honest one (a silent flood, one connection from each of many hosts, closed an
idle connection each; a review). Beyond, the oldest of them is cut off for a newcomer. The
node so holds up to this many sockets over ``max_connections``, within the files that
``peer.network.FD_RESERVE`` keeps aside."""
_STOPPED = "this peer has stopped: its open_peer context has ended"  # (the DHT's words too)
_CONNECTION_ERRORS = (
    PeerUnavailableError,
    ProtocolError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
)


class _Dial:
    __slots__ = ("connection", "done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.connection: RpcConnection | None = None
        self.error: BaseException | None = None


class RpcHost:
    """Calls to and from peers; made by :func:`open_rpc_host`."""

    def __init__(
        self, identity: Identity, network: Network, config: HostConfig, nursery: trio.Nursery
    ) -> None:
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        self.config = config
        self.network = network
        self._receive_budget = ReceiveBudget(
            config.receive_budget, config.receive_stall_timeout, config.receive_budget_per_host
        )
        self._send_budget = SendBudget(config.send_budget, config.send_budget_per_host)
        if config.max_inflight_requests < MAX_INFLIGHT_REQUESTS:
            logger.warning(
                "HostConfig.max_inflight_requests is %d: peers may keep %d requests in flight "
                "(the protocol's number, and every other peer's default), and this node drops "
                "the connection of one that has more than %d",
                config.max_inflight_requests,
                MAX_INFLIGHT_REQUESTS,
                config.max_inflight_requests,
            )
        self.listen_address: Address | None = None
        self._nursery = nursery
        self._handlers = HandlerRegistry()
        # Called with a peer whose last connection the peer's side ended (closed, reset):
        # it may have left (the DHT pings it).
        self.on_connection_lost: Callable[[PeerID], None] | None = None
        # set, and replaced by a fresh one, each time a connection ends: wait on the
        # current one to learn of the next (a peer that cannot be dialed, gone)
        self.disconnected = trio.Event()
        self._connections: dict[RpcConnection, PeerID] = {}  # -> the PeerID that dialed
        self._by_peer: dict[PeerID, RpcConnection] = {}
        self._by_address: dict[str, PeerID] = {}
        self._dials: dict[tuple[str, PeerID | None], _Dial] = {}
        self._dialing: dict[str, _Dial] = {}  # HOST:PORT -> the oldest dial to it in flight
        # inbound handshakes in progress, oldest first -> (remote host, trio time begun)
        self._handshakes: dict[trio.CancelScope, tuple[str, float]] = {}
        # those of them let in at a full node (or at their host's limit), each to take an
        # idle connection's slot once done -> their host group, or None at a full node
        self._deferred: dict[trio.CancelScope, str | None] = {}
        self._cut_waited = False  # the handshake just cut off waited so (see _cut_off)
        self._answered: set[trio.CancelScope] = set()  # handshakes we replied to
        # Inbound connections per host (or /64), handshakes included; one closed for a
        # newcomer from its host counts until its handler has finished (the newcomer in its
        # slot makes the host one over meanwhile), so each one is counted down once.
        self._per_host: Counter[str] = Counter()
        self._inbound: dict[str, list[RpcConnection]] = {}  # established, per host, oldest first
        self._handshake_rate = HostRateLimiter(
            config.handshake_rate_per_ip, config.handshake_burst_per_ip
        )
        self._admit_in_handler = False  # the network's serve() takes no ``admit`` filter
        self.max_connections = config.max_connections
        """``config.max_connections``, or fewer when the process may not open that many
        files (see ``TcpNetwork.connection_budget``): a node with 1024 slots under
        ``ulimit -n 64`` failed every accept once its files ran out, and newcomers got in
        only when the idle timeout closed a connection."""
        budget = getattr(network, "connection_budget", None)
        budget = budget() if callable(budget) else None
        if isinstance(budget, int) and budget < self.max_connections:
            self.max_connections = budget
        self.connections_opened = 0
        """Connections established so far, both directions (each one a handshake)."""
        self.stopped = False
        """True once the host's context has ended: calls raise PeerStoppedError."""
        self._trio_token = trio.lowlevel.current_trio_token()  # made inside its nursery
        self._twins_warned: set[str] = set()  # addresses that proved our own PeerID
        self._own_id_dialed = -math.inf  # when a dial of ours last met our own PeerID
        self._own_id_inbound_at = -math.inf  # when a connection in last proved it
        self._own_id_inbound = trio.Event()  # set (and replaced) by each such connection
        self.twin: tuple[str, float] | None = None
        """The latest sure sign of another process with our key: where (its ``HOST:PORT``,
        or the host it dialed us from) and when (trio time); None if none was seen. Set
        when it dialed us, and by the DHT when an address others knew us at proved our
        PeerID; not by any dial of ours that proves it (``_twin``): an address of this very
        host under another name (``localhost``) does too."""
        self.announce_host: str | None = None
        """The host others are told to dial us at, when it is not the listen host."""

    def check_loop(self) -> None:
        """Refuse a caller that is not on this host's trio loop.

        A background peer's ``node.peer`` awaited from another thread's ``trio.run`` got
        its answer and then killed the peer: the reply woke the caller's task from the
        peer's loop (trio's internal assertion), and every later call said only "stopped".

        Raises:
            RuntimeError: when called outside this host's trio run.
        """
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            token = None
        if token is not self._trio_token:
            raise RuntimeError(
                f"{self!r} runs on another trio loop (a background peer's thread?): await "
                "its methods there, through node.run(...), or call the blocking methods"
            )

    def __repr__(self) -> str:
        return f"<RpcHost {self.peer_id.short()} at {self.listen_address}>"

    @property
    def _handshaking(self) -> int:
        """Inbound handshakes in progress."""
        return len(self._handshakes)

    @property
    def handshakes_refused(self) -> int:
        """Inbound connections closed unanswered because their host opened them too fast."""
        return self._handshake_rate.refused

    @property
    def num_connections(self) -> int:
        """Established connections (both directions)."""
        return len(self._connections)

    def connected_peers(self) -> list[PeerID]:
        """Peers with an open connection."""
        return [peer for peer, conn in self._by_peer.items() if not conn.closed]

    def last_heard(self, peer_id: PeerID) -> float:
        """trio time bytes from ``peer_id`` last arrived, on any open connection (-inf:
        none), part of a frame included. A peer whose answer to one call is late but whose
        bytes keep coming is busy, not frozen. Now, while we are the ones not reading one
        of its connections (its frame waits for room in the receive budget): the averager
        took such peers for frozen, and dropped them, when its pings' answers queued
        behind that frame."""
        connections = [c for c in self._connections if c.peer_id == peer_id]
        if any(c.not_reading for c in connections):
            return trio.current_time()
        return max((c.last_received for c in connections), default=-math.inf)

    # -- handlers --------------------------------------------------------------------------

    def register(self, method: str, handler: Handler) -> None:
        """Serve ``method`` with ``handler``.

        Raises:
            ValueError: if ``method`` is already registered.
        """
        self._handlers.register(method, handler)

    def register_quick(self, method: str, handler: QuickHandler) -> None:
        """Serve ``method`` with a plain function that answers at once from memory; it
        runs on the connection's reader with no task of its own (cheaper per request).

        Raises:
            ValueError: if ``method`` is already registered.
        """
        self._handlers.register_quick(method, handler)

    def register_stream(self, method: str, handler: StreamHandler) -> None:
        """Serve ``method`` with an async generator of reply items.

        Raises:
            ValueError: if ``method`` is already registered.
        """
        self._handlers.register_stream(method, handler)

    def unregister(self, method: str) -> None:
        """Stop serving ``method``: later requests answer ``unknown_method`` (calls already
        running finish); the name is free to register again."""
        self._handlers.unregister(method)

    # -- calls -----------------------------------------------------------------------------

    async def call(
        self,
        address: Address | str,
        method: str,
        body: dict[str, Any] | None = None,
        payload: bytes | memoryview = b"",
    ) -> Reply:
        """Call ``method`` on the peer at ``address`` (an Address, or its text form
        ``PEERID@HOST:PORT`` such as ``node.address``; dialing it if needed).

        Bound it with a cancel scope: the time left is sent along as the call's deadline.

        Raises:
            RemoteError: the peer's handler failed or refused (``code`` says how).
            PeerUnavailableError: cannot connect, wrong identity, or the connection died.
            LimitExceededError: the request exceeds the maximum frame size.
            ProtocolError: ``address`` is text that is not a valid address.
        """
        address = _as_address(address)
        self.check_loop()
        if self.stopped:
            raise PeerStoppedError(_STOPPED)
        # A pooled connection is used without a scheduler pass: the call checkpoints.
        connection = self._pooled(address) if address.peer_id != self.peer_id else None
        if connection is None:
            connection = await self._connection(address)
        try:
            return await connection.call(method, body, payload)
        except ConnectionClosedError:  # closed (idle) just before we sent: never sent
            connection = await self._connection(address)
            return await connection.call(method, body, payload)

    def stream(
        self,
        address: Address | str,
        method: str,
        body: dict[str, Any] | None = None,
        payload: bytes | memoryview = b"",
    ) -> AbstractAsyncContextManager[AsyncIterator[Reply]]:
        """Call a streaming ``method`` (``address`` as in :meth:`call`); iterate the
        context's value for the items.

        Iteration raises what :meth:`call` raises; leaving early cancels the call. Like a
        call, a request the peer closed the (idle) connection on before reading it is sent
        again on a fresh connection, once: the peer never saw it, and no item came.
        """
        return self._stream(_as_address(address), method, body, payload)

    @asynccontextmanager
    async def _stream(
        self,
        address: Address,
        method: str,
        body: dict[str, Any] | None,
        payload: bytes | memoryview,
    ) -> AsyncIterator[AsyncIterator[Reply]]:
        async with contextlib.AsyncExitStack() as calls:

            async def start() -> ReplyStream:
                connection = await self._connection(address)
                return await calls.enter_async_context(connection.stream(method, body, payload))

            try:
                items = await start()
            except ConnectionClosedError:  # closed (idle) just before we sent: never sent
                items = await start()
            yield _RetriedOnce(items, start)

    async def connect(self, address: Address) -> PeerID:
        """Dial ``address`` (or reuse a connection) and return the proven remote PeerID.

        Raises:
            PeerUnavailableError: cannot connect, or the peer proved another identity.
        """
        return (await self._connection(address)).peer_id

    def dialed(self, address: Address) -> bool:
        """Whether a connection we dialed to ``address.hostport`` proved ``address.peer_id``
        (remembered for the last few thousand addresses). A call over a pooled connection
        proves the peer's id, not that it listens at the address the caller named."""
        peer_id = address.peer_id
        return peer_id is not None and self._by_address.get(address.hostport) == peer_id

    async def prove_address(self, address: Address) -> bool:
        """Whether a peer holding ``address.peer_id``'s key listens at ``address``: dial it
        on a connection of its own (never the pool: a pooled connection the peer opened
        proves its id, not where it listens) and complete the handshake. Bounded by
        ``dial_timeout``; afterwards :meth:`dialed` knows the answer too.

        The proven connection is then served like any other, not closed: the peer cannot
        tell it from a dial of ours and may pool it at once (the tie-break of simultaneous
        dials), and its calls over a connection we closed would fail."""
        if address.peer_id is None or address.peer_id == self.peer_id or self.stopped:
            return False
        try:
            with trio.fail_after(self.config.dial_timeout):
                raw = await self.network.connect(address.host, address.port)
                secure = await secure_handshake(
                    raw, self.identity, initiator=True, expected_peer_id=address.peer_id
                )
        except (*_CONNECTION_ERRORS, trio.TooSlowError) as exc:
            logger.debug("%s did not prove its id there: %r", address, exc)
            return False
        if self.stopped:  # our nursery may be closed to new tasks
            await trio.aclose_forcefully(secure)
            return False
        if len(self._by_address) >= _MAX_REMEMBERED_ADDRESSES:
            self._by_address.clear()
        self._by_address[address.hostport] = address.peer_id
        await self._nursery.start(self._serve_connection, secure, self.peer_id)
        return True

    async def disconnect(self, peer_id: PeerID) -> None:
        """Close every connection to ``peer_id`` (pending calls fail)."""
        for connection in [c for c in self._connections if c.peer_id == peer_id]:
            await connection.aclose()

    async def close_connections(self) -> None:
        """Close every connection; the listener keeps serving."""
        for connection in list(self._connections):
            await connection.aclose()

    async def drain(self, limit: float) -> None:
        """Let every connection finish the requests it serves and write what it queued,
        for at most ``limit`` seconds."""
        with trio.move_on_after(limit):
            async with trio.open_nursery() as nursery:
                for connection in list(self._connections):
                    nursery.start_soon(connection.flush)

    async def aclose(self) -> None:
        """Stop listening and close everything (the host cannot be used afterwards)."""
        self._nursery.cancel_scope.cancel()
        await trio.lowlevel.checkpoint()

    # -- the pool --------------------------------------------------------------------------

    def _pooled(self, address: Address) -> RpcConnection | None:
        peer_id = address.peer_id or self._by_address.get(address.hostport)
        connection = self._by_peer.get(peer_id) if peer_id is not None else None
        # (not one closing after our bye: a request written after it is never read)
        return connection if connection is not None and not connection.closing else None

    async def _connection(self, address: Address) -> RpcConnection:
        self.check_loop()
        if self.stopped:
            raise PeerStoppedError(_STOPPED)
        if address.peer_id == self.peer_id and self._is_own(address):
            raise SelfDialError(f"{address} is this host itself")
        if (connection := self._pooled(address)) is not None:
            await trio.lowlevel.checkpoint()
            return connection
        key = (address.hostport, address.peer_id)
        dial = self._dials.get(key)
        if dial is None and (other := self._dialing.get(address.hostport)) is not None:
            # The same HOST:PORT dialed meanwhile under its other name (with or without
            # the PeerID): its connection serves when it proves the PeerID we name, if any
            # (two spellings of one peer made two dials, two connections; a review). Its
            # failure is ours too (a second dial doubled the wait for an unreachable host,
            # a review of the fix), unless it failed to prove a PeerID that we do not ask
            # (it asked another: the same HOST:PORT named under an old and a new key).
            await other.done.wait()
            if (connection := self._pooled(address)) is not None:
                return connection
            if other.connection is not None:  # it proved another PeerID there
                raise PeerUnavailableError(
                    f"cannot reach {address}: {address.hostport} proved another PeerID, "
                    f"{other.connection.peer_id.short()}"
                )
            dial = self._dials.get(key) if _identity_mismatch(other.error) else other
        if dial is None:
            dial = self._dials[key] = _Dial()
            self._dialing.setdefault(address.hostport, dial)
            self._nursery.start_soon(self._dial, address, key, dial)
        await dial.done.wait()
        if dial.connection is None:
            error = PeerUnavailableError  # the kind is kept: a busy peer is no dead one
            if isinstance(dial.error, SelfDialError | PeerBusyError):
                error = type(dial.error)
            detail = str(dial.error)
            if isinstance(dial.error, trio.TooSlowError):  # (it has no text of its own)
                detail = f"no connection within the dial timeout ({self.config.dial_timeout:g} s)"
            raise error(f"cannot reach {address}: {detail}") from dial.error
        return dial.connection

    def _is_own(self, address: Address) -> bool:
        """Whether ``address`` may be this host's own: our port, at the host we listen at
        or announce (or any host, when we listen on all interfaces). Any other address (any
        at all, in client mode) that proves our PeerID is another process's: a twin on a
        machine cloned with our key file, listening on all interfaces at our port, goes
        unseen here (its averaging declarations still show it)."""
        listen = self.listen_address
        if listen is None or address.port != listen.port:
            return False
        host = canonical_host(address.host)
        return listen.host in WILDCARD_HOSTS or host in (listen.host, self.announce_host)

    def _twin(self, address: Address) -> DuplicateIdentityError:
        """The error (and a warning, once per address) for another process with our key."""
        message = (
            f"{address.hostport} proved this peer's own PeerID {self.peer_id.short()}...: "
            "another process uses the same identity (a copied key file?), and peers cannot "
            "tell the two apart; give each peer its own identity"
        )
        self._warn_twin(address.hostport, message)
        return DuplicateIdentityError(message)

    async def _came_back(self, since: float) -> bool:
        """Whether a connection came in proving our own PeerID since ``since`` (or does
        within ``_ECHO_WAIT``): a dial of ours that met our PeerID reached this very host
        (an address of ours under another name, ``localhost`` for ``127.0.0.1``: taken for
        another process with our key, it was warned of as one), not a twin. The dialer's
        handshake ends first; the other end's, in this process, a moment later."""
        if self._own_id_inbound_at < since:
            with trio.move_on_after(_ECHO_WAIT):
                await self._own_id_inbound.wait()
        return self._own_id_inbound_at >= since

    def _warn_twin(self, where: str, message: str) -> None:
        if where not in self._twins_warned:
            if len(self._twins_warned) < 64:
                self._twins_warned.add(where)
            logger.warning("%s", message)

    async def _dial(self, address: Address, key: tuple[str, PeerID | None], dial: _Dial) -> None:
        try:
            started = trio.current_time()
            with trio.fail_after(self.config.dial_timeout):
                raw = await self.network.connect(address.host, address.port)
                secure = await secure_handshake(
                    raw, self.identity, initiator=True, expected_peer_id=address.peer_id
                )
            if secure.remote_peer_id == self.peer_id:
                self._own_id_dialed = trio.current_time()  # (see the inbound side's check)
                await secure.aclose()
                if self._is_own(address):
                    raise SelfDialError(f"{address} is this host itself")
                if await self._came_back(started):
                    raise SelfDialError(f"{address} is this host itself, under another name")
                raise self._twin(address)
            if len(self._by_address) >= _MAX_REMEMBERED_ADDRESSES:
                self._by_address.clear()
            self._by_address[address.hostport] = secure.remote_peer_id
            await self._nursery.start(self._serve_connection, secure, self.peer_id)
            dial.connection = self._by_peer.get(secure.remote_peer_id)
            if dial.connection is None:
                raise PeerUnavailableError(f"the connection to {address} closed at once")
        except (*_CONNECTION_ERRORS, trio.TooSlowError, UnicodeError) as exc:
            # (UnicodeError: a host name the resolver cannot encode; Address refuses those)
            logger.debug("dial %s failed: %r", address, exc)
            dial.error = exc
        finally:
            del self._dials[key]
            if self._dialing.get(key[0]) is dial:
                del self._dialing[key[0]]
            dial.done.set()

    async def _cut_off_stalled_readers(self) -> None:
        """Close each connection whose write in progress began ``send_timeout`` ago."""
        timeout = self.config.send_timeout
        while True:
            await trio.sleep(timeout / 4)
            now = trio.current_time()
            for connection in list(self._connections):
                started = connection.write_started
                if started is not None and now - started >= timeout:
                    logger.debug("%r: %r read nothing for %.1f s", self, connection, timeout)
                    connection.abort(PeerUnavailableError("the peer stopped reading"))

    async def _serve_connection(
        self,
        secure: SecureStream,
        initiator: PeerID,
        *,
        group: str | None = None,
        busy: bool = False,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve a secure connection until it ends; ``group``: the host group of an
        inbound one (it is then one of that host's, for :meth:`_idlest_inbound`);
        ``busy``: no slot is left for it, so it closes after a ``bye`` at once (the peer
        sends what crossed it again on a fresh connection)."""
        config = self.config
        connection = RpcConnection(
            secure,
            secure.remote_peer_id,
            self._handlers,
            remote_host=secure.remote_host,
            max_frame_size=config.max_frame_size,
            max_inflight_requests=config.max_inflight_requests,
            idle_timeout=config.idle_timeout,
            silence_timeout=config.silence_timeout,
            receive_budget=self._receive_budget,
            send_budget=self._send_budget,
            # local experiments run every peer on one loopback address: no share apart
            receive_group=(
                None if is_loopback_host(secure.remote_host) else host_group(secure.remote_host)
            ),
        )
        peer_id = connection.peer_id
        self.connections_opened += 1
        self._connections[connection] = initiator
        current = self._by_peer.get(peer_id)
        if current is None or current.closing or initiator.raw < self._connections[current].raw:
            self._by_peer[peer_id] = connection
        logger.debug("%r: connected to %s at %s", self, peer_id.short(), secure.remote_host)
        if group is not None:
            self._inbound.setdefault(group, []).append(connection)
        if busy:
            logger.debug("%r: no slot left for %s, closing its connection", self, peer_id.short())
            connection.close_idle_nowait(PeerBusyError("every connection slot is taken"))
        try:
            await connection.run(task_status=task_status)
        finally:
            del self._connections[connection]
            if group is not None:
                self._inbound[group].remove(connection)
                if not self._inbound[group]:
                    del self._inbound[group]
            if self._by_peer.get(peer_id) is connection:
                del self._by_peer[peer_id]
                self._promote(peer_id)
            logger.debug("%r: disconnected from %s", self, peer_id.short())
            if connection.lost and peer_id not in self._by_peer and self.on_connection_lost:
                self.on_connection_lost(peer_id)
            self.disconnected.set()
            self.disconnected = trio.Event()

    def _promote(self, peer_id: PeerID) -> None:
        """After the pooled connection to ``peer_id`` ended, pool another live one, if any."""
        others = [(i.raw, id(c), c) for c, i in self._connections.items() if c.peer_id == peer_id]
        others = [entry for entry in others if not entry[2].closing]
        if others:
            self._by_peer[peer_id] = min(others)[2]

    def _admit(self, host: str) -> bool:
        """Whether to take an inbound connection from ``host`` at all (before any object
        or task is made for it): not when the host already holds
        ``max_connections_per_ip`` of them and none is idle (the handler, which checks
        again, lets the newcomer wait for one that is), nor when it opens them faster than
        ``handshake_rate_per_ip`` (loopback excepted, see ``HostConfig``)."""
        group = host_group(host)
        at_limit = self._per_host[group] >= self.config.max_connections_per_ip
        if at_limit and self._idlest_inbound(group) is None and not self._stalled(group):
            logger.debug("%r: refusing %s: too many connections from it", self, host)
            return False
        limited = self.config.rate_limit_loopback or not is_loopback_host(host)
        if limited and not self._handshake_rate.allow(group, trio.current_time()):
            logger.debug("%r: refusing %s: it opens connections too fast", self, host)
            return False
        return True

    async def _handle_inbound(self, raw: trio.abc.Stream) -> None:
        host = remote_host_of(raw)
        group = host_group(host)
        config = self.config
        if self._admit_in_handler and not self._admit(host):
            await turn_away(raw)
            return
        # Where the newcomer waits for an idle connection to give it its slot once its
        # handshake completes (see _DEFERRED_EVICTIONS): its host, or any (None).
        deferred: tuple[str | None] | None = None
        over = True  # let in with every slot taken: it needs one once its handshake completes
        at_host_limit = self._per_host[group] >= config.max_connections_per_ip
        self._cut_waited = False
        if at_host_limit:
            # The host's own stalled handshake, else its idle connection once the newcomer's
            # handshake completes (a few at once), else the place of its oldest handshake
            # not answered yet, else busy (see _cut_off_unanswered); never an idle
            # connection for a newcomer whose handshake has not completed
            if self._cut_off_stalled_handshake(group):
                pass
            elif self._can_defer(group):
                deferred = (group,)
            elif self._cut_off_unanswered(group):
                pass  # (in its place: waiting for an idle slot if it did, see below)
            else:
                logger.debug("%r: refusing %s: too many connections from it", self, host)
                await turn_away(raw)
                return
        elif len(self._handshakes) + len(self._connections) >= self.max_connections:
            # A stalled handshake first; then an idle connection once the handshake
            # completes (16 newcomers at most, 4 of one host: a flood of silent
            # connections larger than the idle ones closed one each, a review); then the
            # place of the oldest handshake not answered yet; else busy. A handshake we
            # answered is never cut before it stalls: its dialer would not be told busy
            # (a NAT's crowd cutting off its own oldest failed 29 of 100 joins, a review)
            if self._cut_off_stalled():
                pass
            elif self._can_defer(None, host=group):
                deferred = (None,)
            elif self._cut_off_unanswered():
                pass
            else:
                logger.debug("%r: refusing %s: %d connections", self, host, self.max_connections)
                await turn_away(raw)
                return
        else:
            over = False
        if self._cut_waited and deferred is None:
            # in the place of one that waited for an idle slot: this one waits so too
            # (else the handshakes over the limit grew by 16 a second under a flood of
            # silent connections from new hosts, each cutting a stalled one; a review)
            deferred = (group if at_host_limit else None,)
        self._per_host[group] += 1
        handshake = trio.CancelScope(deadline=trio.current_time() + config.handshake_timeout)
        self._handshakes[handshake] = (host, trio.current_time())
        if deferred is not None:
            self._deferred[handshake] = deferred[0]
        try:
            try:
                with handshake:
                    secure = await secure_handshake(
                        raw,
                        self.identity,
                        initiator=False,
                        # cut off to make room (not timed out, not closing): say busy
                        busy_if_cancelled=lambda: handshake not in self._handshakes,
                        on_reply=lambda: self._answered.add(handshake),
                    )
            finally:
                self._handshakes.pop(handshake, None)
                self._deferred.pop(handshake, None)
                self._answered.discard(handshake)
            if handshake.cancelled_caught:  # too slow, or cut off to make room
                logger.debug("%r: handshake with %s cut off", self, host)
                return
            if secure.remote_peer_id == self.peer_id:
                self._own_id_inbound_at = trio.current_time()
                self._own_id_inbound.set()
                self._own_id_inbound = trio.Event()
                await secure.aclose()
                # our own dial, to an address of ours we did not know for one (only such
                # dials may lead here; the dialer finishes its handshake first), or another
                # process with our key (it dialed us)
                ours = trio.current_time() - self._own_id_dialed < _OWN_DIAL_WINDOW
                if not ours and not any(key[1] in (None, self.peer_id) for key in self._dials):
                    where = f"{host} (it dialed us)"
                    self.twin = (where, trio.current_time())
                    self._warn_twin(
                        where,
                        f"a process at {host} proved this peer's own PeerID "
                        f"{self.peer_id.short()}...: another process uses the same identity "
                        "(a copied key file?), and peers cannot tell the two apart; give each "
                        "peer its own identity",
                    )
                return
            busy = over and not self._make_room(group)
            await self._serve_connection(secure, secure.remote_peer_id, group=group, busy=busy)
        except (*_CONNECTION_ERRORS, trio.TooSlowError) as exc:
            logger.debug("%r: inbound connection from %s failed: %r", self, host, exc)
        finally:
            self._per_host[group] -= 1
            if not self._per_host[group]:
                del self._per_host[group]

    def _can_defer(self, group: str | None, host: str | None = None) -> bool:
        """Whether a newcomer at a full node (at ``group``'s limit, when given; from
        ``host``, a host group) may go on with its handshake and take an idle connection's
        slot once it completes: fewer such newcomers are in progress than the caps
        (``_DEFERRED_EVICTIONS`` in all, with the handshakes over the limit in all;
        ``_ONE_HOSTS_WAITING`` for one host) and than the idle connections there."""
        if len(self._deferred) >= _DEFERRED_EVICTIONS:  # (bounds the files held over the limit)
            return False
        if len(self._handshakes) + len(self._connections) >= (
            self.max_connections + _DEFERRED_EVICTIONS
        ):
            return False
        if group is None:
            waiting = len(self._deferred)
            if host is not None:
                mine = sum(host_group(self._handshakes[h][0]) == host for h in self._deferred)
                if mine >= _ONE_HOSTS_WAITING:
                    return False
        else:
            waiting = sum(scope == group for scope in self._deferred.values())
            if waiting >= _ONE_HOSTS_WAITING:
                return False
        return len(self._idle_inbound(group)) > waiting

    def _cut_off_unanswered(self, group: str | None = None) -> bool:
        """Make room for a newcomer: cut off the oldest handshake in progress (from
        ``group``, when given) that we have not replied to yet, whatever its age: its
        dialer sent nothing we could answer (a silent connection), and is told busy. One
        we replied to is cut off only once stalled: its dialer would not be told busy (a
        NAT's crowd so cut failed 56 of 60 joins), while refusing newcomers whenever the
        waiting places were full let a flood of young silent connections keep fresh
        peers out (48 of 50; a review). False when there is none such."""
        found = next(
            (
                handshake
                for handshake, (host, _) in self._handshakes.items()  # oldest first
                if handshake not in self._answered and (group is None or host_group(host) == group)
            ),
            None,
        )
        if found is None:
            return False
        logger.debug("%r: all slots taken, cutting off a handshake not answered yet", self)
        self._cut_off(found)
        return True

    def _cut_off(self, handshake: trio.CancelScope) -> None:
        """Cancel an inbound handshake to make room (it then says busy); it no longer
        counts, nor waits for an idle connection (its task still sends the busy signal:
        left in ``_deferred`` meanwhile, it was cut off a second time, a KeyError that
        took the host down; a review)."""
        del self._handshakes[handshake]
        if handshake in self._deferred:
            del self._deferred[handshake]
            self._cut_waited = True  # the newcomer taking its place waits so (see the caller)
        handshake.cancel()

    def _make_room(self, group: str) -> bool:
        """Whether an inbound connection from ``group`` whose handshake just completed may
        stay: there is a slot for it among the established ones (per host and in all,
        those closing not counted), or an idle inbound connection closes to give it one."""
        limit = self.config.max_connections_per_ip
        mine = self._inbound.get(group, [])
        if len(mine) >= limit and sum(not c.closing for c in mine) >= limit:
            # its host's idle connection frees a slot in all too (another host's was
            # closed as well when our own dials held the node over its limit; a review)
            return self._evict_idle_inbound(group)
        if len(self._connections) >= self.max_connections:
            live = sum(not c.closing for c in self._connections)
            if live >= self.max_connections and not self._evict_idle_inbound():
                return False
        return True

    def _cut_off_stalled(self) -> bool:
        """Make room for a new inbound connection: cancel the oldest handshake in progress
        when it began ``_EVICT_AFTER`` seconds ago or more (a peer that connects and sends
        nothing holds a slot until ``handshake_timeout``; an honest handshake takes a round
        trip). False when there is none such."""
        oldest = next(iter(self._handshakes.items()), None)  # oldest first
        if oldest is None:
            return False
        handshake, (host, began) = oldest
        if trio.current_time() - began < _EVICT_AFTER:
            return False
        logger.debug("%r: all slots taken, cutting off the handshake with %s", self, host)
        self._cut_off(handshake)
        return True

    def _stalled(self, group: str) -> trio.CancelScope | None:
        """The oldest handshake from ``group`` still in progress ``_EVICT_AFTER`` seconds
        after it began (a connection that sends nothing), or None."""
        now = trio.current_time()
        for handshake, (host, began) in self._handshakes.items():  # oldest first
            if now - began < _EVICT_AFTER:
                return None
            if host_group(host) == group:
                return handshake
        return None

    def _cut_off_stalled_handshake(self, group: str) -> bool:
        """Make room for a new inbound connection from ``group`` at its limit: cancel its
        oldest stalled handshake (see :meth:`_stalled`), which then says busy. False when
        it has none."""
        handshake = self._stalled(group)
        if handshake is None:
            return False
        logger.debug("%r: per-host slots taken, cutting off a stalled handshake", self)
        self._cut_off(handshake)
        return True

    def _evict_idle_inbound(self, group: str | None = None) -> bool:
        """Make room for a new inbound connection when every slot holds an established one
        (of ``group``'s slots, when given): close, after a ``bye``, the inbound connection
        idle the longest (see :meth:`_idlest_inbound`). Connections kept open with a ping
        now and then must not lock every other peer out; an honest peer evicted so dials
        again when it needs us. False when there is none."""
        oldest = self._idlest_inbound(group)
        if oldest is None:
            return False
        logger.debug("%r: all slots taken, closing %r, idle the longest", self, oldest)
        oldest.close_idle_nowait(PeerUnavailableError("closed to make room for another peer"))
        return True

    def _idlest_inbound(self, group: str | None = None) -> RpcConnection | None:
        """The inbound connection (from ``group`` only, when given) idle the longest: not
        closing already, no call in flight either way, quiet for ``_EVICT_AFTER`` seconds
        at least (a flood of new connections must not evict each other at once). None
        when none is idle."""
        return min(self._idle_inbound(group), key=lambda c: c.last_activity, default=None)

    def _idle_inbound(self, group: str | None = None) -> list[RpcConnection]:
        """The inbound connections (from ``group`` only, when given) idle enough to be
        closed for a newcomer (see :meth:`_idlest_inbound`)."""
        if group is None:
            inbound = [c for c, initiator in self._connections.items() if initiator != self.peer_id]
        else:
            inbound = self._inbound.get(group, [])
        now = trio.current_time()
        return [
            c
            for c in inbound
            if not c.closing and not c.num_inflight and now - c.last_activity >= _EVICT_AFTER
        ]


class _RetriedOnce:
    """The items of a stream whose request may turn out unread by the peer (its idle timer
    closed the connection first: the first item raises ``ConnectionClosedError``): then
    the items of the same request started again by ``start``, once."""

    def __init__(self, items: ReplyStream, start: Callable[[], Awaitable[ReplyStream]]) -> None:
        self._items = items
        self._start: Callable[[], Awaitable[ReplyStream]] | None = start

    def __aiter__(self) -> _RetriedOnce:
        return self

    async def __anext__(self) -> Reply:
        try:
            item = await self._items.__anext__()
        except ConnectionClosedError:
            if self._start is None:
                raise
            start, self._start = self._start, None
            self._items = await start()
            return await self._items.__anext__()
        self._start = None  # an item came: the peer read the request
        return item


def _identity_mismatch(error: BaseException | None) -> bool:
    """Whether a dial failed because the peer there proved another PeerID than asked."""
    while error is not None:
        if isinstance(error, IdentityMismatchError):
            return True
        error = error.__cause__
    return False


def _as_address(address: Address | str) -> Address:
    """``address``, parsed when it is text (raises ProtocolError if malformed, TypeError
    for anything else)."""
    if isinstance(address, Address):
        return address
    if isinstance(address, str):
        return Address.parse(address)
    raise TypeError(
        f"address must be an Address or 'PEERID@HOST:PORT' text, not {type(address).__name__}"
    )


_few_files_warned = False


def _warn_few_files(configured: int, budget: int) -> None:
    """Once per process: the file limit holds the host below ``max_connections``."""
    global _few_files_warned
    if not _few_files_warned:
        _few_files_warned = True
        logger.warning(
            "this process may open too few files (%s) for HostConfig.max_connections=%d: "
            "at most %d connections, the idlest closed for newcomers; raise the limit "
            "(ulimit -n, or LimitNOFILE= in a systemd unit)", open_files_limit(), configured,
            budget,
        )  # fmt: skip


@asynccontextmanager
async def open_rpc_host(
    identity: Identity,
    *,
    listen: Address | None,
    network: Network | None = None,
    config: HostConfig = HostConfig(),
) -> AsyncIterator[RpcHost]:
    """An :class:`RpcHost` listening on ``listen`` (``None``: client mode, no listener).

    The listener is up before the host is yielded (``host.listen_address`` has the bound
    port). Leaving the context normally first lets the connections finish the requests
    they serve and write what they queued (at most ``config.drain_timeout``), then closes
    every connection and stops every task; leaving it by an exception does so at once.

    Raises:
        OSError: if the listen address cannot be bound.
    """
    network = TcpNetwork() if network is None else network
    body_error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        host = RpcHost(identity, network, config, nursery)
        if math.isfinite(config.send_timeout):
            nursery.start_soon(host._cut_off_stalled_readers)
        try:
            if listen is not None:
                serve: Callable[..., Awaitable[None]] = network.serve
                if "admit" in inspect.signature(serve).parameters:
                    serve = partial(serve, admit=host._admit)
                else:  # a Network of the user's own, written before ``admit``
                    host._admit_in_handler = True
                port = await nursery.start(serve, listen.host, listen.port, host._handle_inbound)
                host.listen_address = Address(listen.host, port, identity.peer_id)
                # (not for the usual 1024: 992 slots instead of 1024 is no news)
                if host.max_connections < 0.9 * config.max_connections:
                    _warn_few_files(config.max_connections, host.max_connections)
            yield host
            # a clean exit: others get what we were sending them (bounded)
            await host.drain(config.drain_timeout)
        except BaseException as exc:  # re-raised below, outside the nursery (no group)
            body_error = exc
        finally:
            host.stopped = True
            nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error
