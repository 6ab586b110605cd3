"""A round's plan (who reduces what, with which weights), shared helpers for its tasks."""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack
import trio

from peer import Peer, PeerUnavailableError, RemoteError
from peer.remote_hosts import UNDIALABLE_HOST, over_its_connection
from protocol.address import Address
from protocol.identity import PeerID

from .config import AveragerConfig
from .grouping import Declaration
from .layout import Span
from .messages import TAG_BYTES, GroupConfirmation
from .reducer import DropReason, Member, effective_weights

logger = logging.getLogger(__name__)


MAX_RECONNECTS = 2
"""Broken connections to one peer that a round survives: a call that fails on a reset
connection is retried once a ping (over a fresh dial) finds the peer still in the round. A
link that keeps breaking is given up on: the peer is then dead for the rest of the round."""


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
    group_id: bytes = field(kw_only=True)  # our messages of the round name it: group_tag

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
            group_id=group_tag(conf),
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
        """Where to reach ``peer_id``, its PeerID included, so that the handshake proves
        who answers (declarations name it, ``Declaration.from_wire``)."""
        member = self.member(peer_id)
        if member is None or member.address is None:
            return None
        return Address.parse(member.address).with_peer_id(peer_id)


@dataclass
class _SharedProbe:
    """A probe under way, whose answer the other callers share (``Liveness.probe``,
    ``Liveness.reconnect``)."""

    done: trio.Event = field(default_factory=trio.Event)
    finished: bool = False  # it came to a verdict (False: its caller was cancelled first)


def group_tag(conf: GroupConfirmation) -> bytes:
    """The tag our chunks, result requests and pings of the round carry: a digest of the
    confirmation as we received it (the round, the leader's random draw, each member's
    declaration as the all-reduce reads it, the spans): the first TAG_BYTES (16) bytes of
    its SHA-256. A leader that tried draws to find two confirmations with one tag would
    need ~2**64 of them (with 62 bits, ~2**31 were within a reviewer's reach).

    Members of one honest leader's group all compute the same tag. Members that a lying
    leader told different things (each join gets its own answer) compute different ones,
    and take each other's messages for another group's (``not_found``), not for garbage:
    so data that fails our checks under our own tag was sent by a member that received
    exactly our confirmation, and is its own doing, whoever led the round (see
    ``Averager._bench_garbage``)."""
    members = [
        (m.peer_id.raw, m.address or "", float(m.weight), int(m.epoch), float(m.bandwidth),
         m.layout)
        for m in conf.members
    ]  # fmt: skip
    spans = [[int(a), int(b)] for a, b in conf.spans]
    packed = msgpack.packb([conf.round, conf.group_id, members, spans], use_bin_type=True)
    return hashlib.sha256(packed).digest()[:TAG_BYTES]


