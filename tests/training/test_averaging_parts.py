"""Pure pieces of the averager: layout, spans, grouping, the reducer's accounting, messages."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from protocol.codecs import get_codec
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity, PeerID
from training.averaging.grouping import (
    Declaration,
    grid_sides,
    leader_of,
    make_groups,
    parse_declarations,
    phase_of,
)
from training.averaging.layout import FlatVector, as_tensors, check_spans, split_spans
from training.averaging.messages import ChunkHeader, GroupConfirmation, ResultHeader
from training.averaging.reducer import (
    ChunkRejected,
    DropReason,
    Member,
    PartReducer,
    effective_weights,
)
from training.averaging.report import (
    Outcome,
    PartReport,
    PartStatus,
    _fraction,
    merge_dropped,
    outcome_of,
    part_status,
)


def peer(i: int) -> PeerID:
    return Identity.from_seed(bytes([i + 1]) * 32).peer_id


def decl(i: int, *, client: bool = False, layout: str = "L", count: int = 0) -> Declaration:
    address = None if client else f"{peer(i)}@10.0.0.{i}:1000"
    return Declaration(peer(i), address, 1.0, 0, 1.0, layout, count, 100)


# -- layout -----------------------------------------------------------------------------


def test_flat_vector_round_trip_mixed_dtypes() -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = np.arange(4, dtype=np.float32) + 10
    c = torch.ones(3, dtype=torch.float64)
    flat = FlatVector(as_tensors([a, b, c]))
    flat.load()
    assert flat.array.tolist() == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 1, 1, 1]
    flat.array[:] = -1
    flat.store((4, 11))  # crosses all three tensors
    assert a.view(-1).tolist() == [0, 1, 2, 3, -1, -1]
    assert b.tolist() == [-1, -1, -1, -1]
    assert c.tolist() == [-1, 1, 1]
    assert flat.layout.total == 13


def test_as_tensors_refuses_bad_input() -> None:
    with pytest.raises(TypeError):
        as_tensors([torch.arange(3)])
    with pytest.raises(ValueError):
        as_tensors([torch.zeros(4, 4).t()])
    with pytest.raises(ValueError):
        as_tensors([])
    with pytest.raises(ValueError, match="only dense tensors"):
        as_tensors([torch.zeros(4, 4).to_sparse()])


def test_as_tensors_refuses_tensors_that_share_memory() -> None:
    """Shared memory would be averaged twice over (and a partial round's report could not
    be right for it): the same tensor twice, overlapping views, tied state_dict entries."""
    base = torch.zeros(10)
    for tensors in ([base, base], [base[2:6], base[4:8]], [torch.zeros(3), base, base[9:]]):
        with pytest.raises(ValueError, match="share memory"):
            as_tensors(tensors)
    assert len(as_tensors([base[:5], base[5:], base[:0], base[:0]])) == 4  # disjoint or empty


def test_as_tensors_refuses_read_only_memory(tmp_path: Path) -> None:
    """Averaging writes in place: a read-only array is refused (a read-only memmap, even
    behind a torch tensor, would otherwise crash the process on the first write)."""
    frozen = np.zeros(4, dtype=np.float32)
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="tensor 1 is a read-only numpy array"):
        as_tensors([torch.zeros(2), frozen])
    np.save(tmp_path / "x.npy", np.ones(1 << 16, dtype=np.float32))
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    with pytest.raises(ValueError, match="tensor 0 is a read-only numpy array"):
        as_tensors([mapped])
    with warnings.catch_warnings():  # torch warns (once per process) that it is not writable
        warnings.simplefilter("ignore", UserWarning)
        behind = torch.from_numpy(mapped)
    with pytest.raises(ValueError, match="tensor 0 lies in read-only memory"):
        as_tensors([behind])
    writable = np.load(tmp_path / "x.npy", mmap_mode="r+")
    assert len(as_tensors([writable, torch.from_numpy(writable[:0])])) == 2


@given(
    total=st.integers(0, 1 << 22),
    bandwidths=st.lists(st.floats(0.0, 1e9), min_size=1, max_size=20).filter(lambda b: sum(b) > 0),
)
def test_split_spans_tile_and_follow_bandwidth(total: int, bandwidths: list[float]) -> None:
    spans = split_spans(total, bandwidths)
    check_spans(spans, total)
    weight = math.fsum(bandwidths)
    unit = 4096 if total >= 4096 * len(bandwidths) * 4 else 1
    for (start, stop), bandwidth in zip(spans[:-1], bandwidths, strict=False):
        assert abs((stop - start) - total * bandwidth / weight) <= 2 * unit + total * 1e-9 * 0 + (
            unit * len(bandwidths)
        )


def test_split_spans_equal_bandwidth_is_even() -> None:
    assert split_spans(10, [1, 1, 1, 1, 1]) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    spans = split_spans(1 << 24, [1.0] * 4)
    assert [b - a for a, b in spans] == [1 << 22] * 4


def test_split_spans_take_any_finite_bandwidths() -> None:
    """A declared bandwidth is any positive finite number: 1e308 used to overflow the sum
    (two of them) or the boundary (one before the last)."""
    assert split_spans(100_000, [1e308, 1e308]) == [(0, 49152), (49152, 100_000)]
    assert split_spans(100_000, [1e308, 1.0]) == [(0, 100_000), (100_000, 100_000)]
    assert split_spans(10, [5e-324, 1.0, 5e-324]) == [(0, 0), (0, 10), (10, 10)]


# -- grouping ---------------------------------------------------------------------------


def test_grid_sides() -> None:
    assert grid_sides(4, 4) == (4,)
    assert grid_sides(16, 4) == (4, 4)
    assert grid_sides(8, 4) == (4, 2)  # was 3 x 3: a short line every round
    assert grid_sides(12, 4) == (4, 3)
    assert grid_sides(10, 4) == (4, 4)  # no exact fit: equal sides
    assert grid_sides(17, 4) == (3, 3, 3)
    assert grid_sides(1, 4) == (1,)
    assert grid_sides(1000, 16) == (10, 10, 10)
    assert grid_sides(7, 2) == (2, 2, 2)
    for n in range(1, 300):
        for group_size in (2, 3, 4, 5, 8, 16):
            sides = grid_sides(n, group_size)
            assert max(sides) <= group_size and math.prod(sides) >= n
            assert group_size ** (len(sides) - 1) < n or len(sides) == 1


def test_groups_are_deterministic_and_bounded() -> None:
    decls = [decl(i) for i in range(16)]
    groups = make_groups(decls, 4, "p")
    assert make_groups(list(reversed(decls)), 4, "p") == groups
    assert sorted(len(g) for g in groups) == [4, 4, 4, 4]
    assert sorted(d.peer_id.raw for g in groups for d in g) == sorted(p.peer_id.raw for p in decls)
    for group in groups:
        assert leader_of(group) == group[0]


@pytest.mark.parametrize("n", [2, 3, 5, 8, 10, 12, 16, 17, 40])
def test_moshpit_grid_mixes_everyone(n: int) -> None:
    """Averaging within the groups of d consecutive phases yields the global mean."""
    values = {peer(i): float(i) for i in range(n)}
    d = len(grid_sides(n, 4))
    for phase in range(d):
        decls = [decl(i, count=phase) for i in range(n)]
        groups = make_groups(decls, 4, "p")
        assert all(len(g) <= 4 for g in groups)
        for group in groups:
            mean = sum(values[x.peer_id] for x in group) / len(group)
            for x in group:
                values[x.peer_id] = mean
    spread = max(values.values()) - min(values.values())
    grid_full = math.prod(grid_sides(n, 4)) == n
    if grid_full:
        assert spread < 1e-9
    assert spread < n - 1  # always mixes


def test_one_declarer_cannot_choose_the_grid_phase() -> None:
    """The phase fixes the grid and the order in every group, so whoever chose it chose
    who leads: with the largest count as the phase, a hostile peer found a count under
    which it led (and refused every join). With the lower median, any count it declares
    gives the honest peers' grouping while two or more of them agree."""
    hostile = 8
    leads = [
        phase
        for phase in range(64)
        for group in make_groups([decl(i, count=phase) for i in range(hostile + 1)], 4, "p")
        if leader_of(group) == decl(hostile, count=phase)
    ]
    assert leads and len(leads) < 64  # choosing the phase would choose the leader
    for honest in (2, 3, hostile):
        fair = make_groups(
            [decl(i, count=7) for i in range(honest)] + [decl(hostile, count=7)], 4, "p"
        )
        for count in (0, 1, 6, 8, 2**40, 2**62 - 1, *leads):
            decls = [decl(i, count=7) for i in range(honest)] + [decl(hostile, count=count)]
            assert phase_of(decls) == 7
            groups = make_groups(decls, 4, "p")
            assert [[d.peer_id for d in g] for g in groups] == [
                [d.peer_id for d in g] for g in fair
            ], (honest, count)
    assert phase_of([]) == 0
    assert phase_of([decl(0, count=5), decl(1, count=9)]) == 5  # the lower of two
    assert phase_of([decl(i, count=c) for i, c in enumerate((4, 1, 9, 3, 3))]) == 3


