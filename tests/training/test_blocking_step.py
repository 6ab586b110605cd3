"""``averager.step(...)`` without ``await`` in a plain script on a background peer: it
blocks and returns the report, as the background peer's ``dht.store`` and ``dht.get`` do
(the issue's "blocking form through the background peer"); in async code it stays an
awaitable. Before, it returned a coroutine that never ran (``info.group`` then failed)."""

from __future__ import annotations

import gc
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import trio
import trio.testing
from test_averaging_support import fast_config, make_members, memnet_swarm

from peer import open_peer, run_in_background
from training import Averager, AveragerConfig, AveragingInfo, Outcome


def test_step_without_await_on_a_background_peer_averages_and_returns_the_report() -> None:
    config = AveragerConfig(gather_window=0.5, join_timeout=0.5)
    with (
        run_in_background("127.0.0.1:0") as first,
        run_in_background("127.0.0.1:0", [first.address]) as second,
    ):
        mine, theirs = torch.full((5000,), 3.0), torch.full((5000,), 1.0)
        averager = Averager(first, "blocking/p", [mine], config=config)
        other = Averager(second, "blocking/p", [theirs], config=config)
        # two steps started together may still meet in different rounds (each then alone,
        # its tensor untouched): a few tries, both or neither
        for _attempt in range(3):
            with ThreadPoolExecutor(1) as pool:
                theirs_done = pool.submit(other.step, weight=1.0, timeout=10.0)
                info = averager.step(weight=3.0, epoch=0, timeout=10.0)
                their_info = theirs_done.result()
            assert isinstance(info, AveragingInfo) and isinstance(their_info, AveragingInfo)
            if info.outcome is Outcome.AVERAGED:
                break
            assert info.outcome is their_info.outcome is Outcome.ALONE, (info, their_info)
        assert info.outcome is their_info.outcome is Outcome.AVERAGED, (info, their_info)
        assert info.averaged_fraction == their_info.averaged_fraction == 1.0
        assert sorted(info.group) == sorted([first.peer_id, second.peer_id])
        assert torch.equal(mine, torch.full((5000,), 2.5)) and torch.equal(mine, theirs)
        with pytest.raises(ValueError, match="weight"):  # checked before blocking
            averager.step(weight=-1.0)
        averager.close()
        other.close()


def test_awaiting_it_from_another_trio_loop_is_still_refused() -> None:
    """In a trio task, ``step`` is the awaitable as before: on a background peer's averager
    from another loop, that is the clear error it was."""
    with run_in_background("127.0.0.1:0") as node:
        averager = Averager(node, "blocking/loop", [torch.zeros(4)])

        async def main() -> None:
            with pytest.raises(RuntimeError, match=r"call step_blocking\(\) from a thread"):
                await averager.step(timeout=1.0)

        trio.run(main)
        averager.close()


def test_a_background_step_dropped_in_a_trio_task_is_named_by_the_next_blocking_step() -> None:
    """A background averager's ``step()`` without ``await`` in a trio task of the script's
    only warned when collected; the next step, from a plain thread, ran as if nothing had
    been lost (an outside tester). It says so now, as a next step in async code does."""
    with run_in_background("127.0.0.1:0") as node:
        tensor = torch.zeros(4)
        averager = Averager(node, "blocking/dropped", [tensor])

        async def main() -> None:
            averager.step(timeout=1.0)  # type: ignore[unused-coroutine]
            gc.collect()

        for blocking in (averager.step, averager.step_blocking):
            with pytest.warns(RuntimeWarning, match="never awaited"):
                trio.run(main)
            with pytest.raises(RuntimeError, match=r"never awaited.*await averager.step"):
                blocking(timeout=0.5)
        assert averager.step(timeout=0.5).group == (node.peer_id,)  # said once
        averager.close()


async def test_an_open_peer_averagers_step_from_a_plain_thread_says_so() -> None:
    """Its coroutine could only run in the peer's own loop: from a worker thread ``step()``
    returned one that nothing ever ran (a helper's trial), where ``step_blocking`` said why."""
    with trio.fail_after(30):
        async with open_peer("127.0.0.1:0") as node:
            averager = Averager(node, "blocking/thread", [torch.zeros(4)])
            with pytest.raises(RuntimeError, match=r"await averager\.step\(\.\.\.\) in that"):
                await trio.to_thread.run_sync(averager.step)
            averager.close()


def test_a_with_block_closes_the_averager() -> None:
    with run_in_background("127.0.0.1:0") as node:
        tensor = torch.zeros(4)
        with Averager(node, "blocking/with", [tensor]) as averager:
            assert isinstance(averager, Averager)
        with pytest.raises(RuntimeError, match="'blocking/with' is closed"):
            averager.step(timeout=1.0)
        Averager(node, "blocking/with", [tensor]).close()  # the prefix is free again


