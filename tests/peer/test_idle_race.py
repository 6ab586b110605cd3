"""A call sent just as the other side's idle timer closes the pooled connection: the peer
never read it, so the caller retries on a fresh connection instead of failing (and the
DHT then does not count a live peer as failed)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from peer import MemoryNetwork, Peer, open_peer
from protocol.messages import NodeInfo

LATENCY = 0.01


@asynccontextmanager
async def _pair() -> AsyncIterator[tuple[Peer, Peer, NodeInfo]]:
    """Peers a and b (b joined through a) on a memory network, and a as b's contact."""
    net = MemoryNetwork(latency=LATENCY)
    async with (
        open_peer(listen="10.0.0.1:1000", network=net.interface("10.0.0.1")) as a,
        open_peer(
            listen="10.0.0.2:1000", network=net.interface("10.0.0.2"), initial_peers=[a.address]
        ) as b,
    ):
        yield a, b, NodeInfo(a.peer_id, "10.0.0.1:1000")


async def test_a_call_sent_as_the_peer_closes_the_idle_connection_succeeds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(600):
        async with _pair() as (a, b, node_a):
            await trio.sleep(5)  # joined, handed over, quiet
            assert await b.dht.protocol.ping(node_a)
            (theirs,) = [c for c in a.rpc._connections if c.peer_id == b.peer_id]
            idle_timeout = theirs.idle_timeout
            # a's idle timer closes its side at this time; our request lands after it
            closes_at = theirs.last_activity + idle_timeout
            await trio.sleep_until(closes_at - LATENCY / 2)
            failed_before = b.dht.protocol.calls_failed
            assert await b.dht.protocol.ping(node_a)
            assert b.dht.protocol.calls_failed == failed_before
            assert a.peer_id in b.dht.table


async def test_pings_a_minute_apart_never_fail_against_a_live_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Whether the request meets the closed connection in the write (the peer's close
    arrived first) or on the read side (it arrived after), the call is retried."""
    with trio.fail_after(900):
        async with _pair() as (_, b, node_a):
            results = []
            for gap in (59.9, 60.0, 60.0, 60.0, 45.0, 60.0, 59.99, 60.01):
                results.append(await b.dht.protocol.ping(node_a))
                await trio.sleep(gap)
            assert all(results), results


async def test_a_call_crossing_the_idle_close_of_a_peer_with_a_shorter_idle_timeout_succeeds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The peer closes idle connections after 20 s, we after 60 s: our guess that a call
    crossing its close was never read went by our own timeout, and calls sent up to ~10 ms
    before its close failed (10 of 61 offsets, a review). The idle close now says ``bye``
    first and keeps its end open until we close ours: such a call fails as unread and is
    sent again on a fresh connection."""
    from peer.host import HostConfig, open_rpc_host
    from peer.rpc import Reply, Request
    from protocol.address import Address
    from protocol.identity import Identity

    async def echo(request: Request) -> Reply:
        return Reply(request.body)

    failures = []
    with trio.fail_after(600):
        for offset in [20 + d / 1000 for d in range(-30, 31, 3)]:
            net = MemoryNetwork(latency=0.01)
            async with (
                open_rpc_host(
                    Identity.from_seed(b"i" * 32), listen=Address("a", 1),
                    network=net.interface("a"), config=HostConfig(idle_timeout=60),
                ) as a,
                open_rpc_host(
                    Identity.from_seed(b"j" * 32), listen=Address("b", 1),
                    network=net.interface("b"), config=HostConfig(idle_timeout=20),
                ) as b,
            ):  # fmt: skip
                b.register("echo", echo)
                assert b.listen_address is not None
                await a.call(b.listen_address, "echo", {})
                await trio.sleep(offset)
                try:
                    with trio.fail_after(5):
                        await a.call(b.listen_address, "echo", {"x": 1})
                except Exception as exc:
                    failures.append((offset, repr(exc)))
        assert not failures, failures
