"""The receive budget: large frames on their way in, over all connections together, take at
most ``HostConfig.receive_budget`` bytes; a frame that stalls while others wait is cut off.
A trial's bootstrap node held 2.6 GB for 600 connections that each announced a 4 MiB frame,
sent 2.2 MiB of it and went quiet, and kept it after they closed."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
import trio
import trio.testing
from secure_pairs import secure_pair

from peer.host import HostConfig, RpcHost, open_rpc_host
from peer.memnet import MemoryNetwork
from peer.receive_budget import ByteMeter, ReceiveBudget
from peer.rpc import Reply
from peer.secure import SecureStream, secure_handshake
from peer.wire import FRAME_POOL, FramePool, FrameReader
from protocol.address import Address
from protocol.errors import RemoteProtocolError
from protocol.framing import encode_frame_header
from protocol.identity import Identity
from protocol.noise.transport import LENGTH_PREFIX
from protocol.rpc import FrameKind, RpcFrame, decode_rpc_frame, encode_rpc_frame

SERVER = Identity.from_seed(b"s" * 32)
PEER = Identity.from_seed(b"p" * 32)
MIB = 1 << 20
CONTENT = bytes(range(256)) * (MIB // 256)


async def _secure_pair() -> tuple[SecureStream, SecureStream]:
    return await secure_pair(PEER, SERVER)


async def _read_one(stream: SecureStream, budget: ReceiveBudget) -> object:
    """One frame's bytes (None at the end of the stream), or the error that cut it off."""
    try:
        frame = await FrameReader(stream, 4 * MIB, FramePool(), budget).next_frame()
    except RemoteProtocolError as exc:
        return exc
    return None if frame is None else bytes(frame)


async def test_a_frame_waits_for_room_and_a_stalled_one_is_cut_off_to_make_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ReceiveBudget(limit=MIB + MIB // 2, stall_timeout=10.0)  # one frame
    stalling, stalled_side = await _secure_pair()
    honest, honest_side = await _secure_pair()
    pool = FramePool()
    outcomes: dict[str, object] = {}

    async def read(name: str, stream: SecureStream) -> None:
        reader = FrameReader(stream, 4 * MIB, pool, budget)
        try:
            frame = await reader.next_frame()
            outcomes[name] = None if frame is None else bytes(frame)
        except RemoteProtocolError as exc:
            outcomes[name] = exc

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, "stalled", stalled_side)
            await stalling.send_all(encode_frame_header(MIB) + CONTENT[: 600 << 10])
            await trio.testing.wait_all_tasks_blocked()
            assert budget.used == MIB
            nursery.start_soon(read, "honest", honest_side)
            start = trio.current_time()
            await honest.send_all(encode_frame_header(MIB) + CONTENT)
            await trio.testing.wait_all_tasks_blocked()
            assert not outcomes and budget.used == MIB  # it waits, unread
            assert pool.allocated == 1
    assert trio.current_time() - start == pytest.approx(10.0, abs=0.1)
    assert isinstance(outcomes["stalled"], RemoteProtocolError)
    assert "stalled" in str(outcomes["stalled"])
    assert outcomes["honest"] == CONTENT
    assert budget.used == 0 and budget.cut_off == 1


