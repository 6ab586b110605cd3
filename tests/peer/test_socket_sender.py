"""``partial_sender`` on a TCP socket: it writes as much as the kernel takes at once and
reports exactly what went out, is cancelled only while it has sent nothing, and turns
socket errors into trio's stream errors."""

from __future__ import annotations

import array
import socket
import struct

import pytest
import trio

from peer.network import PartialSender, partial_sender


async def _tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listeners[0]:
        port = listeners[0].socket.getsockname()[1]
        a = await trio.open_tcp_stream("127.0.0.1", port)
        b = await listeners[0].accept()
    return a, b


async def _sender_pair(
    sndbuf: int = 0,
) -> tuple[trio.SocketStream, trio.SocketStream, PartialSender]:
    """A TCP pair and the first end's sender (``sndbuf``: a small send buffer, so that the
    kernel takes large writes a part at a time)."""
    a, b = await _tcp_pair()
    if sndbuf:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    send_some = partial_sender(a)
    assert send_some is not None
    return a, b, send_some


async def _read_into(stream: trio.SocketStream, received: bytearray, pause: float = 0) -> None:
    """Read ``stream`` to its end into ``received`` (``pause`` s after each read)."""
    while chunk := await stream.receive_some(1 << 16):
        received.extend(chunk)
        if pause:
            await trio.sleep(pause)


async def test_every_byte_it_reports_reaches_the_peer_in_order() -> None:
    """Calls cut short by deadlines while the peer reads slowly: what the calls returned,
    put together, is exactly what the peer reads."""
    data = bytes(range(256)) * (16 << 12)  # 16 MiB
    with trio.fail_after(60):
        a, b, send_some = await _sender_pair(sndbuf=1 << 16)
        received = bytearray()
        sent, cut = 0, 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_read_into, b, received, 0.0005)
            view = memoryview(data)
            while sent < len(data):
                with trio.move_on_after(0.001) as scope:
                    sent += await send_some(view[sent:])
                cut += scope.cancelled_caught
            await a.aclose()
        assert cut, "no call was cancelled while waiting"
        assert received == data
        await b.aclose()


async def test_a_closed_socket_is_a_closed_resource() -> None:
    with trio.fail_after(10):
        a, b, send_some = await _sender_pair()
        await a.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await send_some(memoryview(b"x"))
        await b.aclose()


async def test_a_reset_connection_is_a_broken_resource() -> None:
    with trio.fail_after(10):
        a, b, send_some = await _sender_pair()
        b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await b.aclose()  # a reset, not a clean end
        with pytest.raises(trio.BrokenResourceError):
            for _ in range(100):  # the first write may go out before the reset is seen
                await send_some(memoryview(b"x" * 65536))
                await trio.sleep(0.01)
        await a.aclose()


async def test_a_call_cancelled_before_it_starts_sends_nothing() -> None:
    with trio.fail_after(10):
        a, b, send_some = await _sender_pair()
        with trio.CancelScope() as scope:
            scope.cancel()
            await send_some(memoryview(b"lost"))
        assert scope.cancelled_caught
        await send_some(memoryview(b"kept"))
        await a.aclose()
        got = bytearray()
        await _read_into(b, got)
        assert got == b"kept"
        await b.aclose()


async def test_bytes_and_views_of_wider_items_are_sent_from_the_right_byte() -> None:
    """What ``send_some`` returns counts bytes, whatever the buffer: ``bytes``, and a view
    of float32 items the kernel takes only part of (a slice of items resent the wrong bytes,
    a review's reproduction)."""
    values = array.array("f", range(1 << 20))  # 4 MiB of float32
    expected = values.tobytes()
    with trio.fail_after(60):
        a, b, send_some = await _sender_pair(sndbuf=1 << 16)
        received = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_read_into, b, received)
            assert await send_some(b"head") == 4  # type: ignore[arg-type]
            sent = await send_some(memoryview(values))  # bytes, of a view of 4-byte items
            rest = memoryview(values).cast("B")
            while sent < len(expected):
                sent += await send_some(rest[sent:])
            await a.aclose()
        assert received == b"head" + expected
        await b.aclose()
