"""A client-mode peer is not shut out when the full peers fill their groups exactly: a
churn trial's client was alone in 10 of 10 steps beside 4 full peers at ``group_size=4``.
Memory network, virtual time."""

from __future__ import annotations

import numpy as np
import trio
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all, verify_round

from training import Averager, Outcome


async def test_a_client_beside_full_peers_that_fill_their_group_averages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(5) as (_, nodes):
            members = make_members(nodes, 1 << 12, fast_config(group_size=4))
            client = members[-1]
            client.averager.close()
            client.averager = Averager(
                client.averager.node,
                "t/x",
                [client.array],
                config=fast_config(group_size=4, client_mode=True),
            )
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
