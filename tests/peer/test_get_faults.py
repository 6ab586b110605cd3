"""A get whose holder fails partway through a paged read.

A holder that dies between the pages of a key too large for one reply (1 MiB) must count
as failed: part of the key must not pass for all of it, nor count toward the quorum.
Other holders are asked instead; with none, the get returns None.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing

from peer import Peer, PeerConfig
from peer.memnet import MemoryNetwork
from peer.node import open_peer
from protocol.dhtid import DHTID
from protocol.identity import Identity
from protocol.messages import FindValueResponse, NodeInfo

EPOCH = 1_700_000_000.0  # unix time at virtual time 0: expirations travel as unix times
LATENCY = 0.01
BIG = {f"part-{i:03d}": bytes([i]) * 8000 for i in range(200)}  # 1.6 MB: two replies


def _unix_time() -> float:
    return EPOCH + trio.current_time()


def _host(index: int) -> str:
    return f"10.0.0.{index}"


async def _open(
    stack: AsyncExitStack,
    net: MemoryNetwork,
    index: int,
    initial: list[str],
    *,
    client_mode: bool = False,
) -> Peer:
    return await stack.enter_async_context(
        open_peer(
            None if client_mode else f"{_host(index)}:0",
            initial,
            identity=Identity.from_seed(index.to_bytes(32, "big")),
            client_mode=client_mode,
            network=net.interface(_host(index)),
            config=PeerConfig(),
            clock=_unix_time,
        )
    )


def _node(index: int) -> NodeInfo:
    peer_id = Identity.from_seed(index.to_bytes(32, "big")).peer_id
    return NodeInfo(peer_id, f"10.1.0.{index}:1")


Pager = Callable[[NodeInfo, DHTID, bytes | None], Awaitable[FindValueResponse | None]]


def _before_second_page(
    monkeypatch: pytest.MonkeyPatch, reader: Peer, action: Callable[[NodeInfo], None]
) -> list[NodeInfo]:
    """Run ``action(holder)`` once, just before ``reader`` first asks a holder for a later
    page; returns the holder it ran for."""
    find_value: Pager = reader.dht.protocol.find_value
    hit: list[NodeInfo] = []

    async def paged(
        node: NodeInfo, key: DHTID, after: bytes | None = None
    ) -> FindValueResponse | None:
        if after is not None and not hit:
            hit.append(node)
            action(node)
        return await find_value(node, key, after)

    monkeypatch.setattr(reader.dht.protocol, "find_value", paged)
    return hit


# ---- a holder that dies partway --------------------------------------------------------


async def _sole_holder_and_reader(stack: AsyncExitStack, net: MemoryNetwork) -> Peer:
    """Node 1 holds the 200 subkeys of ``BIG`` under "big"; returns node 2, a client."""
    holder = await _open(stack, net, 1, [])
    for subkey, value in BIG.items():
        assert await holder.dht.store("big", value, ttl=600.0, subkey=subkey)
    return await _open(stack, net, 2, [holder.address], client_mode=True)


async def test_a_sole_holder_that_dies_between_pages_gives_none_not_part_of_the_key(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tester's case: one node holds 200 subkeys of 8 KB, a client reads them, and the
    holder dies after the first page. The get returned the first page's subkeys as if they
    were all; now nobody delivered the whole key: None."""
    net = MemoryNetwork(latency=LATENCY)
    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            reader = await _sole_holder_and_reader(stack, net)
            assert await reader.dht.get("big") == BIG  # (whole while the holder lives)
            killed = _before_second_page(monkeypatch, reader, lambda _: net.kill_host(_host(1)))
            assert await reader.dht.get("big") is None
            assert len(killed) == 1
            assert await reader.dht.get("big") is None


async def test_a_holder_that_dies_between_pages_did_not_answer_the_read(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_entries`` counts a node as answered once its whole copy came: one that fails
    partway gave nothing usable (a review: it counted after its first page)."""
    net = MemoryNetwork(latency=LATENCY)
    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            reader = await _sole_holder_and_reader(stack, net)
            read = await reader.dht.read_entries("big")
            assert (read.asked, read.answered, len(read.entries)) == (1, 1, len(BIG))
            _before_second_page(monkeypatch, reader, lambda _: net.kill_host(_host(1)))
            read = await reader.dht.read_entries("big")
            assert (read.asked, read.answered, read.entries) == (1, 0, {})


async def test_a_holder_that_dies_between_pages_is_replaced_by_another(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four nodes hold the key (fewer than k: all of them). ``latest=False`` ends at the
    first holder: the one that dies after its first page must not be that holder (the get
    returned its ~128 subkeys of 200); the next one asked delivers the whole key."""
    net = MemoryNetwork(latency=LATENCY)
    with trio.fail_after(300):
        async with AsyncExitStack() as stack:
            first = await _open(stack, net, 1, [])
            servers = [first] + [await _open(stack, net, i, [first.address]) for i in (2, 3, 4)]
            for subkey, value in BIG.items():
                assert await servers[1].dht.store("big", value, ttl=600.0, subkey=subkey)
            reader = await _open(stack, net, 9, [first.address], client_mode=True)
            await reader.dht.find_peers()
            hosts = {s.peer_id: s.address.split("@")[1].split(":")[0] for s in servers}

            def kill(node: NodeInfo) -> None:
                net.kill_host(hosts[node.peer_id])

            killed = _before_second_page(monkeypatch, reader, kill)
            assert await reader.dht.get("big", latest=False) == BIG
            assert len(killed) == 1  # one died; another holder read whole, not killed
            # and a quorum read counts only whole copies (the dead one is not among them)
            assert await reader.dht.get("big") == BIG
