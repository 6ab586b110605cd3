"""How long a frozen reducer (its host stopped, its connections open) holds the survivors:
``2 * stall_timeout`` after the last bytes heard from it, whenever in the round it froze.

That is one ``stall_timeout`` of silence, then ``stall_timeout / 2`` for a ping over the
pooled connection and ``stall_timeout / 2`` more for a ping over a fresh dial (see
``Liveness.probe``); the upload, the download and our own reducer all share that one probe.
A churn trial (3 processes, defaults: ``stall_timeout`` 5 s) saw steps of 11.2 s, 10 s of
them this wait. Before, a reducer frozen right after bytes that counted as no progress
(its ping to us, DHT traffic, part of a frame) was found busy by one probe and then waited
for a whole ``stall_timeout`` more: 14.93 s here, ``3 * stall_timeout``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from test_averaging_support import (
    Member,
    fast_config,
    host_of,
    make_members,
    memnet_swarm,
    step_all,
    verify_round,
)

from peer import MemoryNetwork
from protocol.address import Address
from protocol.identity import PeerID
from training import AveragerConfig, DropReason, Outcome, PartStatus
from training.averaging.plan import Liveness, Plan
from training.averaging.reducing import ReducerService

N = 3
SIZE = N * 8 * 1024  # 8 chunks of 1024 elements per part
STALL = AveragerConfig().stall_timeout  # the default, as in the trial: 5 s
TIMEOUT = 30.0
SLACK = 0.05  # network latency (5 ms a hop) and scheduling on virtual time


def victim_of(plan: Plan) -> PeerID:
    return plan.reducers[1].peer_id


class Freezer:
    """Freezes the victim's host once, and remembers when."""

    def __init__(self, net: MemoryNetwork, members: list[Member]) -> None:
        self.net = net
        self.ids = [m.peer_id for m in members]
        self.at: float | None = None
        self.victim: int | None = None

    def __call__(self, peer_id: PeerID) -> None:
        if self.at is None:
            self.victim = self.ids.index(peer_id)
            self.net.freeze_host(host_of(self.victim))
            self.at = trio.current_time()


def freeze_at(monkeypatch: pytest.MonkeyPatch, moment: str, freeze: Freezer) -> None:
    """Freeze the victim reducer (a) as its round starts, before any chunk arrived, (b) once
    it took 5 of its 16 chunks, (c) once it served its result header (its part reduced)."""
    if moment == "before-any-chunk":
        load = ReducerService.load

        async def frozen_load(self: ReducerService) -> None:
            if self.plan.me == victim_of(self.plan):
                freeze(self.plan.me)
            await load(self)

        monkeypatch.setattr(ReducerService, "load", frozen_load)
    elif moment == "mid-upload":
        on_chunk = ReducerService.on_chunk
        taken = [0]

        async def frozen_on_chunk(self: ReducerService, sender: PeerID, *args: Any) -> Any:
            reply = await on_chunk(self, sender, *args)
            if self.plan.me == victim_of(self.plan):
                taken[0] += 1
                if taken[0] == 5:
                    freeze(self.plan.me)
            return reply

        monkeypatch.setattr(ReducerService, "on_chunk", frozen_on_chunk)
    else:
        results = ReducerService.results

        async def frozen_results(self: ReducerService, member: PeerID) -> AsyncIterator[Any]:
            async for item in results(self, member):
                yield item
                if self.plan.me == victim_of(self.plan):
                    freeze(self.plan.me)

        monkeypatch.setattr(ReducerService, "results", frozen_results)


def check(members: list[Member], results: list[Any], freeze: Freezer, start: float) -> None:
    """Each survivor returned ``2 * STALL`` after the freeze, reported honestly."""
    assert freeze.at is not None and freeze.victim is not None
    victim_id = members[freeze.victim].peer_id
    infos = []
    for i, (info, elapsed) in enumerate(results):
        assert info is not None
        if i == freeze.victim:
            continue
        waited = start + elapsed - freeze.at
        assert 2 * STALL - 0.2 <= waited <= 2 * STALL + SLACK, f"member {i}: {waited} s"
        assert info.outcome is Outcome.PARTIAL and info.dropped[victim_id] is DropReason.FROZEN
        (part,) = [p for p in info.parts if p.reducer == victim_id]
        assert part.status is PartStatus.NONE and part.note == "the reducer is frozen"
        infos.append(info)
    survivors = [m for i, m in enumerate(members) if i != freeze.victim]
    verify_round([*survivors, members[freeze.victim]], [*infos, results[freeze.victim][0]])


@pytest.mark.parametrize("moment", ["before-any-chunk", "mid-upload", "serving-results"])
async def test_a_frozen_reducer_costs_two_stall_timeouts(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    """Measured: 10.00, 9.98 and 9.92 s after the freeze (the last heard progress came
    a little before it in the later cases), before and after the change."""
    with trio.fail_after(300):
        async with memnet_swarm(N, first_seed=40) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(stall_timeout=STALL, max_inflight=2))
            freeze = Freezer(net, members)
            freeze_at(monkeypatch, moment, freeze)
            start = trio.current_time()
            results = await step_all(members, timeout=TIMEOUT)
            check(members, results, freeze, start)


async def test_a_reducer_frozen_just_after_bytes_that_are_no_progress_is_not_waited_for_again(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The victim's reduction waits (for a slow sender, say); the survivors' downloads ping
    it every stall timeout. Just over ``stall_timeout / 2`` after one of those pings it
    sends each survivor a ping of its own (bytes, but no progress of any download) and
    freezes. The next probe finds its answer late but those bytes recent: busy. It used to
    wait a whole stall timeout from there (14.93 s after the freeze); now the next probe is
    due a stall timeout after those bytes, at once: 9.985-9.995 s."""
    alive: list[float] = []  # when survivors' probes found the victim alive
    both_alive = trio.Event()  # each survivor's first probe of the victim was answered
    probe = Liveness._probe

    async def recording_probe(self: Liveness, peer_id: PeerID) -> Any:
        answer = await probe(self, peer_id)
        if answer is None and peer_id == victim_of(self.plan):
            alive.append(trio.current_time())
            if len(alive) == N - 1:
                both_alive.set()
        return answer

    monkeypatch.setattr(Liveness, "_probe", recording_probe)
    with trio.fail_after(300):
        async with memnet_swarm(N, first_seed=40) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(stall_timeout=STALL, max_inflight=2))
            freeze = Freezer(net, members)
            reduce = ReducerService.reduce

            async def held_reduce(self: ReducerService, cutoff: float) -> Any:
                if self.plan.me == victim_of(self.plan):
                    await both_alive.wait()
                    await trio.sleep_until(max(alive) + STALL / 2 + SLACK)
                    for member in self.plan.members:
                        if member.peer_id != self.plan.me and member.address is not None:
                            body = {"round": self.plan.round}
                            address = Address.parse(member.address)
                            await self.liveness.node.rpc.call(
                                address, self.liveness.ping_method, body
                            )
                    freeze(self.plan.me)
                return await reduce(self, cutoff)

            monkeypatch.setattr(ReducerService, "reduce", held_reduce)
            start = trio.current_time()
            results = await step_all(members, timeout=TIMEOUT)
            check(members, results, freeze, start)
