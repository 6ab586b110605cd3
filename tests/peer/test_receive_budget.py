"""The receive budget: large frames on their way in, over all connections together, take at
most ``HostConfig.receive_budget`` bytes; a frame that stalls while others wait is cut off.
A trial's bootstrap node held 2.6 GB for 600 connections that each announced a 4 MiB frame,
sent 2.2 MiB of it and went quiet, and kept it after they closed."""

from __future__ import annotations

import sys

import pytest
import trio
import trio.testing

from peer.host import HostConfig, open_rpc_host
from peer.memnet import MemoryNetwork
from peer.receive_budget import ReceiveBudget
from peer.secure import SecureStream, secure_handshake
from peer.wire import FRAME_POOL, FramePool, FrameReader
from protocol.address import Address
from protocol.errors import RemoteProtocolError
from protocol.framing import encode_frame_header
from protocol.identity import Identity

SERVER = Identity.from_seed(b"s" * 32)
PEER = Identity.from_seed(b"p" * 32)
MIB = 1 << 20
CONTENT = bytes(range(256)) * (MIB // 256)


async def _secure_pair() -> tuple[SecureStream, SecureStream]:
    left, right = trio.testing.memory_stream_pair()
    streams: dict[bool, SecureStream] = {}

    async def shake(raw: trio.abc.Stream, identity: Identity, initiator: bool) -> None:
        streams[initiator] = await secure_handshake(raw, identity, initiator=initiator)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(shake, left, PEER, True)
        nursery.start_soon(shake, right, SERVER, False)
    return streams[True], streams[False]


async def test_a_frame_waits_for_room_and_a_stalled_one_is_cut_off_to_make_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ReceiveBudget(limit=MIB + MIB // 2, stall_timeout=10.0)  # room for one frame
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
    """Slow is not stalled: a frame that gets bytes every few seconds keeps its room, and
    the frame waiting behind it comes in after it."""
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
            for offset in range(MIB // 2, MIB, 64 << 10):
                await trio.sleep(8)
                await slow.send_all(CONTENT[offset : offset + (64 << 10)])
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


async def test_an_abandoned_frame_leaves_no_buffer_behind_with_the_closed_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The closed connection keeps why it closed: that error's traceback held the frame's
    buffer (a trial's node: 155 MiB after 60 such connections had gone)."""
    net = MemoryNetwork()
    config = HostConfig(receive_budget=8 * MIB)
    async with open_rpc_host(
        SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
    ) as host:
        with trio.fail_after(30):
            raw = await net.interface("p").connect("s", 1)
            attacker = await secure_handshake(raw, PEER, initiator=True)
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
