"""A declared bandwidth counts for at most 4x the group's median: a hostile member that
declared 1e300 was handed the whole vector to reduce (every other part empty), and as the
reducer of every part it could send back anything as everyone's mean (a trial measured
every honest tensor set to its 777.0, reported ``averaged``)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all, verify_round

from training import Outcome, PartStatus
from training.averaging.layout import MAX_BANDWIDTH_SPREAD, bounded_bandwidths, split_spans


def test_bandwidths_are_clipped_to_a_multiple_of_the_median() -> None:
    assert bounded_bandwidths([1.0, 1.0, 1e300]) == [1.0, 1.0, MAX_BANDWIDTH_SPREAD]
    assert bounded_bandwidths([10.0, 20.0, 30.0]) == [10.0, 20.0, 30.0]  # honest spreads stay
    assert bounded_bandwidths([]) == []
    # a pair: the median of two is their mean, which a liar sets (a trial: 1 and 1e300
    # handed the liar the whole vector); the lower median bounds it to 4x the other's share
    assert bounded_bandwidths([1.0, 1e300]) == [1.0, MAX_BANDWIDTH_SPREAD]
    assert bounded_bandwidths([1.0, 2.0, 3.0, 1e300]) == [1.0, 2.0, 3.0, 2 * MAX_BANDWIDTH_SPREAD]
    spans = split_spans(1 << 20, bounded_bandwidths([1.0, 1.0, 1e300]))
    sizes = [stop - start for start, stop in spans]
    assert min(sizes) > 0 and max(sizes) <= (1 << 20) * 4 / 6 + 4096


async def test_a_member_declaring_a_huge_bandwidth_gets_a_bounded_part(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(3) as (_, nodes):
            size = 3 * 16_384
            members = make_members(nodes[:2], size, fast_config())
            members += make_members(nodes[2:], size, fast_config(bandwidth=1e300), seed=1)
            results = await step_all(members, timeout=20.0)
    for info, _ in results:
        assert info is not None and info.outcome is Outcome.AVERAGED
        sizes = {part.reducer: part.span[1] - part.span[0] for part in info.parts}
        assert sizes[members[2].peer_id] <= size * 4 / 6 + 4096, sizes
        assert all(sizes[m.peer_id] > 0 for m in members[:2]), sizes


@pytest.mark.parametrize("first_seed", [1, 20, 40, 60])
async def test_an_empty_part_is_served_to_a_member_that_fetches_one_part_at_a_time(
    autojump_clock: trio.testing.MockClock, first_seed: int
) -> None:
    """A member declaring a tiny bandwidth reduces an empty part; its header (no chunks)
    used to go unserved once its step ended, so a member fetching its parts one at a time
    (``max_downloads=1``) reached it late, was refused, and reported it ``dead`` while the
    others reported the part ``all`` (a new-user trial, 4 of 5 runs)."""
    with trio.fail_after(120):
        async with memnet_swarm(4, first_seed=first_seed) as (_, nodes):
            size = 3 * 65_536
            members = make_members(nodes[:2], size, fast_config())
            members += make_members(nodes[2:3], size, fast_config(bandwidth=1e-300), seed=1)
            members += make_members(nodes[3:], size, fast_config(max_downloads=1), seed=2)
            results = await step_all(members, timeout=20.0)
            infos = [info for info, _ in results if info is not None]
            verify_round(members, infos)
    tiny = members[2].peer_id
    for info in infos:
        (empty,) = [p for p in info.parts if p.reducer == tiny]
        assert empty.size == 0 and empty.status is PartStatus.ALL, str(info)
        assert info.outcome is Outcome.AVERAGED and not info.dropped, str(info)
