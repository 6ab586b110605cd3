"""The averager's fast paths: torch casts, raw (uncopied) float32 payloads, fused copies."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.codecs import get_codec
from protocol.codecs.casts import NUMPY_CASTS, Casts
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity, PeerID
from training.averaging.casts import TORCH_CASTS
from training.averaging.layout import FlatVector, as_tensors
from training.averaging.messages import ChunkHeader
from training.averaging.reducer import (
    ChunkRejected,
    DropReason,
    Member,
    PartReducer,
    decode_raw,
)
from training.averaging.scans import copy_finite


def peer(i: int) -> PeerID:
    return Identity.from_seed(bytes([i + 1]) * 32).peer_id


def test_torch_casts_match_numpy() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([bits.view(np.float32), np.float32([65504, 65520, -7e4, 1e-8, 6e-8])])
    x = x[~np.isnan(x)]  # NaN stays NaN, its payload may differ
    fast, slow = get_codec("float16"), get_codec("float16")
    fast.casts = TORCH_CASTS
    assert fast.encode(x) == slow.encode(x)
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    blob = slow.encode(halves)
    np.testing.assert_array_equal(fast.decode(blob), slow.decode(blob))  # NaN == NaN here
    fast8, slow8 = get_codec("int8"), get_codec("int8")
    fast8.casts = TORCH_CASTS
    y = rng.standard_normal(10_000).astype(np.float32)
    blob = slow8.encode(y)
    assert fast8.encode(y) == blob
    np.testing.assert_array_equal(fast8.decode(blob), slow8.decode(blob))


def test_copy_finite_checks_every_piece() -> None:
    src = np.arange(200_000, dtype=np.float32)
    dst = np.empty_like(src)
    zeros = np.zeros(1000, np.float32)
    assert copy_finite(dst, src, zeros)
    np.testing.assert_array_equal(dst, src)
    src[150_000] = np.inf
    assert not copy_finite(dst, src, zeros)
    assert not copy_finite(dst[:1], np.float32([np.nan]), zeros)


def test_raw_chunk_header_and_payload() -> None:
    head = ChunkHeader(9, 1, 3, 7, 2.0, raw=True, group_id=(5).to_bytes(16, "big"))
    assert head.to_body()["raw"] is True
    assert ChunkHeader.from_body(head.to_body()) == head
    assert "raw" not in ChunkHeader(9, 1, 3, 7, 2.0, group_id=(5).to_bytes(16, "big")).to_body()
    with pytest.raises(RemoteProtocolError):
        ChunkHeader.from_body({**head.to_body(), "raw": 1})
    values = np.float32([1, 2, 3])
    np.testing.assert_array_equal(decode_raw(values.tobytes(), 3), values)
    with pytest.raises(RemoteProtocolError):
        decode_raw(values.tobytes(), 2)


def reducer_for(
    codec: str,
    local: np.ndarray,
    target: np.ndarray | None = None,
    *,
    weights: tuple[float, ...] = (1.0, 2.0, 3.0),
    chunk_elements: int = 8,
    acc: np.ndarray | None = None,
    defer_load: bool = False,
) -> PartReducer:
    """A reducer of ``len(local)`` values for members ``peer(i)`` of ``weights[i]``; we are
    ``peer(0)``, our values read from ``target`` (when given) or already in ``acc``."""
    members = [Member(peer(i), weight, 0) for i, weight in enumerate(weights)]
    if acc is None:
        acc = np.empty(len(local), np.float32)
        if target is None:
            acc[:] = local
    return PartReducer(
        length=len(local),
        chunk_elements=chunk_elements,
        codec=get_codec(codec),
        members=members,
        senders=[m.peer_id for m in members],
        max_staleness=2,
        decay=0.5,
        acc=acc,
        scratch=np.empty(chunk_elements, np.float32),
        local=peer(0),
        local_values=target,
        defer_load=defer_load,
    )


def test_reducer_takes_raw_chunks_with_the_none_codec_only() -> None:
    rng = np.random.default_rng(1)
    data = [rng.standard_normal(16).astype(np.float32) for _ in range(3)]
    tensor = data[0].copy()
    reducer = reducer_for("none", data[0], target=tensor)  # loads our values from tensor
    for chunk in range(2):
        raw = data[1][8 * chunk : 8 * chunk + 8].tobytes()
        reducer.add_chunk(peer(1), chunk, 0, 2.0, raw, raw=True)
    with pytest.raises(ChunkRejected):  # 7 values, not 8
        reducer.add_chunk(peer(2), 0, 0, 3.0, data[2][:7].tobytes(), raw=True)
    out = np.empty(16, np.float32)
    outcome = reducer.finalize({}, out)
    assert outcome.contributors == (peer(0), peer(1))
    assert outcome.dropped == ((peer(2), DropReason.GARBAGE),)
    np.testing.assert_allclose(out, (data[0] + 2 * data[1]) / 3, rtol=1e-6)
    assert reducer.mean() is out
    np.testing.assert_array_equal(tensor, data[0])  # read, never written
    int8 = reducer_for("int8", data[0])
    with pytest.raises(ChunkRejected, match="none codec"):
        int8.add_chunk(peer(1), 0, 0, 2.0, data[1][:8].tobytes(), raw=True)


@pytest.mark.parametrize("into_out", [False, True])
def test_reducer_divides_a_chunk_at_a_time_when_asked(into_out: bool) -> None:
    rng = np.random.default_rng(2)
    mine, theirs = (rng.standard_normal(20).astype(np.float32) for _ in range(2))
    reducer = reducer_for("none", mine, weights=(1.0, 3.0, 4.0))  # chunks of 8, 8, 4
    for chunk in range(3):
        raw = theirs[8 * chunk : 8 * chunk + 8].tobytes()
        reducer.add_chunk(peer(1), chunk, 0, 3.0, raw, raw=True)
    out = np.zeros(20, np.float32) if into_out else None
    # peer 2 sent nothing: the sum of shares (1/8, 3/8) * values is half the mean
    assert reducer.finalize({}, out, divide=False).weight == 4.0
    expected = (mine + 3 * theirs) / 4
    reducer.divide(1)
    reducer.divide(1)  # once only
    np.testing.assert_allclose(reducer.mean()[8:16], expected[8:16], rtol=1e-6)
    if into_out:  # the other chunks are not written yet
        assert not reducer.mean()[:8].any() and not reducer.mean()[16:].any()
    else:  # still the sum
        np.testing.assert_allclose(reducer.mean()[:8], expected[:8] / 2, rtol=1e-6)
    reducer.divide_all()
    np.testing.assert_allclose(reducer.mean(), expected, rtol=1e-6)


def test_reducer_drops_nonfinite_local_values_loaded_from_a_tensor() -> None:
    local = np.float32([1, 2, np.nan, 4])
    reducer = reducer_for("none", local, target=local)
    assert reducer.reason(peer(0)) is DropReason.NONFINITE


def deferred_reducer(local: np.ndarray, acc: np.ndarray, weight: float) -> PartReducer:
    """Two members (us of ``weight``, peer(1) of 1), chunks of 4, our values loaded on demand."""
    return reducer_for(
        "none", local, local, weights=(weight, 1.0), chunk_elements=4, acc=acc, defer_load=True
    )


def test_reducer_loads_its_own_values_in_steps_when_deferred() -> None:
    local = np.arange(10, dtype=np.float32)
    other = np.ones(10, dtype=np.float32)
    acc = np.full(10, np.nan, np.float32)
    reducer = deferred_reducer(local, acc, weight=3.0)
    with pytest.raises(RuntimeError):  # nothing is added before our values are in
        reducer.add_chunk(peer(1), 0, 0, 1.0, other[:4].tobytes(), raw=True)
    with pytest.raises(RuntimeError):
        reducer.finalize({})
    assert reducer.pending() == [peer(0), peer(1)]
    steps = reducer.load_steps()
    next(steps)  # one chunk (4 values) loaded and weighed by our share, the rest untouched
    np.testing.assert_array_equal(acc[:4], 0.75 * local[:4])
    assert np.isnan(acc[4:]).all() and not reducer.loaded
    assert sum(1 for _ in steps) == 1  # three pieces: a pause after each but the last
    assert reducer.loaded and reducer.pending() == [peer(1)]
    for chunk, (a, b) in enumerate([(0, 4), (4, 8), (8, 10)]):
        reducer.add_chunk(peer(1), chunk, 0, 1.0, other[a:b].tobytes(), raw=True)
    outcome = reducer.finalize({})
    assert outcome.contributors == (peer(0), peer(1)) and outcome.weight == 4.0
    np.testing.assert_allclose(reducer.mean(), (3 * local + other) / 4)


def test_reducer_drops_own_values_not_finite_in_a_later_piece() -> None:
    local = np.float32([1, 2, 3, 4, 5, np.inf, 7])
    acc = np.empty(7, np.float32)
    reducer = deferred_reducer(local, acc, weight=2.0)
    assert sum(1 for _ in reducer.load_steps()) == 1  # stops at the bad piece
    assert reducer.loaded and reducer.reason(peer(0)) is DropReason.NONFINITE
    np.testing.assert_array_equal(acc, np.zeros(7, np.float32))  # the sum starts from zero
    assert list(reducer.load_steps()) == []  # loads once


def test_flat_vector_views_only_single_float32_tensors() -> None:
    a, b = np.arange(6, dtype=np.float32), np.arange(4, dtype=np.float64)
    flat = FlatVector(as_tensors([a, b]))
    view = flat.view(1, 5)
    assert view is not None and np.shares_memory(view, a)
    assert flat.view(4, 8) is None  # spans two tensors
    assert flat.view(6, 8) is None  # float64: converted through the flat vector


def test_torch_row_scaling_equals_numpys_bit_for_bit() -> None:
    """int8's per-block scaling through torch must round as numpy does (senders and
    receivers may use either), across the float32 range and into subnormals."""
    rng = np.random.default_rng(3)
    rows = rng.integers(-127, 128, (64, 512)).astype(np.float32)  # decoding: q * scale
    rows[::2] /= np.float32(7)  # and fractions
    factors = np.float32(10.0) ** rng.uniform(-44, 30, 64).astype(np.float32)
    factors[:3] = (0.0, np.finfo(np.float32).tiny, 2.6e36)  # (int8 scales stay finite)
    expected = np.empty_like(rows)
    NUMPY_CASTS.scale_rows(rows, factors, expected)
    got = np.empty_like(rows)
    TORCH_CASTS.scale_rows(rows, factors, got)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    TORCH_CASTS.scale_rows(rows, factors, rows)  # in place, as decoding does
    np.testing.assert_array_equal(rows.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("casts", [NUMPY_CASTS, TORCH_CASTS], ids=["numpy", "torch"])
def test_casts_refuse_a_read_only_output_and_leave_it_unchanged(casts: Casts) -> None:
    """torch alone would warn and write through a read-only array; both refuse it."""
    rows = np.ones((4, 8), dtype=np.float32)
    factors = np.full(4, 2.0, dtype=np.float32)
    frozen = np.zeros((4, 8), dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        casts.scale_rows(rows, factors, frozen)
    half = np.zeros(32, dtype=np.float16)
    half.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        casts.to_half(rows.reshape(-1), half)
    with pytest.raises(ValueError, match="read-only"):
        casts.to_float(np.ones(32, dtype=np.float16), frozen.reshape(-1))
    assert not frozen.any() and not half.any()
