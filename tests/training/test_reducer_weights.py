"""The reducer's convex sums: any positive finite weights, values up to float32's largest,
and a mean the codec cannot send back refused with a note (never served as infinity)."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.codecs import get_codec
from protocol.identity import Identity, PeerID
from training.averaging.reducer import DropReason, Member, PartReducer, wide_sum_wanted
from training.averaging.scans import FLT_MAX, convex_shares, float32_below

LENGTH, CHUNK = 20, 8


def peer(i: int) -> PeerID:
    return Identity.from_seed(bytes([i + 31]) * 32).peer_id


def reduce(
    codec: str,
    weights: tuple[float, ...],
    data: list[np.ndarray],
    senders: int | None = None,
    wide: bool = False,
) -> tuple[PartReducer, np.ndarray]:
    """We are peer 0 (our values already in the sum's buffer); the first ``senders`` others
    (default: all) send everything through ``codec``, the rest nothing. ``wide``: the sum
    in float64."""
    members = [Member(peer(i), w, 0) for i, w in enumerate(weights)]
    acc = data[0].copy()
    reducer = PartReducer(
        wide=np.empty(LENGTH, np.float64) if wide else None,
        length=LENGTH,
        chunk_elements=CHUNK,
        codec=get_codec(codec),
        members=members,
        senders=[m.peer_id for m in members],
        max_staleness=2,
        decay=0.5,
        acc=acc,
        scratch=np.empty(CHUNK, np.float32),
        local=peer(0),
    )
    encoder = get_codec(codec)
    count = len(members) - 1 if senders is None else senders
    for member, values in zip(members[1 : 1 + count], data[1 : 1 + count], strict=True):
        for index in range(reducer.n_chunks):
            blob = encoder.encode(values[index * CHUNK : (index + 1) * CHUNK])
            reducer.add_chunk(member.peer_id, index, 0, member.weight, blob)
    return reducer, acc


def spread(value: float, seed: int) -> np.ndarray:
    """``LENGTH`` values between 0.5 and 1 times ``value`` (so that the mean is not trivial)."""
    return (value * np.random.default_rng(seed).uniform(0.5, 1.0, LENGTH)).astype(np.float32)


@pytest.mark.parametrize(
    ("weights", "scales"),
    [
        ((1.0, 1.0), (1.2e38, 2.4e38)),  # the weighted sum overflowed float32
        ((1e20, 1e20), (1e20, 2e20)),  # weight x value overflowed float32
        ((1e300, 1e300), (1.0, 2.0)),  # weights beyond float32's range
        ((1e-300, 1e-300), (1.0, 2.0)),  # ... and below it
        ((1e-46, 1e-40), (1.0, 2.0)),  # below float32's smallest subnormal
        ((1e39, 1.0), (1.0, 2.0)),
        ((1e300, 1e-300, 3.0), (1.0, 2.0, 3.0)),
        ((1.0, 2.0, 3.0), (1e-30, -2e-30, 3e-30)),  # tiny values stay exact too
    ],
)
@pytest.mark.parametrize("wide", [False, True], ids=["float32", "float64"])
def test_any_positive_finite_weights_give_the_weighted_mean(
    weights: tuple[float, ...], scales: tuple[float, ...], wide: bool
) -> None:
    data = [spread(scale, i) for i, scale in enumerate(scales)]
    reducer, _ = reduce("none", weights, data, wide=wide)
    outcome = reducer.finalize({})
    assert outcome.contributors == tuple(peer(i) for i in range(len(weights)))
    assert outcome.note == "" and outcome.weight == pytest.approx(sum(weights))
    top = max(weights)  # float64 reference, scaled so that it cannot overflow either
    expected = sum(w / top * d.astype(np.float64) for w, d in zip(weights, data, strict=True))
    expected /= sum(w / top for w in weights)
    mean = reducer.mean().astype(np.float64)
    assert np.isfinite(mean).all()
    assert np.abs(mean - expected).max() <= 1e-6 * np.abs(expected).max()


def test_shares_are_float32_factors_that_sum_to_at_most_one() -> None:
    for weights in ([1.0, 1.0, 1.0], [1e300, 1e-300, 7.0], [1e-320, 2e-320], [3.0] * 17):
        shares = convex_shares(dict(enumerate(weights)))
        assert all(float(np.float32(s)) == s and 0.0 <= s <= 1.0 for s in shares.values())
        assert 0.5 < sum(shares.values()) <= 1.0
    assert float32_below(1 / 3) < 1 / 3 < float(np.nextafter(np.float32(float32_below(1 / 3)), 1))


@pytest.mark.parametrize(
    ("weights", "shares"),
    [
        ((1.0, 1.0), (0.5, 0.5)),
        ((1.0,) * 4, (0.25,) * 4),
        ((1.0, 1.0, 1.0), (0.25, 0.25, 0.25)),
        ((1.0, 2.0), (0.25, 0.5)),
        ((1.0, 3.0), (0.25, 0.75)),
        ((32.0, 96.0, 7.0), (0.125, 0.375, 7 / 256)),
        ((2.0**-600, 3 * 2.0**-600), (0.25, 0.75)),
        ((8.0,), (1.0,)),
    ],
)
def test_weights_of_few_significant_bits_have_exact_shares(
    weights: tuple[float, ...], shares: tuple[float, ...]
) -> None:
    """Shares are the weights over a power of two, so small integer weights lose nothing."""
    assert tuple(convex_shares(dict(enumerate(weights))).values()) == shares


@pytest.mark.parametrize(
    "weights",
    [
        (1.0, 2.0),
        (2.0, 1.0),
        (1.0, 1.0),
        (1.0, 3.0),
        (4.0, 7.0),
        (3.0, 3.0),  # equal weights that are no power of two (a review: 3/8 each rounded)
        (100.0, 100.0),
        (0.1, 0.1),
        (32.0, 48.0),
    ],
    ids=str,
)
def test_two_integer_weights_give_the_correctly_rounded_mean(weights: tuple[float, ...]) -> None:
    """Where two contributions nearly cancel, the mean is small beside the values; it is
    still within a float32 rounding of the exact mean, element by element, when the other's
    weight is ours times a ratio float32 holds, or ours is a power of two: our values are
    scaled by our share exactly, the multiply-add rounds once and the division by the
    shares' sum once. (Our own weight 3 beside 1, or 5 beside 3, rounds as `3 * x` does in
    a float32 reference.)"""
    rng = np.random.default_rng(7)
    ours = rng.standard_normal(LENGTH).astype(np.float32)
    w0, w1 = weights
    # the other's values cancel ours but for a small remainder
    theirs = (-(w0 / w1) * ours + 1e-4 * rng.standard_normal(LENGTH)).astype(np.float32)
    reducer, _ = reduce("none", weights, [ours, theirs])
    reducer.finalize({})
    exact = (w0 * ours.astype(np.float64) + w1 * theirs.astype(np.float64)) / (w0 + w1)
    np.testing.assert_allclose(reducer.mean(), exact, rtol=2**-23, atol=0)


@pytest.mark.parametrize(
    ("weights", "own", "shares"),
    [
        ((3.0, 3.0), 0, (0.5, 0.5)),
        ((3.0, 3.0, 3.0), 1, (0.25, 0.25, 0.25)),
        ((32.0, 48.0), 0, (0.25, 0.375)),
        ((1.0, 3.0), 1, (0.25, 0.75)),  # 1/3 is no float32: weights over a power of two
        ((0.1, 0.05), 0, (0.5, 0.25)),
    ],
)
def test_shares_are_exact_ratios_to_our_own_weight_when_they_can_be(
    weights: tuple[float, ...], own: int, shares: tuple[float, ...]
) -> None:
    assert tuple(convex_shares(dict(enumerate(weights)), own=own).values()) == shares


def test_equal_weights_near_float32s_largest_still_average() -> None:
    """Two values at FLT_MAX, equal weights of 3: shares of 1/2 each, the mean FLT_MAX (with
    shares of 3/8 each it was refused as an overflow)."""
    data = [np.full(LENGTH, FLT_MAX, np.float32), np.full(LENGTH, FLT_MAX, np.float32)]
    reducer, _ = reduce("none", (3.0, 3.0), data)
    outcome = reducer.finalize({})
    assert outcome.note == ""
    np.testing.assert_array_equal(reducer.mean(), data[0])


def test_renormalising_after_a_drop_cannot_overflow() -> None:
    """Peer 2 (most of the weight) sent nothing: the contributors' sum is scaled back up by
    their shares (a quarter of the total), and their values near FLT_MAX still fit."""
    data = [np.full(LENGTH, 3e38, np.float32), np.full(LENGTH, 3.2e38, np.float32), spread(1, 2)]
    reducer, _ = reduce("none", (1.0, 1.0, 6.0), data, senders=1)
    outcome = reducer.finalize({})
    assert outcome.contributors == (peer(0), peer(1)) and outcome.weight == 2.0
    assert outcome.dropped == ((peer(2), DropReason.TIMEOUT),)
    np.testing.assert_allclose(reducer.mean(), np.full(LENGTH, 3.1e38), rtol=1e-6)


@pytest.mark.parametrize(
    ("codec", "weights", "scales", "senders", "words"),
    [
        ("float16", (1.0, 1.0), (2e5, 1e4), None, "overflows float16"),  # ours beyond it
        ("none", (1.0, 1.0, 1.0), (FLT_MAX,) * 3, None, "overflows float32"),
        ("int8", (1.0, 1.0, 1.0), (FLT_MAX,) * 3, None, "overflows float32"),
        ("none", (1.0, 1e30), (1.0, 1.0), 0, "underflow"),  # a dominant sender dropped
    ],
)
def test_a_mean_the_codec_cannot_send_back_is_no_result_with_a_note(
    codec: str, weights: tuple[float, ...], scales: tuple[float, ...], senders: int | None,
    words: str,
) -> None:  # fmt: skip
    data = [np.full(LENGTH, scale, np.float32) for scale in scales]
    reducer, _ = reduce(codec, weights, data, senders)
    outcome = reducer.finalize({})
    assert outcome.contributors == () and outcome.weight == 0.0
    assert words in outcome.note


def test_a_mean_at_float32s_largest_is_served_when_no_division_is_needed() -> None:
    """Two equal weights: shares of exactly 1/2, the sum is the mean, nothing rounds up."""
    data = [np.full(LENGTH, FLT_MAX, np.float32), np.full(LENGTH, FLT_MAX, np.float32)]
    reducer, _ = reduce("none", (1.0, 1.0), data)
    outcome = reducer.finalize({})
    assert outcome.note == "" and outcome.weight == 2.0
    np.testing.assert_array_equal(reducer.mean(), data[0])


@pytest.mark.parametrize(
    "weights",
    [
        (1.0, 1.0, 1.0), (1.0, 2.0, 3.0, 1.0), (0.1, 0.7, 1.3), (1.0,) * 16,
        (1e307, 2e307, 5e307), (1.0, 3.0), (3.0, 1.0), (0.3, 1.7), (48.0, 32.0), (1.0, 2.0),
    ],
    ids=str,
)  # fmt: skip
def test_a_float64_sum_is_within_a_rounding_of_the_exact_mean_where_values_cancel(
    weights: tuple[float, ...],
) -> None:
    """With three senders or more, or two whose float32 shares would round our values
    (the ``none`` codec), the sum is kept in float64 and rounded to float32 once: each
    element of the mean is within a float32 rounding of the exact weighted mean, even where
    the contributions nearly cancel (a float32 sum rounds at each addition, by up to 2**-24
    of the partial sums: far more than that, relatively, beside a mean near zero)."""
    effective = {peer(i): w for i, w in enumerate(weights)}
    wanted = wide_sum_wanted(get_codec("none"), effective, peer(0))
    rng = np.random.default_rng(11)
    data = [rng.standard_normal(LENGTH).astype(np.float32) for _ in weights[:-1]]
    # the last sender's values cancel the others' weighted sum but for a small remainder
    top = max(weights)
    partial = sum(w / top * d.astype(np.float64) for w, d in zip(weights, data, strict=False))
    remainder = 1e-4 * rng.standard_normal(LENGTH)
    data.append(((remainder - partial) / (weights[-1] / top)).astype(np.float32))
    exact = sum(w / top * d.astype(np.float64) for w, d in zip(weights, data, strict=True))
    exact /= sum(w / top for w in weights)
    reducer, _ = reduce("none", weights, data, wide=wanted)  # as the service decides
    reducer.finalize({})
    np.testing.assert_allclose(reducer.mean(), exact, rtol=2**-23, atol=0)
    if wanted:  # what a float32 sum would give instead
        narrow, _ = reduce("none", weights, data)
        narrow.finalize({})
        assert not np.allclose(narrow.mean(), exact, rtol=1e-6, atol=0)


def test_a_float64_sum_leaves_nothing_of_a_dropped_sender() -> None:
    """A sender that delivered part of its chunks and was dropped is subtracted again; the
    mean of the others is still within a float32 rounding of theirs."""
    rng = np.random.default_rng(12)
    data = [rng.standard_normal(LENGTH).astype(np.float32) for _ in range(4)]
    members = [Member(peer(i), 1.0 + i, 0) for i in range(4)]
    reducer = PartReducer(
        length=LENGTH, chunk_elements=CHUNK, codec=get_codec("none"), members=members,
        senders=[m.peer_id for m in members], max_staleness=2, decay=0.5, acc=data[0].copy(),
        scratch=np.empty(CHUNK, np.float32), local=peer(0), wide=np.empty(LENGTH, np.float64),
    )  # fmt: skip
    encoder = get_codec("none")
    for member, values in zip(members[1:], data[1:], strict=True):
        chunks = reducer.n_chunks if member.peer_id != peer(2) else reducer.n_chunks - 1
        for index in range(chunks):
            blob = encoder.encode(values[index * CHUNK : (index + 1) * CHUNK])
            reducer.add_chunk(member.peer_id, index, 0, member.weight, blob)
    outcome = reducer.finalize({})
    assert outcome.dropped == ((peer(2), DropReason.TIMEOUT),)
    kept = [0, 1, 3]
    exact = sum(members[i].weight * data[i].astype(np.float64) for i in kept)
    exact /= sum(members[i].weight for i in kept)
    np.testing.assert_allclose(reducer.mean(), exact, rtol=2**-23, atol=0)


@pytest.mark.parametrize(
    ("codec", "weights", "own", "wide"),
    [
        ("none", (1.0, 1.0), 0, False),  # one fused multiply-add
        ("none", (1.0, 2.0), 0, False),
        ("none", (1.0, 2.0), 1, False),  # ... and one division by 3/4
        ("none", (32.0, 48.0), 0, False),
        ("none", (32.0, 48.0), 1, True),  # our share 3/8: our values would round
        ("none", (1.0, 3.0), 1, True),
        ("none", (0.3, 1.7), 0, True),  # no exact float32 ratio
        ("none", (1.0, 1.0, 1.0), 0, True),
        ("none", (5.0, None, 5.0), 0, False),  # a stale sender does not count
        ("none", (None, 5.0, 7.0), 0, True),  # our own values are stale
        ("none", (1.0,), 0, False),
        ("float16", (1.0, 3.0, 5.0), 0, False),  # the lossy codecs' error dwarfs float32's
        ("int8", (0.3, 1.7), 0, False),
        ("topk", (1.0, 1.0, 1.0), 0, False),
    ],
    ids=str,
)
def test_the_sum_is_float64_where_float32_would_round_more_than_twice(
    codec: str, weights: tuple[float | None, ...], own: int, wide: bool
) -> None:
    params = {"fraction": 0.5} if codec == "topk" else {}
    effective = {peer(i): w for i, w in enumerate(weights)}
    assert wide_sum_wanted(get_codec(codec, **params), effective, peer(own)) is wide


def test_opposite_contributions_cancel_exactly_in_a_float64_sum() -> None:
    """Shares are the weights over a power of two, exact: ``a``, ``-a`` and 0 with equal
    weights average to exactly 0 (with each weight over the total, 1/3 rounded, our scaled
    values and the others' fused products differed by 2**-53 of them: a review)."""
    rng = np.random.default_rng(13)
    a = rng.standard_normal(LENGTH).astype(np.float32)
    for weights in ((1.0, 1.0, 1.0), (3.0, 3.0, 3.0, 3.0, 3.0), (0.1, 0.1, 0.1)):
        data = [a, -a, *([np.zeros(LENGTH, np.float32)] * (len(weights) - 2))]
        reducer, _ = reduce("none", weights, data, wide=True)
        reducer.finalize({})
        np.testing.assert_array_equal(reducer.mean(), np.zeros(LENGTH, np.float32))
