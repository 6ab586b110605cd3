"""What keeps a contact in a routing table: answers at an address it still listens at.

Two reviews: a peer that restarted in client mode with the same identity stayed listed at
its dead address, its answers over its client's connection taken for answers there; and
one reset connection evicted a live contact without the promised ping.
"""

from __future__ import annotations

import math
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio
import trio.testing

from peer.dht import DHTConfig
from peer.dht.protocol import CLIENT_RECHECK, DHTProtocol
from peer.dht.routing import RoutingTable
from peer.errors import PeerUnavailableError
from peer.memnet import MemoryNetwork
from peer.node import Peer, PeerConfig, open_peer
from peer.rpc import Reply
from protocol.address import Address
from protocol.dhtid import DHTID
from protocol.identity import Identity, PeerID
from protocol.messages import NodeInfo, PingRequest, PingResponse

P = Identity.from_seed(b"p" * 32)


async def _start(
    nursery: trio.Nursery, listen: str | None, initial: list[str], **kwargs: Any
) -> tuple[Peer, trio.CancelScope]:
    """A peer run in ``nursery`` until the returned scope is cancelled (a process exiting)."""

    async def run(task_status: trio.TaskStatus[tuple[Peer, trio.CancelScope]]) -> None:
        with trio.CancelScope() as scope:
            async with open_peer(listen, initial, **kwargs) as peer:
                task_status.started((peer, scope))
                await trio.sleep_forever()

    result: tuple[Peer, trio.CancelScope] = await nursery.start(run)
    return result