async def test_a_frame_that_keeps_arriving_is_not_cut_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Slow is not stalled: a frame that arrives at 32 KiB/s, in pieces smaller than a
    secure message (64 KiB: counted as they come, not once a message is whole), keeps its
    room, and the frame waiting behind it comes in after it."""
    budget = ReceiveBudget(limit=MIB, stall_timeout=10.0)
    slow, slow_side = await _secure_pair()
    other, other_side = await _secure_pair()
    got: list[bytes] = []

    async def read(stream: SecureStream) -> None:
        frame = await FrameReader(stream, 4 * MIB, FramePool(), budget).next_frame()
        assert frame is not None
        got.append(bytes(frame))

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, slow_side)
            await slow.send_all(encode_frame_header(MIB) + CONTENT[: MIB // 2])
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(read, other_side)
            await other.send_all(encode_frame_header(MIB) + CONTENT)
            for offset in range(MIB // 2, MIB, 256 << 10):  # 32 KiB/s, in pieces
                for piece in range(offset, offset + (256 << 10), 4 << 10):
                    await trio.sleep(0.125)
                    await slow.send_all(CONTENT[piece : piece + (4 << 10)])
    assert got == [CONTENT, CONTENT] and budget.cut_off == 0 and budget.used == 0


async def test_a_frame_larger_than_the_budget_comes_in_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ReceiveBudget(limit=MIB // 2, stall_timeout=10.0)
    sender, receiver = await _secure_pair()
    with trio.fail_after(10):
        await sender.send_all(encode_frame_header(MIB) + CONTENT)
        frame = await FrameReader(receiver, 4 * MIB, FramePool(), budget).next_frame()
    assert frame is not None and frame == CONTENT and budget.used == 0


async def _honest_frame_behind(
    budget: ReceiveBudget,
    slow_sender: Callable[[SecureStream], Awaitable[None]],
    head_start: float | None = None,
) -> tuple[object, object, float]:
    """A slow frame (sent by ``slow_sender``) takes room first (after ``head_start``
    seconds; None: once everything is blocked); then an honest 1 MiB frame comes. Returns
    what reading each gave (bytes, or the error that cut it off) and how long the honest
    one took."""
    slow, slow_side = await _secure_pair()
    honest, honest_side = await _secure_pair()
    outcomes: dict[str, object] = {}
    honest_read = trio.Event()

    async def read(name: str, stream: SecureStream) -> None:
        outcomes[name] = await _read_one(stream, budget)
        if name == "honest":
            honest_read.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, "slow", slow_side)
        nursery.start_soon(slow_sender, slow)
        if head_start is None:
            await trio.testing.wait_all_tasks_blocked()
        else:
            await trio.sleep(head_start)
        nursery.start_soon(read, "honest", honest_side)
        start = trio.current_time()
        await honest.send_all(encode_frame_header(MIB) + CONTENT)
        await honest_read.wait()
        nursery.cancel_scope.cancel()
    return outcomes["slow"], outcomes["honest"], trio.current_time() - start


async def test_a_frame_that_trickles_in_is_cut_off_when_another_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A byte every 9 s kept a frame's room forever (a reviewer): under MIN_RATE on average
    once stall_timeout old, it counts as stalled."""
    budget = ReceiveBudget(limit=MIB, stall_timeout=10.0)

    async def trickle(stream: SecureStream) -> None:
        await stream.send_all(encode_frame_header(MIB))
        for _ in range(100):
            await trio.sleep(9)
            await stream.send_all(b"\0")

    with trio.fail_after(60):
        trickled, honest, _ = await _honest_frame_behind(budget, trickle)
    assert isinstance(trickled, RemoteProtocolError)
    assert honest == CONTENT and trio.current_time() < 12


async def test_a_frame_too_slow_to_finish_soon_is_cut_off_when_another_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two peers that trickled a 4 MiB frame each at 24 KiB/s, above MIN_RATE, held a
    bootstrap node's whole 8 MiB receive budget for ~3 minutes, and every larger store
    waited (an outside tester). Once stall_timeout old, a frame whose rest would take more
    than FINISH_WITHIN stall timeouts at its average rate counts as stalled."""
    budget = ReceiveBudget(limit=4 * MIB, stall_timeout=10.0)

    async def trickle(stream: SecureStream) -> None:  # 24 KiB/s, in 6 KiB pieces
        await stream.send_all(encode_frame_header(4 * MIB))
        for _ in range(4 * MIB // (6 << 10)):
            await trio.sleep(0.25)
            await stream.send_all(CONTENT[: 6 << 10])

    with trio.fail_after(120):
        slow, honest, waited = await _honest_frame_behind(budget, trickle, head_start=1)
    assert isinstance(slow, RemoteProtocolError)
    assert honest == CONTENT
    assert waited == pytest.approx(9.0, abs=0.5)  # 10 s after the slow one began
    assert budget.cut_off == 1


async def test_one_remote_host_holds_at_most_its_share(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Frames from one host take at most ``host_limit`` of the budget (but one frame always
    fits): another host's frame does not wait behind them."""
    budget = ReceiveBudget(limit=8 * MIB, stall_timeout=10.0, host_limit=2 * MIB)
    with trio.fail_after(10):
        first = await budget.acquire(2 * MIB, "203.0.113.7", ByteMeter())
        with trio.move_on_after(5) as waited:  # its second frame waits for its share
            await budget.acquire(MIB, "203.0.113.7", ByteMeter())
        assert waited.cancelled_caught
        other = await budget.acquire(2 * MIB, "198.51.100.1", ByteMeter())  # at once
        big = await budget.acquire(3 * MIB, "192.0.2.9", ByteMeter())  # one frame always fits
        assert budget.used == 7 * MIB
        for hold in (first, other, big):
            budget.release(hold)
    assert budget.used == 0


