"""A member killed mid-round stops counting in the population the survivors expect once a
round read at its close shows it gone (``Matchmaker.suspect``): the survivors wait for one
slot's close, not for every round that counted it (memory network, virtual time)."""

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
)

from training import AveragingInfo, Outcome
from training.averaging.matchmaking import Matchmaker

WINDOW = 8.0


async def _steps_after(survivors: list[Member], steps: int) -> list[list[AveragingInfo]]:
    out = []
    for _ in range(steps):
        results = await step_all(survivors, timeout=30.0)
        out.append([info for info, _ in results if info is not None])
        assert len(out[-1]) == len(survivors), results
    return out


def _check(after: list[list[AveragingInfo]], pair: int) -> None:
    """Every step after the kill averages the survivors; the first waits for its slot's
    close (the dead member might be a live one a moment late), the next ones close early."""
    for step, infos in enumerate(after):
        for info in infos:
            assert info.outcome is Outcome.AVERAGED and len(info.group) == pair, str(info)
            if step:
                assert info.matchmaking_s < 1.0, (step, info.matchmaking_s, str(info))
    assert max(info.matchmaking_s for info in after[0]) > 1.0  # the one slot it costs


async def test_survivors_of_a_member_killed_in_the_allreduce_wait_for_one_close_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three members step early in a long slot, closing their rounds early (each expects
    the other two). One is killed in the middle of its uploads: the survivors' round is
    partial. Their next step waits for the slot's close (the killed member still counts)
    and reads the round without it; the steps after that close early. They used to wait
    for the close in each of their next three steps, until the rounds that counted the
    dead member aged out (an outside tester: 2.6 s, then 6.1 s with a 6 s window, against
    0.5 s before the kill)."""
    config = fast_config(gather_window=WINDOW, max_inflight=2)
    with trio.fail_after(300):
        async with memnet_swarm(3) as (net, nodes):
            members = make_members(nodes, 16_384, config)
            await step_all(members, timeout=30.0)  # each learns of the others
            await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.1)  # early in a slot
            steady = await step_all(members, timeout=30.0)
            assert all(i is not None and i.matchmaking_s < 1.0 for i, _ in steady), steady
            victim = 2
            after_acks(members[victim], 2, lambda: net.kill_host(host_of(victim)))
            killed = await step_all(members, timeout=30.0)
            for info, _ in killed[:victim]:
                assert info is not None and info.outcome is Outcome.PARTIAL, str(info)
            after = await _steps_after(members[:victim], 3)
    _check(after, 2)


async def test_survivors_of_a_leader_killed_in_matchmaking_wait_for_one_close_only(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four members step early in a long slot; the one that leads is killed as it starts
    leading: the others' joins fail at once, they skip it and average as three. The dead
    leader's declaration stays in the round key; their next step waits for the slot's
    close, and the ones after it close early."""
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
