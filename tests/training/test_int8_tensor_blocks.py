"""int8 blocks never span two tensors: a chunk over several tensors is a blob per tensor
(pieces.py; protocol.md 9.1, "Chunks that span tensors")."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import test_averaging_support as support
import torch
import trio
from test_allreduce_faults import after_acks, non_leader
from test_averaging_support import (
    fast_config,
    host_of,
    memnet_swarm,
    step_all,
    step_averagers,
    verify_round,
)

from protocol.codecs import get_codec
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity
from training import Averager, AveragerConfig, Outcome, PartStatus
from training.averaging.arguments import check_chunk_fits
from training.averaging.pieces import RangeCodec
from training.averaging.reducer import ChunkRejected, DropReason, Member, PartReducer


@pytest.mark.parametrize("n", [2, 3])
async def test_a_small_tensor_beside_a_large_one_keeps_its_own_precision(
    autojump_clock: trio.testing.MockClock, n: int
) -> None:
    """Values of ~1 beside values of ~100 in the same 4096-block: before, the small tensor
    took the large one's scale and came back with errors of ~1.3 (56x its own bound)."""
    gen = torch.Generator().manual_seed(n)
    # small tensors between and around large ones; chunks of 1024 elements (4 KiB) span
    # several tensors and cut through the large ones
    sizes_scales = [(10, 1.0), (5000, 100.0), (7, 0.01), (0, 1.0), (3000, 50.0), (33, 1.0)]
    tensors = [
        [torch.randn(size, generator=gen) * scale for size, scale in sizes_scales] for _ in range(n)
    ]
    originals = [[t.clone() for t in ts] for ts in tensors]
    with trio.fail_after(60):
        async with memnet_swarm(n) as (_, nodes):
            averagers = [
                Averager(node, "t/blocks", ts, codec="int8", config=fast_config(codec="int8"))
                for node, ts in zip(nodes, tensors, strict=True)
            ]
            infos = await step_averagers(averagers)
    assert [info.outcome for info in infos] == [Outcome.AVERAGED] * n
    for k, (size, _) in enumerate(sizes_scales):
        expected = sum(o[k].double() for o in originals) / n
        # two quantizations, each within 1/254 of the largest magnitude of a block of this
        # tensor, so of the tensor's own contributions (float32 rounding aside)
        own = max((float(o[k].abs().max()) for o in originals), default=0.0) if size else 0.0
        bound = 2 * own / 254 * (1 + 1e-5) + 1e-7
        for ts in tensors:
            error = float((ts[k].double() - expected).abs().max()) if size else 0.0
            assert error <= bound, (k, error, bound)
        for ts in tensors[1:]:  # every member decoded the same blobs
            assert torch.equal(ts[k], tensors[0][k])


def test_pieces_cut_a_range_at_each_tensor_boundary_inside_it() -> None:
    ranges = RangeCodec(get_codec("int8"), (0, 3, 3, 8, 20))  # tensors of 3, 0, 5, 12
    assert ranges.cuts == (3, 8)
    assert ranges.pieces(0, 3) == [(0, 3)]
    assert ranges.pieces(2, 6) == [(2, 3), (3, 6)]
    assert ranges.pieces(3, 8) == [(3, 8)]
    assert ranges.pieces(0, 20) == [(0, 3), (3, 8), (8, 20)]
    assert ranges.pieces(7, 9) == [(7, 8), (8, 9)]
    # protocol.md 9.1's example: tensors of 3 and 5, the chunk [2, 6)
    example = RangeCodec(get_codec("int8"), (0, 3, 8))
    assert example.encoded_size(2, 6) == (24 + 1 + 4) + (24 + 3 + 4)
    for codec in ("none", "float16", "topk"):  # no blocks: one blob per chunk
        params = {"k": 2} if codec == "topk" else {}
        other = RangeCodec(get_codec(codec, **params), (0, 3, 8))
        assert other.cuts == () and other.pieces(2, 6) == [(2, 6)]