@pytest.mark.parametrize(
    ("n", "group_size", "sizes", "spread"),
    [(10, 3, [2, 2, 3, 3], 0.05), (7, 2, [1, 2, 2, 2], 0.5), (5, 4, [2, 3], 0.05)],
)
def test_short_grid_lines_are_balanced_within_group_size(
    n: int, group_size: int, sizes: list[int], spread: float
) -> None:
    """Short grid lines are balanced (10 in groups of 3: not 3, 3, 3, 1), and no group
    exceeds group_size: pairs of an odd count leave one peer out (another each round).
    Repeated rounds still mix everyone."""
    values = {peer(i): float(i) for i in range(n)}
    d = len(grid_sides(n, group_size))
    for phase in range(2 * d):
        decls = [decl(i, count=phase) for i in range(n)]
        groups = make_groups(decls, group_size, "p")
        assert make_groups(list(reversed(decls)), group_size, "p") == groups
        assert sorted(d.peer_id.raw for g in groups for d in g) == sorted(p.raw for p in values)
        assert sum(len(g) == 1 for g in groups) == (group_size == 2 and n % 2)
        assert max(len(g) for g in groups) <= group_size
        if phase == 0:
            assert sorted(len(g) for g in groups) == sizes
        for group in groups:
            mean = sum(values[x.peer_id] for x in group) / len(group)
            for x in group:
                values[x.peer_id] = mean
    assert max(values.values()) - min(values.values()) < spread  # from n - 1


