"""``PartReport.counted``: whether the reducer's result header listed this peer, so that
with ``topk`` what it sent for the part is no longer owed, even when the result did not
reach it. A reducer killed once every survivor had its header, before any chunk: the
survivors reported the part ``none`` and no longer owed their top-k values, and nothing
told them (a review): following the docs' advice (zero the ``none`` parts) lost them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from test_allreduce_faults import non_leader, watch_streams_from
from test_averaging_support import fast_config, host_of, make_members, memnet_swarm, step_all

from training import PartStatus
from training.averaging.reducing import ReducerService

SIZE = 16_384


async def test_a_part_whose_reducer_died_after_its_header_is_reported_counted(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(4) as (net, nodes):
            config = fast_config(codec="topk", codec_params={"fraction": 0.25})
            members = make_members(nodes, SIZE, config)
            victim = non_leader(members)
            victim_id = members[victim].peer_id
            serve = ReducerService.results

            async def header_only(self: ReducerService, member: Any) -> AsyncIterator[Any]:
                async with aclosing(serve(self, member)) as items:
                    async for item in items:
                        yield item
                        if self.plan.me == victim_id:  # the header: then nothing more
                            await trio.sleep_forever()

            monkeypatch.setattr(ReducerService, "results", header_only)
            headers: list[int] = []

            def count_header() -> None:
                headers.append(1)
                if len(headers) == len(members) - 1:
                    net.kill_host(host_of(victim))

            for i, member in enumerate(members):
                if i != victim:
                    watch_streams_from(member, victim_id, count_header)
            results = await step_all(members, timeout=30.0)
            for i, (info, _) in enumerate(results):
                if i == victim:
                    continue
                member = members[i]
                for part in info.parts:
                    a, b = part.span
                    owed = member.averager.feedback.residual[a:b]
                    if part.reducer != victim_id:
                        assert part.received and part.counted
                        continue
                    assert part.status is PartStatus.NONE and not part.received
                    assert part.counted  # its values went into a mean it did not get
                    assert np.array_equal(member.array[a:b], member.data[a:b])  # kept
                    # no longer owed in full: the top-k values sent were subtracted
                    assert np.abs(owed).sum() < 0.9 * np.abs(member.data[a:b]).sum()


async def test_a_part_cut_short_by_our_own_deadline_after_its_header_is_counted(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member whose own deadline ended its download after the header came (the others
    got the mean, its values in it) reported ``counted`` False and kept its top-k values
    owed: sent again next round, they counted twice (a review of ``counted``)."""
    with trio.fail_after(120):
        async with memnet_swarm(4) as (_net, nodes):
            config = fast_config(codec="topk", codec_params={"fraction": 0.25}, stall_timeout=60.0)
            members = make_members(nodes, SIZE, config)
            victim = non_leader(members)
            victim_id = members[victim].peer_id
            slow = (victim + 1) % len(members)
            slow_id = members[slow].peer_id
            serve = ReducerService.results

            async def slow_for_one(self: ReducerService, member: Any) -> AsyncIterator[Any]:
                async with aclosing(serve(self, member)) as items:
                    async for item in items:
                        yield item
                        if self.plan.me == victim_id and member == slow_id:
                            await trio.sleep_forever()  # the header, then nothing in time

            monkeypatch.setattr(ReducerService, "results", slow_for_one)
            results = await step_all(members, timeout=8.0)
            info = results[slow][0]
            (part,) = [p for p in info.parts if p.reducer == victim_id]
            assert part.status is PartStatus.NONE and not part.received
            others = [
                p
                for i, (other, _) in enumerate(results)
                if i not in (slow, victim)
                for p in other.parts
                if p.reducer == victim_id
            ]
            assert others and all(p.received and slow_id in p.contributors for p in others)
            assert part.counted
            a, b = part.span
            owed = members[slow].averager.feedback.residual[a:b]
            assert np.abs(owed).sum() < 0.9 * np.abs(members[slow].data[a:b]).sum()
