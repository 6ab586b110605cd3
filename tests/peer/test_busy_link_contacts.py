"""A contact whose DHT answers come late because its link is busy, its bytes still
arriving, is not counted as failing. A volunteer on a slow uplink whose averaging round
was cut short kept receiving what its peers had queued for it for seconds, its DHT answers
behind those bytes: the requests timed out (or lookups gave up on them), every contact left
its table within a second, and it averaged alone for the next rounds (a trial: 3 peers at
1 Gbit/s and one at 10 Mbit/s, 16 MB `none`, 15 s steps; its table emptied after each
failed round). Here the slow contact's far link (2.5 s one way) stands for the queue, and a
stream it sends on keeps its bytes coming. A frozen contact (nothing arrives) leaves as
before."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio
import trio.testing

from peer import Peer, Reply, Request, open_peer
from peer.dht import DHTConfig
from peer.dht.protocol import CUT_OFF_GRACE
from peer.memnet import MemoryNetwork
from protocol.identity import Identity
from protocol.messages import NodeInfo

CONFIG = DHTConfig()
A, B, C = (Identity.from_seed(bytes([i]) * 32) for i in (1, 2, 3))


async def _trickle(request: Request) -> AsyncIterator[Reply]:
    for i in range(1000):  # bytes every half second, for longer than any test runs
        yield Reply({"i": i})
        await trio.sleep(0.5)


async def _read_all(node: Peer, address: str) -> None:
    async with node.rpc.stream(address, "test.trickle", {}) as items:
        async for _ in items:
            pass


async def _with_slow_contact(
    body: Callable[[Peer, Peer, NodeInfo], Awaitable[None]], *, busy: bool, third: bool = False
) -> None:
    """Run ``body(a, b, b_info)`` with ``b`` in ``a``'s table and each request to it
    outlasting ``request_timeout``: ``busy``, ``b``'s link slow from then on and ``b``
    streaming to ``a``; else ``b`` frozen. ``third``: a third peer ``c`` known to ``a``."""
    net = MemoryNetwork(latency=0.005)
    async with (
        open_peer("10.0.0.1:4000", [], A, network=net.interface("10.0.0.1")) as a,
        open_peer("10.0.0.2:4000", [a.address], B, network=net.interface("10.0.0.2")) as b,
        trio.open_nursery() as nursery,
    ):
        if third:
            c = await nursery.start(_serve, net, [a.address])
            await a.dht.protocol.ping(NodeInfo(C.peer_id, c))
        b.rpc.register_stream("test.trickle", _trickle)
        info = NodeInfo(B.peer_id, "10.0.0.2:4000")
        assert B.peer_id in a.dht.table
        if busy:
            net.slow_host("10.0.0.2", CONFIG.request_timeout / 2 + 1.0)  # round trip 5 s
            nursery.start_soon(_read_all, a, b.address)
        await trio.sleep(10)  # the stream's first items are in; b's earlier bytes are old
        if not busy:
            net.freeze_host("10.0.0.2")
        await body(a, b, info)
        nursery.cancel_scope.cancel()


async def _ping_until_gone(a: Peer, info: NodeInfo) -> tuple[list[bool], float]:
    """Ping ``info`` from ``a`` until it leaves ``a``'s table, for two ``CUT_OFF_GRACE`` at
    most: what each ping returned, and the seconds taken."""
    answered = []
    started = trio.current_time()
    while info.peer_id in a.dht.table and trio.current_time() - started < 2 * CUT_OFF_GRACE:
        answered.append(await a.dht.protocol.ping(info))
    return answered, trio.current_time() - started


async def _serve(
    net: MemoryNetwork, initial: list[str], *, task_status: trio.TaskStatus[str]
) -> None:
    async with open_peer("10.0.0.3:4000", initial, C, network=net.interface("10.0.0.3")):
        task_status.started("10.0.0.3:4000")
        await trio.sleep_forever()


@pytest.mark.parametrize("busy", [True, False], ids=["busy", "frozen"])
async def test_timed_out_pings_count_only_when_nothing_arrives(
    autojump_clock: trio.testing.MockClock, busy: bool
) -> None:
    """Frozen: ``a``'s only contact, so nothing comes from anyone, which ``a`` cannot tell
    from its own link stalling: its failed pings count once that silence outlasts
    ``CUT_OFF_GRACE`` (tests/peer/test_cut_off_link.py), and it leaves then."""

    async def body(a: Peer, b: Peer, info: NodeInfo) -> None:
        answered, took = await _ping_until_gone(a, info)
        assert answered == [busy] * len(answered)  # alive while its bytes come
        assert (B.peer_id in a.dht.table) is busy
        if not busy:  # left at its max_failures-th failed ping after the grace
            most = CUT_OFF_GRACE + (CONFIG.max_failures + 1) * CONFIG.request_timeout
            assert CUT_OFF_GRACE < took < most

    with trio.fail_after(300):
        await _with_slow_contact(body, busy=busy)


@pytest.mark.parametrize("busy", [True, False], ids=["busy", "frozen"])
async def test_lookups_that_give_up_on_a_busy_contact_keep_it(
    autojump_clock: trio.testing.MockClock, busy: bool
) -> None:
    """A lookup gives up on a request after a short silence (hedging) and counts it as a
    timeout: three of them took a busy contact out of the table."""

    async def body(a: Peer, b: Peer, info: NodeInfo) -> None:
        for i in range(CONFIG.max_failures + 2):
            await a.dht.get(f"key {i}")
        assert (B.peer_id in a.dht.table) is busy

    with trio.fail_after(300):
        await _with_slow_contact(body, busy=busy, third=True)


async def test_the_eviction_ping_keeps_a_busy_contact_as_it_was(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A full bucket pings its least-recently-seen contact before a newcomer may take its
    place: a busy one that did not answer stays, but is not refreshed (it answered nothing:
    its failures stand and it stays first in line for the next ping)."""

    async def body(a: Peer, b: Peer, info: NodeInfo) -> None:
        table = a.dht.table
        bucket = table._buckets[table._index[B.peer_id]]
        contact = bucket.contacts[B.peer_id]
        contact.failures = 2
        seen = contact.last_seen
        bucket.pending_ping = B.peer_id
        a.dht.protocol._ping_send.send_nowait(info)  # as a newcomer meeting a full bucket
        await trio.sleep(CONFIG.request_timeout + 1)
        assert bucket.pending_ping is None  # the ping ended
        assert bucket.contacts.get(B.peer_id) is contact
        assert (contact.failures, contact.last_seen) == (2, seen)

    with trio.fail_after(120):
        await _with_slow_contact(body, busy=True)