async def test_a_peer_back_in_client_mode_with_the_same_identity_leaves_every_table(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """P listened at X and was dialed there; it restarts at once in client mode with the
    same identity, elsewhere, and keeps reading. Our calls to "P at X" (the pings of a
    contact that left) went over its client's connection and answered, and the memory of
    the old dial at X made each answer proof of X: P was listed at its dead address by
    every node, for good. Its requests without a sender now take it out, and answers do
    not bring it back; when it listens at X again, a dial there does."""
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(3600):
        async with (
            open_peer("10.0.0.1:1000", network=net.interface("10.0.0.1")) as node,
            trio.open_nursery() as nursery,
        ):
            p, p_scope = await _start(
                nursery,
                "10.0.0.5:1000",
                [node.address],
                identity=P,
                network=net.interface("10.0.0.5"),
            )
            at_x = NodeInfo(P.peer_id, "10.0.0.5:1000")
            await node.dht.host.close_connections()
            assert await node.dht.protocol.ping(at_x)  # dialed at X: proven there
            assert node.dht.host.dialed(Address.parse(p.address))
            assert node.dht.table.get(P.peer_id) == at_x
            p_scope.cancel()  # stops, and at once back as a client, with the same key
            client, client_scope = await _start(
                nursery,
                None,
                [node.address],
                client_mode=True,
                identity=P,
                network=net.interface("10.0.0.9"),
            )
            for _ in range(30):  # reading all along: its connection stays open
                await client.dht.get("k")
                assert await node.dht.protocol.ping(at_x)  # answered over that connection
                await trio.sleep(20)
                assert P.peer_id not in node.dht.table
            assert P.peer_id not in [n.peer_id for n in node.dht.table.nodes()]
            client_scope.cancel()  # and back at X, listening
            await trio.sleep(CLIENT_RECHECK)
            at = net.interface("10.0.0.5")
            await _start(nursery, "10.0.0.5:1000", [], identity=P, network=at)
            assert await node.dht.protocol.ping(at_x)
            await trio.sleep(1)  # (the address is dialed on a connection of its own)
            assert node.dht.table.get(P.peer_id) == at_x
            nursery.cancel_scope.cancel()


def _two_in_one_bucket(owner: Identity, seeds: range) -> tuple[Identity, Identity]:
    """Two identities whose ids fall in the same bucket of ``owner``'s routing table."""
    me = DHTID.from_peer_id(owner.peer_id)
    first: dict[int, Identity] = {}
    for seed in seeds:
        identity = Identity.from_seed(seed.to_bytes(32, "big"))
        index = me.bucket_index(DHTID.from_peer_id(identity.peer_id))
        if index in first:
            return first[index], identity
        first[index] = identity
    raise AssertionError("no two in one bucket")


@pytest.mark.parametrize("calls", [1, 3])
async def test_a_contact_whose_connection_is_reset_mid_call_stays_when_it_answers_a_ping(
    autojump_clock: trio.testing.MockClock, calls: int
) -> None:
    """A call to B is in flight when a NAT resets the connection. With a replacement
    waiting in B's bucket, the failure evicted B at once, no ping asked, and B stayed out
    while it answered everyone. Now the failure is counted and B pinged: it answers on a
    fresh connection and keeps its place. A B that is gone (a refused dial) still leaves
    within a round trip, its replacement taking its place. One reset fails every call in
    flight at once: three of them counted to ``max_failures`` and evicted B all the same
    (a review of the fix)."""
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(600):
        async with AsyncExitStack() as stack:
            a, b, c, index = await _b_and_its_replacement_c(stack, net)
            b_info = NodeInfo(b.peer_id, "10.0.0.2:1000")
            assert a.dht.table.bucket_nodes(index) == [b_info]
            assert [n.peer_id for n in a.dht.table.replacement_nodes(index)] == [c.peer_id]
            net.slow_host("10.0.0.2", 0.2)  # a call in flight long enough to be cut
            async with trio.open_nursery() as nursery:
                for target in range(calls):
                    nursery.start_soon(a.dht.protocol.find_node, b_info, DHTID(12345 + target))
                await trio.sleep(0.1)
                assert net.drop_connections("10.0.0.2", "10.0.0.1") == 1
            net.slow_host("10.0.0.2", 0.0)
            await trio.sleep(1)  # the ping: a dial and a round trip
            assert a.dht.table.bucket_nodes(index) == [b_info]
            await trio.sleep(300)
            assert a.dht.table.bucket_nodes(index) == [b_info]

            net.kill_host("10.0.0.2")  # gone: the ping's dial is refused
            assert await a.dht.protocol.find_node(b_info, DHTID(12345)) is None
            await trio.sleep(0.1)
            assert [n.peer_id for n in a.dht.table.bucket_nodes(index)] == [c.peer_id]


async def test_a_reset_under_several_calls_keeps_a_contact_with_no_replacement(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No replacement waiting: three calls failed by one reset count to
    ``max_failures``; B, a live peer and A's only contact, is pinged then (the connection
    loss pings it too) and stays when it answers."""
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(600):
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(
                open_peer("10.0.0.1:1000", network=net.interface("10.0.0.1"))
            )
            b = await stack.enter_async_context(
                open_peer("10.0.0.2:1000", [a.address], network=net.interface("10.0.0.2"))
            )
            b_info = NodeInfo(b.peer_id, "10.0.0.2:1000")
            assert b.peer_id in a.dht.table
            net.slow_host("10.0.0.2", 0.2)
            async with trio.open_nursery() as nursery:
                for target in range(3):
                    nursery.start_soon(a.dht.protocol.find_node, b_info, DHTID(12345 + target))
                await trio.sleep(0.1)
                assert net.drop_connections("10.0.0.2", "10.0.0.1") == 1
            net.slow_host("10.0.0.2", 0.0)
            await trio.sleep(1)
            assert b.peer_id in a.dht.table


@pytest.mark.parametrize("how", ["reset", "kill"])
async def test_one_failure_under_many_calls_costs_one_ping(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Twenty calls in flight when the connection resets (or the peer dies): each failed
    call queued a ping of its own, 17 of B, most of them after B had left (a review)."""
    pings: list[PeerID] = []
    request = DHTProtocol._request

    async def counting(
        self: DHTProtocol, node: NodeInfo, message: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if isinstance(message, PingRequest):
            pings.append(node.peer_id)
        return await request(self, node, message, *args, **kwargs)

    monkeypatch.setattr(DHTProtocol, "_request", counting)
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(600):
        async with AsyncExitStack() as stack:
            a, b, _c, _index = await _b_and_its_replacement_c(stack, net)
            b_info = NodeInfo(b.peer_id, "10.0.0.2:1000")
            pings.clear()
            net.slow_host("10.0.0.2", 0.2)
            async with trio.open_nursery() as nursery:
                for target in range(20):
                    nursery.start_soon(a.dht.protocol.find_node, b_info, DHTID(12345 + target))
                await trio.sleep(0.1)
                if how == "reset":
                    assert net.drop_connections("10.0.0.2", "10.0.0.1") == 1
                else:
                    net.kill_host("10.0.0.2")
            net.slow_host("10.0.0.2", 0.0)
            await trio.sleep(2)
            assert (b.peer_id in a.dht.table) == (how == "reset")
            # (a peer that left is pinged again later, to see it back: one more)
            assert pings.count(b.peer_id) <= (1 if how == "reset" else 2)


class _MovedHost:
    """A host where nothing listens at 10.0.0.1 any more and a ping at 10.0.0.2 answers."""

    def __init__(self, dead_after: float = 0.01) -> None:
        self.calls: list[str] = []
        self.dead_after = dead_after  # how long a call to 10.0.0.1 takes to fail
        self.stopped = False  # (RpcHost's: a failure during our own shutdown is no news)

    async def call(self, address: Address, method: str, body: Any) -> Reply:
        self.calls.append(address.hostport)
        if address.host == "10.0.0.1":
            await trio.sleep(self.dead_after)
            raise PeerUnavailableError("connection refused")
        await trio.sleep(0.01)
        return Reply(PingResponse().to_body())

    def last_heard(self, peer_id: PeerID) -> float:
        return -math.inf

    def dialed(self, address: Address) -> bool:
        return True

    def reached_elsewhere(self, address: Address) -> str | None:
        return None  # (each call reaches the address it names)


async def test_a_ping_queued_for_an_old_address_goes_to_the_new_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A ping queued for a contact at its old address, the contact learnt at a new one
    meanwhile (its next failure not queued again: one ping at a time): the ping went to
    the old address, failed, and evicted the live contact (a review)."""
    table = RoutingTable(DHTID.from_peer_id(Identity.from_seed(b"o" * 32).peer_id), k=20)
    host = _MovedHost()
    protocol = DHTProtocol(host, table, None, DHTConfig(), sender="10.0.0.9:1000")  # type: ignore[arg-type]
    table.update(NodeInfo(P.peer_id, "10.0.0.1:1000"), trio.current_time())
    protocol.check_alive(P.peer_id)  # a reset: queued while it was at 10.0.0.1
    protocol.learn(NodeInfo(P.peer_id, "10.0.0.2:1000"))  # back elsewhere, proven there
    protocol.check_alive(P.peer_id)  # a failure there: one ping at a time, not queued
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(protocol.run_pings)
            await trio.sleep(10)
            nursery.cancel_scope.cancel()
    assert host.calls == ["10.0.0.2:1000"]
    assert P.peer_id in table


async def test_a_contact_learnt_at_a_new_address_while_its_ping_is_under_way_stays(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The usual case of the one above: the ping to the old address is under way (its dial
    takes seconds to fail) when the contact is proven at its new address; the failure then
    evicted it (a review). A failure at an address the table no longer holds counts not."""
    table = RoutingTable(DHTID.from_peer_id(Identity.from_seed(b"o" * 32).peer_id), k=20)
    host = _MovedHost(dead_after=5.0)
    protocol = DHTProtocol(host, table, None, DHTConfig(), sender="10.0.0.9:1000")  # type: ignore[arg-type]
    table.update(NodeInfo(P.peer_id, "10.0.0.1:1000"), trio.current_time())
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(protocol.run_pings)
            protocol.check_alive(P.peer_id)  # a call failed: the ping goes out at once
            await trio.sleep(1)
            protocol.learn(NodeInfo(P.peer_id, "10.0.0.2:1000"))  # back elsewhere, proven
            await trio.sleep(10)
            nursery.cancel_scope.cancel()
    assert host.calls == ["10.0.0.1:1000"]
    node = table.get(P.peer_id)
    assert node is not None and node.address == "10.0.0.2:1000"


async def _b_and_its_replacement_c(
    stack: AsyncExitStack, net: MemoryNetwork
) -> tuple[Peer, Peer, Peer, int]:
    """Peers a (10.0.0.1), b and c (10.0.0.2 and .3) with k = 1, b and c in one bucket of
    a's table: b its contact, c its replacement; and that bucket's index."""
    owner = Identity.from_seed(b"a" * 32)
    b_identity, c_identity = _two_in_one_bucket(owner, range(1, 100))
    config = PeerConfig(dht=DHTConfig(k=1))
    a = await stack.enter_async_context(
        open_peer("10.0.0.1:1000", identity=owner, config=config, network=net.interface("10.0.0.1"))
    )
    b, c = [
        await stack.enter_async_context(
            open_peer(
                f"10.0.0.{host}:1000",
                [a.address],
                identity=identity,
                config=config,
                network=net.interface(f"10.0.0.{host}"),
            )
        )
        for host, identity in ((2, b_identity), (3, c_identity))
    ]
    return a, b, c, a.dht.node_id.bucket_index(DHTID.from_peer_id(b.peer_id))
