"""The RPC host: real TCP, dialing, the connection pool, client mode, lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing
from test_rpc import echo, two_hosts

from peer.errors import PeerUnavailableError
from peer.host import HostConfig, RpcHost, open_rpc_host
from peer.memnet import MemoryNetwork
from peer.node import open_peer
from peer.rpc import Reply, Request
from protocol.address import Address
from protocol.errors import ProtocolError
from protocol.identity import Identity
from protocol.messages import NodeInfo, PingRequest

ID_A = Identity.from_seed(b"a" * 32)
ID_B = Identity.from_seed(b"b" * 32)
ID_C = Identity.from_seed(b"c" * 32)


async def whoami(request: Request) -> Reply:
    return Reply({"caller": request.peer_id.to_base58(), "host": request.remote_host})


async def test_tcp_smoke() -> None:
    with trio.fail_after(10):
        async with (
            open_rpc_host(ID_A, listen=Address("127.0.0.1", 0)) as a,
            open_rpc_host(ID_B, listen=None) as b,
        ):
            a.register("whoami", whoami)
            assert b.listen_address is None
            address = a.listen_address
            assert address is not None and address.peer_id == ID_A.peer_id and address.port > 0
            reply = await b.call(address, "whoami")
            assert reply.body == {"caller": ID_B.peer_id.to_base58(), "host": "127.0.0.1"}
            # a HOST:PORT address learns the PeerID; the connection is reused
            assert await b.connect(Address("127.0.0.1", address.port)) == ID_A.peer_id
            big = bytes(range(256)) * 8192  # 2 MiB through the secure channel
            a.register("echo", lambda r: _echo(r))
            assert bytes((await b.call(address, "echo", {}, big)).payload) == big
            assert a.num_connections == b.num_connections == 1
            assert b.connected_peers() == [ID_A.peer_id]


async def _echo(request: Request) -> Reply:
    return Reply({}, request.payload)


async def test_wrong_peer_id_and_unreachable(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork()
    async with open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a:
        a.register("whoami", whoami)
        async with open_rpc_host(ID_B, listen=None, network=net.interface("b")) as b:
            with trio.fail_after(5):
                with pytest.raises(PeerUnavailableError) as info:
                    await b.call(Address("a", 1, ID_C.peer_id), "whoami")
                assert info.value.__cause__ is not None
                with pytest.raises(PeerUnavailableError) as info:
                    await b.call(Address("nowhere", 1), "whoami")
                assert isinstance(info.value.__cause__, ConnectionRefusedError)
                with pytest.raises(PeerUnavailableError):
                    await b.call(Address("x", 1, ID_B.peer_id), "whoami")  # ourselves
                await b.call(Address("a", 1, ID_A.peer_id), "whoami")
            assert b.num_connections == 1


async def test_concurrent_calls_share_one_dial(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork(latency=0.1)
    async with (
        open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(ID_B, listen=None, network=net.interface("b")) as b,
    ):
        a.register("whoami", whoami)
        assert a.listen_address is not None
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(b.call, a.listen_address, "whoami")
        assert net.connections_opened == 1
        assert trio.current_time() == pytest.approx(0.4)  # 3 handshake legs + 1 reply


@pytest.mark.parametrize("wrong_id", [False, True], ids=["same-peer", "another-peer-named"])
async def test_concurrent_calls_naming_a_peer_two_ways_share_one_dial(
    autojump_clock: trio.testing.MockClock, wrong_id: bool
) -> None:
    """Calls naming one peer ``HOST:PORT`` and ``PEERID@HOST:PORT`` at once made two dials
    and two connections (a review). The later spelling now waits for the dial in flight
    and uses its connection when it proves the PeerID named; a call naming another
    PeerID there fails as that dial shows it would."""
    net = MemoryNetwork(latency=0.1)
    async with (
        open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(ID_B, listen=None, network=net.interface("b")) as b,
    ):
        a.register("whoami", whoami)
        named = Address("a", 1, ID_C.peer_id if wrong_id else ID_A.peer_id)
        failed: list[str] = []

        async def call(address: Address) -> None:
            try:
                await b.call(address, "whoami")
            except PeerUnavailableError:
                failed.append(str(address))

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for i in range(10):
                    nursery.start_soon(call, named if i % 2 else Address("a", 1))
        assert len(failed) == (5 if wrong_id else 0)
        # (another PeerID named: a dial under it, if it went first, proves none for the
        # bare calls, which then dial themselves; trio runs the tasks in either order)
        assert net.connections_opened <= (2 if wrong_id else 1)
        assert b.num_connections == 1


@pytest.mark.parametrize("named_first", [False, True], ids=["bare-first", "named-first"])
async def test_a_call_waiting_on_a_dial_under_the_other_name_fails_with_it(
    autojump_clock: trio.testing.MockClock, named_first: bool
) -> None:
    """Against a host that does not answer, a call that waited for the dial under the
    other spelling dialed again itself, failing after twice the dial timeout (a review)."""
    net = MemoryNetwork(latency=0.01)
    async with (
        open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(ID_B, listen=None, network=net.interface("b")) as b,
    ):
        a.register("whoami", whoami)
        net.freeze_host("a")
        spellings = [Address("a", 1), Address("a", 1, ID_A.peer_id)]
        if named_first:
            spellings.reverse()
        ended: list[float] = []

        async def call(address: Address) -> None:
            with pytest.raises(PeerUnavailableError, match="dial timeout"):
                await b.call(address, "whoami")
            ended.append(trio.current_time())

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, spellings[0])
                await trio.sleep(0.5)
                nursery.start_soon(call, spellings[1])
        timeout = HostConfig().dial_timeout
        assert ended == [pytest.approx(timeout, abs=0.1)] * 2
        assert net.connections_opened == 0


async def test_a_call_naming_the_right_peer_id_is_not_failed_by_one_naming_a_stale_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Calls to one HOST:PORT under an old PeerID (a stale contact) and the new one (the
    peer restarted there with a new key): the second waited for the first's dial and took
    its identity failure as its own (a review)."""
    net = MemoryNetwork(latency=0.01)
    async with (
        open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(ID_B, listen=None, network=net.interface("b")) as b,
    ):
        a.register("whoami", whoami)
        outcome: dict[str, object] = {}

        async def call(name: str, address: Address) -> None:
            try:
                outcome[name] = (await b.call(address, "whoami")).body["caller"]
            except PeerUnavailableError:
                outcome[name] = "unavailable"

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "stale", Address("a", 1, ID_C.peer_id))
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(call, "right", Address("a", 1, ID_A.peer_id))
        assert outcome == {"stale": "unavailable", "right": ID_B.peer_id.to_base58()}