async def test_a_connection_waiting_for_room_is_neither_silent_nor_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """While our reader waits for room, the peer's replies queue behind the frame we have
    not read: calls to it went unanswered and the connection was aborted as silent after
    10 s (a reviewer), which is not the peer's doing. (Nor is it closed as idle while it
    waits: our keepalives go out on it; a parked connection ends once its frame gets room
    and stalls.)"""
    net = MemoryNetwork()
    config = HostConfig(receive_budget=MIB, idle_timeout=30.0, silence_timeout=5.0)
    holder = Identity.from_seed(b"h" * 32)
    async with (
        _server(net, config) as server,
        _host(net, PEER, "p", config) as peer,
    ):
        server.register("echo", lambda request: _echo(request))
        peer.register("ping", lambda request: _pong(request))
        with trio.fail_after(120):
            hog = await _dial(net, "h", holder)
            content = bytes(MIB - 64)
            await hog.send_all(encode_frame_header(MIB) + content[: MIB // 2])

            async def feed() -> None:  # 20 KiB/s: slow, not stalled: it keeps the room
                for offset in range(MIB // 2, len(content), 20 << 10):
                    await trio.sleep(1)
                    await hog.send_all(content[offset : offset + (20 << 10)])

            answered: list[float] = []
            done = trio.Event()

            async def honest_call() -> None:
                await peer.call(Address("s", 1, SERVER.peer_id), "echo", {}, bytes(MIB // 2))
                answered.append(trio.current_time())
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(feed)
                await trio.testing.wait_all_tasks_blocked()
                start = trio.current_time()
                nursery.start_soon(honest_call)
                heard: list[bool] = []
                for _ in range(8):  # the server calls the waiting peer meanwhile
                    await trio.sleep(5)
                    with trio.move_on_after(2):
                        await server.call(Address("p", 1, PEER.peer_id), "ping")
                    # (what the averager asks before it takes a peer for frozen)
                    heard.append(server.last_heard(PEER.peer_id) == trio.current_time())
                await done.wait()
                assert heard[:3] == [True] * 3, heard  # parked by us: heard "now"
                nursery.cancel_scope.cancel()
    assert answered[0] - start > 20  # it waited for the slow frame, and was not cut off


async def _echo(request: object) -> Reply:
    return Reply({})


async def _pong(request: object) -> Reply:
    return Reply({"ok": True})


async def test_an_abandoned_frame_leaves_no_buffer_behind_with_the_closed_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The closed connection keeps why it closed: that error's traceback held the frame's
    buffer (a trial's node: 155 MiB after 60 such connections had gone)."""
    net = MemoryNetwork()
    config = HostConfig(receive_budget=8 * MIB)
    async with _server(net, config) as host:
        with trio.fail_after(30):
            attacker = await _dial(net, "p", PEER)
            await attacker.send_all(encode_frame_header(MIB) + CONTENT[: 600 << 10])
            await trio.testing.wait_all_tasks_blocked()
            in_use = _pooled_in_use()
            assert in_use >= MIB
            await attacker.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert _pooled_in_use() == in_use - MIB
            assert host._receive_budget.used == 0


def _pooled_in_use() -> int:
    """Bytes of the process's frame buffers that something still refers to."""
    return sum(
        size
        for size, buffers in FRAME_POOL._classes.items()
        for buffer in buffers
        if sys.getrefcount(buffer) > 3  # the list, the loop variable, getrefcount's argument
    )


async def test_a_slow_frame_on_an_otherwise_idle_connection_is_not_closed_midway(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The idle timer counted frames only: a 1 MiB request arriving at 20 KiB/s (50 s) on a
    connection with an idle timeout of 20 s was closed midway (a reviewer: any 4 MiB frame
    slower than ~70 KiB/s, with the default 60 s)."""
    net = MemoryNetwork()
    config = HostConfig(idle_timeout=20.0)
    async with _server(net, config) as server:
        server.register("echo", _echo)
        with trio.fail_after(120):
            client = await _dial(net, "p", PEER)
            request = RpcFrame(FrameKind.REQUEST, 1, method="echo", payload=bytes(MIB))
            data = b"".join(bytes(piece) for piece in encode_rpc_frame(request))
            for offset in range(0, len(data), 20 << 10):  # 20 KiB/s
                await client.send_all(data[offset : offset + (20 << 10)])
                await trio.sleep(1)
            reply = decode_rpc_frame(await FrameReader(client, 4 * MIB).next_frame() or b"")
    assert reply.kind is FrameKind.RESPONSE and reply.request_id == 1


async def test_a_frame_waiting_for_its_hosts_share_cuts_off_no_other_hosts_frame(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A frame blocked only by its own host's share cut off another host's frame that had
    paused (a reviewer): that frees nothing it can use."""
    budget = ReceiveBudget(limit=8 * MIB, stall_timeout=10.0, host_limit=2 * MIB)
    paused = ByteMeter()
    with trio.fail_after(60):
        other = await budget.acquire(MIB, "198.51.100.1", paused)  # gets nothing for 30 s
        mine = await budget.acquire(2 * MIB, "203.0.113.7", ByteMeter())
        with trio.move_on_after(30):  # waits for its host's share, and nothing else
            await budget.acquire(MIB, "203.0.113.7", ByteMeter())
        # its own host's stalled frame is cut off (it frees what the waiter can use)
        assert not other.scope.cancel_called and mine.scope.cancel_called
        budget.release(mine)
        budget.release(other)


async def test_frames_get_room_in_the_order_they_asked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A large frame is not starved by smaller ones that keep coming after it."""
    budget = ReceiveBudget(limit=4 * MIB, stall_timeout=100.0)
    order: list[str] = []
    with trio.fail_after(60):
        first = await budget.acquire(3 * MIB, None, ByteMeter())

        async def ask(name: str, size: int) -> None:
            hold = await budget.acquire(size, None, ByteMeter())
            order.append(name)
            await trio.sleep(1)
            budget.release(hold)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "large", 4 * MIB)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, "small", MIB)  # would fit now, but asked later
            await trio.testing.wait_all_tasks_blocked()
            assert not order
            budget.release(first)
    assert order == ["large", "small"]


async def test_a_frame_trickling_in_does_not_keep_its_connection_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Bytes of a frame count as use only at 16 KiB/s or more: a header and then a byte
    every 15 s would otherwise hold a connection open forever (idle timeout 20 s)."""
    net = MemoryNetwork()
    async with open_rpc_host(
        SERVER,
        listen=Address("s", 1),
        network=net.interface("s"),
        config=HostConfig(idle_timeout=20.0),
    ) as server:
        with trio.fail_after(300):
            client = await _dial(net, "p", PEER)
            await client.send_all(encode_frame_header(1000))
            await trio.testing.wait_all_tasks_blocked()
            assert server.num_connections == 1
            start = trio.current_time()
            for _ in range(20):
                await trio.sleep(15)
                with contextlib.suppress(trio.BrokenResourceError):
                    await client.send_all(b"\0")
                await trio.testing.wait_all_tasks_blocked()
                if not server.num_connections:
                    break
            assert not server.num_connections and trio.current_time() - start <= 45


async def test_the_next_waiting_frame_cuts_off_stalled_frames_when_the_first_leaves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only the first frame waiting for the total cuts off stalled ones; when it left (its
    connection closed), the next slept on and nothing was cut off again (a reviewer)."""
    budget = ReceiveBudget(limit=8 * MIB, stall_timeout=10.0)
    with trio.fail_after(60):
        stalled = [await budget.acquire(4 * MIB, None, ByteMeter()) for _ in range(2)]
        first = trio.CancelScope()
        granted = trio.Event()

        async def wait_first() -> None:
            with first:
                await budget.acquire(4 * MIB, None, ByteMeter())

        async def wait_next() -> None:
            budget.release(await budget.acquire(4 * MIB, None, ByteMeter()))
            granted.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(wait_next)
            await trio.sleep(5)
            first.cancel()  # its connection is gone
            await trio.sleep(6)
            assert all(hold.scope.cancel_called for hold in stalled)
            for hold in stalled:  # (their readers would, cut off)
                budget.release(hold)
            await granted.wait()


async def test_empty_secure_messages_are_no_progress_of_a_frame(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A header, then only empty Noise messages (18 bytes, no data) at 27 KiB/s: counted
    as ciphertext, they passed for progress, and the frame kept its room and its
    connection forever (a reviewer). More than 16 empty messages in a row are a protocol
    violation now (session 52): the connection ends at the 17th, before the receive
    budget's stall rule (which cut it off for the frame waiting behind it) comes to it."""
    net = MemoryNetwork()
    config = HostConfig(receive_budget=4 * MIB)
    async with _server(net, config) as server:
        with trio.fail_after(120):
            attacker = await _dial(net, "a", PEER)
            await attacker.send_all(encode_frame_header(4 * MIB) + bytes(100))
            cut = trio.Event()

            async def pad() -> None:
                with contextlib.suppress(trio.BrokenResourceError):
                    while True:
                        await attacker.transport_stream.send_all(_empty_messages(attacker, 1500))
                        await trio.sleep(1)
                cut.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pad)
                honest = await _dial(net, "h", Identity.from_seed(b"o" * 32))
                await honest.send_all(encode_frame_header(4 * MIB))
                with trio.fail_after(5):
                    await cut.wait()
                assert server.num_connections == 1  # the honest one, still waiting for room
                nursery.cancel_scope.cancel()


def _empty_messages(stream: SecureStream, count: int) -> bytes:
    """``count`` empty transport messages, sealed by hand: the API sends none (they are
    valid, and a peer may send them)."""
    transport = stream._transport
    out = []
    for _ in range(count):
        sealed = transport._seal_aead.encrypt(transport._seal_nonce(transport._seal_n), b"", None)
        transport._seal_n += 1
        out.append(LENGTH_PREFIX.pack(len(sealed)) + sealed)
    return b"".join(out)


async def test_a_frame_is_charged_the_buffer_it_takes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Pooled buffers are whole multiples of 64 KiB: frames of 64 KiB + 1 byte were charged
    their length and took twice that, so headers alone held twice the budget (a reviewer)."""
    budget = ReceiveBudget(limit=MIB, stall_timeout=10.0)
    sender, receiver = await _secure_pair()
    with trio.fail_after(10):
        await sender.send_all(encode_frame_header((64 << 10) + 1))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(FrameReader(receiver, 4 * MIB, FramePool(), budget).next_frame)
            await trio.testing.wait_all_tasks_blocked()
            assert budget.used == 128 << 10
            nursery.cancel_scope.cancel()


def _host(
    net: MemoryNetwork, identity: Identity, host: str, config: HostConfig
) -> AbstractAsyncContextManager[RpcHost]:
    return open_rpc_host(
        identity, listen=Address(host, 1), network=net.interface(host), config=config
    )


def _server(net: MemoryNetwork, config: HostConfig) -> AbstractAsyncContextManager[RpcHost]:
    """The host under test, at s:1."""
    return _host(net, SERVER, "s", config)


async def _dial(net: MemoryNetwork, host: str, identity: Identity) -> SecureStream:
    """A secure connection to the server from ``host``, by hand (as a hostile peer would)."""
    raw = await net.interface(host).connect("s", 1)
    return await secure_handshake(raw, identity, initiator=True)


async def test_a_peer_whose_frame_waits_for_the_budget_hears_keepalives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Another host's 2 MiB frame trickles in at 32 KiB/s (not stalled: above MIN_RATE) and
    holds the whole budget for a minute; an honest peer's 1 MiB upload waits its turn,
    unread, while its pings go unanswered. Without a sign of life the peer took us for
    gone after its silence timeout and the upload failed (a review); a keepalive goes out
    every 2.5 s while the frame waits."""
    mib = 1 << 20
    net = MemoryNetwork(window=mib)
    with trio.fail_after(300):
        async with contextlib.AsyncExitStack() as stack:
            server = await stack.enter_async_context(
                open_rpc_host(
                    Identity.from_seed(b"s" * 32),
                    listen=Address("s", 1),
                    network=net.interface("s"),
                    config=HostConfig(receive_budget=2 * mib),
                )
            )
            server.register_quick("ping", lambda request: Reply({"ok": True}))

            async def upload(request: Any) -> Reply:
                return Reply({"n": len(request.payload)})

            server.register("upload", upload)
            address = server.listen_address
            assert address is not None
            honest = await stack.enter_async_context(
                open_rpc_host(
                    Identity.from_seed(b"h" * 32), listen=None, network=net.interface("honest")
                )
            )
            await honest.call(address, "ping")
            raw = await net.interface("slow").connect("s", 1)
            slow = await secure_handshake(raw, Identity.from_seed(b"x" * 32), initiator=True)
            size = 2 * mib - 100
            await slow.send_all(encode_frame_header(size))

            async def trickle() -> None:
                for sent in range(0, size, 16 << 10):
                    await slow.send_all(bytes(min(16 << 10, size - sent)))
                    await trio.sleep(0.5)

            async def pings() -> None:
                for _ in range(15):  # as the DHT and averagers do: 2 s deadlines
                    with trio.move_on_after(2):
                        await honest.call(address, "ping")
                    await trio.sleep(0.1)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trickle)
                await trio.sleep(1)
                nursery.start_soon(pings)
                reply = await honest.call(address, "upload", {}, bytes(mib))
                assert reply.body == {"n": mib}
                nursery.cancel_scope.cancel()
