"""Hostile peers built from the wire spec alone (docs/protocol.md): each must cost the node
little memory and CPU, and everyone else keeps being served."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing
from secure_pairs import secure_pair

from peer.host import HostConfig, open_rpc_host
from peer.memnet import MemoryNetwork
from peer.rpc import Reply, Request
from peer.secure import SecureStream, secure_handshake
from peer.wire import QUEUE_BYTES, FramePool, FrameReader
from protocol.address import Address
from protocol.errors import RemoteProtocolError
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, NEED_DATA, FrameDecoder, encode_frame_header
from protocol.identity import Identity
from protocol.rpc import FrameKind, RpcFrame, decode_rpc_frame, encode_rpc_frame

SERVER = Identity.from_seed(b"s" * 32)
GOOD = Identity.from_seed(b"g" * 32)
BAD = Identity.from_seed(b"b" * 32)

MIB = 1 << 20
LARGE = bytes(MIB)


def _requests(method: str, count: int) -> bytes:
    frames = (
        encode_rpc_frame(RpcFrame(FrameKind.REQUEST, request_id, method=method))
        for request_id in range(count)
    )
    return b"".join(bytes(piece) for pieces in frames for piece in pieces)


async def _dial(net: MemoryNetwork, source: str, identity: Identity) -> SecureStream:
    raw = await net.interface(source).connect("s", 1)
    return await secure_handshake(raw, identity, initiator=True)


async def _read_replies(stream: SecureStream, count: int) -> int:
    """Read until ``count`` reply frames came; how many of them were ``res``."""
    decoder = FrameDecoder()
    seen = answered = 0
    while seen < count:
        decoder.receive_data(await stream.receive_some(MIB))
        while (frame := decoder.next_frame()) is not NEED_DATA:
            assert isinstance(frame, bytes)
            seen += 1
            answered += decode_rpc_frame(frame).kind is FrameKind.RESPONSE
    return answered


async def _asking_for_pages(net: MemoryNetwork, count: int) -> list[SecureStream]:
    """``count`` connections from host "bad", each asking for 20 pages and reading none."""
    attackers = []
    for i in range(count):
        attacker = await _dial(net, "bad", Identity.from_seed(bytes([i + 1]) * 32))
        await attacker.send_all(_requests("page", 20))
        attackers.append(attacker)
    return attackers


class _Pages:
    """A quick handler of 1 MiB pages that counts the pages it built."""

    def __init__(self) -> None:
        self.built = 0

    def __call__(self, request: Request) -> Reply:
        self.built += 1
        return Reply({}, LARGE)


async def test_a_peer_that_never_reads_large_replies_makes_us_build_few_of_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A FIND_VALUE page is 1 MiB for a request of ~100 bytes. A peer that asked for 100 of
    them and read none made the node build and hold all 100 (32 queued, the rest held by
    tasks waiting for queue room): ~150 MB per connection, measured on real TCP."""
    net = MemoryNetwork(window=MIB)  # a peer that stops reading stalls our writes, as TCP
    page = _Pages()

    async with (
        open_rpc_host(SERVER, listen=Address("s", 1), network=net.interface("s")) as server,
        open_rpc_host(GOOD, listen=None, network=net.interface("good")) as good,
    ):
        server.register_quick("page", page)
        server.register_quick("ping", lambda request: Reply({"ok": True}))
        assert server.listen_address is not None
        with trio.fail_after(30):
            attacker = await _dial(net, "bad", BAD)
            await attacker.send_all(_requests("page", 100))
            await trio.sleep(5)  # everything that can happen without the attacker reading
            # the outbox's byte budget, the batch being written, what the window holds
            assert page.built <= QUEUE_BYTES // MIB + 4
            reply = await good.call(server.listen_address, "ping")
            assert reply.body == {"ok": True}
            # once it reads, every request is answered: no waiter was forgotten
            assert await _read_replies(attacker, 100) == 100
            assert page.built == 100


