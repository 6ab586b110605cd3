"""A member that is gone stops counting in the population the survivors expect: their
next rounds close early without it (memory network, virtual time). A killed member, or one
whose averager was closed, is found by a ping (``Matchmaker._ping_missing``: refused, or
``unknown_method``); one that says nothing (frozen for good) by a read at the next round's
close that misses it (``Matchmaker.suspect``), which costs the survivors that one slot."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from test_allreduce_faults import after_acks
from test_averaging_support import (
    Member,
    fast_config,
    host_of,
    make_members,
    memnet_swarm,
    step_all,
    virtual_clock,
)

from peer import Peer, open_peer
from protocol.identity import Identity
from training import AveragerConfig, AveragingInfo, Outcome
from training.averaging.matchmaking import Matchmaker

WINDOW = 8.0


async def _steps_after(survivors: list[Member], steps: int) -> list[list[AveragingInfo]]:
    out = []
    for _ in range(steps):
        results = await step_all(survivors, timeout=30.0)
        out.append([info for info, _ in results if info is not None])
        assert len(out[-1]) == len(survivors), results
    return out


def _check(after: list[list[AveragingInfo]], pair: int, waits: int = 0) -> None:
    """Every step after the fault averages the survivors; the first ``waits`` wait for
    their slot's close, the others close early."""
    for step, infos in enumerate(after):
        for info in infos:
            assert info.outcome is Outcome.AVERAGED and len(info.group) == pair, str(info)
            if step >= waits:
                assert info.matchmaking_s < 1.0, (step, info.matchmaking_s, str(info))
            else:
                assert info.matchmaking_s > 1.0, (step, info.matchmaking_s, str(info))


async def _steady_trio(nodes: list[Peer], config: AveragerConfig) -> list[Member]:
    """Three members that have averaged twice, the second time early in a long slot (each
    expects the other two, and closes its rounds early)."""
    members = make_members(nodes, 16_384, config)
    await step_all(members, timeout=30.0)  # each learns of the others
    await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.1)  # early in a slot
    steady = await step_all(members, timeout=30.0)
    assert all(i is not None and i.matchmaking_s < 1.0 for i, _ in steady), steady
    return members


@pytest.mark.parametrize("fault", ["kill", "freeze"])
async def test_survivors_of_a_member_lost_in_the_allreduce_close_early_again(
    autojump_clock: trio.testing.MockClock, fault: str
) -> None:
    """One of three members is killed (or frozen for good) in the middle of its uploads:
    the survivors' round is partial. A killed one refuses the ping of the survivors' next
    round, which closes early without it; a frozen one does not answer, so that round
    waits for the slot's close, whose read misses it: the rounds after close early. They
    used to wait for the close in each of their next three steps, until the rounds that
    counted the lost member aged out (an outside tester: 2.6 s, then 6.1 s with a 6 s
    window, against 0.5 s before the kill)."""
    config = fast_config(gather_window=WINDOW, max_inflight=2)
    with trio.fail_after(300):
        async with memnet_swarm(3) as (net, nodes):
            members = await _steady_trio(nodes, config)
            victim = 2
            lose = net.kill_host if fault == "kill" else net.freeze_host
            after_acks(members[victim], 2, lambda: lose(host_of(victim)))
            if fault == "freeze":  # its own step never returns
                survivors = await _without(members, victim)
            else:
                lost = await step_all(members, timeout=30.0)
                for info, _ in lost[:victim]:
                    assert info is not None and info.outcome is Outcome.PARTIAL, str(info)
                survivors = members[:victim]
            after = await _steps_after(survivors, 3)
    _check(after, 2, waits=int(fault == "freeze"))


async def _without(members: list[Member], victim: int) -> list[Member]:
    """Step every member; return the others once their steps did (the victim's is
    cancelled then)."""
    survivors: list[Member] = []
    async with trio.open_nursery() as nursery:

        async def one(i: int) -> None:
            info = await members[i].averager.step(weight=1.0, timeout=30.0)
            assert info.outcome is Outcome.PARTIAL, str(info)
            survivors.append(members[i])
            if len(survivors) == len(members) - 1:
                nursery.cancel_scope.cancel()

        for i in range(len(members)):
            if i != victim:
                nursery.start_soon(one, i)
        nursery.start_soon(members[victim].averager.step, 1.0)
    return sorted(survivors, key=members.index)


