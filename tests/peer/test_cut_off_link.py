"""A peer whose own link stalls, or slows down, keeps its contacts, and its lookups answer.
In a stall every request in flight times out at once, and nothing comes from anyone: that
says nothing of the contacts. A client-mode volunteer whose link stalled for half a second
(5 s more latency for what it sent and received then) lost every contact to those
timeouts and, nobody dialing a client back, averaged alone until its refresh re-dialed its
initial peers (an outside re-check: 5 of 5 runs)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from peer import Peer, open_peer
from peer.memnet import MemoryNetwork
from protocol.identity import Identity

SERVERS = 4
VOLUNTEER = "10.0.1.1"


async def _stall(net: MemoryNetwork, volunteer: Peer) -> None:
    """A matchmaking's worth of requests: stores and reads during a half-second stall of
    the volunteer's link, and reads right after it (they queue behind the late bytes)."""
    net.slow_host(VOLUNTEER, 5.0)
    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(volunteer.dht.store, f"during {i}", i, 600.0)
        await trio.sleep(0.5)
        net.slow_host(VOLUNTEER, 0.0)
        for i in range(3):
            nursery.start_soon(volunteer.dht.get, f"during {i}")


@pytest.mark.parametrize("client_mode", [True, False], ids=["client", "server"])
async def test_a_stall_of_our_own_link_keeps_every_contact(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, client_mode: bool
) -> None:
    net = MemoryNetwork(latency=0.005)
    caplog.set_level(logging.INFO, logger="peer")
    with trio.fail_after(120):
        async with _swarm(net, SERVERS, client_mode) as volunteer:
            assert await volunteer.dht.store("before", 1, ttl=600)
            contacts = sorted(volunteer.dht.routing_table_peers())
            assert len(contacts) == SERVERS
            caplog.clear()

            await _stall(net, volunteer)
            await trio.sleep(30)  # every request of the stall has ended

            assert sorted(volunteer.dht.routing_table_peers()) == contacts
            assert not [line for line in caplog.messages if "peer left" in line]
            assert await volunteer.dht.store("after", 3, ttl=600)
            assert await volunteer.dht.get("after") == 3


@pytest.mark.parametrize("servers", [1, 2, 3])
async def test_lookups_through_a_link_that_slowed_down_still_answer(
    autojump_clock: trio.testing.MockClock, servers: int
) -> None:
    """An outside tester's client with 2 or 3 contacts: its lookups, used to 10 ms round
    trips, gave up on each contact after 50 ms once 60-100 ms came on each way, and every
    store returned False and every get None, in ~0.1 s, for as long as the link was slow
    (tests/peer/test_routing.py -k nobody_left)."""
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(120):
        async with _swarm(net, servers, client_mode=True) as volunteer:
            for i in range(40):  # its recent lookups: answers within 10 ms
                assert await volunteer.dht.store(f"fast {i}", i, ttl=600)
            net.slow_host(VOLUNTEER, 0.1)
            for i in range(3):
                assert await volunteer.dht.store(f"slow {i}", i, ttl=600)
                assert await volunteer.dht.get(f"slow {i}") == i


@asynccontextmanager
async def _swarm(net: MemoryNetwork, servers: int, client_mode: bool) -> AsyncIterator[Peer]:
    """``servers`` nodes at 10.0.0.1, 10.0.0.2, ..., and a volunteer that joined through
    the first (a client, or listening at ``VOLUNTEER``), open for the context."""
    async with (
        open_peer("10.0.0.1:4000", network=net.interface("10.0.0.1")) as boot,
        trio.open_nursery() as nursery,
    ):
        for i in range(2, servers + 1):
            await nursery.start(_serve, net, f"10.0.0.{i}", boot.address)
        async with open_peer(
            None if client_mode else f"{VOLUNTEER}:4000",
            [boot.address],
            client_mode=client_mode,
            network=net.interface(VOLUNTEER),
        ) as volunteer:
            yield volunteer
        nursery.cancel_scope.cancel()


async def _serve(
    net: MemoryNetwork, host: str, boot: str, *, task_status: trio.TaskStatus[None]
) -> None:
    identity = Identity.from_seed(host.encode().ljust(32, b"\0"))
    async with open_peer(f"{host}:4000", [boot], identity, network=net.interface(host)):
        task_status.started()
        await trio.sleep_forever()