async def test_peers_that_never_read_large_replies_hold_the_send_budget_and_no_more(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Each connection queues at most 4 MiB, but a client that opened 128 connections, asked
    on each for 100 pages of 1 MiB and read none made a bootstrap node hold 1.3 GB (an
    outside tester, real TCP: the queue, the batch being written, a reply waiting for room,
    and a task per request). Now large frames take room in the host's send budget, and one
    host holds at most its share of it: another host's large reply goes out at once."""
    net = MemoryNetwork(window=MIB)  # a peer that stops reading stalls our writes, as TCP
    config = HostConfig(send_budget=8 * MIB, send_budget_per_host=2 * MIB)
    page = _Pages()

    async with (
        open_rpc_host(
            SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
        ) as server,
        open_rpc_host(GOOD, listen=None, network=net.interface("good")) as good,
    ):
        server.register_quick("page", page)
        server.register_quick("ping", lambda request: Reply({"ok": True}))
        assert server.listen_address is not None
        with trio.fail_after(30):
            attackers = await _asking_for_pages(net, 6)
            await trio.sleep(5)  # everything that can happen without the attackers reading
            # each window took one page (written: no longer ours); then the host's share,
            # one frame beyond it, and the frame each writer is stuck on
            assert page.built <= 6 + 2 + 1 + 6, page.built
            assert server._send_budget.used <= 3 * MIB + 6 * MIB
            assert (await good.call(server.listen_address, "ping")).body == {"ok": True}
            with trio.fail_after(1):  # another host's large reply is not held back
                assert (await good.call(server.listen_address, "page")).payload == LARGE
            # once they read, every request is answered: no waiter was forgotten (all at
            # once: the frames stuck on the others hold their host's share meanwhile)
            answered = []

            async def read(attacker: SecureStream) -> None:
                answered.append(await _read_replies(attacker, 20))

            async with trio.open_nursery() as nursery:
                for attacker in attackers:
                    nursery.start_soon(read, attacker)
            assert answered == [20] * 6 and page.built == 6 * 20 + 1
            assert server._send_budget.used == 0
            for attacker in attackers:
                await attacker.aclose()


def _frames(*frames: RpcFrame) -> bytes:
    return b"".join(bytes(piece) for frame in frames for piece in encode_rpc_frame(frame))


async def test_small_replies_never_wait_behind_others_unread_large_replies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A ping's reply takes nothing from the send budget, so it must not wait for it: with
    the budget filled by other connections' unread pages, a ping waited 55 s, until the
    send timeout cut them off (a review)."""
    net = MemoryNetwork(window=MIB)
    config = HostConfig(send_budget=2 * MIB)  # no share per host (the default)
    async with (
        open_rpc_host(
            SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
        ) as server,
        open_rpc_host(GOOD, listen=None, network=net.interface("good")) as good,
    ):
        server.register_quick("page", lambda request: Reply({}, LARGE))
        server.register_quick("ping", lambda request: Reply({"ok": True}))
        assert server.listen_address is not None
        with trio.fail_after(30):
            attackers = await _asking_for_pages(net, 4)
            await trio.sleep(5)
            assert not server._send_budget.fits(MIB, None)  # no room for a page
            with trio.fail_after(1):
                assert (await good.call(server.listen_address, "ping")).body == {"ok": True}
            for attacker in attackers:
                await attacker.aclose()


async def test_a_request_cancelled_while_queued_leaves_the_backlog(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Quick requests waiting for room wait in one queue per connection. A request and its
    cancel, again and again, while the first waited, piled up there (2,000 entries of
    30 KB each past the in-flight limit of 128: a review)."""
    net = MemoryNetwork(window=MIB)
    config = HostConfig(send_budget=MIB)
    async with open_rpc_host(
        SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
    ) as server:
        server.register_quick("page", lambda request: Reply({}, LARGE))
        with trio.fail_after(60):
            hog = await _dial(net, "bad", Identity.from_seed(b"h" * 32))  # fills the budget
            await hog.send_all(_requests("page", 20))
            await trio.sleep(2)
            cheat = Identity.from_seed(b"a" * 32)
            attacker = await _dial(net, "bad2", cheat)
            await attacker.send_all(_frames(RpcFrame(FrameKind.REQUEST, 0, method="page")))
            for k in range(1, 2001):
                await attacker.send_all(
                    _frames(
                        RpcFrame(FrameKind.REQUEST, k, method="page", payload=bytes(30_000)),
                        RpcFrame(FrameKind.CANCEL, k),
                    )
                )
            await trio.sleep(1)
            (connection,) = [c for c in server._connections if c.peer_id == cheat.peer_id]
            assert len(connection._quick_backlog) <= 1 and len(connection._incoming) <= 1
            for stream in (hog, attacker):
                await stream.aclose()


async def test_connections_that_never_handshake_do_not_lock_other_peers_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Silent TCP connections from a few hosts (no crypto, no bytes) filled every slot, and
    each new peer was refused for ``handshake_timeout``, renewable forever. The oldest
    handshake in progress now makes room."""
    net = MemoryNetwork()
    config = HostConfig(max_connections=8, max_connections_per_ip=4, handshake_timeout=10.0)
    silent: list[trio.abc.Stream] = []
    async with (
        open_rpc_host(
            SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
        ) as server,
        open_rpc_host(GOOD, listen=None, network=net.interface("good")) as good,
    ):
        server.register_quick("ping", lambda request: Reply({"ok": True}))
        assert server.listen_address is not None
        with trio.fail_after(5):
            for host in ("bad1", "bad2"):
                for _ in range(4):
                    silent.append(await net.interface(host).connect("s", 1))
            await trio.testing.wait_all_tasks_blocked()
            assert server._handshaking == 8
            for _ in range(3):  # within the handshake timeout, again and again
                assert (await good.call(server.listen_address, "ping")).body == {"ok": True}
                await good.disconnect(server.peer_id)
                await trio.sleep(1)
            assert server._handshaking < 8  # the oldest silent ones were cut off
        for stream in silent:
            await stream.aclose()


async def test_established_idle_connections_do_not_lock_other_peers_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Completed handshakes from a few hosts, each kept open (a ping now and then keeps the
    idle timer away), filled every slot and every new peer was refused for as long as the
    attacker liked. The inbound connection idle the longest now makes room; one serving a
    call is never closed for it."""
    net = MemoryNetwork()
    config = HostConfig(max_connections=4, max_connections_per_ip=2)
    busy = trio.Event()
    release = trio.Event()

    async def slow(request: Request) -> Reply:
        busy.set()
        await release.wait()
        return Reply({"slow": True})

    with trio.fail_after(30):
        async with AsyncExitStack() as stack:
            server = await stack.enter_async_context(
                open_rpc_host(
                    SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
                )
            )
            server.register_quick("ping", lambda request: Reply({"ok": True}))
            server.register("slow", slow)
            address = server.listen_address
            assert address is not None
            # the first holder keeps a call in flight, the others only held their slot
            holders = []
            for index in range(4):
                identity = Identity.from_seed(bytes([100 + index]) * 32)
                host = net.interface(f"bad{index // 2}")
                holder = open_rpc_host(identity, listen=None, network=host)
                holders.append(await stack.enter_async_context(holder))
                await holders[-1].call(address, "ping")
            good = await stack.enter_async_context(
                open_rpc_host(GOOD, listen=None, network=net.interface("good"))
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(holders[0].call, address, "slow")
                await busy.wait()
                await trio.sleep(5)
                assert server.num_connections == 4
                assert (await good.call(address, "ping")).body == {"ok": True}
                await trio.testing.wait_all_tasks_blocked()
                assert holders[0].peer_id in server.connected_peers()  # its call still runs
                assert server.num_connections == 4  # one idle holder made room
                release.set()


async def test_the_per_host_limit_counts_an_ipv6_slash_64_as_one_host(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One IPv6 subscriber holds a whole /64: counting each address apart gave one attacker
    as many hosts as it liked."""
    net = MemoryNetwork()
    config = HostConfig(max_connections=64, max_connections_per_ip=4)
    async with open_rpc_host(
        SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
    ) as server:
        with trio.fail_after(5):
            streams = [
                await net.interface(f"2001:db8:0:7::{i + 1:x}").connect("s", 1) for i in range(6)
            ]
            await trio.testing.wait_all_tasks_blocked()
            assert server._handshaking == 4  # the other two were closed at once
            other = await net.interface("2001:db8:0:8::1").connect("s", 1)  # another /64
            await trio.testing.wait_all_tasks_blocked()
            assert server._handshaking == 5
        for stream in [*streams, other]:
            await stream.aclose()


async def _secure_pair() -> tuple[SecureStream, SecureStream]:
    return await secure_pair(BAD, SERVER)


async def test_a_frame_announced_but_not_sent_gets_no_buffer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Four bytes announcing a 4 MiB frame made the reader allocate (and zero) 4 MiB at
    once: 120 connections that sent 5 bytes each took 480 MB of a node's memory, for the
    idle timeout, renewable. The buffer now waits for half of the frame."""
    pool = FramePool()
    attacker, server = await _secure_pair()
    reader = FrameReader(server, DEFAULT_MAX_FRAME_SIZE, pool)
    content = bytes(range(256)) * (DEFAULT_MAX_FRAME_SIZE // 256)
    got: list[memoryview | None] = []

    async def read() -> None:
        got.append(await reader.next_frame())

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await attacker.send_all(encode_frame_header(len(content)) + content[:1000])
            await trio.testing.wait_all_tasks_blocked()
            assert pool.allocated == 0 and not got
            await attacker.send_all(content[1000 : len(content) // 2])
            await trio.testing.wait_all_tasks_blocked()
            assert pool.allocated == 1 and not got  # half of it came: worth a buffer
            await attacker.send_all(content[len(content) // 2 :])
    assert got[0] is not None and got[0] == content


async def test_a_truncated_large_frame_still_ends_the_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    attacker, server = await _secure_pair()
    reader = FrameReader(server, DEFAULT_MAX_FRAME_SIZE, FramePool())
    with trio.fail_after(5):
        await attacker.send_all(encode_frame_header(1 << 20) + bytes(100))
        await attacker.aclose()
        with pytest.raises(RemoteProtocolError, match="truncated"):
            await reader.next_frame()


async def test_a_small_answer_still_skips_our_queued_uploads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With our uploads to a peer filling the outbox's byte budget, the peer's DHT-style
    requests are answered off the reader; their small replies must still go ahead of the
    megabytes queued (a reply that paces the peer must not wait behind them)."""
    net = MemoryNetwork(window=MIB)
    async with open_rpc_host(SERVER, listen=Address("s", 1), network=net.interface("s")) as server:
        server.register_quick("ping", lambda request: Reply({"ok": True}))
        with trio.fail_after(30):
            peer = await _dial(net, "p", GOOD)
            await trio.testing.wait_all_tasks_blocked()
            async with trio.open_nursery() as uploads:
                for _ in range(8):  # never answered: the peer only reads
                    uploads.start_soon(server.call, Address("p", 9, GOOD.peer_id), "x", {}, LARGE)
                await trio.testing.wait_all_tasks_blocked()
                await peer.send_all(_requests("ping", 1))
                await trio.testing.wait_all_tasks_blocked()
                decoder = FrameDecoder()
                uploads_first = 0
                while True:
                    decoder.receive_data(await peer.receive_some(MIB))
                    while (frame := decoder.next_frame()) is not NEED_DATA:
                        assert isinstance(frame, bytes)
                        kind = decode_rpc_frame(frame).kind
                        if kind is FrameKind.RESPONSE:
                            break
                        uploads_first += 1
                    else:
                        continue
                    break
                # only what was already written or being written when the ping came
                assert uploads_first <= 2, uploads_first
                uploads.cancel_scope.cancel()
