"""A peer whose process stood still (suspended, starved of CPU) during an all-reduce says
so in its report: the members it lists as ``timeout`` may have been waiting for it."""

from __future__ import annotations

import trio
import trio.testing

from training.averaging.loopwatch import PERIOD, LoopWatch


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
    assert watch.note(8.0) == ""
