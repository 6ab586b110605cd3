"""A round's plan (who reduces what, with which weights), shared helpers for its tasks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from peer import Peer, PeerUnavailableError, RemoteError
from protocol.address import Address
from protocol.identity import PeerID

from .config import AveragerConfig
from .grouping import Declaration
from .layout import Span
from .messages import GroupConfirmation
from .reducer import DropReason, Member, effective_weights

logger = logging.getLogger(__name__)

_UNDIALABLE = "client-mode.invalid"  # a host no lookup resolves (RFC 6761)


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything every member derives identically from the leader's confirmation."""

    round: int
    me: PeerID
    members: tuple[Declaration, ...]
    reducers: tuple[Declaration, ...]  # part i is reduced by reducers[i]
    spans: tuple[Span, ...]
    weights: dict[PeerID, float | None]  # staleness-decayed; None: too stale to count
    max_epoch: int

    @classmethod
    def of(cls, conf: GroupConfirmation, me: PeerID, config: AveragerConfig) -> Plan:
        members = tuple(Member(m.peer_id, m.weight, m.epoch) for m in conf.members)
        weights = effective_weights(members, config.max_staleness, config.staleness_decay)
        return cls(
            conf.round,
            me,
            conf.members,
            conf.reducers,
            conf.spans,
            weights,
            max(m.epoch for m in conf.members),
        )

    @property
    def group(self) -> tuple[PeerID, ...]:
        return tuple(m.peer_id for m in self.members)

    @property
    def my_part(self) -> int | None:
        return next((i for i, r in enumerate(self.reducers) if r.peer_id == self.me), None)

    def member(self, peer_id: PeerID) -> Declaration | None:
        return next((m for m in self.members if m.peer_id == peer_id), None)

    def address(self, peer_id: PeerID) -> Address | None:
        member = self.member(peer_id)
        if member is None or member.address is None:
            return None
        return Address.parse(member.address)


class Liveness:
    """Dead or frozen peers seen during a round (sticky), and the probe that finds them."""

    def __init__(self, node: Peer, plan: Plan, ping_method: str, timeout: float) -> None:
        self.node = node
        self.plan = plan
        self.ping_method = ping_method
        self.timeout = timeout
        self.bad: dict[PeerID, DropReason] = {}
        self.changed = trio.Event()

    def mark(self, peer_id: PeerID, reason: DropReason) -> None:
        if peer_id not in self.bad:
            logger.debug("round %d: %s is %s", self.plan.round, peer_id.short(), reason)
            self.bad[peer_id] = reason
            self.changed.set()
            self.changed = trio.Event()

    async def probe(self, peer_id: PeerID) -> DropReason | None:
        """Ping a peer whose part of the round went quiet: None when it answers that it is
        in the round, or its answer is late but its bytes keep coming; dead when its host
        refuses, or it is no longer in the round (even if it still sends us DHT traffic);
        frozen when it is silent. A client-mode peer is pinged over its connection to us
        (dead when it has none).

        On a CPU-starved host one 2 MiB chunk took 2.4 s to arrive, and a ping's answer
        queues behind it: only a peer that sends nothing at all, from shortly before the
        ping on, is frozen (every peer of 3 was dropped as frozen with ``stall_timeout``
        1.5 s under load before; none since)."""
        if peer_id in self.bad:
            return self.bad[peer_id]
        started = trio.current_time()
        address = self.plan.address(peer_id)
        if address is None:  # client mode: cannot be dialed, but a dead one's connection is gone
            if peer_id not in self.node.rpc.connected_peers():
                self.mark(peer_id, DropReason.DEAD)
                return DropReason.DEAD
            # Its connection to us is pooled under its PeerID and serves our calls too (no
            # scheduler pass in between: never dialed): ping it there, as a member that left
            # the round may still send us DHT traffic, and its bytes must not keep it in
            address = Address(_UNDIALABLE, 0, peer_id)
        with trio.move_on_after(self.timeout):
            try:
                await self.node.rpc.call(address, self.ping_method, {"round": self.plan.round})
            except PeerUnavailableError:
                self.mark(peer_id, DropReason.DEAD)
                return DropReason.DEAD
            except RemoteError as exc:
                # alive, but its step has ended (or its averager is closed): gone from the
                # round, it will neither send nor serve any more
                if exc.code in ("not_found", "unknown_method"):
                    self.mark(peer_id, DropReason.DEAD)
                    return DropReason.DEAD
            return None
        if self.node.rpc.last_heard(peer_id) >= started - self.timeout:  # busy, not frozen
            return None
        self.mark(peer_id, DropReason.FROZEN)
        return DropReason.FROZEN

    async def watch(
        self, peer_id: PeerID, last_progress: list[float], stall: float, scope: trio.CancelScope
    ) -> None:
        """Cancel ``scope`` once ``peer_id`` is known bad, or stalls ``stall`` seconds
        (``last_progress[0]``, trio time) and then fails a probe."""
        while True:
            if peer_id in self.bad:
                scope.cancel()
                return
            wait_until = last_progress[0] + stall
            if trio.current_time() >= wait_until:
                if await self.probe(peer_id) is not None:
                    scope.cancel()
                    return
                last_progress[0] = trio.current_time()
                continue
            with trio.move_on_at(wait_until):
                await self.changed.wait()
