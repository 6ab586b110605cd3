"""Review of session 12's mechanisms: owed bytes of a cancelled write, busy joins, the
per-host storage quota. Each test here failed on the tree it was written against."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing
from test_cancellation_review import assert_settled, echo
from test_owed_bytes import WINDOW
from test_rpc import two_hosts

from peer import Peer, open_peer
from peer.cli import main
from peer.dht import DHTConfig
from peer.errors import PeerBusyError
from peer.memnet import MemoryNetwork
from peer.rpc import Reply, Request
from peer.secure import SecureStream, secure_handshake
from protocol.identity import Identity
from protocol.noise import BUSY_SIGNAL, NoiseHandshake


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


def _status_against_a_listener(signal: bytes, timeout: str) -> int:
    """``swarm status`` against a listener that accepts, sends ``signal`` and closes."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)
    stop = threading.Event()

    def turn_away() -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            with contextlib.suppress(OSError):
                connection.sendall(signal)
            connection.close()

    thread = threading.Thread(target=turn_away)
    thread.start()
    try:
        address = f"{Identity.generate().peer_id}@127.0.0.1:{server.getsockname()[1]}"
        return main(["status", "--initial-peers", address, "--timeout", timeout])
    finally:
        stop.set()
        thread.join()
        server.close()


def test_status_says_an_initial_peer_is_busy_within_its_timeout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`swarm status` against a node that turns us away before its handshake (busy): the
    join's retries (30 s) outlasted the command's --timeout (20 s by default), which then
    cut the start short and said only "no complete answer within 2.0 s (no peer answered
    by then)", where it used to say at once that the node was busy. The retries now end
    within half the timeout, and the report names the node as busy."""
    monkeypatch.setattr("peer.cli._configure_logging", lambda *args: None)  # other tests' levels
    assert _status_against_a_listener(BUSY_SIGNAL, "2") == 1
    captured = capsys.readouterr()
    assert captured.out == "0 peer(s) reachable\n"
    assert "no peer answered (tried" in captured.err
    assert "busy at each of" in captured.err


def test_status_fails_at_once_on_a_listener_that_just_closes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bare close before the handshake (a proxy in front of a peer that is gone, as
    docker-proxy does) is not "busy": no retries, a report at once that says what happened
    (it was taken for busy, and retried until the timeout)."""
    monkeypatch.setattr("peer.cli._configure_logging", lambda *args: None)
    started = time.monotonic()
    assert _status_against_a_listener(b"", "20") == 1
    assert time.monotonic() - started < 5
    captured = capsys.readouterr()
    assert "closed the connection before its handshake" in captured.err
    assert "busy" not in captured.err


class _Whole:
    """A stand-in stream with only ``send_all`` (for ``trickle``)."""

    def __init__(self, send_all: Callable[[bytes], Awaitable[None]]) -> None:
        self.send_all = send_all


async def test_the_busy_signal_is_recognised_when_it_comes_byte_by_byte() -> None:
    """The dialer reads the responder's first two bytes before deciding: the busy signal
    split over two reads is still "busy", and a real handshake whose reads come one byte
    at a time still completes."""

    async def trickle(stream: trio.abc.Stream | _Whole, data: bytes) -> None:
        for i in range(len(data)):
            await stream.send_all(data[i : i + 1])
            await trio.testing.wait_all_tasks_blocked()

    with trio.fail_after(10):
        raw_a, raw_b = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle, raw_b, BUSY_SIGNAL)
            with pytest.raises(PeerBusyError):
                await secure_handshake(raw_a, Identity.generate(), initiator=True)
            await raw_b.aclose()

        raw_a, raw_b = trio.testing.memory_stream_pair()
        ids = Identity.generate(), Identity.generate()
        done: list[SecureStream] = []
        send_all = raw_b.send_all

        async def send_bytewise(data: bytes | bytearray | memoryview) -> None:
            await trickle(_Whole(send_all), bytes(data))

        raw_b.send_all = send_bytewise  # type: ignore[method-assign]

        async def responder() -> None:
            done.append(await secure_handshake(raw_b, ids[1], initiator=False))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(responder)
            dialer = await secure_handshake(raw_a, ids[0], initiator=True)
        assert dialer.remote_peer_id == ids[1].peer_id and done


async def test_a_contact_busy_for_longer_than_a_refresh_interval_is_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A busy answer is a sign of life only for so long: a departed peer's address now
    answering busy (another process, an attacker) kept the dead contact in our table
    forever, since busy answers never counted as failures. They count once we have not
    heard from the contact for a whole ``refresh_interval``; before that they do not."""
    net = MemoryNetwork(latency=0.01)
    config = DHTConfig()

    async def busy(stream: trio.abc.Stream) -> None:
        await stream.send_all(BUSY_SIGNAL)
        await stream.aclose()

    leave, left = trio.Event(), trio.Event()

    async def run_x(task_status: trio.TaskStatus[Peer]) -> None:
        async with open_peer("10.0.0.9:4000", network=net.interface("10.0.0.9")) as x:
            task_status.started(x)
            await leave.wait()
        left.set()

    with trio.fail_after(10 * config.refresh_interval):
        async with trio.open_nursery() as nursery:
            x = await nursery.start(run_x)
            async with open_peer(
                "10.0.0.1:4000", [x.address], network=net.interface("10.0.0.1")
            ) as volunteer:
                table = volunteer.dht.protocol.table
                node = table.get(x.peer_id)
                assert node is not None
                leave.set()  # x leaves; something else at its address answers busy
                await left.wait()
                await nursery.start(net.serve, "10.0.0.9", 4000, busy)
                for _ in range(2 * config.max_failures):
                    await volunteer.dht.protocol.ping(node)
                assert node.peer_id in table  # busy, and heard from lately
                await trio.sleep(config.refresh_interval + 1)
                for _ in range(config.max_failures):
                    await volunteer.dht.protocol.ping(node)
                assert node.peer_id not in table
            nursery.cancel_scope.cancel()
