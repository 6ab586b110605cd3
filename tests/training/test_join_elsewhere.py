"""A peer the round put in another group cannot join ours as well. A hostile trial's peer
joined every other leader with room after its round closed; each accepted it as an
unexpected caller (slightly different views of the round end in one group that way),
gave it a part, and averaged partially without it: 13 of 40 honest steps partial. A
caller we did not see declare at all is still welcome. Memory network, virtual time."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import trio
from test_averaging_support import (
    Member,
    fast_config,
    make_members,
    memnet_swarm,
    slow_joins,
    step_all,
    verify_round,
)

from protocol.address import Address
from training import Outcome
from training.averaging.grouping import round_key
from training.averaging.messages import GroupConfirmation, method_prefix
from training.averaging.round_state import RoundState


async def _two_leaders(members: list[Member]) -> list[RoundState]:
    """Once every member's round is decided, the states of its two leaders."""
    while True:
        states = [m.averager._matchmaker.current for m in members]
        if all(s is not None and s.closed.is_set() for s in states):
            leaders = [s for s in states if s is not None and s.is_leader]
            if len(leaders) == 2:
                return leaders
        await trio.sleep(0.001)


def _two_groups_of_three_averaged(members: list[Member], results: list[Any]) -> None:
    infos = [info for info, _ in results]
    verify_round(members, infos)
    for info in infos:
        assert info is not None and info.outcome is Outcome.AVERAGED, info
        assert len(info.group) == 3


async def test_a_member_of_another_group_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(6) as (_, nodes):
            # 6 peers, group_size 4: two groups of 3 on the grid, each with room for one
            members = make_members(nodes, 3000, fast_config(group_size=4))
            calls = {m.peer_id: m.averager.node.rpc.call for m in members}
            for m in members:  # the honest joins come a little late: the leaders wait
                slow_joins(m.averager.node, 0.3)  # within the leader's join_timeout (0.5 s)
            replies: list[object] = []

            async def join_the_other_group() -> None:
                leaders = await _two_leaders(members)
                ours, theirs = leaders
                joiner = next(
                    m for m in members if m.peer_id in ours.order and m.peer_id != ours.me.peer_id
                )
                state = joiner.averager._matchmaker.current
                assert state is not None and theirs.me.address is not None
                body = {"round": state.number, "decl": state.me.to_wire()}
                reply = await calls[joiner.peer_id](
                    Address.parse(theirs.me.address), f"{method_prefix('t/x')}.join", body
                )
                replies.append(reply.body)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(join_the_other_group)
                results = await step_all(members, timeout=20.0)
            assert replies == [{"status": "full"}]
            _two_groups_of_three_averaged(members, results)


async def test_a_confirmed_member_that_joins_again_gets_the_same_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A member's join answer can be lost with its connection, or a peer it asked can send
    it back to the leader: asked again while its step is in the round, the leader answers
    with the same confirmation (what is left of its budget), not "not in round", which
    makes the member skip a live leader as gone (a hostile probe's repeated join)."""
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 3000, fast_config())
            answered: list[GroupConfirmation] = []

            async def join_again() -> None:
                while True:  # every member past matchmaking, the leader's answer given
                    leaders = [m.averager._matchmaker.led for m in members]
                    led = next((s for s in leaders if s is not None), None)
                    if led is not None and all(
                        m.averager._matchmaker.current is None for m in members
                    ):
                        break
                    await trio.sleep(0.001)
                assert led.confirmation is not None and led.me.address is not None
                joiner = next(m for m in members if m.peer_id != led.me.peer_id)
                decl = next(d for d in led.confirmation.members if d.peer_id == joiner.peer_id)
                body = {"round": led.number, "decl": decl.to_wire()}
                reply = await joiner.averager.node.rpc.call(
                    Address.parse(led.me.address), f"{method_prefix('t/x')}.join", body
                )
                again = GroupConfirmation.from_body(reply.body, 3000)
                first = led.confirmation
                assert 0 < again.budget <= first.budget
                assert again == replace(first, budget=again.budget)
                answered.append(again)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(join_again)
                results = await step_all(members, timeout=20.0)
            assert len(answered) == 1
            infos = [info for info, _ in results]
            verify_round(members, infos)  # type: ignore[arg-type]
            for info, _ in results:
                assert info is not None and info.outcome is Outcome.AVERAGED, info


