"""Review of two changes: layouts in matchmaking (a peer that met its own layout sits out a
round of strangers; early close counts its own layout) and the liveness rule (late ping
answers with bytes arriving mean busy). Scenarios from issue 4 and docs/averaging.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import trio
import trio.testing
from test_allreduce_faults import SIZE, after_acks
from test_averaging_support import (
    Member,
    fast_config,
    make_members,
    memnet_swarm,
    step_all,
    step_or_mismatch,
    verify_round,
)

from training import (
    Averager,
    AveragingInfo,
    DropReason,
    LayoutMismatchError,
    Outcome,
    PartStatus,
)
from training.averaging.grouping import round_key

WINDOW = 4.0


async def _matchmaking_times(
    configs: Sequence[Mapping[str, object]], rounds: int
) -> list[list[float]]:
    times: list[list[float]] = []
    async with memnet_swarm(len(configs)) as (_, nodes):
        members = [
            make_members([node], 500, fast_config(gather_window=WINDOW, **cfg), seed=i)[0]
            for i, (node, cfg) in enumerate(zip(nodes, configs, strict=True))
        ]
        for _ in range(rounds):
            results = await step_all(members, timeout=30.0)
            for info, _ in results:
                assert info is not None and info.outcome is Outcome.AVERAGED, info
            times.append([info.matchmaking_s for info, _ in results])  # type: ignore[union-attr]
            await trio.sleep(0.01)
    return times


async def test_two_correct_sub_swarms_under_one_prefix_still_close_early(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two group sizes under one prefix are a supported set-up (docs: they group apart):
    a steady swarm of each kind must close its rounds early like a swarm of one kind,
    not wait for every slot's close because the other kind is there."""
    with trio.fail_after(300):
        one_kind = await _matchmaking_times([{"group_size": 16}] * 5, rounds=4)
        two_kinds = await _matchmaking_times(
            [{"group_size": 2}] * 2 + [{"group_size": 16}] * 3, rounds=4
        )
    print("one kind", one_kind, "two kinds", two_kinds)
    assert max(one_kind[-1]) < WINDOW / 2
    assert max(two_kinds[-1]) < WINDOW / 2


