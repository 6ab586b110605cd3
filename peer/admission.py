"""The inbound admission policy of an :class:`~peer.host.RpcHost`: which connections
come in, and whose slot a newcomer takes when the node (or its host's share) is full.

Inbound: at ``max_connections_per_ip`` from one host (one /64 for IPv6: a single
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
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

import trio

from protocol.errors import ProtocolError
from protocol.identity import Identity, PeerID

from .errors import PeerUnavailableError
from .host_config import HostConfig
from .network import remote_host_of
from .ratelimit import HostRateLimiter
from .remote_hosts import host_group, is_loopback_host
from .rpc import RpcConnection
from .secure import SecureStream, secure_handshake, turn_away

__all__ = ["InboundAdmission"]

logger = logging.getLogger("peer.host")  # (its rules were peer.host's: one logger)

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
_CONNECTION_ERRORS = (
    PeerUnavailableError,
    ProtocolError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
)


class InboundAdmission:
    """The inbound half of :class:`~peer.host.RpcHost` (a mixin): the listener's handler,
    and the rules above for who gets a slot."""

    # The host's state these rules read and keep, made (and explained) in RpcHost.__init__
    identity: Identity
    peer_id: PeerID
    config: HostConfig
    max_connections: int
    twin: tuple[str, float] | None
    _connections: dict[RpcConnection, PeerID]
    _dials: Mapping[tuple[str, PeerID | None], object]
    _handshakes: dict[trio.CancelScope, tuple[str, float]]
    _deferred: dict[trio.CancelScope, str | None]
    _cut_waited: bool
    _answered: set[trio.CancelScope]
    _per_host: Counter[str]
    _inbound: dict[str, list[RpcConnection]]
    _handshake_rate: HostRateLimiter
    _admit_in_handler: bool
    _own_id_dialed: float
    _own_id_inbound_at: float
    _own_id_inbound: trio.Event

    if TYPE_CHECKING:  # RpcHost's own (the pool's)

        async def _serve_connection(
            self,
            secure: SecureStream,
            initiator: PeerID,
            *,
            group: str | None = None,
            busy: bool = False,
            dialed: str | None = None,
            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
        ) -> None: ...

        def _warn_twin(self, where: str, message: str) -> None: ...

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
