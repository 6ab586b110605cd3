"""What a DHT node holds after a burst: a handover to newcomers and a republish run from a
few worker tasks, not one task per key (a bootstrap node holding 2,500 keys, joined by 3
newcomers at once, held 7,500 tasks waiting on a limiter, ~4 KiB each, and its RSS went
from 40 to 70 MiB for good: the allocator kept the freed memory; a churn trial), and
expired records are freed within a sweep interval, not at the next refresh."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from peer import Peer, open_peer
from peer.memnet import MemoryNetwork
from protocol.identity import Identity

KEYS = 1500


class _TaskCount(trio.abc.Instrument):
    """Live tasks now, and the most seen since ``reset``."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.live += 1
        self.peak = max(self.peak, self.live)

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self.live -= 1

    def reset(self) -> None:
        self.peak = self.live


@asynccontextmanager
async def _holding(net: MemoryNetwork, keys: int, ttl: float) -> AsyncIterator[Peer]:
    """A peer alone on ``net`` (so it holds every key it stores), holding ``keys`` keys."""
    async with open_peer(
        "10.0.0.1:4000", identity=Identity.from_seed(b"a" * 32), network=net.interface("10.0.0.1")
    ) as node:
        for i in range(keys):
            assert await node.dht.store(f"held/{i}", i, ttl=ttl)
        assert node.dht.storage is not None and len(node.dht.storage) == keys
        yield node


async def test_a_handover_of_many_keys_runs_from_a_few_tasks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork(latency=0.005)
    count = _TaskCount()
    trio.lowlevel.add_instrument(count)
    try:
        with trio.fail_after(600):
            async with _holding(net, KEYS, ttl=3600.0) as holder:
                await trio.sleep(1)
                count.reset()
                before = count.live
                async with open_peer(
                    "10.0.0.2:4000",
                    [holder.address],
                    Identity.from_seed(b"n" * 32),
                    network=net.interface("10.0.0.2"),
                ) as newcomer:
                    assert newcomer.dht.storage is not None
                    await trio.sleep(30)  # virtual: far less than republish_interval
                    assert len(newcomer.dht.storage) == KEYS  # every key was handed over
                    assert count.peak - before < 100  # was KEYS + ~40
                    # republish, from the holder's side: the same few workers
                    count.reset()
                    before = count.live
                    assert await holder.dht.republish() == KEYS
                    assert count.peak - before < 100
    finally:
        trio.lowlevel.remove_instrument(count)


async def test_expired_records_are_freed_without_a_store_or_refresh(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A node that nobody stores to held expired records until its next refresh (up to 10
    minutes): a bootstrap node's memory stayed at its churn peak that long (a trial)."""
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(600):
        async with _holding(net, 50, ttl=5.0) as node:
            assert node.dht.storage is not None
            await trio.sleep(5.0 + 31.0)  # expired, then one sweep later; no refresh yet
            assert len(node.dht.storage) == 0
