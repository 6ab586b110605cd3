"""The writer's outbox: urgent frames (small requests, unary replies) skip the bulk queue."""

from __future__ import annotations

import trio
import trio.testing

from peer.wire import Outbox


async def test_urgent_frames_go_before_queued_bulk_frames() -> None:
    outbox = Outbox(capacity=2)
    bulk = [[b"bulk%d" % i] for i in range(2)]
    for frame in bulk:
        await outbox.put(frame)
    reply = [b"reply"]
    with trio.fail_after(1):
        await outbox.put(reply, urgent=True)  # a queue of its own: room, though bulk is full
    assert not outbox.has_room() and outbox.has_room(urgent=True)
    assert await outbox.get_batch() == [b"replybulk0bulk1"]  # small frames joined, in order
    assert outbox.writing(reply)
    outbox.release()


async def test_an_urgent_frame_can_be_withdrawn_and_wakes_the_writer() -> None:
    outbox = Outbox(capacity=4)
    batches: list[list[object]] = []

    async def writer() -> None:
        batches.append(list(await outbox.get_batch()))
        outbox.release()

    request = [b"request"]
    with trio.fail_after(1):
        outbox.put_nowait(request, urgent=True)
        assert not outbox.try_claim()  # something is queued: the writer goes first
        assert outbox.withdraw(request)
        assert outbox.try_claim()
        outbox.release()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await trio.testing.wait_all_tasks_blocked()
            assert batches == []
            outbox.put_nowait([b"ping"], urgent=True)
    assert batches == [[b"ping"]]


async def test_a_full_urgent_queue_waits_for_the_writer() -> None:
    """A peer that never reads our answers cannot make us queue them without bound."""
    outbox = Outbox(capacity=2)
    for i in range(2):
        outbox.put_nowait([b"answer%d" % i], urgent=True)
    assert not outbox.has_room(urgent=True)
    queued = trio.Event()

    async def answer() -> None:
        await outbox.put([b"answer2"], urgent=True)
        queued.set()

    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            await trio.testing.wait_all_tasks_blocked()
            assert not queued.is_set()  # parked until the writer takes a batch
            assert await outbox.get_batch() == [b"answer0answer1"]
            outbox.release()
            await queued.wait()
        assert await outbox.get_batch() == [b"answer2"]


async def test_outbox_wakes_a_waiting_put_when_the_frames_taken_were_empty() -> None:
    # The queue is bounded in frames and in bytes; taking frames that hold no bytes still
    # frees frame slots, and a put waiting for one must wake.
    outbox = Outbox(capacity=1)
    await outbox.put([b""])
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outbox.put, [b"x"])
            await trio.testing.wait_all_tasks_blocked()
            assert await outbox.get_batch() == []  # nothing to write: empty pieces are dropped
            outbox.release()
        assert await outbox.get_batch() == [b"x"]