@pytest.mark.parametrize("n", [5, 7, 9, 11, 17, 33])
def test_the_odd_one_of_pairs_changes_every_round_of_a_block(n: int) -> None:
    """Pairs and an odd count: the peer on the grid's short line sat out d - 1 rounds of
    every d (9 peers: the same one 3 rounds in a row, a trial). Now a different one sits
    out each round of a grid block (the same one at most twice in a row, across blocks)."""
    d = len(grid_sides(n, 2))
    out: list[bytes] = []
    for phase in range(3 * d):
        groups = make_groups([decl(i, count=phase) for i in range(n)], 2, "p")
        [single] = [g for g in groups if len(g) == 1]
        out.append(single[0].peer_id.raw)
    for phase in range(1, 3 * d):
        if phase % d:  # within a block
            assert out[phase] != out[phase - 1], phase
        if phase >= 2:
            assert not out[phase] == out[phase - 1] == out[phase - 2], phase


@pytest.mark.parametrize(
    ("full", "clients", "group_size", "sizes"),
    [
        (3, 3, 4, [3, 3]),  # was [1, 1, 4]: two clients alone
        (4, 1, 4, [2, 3]),  # was [1, 4]: a churn trial's client, alone round after round
        (2, 1, 2, [1, 2]),  # a pair lends nobody: one of three would sit out anyway
        (1, 3, 2, [1, 1, 2]),  # one full peer leads one client; the others have no leader
        (8, 2, 4, [3, 3, 4]),
    ],
)
def test_clients_fill_groups_with_room_and_never_lead(
    full: int, clients: int, group_size: int, sizes: list[int]
) -> None:
    decls = [decl(i) for i in range(full)]
    decls += [decl(i, client=True) for i in range(full, full + clients)]
    groups = make_groups(decls, group_size, "p")
    assert sorted(len(g) for g in groups) == sizes
    assert sorted(d.peer_id.raw for g in groups for d in g) == sorted(d.peer_id.raw for d in decls)
    for group in groups:
        assert len(group) <= group_size
        leader = leader_of(group)
        if len(group) > 1:
            assert leader is not None and not leader.client_mode