def test_a_range_round_trips_and_each_piece_is_a_blob_of_its_own() -> None:
    offsets = (0, 5, 6, 4100, 4200)
    ranges = RangeCodec(get_codec("int8", block_size=64), offsets)
    rng = np.random.default_rng(0)
    flat = rng.standard_normal(4200).astype(np.float32)
    flat[5] = 1e-3  # a one-element tensor of small values between larger ones
    for start, stop in [(0, 4200), (3, 4099), (4100, 4200), (5, 6), (2, 5000 - 800)]:
        out = bytearray(ranges.encoded_size(start, stop))
        size = ranges.encode_into(flat[start:stop], out, start)
        assert size == len(out)
        back = ranges.decode_into(bytes(out), np.empty(stop - start, np.float32), start)
        for a, b in ranges.pieces(start, stop):
            own = float(np.abs(flat[a:b]).max())
            assert float(np.abs(back[a - start : b - start] - flat[a:b]).max()) <= own / 254 * 1.001
        # the payload is the pieces' blobs end to end
        offset = 0
        for a, b in ranges.pieces(start, stop):
            blob_size = get_codec("int8", block_size=64).encoded_size(b - a)
            blob = bytes(out[offset : offset + blob_size])
            assert get_codec("int8").decode(blob).shape == (b - a,)
            offset += blob_size
        assert offset == size


def test_a_payload_that_is_not_the_pieces_blobs_is_refused() -> None:
    int8 = get_codec("int8")
    ranges = RangeCodec(int8, (0, 3, 8))
    values = np.arange(8, dtype=np.float32)
    good = bytearray(ranges.encoded_size(0, 8))
    ranges.encode_into(values, good, 0)
    out = np.empty(8, np.float32)
    whole = int8.encode(values)  # one blob over both tensors (the v6 form)
    for bad in (bytes(good[:-1]), bytes(good) + b"\0", whole, int8.encode(values[:3]) * 2):
        with pytest.raises(RemoteProtocolError):
            ranges.decode_into(bad, out, 0)
    # pieces of other sizes, together as long as the right ones
    swapped = int8.encode(values[:5]) + int8.encode(values[5:])
    assert len(swapped) == len(good)
    with pytest.raises(RemoteProtocolError):
        ranges.decode_into(swapped, out, 0)


@pytest.mark.parametrize("pieces", [1, 2, 20], ids=["one-blob", "few-pieces", "many-pieces"])
def test_blobs_of_another_block_size_that_are_as_long_are_refused(pieces: int) -> None:
    """A chunk counts only if it is what the round's codec makes of it: blocks of 300 make
    as many blocks as the round's 256 over 1024 values (the same bytes), and were decoded,
    straddling the round's blocks (a review). Each decoding path refuses them now."""
    ours, other = get_codec("int8", block_size=256), get_codec("int8", block_size=300)
    length = 1024
    offsets = np.linspace(0, pieces * length, pieces + 1).astype(int)
    ranges = RangeCodec(ours, offsets)
    values = np.ones(pieces * length, np.float32)
    values[200] = 1000.0  # in the first block of either size
    good = bytearray(ranges.encoded_size(0, values.size))
    ranges.encode_into(values, good, 0)
    forged = b"".join(other.encode(values[a:b]) for a, b in itertools.pairwise(offsets))
    assert len(forged) == len(good)
    out = np.empty(values.size, np.float32)
    # the round's blocks keep 256..299 within 1/254 of their own largest magnitude, 1;
    # the forged ones put them in a block with 1000, which decodes them as 0
    decoded = ranges.decode_into(bytes(good), out, 0)[256:300]
    assert np.abs(decoded - 1.0).max() <= 1 / 254
    assert (other.decode(forged[: other.encoded_size(length)])[256:300] == 0).all()
    with pytest.raises(RemoteProtocolError, match="block_size 300"):
        ranges.decode_into(forged, out, 0)
    # one dimension too: a (1024, 1) blob is as long as its 1-d form
    reshaped = b"".join(
        ours.encode(values[a:b].reshape(-1, 1)) for a, b in itertools.pairwise(offsets)
    )
    if len(reshaped) == len(good):  # (the header grows by a dimension: longer, refused)
        with pytest.raises(RemoteProtocolError):
            ranges.decode_into(reshaped, out, 0)


