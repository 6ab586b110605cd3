"""``averager.step(...)`` without ``await`` in a plain script on a background peer: it
blocks and returns the report, as the background peer's ``dht.store`` and ``dht.get`` do
(the issue's "blocking form through the background peer"); in async code it stays an
awaitable. Before, it returned a coroutine that never ran (``info.group`` then failed)."""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import trio

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
