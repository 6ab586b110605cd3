"""A node that closes an idle connection to make room for another peer says ``bye`` first:
the peer reads the close as ours, not as a departure, so it does not dial back to check on
us (which, with every slot taken, pushed the next idle peer out, and so on, one handshake
after another), and a request that crossed the ``bye`` goes out again elsewhere."""

from __future__ import annotations

import contextlib

import pytest
import trio
import trio.testing

from peer.calls import ConnectionClosedError
from peer.errors import PeerUnavailableError
from peer.host import HostConfig, open_rpc_host
from peer.memnet import MemoryNetwork
from peer.node import PeerConfig, open_peer
from peer.rpc import HandlerRegistry, Reply, Request, RpcConnection
from protocol.address import Address
from protocol.identity import Identity, PeerID

SERVER = Identity.from_seed(b"s" * 32)
CLIENTS = [Identity.from_seed(bytes([65 + i]) * 32) for i in range(4)]


async def echo(request: Request) -> Reply:
    return Reply(request.body, request.payload)


async def test_a_request_that_crosses_the_bye_is_not_served_and_fails_as_unread(
    autojump_clock: trio.testing.MockClock,
) -> None:
    served = []

    async def counted(request: Request) -> Reply:
        served.append(request.body)
        return Reply(request.body)

    ours, theirs = trio.testing.memory_stream_pair()
    handlers = HandlerRegistry()
    handlers.register("echo", counted)
    evictor = RpcConnection(ours, CLIENTS[0].peer_id, handlers)
    other = RpcConnection(theirs, SERVER.peer_id, handlers)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(evictor.run)
            await nursery.start(other.run)
            assert (await other.call("echo", {"n": 1})).body == {"n": 1}
            evictor.close_idle_nowait(ConnectionError("closed to make room"))
            assert evictor.closing and not evictor.closed  # until the bye is written
            with pytest.raises(ConnectionClosedError, match="before reading the request"):
                await other.call("echo", {"n": 2})  # crosses the bye, or follows it
            await trio.testing.wait_all_tasks_blocked()
            assert evictor.closed and other.closed
            assert not evictor.lost and not other.lost  # nobody departed
            assert served == [{"n": 1}]


async def test_a_peer_closed_to_make_room_does_not_take_it_for_a_departure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    config = HostConfig(max_connections=3, max_connections_per_ip=3)
    async with open_rpc_host(
        SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
    ) as server:
        server.register("echo", echo)
        address = server.listen_address
        assert address is not None
        lost: list[PeerID] = []
        with trio.fail_after(30):
            async with (
                open_rpc_host(CLIENTS[0], listen=None, network=net.interface("a")) as a,
                open_rpc_host(CLIENTS[1], listen=None, network=net.interface("b")) as b,
                open_rpc_host(CLIENTS[2], listen=None, network=net.interface("c")) as c,
                open_rpc_host(CLIENTS[3], listen=None, network=net.interface("d")) as d,
            ):
                for client in (a, b, c, d):
                    client.on_connection_lost = lost.append
                for client in (a, b, c):
                    await client.call(address, "echo")
                    await trio.sleep(2)  # a is idle the longest
                await d.call(address, "echo")  # every slot is taken: a is closed for it
                await trio.testing.wait_all_tasks_blocked()
                assert a.num_connections == 0
                assert server.num_connections == 3
                assert lost == []  # a would check on the server with a new dial, pushing b out
                await trio.sleep(5)
                assert (b.num_connections, c.num_connections, d.num_connections) == (1, 1, 1)
                assert (await a.call(address, "echo", {"back": 1})).body == {"back": 1}


