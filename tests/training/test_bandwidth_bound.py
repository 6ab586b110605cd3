"""A declared bandwidth counts for at most 4x the group's median: a hostile member that
declared 1e300 was handed the whole vector to reduce (every other part empty), and as the
reducer of every part it could send back anything as everyone's mean (a trial measured
every honest tensor set to its 777.0, reported ``averaged``)."""

from __future__ import annotations

import trio
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all

from training import Outcome
from training.averaging.layout import MAX_BANDWIDTH_SPREAD, bounded_bandwidths, split_spans


def test_bandwidths_are_clipped_to_a_multiple_of_the_median() -> None:
    assert bounded_bandwidths([1.0, 1.0, 1e300]) == [1.0, 1.0, MAX_BANDWIDTH_SPREAD]
    assert bounded_bandwidths([10.0, 20.0, 30.0]) == [10.0, 20.0, 30.0]  # honest spreads stay
    assert bounded_bandwidths([]) == []
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
