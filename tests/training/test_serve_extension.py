"""A reducer serves its mean on past a stall timeout without downloads while a member
that has not fetched it answers that it is in the round (a slow member, its download slots
held by other parts, came after the reducer had stopped and lost the part), but only for as
many stall timeouts as a member with one download slot could need to come to the part: one
that never fetches (hostile, or gave up on the part) does not hold the reducer's step to
its deadline (ReducerService.serve)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from test_allreduce_faults import non_leader
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all, verify_round

from peer import RemoteError, Request
from training import Outcome, PartStatus
from training.averaging.averager import Averager
from training.averaging.butterfly import Butterfly

STALL = 4.0
DEADLINE = 200.0  # far beyond what serving needs: its bound shows


def hold_download(
    monkeypatch: pytest.MonkeyPatch, member: Any, reducer: Any, delay: float | None
) -> list[float]:
    """``member`` starts its download of ``reducer``'s part ``delay`` seconds late (never,
    with None), out of reach of the download's stall watch; the time it started is noted."""
    download = Butterfly._download
    started: list[float] = []

    async def late_download(self: Butterfly, index: int, address: Any, encoded: Any) -> Any:
        if self.plan.me == member and self.plan.reducers[index].peer_id == reducer:
            if delay is None:
                await trio.sleep_forever()
            await trio.sleep(delay)
            started.append(trio.current_time())
        return await download(self, index, address, encoded)

    monkeypatch.setattr(Butterfly, "_download", late_download)
    return started


async def test_a_member_that_comes_late_for_a_part_but_answers_still_gets_it(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE * 2):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 3 * 4096, fast_config(stall_timeout=STALL))
            slow = non_leader(members)
            reducer = (slow + 1) % 3
            late = 2.5 * STALL  # two stall timeouts without a download at the reducer
            started = hold_download(
                monkeypatch, members[slow].peer_id, members[reducer].peer_id, late
            )
            results = await step_all(members, timeout=DEADLINE)
            infos = [info for info, _ in results]
            verify_round(members, infos)  # type: ignore[arg-type]
            assert started, "the late download never started"
            for info, _ in results:
                assert info is not None and info.outcome is Outcome.AVERAGED, str(info)
                assert all(p.status is PartStatus.ALL for p in info.parts), str(info)
            # the reducer's step ended soon after the late member had the part
            assert results[reducer][1] < late + 2 * STALL, results[reducer][1]


async def test_a_member_that_never_fetches_a_part_holds_its_reducer_a_bounded_time(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE * 2):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 3 * 4096, fast_config(stall_timeout=STALL))
            never = non_leader(members)
            reducer = (never + 1) % 3
            hold_download(monkeypatch, members[never].peer_id, members[reducer].peer_id, None)
            results = await step_all(members, timeout=DEADLINE)
            info, took = results[reducer]
            assert info is not None and info.outcome is Outcome.AVERAGED, str(info)
            # served on past the first stall timeout (the member answered pings), then
            # stopped after one extension per reducer of the plan (3): not at the deadline
            assert 2 * STALL < took <= (3 + 1) * STALL + 2.0, took
            third = 3 - never - reducer
            assert results[third][1] < STALL, results[third][1]


async def test_a_never_fetcher_that_left_the_round_releases_the_reducer_at_the_first_stall(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extension asks: a member that has not fetched and answers that it is no longer
    in the round (``not_found``) is not waited for again (a review: serving on without
    asking passed the two tests above)."""
    original = Averager._on_ping
    gone: list[Any] = []

    async def on_ping(self: Averager, request: Request) -> Any:
        if gone and self.node.peer_id == gone[0] and request.body.get("round") is not None:
            raise RemoteError("not_found", "not in this round")
        return await original(self, request)

    monkeypatch.setattr(Averager, "_on_ping", on_ping)  # before the averagers register it
    with trio.fail_after(DEADLINE * 2):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 3 * 4096, fast_config(stall_timeout=STALL))
            never = non_leader(members)
            gone.append(members[never].peer_id)
            reducer = (never + 1) % 3
            hold_download(monkeypatch, members[never].peer_id, members[reducer].peer_id, None)
            results = await step_all(members, timeout=DEADLINE)
            info, took = results[reducer]
            assert info is not None and info.outcome is Outcome.AVERAGED, str(info)
            assert took <= 1.5 * STALL, took  # one stall timeout and a ping, not four
