"""The peer's ``open_peer`` block ends while a step of its averager runs in another task.
Before the all-reduce the step raised ``PeerStoppedError``, as documented; during it, a
nested ExceptionGroup (dials refused, the host stopped, trio's shutdown) that
``except PeerStoppedError`` did not catch (a lifecycle trial)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from test_averaging_support import fast_config, host_of, virtual_clock

from peer import PeerStoppedError, open_peer
from peer.memnet import MemoryNetwork
from training import Averager
from training.averaging import butterfly as butterfly_module


async def test_a_peer_that_stops_mid_allreduce_raises_peer_stopped(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = MemoryNetwork(latency=0.005)
    in_butterfly = trio.Event()
    run = butterfly_module.Butterfly.run

    async def marked(self: Any, cutoff: float, deadline: float) -> Any:
        if self.node is second:
            in_butterfly.set()
        return await run(self, cutoff, deadline)

    monkeypatch.setattr(butterfly_module.Butterfly, "run", marked)
    outcome: dict[str, object] = {}

    async def step(name: str, averager: Averager) -> None:
        try:
            outcome[name] = await averager.step(timeout=20.0)
        except BaseException as exc:  # which kind is what the test is about
            outcome[name] = exc

    config = fast_config(chunk_bytes=4096)
    with trio.fail_after(120):
        async with open_peer(
            f"{host_of(0)}:1", network=net.interface(host_of(0)), clock=virtual_clock
        ) as first:
            a = Averager(first, "end/x", [np.ones(1 << 16, np.float32)], config=config)
            async with (
                trio.open_nursery() as nursery,
                open_peer(
                    f"{host_of(1)}:1",
                    [first.address],
                    network=net.interface(host_of(1)),
                    clock=virtual_clock,
                ) as second,
            ):
                b = Averager(second, "end/x", [np.ones(1 << 16, np.float32)], config=config)
                nursery.start_soon(step, "a", a)
                nursery.start_soon(step, "b", b)
                await in_butterfly.wait()
                # leaving the block ends b's peer while its step is under way
    assert isinstance(outcome["b"], PeerStoppedError), repr(outcome["b"])
    assert "during a step" in str(outcome["b"])
    assert not isinstance(outcome["a"], BaseException), repr(outcome["a"])
