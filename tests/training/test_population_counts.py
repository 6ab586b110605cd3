"""The population a peer expects before closing a round early (the most peers of its layout
in its last 3 rounds) is what it read, and nothing it guessed (memory network, virtual
time).

A version that took the members its group could not reach in an all-reduce out of those
counts (so that the survivors of a killed member close their next rounds early) was
reverted: a review found that a live peer behind a brief partition was then forgotten, and
one whose steps start a moment after the others' was left out of every later round (the
others closed early without it and recorded the smaller count); and that a dead peer was
subtracted from rounds it had not been in, leaving out a peer that had.
"""

from __future__ import annotations

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

WINDOW = 4.0
LATE = 0.6  # the late peer's steps start this long after the others' (within the slot)


async def _staggered(members: list[Member], late: set[int], delay: float) -> list[AveragingInfo]:
    """Every member steps once; those in ``late`` start ``delay`` seconds after the rest."""
    infos: list[AveragingInfo | None] = [None] * len(members)

    async def one(i: int) -> None:
        if i in late:
            await trio.sleep(delay)
        infos[i] = await members[i].averager.step(weight=1.0, timeout=30.0)

    async with trio.open_nursery() as nursery:
        for i in range(len(members)):
            nursery.start_soon(one, i)
    assert all(info is not None for info in infos)
    return infos  # type: ignore[return-value]


async def _slot_start() -> None:
    await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.1)


async def test_a_brief_partition_does_not_leave_a_late_peer_out_for_good(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A and X cannot reach each other for 0.2 s during an all-reduce (B reaches both);
    both are alive. X's steps start 0.6 s after the others' in every slot: the others wait
    for it, as they did before the partition, and all three average in every later round."""
    config = fast_config(gather_window=WINDOW, max_inflight=2)
    a, x = 0, 2
    with trio.fail_after(600):
        async with memnet_swarm(3, first_seed=40) as (net, nodes):
            members = make_members(nodes, 16_384, config)
            await step_all(members, timeout=30.0)
            for _ in range(2):  # steady: X comes late, the others wait for it
                await _slot_start()
                await _staggered(members, {x}, LATE)
            token = trio.lowlevel.current_trio_token()

            async def blip() -> None:
                net.partition([host_of(a)], [host_of(x)])
                await trio.sleep(0.2)
                net.heal()

            async with trio.open_nursery() as nursery:
                after_acks(members[a], 1, lambda: token.run_sync_soon(nursery.start_soon, blip))
                await _slot_start()
                await _staggered(members, set(), 0)
            later = []
            for _ in range(4):
                await _slot_start()
                later.append(await _staggered(members, {x}, LATE))
    for infos in later:
        for info in infos:
            assert info.outcome is Outcome.AVERAGED and len(info.group) == 3, str(info)


async def test_a_dead_peer_does_not_lower_the_count_of_rounds_it_was_not_in(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A, B and C step in two rounds; then A, B and X (C skips a slot), and X is killed
    mid-round. C steps again in the next slots, 0.6 s after A and B: three peers come, as
    in the rounds before X's, and A and B wait for C."""
    config = fast_config(gather_window=WINDOW, max_inflight=2)
    a, b, c, x = 0, 1, 2, 3
    with trio.fail_after(600):
        async with memnet_swarm(4, first_seed=40) as (net, nodes):
            members = make_members(nodes, 16_384, config)
            for _ in range(2):
                await _slot_start()
                await _staggered(members[:3], set(), 0)
            await _slot_start()
            after_acks(members[x], 2, lambda: net.kill_host(host_of(x)))
            await _staggered([members[a], members[b], members[x]], set(), 0)
            for _ in range(3):
                await _slot_start()
                infos = await _staggered(members[:3], {c}, LATE)
    for info in infos:
        assert info.outcome is Outcome.AVERAGED and len(info.group) == 3, str(info)
