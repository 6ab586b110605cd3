"""What the DHT's work for slow and departed peers (background re-stores, re-contact pings)
costs, against an adversary and under churn: it stays bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from functools import partial, wraps
from typing import Any

import trio
import trio.testing
from test_dht_hostile import FROZEN_HOST, honest_peers_and_one_naming_made_up_nodes
from test_rpc import two_hosts

from peer.dht.routing import DEPARTED_MEMORY
from peer.memnet import MemoryNetwork
from peer.node import open_peer
from peer.rpc import Reply, Request
from protocol.identity import Identity
from protocol.messages import NodeInfo


async def test_recontact_pings_under_churn_of_hundreds_stay_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """300 contacts leave the table at once (a crash of a third of a large swarm), at a
    host that swallows every packet (each ping costs a full request timeout). The
    re-contact pings (docs: 2, 5, 9.5 s ... after leaving, then every minute for half an
    hour, 8 at once) stay 8 at once, at most 36 per contact, for at most DEPARTED_MEMORY
    contacts, and end."""
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(2400):
        async with AsyncExitStack() as stack:
            victim = await stack.enter_async_context(
                open_peer("10.0.0.1:0", network=net.interface("10.0.0.1"))
            )
            dead = await stack.enter_async_context(
                open_peer("10.0.0.9:0", network=net.interface("10.0.0.9"))
            )
            hostport = dead.rpc.listen_address.hostport  # type: ignore[union-attr]
            net.freeze_host("10.0.0.9")
            dht = victim.dht
            ping = dht.protocol.ping
            now_running = [0]
            most = [0]
            per_node: dict[Any, int] = {}

            @wraps(ping)
            async def counting(node: NodeInfo, *, take_slot: bool = True) -> bool:
                if take_slot:
                    return await ping(node, take_slot=take_slot)
                per_node[node.peer_id] = per_node.get(node.peer_id, 0) + 1
                now_running[0] += 1
                most[0] = max(most[0], now_running[0])
                try:
                    return await ping(node, take_slot=take_slot)
                finally:
                    now_running[0] -= 1

            dht.protocol.ping = counting  # type: ignore[method-assign]
            for i in range(300):
                node = NodeInfo(Identity.from_seed(i.to_bytes(32, "big")).peer_id, hostport)
                dht.table.update(node, trio.current_time())
                dht.table.remove(node.peer_id)
            assert len(dht._upkeep._recontacts) <= DEPARTED_MEMORY
            await trio.sleep(1900)
            assert most[0] <= 8, most
            assert per_node and max(per_node.values()) <= 36, per_node
            assert len(per_node) <= DEPARTED_MEMORY
            assert not dht._upkeep._recontacts


async def test_what_a_node_keeps_per_peer_that_joined_stays_bounded(
    autojump_clock: trio.testing.MockClock, monkeypatch: Any
) -> None:
    """A bootstrap node meets a new PeerID at every volunteer's start (fresh keys): its
    note of each one's join (for the handover rule) was kept for good, 7,000 notes after
    7,000 visitors (an outside tester's soak, then a churn of distinct peers). Notes older
    than a republish interval now go once there are ``_REJOINED_MEMORY`` of them."""
    from peer.dht import learning

    monkeypatch.setattr(learning, "_REJOINED_MEMORY", 64)
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(3600):
        async with open_peer("10.0.0.1:0", network=net.interface("10.0.0.1")) as node:
            protocol = node.dht.protocol
            protocol.on_new_contact = lambda node, rejoined: None  # (no handovers to fakes)
            for i in range(1000):
                peer_id = Identity.from_seed(i.to_bytes(32, "big")).peer_id
                protocol._joined(NodeInfo(peer_id, "10.0.0.9:1000"))
                if i % 50 == 49:
                    await trio.sleep(61.0)  # joins spread over time, as churn comes
            assert len(protocol._rejoined_at) <= 64


async def test_background_stores_to_made_up_nodes_stay_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hostile peer answers every STORE naming MAX_NODES made-up nodes closer to the key
    than anyone, at a host that swallows connections. Each of the victim's stores gives up
    on some of them, and sends those STOREs again in the background (docs/dht.md: outside
    the request slots, at most 32 at once). Over 24 stores in a row: never more than 32
    at once, none left after the request timeout, at most one background STORE per STORE
    given up on (no amplification beyond the lookups' own), and every key is found."""
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(600):
        async with AsyncExitStack() as stack:
            peers, _ = await honest_peers_and_one_naming_made_up_nodes(stack, net, honest=5)
            victim = peers[-1]
            store = victim.dht.protocol.store
            running, most = [0], [0]
            sent = {"lookup": 0, "background": 0}

            @wraps(store)
            async def counting(
                node: NodeInfo, *args: Any, take_slot: bool = True, **kw: Any
            ) -> Any:
                if node.address == f"{FROZEN_HOST}:4000":
                    sent["lookup" if take_slot else "background"] += 1
                if take_slot:
                    return await store(node, *args, take_slot=take_slot, **kw)
                running[0] += 1
                most[0] = max(most[0], running[0])
                try:
                    return await store(node, *args, take_slot=take_slot, **kw)
                finally:
                    running[0] -= 1

            victim.dht.protocol.store = counting  # type: ignore[method-assign]
            async with trio.open_nursery() as nursery:
                for i in range(24):  # (expirations follow the virtual clock: a long ttl)
                    nursery.start_soon(partial(victim.dht.store, ttl=3600.0), f"key{i}", i)
                    await trio.sleep(0.05)
            assert most[0] <= 32, most
            await trio.sleep(victim.dht.config.request_timeout + 1)
            assert running[0] == 0 and victim.dht._publishing.in_background["resend"] == 0
            assert sent["background"] <= sent["lookup"], sent
            for i in range(24):
                assert await peers[1].dht.get(f"key{i}") == i


# -- the silence rule (peer/rpc_calling.py, Calling._note_unanswered) -----------------------


async def count(request: Request) -> AsyncIterator[Reply]:
    for i in range(request.body["n"]):
        yield Reply({"i": i})


async def echo(request: Request) -> Reply:
    return Reply(request.body)


async def test_a_paused_stream_consumer_is_not_taken_for_a_silent_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A caller reads a long stream, then pauses 15 s (its own work) with the stream's
    buffer full: the connection's reader waits for it (docs: STREAM_BUFFER_ITEMS), so
    nothing more is read, though the peer's bytes are there. Meanwhile short calls on
    the same connection (a DHT ping every 2 s, 1.5 s timeout) time out. The peer is
    alive and spoke all along: the stream must go on when the caller reads again (the
    silence rule closed the connection after 10 s: PeerUnavailableError mid-stream)."""
    async with two_hosts(MemoryNetwork(latency=0.01)) as (a, b, address):
        b.register_stream("count", count)
        b.register("echo", echo)
        with trio.fail_after(120):
            async with a.stream(address, "count", {"n": 100}) as items:
                got = []
                async for item in items:
                    got.append(item.body["i"])
                    if len(got) == 1:
                        await trio.sleep(0.5)  # the buffer fills
                        for _ in range(8):  # paused: our other calls time out
                            with trio.move_on_after(1.5):
                                await a.call(address, "echo", {})
                            await trio.sleep(0.5)
            assert got == list(range(100))
