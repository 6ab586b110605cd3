"""Inbound connections: the per-host rate limit (a crowd behind one NAT is slowed down, not
turned away; refusals do not evict honest contacts; loopback is exempt, IPv4 and IPv6 alike)
and the TCP accept loop (the remote host as the stream names it; nothing left open when the
listener stops). In-memory network and virtual time, real loopback TCP only where TCP itself
is under test."""

from __future__ import annotations

import contextlib
import gc
import socket
import warnings
from functools import partial

import pytest
import trio
import trio.testing
from ipv6_loopback import ipv6_loopback

from peer import DHTConfig, open_peer
from peer.errors import PeerUnavailableError
from peer.host import HostConfig, open_rpc_host
from peer.memnet import MemoryNetwork
from peer.network import TcpNetwork, remote_host_of
from peer.remote_hosts import host_group
from protocol.address import Address
from protocol.identity import Identity
from protocol.noise import BUSY_SIGNAL

LATENCY = 0.01
WINDOW = 1 << 16
"""Bytes unread in one direction before a write waits (like a socket's buffers)."""
"""Just under the largest frame: four 1 MiB writes, one round trip of the window apart."""


# -- the per-host rate limit on inbound connections -------------------------------------


needs_ipv6_loopback = pytest.mark.skipif(
    not ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine (e.g. a container)"
)


def _client_identity(index: int) -> Identity:
    return Identity.from_seed((9_000 + index).to_bytes(32, "big"))


async def test_a_crowd_behind_one_nat_joining_at_once_is_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """HostConfig says the burst is 'enough for a crowd of peers behind one NAT joining at
    once'. A lab, a cluster behind SNAT or one machine running a swarm of 96 peers: all
    dial the bootstrap peer within the same instant. Each refused one fails its
    ``open_peer`` ("no initial peer answered"), so the crowd must be slowed down (a
    second or two), not turned away: the per-host connection count already bounds how
    many may wait, and waiting costs no handshake."""
    net = MemoryNetwork(latency=LATENCY)
    crowd = 96
    async with open_rpc_host(
        _client_identity(-1), listen=Address("10.0.0.9", 4000), network=net.interface("10.0.0.9")
    ) as bootstrap:
        address = bootstrap.listen_address
        assert address is not None
        failures: list[BaseException] = []

        async def join(index: int) -> None:
            async with open_rpc_host(
                _client_identity(index), listen=None, network=net.interface("10.0.0.1")
            ) as volunteer:
                try:
                    await volunteer.connect(address)
                except PeerUnavailableError as exc:
                    failures.append(exc)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for index in range(crowd):
                    nursery.start_soon(join, index)
        assert not failures, f"{len(failures)} of {crowd} refused: {failures[0]}"
        assert bootstrap.handshakes_refused == 0


@needs_ipv6_loopback
async def test_tcp_accept_loop_names_the_ipv6_host_as_the_stream_does() -> None:
    """The accept loop's ``admit`` sees the host that the per-host limits count by
    (``remote_host_of`` on the stream): the same string, over IPv6 too."""
    admitted: list[str] = []
    served: list[str] = []

    def admit(host: str) -> bool:
        admitted.append(host)
        return len(admitted) % 2 == 1  # every other one refused

    async def handler(stream: trio.abc.Stream) -> None:
        served.append(remote_host_of(stream))
        await stream.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(TcpNetwork().serve, admit=admit), "::1", 0, handler)
            for i in range(4):
                stream = await trio.open_tcp_stream("::1", port)
                got = b""
                while chunk := await stream.receive_some():
                    got += chunk
                assert got == (BUSY_SIGNAL if i % 2 else b"")  # closed either way
                await stream.aclose()
            nursery.cancel_scope.cancel()
    assert admitted == ["::1"] * 4
    assert served == ["::1"] * 2
    assert host_group(admitted[0]) == host_group(served[0])


