"""A part whose only contributor is this peer is no group result for it: the report says
``none`` (with a note) and the tensor keeps its own values, bit for bit, instead of
``some`` over itself with its values put through the codec (an int8 round quantized
them). A trial found it on a peer frozen through the all-reduce: back, it reported its own
part ``some`` over itself, and ``received_fraction`` counted it."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all, verify_round

from training import Outcome, PartStatus
from training.averaging.butterfly import SOLO_NOTE

SIZE = 8192


@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("nan_at", [[5], [5, SIZE - 1]])
async def test_a_part_averaged_over_ourselves_alone_keeps_our_values(
    autojump_clock: trio.testing.MockClock, codec: str, nan_at: list[int]
) -> None:
    """Two peers; the victim has NaN in one part (or both): its values there are dropped,
    so that part's mean is the other peer's values alone, wherever it was reduced. The
    other peer keeps its own values there (its own part, or the victim's); the victim takes
    them (``some``, the mean over the other)."""
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config(codec=codec))
            other, victim = members
            victim.data[nan_at] = np.nan
            victim.array[:] = victim.data
            results = await step_all(members, timeout=20.0)
    infos = [info for info, _ in results]
    verify_round(members, infos, codec=codec)  # type: ignore[arg-type]
    other_info, victim_info = infos
    assert other_info is not None and victim_info is not None
    for mine, theirs in zip(other_info.parts, victim_info.parts, strict=True):
        start, stop = mine.span
        if any(start <= i < stop for i in nan_at):
            assert mine.status is PartStatus.NONE and not mine.received
            assert mine.note == SOLO_NOTE and mine.contributors == ()
            np.testing.assert_array_equal(other.array[start:stop], other.data[start:stop])
            assert theirs.status is PartStatus.SOME
            assert theirs.contributors == (other.peer_id,)
            largest = np.abs(other.data[start:stop]).max()
            bound = largest * (1e-6 if codec == "none" else 1 / 127)
            assert np.abs(victim.array[start:stop] - other.data[start:stop]).max() <= bound
        else:
            assert mine.status is PartStatus.ALL and theirs.status is PartStatus.ALL
    assert (
        other_info.received_fraction
        == 1 - sum(1 for p in other_info.parts if p.status is PartStatus.NONE) * (SIZE // 2) / SIZE
    )
    if len(nan_at) == 1:  # the one line says that the rest was averaged over fewer
        assert str(victim_info).startswith("partial 50% over 2 peers, 100% over some of them")
        assert str(other_info).startswith("partial 50% over 2 peers in round")
    if len(nan_at) == 2:  # nothing of the group reached the other peer
        assert other_info.outcome is Outcome.FAILED
        np.testing.assert_array_equal(other.array, other.data)
