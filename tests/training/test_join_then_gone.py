"""A member whose host dies after its join reached the leader, before the leader answered,
is left out of the confirmation: the leader's join handler is cancelled when the caller's
connection ends. A client-mode trial's survivors, confirmed with such a member, waited
5.0-5.5 s (stall_timeout) in their all-reduce to drop it as dead. Memory network,
virtual time."""

from __future__ import annotations

import trio
from test_averaging_support import (
    fast_config,
    host_of,
    make_members,
    memnet_swarm,
    slow_joins,
    step_all,
    verify_round,
)

from training import Averager, Outcome

STALL = 2.0  # fast_config's stall_timeout


async def test_a_member_gone_before_the_confirmation_is_left_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(4) as (net, nodes):
            members = make_members(nodes, 3000, fast_config(group_size=4))
            victim = members[3]
            victim.averager.close()
            victim.averager = Averager(
                victim.averager.node, "t/x", [victim.array],
                config=fast_config(group_size=4, client_mode=True),
            )  # fmt: skip
            survivors = members[:3]
            for m in survivors:  # the survivors' joins come late: the leader still waits
                slow_joins(m.averager.node, 0.3)  # within the leader's join_timeout (0.5 s)

            async def kill_the_victim_once_it_joined() -> None:
                while True:
                    for m in survivors:
                        state = m.averager._matchmaker.current
                        if state is not None and victim.peer_id in state.joined:
                            net.kill_host(host_of(3))
                            return
                    await trio.sleep(0.001)

            async def victim_step() -> None:
                with trio.move_on_after(30):
                    await victim.averager.step(timeout=20.0)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_the_victim_once_it_joined)
                nursery.start_soon(victim_step)
                results = await step_all(survivors, timeout=20.0)
                nursery.cancel_scope.cancel()
            infos = [info for info, _ in results]
            for info in infos:  # before the verifier, which knows only the survivors
                assert info is not None and victim.peer_id not in info.group, info
                assert info.outcome is Outcome.AVERAGED, info
                assert info.allreduce_s < STALL / 2, info.allreduce_s
            verify_round(survivors, infos)  # type: ignore[arg-type]