async def test_tcp_listener_stopped_with_connections_waiting_leaves_nothing_open() -> None:
    """Cancelled while connections wait in the backlog and handlers run: the listening
    socket is closed (a new dial is refused), every accepted socket is closed, and
    nothing is left for the garbage collector to warn about."""
    started = 0
    five_started = trio.Event()

    async def handler(stream: trio.abc.Stream) -> None:
        nonlocal started
        started += 1
        if started == 5:
            five_started.set()
        async with stream:
            await trio.sleep_forever()

    clients: list[socket.socket] = []
    with warnings.catch_warnings(record=True) as caught, trio.fail_after(10):
        warnings.simplefilter("always")
        try:
            async with trio.open_nursery() as nursery:
                port = await nursery.start(TcpNetwork().serve, "127.0.0.1", 0, handler)
                for _ in range(20):
                    client = socket.socket()
                    client.setblocking(False)
                    clients.append(client)
                    with contextlib.suppress(BlockingIOError):
                        client.connect(("127.0.0.1", port))
                await five_started.wait()
                nursery.cancel_scope.cancel()  # some are still in the backlog
            with pytest.raises(OSError):
                await trio.open_tcp_stream("127.0.0.1", port)
        finally:
            for client in clients:
                client.close()
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


async def test_refusals_by_the_rate_limit_do_not_evict_an_honest_contact(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A volunteer shares its public address with others (a carrier-grade NAT, a campus
    NAT); one of them opens connections to a well-known peer X in a loop (hostile, or a
    crowd joining and retrying: ~1000 a second here). X refuses the connections beyond
    its per-host rate, the volunteer's among them. X is alive and well, so the volunteer
    must not drop it from its routing table (``max_failures`` failures in a row evict a
    contact, docs/dht.md): else whoever shares our address can make us forget every
    peer it floods. A dial refused this way fails like a dead peer's (not as a
    maybe-alive timeout)."""
    net = MemoryNetwork(latency=LATENCY)
    nat = net.interface("10.0.0.1")
    with trio.fail_after(300):
        async with (
            open_peer(
                "10.0.0.9:4000",
                network=net.interface("10.0.0.9"),
                identity=_client_identity(-1),
                clock=lambda: 1e9 + trio.current_time(),
            ) as x,
            open_peer(
                "10.0.0.1:4000",
                [x.address],
                network=nat,
                identity=_client_identity(-2),
                clock=lambda: 1e9 + trio.current_time(),
            ) as volunteer,
        ):
            table = volunteer.dht.protocol.table
            node = table.get(x.peer_id)
            assert node is not None
            await trio.sleep(HostConfig().idle_timeout + 1)  # the connection closed for idleness
            assert not volunteer.rpc.num_connections

            async def crowd_joins() -> None:
                for _ in range(2000):  # from the volunteer's address, not its own
                    stream = await nat.connect("10.0.0.9", 4000)
                    await stream.aclose()
                    await trio.sleep(0.001)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(crowd_joins)
                await trio.sleep(1.03)  # the burst is spent (and the bucket between refills)
                for _ in range(DHTConfig().max_failures):
                    await volunteer.dht.protocol.ping(node)
            assert x.rpc.handshakes_refused > 0
            assert x.peer_id in table, "an honest contact evicted for the rate limit's refusals"


@needs_ipv6_loopback
async def test_ipv6_loopback_is_exempt_from_the_rate_limit_like_ipv4_loopback() -> None:
    """HostConfig.rate_limit_loopback (off by default): local experiments start peers by
    the hundred on this machine's loopback, and each refused one fails its ``open_peer``.
    ``[::1]`` is this machine's loopback as much as 127.0.0.1 (a peer listening on
    ``localhost`` may well be reached over it)."""
    config = HostConfig(handshake_burst_per_ip=8)  # a crowd of 24 would exceed it
    crowd = 24
    async with open_rpc_host(_client_identity(-3), listen=Address("::1", 0), config=config) as host:
        address = host.listen_address
        assert address is not None
        ended: list[int] = []

        async def ends_at_once(stream: trio.abc.Stream) -> None:
            # a refused connection is closed as it is accepted; a taken one waits for our
            # first handshake message (for handshake_timeout, 10 s)
            with trio.move_on_after(1.0):
                with contextlib.suppress(trio.BrokenResourceError):
                    await stream.receive_some()
                ended.append(1)

        streams: list[trio.abc.Stream] = []
        try:
            with trio.fail_after(20):
                for _ in range(crowd):  # dialed at once, e.g. a script starting many peers
                    streams.append(await trio.open_tcp_stream("::1", address.port))
                async with trio.open_nursery() as nursery:
                    for stream in streams:
                        nursery.start_soon(ends_at_once, stream)
        finally:
            for stream in streams:
                await trio.aclose_forcefully(stream)
        assert not ended, f"{len(ended)} of {crowd} connections from [::1] refused"
        assert host.handshakes_refused == 0
