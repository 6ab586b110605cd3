"""Review of the wire, host and DHT changes: regressions for the bugs found."""

from __future__ import annotations

import signal
import threading
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing

from peer.background import run_in_background
from peer.host import HostConfig, RpcHost, open_rpc_host
from peer.memnet import MemoryNetwork
from peer.node import open_peer
from peer.rpc import Reply, Request
from peer.wire import Outbox
from protocol.address import Address
from protocol.identity import Identity
from protocol.messages import NodeInfo, PingRequest


def _ordered_identities() -> tuple[Identity, Identity]:
    """Two identities, the second with the smaller raw PeerID (it wins the pool tie-break)."""
    first, second = Identity.from_seed(b"r" * 32), Identity.from_seed(b"s" * 32)
    if first.peer_id.raw < second.peer_id.raw:
        first, second = second, first
    return first, second


async def _pong(request: Request) -> Reply:
    return Reply({"ok": True})


async def test_proving_an_address_does_not_break_the_proven_peers_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A dialed B and calls it all the time; B proves A's address (as a DHT node does for a
    # claimed sender address at another host). B's check dial completes its handshake on A
    # and (before the fix) closed at once: A pooled it (B's id is smaller), and A's calls
    # to B that took it in that moment failed with PeerUnavailableError.
    id_a, id_b = _ordered_identities()
    net = MemoryNetwork()
    config = HostConfig(idle_timeout=60)
    async with (
        open_rpc_host(id_a, listen=Address("a", 1), network=net.interface("a"), config=config) as a,
        open_rpc_host(id_b, listen=Address("b", 1), network=net.interface("b"), config=config) as b,
    ):
        b.register("pong", _pong)
        assert a.listen_address is not None and b.listen_address is not None
        with trio.fail_after(30):
            await a.call(b.listen_address, "pong")

            async def keep_calling() -> None:  # no latency: bounded by count, not time
                for _ in range(300):
                    await a.call(b.listen_address, "pong")  # type: ignore[arg-type]

            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(keep_calling)
                for _ in range(30):
                    assert await b.prove_address(a.listen_address)
            assert b.dialed(a.listen_address)


async def _echo(request: Request) -> Reply:
    return Reply({}, request.payload)


async def test_large_frames_both_ways_at_once_over_a_small_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Each reader waits for half of a large frame before allocating it; with TCP-like flow
    # control (a 64 KiB window) and both peers sending 3 MiB frames to each other at once,
    # neither may end up waiting for the other's half-frame.
    id_a, id_b = _ordered_identities()
    net = MemoryNetwork(latency=0.01, window=1 << 16)
    async with (
        open_rpc_host(id_a, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(id_b, listen=Address("b", 1), network=net.interface("b")) as b,
    ):
        a.register("echo", _echo)
        b.register("echo", _echo)
        assert a.listen_address is not None and b.listen_address is not None
        payload = bytes(range(256)) * (3 << 12)  # 3 MiB
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(_expect_echo, a, b.listen_address, payload)
                    nursery.start_soon(_expect_echo, b, a.listen_address, payload)


async def _expect_echo(host: RpcHost, address: Address, payload: bytes) -> None:
    assert bytes((await host.call(address, "echo", {}, payload)).payload) == payload


def test_ctrl_c_during_a_blocking_call_cancels_it_on_the_loop() -> None:
    # SIGINT while the caller blocks in node.run(): the call is cancelled on the loop (not
    # left running), KeyboardInterrupt reaches the caller, and the peer still serves calls.
    entered = threading.Event()
    unwound: list[bool] = []

    async def slow() -> None:
        entered.set()
        try:
            await trio.sleep(60)
        finally:
            unwound.append(True)

    def interrupt() -> None:
        if entered.wait(10):
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    with run_in_background("127.0.0.1:0") as node:
        helper = threading.Thread(target=interrupt)
        helper.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                node.run(slow)
        finally:
            helper.join()
        assert unwound == [True]
        assert node.run_sync(lambda: 7) == 7


async def test_one_host_claiming_many_dead_addresses_does_not_block_honest_proofs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 70 throwaway identities on one host ping the victim claiming a frozen address (each
    # check dial then lasts dial_timeout, 10 s). They filled the queue of claims to check
    # (64, dialed one at a time: ~11 min), so an honest peer whose requests come from
    # another host than the one it listens at (dual-stack, multi-homed) was not learnt.
    net = MemoryNetwork(latency=0.01)
    net.freeze_host("10.0.0.9")
    identity = Identity.from_seed(b"h" * 32)
    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            victim = await stack.enter_async_context(
                open_peer("10.0.0.1:0", network=net.interface("10.0.0.1"))
            )
            address = victim.rpc.listen_address
            assert address is not None
            for seed in range(70):
                liar = await stack.enter_async_context(
                    open_rpc_host(
                        Identity.from_seed(bytes([seed]) * 32),
                        listen=None,
                        network=net.interface("10.0.0.3"),
                    )
                )
                await liar.call(address, "dht.ping", PingRequest("10.0.0.9:80").to_body())
            listening = await stack.enter_async_context(
                open_peer("10.0.0.5:0", identity=identity, network=net.interface("10.0.0.5"))
            )
            claimed = listening.rpc.listen_address
            assert claimed is not None
            asking = await stack.enter_async_context(
                open_rpc_host(identity, listen=None, network=net.interface("10.0.0.6"))
            )
            await asking.call(address, "dht.ping", PingRequest(claimed.hostport).to_body())
            await trio.sleep(15)
            assert victim.dht.table.get(identity.peer_id) == NodeInfo(
                identity.peer_id, claimed.hostport
            )


async def test_outbox_wakes_a_waiting_put_when_the_frames_taken_were_empty() -> None:
    # The queue is bounded in frames and in bytes; taking frames that hold no bytes still
    # frees frame slots, and a put waiting for one must wake.
    outbox = Outbox(capacity=1)
    await outbox.put([b""])
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outbox.put, [b"x"])
            await trio.testing.wait_all_tasks_blocked()
            assert await outbox.get_batch() == []  # nothing to write: empty pieces are dropped
            outbox.release()
        assert await outbox.get_batch() == [b"x"]
