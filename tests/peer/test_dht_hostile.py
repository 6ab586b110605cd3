"""DHT peers that lie in their replies: what a lookup may and may not learn from them."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AsyncExitStack

import trio
import trio.testing
from msgpack import packb

from peer import Peer, Reply, Request
from peer.memnet import MemoryNetwork
from peer.node import open_peer
from protocol.dhtid import DHTID
from protocol.identity import Identity, PeerID
from protocol.messages import (
    MAX_NODES,
    Entry,
    FindNodeRequest,
    FindNodeResponse,
    FindValueRequest,
    FindValueResponse,
    NodeInfo,
    PingRequest,
    StoreRequest,
    StoreResponse,
)


async def test_a_node_named_at_a_made_up_address_is_not_learnt_over_a_pooled_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hostile peer names a client-mode peer, which is connected to the victim, at an
    address it made up. The victim's query reaches the client over that connection and
    the client answers: its id is proven, its address is not, and a client never enters
    routing tables. A node named at its real address is dialed there and learnt."""
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            victim = await stack.enter_async_context(
                open_peer("10.0.0.1:0", network=net.interface("10.0.0.1"))
            )
            client = await stack.enter_async_context(
                open_peer(
                    None, [victim.address], client_mode=True, network=net.interface("10.0.0.3")
                )
            )
            honest = await stack.enter_async_context(
                open_peer("10.0.0.4:0", network=net.interface("10.0.0.4"))
            )
            assert await client.dht.store("k", 1)  # the client stays connected
            assert client.peer_id in victim.rpc.connected_peers()
            named = (
                NodeInfo(client.peer_id, "10.0.0.9:9"),
                NodeInfo(honest.peer_id, honest.rpc.listen_address.hostport),  # type: ignore[union-attr]
            )

            def lying(request: Request) -> Reply:
                FindNodeRequest.from_body(request.body)
                return Reply(FindNodeResponse(named).to_body())

            hostile = await stack.enter_async_context(
                open_peer("10.0.0.2:0", [victim.address], network=net.interface("10.0.0.2"))
            )
            hostile.rpc.unregister("dht.find_node")
            hostile.rpc.register_quick("dht.find_node", lying)
            await victim.dht.find_nodes(DHTID.from_peer_id(client.peer_id))
            assert client.peer_id not in victim.dht.table
            assert victim.dht.table.get(honest.peer_id) == named[1]
            assert hostile.peer_id in victim.dht.table


def answer_every_lookup_with(hostile: Peer, named: Callable[[DHTID], tuple[NodeInfo, ...]]) -> None:
    """Make ``hostile`` answer FIND_NODE, STORE (accepting) and FIND_VALUE (no value) with
    the contacts ``named(target)``."""

    def find_node(request: Request) -> Reply:
        target = FindNodeRequest.from_body(request.body).target
        return Reply(FindNodeResponse(named(target)).to_body())

    def store(request: Request) -> Reply:
        message = StoreRequest.from_body(request.body)
        accepted = tuple(True for _ in message.entries)
        return Reply(StoreResponse(accepted, named(message.key)).to_body())

    def find_value(request: Request) -> Reply:
        key = FindValueRequest.from_body(request.body).key
        return Reply(FindValueResponse(None, named(key)).to_body())

    for method, handler in (
        ("dht.find_node", find_node),
        ("dht.store", store),
        ("dht.find_value", find_value),
    ):
        hostile.rpc.unregister(method)
        hostile.rpc.register_quick(method, handler)


FROZEN_HOST = "10.0.0.66"
"""Where the made-up nodes live: a host that swallows connections (frozen)."""


def made_up_nodes(target: DHTID) -> tuple[NodeInfo, ...]:
    """MAX_NODES nodes closer to ``target`` than anyone, at the frozen host."""
    ids = (PeerID((int(target) ^ i).to_bytes(32, "big")) for i in range(1, MAX_NODES + 1))
    return tuple(NodeInfo(peer_id, f"{FROZEN_HOST}:4000") for peer_id in ids)


