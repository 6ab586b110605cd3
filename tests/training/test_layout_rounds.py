"""Layouts in matchmaking: a peer that met its own layout sits out a round of strangers, and
an early close counts its own layout (correct sub-swarms under one prefix still close early;
a straggler left with the old layout is told; a lone misconfigured newcomer never makes a
correct peer raise). Scenarios from issue 4 and docs/averaging.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import trio
import trio.testing
from test_averaging_support import (
    Member,
    fast_config,
    make_members,
    memnet_swarm,
    step_all,
    step_or_mismatch,
)

from training import (
    Averager,
    AveragingInfo,
    LayoutMismatchError,
    Outcome,
)

WINDOW = 4.0


async def _matchmaking_times(
    configs: Sequence[Mapping[str, object]], rounds: int
) -> list[list[float]]:
    times: list[list[float]] = []
    async with memnet_swarm(len(configs)) as (_, nodes):
        members = [
            make_members([node], 500, fast_config(gather_window=WINDOW, **cfg), seed=i)[0]
            for i, (node, cfg) in enumerate(zip(nodes, configs, strict=True))
        ]
        for _ in range(rounds):
            results = await step_all(members, timeout=30.0)
            for info, _ in results:
                assert info is not None and info.outcome is Outcome.AVERAGED, info
            times.append([info.matchmaking_s for info, _ in results])  # type: ignore[union-attr]
            await trio.sleep(0.01)
    return times


async def test_two_correct_sub_swarms_under_one_prefix_still_close_early(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two group sizes under one prefix are a supported set-up (docs: they group apart):
    a steady swarm of each kind must close its rounds early like a swarm of one kind,
    not wait for every slot's close because the other kind is there."""
    with trio.fail_after(300):
        one_kind = await _matchmaking_times([{"group_size": 16}] * 5, rounds=4)
        two_kinds = await _matchmaking_times(
            [{"group_size": 2}] * 2 + [{"group_size": 16}] * 3, rounds=4
        )
    print("one kind", one_kind, "two kinds", two_kinds)
    assert max(one_kind[-1]) < WINDOW / 2
    assert max(two_kinds[-1]) < WINDOW / 2


async def test_a_straggler_left_with_the_old_layout_is_told_after_a_few_rounds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The owner changed the model: every peer restarts with the new layout but one
    straggler, which has averaged with its own kind before. A lone stranger may be a
    misconfigured newcomer (the straggler sits that round out), but a stranger layout with
    company round after round is the swarm: the straggler gets ``LayoutMismatchError``
    instead of ``alone`` forever, and the new swarm averages meanwhile."""
    with trio.fail_after(300):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 500, fast_config())
            for info, _ in await step_all(members, timeout=20.0):
                assert info is not None and info.outcome is Outcome.AVERAGED
            straggler = members[0].averager
            for m in members[1:]:
                m.averager.close()
            restarted = make_members(nodes[1:], 600, fast_config(), seed=5)
            outcomes: list[Outcome | str] = []
            for _ in range(6):
                outcomes.append(await _step_beside(straggler, restarted))
                if outcomes[-1] == "mismatch":
                    break
    print(outcomes)
    assert outcomes[-1] == "mismatch" and len(outcomes) <= 3
    assert all(o is Outcome.ALONE for o in outcomes[:-1])


async def _step_beside(averager: Averager, others: list[Member]) -> Outcome | str:
    """One step of ``averager`` while ``others`` step too: its outcome, or "mismatch"."""
    outcome: Outcome | str = "none"

    async def one() -> None:
        nonlocal outcome
        try:
            outcome = (await averager.step(timeout=20.0)).outcome
        except LayoutMismatchError as exc:
            assert "3 rounds" in str(exc), exc
            outcome = "mismatch"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        results = await step_all(others, timeout=20.0)
    for info, _ in results:  # the others never wait for us
        assert info is not None and info.outcome is Outcome.AVERAGED, info
    return outcome


async def test_a_lone_misconfigured_newcomer_retrying_never_raises_in_a_correct_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The trade-off's other side: a newcomer of another layout, restarted round after
    round (its loop catches the error and steps again), beside one correct peer that
    averaged with its own kind before: the newcomer is told every time, the correct peer
    sits each round out (its note counts the stranger) and never raises."""
    with trio.fail_after(300):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes[:2], 500, fast_config())
            for info, _ in await step_all(members, timeout=20.0):
                assert info is not None and info.outcome is Outcome.AVERAGED
            members[1].averager.close()
            newcomer = make_members(nodes[2:], 600, fast_config(), seed=3)[0].averager
            notes = []
            for _ in range(5):
                outcome: list[AveragingInfo | LayoutMismatchError] = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(step_or_mismatch, newcomer, 20.0, outcome)
                    info = await members[0].averager.step(timeout=20.0)
                assert len(outcome) == 1 and isinstance(outcome[0], LayoutMismatchError)
                assert info.outcome is Outcome.ALONE, info
                notes.append(info.note)
    print(notes)
    assert all("1 peer(s) of another layout declared" in note for note in notes)
