"""A peer that stops while its own DHT calls are under way says nothing of its contacts:
the calls its shutdown broke are no sign that they left (an outside tester: every exit of
a script whose tasks still read the DHT logged each contact as "peer left: X (a request
failed)" and warned that the peer knew no other peer)."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from peer import PeerStoppedError, open_peer
from peer.memnet import MemoryNetwork
from protocol.identity import Identity


async def test_calls_broken_by_our_own_shutdown_log_no_departures(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="peer")
    net = MemoryNetwork(latency=0.01)
    ids = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(3)]
    answered = 0
    with trio.fail_after(60):
        async with (
            open_peer("a:4000", [], ids[0], network=net.interface("a")) as a,
            open_peer("b:4000", [a.address], ids[1], network=net.interface("b")) as b,
        ):
            for i in range(10):
                assert await b.dht.store(f"k{i}", i, ttl=600.0)
            async with (
                trio.open_nursery() as readers,
                open_peer("c:4000", [a.address], ids[2], network=net.interface("c")) as c,
            ):

                async def read(i: int) -> None:
                    nonlocal answered
                    try:
                        while True:  # until the stopped peer refuses the call
                            answered += await c.dht.get(f"k{i}") == i
                    except PeerStoppedError:
                        pass

                for i in range(10):
                    readers.start_soon(read, i)
                await trio.sleep(0.5)  # reads under way when the block ends
                caplog.clear()
    assert answered > 10
    ours = [
        r.getMessage()
        for r in caplog.records
        if any(p.peer_id.short() in r.getMessage() for p in (a, b))
        or "knows no other peer" in r.getMessage()
    ]
    assert not [m for m in ours if "left" in m or "knows no" in m], ours
