"""A call the peer read and served is never sent a second time: only a ``bye`` (the peer's
idle timer, or room made for another peer) says the peer did not read it. Before session
52 a call sent on a connection quiet for half the idle timeout was taken for unread when
the connection then ended without a word, and sent again: a handler that was running (a
payment, an averaging contribution) ran twice and the caller saw success (a review)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from peer import PeerUnavailableError
from peer.host import RpcHost, open_rpc_host
from peer.memnet import MemoryNetwork
from peer.rpc import Reply, Request
from protocol.address import Address
from protocol.identity import Identity

A, B = Identity.from_seed(b"a" * 32), Identity.from_seed(b"b" * 32)
IDLE = 60.0  # HostConfig's default idle_timeout


@asynccontextmanager
async def _pair(net: MemoryNetwork) -> AsyncIterator[tuple[RpcHost, RpcHost, Address]]:
    """Hosts a (caller) and b (callee) on ``net``, and b's address."""
    async with (
        open_rpc_host(A, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(B, listen=Address("b", 1), network=net.interface("b")) as b,
    ):
        assert b.listen_address is not None
        yield a, b, b.listen_address


@pytest.mark.parametrize("quiet", [IDLE / 2 - 1, IDLE / 2 + 1])
@pytest.mark.parametrize("how", ["reset", "disconnect", "killed"])
async def test_a_call_served_before_the_connection_ended_runs_once_and_fails(
    autojump_clock: trio.testing.MockClock, quiet: float, how: str
) -> None:
    net = MemoryNetwork(latency=0.01)
    served: list[float] = []

    async def pay(request: Request) -> Reply:
        served.append(trio.current_time())
        await trio.sleep(2.0)
        return Reply({"ok": True})

    with trio.fail_after(120):
        async with _pair(net) as (a, b, address):
            b.register("pay", pay)
            await a.call(address, "pay", {})
            served.clear()
            await trio.sleep(quiet)

            async def end_it() -> None:
                await trio.sleep(1.0)  # the request arrived, the handler runs
                if how == "reset":
                    assert net.drop_connections("a") == 1
                elif how == "disconnect":
                    await b.disconnect(a.peer_id)
                else:
                    net.kill_host("b")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(end_it)
                with pytest.raises(PeerUnavailableError):
                    await a.call(address, "pay", {})
            assert len(served) == 1
            await trio.testing.wait_all_tasks_blocked()
            assert a.lost_at(b.peer_id) > -math.inf  # a departure, not an idle close


async def echo(request: Request) -> Reply:
    return Reply(request.body)


async def test_a_close_without_bye_after_a_quiet_spell_is_a_loss(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An end of stream without a ``bye`` (a process killed: its kernel closes the socket
    cleanly), after the connection was quiet for half the idle timeout, is a departure:
    it was taken for the peer's idle timer (no ``lost_at``, no DHT ping)."""
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(120):
        async with _pair(net) as (a, b, address):
            b.register("echo", echo)
            await a.call(address, "echo", {})
            await trio.sleep(IDLE / 2 + 5)
            closed = trio.current_time()
            await b.disconnect(a.peer_id)  # a plain close, as a dying process's kernel's
            await trio.sleep(1)
            assert closed < a.lost_at(b.peer_id) < closed + 1
