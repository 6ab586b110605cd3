"""``DHTConfig.replicas``: how many of the closest nodes a store reaches (None: k, the
paper's rule and the default). Fewer replicas cost fewer STORE RPCs per store (hivemind
1.1's DHTNode stores to 5 of k = 20); the closest nodes still hold every key, reads still
find it, and a newcomer among the closest is handed it. Memory network, virtual time."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

import peer
from peer.memnet import MemoryNetwork
from peer.node import Peer, PeerConfig, open_peer
from protocol.dhtid import DHTID
from protocol.identity import Identity

EPOCH = 1_700_000_000.0


def _identity(index: int) -> Identity:
    return Identity.from_seed(index.to_bytes(32, "big"))


async def _run_peer(
    net: MemoryNetwork,
    index: int,
    initial_peers: list[str],
    config: PeerConfig,
    *,
    task_status: trio.TaskStatus[Peer],
) -> None:
    host = f"10.0.{index // 250}.{index % 250 + 1}"
    async with open_peer(
        listen=f"{host}:4000",
        initial_peers=initial_peers,
        identity=_identity(index),
        network=net.interface(host),
        config=config,
        clock=lambda: EPOCH + trio.current_time(),
    ) as node:
        task_status.started(node)
        await trio.sleep_forever()


async def _swarm(
    nursery: trio.Nursery, net: MemoryNetwork, count: int, config: PeerConfig
) -> list[Peer]:
    first = await nursery.start(_run_peer, net, 0, [], config)
    swarm = [first]
    for index in range(1, count):
        swarm.append(await nursery.start(_run_peer, net, index, [first.address], config))
    return swarm


def _holders(swarm: list[Peer], key: str) -> set[int]:
    key_id = DHTID.from_key(key)
    return {i for i, node in enumerate(swarm) if node.dht.storage and node.dht.storage.get(key_id)}


def _closest(swarm: list[Peer], key: str, count: int) -> set[int]:
    key_id = DHTID.from_key(key)
    order = sorted(range(len(swarm)), key=lambda i: swarm[i].dht.node_id ^ key_id)
    return set(order[:count])


@pytest.mark.parametrize(
    "replicas", [0, 21, True, 2.5, "5"], ids=["zero", "over-k", "bool", "float", "str"]
)
def test_replicas_must_be_none_or_an_integer_up_to_k(replicas: object) -> None:
    with pytest.raises(ValueError, match=r"DHTConfig\.replicas"):
        peer.DHTConfig(replicas=replicas)  # type: ignore[arg-type]


def test_replicas_default_to_k() -> None:
    assert peer.DHTConfig().store_replicas == 20
    assert peer.DHTConfig(k=8).store_replicas == 8
    assert peer.DHTConfig(replicas=5).store_replicas == 5


@pytest.mark.parametrize("replicas", [None, 5], ids=["k", "five"])
async def test_the_closest_replicas_hold_each_key_and_every_peer_reads_it(
    autojump_clock: trio.testing.MockClock, replicas: int | None
) -> None:
    net = MemoryNetwork(latency=0.005)
    config = PeerConfig(dht=peer.DHTConfig(replicas=replicas))
    want = 20 if replicas is None else replicas
    rng = random.Random(7)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            swarm = await _swarm(nursery, net, 40, config)
            keys = [f"replicas/{n}" for n in range(20)]
            for key in keys:
                assert await rng.choice(swarm).dht.store(key, key, ttl=300.0)
            counts = []
            for key in keys:
                holders = _holders(swarm, key)
                assert _closest(swarm, key, want) <= holders, key
                counts.append(len(holders))
                reader = rng.choice(swarm)
                assert await reader.dht.get(key) == key
            if replicas is not None:
                # a store asks nodes on its way too (they keep a copy): a few more than 5,
                # far fewer than the 20+ that k replicas put it on
                assert max(counts) <= 2 * replicas, counts
            else:
                assert min(counts) >= 20, counts
            nursery.cancel_scope.cancel()


async def test_a_newcomer_among_the_closest_replicas_is_handed_the_key(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork(latency=0.005)
    config = PeerConfig(dht=peer.DHTConfig(replicas=3))
    key = "replicas/handover"
    key_id = DHTID.from_key(key)
    # the newcomer: an identity closer to the key than any of the first 30
    newcomer = min(range(30, 400), key=lambda i: DHTID.from_peer_id(_identity(i).peer_id) ^ key_id)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            swarm = await _swarm(nursery, net, 30, config)
            assert await swarm[5].dht.store(key, "v", ttl=300.0)
            assert all(
                DHTID.from_peer_id(_identity(newcomer).peer_id) ^ key_id
                < (node.dht.node_id ^ key_id)
                for node in swarm
            )
            late = await nursery.start(_run_peer, net, newcomer, [swarm[0].address], config)
            await trio.sleep(10.0)  # its join lookups reach the holders, which hand it over
            assert late.dht.storage is not None and late.dht.storage.get(key_id)
            nursery.cancel_scope.cancel()


async def test_every_reader_gets_every_subkey_of_a_shared_key(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nodes a store's lookup asks on the way keep a copy of that one store: with fewer
    replicas than k, reads counted such partial copies among the k closest toward their
    quorum, and a reader far from the key got 2 or 4 of 20 writers' subkeys (a re-check).
    A holder counts only among the ``replicas`` closest."""
    net = MemoryNetwork(latency=0.005)
    config = PeerConfig(dht=peer.DHTConfig(replicas=5))
    rng = random.Random(2)
    with trio.fail_after(900):
        async with trio.open_nursery() as nursery:
            swarm = await _swarm(nursery, net, 40, config)
            for j in range(4):
                key = f"shared/{j}"
                writers = rng.sample(range(len(swarm)), 20)
                for w in writers:
                    assert await swarm[w].dht.store(key, w, ttl=300.0, subkey=f"s{w}")
                want = {f"s{w}": w for w in writers}
                for reader in swarm:
                    assert await reader.dht.get(key) == want, key
            nursery.cancel_scope.cancel()