async def test_a_caller_that_never_declared_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer that never declares skipped the check above (nobody saw it in another
    group): it joined every leader with room, took its share of the vector and froze, and
    every honest step ended partial, 0 % averaged, at its timeout (an outside review). An
    unexpected caller must have a declaration in the round now."""
    with trio.fail_after(60):
        async with memnet_swarm(7) as (_, nodes):
            intruder, honest_nodes = nodes[6], nodes[:6]
            # 6 peers, group_size 4: two groups of 3 on the grid, each with room for one
            members = make_members(honest_nodes, 3000, fast_config(group_size=4))
            for m in members:  # the honest joins come a little late: the leaders wait
                slow_joins(m.averager.node, 0.3)
            replies: list[object] = []

            async def join_a_leader() -> None:
                leaders = await _two_leaders(members)
                leader = leaders[0]
                assert leader.me.address is not None
                forged = replace(leader.me, peer_id=intruder.peer_id, address=intruder.address)
                body = {"round": leader.number, "decl": forged.to_wire()}
                reply = await intruder.rpc.call(
                    Address.parse(leader.me.address), f"{method_prefix('t/x')}.join", body
                )
                replies.append(reply.body)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(join_a_leader)
                results = await step_all(members, timeout=20.0)
            assert replies == [{"status": "full"}]
            _two_groups_of_three_averaged(members, results)


async def test_a_declared_caller_is_awaited_while_the_leader_reads_the_round(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A caller the leader did not see declare (it declared after the leader's window: another
    view of the round) is checked with a read of the round key. The members the leader
    expects may all join during that read: the leader must not answer them first, which
    left the caller "closed" and alone in the next round (a CI run at 0.25 s of latency)."""
    with trio.fail_after(60):
        async with memnet_swarm(7) as (_, nodes):
            late, honest_nodes = nodes[6], nodes[:6]
            # 6 peers, group_size 4: two groups of 3 on the grid, each with room for one
            members = make_members(honest_nodes, 3000, fast_config(group_size=4))
            for m in members:  # the expected joins land while the leader reads (0.3 s)
                slow_joins(m.averager.node, 0.3)
            replies: list[object] = []

            async def declare_late_and_join() -> None:
                leader = (await _two_leaders(members))[0]
                assert leader.me.address is not None
                node = next(m.averager.node for m in members if m.peer_id == leader.me.peer_id)
                get_entries = node.dht.get_entries

                async def slow_read(key: str) -> Any:
                    await trio.sleep(0.4)  # within the leader's join_timeout (0.5 s)
                    return await get_entries(key)

                node.dht.get_entries = slow_read  # type: ignore[method-assign,assignment]
                decl = replace(leader.me, peer_id=late.peer_id, address=late.address)
                key = round_key("t/x", leader.number)
                assert await late.dht.store(key, decl.to_wire(), ttl=30.0, subkey=str(late.peer_id))
                body = {"round": leader.number, "decl": decl.to_wire()}
                reply = await late.rpc.call(
                    Address.parse(leader.me.address), f"{method_prefix('t/x')}.join", body
                )
                replies.append(reply.body)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(declare_late_and_join)
                await step_all(members, timeout=20.0)
            assert len(replies) == 1
            reply = replies[0]
            assert isinstance(reply, dict) and reply.get("status") != "closed", reply
            confirmed = GroupConfirmation.from_body(reply, 3000)
            assert late.peer_id in {m.peer_id for m in confirmed.members}
            assert len(confirmed.members) == 4
