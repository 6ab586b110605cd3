"""A client-mode peer is not shut out when the full peers fill their groups exactly: a
churn trial's client was alone in 10 of 10 steps beside 4 full peers at ``group_size=4``.
Memory network, virtual time."""

from __future__ import annotations

import numpy as np
import trio
from test_averaging_support import (
    Member,
    fast_config,
    make_members,
    memnet_swarm,
    step_all,
    verify_round,
)

from training import Averager, Outcome


def make_clients(members: list[Member], group_size: int) -> None:
    """Turn ``members`` into client-mode peers (their averagers made again)."""
    for member in members:
        member.averager.close()
        member.averager = Averager(
            member.averager.node,
            "t/x",
            [member.array],
            config=fast_config(group_size=group_size, client_mode=True),
        )


async def test_a_client_beside_full_peers_that_fill_their_group_averages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(5) as (_, nodes):
            members = make_members(nodes, 1 << 12, fast_config(group_size=4))
            make_clients(members[-1:], 4)
            for _round in range(3):
                for m in members:
                    m.data = m.array.copy()
                results = await step_all(members, timeout=30.0)
                infos = [info for info, _ in results]
                verify_round(members, infos)  # type: ignore[arg-type]
                for info in infos:
                    assert info is not None and info.outcome is Outcome.AVERAGED, info
                client_info = infos[-1]
                assert client_info is not None and 2 <= len(client_info.group) <= 4
    spread = max(np.ptp(np.stack([m.array for m in members]), axis=0))
    print(f"spread after 3 rounds: {spread:.3g}")


async def test_a_client_left_out_by_the_grouping_says_why_and_does_not_wait_a_round(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One full peer and four clients at group_size=4: one client is left out each round.
    From the second round on it followed the others into the next slot (the lone retry
    meant for peers that missed a slot boundary), found nobody there, and said only "no
    partner", a window later (a many-peer trial)."""
    with trio.fail_after(120):
        async with memnet_swarm(5) as (_, nodes):
            members = make_members(nodes, 1 << 10, fast_config(group_size=4))
            make_clients(members[1:], 4)
            for _round in range(4):
                for m in members:
                    m.data = m.array.copy()
                results = await step_all(members, timeout=30.0)
                verify_round(members, [info for info, _ in results])  # type: ignore[misc]
                alone = [(info, took) for info, took in results if info and len(info.group) == 1]
                assert len(alone) == 1, results
                info, took = alone[0]
                assert info.outcome is Outcome.ALONE
                assert "left us out" in info.note, info.note
                slowest_grouped = max(t for i, t in results if i and len(i.group) > 1)
                assert took <= slowest_grouped + 0.5, (took, slowest_grouped)
