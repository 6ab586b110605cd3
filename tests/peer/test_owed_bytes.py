"""A write cancelled midway keeps the connection: the secure stream keeps the sealed bytes
it did not send and sends them first next time, so the peer reads every byte in order.

Before, a call cancelled while its own task wrote its (small) request to a congested
stream ended the connection for every other call on it: the frame's sealed bytes had
consumed their Noise nonces and could be neither dropped nor resent.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from test_rpc import two_hosts
from test_rpc_cancellation import assert_settled, echo

from peer.memnet import MemoryNetwork, MemoryStream
from peer.network import partial_sender
from peer.rpc import Reply, Request
from peer.secure import SecureStream, secure_handshake
from protocol.identity import Identity

WINDOW = 1 << 16


async def _secure_pair(
    raw_a: trio.abc.Stream, raw_b: trio.abc.Stream
) -> tuple[SecureStream, SecureStream]:
    ids = Identity.generate(), Identity.generate()
    streams: list[SecureStream] = [None, None]  # type: ignore[list-item]

    async def side(index: int, raw: trio.abc.Stream) -> None:
        streams[index] = await secure_handshake(raw, ids[index], initiator=index == 0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, 0, raw_a)
        nursery.start_soon(side, 1, raw_b)
    return streams[0], streams[1]


@asynccontextmanager
async def _memnet_secure_pair() -> AsyncIterator[tuple[SecureStream, SecureStream]]:
    """Two ends of a secure connection on a memory network whose window is ``WINDOW``."""
    net = MemoryNetwork(window=WINDOW)
    async with trio.open_nursery() as nursery:
        accepted: list[trio.abc.Stream] = []

        async def keep(stream: trio.abc.Stream) -> None:
            accepted.append(stream)
            await trio.sleep_forever()

        port = await nursery.start(net.serve, "b", 0, keep)
        raw_a = await net.connect("b", port)
        await trio.testing.wait_all_tasks_blocked()
        yield await _secure_pair(raw_a, accepted[0])
        nursery.cancel_scope.cancel()


async def _read_exactly(stream: SecureStream, size: int) -> bytes:
    got = bytearray()
    while len(got) < size:
        data = await stream.receive_some()
        assert data, f"end of stream after {len(got)} of {size} bytes"
        got += data
    return bytes(got)


async def test_a_cancelled_memnet_write_is_sent_first_at_the_next_send(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(30):
        async with _memnet_secure_pair() as (a, b):
            first, cut, last = b"1" * 70_000, b"2" * 40_000, b"3" * 10
            await a.send_all(first)  # fills the window: b reads nothing yet
            with trio.move_on_after(1) as scope:
                await a.send_all(cut)
            assert scope.cancelled_caught
            assert a.intact
            received = await _read_exactly(b, len(first))
            await a.send_all(last)
            received += await _read_exactly(b, len(cut) + len(last))
            assert received == first + cut + last


async def test_a_cancelled_tcp_write_is_sent_first_at_the_next_send() -> None:
    """Real sockets: a write cancelled while the kernel's buffers are full (the peer
    does not read) went out partly; the rest follows at the next send."""
    block = 1 << 20
    with trio.fail_after(60):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with listeners[0]:
            port = listeners[0].socket.getsockname()[1]
            raw_a = await trio.open_tcp_stream("127.0.0.1", port)
            raw_b = await listeners[0].accept()
            raw_a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
            assert partial_sender(raw_a) is not None
            a, b = await _secure_pair(raw_a, raw_b)
            sent: list[bytes] = []
            cancelled = False
            for n in range(64):  # at most 64 MiB before the kernel's buffers are full
                data = bytes([n]) * block
                sent.append(data)
                with trio.move_on_after(0.5) as scope:
                    await a.send_all(data)
                if scope.cancelled_caught:
                    cancelled = True
                    break
            assert cancelled, "the peer's buffers never filled"
            assert a.intact
            total = sum(map(len, sent))

            async def read_all(into: bytearray) -> None:
                into += await _read_exactly(b, total + 5)

            received = bytearray()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all, received)
                await a.send_all(b"after")
            assert bytes(received) == b"".join(sent) + b"after"
            await a.aclose()
            await b.aclose()


async def test_a_send_cut_off_before_all_was_sealed_tears_the_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Several slices (more than one write): cancelled between them, part of the data was
    never sealed, so nothing more may go out (the peer would read a broken frame)."""
    with trio.fail_after(30):
        async with _memnet_secure_pair() as (a, _):
            with trio.move_on_after(1) as scope:
                await a.send_all(bytes(3 << 20))  # three 1 MiB writes; the window is 64 KiB
            assert scope.cancelled_caught
            assert not a.intact
            with pytest.raises(trio.BrokenResourceError, match="cut off"):
                await a.send_all(b"more")


