"""The secure channel: handshake over a stream, identity checks, sealed data, tampering."""

from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from peer.errors import PeerUnavailableError
from peer.memnet import MemoryNetwork
from peer.secure import SecureStream, secure_handshake
from peer.wire import FramePool, FrameReader
from protocol.framing import encode_frame
from protocol.identity import Identity
from protocol.noise import NoiseHandshake


def _identity(n: int) -> Identity:
    return Identity.from_seed(bytes([n]) * 32)


async def _pair(
    a: trio.abc.Stream, b: trio.abc.Stream, ia: Identity, ib: Identity
) -> tuple[SecureStream, SecureStream]:
    result: dict[str, SecureStream] = {}

    async def side(name: str, stream: trio.abc.Stream, me: Identity, initiator: bool) -> None:
        result[name] = await secure_handshake(stream, me, initiator=initiator)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "a", a, ia, True)
        nursery.start_soon(side, "b", b, ib, False)
    return result["a"], result["b"]


async def test_handshake_and_bulk_data() -> None:
    ia, ib = _identity(1), _identity(2)
    raw_a, raw_b = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        a, b = await _pair(raw_a, raw_b, ia, ib)
        assert a.remote_peer_id == ib.peer_id
        assert b.remote_peer_id == ia.peer_id
        data = bytes(range(256)) * 12_000  # ~3 MiB: several seal slices and messages
        got = bytearray()

        async def reader() -> None:
            buffer = bytearray(100_000)
            while len(got) < len(data) + 5:
                n = await b.receive_into(buffer)
                assert n
                got.extend(buffer[:n])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await a.send_pieces([data[:10], data[10:], b"", memoryview(b"tail!")])
        assert got == data + b"tail!"
        # small reads keep the rest of a message
        await b.send_all(b"0123456789")
        assert await a.receive_some(3) == b"012"
        assert await a.receive_some() == b"3456789"
        await a.aclose()
        assert await b.receive_some() == b""
        with pytest.raises(trio.ClosedResourceError):
            await a.send_all(b"x")


async def test_expected_peer_id_mismatch() -> None:
    ia, ib, other = _identity(1), _identity(2), _identity(3)
    raw_a, raw_b = trio.testing.memory_stream_pair()
    errors: list[BaseException] = []

    async def responder() -> None:
        try:
            await secure_handshake(raw_b, ib, initiator=False)
        except PeerUnavailableError as exc:
            errors.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(responder)
            with pytest.raises(PeerUnavailableError) as info:
                await secure_handshake(raw_a, ia, initiator=True, expected_peer_id=other.peer_id)
            assert info.value.__cause__ is not None
    assert len(errors) == 1  # the responder saw the connection close


async def test_garbage_and_eof_during_handshake() -> None:
    raw_a, raw_b = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def garbage() -> None:
                await raw_a.send_all(b"\xff" * 100)

            nursery.start_soon(garbage)
            with pytest.raises(PeerUnavailableError):
                await secure_handshake(raw_b, _identity(2), initiator=False)
        raw_a, raw_b = trio.testing.memory_stream_pair()
        await raw_a.aclose()
        with pytest.raises(PeerUnavailableError):
            await secure_handshake(raw_b, _identity(2), initiator=False)


async def test_tampered_message_breaks_the_stream() -> None:
    ia, ib = _identity(1), _identity(2)
    net = MemoryNetwork()
    accepted: list[SecureStream] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def serve(stream: trio.abc.Stream) -> None:
                accepted.append(await secure_handshake(stream, ib, initiator=False))

            port = await nursery.start(net.serve, "b", 0, serve)
            raw = await net.connect("b", port)
            a = await secure_handshake(raw, ia, initiator=True)
            await trio.testing.wait_all_tasks_blocked()
            b = accepted[0]
            # a valid message, then a forged one written under the secure layer
            await a.send_all(b"fine")
            assert await b.receive_some() == b"fine"
            await raw.send_all(b"\x00\x20" + b"\x00" * 32)
            with pytest.raises(trio.BrokenResourceError) as info:
                await b.receive_some()
            assert info.value.__cause__ is not None
            nursery.cancel_scope.cancel()


async def test_truncated_stream_is_broken() -> None:
    ia, ib = _identity(1), _identity(2)
    raw_a, raw_b = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        _, b = await _pair(raw_a, raw_b, ia, ib)
        await raw_a.send_all(b"\x01\x00\x12")  # a length prefix and part of a message
        await raw_a.aclose()
        with pytest.raises(trio.BrokenResourceError):
            await b.receive_some()


async def test_handshake_cancelled_closes_stream(autojump_clock: trio.testing.MockClock) -> None:
    _, raw_b = trio.testing.memory_stream_pair()
    with trio.move_on_after(5):
        await secure_handshake(raw_b, _identity(2), initiator=False)
    with pytest.raises(trio.ClosedResourceError):
        await raw_b.send_all(b"x")


def _socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    left, right = trio.socket.socketpair()
    return trio.SocketStream(left), trio.SocketStream(right)


async def _drain(stream: SecureStream, size: int) -> None:
    buffer, got = bytearray(1 << 16), 0
    while got < size:
        n = await stream.receive_into(buffer)
        assert n
        got += n