async def test_a_straggler_left_with_the_old_layout_is_told_after_a_few_rounds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The owner changed the model: every peer restarts with the new layout but one
    straggler, which has averaged with its own kind before. A lone stranger may be a
    misconfigured newcomer (the straggler sits that round out), but a stranger layout with
    company round after round is the swarm: the straggler gets ``LayoutMismatchError``
    instead of ``alone`` forever, and the new swarm averages meanwhile."""
    with trio.fail_after(300):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 500, fast_config())
            for info, _ in await step_all(members, timeout=20.0):
                assert info is not None and info.outcome is Outcome.AVERAGED
            straggler = members[0].averager
            for m in members[1:]:
                m.averager.close()
            restarted = make_members(nodes[1:], 600, fast_config(), seed=5)
            outcomes: list[Outcome | str] = []
            for _ in range(6):
                outcomes.append(await _step_beside(straggler, restarted))
                if outcomes[-1] == "mismatch":
                    break
    print(outcomes)
    assert outcomes[-1] == "mismatch" and len(outcomes) <= 3
    assert all(o is Outcome.ALONE for o in outcomes[:-1])


async def _step_beside(averager: Averager, others: list[Member]) -> Outcome | str:
    """One step of ``averager`` while ``others`` step too: its outcome, or "mismatch"."""
    outcome: Outcome | str = "none"

    async def one() -> None:
        nonlocal outcome
        try:
            outcome = (await averager.step(timeout=20.0)).outcome
        except LayoutMismatchError as exc:
            assert "3 rounds" in str(exc), exc
            outcome = "mismatch"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        results = await step_all(others, timeout=20.0)
    for info, _ in results:  # the others never wait for us
        assert info is not None and info.outcome is Outcome.AVERAGED, info
    return outcome


@pytest.mark.parametrize("client_mode", [False, True], ids=["pingable", "client-mode"])
async def test_a_member_that_left_the_round_but_talks_to_us_is_dropped_at_once(
    autojump_clock: trio.testing.MockClock, client_mode: bool
) -> None:
    """A member's step is cancelled mid-upload (it left the round), and its node goes on
    with DHT traffic to everybody (its next step polls the round key). Bytes from it keep
    arriving, but it will never send the rest: the survivors drop it as dead within a few
    stall timeouts, not at the cutoff, and their tensors are what their reports say."""
    with trio.fail_after(300):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes[:3], SIZE, fast_config(max_inflight=3))
            config = fast_config(max_inflight=3, client_mode=client_mode)
            members += make_members(nodes[3:], SIZE, config)
            leaver = members[3]
            survivors = members[:3]
            left = trio.CancelScope()
            after_acks(leaver, 2, left.cancel)

            async def leaver_step() -> None:
                with left:
                    await leaver.averager.step(leaver.weight, timeout=30.0)
                while True:  # still talking to the swarm, as its next step would
                    await leaver.averager.node.dht.get_entries(round_key("t/x", 1))
                    await trio.sleep(0.1)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(leaver_step)
                results = await step_all(survivors, timeout=30.0)
                nursery.cancel_scope.cancel()
    infos = [info for info, _ in results]
    verify_round(survivors, infos, without_report=[leaver])  # type: ignore[arg-type]
    stall = survivors[0].averager.config.stall_timeout
    for info in infos:
        assert info is not None
        assert info.allreduce_s <= 3 * stall, info.allreduce_s
        assert len(info.group) == 4
        for part in info.parts:
            if leaver.peer_id not in part.contributors and part.reducer != leaver.peer_id:
                assert part.status is PartStatus.SOME
                assert part.dropped[leaver.peer_id] is DropReason.DEAD, part


async def test_a_member_alive_to_pings_that_never_completes_a_chunk_ends_by_the_cutoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hostile member keeps its connections busy and answers every ping (as one
    trickling a byte a second would count as alive) but never completes another chunk:
    nobody waits past the step's timeout, it is dropped as ``timeout`` where it owed
    chunks, and every report matches the tensors."""
    timeout = 12.0
    with trio.fail_after(300):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            hostile = members[3]
            rpc = hostile.averager.node.rpc
            call = rpc.call
            acked: dict[int, int] = {}

            async def stalling_call(
                address: Any, method: str, body: Any = None, payload: Any = b""
            ) -> Any:
                if method.endswith(".chunk"):
                    if acked.get(body["part"], 0) >= 2:
                        await trio.sleep_forever()
                    acked[body["part"]] = acked.get(body["part"], 0) + 1
                return await call(address, method, body, payload)

            rpc.call = stalling_call  # type: ignore[method-assign]
            results = await step_all(members, timeout=timeout)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    for i, (info, elapsed) in enumerate(results):
        assert info is not None and elapsed <= timeout + 1e-6, (i, elapsed)
        if i == 3:
            continue
        assert info.outcome is Outcome.PARTIAL, info
        for part in info.parts:
            if part.reducer != hostile.peer_id:
                assert part.status is PartStatus.SOME
                assert part.dropped[hostile.peer_id] is DropReason.TIMEOUT, part


async def test_a_lone_misconfigured_newcomer_retrying_never_raises_in_a_correct_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The trade-off's other side: a newcomer of another layout, restarted round after
    round (its loop catches the error and steps again), beside one correct peer that
    averaged with its own kind before: the newcomer is told every time, the correct peer
    sits each round out (its note counts the stranger) and never raises."""
    with trio.fail_after(300):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes[:2], 500, fast_config())
            for info, _ in await step_all(members, timeout=20.0):
                assert info is not None and info.outcome is Outcome.AVERAGED
            members[1].averager.close()
            newcomer = make_members(nodes[2:], 600, fast_config(), seed=3)[0].averager
            notes = []
            for _ in range(5):
                outcome: list[AveragingInfo | LayoutMismatchError] = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(step_or_mismatch, newcomer, 20.0, outcome)
                    info = await members[0].averager.step(timeout=20.0)
                assert len(outcome) == 1 and isinstance(outcome[0], LayoutMismatchError)
                assert info.outcome is Outcome.ALONE, info
                notes.append(info.note)
    print(notes)
    assert all("1 peer(s) of another layout declared" in note for note in notes)
