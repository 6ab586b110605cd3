"""Consecutive steps in one slot share a round number; the leader's group tag (wire v8) tells
their messages apart.

Before the tag, a chunk of a member's step before, arriving in the reducer's next step of
the same round number, was parked until that step's group was confirmed and then counted
as the member's new chunk: its real chunk then read as a repeat (``garbage``), and the
member was dropped from the part. A ping of the step before was answered "in the round" by
the next step, and a result request of it was served the next step's mean.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from test_averaging_support import fast_config, make_members, memnet_swarm, verify_round

from peer import RemoteError
from protocol.address import Address
from training import AveragingInfo, Outcome
from training.averaging.butterfly import Butterfly
from training.averaging.messages import ChunkHeader
from training.averaging.plan import Plan

WINDOW = 8.0


async def test_messages_of_the_step_before_in_a_round_of_the_same_number_are_not_found(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two members step twice early in a long slot (closed early: each knows the other), so
    both steps are in a round of the same number. As its second step begins, the first
    member sends the other, by hand, a chunk 0 of the other's part with its first step's
    values (same epoch and weight), a ping and a result request, all naming the first
    step's group: each is ``not_found``, and the second step averages everything, dropping
    nobody."""
    config = fast_config(gather_window=WINDOW, chunk_bytes=16 << 10)
    plans: dict[int, list[Plan]] = {0: [], 1: []}
    sent: list[list[np.ndarray]] = [[], []]  # each member's data at each step
    answers: list[str] = []
    run = Butterfly.run

    async def ask(b: Butterfly, address: Address, method: str, body: Any, payload: bytes) -> None:
        try:
            if method == "result":
                async with b.node.rpc.stream(address, f"{b.methods}.result", body) as items:
                    async for _ in items:
                        pass
            else:
                await b.node.rpc.call(address, f"{b.methods}.{method}", body, payload)
            answers.append(f"{method}: ok")
        except RemoteError as exc:
            answers.append(f"{method}: {exc.code}")

    async def run_after_stale(self: Butterfly, cutoff: float, deadline: float) -> Any:
        who = 0 if self.plan.me == members[0].peer_id else 1
        plans[who].append(self.plan)
        if who == 0 and len(plans[0]) == 3:  # the second step of the pair (after a warm-up)
            old, new = plans[0][1], self.plan
            assert (old.round, set(old.group)) == (new.round, set(new.group))
            assert old.group_id != new.group_id
            # the other's part in this step (the step before may have ordered the group
            # otherwise): only the tag tells the stale chunk from a new one
            index = next(i for i, r in enumerate(new.reducers) if r.peer_id != new.me)
            address = new.address(new.reducers[index].peer_id)
            assert address is not None
            me = old.member(old.me)
            assert me is not None
            start = new.spans[index][0]
            values = sent[0][1][start : start + config.chunk_elements]  # the first step's
            header = ChunkHeader(
                old.round, index, 0, me.epoch, me.weight, raw=True, group_id=old.group_id
            )
            stale = {"round": old.round, "group": old.group_id}
            await ask(self, address, "chunk", header.to_body(), values.tobytes())
            await ask(self, address, "ping", stale, b"")
            await ask(self, address, "result", {**stale, "part": index}, b"")
        return await run(self, cutoff, deadline)

    monkeypatch.setattr(Butterfly, "run", run_after_stale)
    with trio.fail_after(300):
        async with memnet_swarm(2, first_seed=7) as (_, nodes):
            members = make_members(nodes, 1 << 16, config)
            infos: list[list[AveragingInfo]] = [[], []]

            async def one(i: int, steps: int) -> None:
                member = members[i]
                member.weight = 1.0
                for k in range(steps):
                    if k:  # work between the steps: the second step averages new values
                        member.array += 10.0 * (i + 1)
                    member.data = member.array.copy()
                    sent[i].append(member.data)
                    infos[i].append(await member.averager.step(weight=1.0, timeout=60.0))

            async with trio.open_nursery() as nursery:  # each learns the other
                for i in range(2):
                    nursery.start_soon(one, i, 1)
            assert all(rows[0].outcome is Outcome.AVERAGED for rows in infos)
            await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.1)  # early in a slot
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(one, i, 2)
    first, second = ([rows[k] for rows in infos] for k in (1, 2))
    assert len({i.round for i in first + second}) == 1  # one round number for both steps
    # the report's group_id tells the two exchanges apart
    assert len({i.group_id for i in first}) == len({i.group_id for i in second}) == 1
    assert first[0].group_id != second[0].group_id and first[0].group_id is not None
    assert answers == ["chunk: not_found", "ping: not_found", "result: not_found"], answers
    for info in second:
        assert info.outcome is Outcome.AVERAGED and not info.dropped, str(info)
    verify_round(members, second)  # the mean of the second step's values, nothing stale
    np.testing.assert_array_equal(members[0].array, members[1].array)