def test_layouts_never_mix() -> None:
    decls = [decl(i, layout="A") for i in range(3)] + [decl(i, layout="B") for i in range(3, 5)]
    groups = make_groups(decls, 8, "p")
    assert sorted(len(g) for g in groups) == [2, 3]
    for group in groups:
        assert len({d.layout for d in group}) == 1


def test_declaration_wire_round_trip_and_validation() -> None:
    d = decl(3)
    assert Declaration.from_wire(d.peer_id, d.to_wire()) == d
    c = decl(4, client=True)
    assert Declaration.from_wire(c.peer_id, c.to_wire()) == c
    bad = dict(d.to_wire(), weight=-1.0)
    with pytest.raises(RemoteProtocolError):
        Declaration.from_wire(d.peer_id, bad)
    entries = {str(d.peer_id): d.to_wire(), "junk": {"x": 1}, str(peer(9)): bad}
    assert parse_declarations(entries) == [d]
    # msgpack's number and bool types only: text, bytes and bools are malformed (fuzzing
    # found "1.5" taken as a weight and any truthy client_mode)
    for field, value in [("weight", "1.5"), ("weight", True), ("bandwidth", b"1"),
                         ("client_mode", 1), ("client_mode", "yes")]:  # fmt: skip
        with pytest.raises(RemoteProtocolError):
            Declaration.from_wire(d.peer_id, dict(d.to_wire(), **{field: value}))
    # an address naming another peer: the group would dial that peer in its place
    other = decl(5)
    with pytest.raises(RemoteProtocolError, match="names another peer"):
        Declaration.from_wire(d.peer_id, dict(d.to_wire(), address=other.address))


# -- reducer ----------------------------------------------------------------------------


def make_reducer(
    codec: str,
    members: list[Member],
    length: int,
    chunk: int = 8,
    local: np.ndarray | None = None,
    **kw: float,
) -> PartReducer:
    acc = np.empty(length + 5, dtype=np.float32)  # the reducer's own span, with slack
    if local is not None:
        acc[:length] = local
    return PartReducer(
        length=length,
        chunk_elements=chunk,
        codec=get_codec(codec),
        members=members,
        senders=[m.peer_id for m in members],
        max_staleness=int(kw.get("max_staleness", 2)),
        decay=float(kw.get("decay", 0.5)),
        acc=acc,
        scratch=np.empty(chunk, dtype=np.float32),
        local=None if local is None else members[0].peer_id,
    )


def send_all(reducer: PartReducer, member: Member, values: np.ndarray, codec: str) -> None:
    enc = get_codec(codec)
    for index in range(reducer.n_chunks):
        part = values[index * reducer.chunk_elements : (index + 1) * reducer.chunk_elements]
        reducer.add_chunk(member.peer_id, index, member.epoch, member.weight, enc.encode(part))


def test_reducer_weighted_mean_and_staleness() -> None:
    rng = np.random.default_rng(0)
    members = [Member(peer(0), 2.0, 5), Member(peer(1), 1.0, 4), Member(peer(2), 3.0, 2)]
    data = [rng.standard_normal(20).astype(np.float32) for _ in members]
    reducer = make_reducer("none", members, 20, local=data[0])
    send_all(reducer, members[1], data[1], "none")
    assert reducer.pending() == []  # peer 2 is 3 epochs behind: stale from the start
    outcome = reducer.finalize({})
    assert outcome.contributors == (peer(0), peer(1))
    assert outcome.dropped == ((peer(2), DropReason.STALE),)
    expected = (2.0 * data[0] + 0.5 * data[1]) / 2.5
    np.testing.assert_allclose(reducer.mean()[:20], expected, rtol=1e-6)
    weights = effective_weights(members, 2, 0.5)
    assert weights == {peer(0): 2.0, peer(1): 0.5, peer(2): None}


