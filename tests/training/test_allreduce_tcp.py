"""Averaging over real loopback TCP (encrypted), with a member killed or frozen mid-round."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import numpy as np
import pytest
import trio
from test_allreduce_faults import after_acks
from test_averaging_support import Member, step_all, verify_round

from peer import Peer, TcpNetwork, open_peer, run_in_background
from protocol.identity import Identity
from training import Averager, AveragerConfig, AveragingInfo, DropReason, Outcome, PartStatus
from training.averaging.grouping import rank_key

TIMEOUT = 15.0
# The defaults' gather window and join timeout (1 s each), not 0.5 s and 0.3 s: on a machine
# shared with other test processes (load ~3 on 2 cores) the fault test's round once formed
# with 3 of its 4 members (it asserts 4); more room to see and join each other.
CONFIG = AveragerConfig(
    chunk_bytes=16384, gather_window=1.0, join_timeout=1.0, stall_timeout=1.0, max_inflight=3
)


class FreezableStream(trio.abc.Stream):
    """A TCP stream that stops moving bytes (but stays open) while its network is frozen."""

    def __init__(self, network: FreezableNetwork, inner: trio.abc.Stream) -> None:
        self.network = network
        self.inner = inner
        self.remote_host = "127.0.0.1"

    async def send_all(self, data: Any) -> None:
        await self.network.wait_thawed()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await self.network.wait_thawed()
        data = await self.inner.receive_some(max_bytes)
        await self.network.wait_thawed()
        return bytes(data)

    async def aclose(self) -> None:
        await self.inner.aclose()


class FreezableNetwork:
    """Real TCP for one peer, which :meth:`freeze` turns into a silent, open-socket zombie."""

    def __init__(self) -> None:
        self.inner = TcpNetwork()
        self.frozen = False

    def freeze(self) -> None:
        self.frozen = True

    async def wait_thawed(self) -> None:
        if self.frozen:
            await trio.sleep_forever()

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        return FreezableStream(self, await self.inner.connect(host, port))

    async def serve(
        self,
        host: str,
        port: int,
        handler: Callable[[trio.abc.Stream], Awaitable[None]],
        *,
        admit: Callable[[str], bool] | None = None,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def wrapped(stream: trio.abc.Stream) -> None:
            await handler(FreezableStream(self, stream))

        await self.inner.serve(host, port, wrapped, admit=admit, task_status=task_status)


def make_member(node: Peer, rng: np.random.Generator, size: int, weight: float) -> Member:
    data = rng.standard_normal(size).astype(np.float32)
    array = data.copy()
    return Member(Averager(node, "t/x", [array], config=CONFIG), data, array, weight=weight)


async def test_three_peers_average_over_tcp() -> None:
    rng = np.random.default_rng(0)
    with trio.fail_after(30):
        async with AsyncExitStack() as stack:
            nodes: list[Peer] = []
            for _ in range(3):
                initial = [nodes[0].address] if nodes else []
                nodes.append(await stack.enter_async_context(open_peer(initial_peers=initial)))
            members = [make_member(n, rng, 50_000, float(i + 1)) for i, n in enumerate(nodes)]
            results = await step_all(members, timeout=TIMEOUT)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    assert all(i is not None and i.outcome is Outcome.AVERAGED for i in infos)


def identities_with_a_non_leader_victim() -> tuple[list[Identity], Identity]:
    """Four fixed identities; the last one will not lead the first round."""
    ids = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(4)]
    seed = hashlib.sha256(b"t/x|round|0").digest()
    leader = min(range(4), key=lambda i: rank_key(seed, ids[i].peer_id))
    victim = ids.pop((leader + 1) % 4)
    return ids, victim


@pytest.mark.parametrize("fault", ["kill", "freeze"])
async def test_member_lost_mid_round_over_tcp(fault: str) -> None:
    rng = np.random.default_rng(1)
    identities, victim_identity = identities_with_a_non_leader_victim()
    with trio.fail_after(60):
        async with AsyncExitStack() as stack:
            survivors: list[Member] = []
            for i, identity in enumerate(identities):
                initial = [survivors[0].averager.node.address] if survivors else []
                node = await stack.enter_async_context(
                    open_peer(initial_peers=initial, identity=identity)
                )
                survivors.append(make_member(node, rng, 40_000, float(i + 1)))
            network = FreezableNetwork()
            scope = trio.CancelScope()
            started = trio.Event()
            go = trio.Event()
            box: dict[str, Any] = {}

            async def victim_life() -> None:
                with scope:
                    async with open_peer(
                        initial_peers=[survivors[0].averager.node.address],
                        identity=victim_identity,
                        network=network,
                    ) as node:
                        box["member"] = make_member(node, rng, 40_000, 2.0)
                        started.set()
                        await go.wait()
                        await box["member"].averager.step(2.0, timeout=TIMEOUT)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(victim_life)
                await started.wait()
                victim: Member = box["member"]
                after_acks(victim, 2, scope.cancel if fault == "kill" else network.freeze)
                go.set()
                results = await step_all(survivors, timeout=TIMEOUT)
                scope.cancel()
            infos: list[AveragingInfo] = []
            for info, elapsed in results:
                assert info is not None and elapsed <= TIMEOUT + 0.5
                infos.append(info)
            # the victim's own values are not checked (it never finished its step)
            nothing = AveragingInfo(Outcome.FAILED, 0, (), None, (), victim.data.size)
            verify_round([*survivors, victim], [*infos, nothing])
            # Over real TCP, "frozen" is best effort: cancelling a write to the frozen peer
            # mid-frame tears the connection down, and the next attempt finds it dead.
            reasons = {DropReason.DEAD} if fault == "kill" else {DropReason.FROZEN, DropReason.DEAD}
            for info in infos:
                assert info.outcome is Outcome.PARTIAL and len(info.group) == 4
                for part in info.parts:
                    if part.reducer == victim.peer_id:
                        assert part.status is PartStatus.NONE
                    else:
                        assert part.status is PartStatus.SOME
                    assert part.dropped[victim.peer_id] in {*reasons, DropReason.TIMEOUT}
            for m in survivors:
                m.data = m.array.copy()
            results = await step_all(survivors, timeout=TIMEOUT)
            next_infos = [info for info, _ in results]
            verify_round(survivors, next_infos)  # type: ignore[arg-type]
            assert all(i is not None and i.outcome is Outcome.AVERAGED for i in next_infos)


def test_step_blocking_with_background_peers() -> None:
    """Plain scripts: peers on background threads, ``step_blocking`` from two threads."""
    with run_in_background() as a, run_in_background(initial_peers=[a.address]) as b:
        arrays = [np.full(3000, 1.0, dtype=np.float32), np.full(3000, 4.0, dtype=np.float32)]
        averagers = [
            Averager(node, "t/blocking", [x], config=CONFIG)
            for node, x in zip((a, b), arrays, strict=True)
        ]
        results: list[Any] = [None, None]

        def run(i: int) -> None:
            results[i] = averagers[i].step_blocking(weight=float(i + 1), timeout=TIMEOUT)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=TIMEOUT + 5)
    assert all(r is not None and r.outcome is Outcome.AVERAGED for r in results)
    assert "averaged 100% over 2 peers" in str(results[0])
    for x in arrays:
        np.testing.assert_allclose(x, 3.0, rtol=1e-6)  # (1 * 1 + 2 * 4) / 3


def test_awaiting_step_on_a_background_peer_from_another_loop_is_refused() -> None:
    """A plain script's own trio.run must not drive a background peer's averager: a clear
    error, and the peer keeps working (it used to die inside trio)."""
    with run_in_background() as a:
        averager = Averager(a, "t/wrong-loop", [np.zeros(10, dtype=np.float32)], config=CONFIG)

        async def in_my_own_loop() -> None:
            await averager.step(timeout=3.0)

        with pytest.raises(RuntimeError, match="step_blocking"):
            trio.run(in_my_own_loop)
        assert a.dht.store("t/still-alive", 1, ttl=10.0)
        with pytest.raises(ValueError, match="finite number of seconds"):  # checked here
            averager.step_blocking(timeout=float("inf"))
        assert averager.step_blocking(timeout=1.0).outcome is Outcome.ALONE
