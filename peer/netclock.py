"""Network time: this machine's clock plus the median offset of its peers' clocks.

Averaging rounds are slots of wall time, and DHT records expire at absolute times, so the
peers of a run must agree on the time. With the default 2 s gather window, a peer whose
clock was 1 s off met the others in 2 of 6 steps, and at 3 s or more in none (it said "no
partner"); one behind by more than a declaration's lifetime stored records that had
already expired for everyone else. A volunteer's machine without NTP is often seconds off.

So each peer asks a few others for their clock (``clock.now``), estimates each offset from
the midpoint of the round trip (wrong by at most half of it, so an estimate within half
the round trip of zero counts as zero), and runs on its own clock
plus the median of those offsets, its own (zero) counted as one. A minority of wrong or
lying clocks does not move the median, and a skewed machine follows the majority.

- A peer asked for the time asks the caller back (over the same connection, at most once
  per ``interval`` per host), so that two peers that meet agree at once (each moves
  halfway), and a node everyone joins through follows the swarm, not its own clock.
- Answers carry the answering machine's own clock, never its corrected one: corrections do
  not feed on each other.
- One sample per host (``peer.remote_hosts.host_group``: an IPv4 address, an IPv6 /64): many
  identities on one machine count once, so that a crowd of them cannot outvote the rest.
  On loopback each peer counts (they share this machine's clock anyway).
- The offset moves only when the median moves by more than ``threshold``: an NTP-synced
  swarm keeps its own clocks, and round-trip jitter does not shift round slots to and fro.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import trio

from protocol.address import Address
from protocol.errors import SwarmError
from protocol.identity import PeerID
from protocol.messages import ClockPeekRequest, ClockRequest, ClockResponse

from .calls import Reply, Request
from .config_types import check_field_types
from .host import RpcHost
from .remote_hosts import host_group, is_loopback_host, over_its_connection

__all__ = ["ClockConfig", "ClockService", "NetworkClock", "wall_clock"]

logger = logging.getLogger(__name__)

_ASK_BACK_WORKERS = 4
_ENOUGH_PICKED = 3  # picked samples below which the periodic ask dials contacts
_CATCH_UP_EVERY = 10.0  # seconds; at most this often, a node with too few picks again
_SLOW_ROUND_TRIP = 0.2
"""Seconds: a host whose answer took longer is asked again (twice at most, 1-3 s apart),
and its fastest answer counts: a busy answerer (its loop computing) is seldom busy at
every try, and the estimate errs by up to half the round trip."""
_AGAIN = 2
_WIDEN_AT = 1.0  # seconds of correction (what warns) after which contacts not asked yet are
_WIDEN_AFTER = 30.0  # asked (clock.peek) this long after, up to _WIDENINGS times (serve)
_WIDENINGS = 10
_MIDPOINT_GAP = 60.0  # seconds between the two middle offsets beyond which no halfway


_WALL_ANCHOR: trio.lowlevel.RunVar[tuple[float, float]] = trio.lowlevel.RunVar("swarm_wall")
"""(unix time minus trio time, seconds suspended) at the first read in a run."""
_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)
_LEAST_SUSPEND = 0.5  # seconds


def _suspended() -> float:
    """Seconds this machine has spent suspended since boot: Linux's boot-time clock runs
    on through a suspend, the monotonic clock (trio's) stops. 0 where there is none."""
    if _BOOTTIME is None:
        return 0.0
    return time.clock_gettime(_BOOTTIME) - time.clock_gettime(time.CLOCK_MONOTONIC)


def wall_clock() -> float:
    """Unix time read through trio's clock: virtual under ``MockClock``, and never stepped
    (trio's clock is monotonic), so that a change of the system time in the middle of a
    run (NTP, by hand) moves neither record expirations nor round slots at once; the peers'
    median (:class:`NetworkClock`) corrects this machine's error. Time the machine spent
    suspended (a laptop's sleep) is added back where the system says how long (Linux).
    Outside a trio run (a plain script's thread): the system time."""
    try:
        now = trio.current_time()
    except RuntimeError:
        return time.time()
    try:
        offset, suspended = _WALL_ANCHOR.get()
    except LookupError:
        offset, suspended = time.time() - now, _suspended()
        _WALL_ANCHOR.set((offset, suspended))
    slept = _suspended() - suspended
    # two clocks read one after the other differ by a jitter of nanoseconds: below a
    # suspend's least, leave the reading exact (virtual-time tests compare times exactly)
    return now + offset + (slept if slept >= _LEAST_SUSPEND else 0.0)


@dataclass(frozen=True, slots=True)
class ClockConfig:
    """How a peer keeps network time (see the module docstring)."""

    enabled: bool = True  # False: run on this machine's clock alone (offset 0)
    interval: float = 300.0  # ask again this often (clocks drift by ppm, not by seconds)
    peers: int = 8  # routing-table peers asked each time
    timeout: float = 2.0  # seconds for one ask
    # Answers that took longer are dropped: their midpoint may be off by half of this.
    max_round_trip: float = 1.0
    max_samples: int = 32  # hosts whose latest offset counts (the oldest goes first)
    threshold: float = 0.1  # seconds the median must move before the offset follows
    max_offset: float = 3600.0  # the correction never exceeds this, whatever peers say

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("interval", "timeout", "max_round_trip", "max_offset"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClockConfig.{name} must be positive")
        if self.threshold < 0 or self.peers < 0 or self.max_samples < 1:
            raise ValueError("ClockConfig: threshold and peers >= 0, max_samples >= 1")


def _voice(host: str, peer_id: PeerID | None) -> str:
    """Whose sample an answer is: its host's (one per machine or /64), except on loopback,
    where each peer counts (peers on one machine share its clock; an experiment that gives
    them different ``clock=`` would otherwise count as one)."""
    if peer_id is not None and is_loopback_host(host):
        return f"{host} {peer_id}"
    return host_group(host)


class NetworkClock:
    """This machine's clock (``local``) corrected by its peers' median offset.

    ``now()`` is what the DHT stamps expirations with and what averaging rounds are cut
    by; ``offset`` is the correction in seconds (positive: our clock is behind).

    Two kinds of samples: *picked* (answers of contacts we chose from our routing table)
    and *asked back* (answers of peers that asked us first). Anyone can ask us, so the
    asked-back ones count only while we have fewer than ``_ENOUGH_PICKED`` picked ones (the
    first node of a swarm, two peers that meet), and then no more of them than the picked
    ones (at least one): hosts that call us in a crowd to be asked back cannot outvote the
    contacts we chose. (Counted beside a larger sample, they did, with a few liars among
    the picked ones: 5 honest and 3 lying picked, 5 liars asked back, moved a node by 3600
    s; an outside tester's settled peers went off for up to 57 s at the liars' re-asks.)

    The median of an even count is halfway between the two middle ones (two camps a few
    seconds apart then draw together), unless they are a minute or more apart: then the
    value between them nearest the offset we run on (with one peer's answer alone,
    halfway). Halfway between an honest camp and a lying one is nobody's time: a node with
    as many liars (+3600 s) as honest voices went 1800 s off.
    """

    def __init__(
        self,
        local: Callable[[], float],
        config: ClockConfig | None = None,
        *,
        count_own: bool = True,
    ) -> None:
        """``count_own``: our own clock is one voice of the median. A client-mode peer's
        is not: nobody asks it back, so it follows the nodes it asked, all the way (half
        way, with one node to ask, would leave the two apart)."""
        self.local = local
        self.config = config or ClockConfig()
        self.count_own = count_own
        self.offset = 0.0
        self._logged = 0.0
        self._picked: OrderedDict[str, float] = OrderedDict()  # voice -> offset, oldest first
        self._asked: OrderedDict[str, float] = OrderedDict()
        # voice -> (round trip, local time) of the answer that counts now (see record)
        self._round_trips: dict[str, tuple[float, float]] = {}

    def now(self) -> float:
        """Unix time as the swarm's median clock reads it."""
        return self.local() + self.offset

    @property
    def picked(self) -> int:
        """How many hosts we chose to ask answered (their latest answers count)."""
        return len(self._picked)

    def has_picked(self, host: str, peer_id: PeerID) -> bool:
        """Whether an answer of ``peer_id`` at ``host`` counts among the picked ones now."""
        return _voice(host, peer_id) in self._picked

    @property
    def samples(self) -> int:
        """How many hosts' offsets count now."""
        return len(self._picked) + len(self._counted_asks())

    def record(
        self,
        host: str,
        remote_time: float,
        sent: float,
        received: float,
        peer_id: PeerID | None = None,
        *,
        picked: bool = True,
    ) -> bool:
        """Count one answer: ``remote_time`` from ``peer_id`` at ``host``, asked at local
        time ``sent`` and answered at local ``received`` (``picked``: we chose to ask it;
        else we asked it back). False when the round trip was too slow (or the local clock
        stepped meanwhile) to trust. A host's recent answer at least twice as fast as this
        one stays in its place; an estimate within half the round trip of zero counts as
        zero (see the comments below)."""
        round_trip = received - sent
        if not 0 <= round_trip <= self.config.max_round_trip:
            return False
        voice = _voice(host, peer_id)
        # as strong a kind as this one (an answer we picked is not one we were asked back)
        counted = voice in self._picked or (not picked and voice in self._asked)
        faster, at = self._round_trips.get(voice, (math.inf, -math.inf))
        if counted and 2 * faster < round_trip and received - at < self.config.interval:
            return True  # a recent, much faster answer of this host bounds its offset tighter
        self._round_trips[voice] = (round_trip, received)
        if len(self._round_trips) > 4 * self.config.max_samples:  # of hosts long gone
            self._round_trips = {voice: (round_trip, received)}
        if picked or voice in self._picked:  # a host we picked stays picked, freshly
            self._asked.pop(voice, None)
            picked = True
        pool = self._picked if picked else self._asked
        pool.pop(voice, None)
        estimate = remote_time - (sent + received) / 2
        # The answer bounds the offset to estimate +- round_trip / 2, no closer: a request
        # that waited on the answerer's busy loop (0.6 s making a tensor) reads as a skew
        # of half that wait (a benchmark peer on loopback followed +0.29 s and met the
        # others a slot late). Bounds that include no skew at all count as none.
        pool[voice] = 0.0 if abs(estimate) <= round_trip / 2 else estimate
        while len(pool) > self.config.max_samples:
            pool.popitem(last=False)
        self._follow_median()
        return True

    def _counted_asks(self) -> list[float]:
        """The latest asked-back offsets, as many as the picked ones (at least one), while
        we picked fewer than ``_ENOUGH_PICKED``; none after."""
        if len(self._picked) >= _ENOUGH_PICKED:
            return []
        most = max(1, len(self._picked))
        return list(self._asked.values())[-most:]

    def _median(self) -> float:
        own = [0.0] if self.count_own else []
        values = sorted([*own, *self._picked.values(), *self._counted_asks()])
        if not values:
            return self.offset
        middle = len(values) // 2
        if len(values) % 2:
            return values[middle]
        low, high = values[middle - 1], values[middle]
        if len(values) == 2 or high - low < _MIDPOINT_GAP:  # (see the class docstring)
            return (low + high) / 2
        return min(max(self.offset, low), high)

    def median(self) -> float:
        """The median of the counted offsets and our own (0, unless ``count_own`` is off),
        within ``max_offset``."""
        return max(-self.config.max_offset, min(self.config.max_offset, self._median()))

    @property
    def uncorrected(self) -> float:
        """Seconds of the peers' median offset beyond ``max_offset``, which the correction
        leaves out (positive: our clock is behind); 0.0 when within it."""
        median = self._median()
        return median - self.median()

    def _follow_median(self) -> None:
        median = self.median()
        if abs(median - self.offset) > self.config.threshold:
            self.offset = median

    def log_change(self) -> None:
        """Log the offset if it moved since last logged (once per batch of answers, not
        once per answer). Seconds off matter, rounds being cut by the clock: a warning."""
        if self.offset == self._logged:
            return
        self._logged = self.offset
        median = self._median()
        side = "behind" if median > 0 else "ahead of"
        if abs(median) > self.config.max_offset:
            if self.samples == 1:
                # one peer's word cannot tell which clock is wrong (an outside tester's fake
                # peer 1e9 s off had this machine told to set its clock); with our own voice
                # counted the median is halfway, so the gap is twice it
                logger.warning(
                    "this machine's clock is %.3f s %s the one peer's clock it knows (either"
                    " may be the wrong one), beyond ClockConfig.max_offset: correcting by only"
                    " %.0f s; set whichever clock is wrong (records and rounds will not match"
                    " the others')",
                    abs(median) * (2 if self.count_own else 1),
                    side,
                    self.config.max_offset,
                )
                return
            logger.warning(
                "this machine's clock is %.3f s %s the median of %d peers' clocks, beyond"
                " ClockConfig.max_offset: correcting by only %.0f s; set this machine's clock"
                " (records and rounds will not match the others')",
                abs(median),
                side,
                self.samples,
                self.config.max_offset,
            )
            return
        if abs(self.offset) <= self.config.threshold:  # back in line after a correction
            logger.info(
                "this machine's clock agrees with the median of %d peers' clocks again"
                " (within %.3f s)",
                self.samples,
                abs(self.offset),
            )
            return
        level = logging.WARNING if abs(self.offset) >= 1.0 else logging.INFO
        if self.samples == 1 and self.count_own:
            # the median of our clock and one peer's is halfway between them, and either may
            # be the wrong one (a machine with NTP was told its clock was behind "the median
            # of 1 peers' clocks" when the one peer it knew ran 3 s ahead: an outside tester)
            logger.log(
                level,
                "this machine's clock is %.3f s %s the one peer's clock it knows (either may"
                " be the wrong one): moving halfway, %.3f s (averaging rounds and DHT"
                " expirations use the corrected time)",
                2 * abs(self.offset),
                side,
                abs(self.offset),
            )
            return
        logger.log(
            level,
            "this machine's clock is %.3f s %s the median of %d peers' clocks: following them"
            " (averaging rounds and DHT expirations use the corrected time)",
            abs(self.offset),
            side,
            self.samples,
        )


class ClockService:
    """Answers ``clock.now`` and asks peers for theirs: at the start (:meth:`sync`), every
    ``interval`` those connected to us then, and back when a peer asks us. While the
    correction is a second or more, also contacts not asked yet (``clock.peek``, which
    nobody answers by asking back): see :meth:`serve`."""

    def __init__(
        self,
        host: RpcHost,
        clock: NetworkClock,
        peers: Callable[[], list[tuple[PeerID, str]]],
        *,
        rng: random.Random | None = None,
    ) -> None:
        """``peers``: the contacts to ask, ``(peer_id, "HOST:PORT")`` (the routing table)."""
        self.host = host
        self.clock = clock
        self.config = clock.config
        self._peers = peers
        self._rng = rng or random.Random()
        self._asked_back: dict[str, float] = {}  # host group -> trio time we last asked it
        self._catch_up_at = -math.inf  # trio time from which a catch-up sync may run
        send, self._ask_back = trio.open_memory_channel[tuple[PeerID, str]](16)
        self._ask_back_send = send
        # slow answers to ask again: (address, host, picked, peek, tries left)
        again, self._again = trio.open_memory_channel[tuple[Address, str, bool, bool, int]](64)
        self._again_send = again
        host.register_quick(ClockRequest.METHOD, self._on_clock)
        host.register_quick(ClockPeekRequest.METHOD, self._on_peek)

    def _on_peek(self, request: Request) -> Reply:
        ClockPeekRequest.from_body(request.body)
        return Reply(ClockResponse(self.clock.local()).to_body())

    def _on_clock(self, request: Request) -> Reply:
        ClockRequest.from_body(request.body)
        answer = Reply(ClockResponse(self.clock.local()).to_body())
        if self.config.enabled and request.remote_host != "?":
            group = _voice(request.remote_host, request.peer_id)
            now = trio.current_time()
            # Only nodes of our routing table (full nodes, address proven): a client-mode
            # caller follows us instead (see NetworkClock's count_own).
            if now - self._asked_back.get(
                group, -math.inf
            ) >= self.config.interval and self._in_table(request.peer_id):
                try:  # a full queue drops the ask: a crowd asking at once gets no extra calls
                    self._ask_back_send.send_nowait((request.peer_id, request.remote_host))
                    self._asked_back[group] = now
                except trio.WouldBlock:
                    pass
                if len(self._asked_back) > 4 * self.config.max_samples:  # a crowd: forget
                    self._asked_back = {group: now}
        return answer

    def _in_table(self, peer_id: PeerID) -> bool:
        return any(contact == peer_id for contact, _ in self._peers())

    async def ask(
        self,
        address: Address,
        host: str,
        *,
        picked: bool = True,
        peek: bool = False,
        again: int = _AGAIN,
    ) -> bool:
        """Ask ``address`` for its clock and count the answer (``host``: its IP, for the
        one-sample-per-host rule; ``picked``: see :class:`NetworkClock`; ``peek``: with
        ``clock.peek``, so that it does not ask us back). False when it did not answer in
        time or usably. A slow answer is counted, and the host asked ``again`` more times
        later (see ``_SLOW_ROUND_TRIP``)."""
        # an ask back waits no longer than an answer may take to count: a crowd of callers
        # that answer slowly must not hold the workers that ask back
        timeout = self.config.timeout if picked else self.config.max_round_trip
        with trio.move_on_after(timeout):
            try:
                # Connected first: a dial and handshake inside the timed call would shift
                # the midpoint by half their time (a few round trips), one way only.
                await self.host.connect(address)
                sent = self.clock.local()
                request = ClockPeekRequest() if peek else ClockRequest()
                reply = await self.host.call(address, request.METHOD, request.to_body())
                answer = ClockResponse.from_body(reply.body)
            except (SwarmError, OSError) as exc:
                logger.debug("clock.now to %s failed: %r", address, exc)
                return False
            received = self.clock.local()
            peer_id = address.peer_id
            if received - sent > _SLOW_ROUND_TRIP and again > 0:
                with contextlib.suppress(trio.WouldBlock):  # full: a crowd, enough asks
                    self._again_send.send_nowait((address, host, picked, peek, again - 1))
            return self.clock.record(host, answer.time, sent, received, peer_id, picked=picked)
        return False

    async def sync(self, *, dial: bool = True, unpicked: bool = False) -> int:
        """Ask up to ``peers`` routing-table contacts at once (``dial=False``: only those
        connected to us now; ``unpicked``: only those whose answers do not count yet, with
        ``clock.peek``); how many answers counted."""
        if not self.config.enabled:
            return 0
        contacts = self._peers()
        if not dial:
            connected = set(self.host.connected_peers())
            contacts = [contact for contact in contacts if contact[0] in connected]
        if unpicked:
            contacts = [
                (peer_id, hostport)
                for peer_id, hostport in contacts
                if not self.clock.has_picked(Address.parse(hostport).host, peer_id)
            ]
        chosen = self._rng.sample(contacts, min(self.config.peers, len(contacts)))
        counted = 0

        async def one(peer_id: PeerID, hostport: str) -> None:
            nonlocal counted
            address = Address.parse(hostport).with_peer_id(peer_id)
            counted += await self.ask(address, address.host, peek=unpicked)

        async with trio.open_nursery() as nursery:
            for peer_id, hostport in chosen:
                nursery.start_soon(one, peer_id, hostport)
        self.clock.log_change()
        return counted

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ask back those who ask us, and :meth:`sync` every ``interval``, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_asks_back)
            nursery.start_soon(self._ask_slow_ones_again)
            task_status.started()
            widenings = 0
            next_sync = trio.current_time() + self.config.interval * self._rng.uniform(0.9, 1.1)
            while self.config.enabled:
                # A correction of a second or more (our clock off, or the contacts we
                # asked): every 30 s, up to 10 times, ask contacts not asked yet. A newcomer
                # whose first contacts were mostly liars (36 % of a swarm, +3600 s, joined
                # first) followed them by up to the whole max_offset for ~10 minutes (an
                # outside tester): the median counts a sample, not the swarm. With
                # clock.peek: asked back, those contacts would count our clock (a crowd of
                # wrong clocks widening pulled settled honest peers off: session 50).
                tick = _WIDEN_AFTER * self._rng.uniform(0.9, 1.1)
                await trio.sleep(max(0.0, min(tick, next_sync - trio.current_time())))
                if abs(self.clock.offset) < _WIDEN_AT:
                    widenings = 0  # (moved again later: widen again)
                elif widenings < _WIDENINGS:
                    widenings += 1
                    await self.sync(unpicked=True)
                if trio.current_time() < next_sync:
                    continue
                next_sync = trio.current_time() + self.config.interval * self._rng.uniform(0.9, 1.1)
                # Over connections that are up for other reasons (a clock drifts by ppm):
                # no dial, nothing that keeps an idle connection open; unless we picked
                # too few so far (the first node of a swarm picked none at its start).
                await self.sync(dial=self.clock.picked < _ENOUGH_PICKED)

    async def _ask_slow_ones_again(self) -> None:
        async with trio.open_nursery() as nursery:
            async for address, host, picked, peek, again in self._again:

                async def later(
                    address: Address, host: str, picked: bool, peek: bool, again: int
                ) -> None:
                    await trio.sleep(self._rng.uniform(1.0, 3.0))
                    # still connected (an ask back: over its connection only), else dropped
                    if address.peer_id in self.host.connected_peers():
                        await self.ask(address, host, picked=picked, peek=peek, again=again)
                        self.clock.log_change()

                nursery.start_soon(later, address, host, picked, peek, again)

    async def _serve_asks_back(self) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(_ASK_BACK_WORKERS):
                nursery.start_soon(self._ask_back_worker, self._ask_back.clone())

    async def _ask_back_worker(self, asks: trio.MemoryReceiveChannel[tuple[PeerID, str]]) -> None:
        async for peer_id, remote_host in asks:
            # over the connection it called us on (a client-mode peer has no address); one
            # that is already gone is not dialed
            if peer_id in self.host.connected_peers():
                await self.ask(over_its_connection(peer_id), remote_host, picked=False)
                self.clock.log_change()
            # A node that picked few peers (the first of a swarm picked none) picks again
            # now that peers come: asks back alone count for no more than one voice.
            now = trio.current_time()
            if self.clock.picked < _ENOUGH_PICKED and now >= self._catch_up_at:
                self._catch_up_at = now + _CATCH_UP_EVERY
                await self.sync()
