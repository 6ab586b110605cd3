"""A peer whose process stood still (suspended, starved of CPU) during an all-reduce says
so in its report: the members it lists as ``timeout`` may have been waiting for it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from test_averaging_attacks import SIZE
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all

from training import Averager, AveragingInfo, Outcome
from training.averaging.descriptions import deadline_note
from training.averaging.loopwatch import PERIOD, LoopWatch
from training.averaging.reducing import ReducerService


async def test_a_loop_that_stood_still_is_measured(
    autojump_clock: trio.testing.MockClock,
) -> None:
    watch = LoopWatch()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await trio.sleep(2.0)
        assert watch.longest < 1e-9 and watch.note(1.0) == ""
        autojump_clock.jump(7.0)  # the clock moves on while no task runs: a suspension
        await trio.sleep(2 * PERIOD)
        watch.stop()
    assert 7.0 - PERIOD <= watch.longest <= 7.0
    assert watch.note(1.0).startswith(f"this process stood still for {watch.longest:.1f} s")
    assert "members dropped" in watch.note(1.0)
    # nobody was dropped: nothing to explain (a tester read the sentence with dropped={})
    assert watch.note(1.0, dropped=False).endswith("holding Python's GIL)")
    assert watch.note(8.0) == ""


async def test_a_stall_whose_late_wake_up_has_not_run_yet_counts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After a suspension the work may end (its timeout passed) before the watch's late
    wake-up runs: stop() counts the wake-up still due (an outside tester's leader, stopped
    while it held the joins, read ``alone`` with no word of the stall)."""
    watch = LoopWatch("matchmaking")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await trio.sleep(0.1)  # the watch sleeps, its wake-up due at 0.25
        autojump_clock.jump(7.0)  # a suspension: no task ran
        watch.stop()  # the work ends first
    assert 6.5 <= watch.longest <= 7.0
    assert watch.note(1.0).startswith("this process stood still for")


async def test_a_step_that_stood_still_in_matchmaking_says_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A laptop suspended during matchmaking read "unconfirmed ...: the timeout ended the
    gather window" or "alone ...", with no word of why (a sleep/resume trial)."""
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            averagers = [
                Averager(node, "watch/mm", [np.full(8, float(i), np.float32)], config=fast_config())
                for i, node in enumerate(nodes)
            ]
            infos: list[AveragingInfo] = []

            async def step(averager: Averager) -> None:
                infos.append(await averager.step(timeout=20.0))

            async with trio.open_nursery() as nursery:
                for averager in averagers:
                    nursery.start_soon(step, averager)
                await trio.sleep(0.3)  # both declared, gathering
                autojump_clock.jump(7.0)  # the whole process stands still
            for info in infos:
                assert "stood still for" in info.note and "during matchmaking" in info.note, info
                # before the matchmaker's own guesses of why
                assert info.note.startswith("this process stood still"), info.note
            # a step that ran smoothly says nothing of the kind
            async with trio.open_nursery() as nursery:
                for averager in averagers:
                    nursery.start_soon(step, averager)
            assert all("stood still" not in info.note for info in infos[2:]), infos[2:]


async def test_a_peer_left_alone_while_it_stood_still_says_that_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Alone after standing still in matchmaking: the stall leads the note, before the
    matchmaker's guesses of why nobody joined (a tester's suspended leader read "they may
    have read it before our declaration reached them" first)."""
    with trio.fail_after(60):
        async with memnet_swarm(1) as (_, nodes):
            averager = Averager(
                nodes[0], "watch/alone", [np.zeros(8, np.float32)], config=fast_config()
            )
            infos: list[AveragingInfo] = []

            async def step() -> None:
                infos.append(await averager.step(timeout=20.0))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(step)
                await trio.sleep(0.3)
                autojump_clock.jump(7.0)
            (info,) = infos
            print(info.note)
            assert info.outcome is Outcome.ALONE, info
            first, *others = info.note.split("; ")
            assert first.startswith("this process stood still for"), info.note
            assert others, info.note  # the matchmaker's own note follows


def test_a_deadline_after_a_stall_does_not_advise_more_time() -> None:
    """A process suspended past its step's timeout reported its healthy reducers as
    ``timeout`` and advised allowing the step more time (an outside tester)."""
    assert "allow the step more time" in deadline_note(2)
    stalled = deadline_note(2, stalled=True)
    assert "allow the step more time" not in stalled
    assert stalled.endswith("(this process standing still is the likely cause)")
    assert deadline_note(0, stalled=True) == ""


@pytest.mark.parametrize(("stall", "blamed"), [(1.2, False), (8.0, True)])
async def test_a_short_stall_does_not_take_the_blame_for_a_reducer_that_never_served(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    stall: float,
    blamed: bool,
) -> None:
    """A reducer takes every chunk and never serves its result: every honest step runs to
    its timeout. A stall of 1.2 s in it (stall_timeout 2 s, noted from 1 s) took the
    blame, and the advice about such a reducer was gone (a re-check); a stall of
    stall_timeout or more, after which the members drop us, is the likely cause."""
    with trio.fail_after(120):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes[:3], SIZE, fast_config())
            members += make_members(nodes[3:], SIZE, fast_config(bandwidth=1e300), seed=1)
            hoarder = members[3].peer_id
            serve = ReducerService.results

            async def never() -> AsyncIterator[Any]:
                await trio.sleep_forever()
                yield

            def results(self: ReducerService, member: Any) -> Any:
                return never() if self.plan.me == hoarder else serve(self, member)

            monkeypatch.setattr(ReducerService, "results", results)

            async def stand_still() -> None:
                await trio.sleep(5.0)  # into the all-reduce
                autojump_clock.jump(stall)  # nothing runs meanwhile

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stand_still)
                results_ = await step_all(members, timeout=12.0)
    info = results_[0][0]
    assert info is not None
    assert "this process stood still" in info.note, info.note
    assert "this step's timeout came before" in info.note, info.note
    assert ("standing still is the likely cause" in info.note) is blamed, info.note
    assert ("serves no result holds every step" in info.note) is not blamed, info.note
