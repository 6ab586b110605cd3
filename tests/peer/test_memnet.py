"""The in-memory network: delivery, latency on virtual time, partitions, crashes, stalls."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from peer.memnet import MemoryNetwork, MemoryStream
from peer.network import Network, remote_host_of


async def _echo(stream: trio.abc.Stream) -> None:
    async with stream:
        while data := await stream.receive_some():
            await stream.send_all(data)


async def _receive_exactly(stream: trio.abc.Stream, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = await stream.receive_some(n - len(out))
        assert chunk, "unexpected EOF"
        out += chunk
    return bytes(out)


async def test_memory_network_is_a_network() -> None:
    net = MemoryNetwork()
    assert isinstance(net, Network)
    assert isinstance(net.interface("10.0.0.1"), Network)


async def test_echo_roundtrip_with_latency(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork(latency=0.25)
    server, client = net.interface("10.0.0.1"), net.interface("10.0.0.2")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "10.0.0.1", 0, _echo)
            stream = await client.connect("10.0.0.1", port)
            assert isinstance(stream, MemoryStream)
            assert remote_host_of(stream) == "10.0.0.1"
            start = trio.current_time()
            await stream.send_all(b"hello ")
            await stream.send_all(b"world")
            assert await _receive_exactly(stream, 11) == b"hello world"
            assert trio.current_time() - start == pytest.approx(0.5)
            # partial reads keep the rest
            await stream.send_all(b"abcdef")
            assert await stream.receive_some(2) == b"ab"
            assert await _receive_exactly(stream, 4) == b"cdef"
            await stream.send_eof()
            assert await stream.receive_some() == b""
            await stream.aclose()
            nursery.cancel_scope.cancel()
    assert net.bytes_sent == 2 * 17
    assert net.bytes_sent_by["10.0.0.2"] == 17
    assert net.connections_opened == 1


async def test_set_latency_keeps_order(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork(latency=1.0)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(net.serve, "s", 0, _echo)
        stream = await net.connect("s", port)
        await stream.send_all(b"slow")
        net.set_latency(0.0)
        await stream.send_all(b"fast")
        with trio.fail_after(5):
            assert await _receive_exactly(stream, 8) == b"slowfast"
        nursery.cancel_scope.cancel()


async def test_connect_refused() -> None:
    net = MemoryNetwork()
    with pytest.raises(ConnectionRefusedError):
        await net.interface("a").connect("b", 1)
    assert net.connections_refused == 1


async def test_serve_errors() -> None:
    net = MemoryNetwork()
    iface = net.interface("a")
    async with trio.open_nursery() as nursery:
        await nursery.start(iface.serve, "0.0.0.0", 5000, _echo)
        with pytest.raises(OSError):
            await iface.serve("a", 5000, _echo)
        with pytest.raises(OSError):
            await iface.serve("b", 5001, _echo)
        nursery.cancel_scope.cancel()


async def test_partition_breaks_streams_and_refuses(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork(latency=0.1)
    a, b, c = (net.interface(h) for h in "abc")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(a.serve, "a", 0, _echo)
            from_b = await b.connect("a", port)
            from_c = await c.connect("a", port)
            assert net.open_connections == 2
            got: list[type[BaseException]] = []

            async def reader() -> None:
                with pytest.raises(trio.BrokenResourceError) as info:
                    await from_b.receive_some()
                assert isinstance(info.value.__cause__, ConnectionResetError)
                got.append(type(info.value))

            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            net.partition(["a"], ["b"])
            await trio.testing.wait_all_tasks_blocked()
            assert got == [trio.BrokenResourceError]
            with pytest.raises(trio.BrokenResourceError):
                await from_b.send_all(b"x")
            with pytest.raises(ConnectionRefusedError):
                await b.connect("a", port)
            # c is in no group: unaffected
            await from_c.send_all(b"ok")
            assert await _receive_exactly(from_c, 2) == b"ok"
            net.heal()
            again = await b.connect("a", port)
            await again.send_all(b"back")
            assert await _receive_exactly(again, 4) == b"back"
            nursery.cancel_scope.cancel()


async def test_kill_host(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork()
    a, b = net.interface("a"), net.interface("b")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(a.serve, "a", 0, _echo)
            stream = await b.connect("a", port)
            net.kill_host("a")
            with pytest.raises(trio.BrokenResourceError):
                await stream.receive_some()
            with pytest.raises(ConnectionRefusedError):
                await b.connect("a", port)
            with pytest.raises(OSError):
                await a.connect("b", 1)
            net.revive_host("a")
            port2 = await nursery.start(a.serve, "a", port, _echo)
            assert port2 == port
            stream = await b.connect("a", port)
            await stream.send_all(b"hi")
            assert await _receive_exactly(stream, 2) == b"hi"
            nursery.cancel_scope.cancel()


async def test_drop_connections_resets_streams_and_lets_new_dials_through(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    a, b, c = net.interface("a"), net.interface("b"), net.interface("c")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(a.serve, "a", 0, _echo)
            from_b, from_c = await b.connect("a", port), await c.connect("a", port)
            assert net.drop_connections("a", "b") == 1  # only a's connection with b
            with pytest.raises(trio.BrokenResourceError):
                await from_b.receive_some()
            await from_c.send_all(b"c")
            assert await _receive_exactly(from_c, 1) == b"c"
            assert net.drop_connections("a") == 1  # every one of a's (c's is left)
            with pytest.raises(trio.BrokenResourceError):
                await from_c.send_all(b"c")
            again = await b.connect("a", port)  # a new dial goes through
            await again.send_all(b"hi")
            assert await _receive_exactly(again, 2) == b"hi"
            nursery.cancel_scope.cancel()


async def test_freeze_stalls_delivery(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork(latency=0.1)
    a, b = net.interface("a"), net.interface("b")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(a.serve, "a", 0, _echo)
        stream = await b.connect("a", port)
        net.freeze_host("a")
        await stream.send_all(b"ping")
        with trio.move_on_after(100) as scope:
            await stream.receive_some()
        assert scope.cancelled_caught
        # connecting to a frozen host hangs too
        with trio.move_on_after(5) as scope:
            await b.connect("a", port)
        assert scope.cancelled_caught
        net.unfreeze_host("a")
        with trio.fail_after(1):
            assert await _receive_exactly(stream, 4) == b"ping"
        nursery.cancel_scope.cancel()


async def test_window_stalls_a_writer_until_the_reader_reads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With a window, unread bytes pile up to it and then ``send_all`` waits (a peer that
    stops reading stalls its writer); reading wakes the writer, and so does the reader
    closing its end (the writer's stream is broken then)."""
    net = MemoryNetwork(window=100)
    accepted: list[trio.abc.Stream] = []
    failed: list[BaseException] = []

    async def keep(stream: trio.abc.Stream) -> None:
        accepted.append(stream)

    async def send(data: bytes) -> None:
        try:
            await stream.send_all(data)
        except trio.BrokenResourceError as exc:
            failed.append(exc)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(net.serve, "s", 0, keep)
        stream = await net.connect("s", port)
        await trio.testing.wait_all_tasks_blocked()
        reader = accepted[0]
        await stream.send_all(bytes(150))  # queued whole: fewer than 100 were unread
        with trio.move_on_after(100) as scope:
            await stream.send_all(b"x")
        assert scope.cancelled_caught  # waited for room all along; nothing was queued
        nursery.start_soon(send, b"y")
        await trio.testing.wait_all_tasks_blocked()
        assert await _receive_exactly(reader, 150) == bytes(150)
        assert await _receive_exactly(reader, 1) == b"y"  # the waiting writer went on
        await stream.send_all(bytes(100))
        nursery.start_soon(send, b"z")
        await trio.testing.wait_all_tasks_blocked()
        await reader.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert len(failed) == 1
        nursery.cancel_scope.cancel()


