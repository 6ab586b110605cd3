"""Gathering a round: read its key until it closes, or close early once the peers we
expect are back, pinging those missing (``Gathering``, a base class of
:class:`~.matchmaking.Matchmaker`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import trio

from peer import Peer, PeerUnavailableError, RemoteError
from peer.errors import PeerBusyError
from protocol.address import Address
from protocol.errors import ProtocolError
from protocol.identity import PeerID

from .config import AveragerConfig
from .grouping import (
    Declaration,
    decided_set,
    parse_closed,
    parse_declarations,
    parse_done,
    phase_of,
)
from .round_state import RoundState

_MAX_MISSING_PINGS = 4
"""The most peers of our remembered rounds, missing from a round, that a peer pings to
close it early without them (``Matchmaker._ping_missing``)."""


class Gathering:
    """The gathering of :class:`~.matchmaking.Matchmaker`, one of its base classes (the
    attributes below are the matchmaker's)."""

    node: Peer
    config: AveragerConfig
    seen_phase: int | None
    _views: list[frozenset[PeerID]]
    _addresses: dict[PeerID, str]
    _ghosts: set[tuple[PeerID, int]]
    _subkey: str
    # and two of its methods
    _without_us: Callable[[int, dict[Any, Any]], dict[Any, Any]]
    _method: Callable[[str], str]

    async def _gather(
        self, state: RoundState, key: str, close_at: float, deadline: float
    ) -> tuple[list[Declaration], Counter[str | None]]:
        """Read the round when it closes, or when a joiner wakes us; poll meanwhile and
        close early once as many peers as before are back (see below). Returns the last
        read's declarations and the others' "done" markers counted by layout.

        A key is reused by consecutive steps within its slot: peers replace their
        declaration by a "done" marker once their round is decided (``withdraw``), so what
        is left is the peers waiting now (and peers that crashed mid-round, until their
        declaration expires; a round they would lead fails and is retried).
        """
        async with trio.open_nursery() as pings:
            result = await self._poll(state, key, close_at, deadline, pings)
            pings.cancel_scope.cancel()
        return result

    async def _poll(
        self,
        state: RoundState,
        key: str,
        close_at: float,
        deadline: float,
        pings: trio.Nursery,
    ) -> tuple[list[Declaration], Counter[str | None]]:
        # at most 0.25 s: the longer window that slow links ask for then costs a steady
        # swarm nothing (0.35 s of matchmaking per step with 4 s, against 0.59 s with 0.5 s
        # polls: benchmarks/slow_links.py --window 4 --latency 0.005 --late 0)
        poll = min(max(self.config.gather_window / 8, 0.02), 0.25)
        # Close early once as many peers are back as we saw in any of the last 3 rounds (a
        # peer that left costs us the wait until the close, not a split swarm), and not
        # before one poll interval: peers a moment behind us get a chance to show up. Those
        # of them that a ping finds without an averager here, or without a process, are
        # not waited for (``_ping_missing``).
        departed = _Departures(state.departed)
        pinged: set[PeerID] = set()
        views = self._views
        not_before = trio.current_time() + poll
        while True:
            now = trio.current_time()
            population = max((len(v - departed.peers) for v in views), default=0)
            early = population >= 2 and not state.wake.is_set() and now < close_at
            if early and now < not_before:
                with trio.move_on_at(min(close_at, not_before)):
                    await state.wake.wait()
                continue
            if not early:
                with trio.move_on_at(close_at):
                    await state.wake.wait()
            declared: list[Declaration] = []
            done: Counter[str | None] = Counter()
            with trio.move_on_at(close_at if early else deadline):
                read = await self.node.dht.read_entries(key)
                state.unheard = read.asked > 0 and not read.answered
                values = {s: v for s, (v, _) in read.entries.items()}
                declared = parse_declarations(values)
                # peers whose read of the round had our declaration, and that withdrew
                # since: we group the set they grouped, without the declarations that came
                # after it (one more reshuffled every pair of a grid, and peers that had
                # waited together were each alone: an outside tester, 1.9 % of the steps)
                declared = decided_set(declared, values, state.me)
                named = {d.peer_id for d in declared}  # a value that reads as both: once
                kept = [
                    d for d in parse_closed(values, self._subkey, state.me.step)
                    if d.peer_id not in named
                ]  # fmt: skip
                declared += kept
                for d in kept:
                    del values[str(d.peer_id)]  # counted as declared, not as done
                others = [d for d in declared if d.peer_id != state.me.peer_id]
                company = [d for d in others if d.layout == state.me.layout]
                if company:
                    self.seen_phase = phase_of([state.me, *company])
                state.others_seen = max(state.others_seen, len(others))
                done = parse_done(self._without_us(state.number, values), self._subkey)
                if done.total() > state.others_done.total():
                    state.others_done = done
            # Exactly the peers of our layout we expect: close (peers of other layouts group
            # apart). More (a newcomer, who does not know it could close early), or a lone
            # peer of another layout (a misconfigured newcomer must learn of the mismatch: our
            # "done" marker names our layout, but a stranger of an older version reads no
            # layout in it): wait for the close, so that everybody reads the same set.
            present = _same_layout(declared, state.me, self._ghosts)
            if not early or _may_close_early(declared, state.me, population, self._ghosts):
                return declared, done
            bound = min(close_at, trio.current_time() + self.config.stall_timeout / 2)
            departed.news = trio.Event()  # a ping finds one gone: look again at once
            self._ping_missing(pings, present, pinged, departed, bound)
            with trio.move_on_at(min(close_at, trio.current_time() + poll)):
                await _either(state.wake, departed.news)

    def _ping_missing(
        self,
        pings: trio.Nursery,
        present: frozenset[PeerID],
        pinged: set[PeerID],
        departed: _Departures,
        bound: float,
    ) -> None:
        """Ping, once a round, the peers of our remembered rounds that have not declared in
        this one (at most ``_MAX_MISSING_PINGS`` of them; more: we wait for the close). One
        that has no averager under our prefix now, or whose address refuses us, is not
        waited for in this round: its volunteer stopped, or its process is gone (a
        volunteer that stopped cost the others the slot's close in each round that
        remembered it, the last 3). One that answers, or says nothing, is waited for as
        before: a peer whose event loop is busy computing is merely late (a review: taking
        silence for departure left such a peer alone in every round, and for good once the
        rounds that had it aged out). Forgetting members that failed a group instead (two
        versions, both reverted) locked live peers out too (reviews;
        ``tests/training/test_population_counts.py``, ``test_departures.py``)."""
        missing = frozenset().union(*self._views) - present - {self.node.peer_id}
        if not missing or len(missing) > _MAX_MISSING_PINGS:
            return
        for peer_id in missing - pinged:
            address = self._addresses.get(peer_id)
            if address is not None:
                pinged.add(peer_id)
                pings.start_soon(self._left_us, peer_id, address, departed, bound)

    async def _left_us(
        self, peer_id: PeerID, address: str, departed: _Departures, bound: float
    ) -> None:
        """``peer_id`` departed (this round) if a ping before ``bound`` is answered
        ``unknown_method`` or refused; an answer, or none, keeps it expected."""
        with trio.move_on_at(bound):
            try:
                try:
                    await self.node.rpc.call(Address.parse(address), self._method("ping"), {})
                except PeerUnavailableError as exc:
                    if isinstance(exc, PeerBusyError):
                        raise
                    # the pooled connection may have broken under a live peer (a NAT that
                    # dropped it): ask again, which dials afresh
                    await self.node.rpc.call(Address.parse(address), self._method("ping"), {})
            except RemoteError as exc:
                if exc.code == "unknown_method":  # no averager under our prefix now
                    departed.add(peer_id)
            except PeerBusyError:
                pass  # up, and busy
            except PeerUnavailableError:  # refused, broken, or another PeerID answers there
                departed.add(peer_id)
            except ProtocolError:
                pass


class _Departures:
    """The peers that a round's pings found gone (``Matchmaker._left_us``), and an event
    the poll loop renews each time it waits, set when one is found."""

    def __init__(self, peers: set[PeerID]) -> None:
        self.peers = peers  # the round's own set (RoundState.departed), filled in place
        self.news = trio.Event()

    def add(self, peer_id: PeerID) -> None:
        self.peers.add(peer_id)
        self.news.set()


async def _either(first: trio.Event, second: trio.Event) -> None:
    """Wait until either event is set."""
    async with trio.open_nursery() as nursery:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(wait, first)
        nursery.start_soon(wait, second)


def _same_layout(
    declared: list[Declaration], me: Declaration, ghosts: Collection[tuple[PeerID, int]] = ()
) -> frozenset[PeerID]:
    """The peers declared with our layout, but ``ghosts`` (``(peer, step tag)`` pairs)."""
    return frozenset(
        d.peer_id for d in declared if d.layout == me.layout and (d.peer_id, d.step) not in ghosts
    )


def _may_close_early(
    declared: list[Declaration],
    me: Declaration,
    population: int,
    ghosts: Collection[tuple[PeerID, int]],
) -> bool:
    """Exactly ``population`` peers of our layout, and no peer of another layout alone with
    it: a sub-swarm of another layout (two or more) groups apart and needs nothing from us,
    so two correct kinds under one prefix both close early (a lone stranger may be a
    misconfigured newcomer, which must see us). Nor when every peer of our layout is in
    client mode: they cannot form a group, and a peer that can may still come before the
    close (closing then would leave a "done" marker that tells the others we had a group)."""
    if len(_same_layout(declared, me, ghosts)) != population:
        return False
    ours = [d for d in declared if d.layout == me.layout and d.peer_id != me.peer_id]
    if all(d.client_mode for d in [me, *ours]):
        return False
    foreign = Counter(d.layout for d in declared if d.layout != me.layout)
    return all(count >= 2 for count in foreign.values())
