"""Top-k error feedback: what compression drops is owed, sent later, and nothing is lost.

Values are small integers and weights 1, so every sum below is exact in float32: the
assertions are equalities, not tolerances.
"""

from __future__ import annotations

import numpy as np
import torch
import trio
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all

from protocol.codecs import get_codec
from training import Outcome, PartStatus
from training.averaging.feedback import ErrorFeedback
from training.averaging.layout import FlatVector

SIZE = 4096  # 2 parts of 2 chunks (1024 elements) in a group of 2
ROUNDS = 12


async def test_topk_error_feedback_sends_everything_eventually(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = fast_config(codec="topk", codec_params={"fraction": 0.25})
    rng = np.random.default_rng(3)
    with trio.fail_after(600):
        async with memnet_swarm(2) as (_, nodes):
            members = make_members(nodes, SIZE, config)
            for m in members:
                m.weight = 1.0
                m.data[:] = rng.integers(-8, 9, SIZE).astype(np.float32)
            mean = (members[0].data.astype(np.float64) + members[1].data) / 2
            received = np.zeros(SIZE)  # sum over rounds of the averaged values
            errors = []
            for t in range(1, ROUNDS + 1):
                for m in members:
                    m.array[:] = m.data
                results = await step_all(members, timeout=30.0)
                for info, _ in results:
                    assert info is not None and info.outcome is Outcome.AVERAGED
                    assert all(p.status is PartStatus.ALL for p in info.parts)
                np.testing.assert_array_equal(members[0].array, members[1].array)
                received += members[0].array
                owed = [m.averager.feedback.residual for m in members]  # type: ignore[union-attr]
                # counted_i = t * x_i - owed_i, and the result is the mean of what was counted
                counted = sum(
                    t * m.data.astype(np.float64) - r for m, r in zip(members, owed, strict=True)
                )
                np.testing.assert_array_equal(received, counted / 2)
                errors.append(float(np.abs(received / t - mean).mean()))
    # each round sends the largest quarter of what is owed: the running average closes in
    assert errors[-1] <= errors[0] / 3
    assert max(float(np.abs(r).max()) for r in owed) < 8 * ROUNDS


async def test_a_mean_denser_than_half_a_chunk_comes_back_whole(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With fraction 0.75 of two peers, most result elements are non-zero: those chunks
    travel dense (raw float32). A reducer that kept only the largest half of each lost the
    rest of the mean while both senders' error feedback counted it delivered (fraction
    1.0: 511 of 1024 values wrong, the part reported ``all``, nothing owed)."""
    config = fast_config(codec="topk", codec_params={"fraction": 0.75})
    rng = np.random.default_rng(5)
    with trio.fail_after(120):
        async with memnet_swarm(2) as (_, nodes):
            members = make_members(nodes, SIZE, config)
            for m in members:
                m.weight = 1.0
                m.data[:] = rng.integers(1, 9, SIZE).astype(np.float32)  # no zeros
                m.array[:] = m.data
            results = await step_all(members, timeout=30.0)
            for info, _ in results:
                assert info is not None and info.outcome is Outcome.AVERAGED
            owed = [m.averager.feedback.residual for m in members]  # type: ignore[union-attr]
            counted = sum(m.data.astype(np.float64) - r for m, r in zip(members, owed, strict=True))
            np.testing.assert_array_equal(members[0].array, members[1].array)
            np.testing.assert_array_equal(members[0].array, counted / 2)
            assert np.count_nonzero(members[0].array) > SIZE // 2


def test_a_part_not_counted_stays_owed() -> None:
    codec = get_codec("topk", fraction=0.25)
    tensor = torch.arange(16, dtype=torch.float32) - 8.0
    flat = FlatVector([tensor])
    feedback = ErrorFeedback(16, codec, chunk_elements=4)
    feedback.residual[:] = 0.5
    feedback.begin(flat)
    contribution = tensor.numpy() + 0.5
    np.testing.assert_array_equal(flat.array, contribution)
    for part, (start, stop) in enumerate([(0, 8), (8, 16)]):
        for a in range(start, stop, 4):
            feedback.record(part, a, codec.encode(flat.array[a : a + 4]))

    feedback.finish({0})  # part 0's result header listed us, part 1's reducer did not count us
    sent = np.zeros(8, dtype=np.float32)
    for a in range(0, 8, 4):  # part 0: one value per chunk of 4 was counted
        sent[a : a + 4] = codec.decode(codec.encode(contribution[a : a + 4]))
    np.testing.assert_array_equal(feedback.residual[:8], contribution[:8] - sent)
    assert np.count_nonzero(sent) == 2
    np.testing.assert_array_equal(feedback.residual[8:], contribution[8:])  # all still owed