async def test_inbound_connection_serves_outbound_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork(latency=0.1)
    async with (
        open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(ID_B, listen=None, network=net.interface("b")) as b,
    ):
        a.register("whoami", whoami)
        b.register("whoami", whoami)
        assert a.listen_address is not None
        with trio.fail_after(5):
            await b.call(a.listen_address, "whoami")
            # a calls the client-mode b back over b's connection; the host part is unused
            reply = await a.call(Address("unused", 1, ID_B.peer_id), "whoami")
        assert reply.body["caller"] == ID_A.peer_id.to_base58()
        assert net.connections_opened == 1


async def test_simultaneous_dials_converge(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork(latency=0.1)
    config = HostConfig(idle_timeout=30)
    async with (
        open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a"), config=config) as a,
        open_rpc_host(ID_B, listen=Address("b", 1), network=net.interface("b"), config=config) as b,
    ):
        a.register("whoami", whoami)
        b.register("whoami", whoami)
        assert a.listen_address is not None and b.listen_address is not None
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.call, b.listen_address, "whoami")
                nursery.start_soon(b.call, a.listen_address, "whoami")
        assert net.connections_opened == 2
        # both now use the same one; the other idles out
        with trio.fail_after(200):
            for _ in range(10):
                await trio.sleep(10)
                await a.call(b.listen_address, "whoami")
                await b.call(a.listen_address, "whoami")
        assert a.num_connections == b.num_connections == 1
        assert net.connections_opened == 2


