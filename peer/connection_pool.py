"""The connection pool of an :class:`~peer.host.RpcHost` (a mixin): the connection each
call goes over, one per peer, dialed once however many calls wait for it (the rules at the
top of :mod:`peer.host`), and each connection's task.

A dial that proves our own PeerID met this very host (``SelfDialError``: its own address,
or another name for it, whose other end then comes in here within ``_ECHO_WAIT``), or
another process with our key: a twin (``DuplicateIdentityError``, and a warning once per
address).
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from protocol.address import Address, canonical_host
from protocol.identity import Identity, PeerID
from protocol.noise import IdentityMismatchError

from .admission import _CONNECTION_ERRORS
from .errors import (
    STOPPED,
    DuplicateIdentityError,
    PeerBusyError,
    PeerSilentError,
    PeerStoppedError,
    PeerUnavailableError,
    SelfDialError,
)
from .host_config import HostConfig
from .network import Network
from .receive_budget import ReceiveBudget
from .remote_hosts import host_group, is_loopback_host
from .rpc import HandlerRegistry, RpcConnection
from .secure import SecureStream, secure_handshake
from .send_budget import SendBudget

__all__ = ["WILDCARD_HOSTS", "ConnectionPool"]

logger = logging.getLogger("peer.host")  # (the pool was peer.host's: one logger)

WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
"""Listen hosts that mean every interface, and the host announced for them by default."""

_MAX_REMEMBERED_ADDRESSES = 4096
"""``HOST:PORT -> PeerID`` learnt by dialing, so later calls without a PeerID reuse the pool."""
LOST_REMEMBERED = 1024
"""Peers whose connections their side ended that ``RpcHost.lost_at`` remembers, newest."""
_ECHO_WAIT = 1.0
"""Seconds a dial that met our own PeerID waits for its other end to come in here."""


class _Dial:
    __slots__ = ("connection", "done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.connection: RpcConnection | None = None
        self.error: BaseException | None = None


class ConnectionPool:
    """The pool of :class:`~peer.host.RpcHost` (a mixin): the connection a call goes over
    (dialing it if needed), and each connection's task and bookkeeping."""

    # The host's state the pool reads and keeps, made (and explained) in RpcHost.__init__
    identity: Identity
    peer_id: PeerID
    config: HostConfig
    network: Network
    listen_address: Address | None
    announce_host: str | None
    stopped: bool
    connections_opened: int
    on_connection_lost: Callable[[PeerID], None] | None
    disconnected: trio.Event
    _nursery: trio.Nursery
    _handlers: HandlerRegistry
    _receive_budget: ReceiveBudget
    _send_budget: SendBudget
    _lost_at: OrderedDict[PeerID, float]
    _connections: dict[RpcConnection, PeerID]
    _by_peer: dict[PeerID, RpcConnection]
    _by_address: dict[str, PeerID]
    _dials: dict[tuple[str, PeerID | None], _Dial]
    _dialing: dict[str, _Dial]
    _inbound: dict[str, list[RpcConnection]]
    _twins_warned: set[str]
    _own_id_dialed: float
    _own_id_inbound_at: float
    _own_id_inbound: trio.Event

    if TYPE_CHECKING:  # RpcHost's own

        def check_loop(self) -> None: ...

    def _pooled(self, address: Address) -> RpcConnection | None:
        peer_id = address.peer_id or self._by_address.get(address.hostport)
        connection = self._by_peer.get(peer_id) if peer_id is not None else None
        # (not one closing after our bye: a request written after it is never read)
        return connection if connection is not None and not connection.closing else None

    async def _connection(self, address: Address) -> RpcConnection:
        self.check_loop()
        if self.stopped:
            raise PeerStoppedError(STOPPED)
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
                error = PeerSilentError
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
            await self._nursery.start(
                functools.partial(self._serve_connection, dialed=address.hostport),
                secure,
                self.peer_id,
            )
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
        dialed: str | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve a secure connection until it ends; ``group``: the host group of an
        inbound one (it is then one of that host's, for :meth:`_idlest_inbound`);
        ``dialed``: the HOST:PORT of an outbound one;
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
        connection.dialed = dialed
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
            if connection.lost and peer_id not in self._by_peer:
                self._lost_at[peer_id] = trio.current_time()
                self._lost_at.move_to_end(peer_id)
                if len(self._lost_at) > LOST_REMEMBERED:
                    self._lost_at.popitem(last=False)
                if self.on_connection_lost:
                    self.on_connection_lost(peer_id)
            self.disconnected.set()
            self.disconnected = trio.Event()

    def _promote(self, peer_id: PeerID) -> None:
        """After the pooled connection to ``peer_id`` ended, pool another live one, if any."""
        others = [(i.raw, id(c), c) for c, i in self._connections.items() if c.peer_id == peer_id]
        others = [entry for entry in others if not entry[2].closing]
        if others:
            self._by_peer[peer_id] = min(others)[2]


def _identity_mismatch(error: BaseException | None) -> bool:
    """Whether a dial failed because the peer there proved another PeerID than asked."""
    while error is not None:
        if isinstance(error, IdentityMismatchError):
            return True
        error = error.__cause__
    return False
