"""A peer that failed the others' joins at once (a ghost: its declaration stays in the round
key) and then declares anew counts again for the early close (memory network, virtual
time)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all

from training import AveragingInfo, Outcome
from training.averaging.matchmaking import Matchmaker

WINDOW = 8.0
AWAY = 1.5  # seconds between the ghost's cancelled step and its next one


async def test_a_ghost_leader_that_steps_again_counts_for_the_early_close(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three members step early in a long slot; the one that leads is cancelled as it
    starts leading (the others' joins fail at once: a ghost, its declaration left in the
    round key), and steps again 1.5 s later, in the same slot, with a new declaration,
    while the other two, having averaged as a pair, step again. Their step has all three
    declared and closes early (2.0 s of matchmaking, of which 1.5 s waiting for the third).
    Ghosts used to be left out of the peers present by PeerID: the two waited for the
    slot's close (6.8 s) although the third was back."""
    config = fast_config(gather_window=WINDOW)
    phase = [0]
    cancelled: list[int] = []
    scopes: dict[int, trio.CancelScope] = {}
    lead = Matchmaker._lead

    async def cancelled_lead(self: Matchmaker, *args: Any, **kwargs: Any) -> Any:
        if phase[0] == 1 and not cancelled:
            who = next(i for i, m in enumerate(members) if m.averager._matchmaker is self)
            cancelled.append(who)
            scopes[who].cancel()
            await trio.lowlevel.checkpoint()
        return await lead(self, *args, **kwargs)

    monkeypatch.setattr(Matchmaker, "_lead", cancelled_lead)
    with trio.fail_after(300):
        async with memnet_swarm(3, first_seed=40) as (_, nodes):
            members = make_members(nodes, 16_384, config)
            await step_all(members, timeout=30.0)  # each learns of the others
            await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.1)  # early in a slot
            await step_all(members, timeout=30.0)  # steady: closes early
            phase[0] = 1
            infos: dict[int, list[AveragingInfo]] = {0: [], 1: [], 2: []}

            async def one(i: int) -> None:
                with trio.CancelScope() as scopes[i]:
                    infos[i].append(await members[i].averager.step(weight=1.0, timeout=30.0))
                if i in cancelled:
                    await trio.sleep(AWAY)  # the others' step goes on without it
                infos[i].append(await members[i].averager.step(weight=1.0, timeout=30.0))

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
    (ghost,) = cancelled
    assert len(infos[ghost]) == 1  # its first step was cancelled
    for i in set(range(3)) - {ghost}:
        first = infos[i][0]
        assert first.outcome is Outcome.AVERAGED and len(first.group) == 2, str(first)
    for i in range(3):
        last = infos[i][-1]
        assert last.outcome is Outcome.AVERAGED and len(last.group) == 3, str(last)
        # the two waited for the third to come back (AWAY), not for the slot's close
        assert last.matchmaking_s < AWAY + 1.0, (i, last.matchmaking_s, str(last))