async def test_dial_timeout_on_a_frozen_peer(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork()
    config = HostConfig(dial_timeout=2.0)
    async with (
        open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(ID_B, listen=None, network=net.interface("b"), config=config) as b,
    ):
        assert a.listen_address is not None
        net.freeze_host("a")
        with pytest.raises(PeerUnavailableError) as info:
            await b.connect(a.listen_address)
        assert isinstance(info.value.__cause__, trio.TooSlowError)
        assert str(info.value).endswith(": no connection within the dial timeout (2 s)")
        assert trio.current_time() == 2.0


async def test_disconnect_and_close_connections(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork()
    async with (
        open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(ID_B, listen=Address("b", 1), network=net.interface("b")) as b,
        open_rpc_host(ID_C, listen=None, network=net.interface("c")) as c,
    ):
        assert a.listen_address is not None and b.listen_address is not None
        with trio.fail_after(5):
            await c.connect(a.listen_address)
            await c.connect(b.listen_address)
            assert c.num_connections == 2
            await c.disconnect(ID_A.peer_id)
            assert c.connected_peers() == [ID_B.peer_id]
            await c.close_connections()
            assert c.num_connections == 0
            await trio.testing.wait_all_tasks_blocked()
            assert a.num_connections == b.num_connections == 0
            await c.connect(a.listen_address)  # dials again


async def test_exit_closes_everything_and_errors_are_not_grouped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    with pytest.raises(KeyError):
        async with (
            open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a,
            open_rpc_host(ID_B, listen=None, network=net.interface("b")) as b,
        ):
            assert a.listen_address is not None
            await b.connect(a.listen_address)
            raise KeyError("from the body")
    await trio.testing.wait_all_tasks_blocked()
    assert net.open_connections == 0
    # the port is free again
    async with open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a:
        assert a.listen_address == Address("a", 1, ID_A.peer_id)


async def test_listen_address_in_use() -> None:
    net = MemoryNetwork()
    async with open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")):
        with pytest.raises(OSError):
            async with open_rpc_host(ID_B, listen=Address("a", 1), network=net.interface("a")):
                pass


async def test_a_clean_exit_first_writes_what_it_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer that leaves right after its last stream item was queued (an averaging
    reducer whose step just returned) still delivers it: a clean exit drains connections
    (at most drain_timeout); it does not wait for callers that never read."""
    net = MemoryNetwork(latency=0.05)
    served = trio.Event()
    chunk = bytes(1 << 20)

    async def chunks(request: Request) -> AsyncIterator[Reply]:
        for index in range(8):
            yield Reply({"i": index}, chunk)
        served.set()

    got: list[int] = []

    async def server(task_status: trio.TaskStatus[Address]) -> None:
        async with open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a:
            a.register_stream("chunks", chunks)
            assert a.listen_address is not None
            task_status.started(a.listen_address)
            await served.wait()  # and leaves at once

    with trio.fail_after(30):
        async with (
            open_rpc_host(ID_B, listen=None, network=net.interface("b")) as b,
            trio.open_nursery() as nursery,
        ):
            address = await nursery.start(server)
            async with b.stream(address, "chunks") as items:
                async for item in items:
                    got.append(item.body["i"])
                    assert len(item.payload) == len(chunk)
    assert got == list(range(8))


async def test_an_address_may_be_given_as_text(autojump_clock: trio.testing.MockClock) -> None:
    """``node.address`` is a string; passing it straight to ``rpc.call`` or ``rpc.stream``
    works, and anything else that is not an Address is a clear error."""
    net = MemoryNetwork(latency=0.01)
    async with two_hosts(net) as (a, b, address):
        b.register("echo", echo)

        async def items(request: Request) -> AsyncIterator[Reply]:
            yield Reply({"i": 0})

        b.register_stream("items", items)
        with trio.fail_after(10):
            assert (await a.call(str(address), "echo", {"x": 1})).body["body"] == {"x": 1}
            async with a.stream(str(address), "items") as replies:
                assert [r.body async for r in replies] == [{"i": 0}]
            with pytest.raises(ProtocolError):
                await a.call("not an address", "echo")
            with pytest.raises(TypeError, match="PEERID@HOST:PORT"):
                await a.call(42, "echo")  # type: ignore[arg-type]


class _ResolverFails:
    """A network whose resolver raises UnicodeError, as getaddrinfo does for a name its IDNA
    codec cannot encode."""

    def __init__(self, inner: trio.abc.Stream | object) -> None:
        self.inner = inner

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        if host == "unencodable":
            raise UnicodeError("encoding with 'idna' codec failed (label empty or too long)")
        return await self.inner.connect(host, port)  # type: ignore[attr-defined]

    async def serve(self, *args: object, **kwargs: object) -> object:
        return await self.inner.serve(*args, **kwargs)  # type: ignore[attr-defined]


async def test_a_resolver_error_is_an_unreachable_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A dial's UnicodeError was not caught: it ended the host (and the node above it)."""
    net = MemoryNetwork()
    async with (
        open_rpc_host(ID_A, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(ID_B, listen=None, network=_ResolverFails(net.interface("b"))) as b,  # type: ignore[arg-type]
    ):
        a.register("whoami", whoami)
        with trio.fail_after(5):
            with pytest.raises(PeerUnavailableError) as info:
                await b.call(Address("unencodable", 1), "whoami")
            assert isinstance(info.value.__cause__, UnicodeError)
            await b.call(Address("a", 1, ID_A.peer_id), "whoami")  # still serving


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


async def _expect_echo(host: RpcHost, address: Address, payload: bytes) -> None:
    assert bytes((await host.call(address, "echo", {}, payload)).payload) == payload


async def test_large_frames_both_ways_at_once_over_a_small_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Each reader waits for half of a large frame before allocating it; with TCP-like flow
    # control (a 64 KiB window) and both peers sending 2 MiB frames (the most a peer may
    # send: see MIN_PEER_FRAME_SIZE) to each other at once, neither may end up waiting for
    # the other's half-frame.
    id_a, id_b = _ordered_identities()
    net = MemoryNetwork(latency=0.01, window=1 << 16)
    async with (
        open_rpc_host(id_a, listen=Address("a", 1), network=net.interface("a")) as a,
        open_rpc_host(id_b, listen=Address("b", 1), network=net.interface("b")) as b,
    ):
        a.register("echo", _echo)
        b.register("echo", _echo)
        assert a.listen_address is not None and b.listen_address is not None
        payload = bytes(range(256)) * (2 << 12)  # 2 MiB
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(_expect_echo, a, b.listen_address, payload)
                    nursery.start_soon(_expect_echo, b, a.listen_address, payload)


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


async def test_a_stream_buffers_at_most_its_byte_bound_for_a_slow_consumer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Items of 2 MiB (4 MiB would be a frame's most): 32 of them were buffered for a
    consumer that lagged, 64 MiB (128 with the largest frames) per stream (a review). The
    reader now waits once STREAM_BUFFER_BYTES are held, and every item still arrives."""
    from peer.calls import STREAM_BUFFER_BYTES

    net = MemoryNetwork(latency=0.01, window=8 << 20)
    chunk = bytes(2 << 20)

    async def chunks(request: Request) -> AsyncIterator[Reply]:
        for index in range(20):
            yield Reply({"i": index}, chunk)

    with trio.fail_after(120):
        async with two_hosts(net) as (a, b, address):
            b.register_stream("chunks", chunks)  # b serves, a reads
            got: list[int] = []
            async with a.stream(address, "chunks") as items:
                got.append((await items.__anext__()).body["i"])
                await trio.sleep(10)  # the consumer lags: the items come meanwhile
                held = items._items._pending.held  # type: ignore[attr-defined]
                assert 0 < held <= STREAM_BUFFER_BYTES, held
                async for item in items:
                    got.append(item.body["i"])
            assert got == list(range(20))


async def test_a_consumer_that_lags_past_the_keepalive_does_not_leak_the_byte_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The reader waiting for byte room counted an item's bytes, then a cancel (its
    keepalive interval, 2.5 s, passed as the consumer's step ran on) came before the send:
    bytes counted for an item never buffered, until the stream stuck with nothing buffered
    (a review: 8 such lags of 40 2 MiB items, and the connection was lost)."""
    net = MemoryNetwork(latency=0.01, window=8 << 20)
    chunk = bytes(2 << 20)

    async def chunks(request: Request) -> AsyncIterator[Reply]:
        for index in range(40):
            yield Reply({"i": index}, chunk)

    got: list[int] = []
    with trio.fail_after(600):
        async with two_hosts(net) as (a, b, address):
            b.register_stream("chunks", chunks)
            async with a.stream(address, "chunks") as items:
                pending = items._items._pending  # type: ignore[attr-defined]
                got.append((await items.__anext__()).body["i"])
                await trio.sleep(10)  # the buffer fills (16 MiB): the reader waits
                async for item in items:
                    got.append(item.body["i"])
                    if len(got) <= 12:
                        autojump_clock.jump(2.5)  # a step that holds the loop that long
                    await trio.sleep(0.01)
                assert pending.held == 0
    assert got == list(range(40))