@pytest.mark.parametrize("fault", ["partial", "garbage", "nonfinite", "duplicate", "lying"])
def test_reducer_excludes_a_failed_sender_exactly(fault: str) -> None:
    rng = np.random.default_rng(1)
    members = [Member(peer(i), 1.0 + i, 0) for i in range(3)]
    data = [rng.standard_normal(30).astype(np.float32) for _ in members]
    reducer = make_reducer("none", members, 30, local=data[0])
    send_all(reducer, members[1], data[1], "none")
    enc = get_codec("none")
    bad = members[2]
    reducer.add_chunk(bad.peer_id, 0, 0, bad.weight, enc.encode(data[2][:8]))
    reducer.add_chunk(bad.peer_id, 1, 0, bad.weight, enc.encode(data[2][8:16]))
    if fault == "partial":
        reducer.drop(bad.peer_id, DropReason.DEAD)
    else:
        blob = enc.encode(data[2][16:24])
        index, epoch = 2, 0
        if fault == "garbage":
            blob = blob[:-4]
        elif fault == "nonfinite":
            chunk = data[2][16:24].copy()
            chunk[3] = np.nan
            blob = enc.encode(chunk)
        elif fault == "duplicate":
            index = 1
        else:
            epoch = 7
        with pytest.raises(ChunkRejected):
            reducer.add_chunk(bad.peer_id, index, epoch, bad.weight, blob)
        with pytest.raises(KeyError):  # dropped: later chunks are refused
            reducer.add_chunk(bad.peer_id, 3, 0, bad.weight, enc.encode(data[2][24:30]))
    outcome = reducer.finalize({})
    assert outcome.contributors == (peer(0), peer(1))
    assert len(outcome.dropped) == 1 and outcome.dropped[0][0] == bad.peer_id
    expected = (1.0 * data[0] + 2.0 * data[1]) / 3.0
    np.testing.assert_allclose(reducer.mean()[:30], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("codec", "raw"), [("none", False), ("int8", False), ("none", True)])
def test_a_chunk_of_the_wrong_size_is_refused_at_admission(codec: str, raw: bool) -> None:
    """``check_chunk`` looks at the payload's size before a call waits for admission: a
    chunk one byte short (or long) of the codec's blob (or of raw float32) is garbage
    there, before its bytes are held or decoded, and its sender is dropped."""
    members = [Member(peer(i), 1.0, 0) for i in range(3)]
    reducer = make_reducer(codec, members, 20)
    values = np.arange(8, dtype=np.float32)
    blob = values.tobytes() if raw else get_codec(codec).encode(values)
    short, long = members[1].peer_id, members[2].peer_id
    with pytest.raises(ChunkRejected, match="bytes, not"):
        reducer.check_chunk(short, 0, 0, 1.0, blob[:-1], raw=raw)
    with pytest.raises(ChunkRejected, match="bytes, not"):
        reducer.check_chunk(long, 0, 0, 1.0, blob + b"\0", raw=raw)
    assert reducer.reason(short) is reducer.reason(long) is DropReason.GARBAGE
    assert reducer.pending() == [members[0].peer_id]


def test_reducer_finalize_drops_pending_with_reasons_and_int8() -> None:
    rng = np.random.default_rng(2)
    members = [Member(peer(i), 1.0, 3) for i in range(3)]
    data = [rng.standard_normal(5000).astype(np.float32) for _ in members]
    reducer = make_reducer("int8", members, 5000, chunk=4096, local=data[0])
    send_all(reducer, members[1], data[1], "int8")
    outcome = reducer.finalize({peer(2): DropReason.FROZEN})
    assert outcome.dropped == ((peer(2), DropReason.FROZEN),)
    expected = (data[0] + data[1]) / 2
    bound = max(np.abs(d).max() for d in data) / 254 + 1e-6
    assert np.abs(reducer.mean()[:5000] - expected).max() <= bound


