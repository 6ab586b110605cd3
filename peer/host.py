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
- Inbound: who comes in, and whose slot a newcomer takes, is ``peer.admission``'s.
- A peer that stops reading what we send is cut off once a write to it has stalled for
  ``send_timeout`` (checked every quarter of it; the idle timer spares a connection with
  calls in flight, so it would otherwise keep its connection slot, its requests and their
  queued replies forever).
- Each connection lives in its own task; whatever a peer does, only its connection ends.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

import trio

from protocol.address import Address
from protocol.identity import Identity, PeerID
from protocol.rpc import MAX_INFLIGHT_REQUESTS

from .admission import _CONNECTION_ERRORS, InboundAdmission
from .connection_pool import _MAX_REMEMBERED_ADDRESSES, ConnectionPool, _Dial
from .connection_pool import WILDCARD_HOSTS as WILDCARD_HOSTS
from .errors import STOPPED, PeerStoppedError
from .host_config import HostConfig
from .network import Network, TcpNetwork, open_files_limit
from .ratelimit import HostRateLimiter
from .receive_budget import ReceiveBudget
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
from .secure import secure_handshake
from .send_budget import SendBudget

__all__ = ["HostConfig", "RpcHost", "open_rpc_host"]

logger = logging.getLogger(__name__)


class RpcHost(ConnectionPool, InboundAdmission):
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
        # -> trio time that happened last (see lost_at), for the LOST_REMEMBERED latest
        self._lost_at: OrderedDict[PeerID, float] = OrderedDict()
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

    def lost_at(self, peer_id: PeerID) -> float:
        """trio time the last connection with ``peer_id`` was ended by its side (closed,
        reset, broken; not after a ``bye``: its idle timer, or room for another peer) with
        none left open (-inf: not among the latest ``LOST_REMEMBERED``). The averager
        reads it for client-mode peers, which it cannot ping: one whose connection ended
        so during a round may have died."""
        return self._lost_at.get(peer_id, -math.inf)

    def last_heard(self, peer_id: PeerID, *, pooled: bool = False) -> float:
        """trio time bytes from ``peer_id`` last arrived, on any open connection (-inf:
        none), part of a frame included. A peer whose answer to one call is late but whose
        bytes keep coming is busy, not frozen. Now, while we are the ones not reading one
        of its connections (its frame waits for room in the receive budget): the averager
        took such peers for frozen, and dropped them, when its pings' answers queued
        behind that frame.

        ``pooled``: only the connection our calls to it use. Bytes over another one say
        nothing of that one: a NAT that forgot it loses what is written there, while the
        peer, having dialed afresh, talks to us over a second connection (an outside
        tester: the dead one was taken for busy and kept, rounds held to their timeout)."""
        connections = [c for c in self._connections if c.peer_id == peer_id]
        if pooled:
            connections = [c for c in connections if self._by_peer.get(peer_id) is c]
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
            raise PeerStoppedError(STOPPED)
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

    def reached_elsewhere(self, address: Address) -> str | None:
        """The HOST:PORT we dialed the connection that calls to ``address`` use now, when
        it is not ``address``'s (None: no such connection, one the peer dialed, or one we
        dialed there). A peer that restarted elsewhere answers calls to its old address over
        its connection at the new one: that proves the new address, not the old."""
        connection = self._pooled(address)
        dialed = None if connection is None else connection.dialed
        return dialed if dialed is not None and dialed != address.hostport else None

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
        await self._nursery.start(
            functools.partial(self._serve_connection, dialed=address.hostport),
            secure,
            self.peer_id,
        )
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
