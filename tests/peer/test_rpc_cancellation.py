"""Cancellation and timing at unlucky moments on the RPC layer (in-memory network, virtual
time): a call or stream given up on must cost only itself, never the connection that other
calls share, and a request the peer never read is retried like a plain call."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
from test_rpc import two_hosts

from peer.host import RpcHost
from peer.memnet import MemoryNetwork
from peer.rpc import Reply, Request, RpcConnection
from protocol.address import Address
from protocol.rpc import FrameKind, RpcFrame

LATENCY = 0.01
WINDOW = 1 << 16
"""Bytes unread in one direction before a write waits (like a socket's buffers)."""


async def echo(request: Request) -> Reply:
    return Reply(request.body, request.payload)


async def slow_echo(request: Request) -> Reply:
    await trio.sleep(request.body["delay"])
    return Reply(request.body, request.payload)


async def endless(request: Request) -> AsyncIterator[Reply]:
    """Items of ``size`` bytes until the caller leaves."""
    i = 0
    while True:
        yield Reply({"i": i}, bytes(request.body["size"]))
        i += 1


async def other_call(a: RpcHost, address: Address, replies: list[Reply]) -> None:
    """A call in flight on the same connection meanwhile (answered after 0.2 s)."""
    replies.append(await a.call(address, "slow_echo", {"delay": 0.2}))


def assert_settled(*hosts: RpcHost) -> None:
    """No call in flight either way, and every call slot free."""
    for host in hosts:
        for connection in host._connections:
            assert not connection._pending, (host, connection._pending)
            assert not connection._incoming, (host, connection._incoming)
            assert connection._call_slots.value == connection.call_slots


async def test_leaving_a_stream_early_keeps_the_connection_for_other_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The callee cancels the handler of a stream its caller left (or whose deadline
    passed); an item it was writing straight to a congested stream must not be cut off
    midway: that ends the connection, and every other call on it fails."""
    net = MemoryNetwork(latency=LATENCY, window=WINDOW)
    async with two_hosts(net) as (a, b, address):
        b.register("slow_echo", slow_echo)
        b.register_stream("endless", endless)
        with trio.fail_after(60):
            await a.call(address, "slow_echo", {"delay": 0})
            opened = a.connections_opened
            for step in range(6):
                for size in (1000, 60_000):
                    replies: list[Reply] = []
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(other_call, a, address, replies)
                        with trio.move_on_after(0.05 + step * 0.003):
                            async with a.stream(address, "endless", {"size": size}) as items:
                                async for _ in items:
                                    pass
                    assert len(replies) == 1
            await trio.sleep(1)
            assert a.connections_opened == opened, "a connection was closed and dialled again"
            assert_settled(a, b)


async def blob(request: Request) -> Reply:
    return Reply({}, bytes(request.body["size"]))


async def test_a_deadline_passing_as_the_reply_is_written_keeps_the_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A handler that answers just before the caller's deadline, on a connection busy with
    a large download: its reply's write must not be cut off by the deadline midway."""
    net = MemoryNetwork(latency=LATENCY, window=WINDOW)
    async with two_hosts(net) as (a, b, address):
        b.register("slow_echo", slow_echo)
        b.register("blob", blob)
        with trio.fail_after(60):
            await a.call(address, "slow_echo", {"delay": 0})
            opened = a.connections_opened
            for step in range(20):
                downloads: list[Reply] = []

                async def download(downloads: list[Reply] = downloads) -> None:
                    downloads.append(await a.call(address, "blob", {"size": 2 << 20}))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(download)
                    await trio.sleep(LATENCY)
                    delay = step * 0.005
                    with trio.move_on_after(delay + 0.005):
                        await a.call(address, "slow_echo", {"delay": delay})
                assert len(downloads) == 1
            await trio.sleep(1)
            assert a.connections_opened == opened, "a connection was closed and dialled again"
            assert_settled(a, b)


async def counted(request: Request) -> AsyncIterator[Reply]:
    for i in range(request.body["n"]):
        yield Reply({"i": i})


async def test_a_stream_opened_as_the_peer_closes_the_idle_connection_succeeds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stream's request that meets the connection just closed by the peer's idle timer
    (in the write, or unread by the peer) was never served: it is retried on a fresh
    connection, like a plain call, instead of failing."""
    async with two_hosts(MemoryNetwork(latency=LATENCY)) as (a, b, address):
        b.register_stream("counted", counted)
        b.register("slow_echo", slow_echo)
        with trio.fail_after(1200):
            for offset in (-LATENCY / 2, -LATENCY / 10, 0, LATENCY / 10, LATENCY / 2):
                await a.call(address, "slow_echo", {"delay": 0})
                (theirs,) = b._connections
                closes_at = theirs.last_activity + theirs.idle_timeout  # b's idle timer
                await trio.sleep_until(closes_at + offset)
                async with a.stream(address, "counted", {"n": 3}) as items:
                    got = [item.body["i"] async for item in items]
                assert got == [0, 1, 2], offset
                await trio.sleep(100)  # every connection idles out


async def sink(request: Request) -> Reply:
    return Reply({"n": memoryview(request.payload).nbytes})


async def test_a_call_given_up_on_a_congested_connection_keeps_it_for_the_upload(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Just after a large upload, the connection's buffers are full: a small call made
    then (a lookup's request, say) whose caller gives up soon after must not have its
    request's write cut off midway, which ends the connection and fails the upload."""
    net = MemoryNetwork(latency=LATENCY, window=WINDOW)
    async with two_hosts(net) as (a, b, address):
        b.register("slow_echo", slow_echo)
        b.register("sink", sink)
        with trio.fail_after(60):
            await a.call(address, "slow_echo", {"delay": 0})
            opened = a.connections_opened
            for step in range(60):
                uploads: list[Reply] = []

                async def upload(uploads: list[Reply] = uploads) -> None:
                    uploads.append(await a.call(address, "sink", {}, bytes(2 << 20)))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(upload)
                    await trio.sleep(step * 0.0007)
                    with trio.move_on_after(0.005):
                        await a.call(address, "slow_echo", {"delay": 0})
                assert uploads[0].body == {"n": 2 << 20}
            await a.call(address, "slow_echo", {"delay": 0})
            assert a.connections_opened == opened, "a connection was closed and dialled again"
            assert_settled(a, b)


async def test_an_upload_cancelled_midway_is_finished_from_a_copy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A call given up on while its large payload is being written (an averaging upload
    whose step timed out) must not end the connection that other calls share, and the
    caller may overwrite its buffer at once: the peer still reads the original bytes."""
    net = MemoryNetwork(latency=LATENCY, window=WINDOW)
    received: list[bytes] = []

    async def keep(request: Request) -> Reply:
        received.append(bytes(request.payload))
        return Reply({})

    async with two_hosts(net) as (a, b, address):
        b.register("slow_echo", slow_echo)
        b.register("keep", keep)
        with trio.fail_after(60):
            await a.call(address, "slow_echo", {"delay": 0})
            opened = a.connections_opened
            answered = 0
            for step in range(40):
                payload = bytearray(b"u" * (2 << 20))
                replies: list[Reply] = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(other_call, a, address, replies)
                    with trio.move_on_after(step * 0.002):
                        await a.call(address, "keep", {}, payload)
                        answered += 1
                    payload[:] = b"X" * len(payload)  # reused as soon as the call returned
                assert len(replies) == 1  # the call beside it was answered
                await trio.sleep(1)
            assert a.connections_opened == opened, "a connection was closed and dialled again"
            assert len(received) > answered, "no call was cancelled midway through its upload"
            assert all(data == b"u" * (2 << 20) for data in received), "read after return"
            assert_settled(a, b)


async def test_a_deadline_at_any_moment_of_a_call_or_stream_costs_only_that_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A sweep of caller deadlines over the life of a call and of a stream (payloads that
    fill the connection's window): each one given up on leaves no call in flight either
    way, no slot taken, the connection up, and the next call gets its own reply."""
    net = MemoryNetwork(latency=LATENCY, window=WINDOW)
    async with two_hosts(net) as (a, b, address):
        b.register("slow_echo", slow_echo)
        b.register_stream("counted_blobs", counted_blobs)
        with trio.fail_after(60):
            await a.call(address, "slow_echo", {"delay": 0})
            opened = a.connections_opened
            for step in range(40):
                with trio.move_on_after(step * 0.002):
                    await a.call(address, "slow_echo", {"delay": 0.01}, bytes(30_000))
                with trio.move_on_after(step * 0.002):
                    async with a.stream(address, "counted_blobs", {"n": 4}) as items:
                        async for _ in items:
                            pass
                reply = await a.call(address, "slow_echo", {"delay": 0, "step": step})
                assert reply.body == {"delay": 0, "step": step}
                await trio.sleep(LATENCY * 3)  # the cancels have arrived
                assert_settled(a, b)
            assert a.connections_opened == opened, "a connection was closed and dialled again"


async def counted_blobs(request: Request) -> AsyncIterator[Reply]:
    for i in range(request.body["n"]):
        yield Reply({"i": i}, bytes(30_000))


async def test_a_stream_left_early_sends_none_of_its_queued_items(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The items a stream handler had queued when its caller left were written all the
    same: up to 4 MiB a connection of data nobody reads, ahead of everything else we send
    (a volunteer on a 10 Mbit/s link kept receiving results for seconds after its step had
    ended, and its DHT pings failed behind them). They are withdrawn now."""
    net = MemoryNetwork(latency=LATENCY, window=WINDOW)
    async with two_hosts(net) as (a, b, address):
        b.register_stream("endless", endless)
        b.register("echo", echo)
        with trio.fail_after(30):
            async with a.stream(address, "endless", {"size": 128 << 10}) as items:
                async for _ in items:
                    break  # one item, then leave: the callee has queued megabytes by now
            sent_at_leave = net.bytes_sent_by["10.0.0.2"]
            await trio.sleep(5.0)  # everything still queued would have arrived by now
            after = net.bytes_sent_by["10.0.0.2"] - sent_at_leave
            # what the writer had taken (a batch of up to 1 MiB) still goes; was 5.4 MB
            assert after < 2 << 20, after
            reply = await a.call(address, "echo", {"still": 1})
            assert reply.body == {"still": 1}
            assert_settled(a, b)


UPLOAD = (2 << 20) - 4096


async def pong(request: Request) -> Reply:
    return Reply({})


def only_connection(connections: dict[RpcConnection, object]) -> RpcConnection:
    (connection,) = connections
    return connection


@pytest.mark.parametrize("kind", ["call", "stream"])
async def test_a_reply_that_comes_before_the_upload_is_written_stops_reading_the_buffer(
    autojump_clock: trio.testing.MockClock, kind: str
) -> None:
    """A peer may answer a call (or end a stream) before it has read the whole request (a
    hostile one knows the request ids: they count up). The call then returns, and the
    caller reuses its buffer (an averaging sender hands it back to its pool): the rest of
    the frame must go out from a copy, never from the buffer the caller now writes (docs:
    a call never reads its payload after it returned)."""
    net = MemoryNetwork(latency=LATENCY, window=WINDOW)
    received: list[bytes] = []
    arrived = trio.Event()

    async def keep(request: Request) -> Reply:
        received.append(bytes(request.payload))
        arrived.set()
        return Reply({})

    async def keep_stream(request: Request) -> AsyncIterator[Reply]:
        yield await keep(request)

    async def upload(a: RpcHost, address: Address, payload: bytearray) -> None:
        if kind == "call":
            await a.call(address, "keep", {}, payload)
            return
        async with a.stream(address, "keep_stream", {}, payload) as items:
            async for _ in items:
                pass

    async with two_hosts(net) as (a, b, address):
        b.register("keep", keep)
        b.register_stream("keep_stream", keep_stream)
        b.register("ping", pong)
        with trio.fail_after(60):
            await a.call(address, "ping")
            ours, theirs = only_connection(a._connections), only_connection(b._connections)
            payload = bytearray(b"u" * UPLOAD)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(upload, a, address, payload)
                await trio.testing.wait_all_tasks_blocked()
                assert ours._outbox._batch, "the writer is not on the 4 MiB payload"
                request_id = ours._next_id - 1
                answer = FrameKind.RESPONSE if kind == "call" else FrameKind.END
                early = RpcFrame(answer, request_id)
                theirs._outbox.put_nowait(theirs._encode(early)[0], urgent=True)
            # the call returned (answered early): the caller reuses its buffer at once
            payload[:] = b"X" * UPLOAD
            await arrived.wait()
            assert received[0] == b"u" * UPLOAD, "the payload was read after the call returned"


async def test_a_cancel_reaches_the_peer_before_a_request_sent_in_the_slot_it_freed() -> None:
    """With every call slot taken, a call given up frees its slot at once; the next call's
    request must not reach the peer before that call's cancel, or the peer counts one more
    request than ``max_inflight_requests`` and ends the connection (a review: the cancel
    waited in the bulk queue while the request went ahead, and all 128 calls failed)."""
    from test_rpc import wired_connection

    with trio.fail_after(5):
        async with wired_connection(max_inflight_requests=4) as (connection, wire):
            scopes = [trio.CancelScope() for _ in range(5)]

            async def call(i: int) -> None:
                with scopes[i]:
                    await connection.call("remote.method", {"i": i})

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(call, i)
                requests = [await wire.receive() for _ in range(4)]
                assert [r.kind for r in requests] == [FrameKind.REQUEST] * 4
                scopes[0].cancel()  # its slot is free at once...
                nursery.start_soon(call, 4)  # ...and taken by the next call
                frames = [await wire.receive(), await wire.receive()]
                assert [(f.kind, f.body.get("i")) for f in frames] == [
                    (FrameKind.CANCEL, None),
                    (FrameKind.REQUEST, 4),
                ], frames
                (first,) = [r for r in requests if r.body["i"] == 0]
                assert frames[0].request_id == first.request_id
                assert not connection.closed
                for scope in scopes:
                    scope.cancel()


async def _fails_as_cancelled() -> None:
    try:
        await trio.sleep_forever()
    finally:
        raise ValueError("cleanup failed")  # the point: it fails when cancelled


async def nursery_handler(request: Request) -> Reply:
    """A handler whose nursery child fails as the handler is cancelled."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_fails_as_cancelled)
        await trio.sleep_forever()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("by_caller", [False, True], ids=["deadline", "cancel"])
async def test_a_handler_that_fails_as_it_is_cancelled_ends_only_its_request(
    autojump_clock: trio.testing.MockClock, by_caller: bool
) -> None:
    """The error of a handler's nursery child, raised as the caller's deadline (or cancel)
    cancels the handler, came out of the request's cancel scope as a group that nothing
    caught: it took the whole host down (a review). It now ends only that request."""
    net = MemoryNetwork(latency=LATENCY)
    async with two_hosts(net) as (a, b, address):
        b.register("work", nursery_handler)
        b.register("echo", echo)
        with trio.fail_after(60):
            if by_caller:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(a.call, address, "work")
                    await trio.sleep(1)
                    nursery.cancel_scope.cancel()
            else:
                with pytest.raises(trio.TooSlowError):
                    with trio.fail_after(1):
                        await a.call(address, "work")
            await trio.sleep(1)
            assert (await a.call(address, "echo", {"x": 1})).body == {"x": 1}
            assert not b.stopped
            assert_settled(a, b)
