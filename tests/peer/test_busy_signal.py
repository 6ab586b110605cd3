"""The busy signal: a node that turns a connection away says so (``BUSY_SIGNAL``), then
closes it, however the refusal is cut short; a dialer recognises the signal however it
arrives; and a busy answer is a sign of life only for so long."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing

from peer import Peer, open_peer
from peer.dht import DHTConfig
from peer.errors import PeerBusyError
from peer.memnet import MemoryNetwork, MemoryStream
from peer.secure import SecureStream, secure_handshake, turn_away
from protocol.identity import Identity
from protocol.noise import BUSY_SIGNAL


async def test_a_refusal_cancelled_before_its_signal_still_closes_the_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``turn_away`` cancelled at its write (the host closing while it refuses someone)
    left the stream open: the cancellation escaped before the close, so the dialer waited
    for its own timeout (and a TCP socket was left to the garbage collector)."""
    with trio.fail_after(5):
        ours, theirs = trio.testing.memory_stream_pair()
        with trio.CancelScope() as scope:
            scope.cancel()
            await turn_away(ours)
        assert await theirs.receive_some() == b""  # closed, not left open


async def test_a_memnet_refusal_cut_short_by_the_listeners_end_still_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The memory network's refusal, cancelled before it ran (the listener stopped just
    after a refused connect), never closed the refused stream: the dialer hung."""

    async def handler(stream: trio.abc.Stream) -> None:
        await stream.aclose()

    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            listening = trio.CancelScope()

            async def serve(task_status: trio.TaskStatus[int]) -> None:
                with listening:
                    await net.interface("10.0.0.1").serve(
                        "10.0.0.1", 0, handler, admit=lambda host: False, task_status=task_status
                    )

            port = await nursery.start(serve)
            stream = await net.interface("10.0.0.2").connect("10.0.0.1", port)
            assert isinstance(stream, MemoryStream)
            listening.cancel()  # before the refusal's task runs
            assert await stream.receive_some() == b""
            await stream.aclose()
    assert net.open_connections == 0


async def test_a_refusal_that_runs_sends_the_signal_then_closes() -> None:
    """The fix keeps the signal where the refusal is not cancelled."""
    with trio.fail_after(5):
        ours, theirs = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(turn_away, ours))
            got = b""
            while chunk := await theirs.receive_some():
                got += chunk
        assert got == b"\x00\x00"


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