def test_a_reducer_drops_a_sender_whose_chunk_spans_tensors_in_one_blob() -> None:
    """The size check: a v6-style chunk (one blob over two tensors) is garbage."""
    int8 = get_codec("int8")
    me, them = (Identity.from_seed(bytes([i]) * 32).peer_id for i in (1, 2))
    members = [Member(me, 1.0, 0), Member(them, 1.0, 0)]
    # the part is flat[100:116] of tensors [0, 104) and [104, 200): chunks of 8 elements,
    # chunk 0 spans both tensors, chunk 1 lies in the second
    ranges = RangeCodec(int8, (0, 104, 200))
    values = np.arange(16, dtype=np.float32)
    first = bytearray(ranges.encoded_size(100, 108))
    ranges.encode_into(values[:8], first, 100)
    assert len(first) == int8.encoded_size(4) * 2

    def reducer() -> PartReducer:
        return PartReducer(
            length=16, chunk_elements=8, codec=int8, members=members, senders=[them],
            max_staleness=2, decay=0.5, acc=np.zeros(16, np.float32),
            scratch=np.empty(8, np.float32), ranges=ranges, base=100,
        )  # fmt: skip

    good = reducer()
    assert not good.add_chunk(them, 0, 0, 1.0, bytes(first))
    assert good.add_chunk(them, 1, 0, 1.0, int8.encode(values[8:]))  # one tensor: one blob
    bad = reducer()
    with pytest.raises(ChunkRejected) as caught:
        bad.add_chunk(them, 0, 0, 1.0, int8.encode(values[:8]))
    assert caught.value.reason is DropReason.GARBAGE
    assert "bytes" in str(caught.value)
    assert bad.reason(them) is DropReason.GARBAGE


def test_most_cuts_is_the_most_boundaries_any_window_holds() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        sizes = rng.integers(0, 6, size=int(rng.integers(1, 12)))
        offsets = tuple(int(x) for x in np.cumsum((0, *sizes)))
        ranges = RangeCodec(get_codec("int8"), offsets)
        total = offsets[-1]
        for window in range(1, total + 2):
            brute = max(
                (len(ranges.pieces(s, s + window)) - 1 for s in range(-1, total + 1)), default=0
            )
            assert ranges.most_cuts(window) == brute, (offsets, window)


def test_chunk_size_check_counts_a_blob_header_per_tensor_boundary() -> None:
    """Many one-element tensors: each adds a header and a scale to the chunk that holds it."""
    int8 = get_codec("int8")
    config = AveragerConfig(codec="int8")
    n = config.chunk_elements
    check_chunk_fits(int8, config, n, RangeCodec(int8, (0, n)))  # one tensor: fits
    tiny = RangeCodec(int8, tuple(itertools.accumulate([0] + [1] * n)))
    with pytest.raises(ValueError, match="chunk_bytes <= ") as refused:
        check_chunk_fits(int8, config, n, tiny)
    smaller = AveragerConfig(codec="int8", chunk_bytes=131072)
    check_chunk_fits(int8, smaller, n, tiny)  # 32768 tensors a chunk: 0.9 MiB
    # the suggestion is the largest that fits (a binary search since an outside tester's
    # 80,000 tensors took 29 s to refuse, a step of 4096 bytes at a time)
    found = re.search(r"use chunk_bytes <= (\d+)", str(refused.value))
    assert found is not None
    fits = int(found.group(1))
    check_chunk_fits(int8, AveragerConfig(codec="int8", chunk_bytes=fits), n, tiny)
    with pytest.raises(ValueError, match="chunk_bytes <= "):
        check_chunk_fits(int8, AveragerConfig(codec="int8", chunk_bytes=fits + 4096), n, tiny)


