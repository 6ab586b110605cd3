"""A call whose request takes longer than the silence timeout to write, on a slow uplink
(a 2 MiB averaging chunk at 100 KiB/s: ~20 s), to a peer that says nothing until it has
the whole request, is not cut off by the silence rule: a probe would wait behind our own
write, and the rule gives no verdict while one of our writes is going out (a review: the
connection was aborted at ~15 s, "nothing from the peer"). A write that stalls for good is
the send timeout's (HostConfig.send_timeout)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from peer.host import HostConfig, RpcHost, open_rpc_host
from peer.memnet import MemoryNetwork, MemoryStream
from peer.rpc import Reply, Request
from protocol.address import Address
from protocol.identity import Identity

ID_A = Identity.from_seed(b"s" * 32)
ID_B = Identity.from_seed(b"t" * 32)
RATE = 100 * 1024  # bytes/s out of host "b" (0.8 Mbit/s uplink)


async def _sink(request: Request) -> Reply:
    return Reply({"n": len(request.payload)})


@pytest.fixture
def slow_uplink(monkeypatch: pytest.MonkeyPatch) -> None:
    send_all = MemoryStream.send_all

    async def throttled(self: MemoryStream, data: bytes | bytearray | memoryview) -> None:
        if self.local_host == "b":
            await trio.sleep(memoryview(data).nbytes / RATE)
        await send_all(self, data)

    monkeypatch.setattr(MemoryStream, "send_all", throttled)


async def _never(request: Request) -> Reply:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


@asynccontextmanager
async def _connected() -> AsyncIterator[tuple[RpcHost, Address]]:
    """Host b (the slow uplink), connected to host a, which serves ``sink`` and ``never``."""
    net = MemoryNetwork(latency=0.05)
    config = HostConfig(silence_timeout=10.0)
    async with (
        open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a"), config=config) as a,
        open_rpc_host(ID_B, listen=None, network=net.interface("b"), config=config) as b,
    ):
        a.register("sink", _sink)
        a.register("never", _never)
        address = a.listen_address
        assert address is not None
        await b.call(address, "sink")  # connected
        yield b, address


@pytest.mark.parametrize("size", [1 << 20, 2 << 20])
async def test_one_slow_upload_to_a_quiet_peer_is_not_cut_off(
    autojump_clock: trio.testing.MockClock, slow_uplink: None, size: int
) -> None:
    async with _connected() as (b, address):
        start = trio.current_time()
        with trio.fail_after(120):
            reply = await b.call(address, "sink", {}, bytes(size))
        assert reply.body == {"n": size}
        assert trio.current_time() - start >= size / RATE  # it really was slow
        assert b.connections_opened == 1


async def test_slow_upload_beside_short_unanswered_calls(
    autojump_clock: trio.testing.MockClock, slow_uplink: None
) -> None:
    """Calls that end unanswered (cancelled after 3 s, a hedged lookup's) beside the upload: the
    rule then runs when they end, its probe waits behind our own write, and the connection
    was cut at ~15 s."""
    async with _connected() as (b, address):
        size = 2 << 20
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:

                async def hedged() -> None:
                    for _ in range(6):  # cancelled after 3 s, no deadline sent along
                        async with trio.open_nursery() as inner:
                            inner.start_soon(b.call, address, "never")
                            await trio.sleep(3.0)
                            inner.cancel_scope.cancel()

                nursery.start_soon(hedged)
                await trio.sleep(0.01)
                reply = await b.call(address, "sink", {}, bytes(size))
        assert reply.body == {"n": size}
        assert b.connections_opened == 1