def test_reducer_local_nonfinite_is_dropped() -> None:
    members = [Member(peer(0), 1.0, 0), Member(peer(1), 1.0, 0)]
    reducer = make_reducer("none", members, 4, local=np.array([1, np.inf, 0, 0], np.float32))
    assert reducer.reason(peer(0)) is DropReason.NONFINITE
    outcome = reducer.finalize({})
    assert outcome.contributors == () and outcome.weight == 0.0


# -- messages ---------------------------------------------------------------------------


def test_messages_round_trip() -> None:
    members = (decl(1), decl(2, client=True), decl(3))
    conf = GroupConfirmation(9, members, ((0, 40), (40, 100)), 12.5, group_id=77)
    assert GroupConfirmation.from_body(conf.to_body(), 100) == conf
    with pytest.raises(RemoteProtocolError):
        GroupConfirmation.from_body(conf.to_body(), 99)
    for budget in (True, 0, -1.0, math.inf, "12"):  # a bool passed for one second
        with pytest.raises(RemoteProtocolError, match="budget"):
            GroupConfirmation.from_body({**conf.to_body(), "budget": budget}, 100)
    for group in (0, 2**62, None, True, 1.0):
        with pytest.raises(RemoteProtocolError, match="group"):
            GroupConfirmation.from_body({**conf.to_body(), "group": group}, 100)
    with pytest.raises(RemoteProtocolError, match="group"):
        GroupConfirmation.from_body({k: v for k, v in conf.to_body().items() if k != "group"}, 100)
    head = ChunkHeader(9, 1, 3, 7, 2.0, DropReason.NONFINITE, group_id=(77).to_bytes(16, "big"))
    assert ChunkHeader.from_body(head.to_body()) == head
    retried = ChunkHeader(
        9, 1, 3, 7, 2.0, raw=True, retry=True, group_id=(2**62 - 1).to_bytes(16, "big")
    )
    assert ChunkHeader.from_body(retried.to_body()) == retried
    for changes in (
        {"zz": 1}, {"retry": "yes"}, {"retry": 1}, {"weight": True}, {"group": 0},
        {"group": 2**62 - 1}, {"group": True}, {"group": None}, {"group": bytes(15)},
        {"group": bytes(17)}, {"group": "00" * 16},
    ):  # fmt: skip
        with pytest.raises(RemoteProtocolError):
            ChunkHeader.from_body({**retried.to_body(), **changes})
    res = ResultHeader((peer(1),), ((peer(2), DropReason.DEAD),), 3.0, 4)
    assert ResultHeader.from_body(res.to_body()) == res
    with pytest.raises(RemoteProtocolError):
        ResultHeader.from_body({"contributors": [], "dropped": [["x", "dead"]], "weight": 1})


# -- report -----------------------------------------------------------------------------


def part(
    start: int,
    stop: int,
    status: PartStatus,
    dropped: dict[PeerID, DropReason] | None = None,
) -> PartReport:
    """A part of ``[start, stop)`` with ``status`` (reducer and contributors do not matter
    to the report's sums)."""
    return PartReport(
        0, peer(0), (start, stop), status, (), dropped or {}, status is not PartStatus.NONE
    )


ALL, SOME, NONE = PartStatus.ALL, PartStatus.SOME, PartStatus.NONE


@pytest.mark.parametrize(
    ("statuses", "total", "outcome"),
    [
        ([(0, 1000, ALL)], 1000, Outcome.AVERAGED),
        ([(0, 995, ALL), (995, 1000, SOME)], 1000, Outcome.PARTIAL),  # 99.5 %: not full
        ([(0, 995, ALL), (995, 1000, NONE)], 1000, Outcome.PARTIAL),
        ([(0, 500, NONE), (500, 1000, SOME)], 1000, Outcome.PARTIAL),
        ([(0, 500, NONE), (500, 1000, NONE)], 1000, Outcome.FAILED),
        ([(0, 0, ALL), (0, 0, ALL)], 0, Outcome.AVERAGED),  # an empty vector
        ([(0, 0, ALL), (0, 0, SOME)], 0, Outcome.PARTIAL),
        ([(0, 0, NONE), (0, 0, NONE)], 0, Outcome.FAILED),
        ([], 1000, Outcome.FAILED),
    ],
)
def test_the_outcome_is_averaged_only_when_every_element_is(
    statuses: list[tuple[int, int, PartStatus]], total: int, outcome: Outcome
) -> None:
    """``averaged`` promises the whole vector is the group's mean: a partial result is
    never reported as full, not even 99.5 % of it, nor an empty vector none of whose parts
    received a result (its share counts as the parts' statuses say)."""
    assert outcome_of([part(*s) for s in statuses], total) is outcome