async def test_a_call_cancelled_during_its_direct_write_keeps_the_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Small calls are written by their own task when the stream is idle. One cancelled
    while that write waits on a full window (the callee's host froze) must cost only
    itself: the other calls on the connection are answered once the callee thaws, the
    callee gets the whole request (then the cancel), and the connection is not redialled."""
    net = MemoryNetwork(latency=0.01, window=WINDOW)
    async with two_hosts(net) as (a, b, address):
        seen: list[int] = []

        async def record(request):  # type: ignore[no-untyped-def]
            seen.append(len(request.payload))
            return Reply({}, b"")

        b.register("echo", echo)
        b.register("record", record)
        with trio.fail_after(60):
            await a.call(address, "echo", {})
            opened = a.connections_opened
            connection = next(iter(a._connections))
            net.freeze_host("10.0.0.2")
            replies: list[Reply] = []

            async def call(size: int) -> None:
                replies.append(await a.call(address, "record", {}, bytes(size)))

            async with trio.open_nursery() as nursery:
                for _ in range(3):  # 3 x 24 KiB direct writes fill the 64 KiB window
                    nursery.start_soon(call, 24_000)
                    await trio.testing.wait_all_tasks_blocked()
                with trio.move_on_after(1) as scope:
                    await a.call(address, "record", {}, bytes(20_000))
                assert scope.cancelled_caught
                assert connection.write_started is None  # not still writing
                assert not connection.closed
                net.unfreeze_host("10.0.0.2")
            assert len(replies) == 3
            assert seen.count(24_000) == 3, seen  # (the cancelled one may have run too)
            await a.call(address, "echo", {})
            assert a.connections_opened == opened, "a connection was closed and dialled again"
            await trio.sleep(1)
            assert_settled(a, b)


def test_a_wrapper_forwarding_attributes_does_not_lend_its_inner_streams_send_some() -> None:
    """A rate-limiting wrapper that forwards unknown attributes to the stream it wraps
    would be bypassed if the secure stream wrote through the inner ``send_some``."""

    class Forwarding(trio.abc.Stream):
        def __init__(self, inner: trio.abc.Stream) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        async def send_all(self, data: bytes | bytearray | memoryview) -> None:
            await self.inner.send_all(data)

        async def wait_send_all_might_not_block(self) -> None:
            await self.inner.wait_send_all_might_not_block()

        async def receive_some(self, max_bytes: int | None = None) -> bytes:
            return await self.inner.receive_some(max_bytes)

        async def aclose(self) -> None:
            await self.inner.aclose()

    inner = MemoryStream.__new__(MemoryStream)  # the class is what matters
    assert partial_sender(inner) is not None
    assert partial_sender(Forwarding(inner)) is None


async def test_a_call_cancelled_during_its_direct_write_cancels_the_callees_handler(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A call cancelled while its own task wrote its request to a full window: the
    request still reaches the callee (the secure stream sends what it owed), so the callee
    must get the cancel too. Without it, a handler with no deadline (the caller's scope
    was cancelled, not timed out) ran on for nothing: an endless one held its task and an
    in-flight slot for as long as the connection lived."""
    net = MemoryNetwork(latency=0.01, window=WINDOW)
    async with two_hosts(net) as (a, b, address):
        started = trio.Event()
        ended: list[float] = []

        async def record(request: Request) -> Reply:
            return Reply({}, b"")

        async def hang(request: Request) -> Reply:
            started.set()
            try:
                await trio.sleep_forever()
            finally:
                ended.append(trio.current_time())
            raise AssertionError("unreachable")

        b.register("echo", echo)
        b.register("record", record)
        b.register("hang", hang)
        with trio.fail_after(60):
            await a.call(address, "echo", {})
            opened = a.connections_opened
            net.freeze_host("10.0.0.2")
            async with trio.open_nursery() as nursery:
                for _ in range(3):  # 3 x 24 KiB direct writes fill the 64 KiB window
                    nursery.start_soon(a.call, address, "record", {}, bytes(24_000))
                    await trio.testing.wait_all_tasks_blocked()
                with trio.CancelScope() as scope:  # no deadline: the callee gets none

                    async def cancel_soon() -> None:
                        await trio.sleep(1)
                        scope.cancel()

                    nursery.start_soon(cancel_soon)
                    await a.call(address, "hang", {}, bytes(20_000))
                assert scope.cancelled_caught
                net.unfreeze_host("10.0.0.2")
            await started.wait()  # the request did go out
            await trio.sleep(1)
            assert ended, "the callee's handler of a cancelled call still runs"
            assert a.connections_opened == opened
            assert_settled(a, b)