async def test_close_semantics() -> None:
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(net.serve, "s", 0, _echo)
        stream = await net.connect("s", port)
        await stream.aclose()
        await stream.aclose()  # idempotent
        with pytest.raises(trio.ClosedResourceError):
            await stream.send_all(b"x")
        with pytest.raises(trio.ClosedResourceError):
            await stream.receive_some()
        await trio.testing.wait_all_tasks_blocked()
        assert net.open_connections == 0
        nursery.cancel_scope.cancel()


async def test_send_to_closed_peer_breaks() -> None:
    net = MemoryNetwork()
    accepted: list[trio.abc.Stream] = []

    async def keep(stream: trio.abc.Stream) -> None:
        accepted.append(stream)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(net.serve, "s", 0, keep)
        stream = await net.connect("s", port)
        await trio.testing.wait_all_tasks_blocked()
        await accepted[0].aclose()
        assert await stream.receive_some() == b""
        with pytest.raises(trio.BrokenResourceError):
            await stream.send_all(b"x")
        nursery.cancel_scope.cancel()


async def test_concurrent_receive_is_busy() -> None:
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(net.serve, "s", 0, _echo)
        stream = await net.connect("s", port)
        nursery.start_soon(stream.receive_some)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await stream.receive_some()
        nursery.cancel_scope.cancel()
