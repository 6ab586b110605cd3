"""``RpcHost.lost_at``: when a peer's side last ended its connection with us, none being left
open. The averager reads it for client-mode senders, which it cannot ping: one killed with
its first calls on their way is found gone without waiting for it to stall."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from peer.host import HostConfig, RpcHost, open_rpc_host
from peer.memnet import MemoryNetwork
from peer.rpc import Reply, Request
from protocol.address import Address
from protocol.identity import Identity

SERVER = Identity.from_seed(b"s" * 32)
CLIENTS = [Identity.from_seed(bytes([65 + i]) * 32) for i in range(3)]
HOSTS = ["a", "b", "c"]


async def echo(request: Request) -> Reply:
    return Reply(request.body, request.payload)


@asynccontextmanager
async def echo_server(net: MemoryNetwork) -> AsyncIterator[tuple[RpcHost, Address]]:
    """A host at ``s:1`` that answers ``echo``, and its address."""
    async with open_rpc_host(SERVER, listen=Address("s", 1), network=net.interface("s")) as server:
        server.register("echo", echo)
        assert server.listen_address is not None
        yield server, server.listen_address


async def test_a_killed_peer_is_lost_when_its_connection_broke(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    async with echo_server(net) as (server, address):
        with trio.fail_after(30):
            async with open_rpc_host(CLIENTS[0], listen=None, network=net.interface("a")) as a:
                assert server.lost_at(a.peer_id) == -math.inf
                await a.call(address, "echo")
                await trio.sleep(1)
                killed = trio.current_time()
                net.kill_host("a")
                await trio.testing.wait_all_tasks_blocked()
                assert server.connected_peers() == []
                assert server.lost_at(a.peer_id) == killed


async def test_our_own_close_and_the_peers_idle_close_are_no_loss(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    async with echo_server(net) as (server, address):
        with trio.fail_after(60):
            idle = HostConfig(idle_timeout=10.0)
            async with (
                open_rpc_host(
                    CLIENTS[0], listen=None, network=net.interface("a"), config=idle
                ) as a,
                open_rpc_host(CLIENTS[1], listen=None, network=net.interface("b")) as b,
            ):
                await a.call(address, "echo")
                await b.call(address, "echo")
                await server.disconnect(b.peer_id)  # ours
                await trio.sleep(15)  # a's idle timer closes its side
                assert server.connected_peers() == []
                assert server.lost_at(a.peer_id) == -math.inf
                assert server.lost_at(b.peer_id) == -math.inf


async def test_only_the_latest_losses_are_remembered(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("peer.connection_pool.LOST_REMEMBERED", 2)
    net = MemoryNetwork()
    async with echo_server(net) as (server, address):
        with trio.fail_after(30):
            async with (
                open_rpc_host(CLIENTS[0], listen=None, network=net.interface("a")) as a,
                open_rpc_host(CLIENTS[1], listen=None, network=net.interface("b")) as b,
                open_rpc_host(CLIENTS[2], listen=None, network=net.interface("c")) as c,
            ):
                for client, host in zip((a, b, c), HOSTS, strict=True):
                    await client.call(address, "echo")
                    net.kill_host(host)
                    await trio.testing.wait_all_tasks_blocked()
                    await trio.sleep(1)
                assert server.lost_at(a.peer_id) == -math.inf  # the oldest, forgotten
                assert server.lost_at(b.peer_id) < server.lost_at(c.peer_id) < math.inf