async def test_a_full_bootstrap_node_does_not_set_off_a_chain_of_dials(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Twelve peers, a bootstrap node with room for six connections: once the swarm has
    settled, the bootstrap node accepts about as many connections as the peers' own
    upkeep needs (refreshes, republishing), not a new one each time it makes room."""
    net = MemoryNetwork()
    small = PeerConfig(host=HostConfig(max_connections=6))
    with trio.fail_after(3600):
        async with (
            open_peer(
                "10.0.0.1:4000", identity=SERVER, network=net.interface("10.0.0.1"), config=small
            ) as bootstrap,
            trio.open_nursery() as nursery,
        ):
            stop = trio.Event()
            joined = trio.Semaphore(0)

            async def volunteer(index: int) -> None:
                host = f"10.0.1.{index}"
                async with open_peer(
                    f"{host}:4000",
                    [bootstrap.address],
                    identity=Identity.from_seed(bytes([100 + index]) * 32),
                    network=net.interface(host),
                ) as peer:
                    await peer.dht.store(f"key-{index}", index, ttl=3600)
                    joined.release()
                    await stop.wait()

            for index in range(12):
                nursery.start_soon(volunteer, index)
            for _ in range(12):
                await joined.acquire()
            await trio.sleep(30)
            before = bootstrap.rpc.connections_opened
            await trio.sleep(120)
            accepted = bootstrap.rpc.connections_opened - before
            stop.set()
    print(f"{accepted} connections accepted in 120 s")
    assert accepted <= 12, f"{accepted} connections in 120 s"


async def test_our_own_call_in_the_instant_we_say_bye_goes_on_a_fresh_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A host closes an idle connection (``bye``, then the close once it is written) and,
    in the same instant, calls that peer: the call does not take the closing connection
    (a request written after our bye is never read; a review found it failed with the
    bye's cause), it dials a fresh one and is answered."""
    from test_rpc import two_hosts

    from peer.errors import PeerUnavailableError

    async with two_hosts(MemoryNetwork(latency=0.01)) as (a, b, address):
        a.register("echo", echo)
        b.register("echo", echo)
        await a.call(address, "echo", {})
        await trio.sleep(2)
        closing = b._by_peer[a.peer_id]
        opened = b.connections_opened
        with trio.fail_after(10):
            closing.close_idle_nowait(PeerUnavailableError("closed for a newcomer"))
            reply = await b.call(a.listen_address, "echo", {"x": 1})
        assert reply.body == {"x": 1}
        assert b.connections_opened == opened + 1
        assert closing.closing and b._by_peer[a.peer_id] is not closing


async def test_evicting_idle_dead_peers_keeps_within_max_connections(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The idlest connection, evicted for a newcomer, is the likeliest to lead to a dead
    peer, which never closes its end: held open for the idle close's grace after the bye,
    each eviction left one more connection (8 of ``max_connections`` 4; a review). An
    eviction closes once its bye is written."""
    net = MemoryNetwork(latency=0.005)
    config = HostConfig(max_connections=4, max_connections_per_ip=4)
    peak = 0
    server_id = Identity.from_seed(b"s" * 32)
    with trio.fail_after(60):
        async with open_rpc_host(
            server_id, listen=Address("s", 1), network=net.interface("s"), config=config
        ) as server:
            server.register("echo", echo)
            address = server.listen_address
            assert address is not None
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    nonlocal peak
                    while True:
                        peak = max(peak, server.num_connections)
                        await trio.sleep(0.01)

                async def client(i: int, ready: trio.Event) -> None:
                    identity = Identity.from_seed(bytes([65 + i]) * 32)
                    async with open_rpc_host(
                        identity, listen=None, network=net.interface(f"c{i}")
                    ) as c:
                        await c.call(address, "echo", {"i": i})
                        ready.set()
                        await trio.sleep_forever()

                nursery.start_soon(watch)
                for i in range(4):  # idle peers fill the slots, then go dark (no FIN)
                    ready = trio.Event()
                    nursery.start_soon(client, i, ready)
                    await ready.wait()
                await trio.sleep(2)
                for i in range(4):
                    net.freeze_host(f"c{i}")
                for i in range(4, 8):  # each newcomer evicts one of them
                    ready = trio.Event()
                    nursery.start_soon(client, i, ready)
                    with trio.fail_after(10):
                        await ready.wait()
                    await trio.sleep(0.3)
                assert peak <= 4 and server.num_connections == 4
                nursery.cancel_scope.cancel()


@pytest.mark.parametrize("at", [3.75, 4.0, 4.25])
async def test_a_bye_goes_after_the_replies_already_queued(
    autojump_clock: trio.testing.MockClock, at: float
) -> None:
    """A served request whose large reply still waits in the queue no longer counts as in
    flight, so its connection may be evicted for a newcomer (at ``at`` s); the bye, queued
    urgent, overtook the reply, and the caller, reading it as 'never read', sent the
    request again: the handler ran twice (2 of 25 trials, a review). The bye queues
    behind the replies."""
    executions: list[int] = []

    async def big(request: Request) -> Reply:
        executions.append(request.body["n"])
        return Reply({"n": request.body["n"]}, b"x" * (2 << 20))

    net = MemoryNetwork(latency=0.6, window=1)  # a slow link
    config = HostConfig(max_connections=1, max_connections_per_ip=8)
    with trio.fail_after(120):
        async with open_rpc_host(
            Identity.from_seed(b"s" * 32), listen=Address("s", 1),
            network=net.interface("s"), config=config,
        ) as server:  # fmt: skip
            server.register("big", big)
            server.register("echo", echo)
            address = server.listen_address
            assert address is not None
            caller_id, newcomer_id = Identity.from_seed(b"c" * 32), Identity.from_seed(b"d" * 32)
            async with open_rpc_host(caller_id, listen=None, network=net.interface("c")) as c:
                await c.connect(address)
                start = trio.current_time()

                async def one(n: int) -> None:
                    with trio.fail_after(60), contextlib.suppress(PeerUnavailableError):
                        await c.call(address, "big", {"n": n})

                async with trio.open_nursery() as nursery:
                    for n in (1, 2, 3):
                        nursery.start_soon(one, n)
                    await trio.sleep_until(start + at)
                    network = net.interface("n")
                    async with open_rpc_host(newcomer_id, listen=None, network=network) as newcomer:
                        with contextlib.suppress(PeerUnavailableError):
                            await newcomer.call(address, "echo", {"hi": 1})
        assert sorted(executions) == [1, 2, 3], executions
