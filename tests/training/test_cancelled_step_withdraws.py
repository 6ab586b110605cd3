"""A step cut short during matchmaking (its caller's cancel scope) replaces its declaration
by a "done" marker in the background. Left there, it read as a peer still waiting in the
slot: a client-mode peer cannot be pinged, and the two peers stepping on in the same slot
were each left alone beside it, with notes that disagreed (an outside tester's fuzzer:
4 of 5 cancel times). Memory network, virtual time."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import numpy as np
import pytest
import trio
import trio.testing

from peer import MemoryNetwork, Peer, open_peer
from protocol.identity import Identity
from training import Averager, AveragerConfig, AveragingInfo, Outcome

T0 = 1_700_000_000.0


def _clock() -> float:
    return T0 + trio.current_time()


@pytest.mark.parametrize("cancel_at", [0.01, 0.045, 0.12])
async def test_the_others_average_in_the_slot_a_cancelled_client_declared_in(
    autojump_clock: trio.testing.MockClock, cancel_at: float
) -> None:
    net = MemoryNetwork(latency=0.005)
    config = AveragerConfig(
        clock=_clock, chunk_bytes=4096, gather_window=1.0, join_timeout=0.5,
        stall_timeout=2.0, group_size=2,
    )  # fmt: skip

    def peer(index: int, client: bool = True) -> AbstractAsyncContextManager[Peer]:
        host = f"10.0.0.{index}"
        return open_peer(
            None if client else f"{host}:1000", [] if index == 1 else [a.address],
            client_mode=client, network=net.interface(host), clock=_clock,
            identity=Identity.from_seed(bytes([index]) * 32),
        )  # fmt: skip

    with trio.fail_after(120):
        async with peer(1, client=False) as a, peer(2) as b, peer(3) as c:
            averagers = {
                name: Averager(node, "ghost/x", [np.full(500, float(i), np.float32)], config=config)
                for i, (name, node) in enumerate(zip("abc", (a, b, c), strict=True))
            }
            infos: dict[str, AveragingInfo] = {}

            async def step(name: str, cancel: bool) -> None:
                with trio.CancelScope() as scope:
                    if cancel:
                        scope.deadline = trio.current_time() + cancel_at
                    infos[name] = await averagers[name].step(weight=1.0, epoch=0, timeout=20.0)

            async def round_of(names: str, cancelled: str = "") -> list[Outcome]:
                infos.clear()
                async with trio.open_nursery() as nursery:
                    for name in names:
                        nursery.start_soon(step, name, name in cancelled)
                return [infos[name].outcome for name in sorted(infos)]

            await round_of("abc")
            await round_of("abc")
            await round_of("abc", cancelled="b")
            # the step after b's cancelled one, in the slot b declared in
            assert await round_of("ac") == [Outcome.AVERAGED] * 2
            # b's own next step (after its marker): a pair and one alone, as before
            assert sorted(await round_of("abc")) == [Outcome.ALONE, *[Outcome.AVERAGED] * 2]
