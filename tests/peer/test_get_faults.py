"""A get whose holder fails partway through a paged read, or is only slow.

- A holder that dies between the pages of a key too large for one reply (1 MiB) must
  count as failed: part of the key must not pass for all of it, nor count toward the
  quorum. Other holders are asked instead; with none, the get returns None.
- A lookup gives up on a request after a silence of the hedge delay, to ask another node
  in its place. With nobody else to ask and no answer yet, it waits for that request up
  to its own timeout, and a late answer counts (a get from a client whose only contact,
  the only holder, froze for 1.2 s returned None after the hedge's 1 s).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing

from peer import Peer, PeerConfig
from peer.dht.lookup import iterative_lookup
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


async def test_a_sole_holder_that_dies_between_pages_gives_none_not_part_of_the_key(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tester's case: one node holds 200 subkeys of 8 KB, a client reads them, and the
    holder dies after the first page. The get returned the first page's subkeys as if they
    were all; now nobody delivered the whole key: None."""
    net = MemoryNetwork(latency=LATENCY)
    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            holder = await _open(stack, net, 1, [])
            for subkey, value in BIG.items():
                assert await holder.dht.store("big", value, ttl=600.0, subkey=subkey)
            reader = await _open(stack, net, 2, [holder.address], client_mode=True)
            assert await reader.dht.get("big") == BIG  # (whole while the holder lives)
            killed = _before_second_page(monkeypatch, reader, lambda _: net.kill_host(_host(1)))
            assert await reader.dht.get("big") is None
            assert len(killed) == 1
            assert await reader.dht.get("big") is None


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


# ---- a holder that is only slow --------------------------------------------------------


@pytest.mark.parametrize("delay", [1.5, 2.5])
async def test_a_lookup_with_nobody_else_to_ask_takes_a_late_answer(
    autojump_clock: trio.testing.MockClock, delay: float
) -> None:
    """The only node answers after the hedge delay (1 s): the lookup gives up on it, has
    nobody to ask in its place, and waits; the late answer counts and nothing is reported
    as a timeout."""
    only = _node(100)
    given_up: list[NodeInfo] = []

    async def query(asker: NodeInfo) -> list[NodeInfo]:
        await trio.sleep(delay)
        return []

    result = await iterative_lookup(
        0, [only], query, k=20, alpha=3, hedge_after=1.0, on_given_up=given_up.append
    )
    assert trio.current_time() == delay
    assert result.closest == (only,) and given_up == []


async def test_a_lookup_with_nobody_else_to_ask_waits_for_the_real_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The only node never answers: its request's own timeout (3 s here) ends the lookup,
    not the hedge delay, and it counts as failed once (by the query), not given up."""
    only = _node(100)
    given_up: list[NodeInfo] = []

    async def query(asker: NodeInfo) -> list[NodeInfo] | None:
        await trio.sleep(3)
        return None

    result = await iterative_lookup(
        0, [only], query, k=20, alpha=3, hedge_after=1.0, on_given_up=given_up.append
    )
    assert trio.current_time() == 3
    assert result.closest == () and result.failed == 1 and given_up == []


async def test_a_lookup_that_has_answers_still_ends_without_the_slow_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The hedging speed-up stays where some node answered: the slow one is given up
    after 0.2 s of silence (twice the first answer's 0.1 s), and reported."""
    fast, slow = _node(101), _node(100)
    given_up: list[NodeInfo] = []

    async def query(asker: NodeInfo) -> list[NodeInfo]:
        await trio.sleep(3 if asker == slow else 0.1)
        return []

    result = await iterative_lookup(
        0, [fast, slow], query, k=20, alpha=3, hedge_after=1.0, on_given_up=given_up.append
    )
    assert trio.current_time() == pytest.approx(0.3)
    assert result.closest == (fast,) and given_up == [slow]


@pytest.mark.parametrize("freeze", [1.2, 2.5])
async def test_a_get_waits_for_its_only_holder_while_it_is_frozen(
    autojump_clock: trio.testing.MockClock, freeze: float
) -> None:
    """The tester's case: a client's only contact, the only holder, stops (SIGSTOP) for
    1.2 or 2.5 s, less than request_timeout (3 s). The get returned None after 1 s; it
    now returns the value when the holder thaws."""
    net = MemoryNetwork(latency=LATENCY)
    with trio.fail_after(60):
        async with AsyncExitStack() as stack:
            holder = await _open(stack, net, 1, [])
            assert await holder.dht.store("slow", "value", ttl=300.0)
            reader = await _open(stack, net, 2, [holder.address], client_mode=True)
            assert await reader.dht.get("slow") == "value"
            async with trio.open_nursery() as nursery:
                net.freeze_host(_host(1))

                async def thaw() -> None:
                    await trio.sleep(freeze)
                    net.unfreeze_host(_host(1))

                nursery.start_soon(thaw)
                start = trio.current_time()
                assert await reader.dht.get("slow") == "value"
                elapsed = trio.current_time() - start
            assert freeze <= elapsed < freeze + 0.1
            assert holder.peer_id in reader.dht.table  # an answer: no timeout counted


async def test_a_get_from_a_holder_frozen_past_the_timeout_gives_none_then(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Frozen longer than request_timeout: None after the timeout (3 s), then the value
    again once the holder thaws."""
    net = MemoryNetwork(latency=LATENCY)
    with trio.fail_after(60):
        async with AsyncExitStack() as stack:
            holder = await _open(stack, net, 1, [])
            assert await holder.dht.store("slow", "value", ttl=300.0)
            reader = await _open(stack, net, 2, [holder.address], client_mode=True)
            assert await reader.dht.get("slow") == "value"
            net.freeze_host(_host(1))
            start = trio.current_time()
            assert await reader.dht.get("slow") is None
            assert trio.current_time() - start == pytest.approx(3.0)
            net.unfreeze_host(_host(1))
            assert await reader.dht.get("slow") == "value"