async def honest_peers_and_one_naming_made_up_nodes(
    stack: AsyncExitStack, net: MemoryNetwork, honest: int
) -> tuple[list[Peer], Peer]:
    """``honest`` peers at 10.0.0.1.. (all joined through the first), and a hostile one at
    10.0.0.9 that answers every lookup with :func:`made_up_nodes` (the host frozen)."""
    net.freeze_host(FROZEN_HOST)
    first = await stack.enter_async_context(
        open_peer("10.0.0.1:0", network=net.interface("10.0.0.1"))
    )
    peers = [first]
    for i in range(2, honest + 1):
        peers.append(
            await stack.enter_async_context(
                open_peer(f"10.0.0.{i}:0", [first.address], network=net.interface(f"10.0.0.{i}"))
            )
        )
    hostile = await stack.enter_async_context(
        open_peer("10.0.0.9:0", [first.address], network=net.interface("10.0.0.9"))
    )
    answer_every_lookup_with(hostile, made_up_nodes)
    return peers, hostile


async def test_a_reply_naming_many_dead_nodes_costs_a_lookup_round_trips_not_timeouts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hostile peer answers every lookup with 64 made-up nodes closer to the target than
    anyone, at an address that swallows connections (a frozen host). A lookup takes the k
    closest of them, gives up on one per short silence, never queues more requests than
    it has slots, and cancels those it gave up on when its requests wait for slots: a
    store, a miss and a find_nodes each take about a second (12 s before: 16 requests at
    a time waited out their 3 s timeouts). None of them enters a table."""
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            peers, hostile = await honest_peers_and_one_naming_made_up_nodes(stack, net, honest=7)
            victim = peers[-1]
            assert hostile.peer_id in victim.dht.table
            for operation in (
                lambda: victim.dht.store("key", 1),
                lambda: peers[1].dht.get("missing"),
                lambda: victim.dht.find_nodes(DHTID.from_key("target")),
            ):
                start = trio.current_time()
                await operation()
                assert trio.current_time() - start < 2.0
            assert await peers[2].dht.get("key") == 1
            for node in peers:
                assert all(n.address != "10.0.0.66:4000" for n in node.dht.table.nodes())


UNDIALABLE_HOSTS = ("0.0.0.0", "::", "255.255.255.255", "224.0.0.1", "ff02::1", "0")


def _hostport(host: str) -> str:
    return f"[{host}]:4000" if ":" in host else f"{host}:4000"


async def test_contacts_at_undialable_addresses_are_skipped_not_dialed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hostile peer names nodes at 0.0.0.0, ::, broadcast and multicast hosts in its
    FIND_NODE, STORE and FIND_VALUE replies (listeners wait there, recording every dial).
    Nobody dials them; the honest node named in the same replies is still learnt."""
    net = MemoryNetwork(latency=0.01)
    dialed: list[str] = []

    async def trap(stream: trio.abc.Stream) -> None:
        dialed.append(getattr(stream, "local_host", "?"))
        await stream.aclose()

    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(nursery.cancel_scope.cancel)
            for host in UNDIALABLE_HOSTS:
                await nursery.start(net.interface(host).serve, host, 4000, trap)
            victim = await stack.enter_async_context(
                open_peer("10.0.0.1:0", network=net.interface("10.0.0.1"))
            )
            honest = await stack.enter_async_context(
                open_peer("10.0.0.4:0", network=net.interface("10.0.0.4"))
            )
            honest_node = NodeInfo(honest.peer_id, honest.rpc.listen_address.hostport)  # type: ignore[union-attr]

            def named(target: DHTID) -> tuple[NodeInfo, ...]:
                made_up = (
                    NodeInfo(PeerID((int(target) ^ i).to_bytes(32, "big")), _hostport(host))
                    for i, host in enumerate(UNDIALABLE_HOSTS, 1)
                )
                return (*made_up, honest_node)

            hostile = await stack.enter_async_context(
                open_peer("10.0.0.2:0", [victim.address], network=net.interface("10.0.0.2"))
            )
            answer_every_lookup_with(hostile, named)
            await victim.dht.find_nodes(DHTID.from_key("target"))
            assert victim.dht.table.get(honest.peer_id) == honest_node
            assert await victim.dht.store("key", 1)
            assert await victim.dht.get("key") == 1
            assert await victim.dht.get("missing") is None
            assert dialed == []
            hosts = {n.address for n in victim.dht.table.nodes()}
            assert hosts == {honest_node.address, hostile.rpc.listen_address.hostport}  # type: ignore[union-attr]


