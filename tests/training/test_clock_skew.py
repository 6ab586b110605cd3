"""Averaging rounds are slots of wall time: a peer whose clock is seconds off met nobody
(with the default 2 s window, 1 s off met the others in 2 of 6 steps, 3 s in none). The
node's network time (peer/netclock.py) puts it back in the others' rounds."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import trio
import trio.testing

from peer.memnet import MemoryNetwork
from peer.netclock import ClockConfig
from peer.node import PeerConfig, open_peer
from training import Averager, AveragerConfig, AveragingInfo

STEPS = 3


def virtual(skew: float) -> Callable[[], float]:
    return lambda: 1_700_000_000.0 + trio.current_time() + skew


async def run_steps(
    skew: float, sync: bool, averager_clock: bool = True
) -> list[list[AveragingInfo]]:
    """Three peers, the third ``skew`` seconds off (its node and its averager read the
    same wrong clock, as on a real machine; ``averager_clock=False``: the averager is
    given none and reads the node's); the groups of each step."""
    net = MemoryNetwork(latency=0.005)
    config = PeerConfig(clock=ClockConfig(enabled=sync))
    clocks = [virtual(0.0), virtual(0.0), virtual(skew)]
    arrays = [np.full(1000, float(i), np.float32) for i in range(3)]

    def peer_at(i: int, initial: list[str]):  # type: ignore[no-untyped-def]
        host = f"10.0.0.{i + 1}"
        return open_peer(
            f"{host}:1000", initial, network=net.interface(host), clock=clocks[i], config=config
        )

    steps: list[list[AveragingInfo]] = []

    async def step(averager: Averager, infos: list[AveragingInfo]) -> None:
        infos.append(await averager.step(timeout=30.0))

    async with (
        peer_at(0, []) as first,
        peer_at(1, [first.address]) as second,
        peer_at(2, [first.address]) as third,
    ):
        averagers = [
            Averager(node, "skew/x", [a], config=AveragerConfig(clock=clock))
            if averager_clock
            else Averager(node, "skew/x", [a])
            for node, a, clock in zip((first, second, third), arrays, clocks, strict=True)
        ]
        for _ in range(STEPS):
            infos: list[AveragingInfo] = []
            async with trio.open_nursery() as nursery:
                for averager in averagers:
                    nursery.start_soon(step, averager, infos)
            steps.append(infos)
            await trio.sleep(0.3)
        for averager in averagers:
            averager.close()
    return steps


@pytest.mark.parametrize(("skew", "averager_clock"), [(3.0, True), (-5.0, True), (3.0, False)])
async def test_a_peer_whose_clock_is_off_averages_with_the_others(
    autojump_clock: trio.testing.MockClock, skew: float, averager_clock: bool
) -> None:
    with trio.fail_after(300):
        steps = await run_steps(skew, sync=True, averager_clock=averager_clock)
    for infos in steps:
        assert [len(info.group) for info in infos] == [3, 3, 3]
        assert all(info.averaged_fraction == 1.0 for info in infos)


async def test_without_network_time_it_is_left_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(300):
        steps = await run_steps(3.0, sync=False)
    for infos in steps:
        assert sorted(len(info.group) for info in infos) == [1, 2, 2]
