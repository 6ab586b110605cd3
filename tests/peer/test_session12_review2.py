"""Second review of session 12's mechanisms (the busy signal). Each test here failed on
the tree it was written against."""

from __future__ import annotations

from functools import partial

import trio
import trio.testing

from peer.memnet import MemoryNetwork, MemoryStream
from peer.secure import turn_away


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
