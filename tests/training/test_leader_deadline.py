"""A leader whose own step has little time left does not cut its members' rounds. Members
used to end their all-reduce at receipt + the confirmation's budget, the leader's own time
left: a leader whose caller gave it 0.17 s (0.02 s left once confirmed) made members that
had 20 s come back after 0.03 s, `failed` or with far less received, while the same short
timeout on any other member cost the others nothing. Memory network, virtual time."""

from __future__ import annotations

import trio
from test_averaging_support import (
    Member,
    fast_config,
    make_members,
    memnet_swarm,
    step_all,
    verify_round,
)

from training import AveragingInfo, Outcome

LONG, SHORT = 20.0, 0.17  # SHORT: just past matchmaking, a few ms left for the all-reduce


async def step_with(
    members: list[Member], timeouts: list[float]
) -> tuple[list[AveragingInfo], list[float]]:
    """Step every member at once, each with its own timeout: the reports, and how long each
    step took."""
    infos: list[AveragingInfo | None] = [None] * len(members)
    took = [0.0] * len(members)

    async def one(i: int) -> None:
        start = trio.current_time()
        infos[i] = await members[i].averager.step(members[i].weight, timeout=timeouts[i])
        took[i] = trio.current_time() - start

    async with trio.open_nursery() as nursery:
        for i in range(len(members)):
            nursery.start_soon(one, i)
    return [info for info in infos if info is not None], took


async def test_a_leader_short_of_time_leaves_the_others_their_own_deadlines(
    autojump_clock: trio.testing.MockClock,
) -> None:
    led: list[tuple[int, list[AveragingInfo], list[float]]] = []
    with trio.fail_after(300):
        async with memnet_swarm(3, first_seed=11) as (_, nodes):
            members = make_members(nodes, 30_000, fast_config(group_size=4))
            await step_all(members, timeout=LONG)  # later rounds close early: all are back
            for it in range(9):  # the short one in turn; the hash picks the leader
                short = it % 3
                for m in members:
                    m.data = m.array.copy()
                await trio.sleep(1.0 - trio.current_time() % 1.0 + 0.05)  # a slot's start
                infos, took = await step_with(
                    members, [SHORT if i == short else LONG for i in range(3)]
                )
                verify_round(members, infos)
                assert took[short] <= SHORT + 1e-9  # its own timeout held
                if infos[short].leader == members[short].peer_id and len(infos[short].group) == 3:
                    led.append((short, infos, took))
    assert led, "the short-timeout peer never led: pick other seeds"
    for short, infos, took in led:
        for i, info in enumerate(infos):
            if i == short:
                continue
            # our own 20 s, not the leader's few ms: every part came back
            assert info.outcome is not Outcome.FAILED, info
            assert info.received_fraction == 1.0, info
            assert took[i] > SHORT, took