def test_the_fractions_of_an_empty_vector_follow_its_parts() -> None:
    """With no element to count, a share is whole when every part has the status, and
    nothing otherwise: parts that all kept their local values do not read as averaged."""
    none = [part(0, 0, NONE), part(0, 0, NONE)]
    assert _fraction(none, 0, (ALL,)) == 0.0
    assert _fraction(none, 0, (ALL, SOME)) == 0.0
    assert _fraction([part(0, 0, ALL), part(0, 0, SOME)], 0, (ALL,)) == 0.0
    assert _fraction([part(0, 0, ALL), part(0, 0, SOME)], 0, (ALL, SOME)) == 1.0
    assert _fraction([], 0, (ALL,)) == 0.0


def test_merged_drops_keep_the_first_reason_seen() -> None:
    """A member dropped by several parts' reducers for different reasons is reported with
    the first part's reason (docs/averaging.md, "The report"); each part keeps its own."""
    parts = [
        part(0, 10, SOME, {peer(1): DropReason.FROZEN}),
        part(10, 20, SOME, {peer(1): DropReason.TIMEOUT, peer(2): DropReason.DEAD}),
        part(20, 30, SOME, {peer(2): DropReason.GARBAGE}),
    ]
    assert merge_dropped(parts) == {peer(1): DropReason.FROZEN, peer(2): DropReason.DEAD}
    assert list(merge_dropped(parts)) == [peer(1), peer(2)]
    assert merge_dropped([]) == {}


@pytest.mark.parametrize(
    ("contributors", "received", "status"),
    [
        ([0, 1, 2], True, ALL),
        ([2, 0, 1, 3], True, ALL),  # a superset still holds every member's values
        ([0, 1], True, SOME),
        ([0, 1, 3], True, SOME),  # as many as the group, but one is not a member
        ([], True, NONE),  # a result over nobody: our values are kept, not "some"
        ([0, 1, 2], False, NONE),
        ([], False, NONE),
    ],
)
def test_part_status(contributors: list[int], received: bool, status: PartStatus) -> None:
    """``all`` only when every member's values are in the received mean, ``some`` when a
    received mean is over fewer of them, ``none`` when nothing usable was received."""
    group = [peer(i) for i in range(3)]
    assert part_status(group, [peer(i) for i in contributors], received) is status


def test_public_surface() -> None:
    import training
    import training.averaging

    names = {
        "Averager",
        "AveragerConfig",
        "AveragingInfo",
        "DropReason",
        "LayoutMismatchError",
        "Outcome",
        "PartReport",
        "PartStatus",
    }
    assert set(training.averaging.__all__) == names
    assert names <= set(training.__all__)


@pytest.mark.parametrize("group_size", [2, 3, 4, 8])
def test_clients_pull_at_most_one_full_peer_away_from_the_others(group_size: int) -> None:
    """Client declarations cannot be checked (no address): a hostile trial's 8 ghost
    clients, which never join, left each of 3 honest peers leading a group of ghosts when
    every client without room took a full peer of its own. Now one full peer per round at
    most ends up without another full peer that it had without the clients."""

    def isolated(groups: list[list[Declaration]]) -> int:
        return sum(sum(not d.client_mode for d in g) == 1 for g in groups)

    for full in range(1, 10):
        for clients in range(0, 20):
            decls = [decl(i) for i in range(full)]
            decls += [decl(i, client=True) for i in range(100, 100 + clients)]
            with_clients = make_groups(decls, group_size, "p")
            without = make_groups(decls[:full], group_size, "p")
            assert isolated(with_clients) <= isolated(without) + 1, (full, clients)
            assert all(len(g) <= group_size for g in with_clients)