async def test_bytes_keep_a_contact_only_while_it_was_seen_lately(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Busy counts as alive only for ``refresh_interval`` after the contact last answered or
    asked us anything: a peer that only sends bytes (a stream, any unknown method) would
    stay listed forever otherwise."""

    async def body(a: Peer, b: Peer, info: NodeInfo) -> None:
        table = a.dht.table
        contact = table._buckets[table._index[B.peer_id]].contacts[B.peer_id]
        contact.last_seen = trio.current_time() - CONFIG.refresh_interval - 1
        answered, took = await _ping_until_gone(a, info)
        assert not any(answered)
        assert B.peer_id not in table  # (a's only contact: after the grace, as frozen)
        assert (
            CUT_OFF_GRACE
            < took
            < CUT_OFF_GRACE + (CONFIG.max_failures + 1) * CONFIG.request_timeout
        )

    with trio.fail_after(300):
        await _with_slow_contact(body, busy=True)


async def test_a_read_says_whether_other_nodes_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``read_entries`` tells a lone copy of our own from a key nobody else holds: the
    averaging's matchmaking read "nobody declared" where its read had heard from nobody."""
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(120):
        async with (
            open_peer("10.0.0.1:4000", [], A, network=net.interface("10.0.0.1")) as a,
            open_peer("10.0.0.2:4000", [a.address], B, network=net.interface("10.0.0.2")) as b,
        ):
            assert await b.dht.store("k", 1, ttl=600.0)
            read = await b.dht.read_entries("k")
            assert read.entries[None][0] == 1
            assert read.asked >= 1 and read.answered == read.asked  # a answered
            net.freeze_host("10.0.0.1")
            read = await b.dht.read_entries("k")
            assert read.entries[None][0] == 1  # b's own copy
            assert read.asked >= 1 and read.answered == 0
            assert await b.dht.get_entries("k") == read.entries
            net.unfreeze_host("10.0.0.1")
