"""What a member makes of a result stream that breaks the contract in small ways (a hostile
result-stream trial): one that ends after fewer chunks than its header announced was
reported "the reducer had no contributions" (the header listed three); a chunk numbered
``0.0`` or ``False`` passed for chunk 0; a header with an unknown key or a bool weight
parsed. With int8 and float16, result chunks are decoded into the tensor as they come: a
part that does not count gets its local values back (the ``codec`` parameters)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from test_averaging_support import (
    fast_config,
    make_members,
    memnet_swarm,
    step_all,
    tolerance,
    verify_round,
)

from peer import Reply
from protocol.errors import RemoteProtocolError
from protocol.identity import PeerID
from training import DropReason, PartStatus
from training.averaging.messages import ResultHeader
from training.averaging.reducing import ReducerService

SIZE = 3 * 4 * 1024  # 3 parts of 4 chunks (chunk_bytes 4096: 1024 elements)

Edit = Callable[[list[Reply]], list[Reply]]


def _drop_last(items: list[Reply]) -> list[Reply]:
    return items[:-1]


def _float_numbers(items: list[Reply]) -> list[Reply]:
    return [items[0]] + [
        Reply({**i.body, "chunk": float(i.body["chunk"])}, i.payload) for i in items[1:]
    ]


def _bool_first(items: list[Reply]) -> list[Reply]:
    first = items[1]
    return [items[0], Reply({**first.body, "chunk": False}, first.payload), *items[2:]]


async def _round_with_liar(
    monkeypatch: pytest.MonkeyPatch, edit: Edit, codec: str = "none"
) -> tuple[list[Any], list[Any], PeerID]:
    serve = ReducerService.results
    liar: list[PeerID] = []

    async def results(self: ReducerService, member: PeerID) -> AsyncIterator[Reply]:
        if self.plan.me not in liar:
            async for item in serve(self, member):
                yield item
            return
        items = [item async for item in serve(self, member)]
        for item in edit(items):
            yield item

    monkeypatch.setattr(ReducerService, "results", results)
    with trio.fail_after(100):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config(codec=codec))
            liar.append(members[0].peer_id)
            outcome = await step_all(members, timeout=20)
    infos = [info for info, _ in outcome]
    verify_round(members, infos, codec=codec)
    return members, infos, members[0].peer_id


@pytest.mark.parametrize("codec", ["none", "int8", "float16"])
async def test_a_stream_that_ends_short_says_so(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    members, infos, liar = await _round_with_liar(monkeypatch, _drop_last, codec)
    for member, info in zip(members[1:], infos[1:], strict=True):
        (part,) = [p for p in info.parts if p.reducer == liar]
        assert part.status is PartStatus.NONE and not part.received
        assert part.note == "the result stream ended after 3 of 4 chunks"
        start, stop = part.span
        np.testing.assert_array_equal(member.array[start:stop], member.data[start:stop])


def _short_third(items: list[Reply]) -> list[Reply]:
    third = items[3]  # (items[0] is the header)
    return [*items[:3], Reply(third.body, bytes(memoryview(third.payload)[:-4])), *items[4:]]


@pytest.mark.parametrize("codec", ["none", "int8", "float16"])
@pytest.mark.parametrize("edit", [_float_numbers, _bool_first, _short_third])
async def test_a_chunk_number_that_is_no_int_is_garbage(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, edit: Edit, codec: str
) -> None:
    _, infos, liar = await _round_with_liar(monkeypatch, edit, codec)
    for info in infos[1:]:
        (part,) = [p for p in info.parts if p.reducer == liar]
        assert part.status is PartStatus.NONE
        assert part.dropped.get(liar) is DropReason.GARBAGE, part


@pytest.mark.parametrize("change", [{"zzz": 1}, {"weight": True}])
def test_a_result_header_with_an_unknown_key_or_a_bool_weight_is_malformed(
    change: dict[str, object],
) -> None:
    body = {"contributors": [], "dropped": [], "weight": 0.0, "chunks": 0}
    ResultHeader.from_body(body)
    with pytest.raises(RemoteProtocolError):
        ResultHeader.from_body({**body, **change})


@pytest.mark.parametrize("codec", ["none", "int8", "float16"])
async def test_a_step_cancelled_midway_through_a_part_leaves_none_of_it(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """Results decoded into the tensor as they come: a step cancelled from outside after
    two chunks of a part (the reducer holding back the rest) puts their local values back,
    as it did when results went through the flat vector (no part is left half averaged)."""
    from training.averaging.butterfly import Butterfly

    serve = ReducerService.results
    slow: list[PeerID] = []

    async def results(self: ReducerService, member: PeerID) -> AsyncIterator[Reply]:
        items = [item async for item in serve(self, member)]
        for sent, item in enumerate(items):
            if self.plan.me in slow and sent == 3:  # after the header and two chunks
                await trio.sleep_forever()
            yield item

    taken: dict[PeerID, int] = {}
    plans: dict[PeerID, Any] = {}
    watched: list[PeerID] = []  # the member whose step is cancelled
    two_in = trio.Event()
    take = Butterfly._take

    def counting_take(self: Butterfly, *args: Any) -> None:
        take(self, *args)
        plans[self.plan.me] = self.plan
        if len(args) == 5 and args[4] is not None:  # into the tensor
            taken[self.plan.me] = taken.get(self.plan.me, 0) + 1
            if taken[self.plan.me] == 2 and self.plan.me == watched[0]:
                two_in.set()

    monkeypatch.setattr(ReducerService, "results", results)
    monkeypatch.setattr(Butterfly, "_take", counting_take)

    def setup(members: list[Any]) -> None:
        slow.append(members[0].peer_id)
        watched.append(members[1].peer_id)

    members = await _step_two_cancelling_the_second(codec, two_in, setup)
    member = members[1]
    plan = plans[member.peer_id]
    start, stop = plan.spans[[r.peer_id for r in plan.reducers].index(members[0].peer_id)]
    assert stop - start == SIZE // 2 and taken[member.peer_id] == 2
    np.testing.assert_array_equal(member.array[start:stop], member.data[start:stop])


async def _step_two_cancelling_the_second(
    codec: str, when: trio.Event, setup: Callable[[list[Any]], None]
) -> list[Any]:
    """Two members step together (weight 1 each); the second's step is cancelled from
    outside once ``when`` is set. ``setup(members)`` runs before the steps."""
    with trio.fail_after(100):
        async with memnet_swarm(2) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config(codec=codec))
            setup(members)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(members[0].averager.step)
                with trio.CancelScope() as scope:
                    nursery.start_soon(_cancel_when, when, scope)
                    await members[1].averager.step(timeout=20)
                assert scope.cancelled_caught
    return members


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


@pytest.mark.parametrize("codec", ["none", "int8", "float16"])
async def test_a_step_cancelled_while_its_reducer_publishes_leaves_its_part_whole(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """A reducer writes what the others decode of its mean into its own tensor, chunk by
    chunk, as it publishes: a step cancelled from outside midway left the first chunks
    averaged and the rest its own values (a trial: 20-30 of 46 chunks). The whole part now
    holds the mean (docs/averaging.md, guarantee 1: parts already received may hold it)."""
    publish = ReducerService.publish
    encoded: dict[PeerID, int] = {}
    spans: dict[PeerID, tuple[int, int]] = {}
    watched: list[PeerID] = []  # the member whose step is cancelled
    two_out = trio.Event()

    async def counting_publish(self: ReducerService) -> None:
        # (none makes its blobs without _encode: count the blobs as they are served)
        changed = self._notify

        def notify() -> None:
            encoded[self.plan.me] = len(self.blobs)
            spans[self.plan.me] = self.plan.spans[self.part]
            if len(self.blobs) == 2 and self.plan.me == watched[0]:
                two_out.set()
            changed()

        self._notify = notify  # type: ignore[method-assign]
        await publish(self)

    monkeypatch.setattr(ReducerService, "publish", counting_publish)
    members = await _step_two_cancelling_the_second(
        codec, two_out, lambda members: watched.append(members[1].peer_id)
    )
    member = members[1]
    start, stop = spans[member.peer_id]
    assert stop - start == SIZE // 2 and encoded[member.peer_id] < 6  # cut short
    mean = (members[0].data[start:stop] + members[1].data[start:stop].astype(np.float64)) / 2
    # (both stepped with weight 1)
    scale = max(float(np.abs(m.data).max()) for m in members)
    assert float(np.abs(member.array[start:stop] - mean).max()) <= tolerance(codec, scale)