class Liveness:
    """Dead or frozen peers seen during a round (sticky), and the probe that finds them."""

    def __init__(self, node: Peer, plan: Plan, ping_method: str, timeout: float) -> None:
        self.node = node
        self.plan = plan
        self.ping_method = ping_method
        self._ping_body = {"round": plan.round, "group": plan.group_id}
        self.timeout = timeout
        self.bad: dict[PeerID, DropReason] = {}
        # of those marked dead or timeout, the ones that said their step had ended: alive
        self.left: set[PeerID] = set()
        self.changed = trio.Event()
        self._reconnects: dict[PeerID, int] = {}
        self._reconnecting: dict[PeerID, _SharedProbe] = {}
        self._probing: dict[PeerID, _SharedProbe] = {}
        self._alive_at: dict[PeerID, float] = {}  # see alive_at
        self._clients_gone: dict[PeerID, float] = {}  # since when, see mark_gone_clients
        self._probed_unconnected: set[PeerID] = set()  # see unconnected_servers

    def mark(self, peer_id: PeerID, reason: DropReason) -> None:
        if peer_id not in self.bad:
            logger.debug("round %d: %s is %s", self.plan.round, peer_id.short(), reason)
            self.bad[peer_id] = reason
            self.changed.set()
            self.changed = trio.Event()

    def mark_left(self, peer_id: PeerID, reason: DropReason = DropReason.DEAD) -> None:
        """``peer_id`` answered that it is no longer in the round (its step ended, was
        cancelled, or its averager closed): dropped as dead, since it will neither send nor
        serve any more, but the report's note says it was alive. A member's own word that
        its step ended (its withdrawal, ``Butterfly._withdraw``) drops it as ``timeout``."""
        if peer_id not in self.bad:
            self.left.add(peer_id)
        self.mark(peer_id, reason)

    def mark_gone_clients(self, peers: Iterable[PeerID]) -> float:
        """Mark dead each client-mode peer among ``peers`` that has had no connection to us
        for ``timeout / 2``. Only for peers that did connect to us this round (their chunks
        came, or their side ended a connection: ``ReducerService._heard_from``): a client
        cannot be dialed, so a dead one's connections are gone (what :meth:`probe` finds,
        a stall timeout later); the grace lets a live one whose connection broke (a write
        cut off midway tears it) dial us again.

        Returns:
            When the next of them would be found dead (trio time; inf when none is gone).
        """
        now = trio.current_time()
        grace = self.timeout / 2
        due = math.inf
        connected: set[PeerID] | None = None
        for peer_id in peers:
            if peer_id in self.bad or self.plan.address(peer_id) is not None:
                continue
            if connected is None:
                connected = set(self.node.rpc.connected_peers())
            if peer_id in connected:
                self._clients_gone.pop(peer_id, None)
                continue
            since = self._clients_gone.setdefault(peer_id, now)
            # the same sum as the deadline returned: ``now - since >= grace`` could still
            # be False at ``now == since + grace`` (rounding), and a caller that waits
            # until the deadline then spun there (for good under a virtual clock, which
            # jumps to a deadline and never past it: an outside tester's fuzzer)
            if now >= since + grace:
                self.mark(peer_id, DropReason.DEAD)
            else:
                due = min(due, since + grace)
        return due

    def unconnected_servers(self, peers: Iterable[PeerID]) -> list[PeerID]:
        """Full-mode peers among ``peers`` that have no connection to us any more: probe
        them now (each is returned once, until it is connected again). Only for peers that
        did connect to us this round. A killed process resets its connections, and the
        probe's fresh dial is refused at once; without it, a reducer whose only wait left
        was a killed member's download held its step until ``stall_timeout`` (a new-user
        trial: one survivor of a ``kill -9`` came out 5 s after the others)."""
        connected: set[PeerID] | None = None
        found = []
        for peer_id in peers:
            if peer_id in self.bad or self.plan.address(peer_id) is None:
                continue
            if connected is None:
                connected = set(self.node.rpc.connected_peers())
            if peer_id in connected:
                self._probed_unconnected.discard(peer_id)
            elif peer_id not in self._probed_unconnected:
                self._probed_unconnected.add(peer_id)
                found.append(peer_id)
        return found

    def alive_at(self, peer_id: PeerID) -> float:
        """When ``peer_id`` was last known alive by a probe that returned None: its answer,
        or, when the answer was late but bytes came (busy), the last of those bytes. The
        next probe is due a stall timeout after that, not after the probe: a peer frozen
        right after its last bytes was otherwise waited for a stall timeout more (3 in all
        instead of 2; ``tests/training/test_frozen_reducer_timing.py``)."""
        return self._alive_at.get(peer_id, trio.current_time())

    async def probe(self, peer_id: PeerID) -> DropReason | None:
        """Ping a peer whose part of the round went quiet: None when it answers that it is
        in the round, or its answer is late but its bytes keep coming; dead when its host
        refuses, or it is no longer in the round (even if it still sends us DHT traffic);
        frozen when it is silent, also over a fresh dial (its pooled connection, closed
        first, may be the silent one). A client-mode peer is pinged over its connection to
        us (dead when it has none).

        On a CPU-starved host one 2 MiB chunk took 2.4 s to arrive, and a ping's answer
        queues behind it: only a peer that sends nothing at all, from shortly before the
        ping on, is frozen (every peer of 3 was dropped as frozen with ``stall_timeout``
        1.5 s under load before; none since)."""
        # one probe per peer at a time, the others share its answer: the upload, the
        # download and our reducer all watch the same peer, and each probe of a silent
        # connection closes the peer's connections (see below)
        while True:
            if peer_id in self.bad:
                return self.bad[peer_id]
            running = self._probing.get(peer_id)
            if running is None:
                break
            await running.done.wait()
            if running.finished:
                return self.bad.get(peer_id)
            # its prober was cancelled (the upload whose call it was has ended): no
            # verdict, which read as alive, and its watchers waited a stall timeout more
        shared = self._probing[peer_id] = _SharedProbe()
        try:
            answer = await self._probe(peer_id)
            shared.finished = True
            return answer
        finally:
            del self._probing[peer_id]
            shared.done.set()

    async def _probe(self, peer_id: PeerID) -> DropReason | None:
        started = trio.current_time()
        address = self.plan.address(peer_id)
        if address is None:  # client mode: cannot be dialed, but a dead one's connection is gone
            if peer_id not in self.node.rpc.connected_peers():
                self.mark(peer_id, DropReason.DEAD)
                return DropReason.DEAD
            # Its connection to us is pooled under its PeerID and serves our calls too (no
            # scheduler pass in between: never dialed): ping it there, as a member that left
            # the round may still send us DHT traffic, and its bytes must not keep it in
            address = over_its_connection(peer_id)
        answer = await self._ping(peer_id, address)
        if answer is not DropReason.FROZEN:
            return self._answered(peer_id, answer)
        heard = self.node.rpc.last_heard(peer_id, pooled=True)  # (where our calls wait)
        if heard >= started - self.timeout:  # busy, not frozen
            self._alive_at[peer_id] = heard
            return None
        if address.host != UNDIALABLE_HOST:
            # Silence on the pooled connection may be the connection's, not the peer's: a
            # NAT or middlebox that dropped it loses what is written, with no reset, and
            # every round used it again (two honest peers "frozen" to each other until the
            # host's send_timeout). Its calls fail now (and are retried, see reconnect);
            # a peer that answers over a fresh dial is alive.
            await self.node.rpc.disconnect(peer_id)
            answer = await self._ping(peer_id, address)
            if answer is not DropReason.FROZEN:
                return self._answered(peer_id, answer)
        self.mark(peer_id, DropReason.FROZEN)
        return DropReason.FROZEN

    def _answered(self, peer_id: PeerID, answer: DropReason | None) -> DropReason | None:
        if answer is None:
            self._alive_at[peer_id] = trio.current_time()
        return answer

    async def _ping(self, peer_id: PeerID, address: Address) -> DropReason | None:
        """One ping naming the round and group: None when the peer answers that it is in
        it; dead (marked) when it cannot be reached or is no longer in the round; frozen
        (not marked: the caller decides) when no answer came within ``timeout``.

        A ping whose connection breaks is sent once more, over a fresh dial: the peer may
        be closing our connection as its old one while we ping (see :meth:`_probe`), and a
        pooled connection the peer closed while our process was stopped still looks open
        until its reader runs, so a ping written on it fails at once (without the fresh
        dial, a member stopped for 8 s found every live member dead on waking, and the
        others took its own values for its part: an outside trial)."""
        with trio.move_on_after(self.timeout):
            try:
                try:
                    await self.node.rpc.call(address, self.ping_method, self._ping_body)
                except PeerUnavailableError:
                    await self.node.rpc.call(address, self.ping_method, self._ping_body)
            except PeerUnavailableError:
                self.mark(peer_id, DropReason.DEAD)
                return DropReason.DEAD
            except RemoteError as exc:
                # alive, but its step has ended (or its averager is closed): gone from the
                # round, it will neither send nor serve any more
                if exc.code in ("not_found", "unknown_method"):
                    self.mark_left(peer_id)
                    return DropReason.DEAD
            return None
        return DropReason.FROZEN

    async def reconnect(self, peer_id: PeerID) -> bool:
        """A call to ``peer_id`` failed because its connection broke (or could not be
        made): whether to retry it. Yes when a ping, dialing again, finds the peer still in
        the round: the connection was reset (a NAT or a middlebox dropped it, or the peer
        could not be dialed only until its own connection to us came up), not the peer.
        Calls that failed together (one connection) share one ping; after
        ``MAX_RECONNECTS`` such episodes in a round the peer is marked dead, as are peers
        whose ping fails (see :meth:`probe`)."""
        while True:
            if peer_id in self.bad:
                return False
            pending = self._reconnecting.get(peer_id)
            if pending is None:
                break
            await pending.done.wait()
            if pending.finished:
                return peer_id not in self.bad
            # its caller was cancelled before a verdict (as in probe): ask again
        if self._reconnects.get(peer_id, 0) >= MAX_RECONNECTS:
            self.mark(peer_id, DropReason.DEAD)
            return False
        self._reconnects[peer_id] = self._reconnects.get(peer_id, 0) + 1
        shared = self._reconnecting[peer_id] = _SharedProbe()
        try:
            alive = await self.probe(peer_id) is None
            shared.finished = True
        finally:
            del self._reconnecting[peer_id]
            shared.done.set()
        logger.debug(
            "round %d: connection to %s broke; %s",
            self.plan.round, peer_id.short(), "retrying" if alive else "giving up",
        )  # fmt: skip
        return alive

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
                last_progress[0] = max(last_progress[0], self.alive_at(peer_id))
                continue
            with trio.move_on_at(wait_until):
                await self.changed.wait()