def test_a_closed_averager_says_only_that_it_is_closed() -> None:
    """Its tensors referenced by nothing else (a throwaway tensor): ``step()`` warned that
    nobody would see their average before it raised "closed" (a helper's trial)."""
    with run_in_background("127.0.0.1:0") as node:
        averager = Averager(node, "blocking/closed", [torch.zeros(4)])
        averager.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeError, match="'blocking/closed' is closed"):
                averager.step(timeout=1.0)


def test_the_unreferenced_warning_stays_short_for_many_tensors() -> None:
    """It listed every index: 29,370 characters for a model of 5,000 parameters whose
    ``.grad`` ``zero_grad()`` let go (an outside tester). Now a count and the first ones."""
    config = AveragerConfig(gather_window=0.2, join_timeout=0.1)
    with run_in_background("127.0.0.1:0") as node:
        tensors = [torch.zeros(2) for _ in range(5000)]
        averager = Averager(node, "blocking/lost", tensors, config=config)
        del tensors
        with pytest.warns(RuntimeWarning, match="referenced by nothing") as seen:
            averager.step(timeout=1.0)
        averager.close()
    message = str(seen[0].message)
    assert "5000 of its 5000 tensors ([0, 1, 2, 3, 4, 5, 6, 7, ...])" in message, message
    assert len(message) < 1000


def _slow_checks(monkeypatch: pytest.MonkeyPatch, wait: Any) -> None:
    """The per-tensor checks before a step take time (``wait()``), as they do with very
    many tensors (a trial: 100,000 one-element tensors, 0.57 s a step)."""
    from training.averaging.layout import FlatVector

    check = FlatVector.check_memory

    def slow_check(self: FlatVector) -> None:
        wait()
        check(self)

    monkeypatch.setattr(FlatVector, "check_memory", slow_check)


async def test_the_checks_before_a_step_count_against_its_timeout(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline counts from the call, not from after the checks: a step alone with
    checks that took 0.6 s of its 1 s returns 1 s after the call (it took 1.6 s)."""
    _slow_checks(monkeypatch, lambda: autojump_clock.jump(0.6))
    with trio.fail_after(30):
        async with open_peer("127.0.0.1:0") as node:
            tensor = torch.zeros(4)
            averager = Averager(node, "blocking/slow", [tensor])
            start = trio.current_time()
            info = await averager.step(timeout=1.0)
            assert trio.current_time() - start <= 1.0 + 1e-6
            assert info.outcome in (Outcome.ALONE, Outcome.UNCONFIRMED)
            averager.close()


def test_the_checks_before_a_blocking_step_count_against_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same through the background peer: the checks run in the caller's thread, before
    the step hops to the peer's loop, where its clock started afresh (1.0 s of checks and
    a 1.0 s timeout took 2.0 s and more)."""
    import time

    _slow_checks(monkeypatch, lambda: time.sleep(1.0))
    with run_in_background("127.0.0.1:0") as node:
        tensor = torch.zeros(4)
        averager = Averager(node, "blocking/slow", [tensor])
        start = time.monotonic()
        info = averager.step(timeout=1.0)
        took = time.monotonic() - start
        averager.close()
    assert info.outcome in (Outcome.ALONE, Outcome.UNCONFIRMED)
    assert took < 1.8, took  # 1.0 s and the hop to the loop (scheduling noise aside)


async def test_the_unreferenced_check_is_asked_at_the_first_steps_then_ever_more_rarely(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It costs ~4 us per tensor: at steps 1-4, then 8, 16, 32..., not at every step."""
    from training.averaging.layout import FlatVector

    asked: list[int] = []
    steps = [0]
    unreferenced = FlatVector.unreferenced

    def counting(self: FlatVector) -> list[int]:
        asked.append(steps[0])
        return unreferenced(self)

    monkeypatch.setattr(FlatVector, "unreferenced", counting)
    with trio.fail_after(300):
        async with open_peer("127.0.0.1:0") as node:
            tensor = torch.zeros(4)
            averager = Averager(node, "blocking/asked", [tensor])
            for steps[0] in range(1, 18):
                await averager.step(timeout=0.05)
            averager.close()
    assert asked == [1, 2, 3, 4, 8, 16]


async def test_a_step_never_awaited_is_named_at_the_next_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``averager.step(...)`` as a bare statement in async code did nothing, and the only
    sign was Python's warning when the coroutine was collected (an outside trial): training
    went on without any averaging. The next step says so."""
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            (member,) = make_members(nodes, 8, fast_config())
            with pytest.warns(RuntimeWarning, match="never awaited"):
                member.averager.step(timeout=1.0)  # type: ignore[unused-coroutine]
                gc.collect()
            with pytest.raises(RuntimeError, match=r"never awaited.*await averager.step"):
                await member.averager.step(timeout=1.0)
            assert (await member.averager.step(timeout=1.0)).group == (member.peer_id,)
            kept = member.averager.step(timeout=1.0)  # made now, awaited later: fine
            assert (await kept).group == (member.peer_id,)
            async with trio.open_nursery() as nursery:  # started as a task: fine too
                nursery.start_soon(member.averager.step)
            assert (await member.averager.step(timeout=1.0)).group == (member.peer_id,)