async def test_stale_group_ping_and_result_while_next_step_unconfirmed(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A and B average (round r, group g1) early in a slot; B steps again at once (alone:
    A does not step), in a round of the same number, not confirmed. A's ping and result
    request naming g1 are ``not_found``: B left g1. (A review: the ping was answered alive
    and the result request held, until B's next step had a group of its own.)"""
    config = fast_config(gather_window=WINDOW, chunk_bytes=16 << 10)
    plans: dict[int, list[Plan]] = {0: [], 1: []}
    run = Butterfly.run

    async def recording_run(self: Butterfly, cutoff: float, deadline: float) -> Any:
        plans[0 if self.plan.me == members[0].peer_id else 1].append(self.plan)
        return await run(self, cutoff, deadline)

    monkeypatch.setattr(Butterfly, "run", recording_run)
    answers: list[str] = []
    with trio.fail_after(300):
        async with memnet_swarm(2, first_seed=7) as (_, nodes):
            members = make_members(nodes, 1 << 16, config)
            infos: list[list[AveragingInfo]] = [[], []]

            async def one(i: int) -> None:
                infos[i].append(await members[i].averager.step(weight=1.0, timeout=60.0))

            for _ in range(2):  # a warm-up, then a step early in a slot
                async with trio.open_nursery() as nursery:
                    for i in range(2):
                        nursery.start_soon(one, i)
                if len(infos[0]) == 1:
                    await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.1)
            assert all(rows[-1].outcome is Outcome.AVERAGED for rows in infos)
            old = plans[0][-1]
            b = members[1].averager
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 1)  # B's next step, alone
                await trio.sleep(0.5)
                assert b._active is not None and b._active.round == old.round
                assert not b._active.ready.is_set()
                index = next(i for i, r in enumerate(old.reducers) if r.peer_id != old.me)
                address = old.address(old.reducers[index].peer_id)
                assert isinstance(address, Address)
                node = members[0].averager.node
                methods = members[0].averager._methods
                stale = {"round": old.round, "group": old.group_id}
                try:
                    await node.rpc.call(address, f"{methods}.ping", stale)
                    answers.append("ping: ok")
                except RemoteError as exc:
                    answers.append(f"ping: {exc.code}")
                with trio.move_on_after(2.0) as scope:
                    try:
                        async with node.rpc.stream(
                            address, f"{methods}.result", {**stale, "part": index}
                        ) as items:
                            async for _ in items:
                                pass
                        answers.append("result: ok")
                    except RemoteError as exc:
                        answers.append(f"result: {exc.code}")
                if scope.cancelled_caught:
                    answers.append("result: no answer in 2 s")
    assert answers == ["ping: not_found", "result: not_found"], answers


async def test_a_member_that_left_and_stepped_again_is_dropped_within_a_stall_timeout(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A and B are confirmed together (round r, group g1) early in a slot; the first to
    start its all-reduce (X) is cancelled at once and steps again right away: its next step
    is in a round of the same number, not confirmed (the other does not step again). The
    other (Y) finds X gone within a stall timeout: X's word that it left, or the ping naming
    g1, which X left. (A review: X's next step answered the ping "alive" and held Y's result
    request, and Y waited 7.4 s, until X's next step left the round.)"""
    stall = 2.0
    config = fast_config(gather_window=WINDOW, chunk_bytes=16 << 10, stall_timeout=stall)
    phase = [0]
    chosen: list[int] = []
    scopes: dict[int, trio.CancelScope] = {}
    run = Butterfly.run

    async def cancelling_run(self: Butterfly, cutoff: float, deadline: float) -> Any:
        who = 0 if self.plan.me == members[0].peer_id else 1
        if phase[0] == 1 and not chosen:
            chosen.append(who)
            scopes[who].cancel()
            await trio.lowlevel.checkpoint()
        return await run(self, cutoff, deadline)

    monkeypatch.setattr(Butterfly, "run", cancelling_run)
    with trio.fail_after(300):
        async with memnet_swarm(2, first_seed=7) as (_, nodes):
            members = make_members(nodes, 1 << 16, config)
            infos: dict[int, AveragingInfo] = {}

            async def one(i: int) -> None:
                with trio.CancelScope() as scopes[i]:
                    infos[i] = await members[i].averager.step(weight=1.0, timeout=40.0)
                    return
                await members[i].averager.step(weight=1.0, timeout=40.0)  # X, at once

            async with trio.open_nursery() as nursery:  # warm-up
                for i in range(2):
                    nursery.start_soon(one, i)
            await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.1)
            phase[0] = 1
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(one, i)
    x = chosen[0]
    y = 1 - x
    info = infos[y]
    assert info.allreduce_s < stall, info.allreduce_s