async def test_a_connection_keeps_no_large_seal_buffer_after_a_large_send() -> None:
    """A large send borrows its seal buffer from the process's pool and gives it back, so
    that an idle connection holds kilobytes: each kept a 1 MiB buffer for as long as it
    stayed open (an outside tester: 300 connections that each read one 1 MiB FIND_VALUE
    page held 310 MiB on a bootstrap node). Also when the send is cut off midway (what
    was not sent is copied out, owed to the next send)."""
    import tracemalloc

    with trio.fail_after(30):
        pairs = [await _pair(*_socket_pair(), _identity(1), _identity(2 + i)) for i in range(8)]
        data = bytes(1 << 20)
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            for a, b in pairs:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_drain, b, len(data))
                    await a.send_all(data)
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # the pool keeps one ~1 MiB buffer for reuse; the eight connections held eight
        assert held - before < 2 << 20, held - before

        a, b = pairs[0]
        # nobody reads: the write (one seal slice, all sealed) stalls and is cut off
        with trio.move_on_after(0.5) as scope:
            await a.send_all(data)
        assert scope.cancelled_caught
        assert a.intact and a._out is a._own_out  # the unsent rest owed, in a copy
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, b, len(data) + 5)
            await a.send_all(b"after")  # the owed bytes go first: every byte arrives
        for a, b in pairs:
            await a.aclose()
            await b.aclose()


@pytest.mark.parametrize(
    "sizes",
    [
        [17_000],  # just over what a connection keeps: a lent buffer
        [65_519, 65_520, 1, 131_038],  # on and around a transport message's plaintext
        [30_000] * 34,  # many pieces, ~1 MiB: each seals into messages of its own
        [(1 << 20) - 5, 3, 70_000],  # a write's worth, then more
        [(2 << 20) + 7, 65_519],  # several writes of one piece
    ],
)
async def test_a_lent_seal_buffer_holds_every_write_of_a_send(sizes: list[int]) -> None:
    """The lent buffer is sized from the pieces (an upper bound on what one write seals,
    at most a full write's): every mix of pieces arrives whole and in order."""
    a, b = await _pair(*_socket_pair(), _identity(1), _identity(2))
    pieces = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    data = b"".join(pieces)
    got = bytearray()

    async def drain() -> None:
        buffer = bytearray(1 << 16)
        while len(got) < len(data):
            n = await b.receive_into(buffer)
            assert n
            got.extend(buffer[:n])

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            await a.send_pieces([memoryview(piece) for piece in pieces])
    assert got == data
    await a.aclose()
    await b.aclose()


# -- frame buffers (peer.wire) over a secure channel ------------------------------------


def test_frame_pool_reuses_unreferenced_buffers_within_its_limit() -> None:
    pool = FramePool(limit=4 << 16)
    first = pool.get(100_000)  # class 128 KiB
    assert len(first) == 100_000 and pool.allocated == 1
    kept = pool.get(100_000)  # ``first`` is alive: another buffer
    assert pool.allocated == 2 and pool.tracked == 2 * (2 << 16)
    del first
    again = pool.get(70_000)  # same class, now free: reused
    assert pool.allocated == 2 and len(again) == 70_000
    del again
    pool.get(200_000)  # over the limit: the free 128 KiB buffer is forgotten
    assert pool.allocated == 3 and pool.tracked <= pool.limit
    assert len(pool.get(10)) == 10 and pool.allocated == 3  # small frames: never pooled
    del kept


async def test_frame_reader_frames_outlive_the_read_loop() -> None:
    raw_a, raw_b = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        a, b = await _pair(raw_a, raw_b, _identity(1), _identity(2))
        pool = FramePool(limit=8 << 20)
        reader = FrameReader(b, max_frame_size=1 << 21, pool=pool)
        payloads = [bytes([i]) * (300_000 + i) for i in range(6)]
        kept = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.send_all, b"".join(encode_frame(p) for p in payloads))
            for i, payload in enumerate(payloads):
                frame = await reader.next_frame()
                assert frame is not None and frame == payload
                if i % 2 == 0:
                    kept.append(frame)  # a reducer keeping a chunk: never overwritten
                del frame
        assert [bytes(f) for f in kept] == payloads[::2]
        assert pool.allocated == 4  # three kept, one reused by the others


async def test_a_peer_that_resets_right_after_its_handshake_keeps_its_address() -> None:
    """A peer may send its last handshake message, a request, and a reset at once: the
    request is still read (the kernel keeps what arrived before the reset), but the
    socket no longer has a peer address once the reset came. Read then, the address was
    '?': an unknown host, exempt from the storage quota. It is read before the handshake,
    when the dialer cannot have reset yet (it needs our reply to finish)."""
    identity = Identity.generate()
    with trio.fail_after(30):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with listeners[0]:
            port = listeners[0].socket.getsockname()[1]
            client = socket.create_connection(("127.0.0.1", port))
            client.setblocking(False)
            raw = await listeners[0].accept()
            handshake = NoiseHandshake(Identity.generate(), initiator=True)
            accepted: list[SecureStream] = []

            async def respond() -> None:
                accepted.append(await secure_handshake(raw, identity, initiator=False))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(respond)
                client.sendall(handshake.data_to_send())
                while not handshake.complete:
                    await trio.lowlevel.wait_readable(client)
                    handshake.receive_data(client.recv(4096))
                last = handshake.data_to_send()
                request = bytearray()
                handshake.into_transport().seal_into(b"STORE", request)
                # the last message, a request and a reset, with no checkpoint between
                client.setblocking(True)
                client.sendall(last + bytes(request))
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
            secure = accepted[0]
            assert await secure.receive_some() == b"STORE"
            assert secure.remote_host == "127.0.0.1"
            await secure.aclose()