async def test_a_sender_at_an_undialable_address_is_answered_but_not_learnt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Requests whose ``sender`` names 0.0.0.0, ::, broadcast or multicast are answered, but
    the sender does not enter the routing table; a sender at an ordinary address does."""
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(60):
        async with AsyncExitStack() as stack:
            victim = await stack.enter_async_context(
                open_peer("10.0.0.1:0", network=net.interface("10.0.0.1"))
            )
            caller = await stack.enter_async_context(
                open_peer(None, client_mode=True, network=net.interface("10.0.0.3"))
            )
            address = victim.rpc.listen_address
            assert address is not None
            target = DHTID.from_key("t")
            for host in UNDIALABLE_HOSTS:
                sender = _hostport(host)
                await caller.rpc.call(address, "dht.ping", PingRequest(sender).to_body())
                body = FindNodeRequest(sender, target).to_body()
                await caller.rpc.call(address, "dht.find_node", body)
            assert caller.peer_id not in victim.dht.table
            await caller.rpc.call(address, "dht.ping", PingRequest("10.0.0.3:4000").to_body())
            assert victim.dht.table.get(caller.peer_id) == NodeInfo(caller.peer_id, "10.0.0.3:4000")


async def test_a_sender_claiming_another_host_is_learnt_only_once_that_address_proves_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request's ``sender`` is a claim. Taken as it was, five throwaway identities pinging
    with a third party's address put it into the table, and every FIND_NODE answer then sent
    other peers' lookups to dial it. A claim at another host than the request's is now dialed
    first, on a connection of its own, and learnt only when the handshake there proves the
    sender's id."""
    net = MemoryNetwork(latency=0.01)
    identity = Identity.from_seed(b"t" * 32)
    with trio.fail_after(60):
        async with AsyncExitStack() as stack:
            victim = await stack.enter_async_context(
                open_peer("10.0.0.1:0", network=net.interface("10.0.0.1"))
            )
            address = victim.rpc.listen_address
            assert address is not None
            for seed in range(5):  # throwaway identities naming a host nobody listens at
                liar = await stack.enter_async_context(
                    open_peer(
                        None,
                        client_mode=True,
                        identity=Identity.from_seed(bytes([seed]) * 32),
                        network=net.interface("10.0.0.3"),
                    )
                )
                await liar.rpc.call(address, "dht.ping", PingRequest("10.0.0.9:80").to_body())
                await trio.sleep(5)
                assert liar.peer_id not in victim.dht.table
            # the same id listening at the host it claims, asking from another one
            listening = await stack.enter_async_context(
                open_peer("10.0.0.5:0", identity=identity, network=net.interface("10.0.0.5"))
            )
            claimed = listening.rpc.listen_address
            assert claimed is not None
            asking = await stack.enter_async_context(
                open_peer(
                    None, client_mode=True, identity=identity, network=net.interface("10.0.0.6")
                )
            )
            await asking.rpc.call(address, "dht.ping", PingRequest(claimed.hostport).to_body())
            await trio.sleep(5)
            assert victim.dht.table.get(identity.peer_id) == NodeInfo(
                identity.peer_id, claimed.hostport
            )
            assert {n.address for n in victim.dht.table.nodes()} == {claimed.hostport}


async def test_a_holder_whose_pages_never_end_is_asked_for_few_of_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hostile holder answers every FIND_VALUE with the same 600 entries and ``more``:
    the get followed 32 pages of it (each entry a signature check when signed, ~2 s of
    CPU for 32 x 1024 of them). Pages must move forward in subkey order, and one holder
    makes us check at most as many entries as a key holds (1024)."""
    net = MemoryNetwork(latency=0.01)
    pages: list[bytes | None] = []
    with trio.fail_after(60):
        async with AsyncExitStack() as stack:
            hostile = await stack.enter_async_context(
                open_peer("10.0.0.2:0", network=net.interface("10.0.0.2"))
            )
            reader = await stack.enter_async_context(
                open_peer("10.0.0.1:0", [hostile.address], network=net.interface("10.0.0.1"))
            )
            expiration = time.time() + 600
            entries = tuple(Entry(f"s{i:04d}", packb(i), expiration) for i in range(600))

            def endless(request: Request) -> Reply:
                pages.append(FindValueRequest.from_body(request.body).after)
                return Reply(FindValueResponse(entries, (), more=True).to_body())

            hostile.rpc.unregister("dht.find_value")
            hostile.rpc.register_quick("dht.find_value", endless)
            value = await reader.dht.get("shared")
            assert isinstance(value, dict) and len(value) == 600
            assert len(pages) == 2  # the second page did not move on: done
