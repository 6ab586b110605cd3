"""A member killed in the all-reduce stops counting in the population the survivors expect
(``Matchmaker.forget``): their next rounds close early without it (memory network,
virtual time)."""

from __future__ import annotations

import trio
import trio.testing
from test_allreduce_faults import after_acks
from test_averaging_support import fast_config, host_of, make_members, memnet_swarm, step_all

from training import Outcome

WINDOW = 8.0


async def test_survivors_of_a_killed_member_close_their_next_rounds_early(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three members step early in a long slot, closing their rounds early (each expects
    the other two). One is killed in the middle of its uploads: the survivors' round is
    partial, and they step on at once. An outside tester's survivors then waited for the
    slot's close in each of their next two steps (2.6 s and 6.1 s with a 6 s window, against
    0.5 s a step before the kill), expecting three peers where two were left."""
    config = fast_config(gather_window=WINDOW, max_inflight=2)
    with trio.fail_after(300):
        async with memnet_swarm(3) as (net, nodes):
            members = make_members(nodes, 16_384, config)
            for m in members:
                m.weight = 1.0
            await step_all(members, timeout=30.0)  # each learns of the others
            await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.1)  # early in a slot
            steady = await step_all(members, timeout=30.0)
            assert all(i is not None and i.matchmaking_s < 1.0 for i, _ in steady), steady
            victim = 2
            after_acks(members[victim], 2, lambda: net.kill_host(host_of(victim)))
            killed = await step_all(members, timeout=30.0)
            survivors = members[:victim]
            for info, _ in killed[:victim]:
                assert info is not None and info.outcome is Outcome.PARTIAL, str(info)
            after = [await step_all(survivors, timeout=30.0) for _ in range(2)]
    for results in after:
        for info, _ in results:
            assert info is not None and info.outcome is Outcome.AVERAGED, str(info)
            assert len(info.group) == 2
            assert info.matchmaking_s < 1.0, (info.matchmaking_s, str(info))  # closed early
