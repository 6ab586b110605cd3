"""RpcConnection.supersede and the host's duplicate connections: of two connections with
one peer, the one not kept closes after 1 s idle, only when the two peers dialed each other
at once, and a superseded one promoted to carry our calls gets its idle timeout back."""

from __future__ import annotations

import logging
import math

import pytest
import trio
import trio.testing
from test_rpc import wired_connection

from peer.errors import PeerUnavailableError
from peer.host import HostConfig, open_rpc_host
from peer.memnet import MemoryNetwork
from peer.rpc import Reply, Request
from protocol.address import Address
from protocol.identity import Identity
from protocol.rpc import FrameKind, RpcFrame

ID_A = Identity.from_seed(b"r" * 32)
ID_B = Identity.from_seed(b"s" * 32)


async def _pong(request: Request) -> Reply:
    return Reply({"ok": True})


async def test_superseded_with_a_call_in_flight_waits_for_it(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """idle_timeout inf (the watchdog starts late), a call of ours in flight: no close
    while it waits; a bye 1 s after it ends; supersede again / after close is harmless."""
    caplog.set_level(logging.WARNING)
    with trio.fail_after(30):
        async with wired_connection() as (connection, wire):
            assert math.isinf(connection.idle_timeout)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(connection.call, "m")
                rid = (await wire.receive()).request_id
                connection.supersede()
                connection.supersede()  # twice: one watchdog
                await trio.sleep(5)
                assert not connection.closing
                await wire.send(RpcFrame(FrameKind.RESPONSE, rid, body={}))
            t0 = trio.current_time()
            bye = await wire.receive()
            assert bye.kind is FrameKind.BYE
            assert trio.current_time() - t0 == pytest.approx(1.0, abs=0.05)
            await connection._finished.wait()
            connection.supersede()  # after close: nothing
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_superseded_while_the_peer_calls_us_waits_for_its_handler(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(30):
        async with wired_connection() as (connection, wire):

            async def slow(request: Request) -> Reply:
                await trio.sleep(3)
                return Reply({"done": 1})

            connection._handlers.register("slow", slow)
            await wire.send(RpcFrame(FrameKind.REQUEST, 1, method="slow"))
            await trio.sleep(0.1)
            connection.supersede()
            answer = await wire.receive()
            assert answer.kind is FrameKind.RESPONSE and answer.body == {"done": 1}
            t0 = trio.current_time()
            assert (await wire.receive()).kind is FrameKind.BYE
            assert trio.current_time() - t0 == pytest.approx(1.0, abs=0.05)


async def test_a_peer_that_redials_while_its_old_connection_hangs_dials_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same peer (same identity: a restart, or a NAT that rebound its address) dials
    us while its old connection, dead without a reset, still stands on our side. Both
    connections have the same initiator, so the tie-break keeps the old (dead) one and the
    host supersedes the new one: our side closes it after 1 s idle, and the peer, calling
    us every 3 s, dialed anew for every call until our side dropped the dead one (a review):
    a connection is superseded only when the two were dialed by different sides."""
    net = MemoryNetwork(latency=0.01)
    config = HostConfig()
    async with open_rpc_host(
        ID_B, listen=Address("b", 1), network=net.interface("b"), config=config
    ) as b:
        b.register("pong", _pong)
        address = b.listen_address
        assert address is not None
        async with open_rpc_host(
            ID_A, listen=None, network=net.interface("a1"), config=config
        ) as old:
            await old.call(address, "pong")
            net.freeze_host("a1")  # the old process's link died silently
            async with open_rpc_host(
                ID_A, listen=None, network=net.interface("a2"), config=config
            ) as new:
                with trio.fail_after(60):
                    for _ in range(10):
                        await new.call(address, "pong")
                        await trio.sleep(3)
                assert new.connections_opened == 1
            net.unfreeze_host("a1")


async def test_a_promoted_superseded_connection_gets_its_idle_timeout_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Of two connections dialed at once, the kept one ends while the superseded one is
    still open (a call of ours in flight on it): the host promotes the superseded one, which
    then closes after idle_timeout, not after 1 s idle (one needless redial: a review)."""
    id_a, id_b = (ID_A, ID_B) if ID_A.peer_id.raw > ID_B.peer_id.raw else (ID_B, ID_A)
    net = MemoryNetwork(latency=0.01)
    config = HostConfig(idle_timeout=60.0)

    async def slow(request: Request) -> Reply:
        await trio.sleep(5)
        return Reply({})

    async with (
        open_rpc_host(id_a, listen=Address("a", 1), network=net.interface("a"), config=config) as a,
        open_rpc_host(id_b, listen=Address("b", 1), network=net.interface("b"), config=config) as b,
    ):
        for host in (a, b):
            host.register("pong", _pong)
            host.register("slow", slow)
        assert a.listen_address is not None and b.listen_address is not None
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.call, b.listen_address, "pong")
                nursery.start_soon(b.call, a.listen_address, "pong")
            assert a.num_connections == 2
            kept = a._by_peer[id_b.peer_id]
            other = next(c for c in a._connections if c is not kept)
            assert other.idle_timeout == 1.0
            async with trio.open_nursery() as nursery:
                nursery.start_soon(other.call, "slow")  # in flight on the superseded one
                await trio.sleep(0.5)
                kept.close_nowait(PeerUnavailableError("test: the kept one ends"))
                await trio.sleep(0.5)
                assert a._by_peer.get(id_b.peer_id) is other  # promoted
            await trio.sleep(3)
            assert not other.closed, "the promoted connection closed after 1 s idle"