def test_a_range_of_many_pieces_is_the_same_blobs_made_in_whole_range_passes() -> None:
    """Beyond ``MANY_PIECES`` a range goes through ``encode_pieces_into`` (a call per piece
    took 7.7 s for 200,000 tiny tensors): the same bytes as the pieces one by one."""
    int8 = get_codec("int8", block_size=4)
    offsets = tuple(itertools.accumulate([0] + [3, 1, 9, 4] * 25))  # 100 tensors
    ranges = RangeCodec(int8, offsets)
    flat = np.random.default_rng(3).standard_normal(offsets[-1]).astype(np.float32)
    for start, stop in [(0, offsets[-1]), (5, 160), (1, 3)]:
        pieces = ranges.pieces(start, stop)
        one_by_one = b"".join(int8.encode(flat[a:b]) for a, b in pieces)
        out = bytearray(ranges.encoded_size(start, stop))
        assert ranges.encode_into(flat[start:stop], out, start) == len(one_by_one)
        assert bytes(out) == one_by_one
        back = ranges.decode_into(one_by_one, np.empty(stop - start, np.float32), start)
        expected = np.concatenate([int8.decode(int8.encode(flat[a:b])) for a, b in pieces])
        np.testing.assert_array_equal(back, expected)


async def test_many_tiny_tensors_average_within_their_own_bounds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """3,000 tensors of 3 values, scales alternating 1e3 and 1e-3, int8, 3 peers."""
    gen = torch.Generator().manual_seed(7)
    scales = [1e3 if i % 2 else 1e-3 for i in range(3000)]
    tensors = [[torch.randn(3, generator=gen) * s for s in scales] for _ in range(3)]
    originals = [[t.clone() for t in ts] for ts in tensors]
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            config = fast_config(codec="int8", chunk_bytes=16384)
            averagers = [
                Averager(node, "t/tiny", ts, config=config)
                for node, ts in zip(nodes, tensors, strict=True)
            ]
            infos = await step_averagers(averagers)
    assert [info.outcome for info in infos] == [Outcome.AVERAGED] * 3
    worst = 0.0
    for k in range(len(scales)):
        expected = sum(o[k].double() for o in originals) / 3
        bound = 2 * max(float(o[k].abs().max()) for o in originals) / 254 * (1 + 1e-5) + 1e-12
        for ts in tensors:
            worst = max(worst, float((ts[k].double() - expected).abs().max()) / bound)
    assert worst <= 1.0, worst


async def test_a_member_killed_mid_round_leaves_tensors_that_match_the_report(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The fault path with int8 chunks over tensors: a member killed after 2 of its 4
    chunks per part were acknowledged; every survivor's tensors are exactly what its report
    says (local values where a part was not received, the decoded mean elsewhere), and the
    next round averages without it. The tensors are views of one array, so the check reads
    them in flat order."""
    sizes = [5, 1500, 3, 0, 9000, 64, 5812]  # 16,384 values, chunks of 1024 span tensors
    scales = np.repeat([1e3, 1e-3, 1.0, 1.0, 1e2, 1e-2, 1.0], sizes)
    with trio.fail_after(300):
        async with memnet_swarm(4) as (net, nodes):
            config = fast_config(codec="int8", max_inflight=3)
            rng = np.random.default_rng(5)
            members = []
            for i, node in enumerate(nodes):
                data = (rng.standard_normal(sum(sizes)) * scales).astype(np.float32)
                array = data.copy()
                views = np.split(array, np.cumsum(sizes)[:-1])
                averager = Averager(node, "t/x", views, config=config)
                members.append(support.Member(averager, data, array, weight=float(i % 3 + 1)))
            victim = non_leader(members)
            after_acks(members[victim], 2, lambda: net.kill_host(host_of(victim)))
            results = await step_all(members, timeout=30.0)
            infos = [info for i, (info, _) in enumerate(results) if i != victim]
            survivors = [m for i, m in enumerate(members) if i != victim]
            verify_round(
                survivors,
                infos,
                codec="int8",
                without_report=[members[victim]],  # type: ignore[arg-type]
            )
            for info in infos:
                assert info is not None and info.outcome is Outcome.PARTIAL
                assert {p.status for p in info.parts} == {PartStatus.NONE, PartStatus.SOME}
            for m in survivors:  # the next round, without the victim: all averaged
                m.data = m.array.copy()
            results = await step_all(survivors, timeout=30.0)
            infos = [info for info, _ in results]
            verify_round(survivors, infos, codec="int8")  # type: ignore[arg-type]
            assert all(info is not None and info.averaged_fraction == 1.0 for info in infos)