async def test_survivors_of_a_leader_killed_in_matchmaking_close_early_again(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four members step early in a long slot; the one that leads is killed as it starts
    leading: the others' joins fail at once, they skip it and average as three. The dead
    leader's declaration stays in the round key (a ghost); the survivors' next steps ping
    it, are refused, and close early (they waited for the close in the first two)."""
    config = fast_config(gather_window=WINDOW)
    armed = [False]
    killed: list[int] = []
    lead = Matchmaker._lead

    async def killed_lead(self: Matchmaker, *args: Any, **kwargs: Any) -> Any:
        if armed[0] and not killed:
            who = next(i for i, m in enumerate(members) if m.averager._matchmaker is self)
            killed.append(who)
            net.kill_host(host_of(who))
            await trio.sleep_forever()  # its process is gone
        return await lead(self, *args, **kwargs)

    monkeypatch.setattr(Matchmaker, "_lead", killed_lead)
    with trio.fail_after(300):
        async with memnet_swarm(4, first_seed=40) as (net, nodes):
            members = make_members(nodes, 16_384, config)
            await step_all(members, timeout=30.0)  # each learns of the others
            await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.1)  # early in a slot
            await step_all(members, timeout=30.0)  # steady: closes early
            armed[0] = True
            survivors: list[Member] = []
            async with trio.open_nursery() as nursery:

                async def one(i: int) -> None:
                    info = await members[i].averager.step(weight=1.0, timeout=30.0)
                    assert info.outcome is Outcome.AVERAGED and len(info.group) == 3, str(info)
                    survivors.append(members[i])
                    if len(survivors) == 3:
                        nursery.cancel_scope.cancel()  # the dead one never returns

                for i in range(4):
                    nursery.start_soon(one, i)
            after = await _steps_after(survivors, 3)
    _check(after, 3)


async def test_a_member_that_closed_its_averager_is_not_waited_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One of three steady members closes its averager between steps (a volunteer that
    stops): the others' pings of their next round are answered ``unknown_method``, and
    each of their next steps closes early. They waited for the slot's close in all three
    (8 s each), counting it until the rounds that had it aged out."""
    config = fast_config(gather_window=WINDOW)
    with trio.fail_after(300):
        async with memnet_swarm(3) as (_, nodes):
            members = await _steady_trio(nodes, config)
            members[2].averager.close()
            after = await _steps_after(members[:2], 3)
    _check(after, 2)


async def test_a_member_back_at_another_address_is_waited_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One of three steady members is killed and restarts at once on another host with the
    same identity, stepping 0.6 s after the others. The others' ping names its old address,
    but goes over the connection its new process opened to them (pooled by PeerID): it
    answers, they wait for it, and all three close early together."""
    config = fast_config(gather_window=WINDOW)
    with trio.fail_after(300):
        async with memnet_swarm(3, first_seed=40) as (net, nodes):
            members = await _steady_trio(nodes, config)
            net.kill_host(host_of(2))
            async with open_peer(
                listen=f"{host_of(3)}:1000",
                initial_peers=[nodes[0].address],
                network=net.interface(host_of(3)),
                clock=virtual_clock,
                identity=Identity.from_seed(bytes([42]) * 32),
            ) as node:
                (back,) = make_members([node], 16_384, config, seed=2)
                infos: list[AveragingInfo] = []

                async def one(member: Member, delay: float) -> None:
                    await trio.sleep(delay)
                    infos.append(await member.averager.step(weight=1.0, timeout=30.0))

                async with trio.open_nursery() as nursery:
                    for member in members[:2]:
                        nursery.start_soon(one, member, 0.0)
                    nursery.start_soon(one, back, 0.6)
    assert len(infos) == 3
    for info in infos:
        assert info.outcome is Outcome.AVERAGED and len(info.group) == 3, str(info)
        assert info.matchmaking_s < 2.0, (info.matchmaking_s, str(info))
