"""The confirmation's plan and the results, re-derived from docs/protocol.md 9.5 and 9.6.

The reference below is written from the text of sections 9, 9.2, 9.5, 9.6 and 10 alone, not
from `training/averaging/*.py` (only their signatures and docstrings were read, to find which
public function computes each rule). Where both agree on thousands of seeded random inputs,
the text is enough for a peer in another language to compute the same plan and to judge a
reducer's result the same way.

Rules reproduced: which members reduce (client mode as 9.2 defines it) and which part each
gets; the spans (bandwidth clipping, scaling, `unit`, rounding, the last part); spans tiling
`[0, total)`; chunk size and chunk spans; the staleness-decayed weights (`E` over every
member, clients included); the shares of the mean; the result header's weight, contributors
and drops, and what a member checks of a header and of a result item.

Where the text reads two ways this file takes the reading stated at the test (a span may
not run backwards; `chunk_bytes / 4` is exact, section 10 making it a multiple of 4).

Written first from the text alone, this file found four places where text and library
differed; the text now gives the library's rules, and the tests follow it: 9.6's shares
are scaled by the largest weight first (weights [3, 5]: 0.37499997, not 0.375); they are
shares of every sender's weight, so a sender that outweighed the contributors by 2**64
and dropped out leaves the part no result, with a note; 9.2 caps a weight at 1e300 (two
contributors of 1e308 had no finite sum); and a confirmation's `status` must be "ok".
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, cast

import numpy as np
import pytest
import torch

from protocol.codecs.registry import get_codec
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity, PeerID
from training.averaging.buffers import BufferPool
from training.averaging.butterfly import Butterfly
from training.averaging.config import AveragerConfig
from training.averaging.grouping import Declaration
from training.averaging.layout import (
    FlatVector,
    bounded_bandwidths,
    check_spans,
    chunk_count,
    chunk_span,
    split_spans,
)
from training.averaging.messages import GroupConfirmation, ResultHeader
from training.averaging.plan import Plan
from training.averaging.reducer import (
    ChunkRejected,
    DropReason,
    Member,
    PartReducer,
    effective_weights,
)
from training.averaging.scans import convex_shares

Span = tuple[int, int]
IDS = [Identity.from_seed(i.to_bytes(2, "big") * 16).peer_id for i in range(260)]
REASONS = ("dead", "frozen", "timeout", "garbage", "nonfinite", "stale")  # 9.6, `dropped`
LAYOUT = "0123456789abcdef"

# --- the reference, from the text --------------------------------------------------------------


def lower_median(values: Sequence[float]) -> float:
    """9.5: "the `(k-1) // 2`-th smallest of the `k` reducers' bandwidths"."""
    return sorted(values)[(len(values) - 1) // 2]


def clip_bandwidths(bandwidths: Sequence[float]) -> list[float]:
    """9.5: "each is clipped to 4 x their lower median"."""
    cap = 4 * lower_median(bandwidths)
    return [min(b, cap) for b in bandwidths]


def spec_spans(total: int, bandwidths: Sequence[float]) -> list[Span]:
    """9.5, "Spans", sentence by sentence: clip, divide by the largest, fsum, unit, round."""
    k = len(bandwidths)
    clipped = clip_bandwidths(bandwidths)
    largest = max(clipped)
    scaled = [b / largest for b in clipped]
    w = math.fsum(scaled)
    unit = 4096 if total >= 4096 * 4 * k else 1
    u = -(-total // unit)
    spans: list[Span] = []
    start = 0
    acc = 0.0
    for i, b in enumerate(scaled):
        acc += b
        stop = total if i == k - 1 else min(total, max(start, round(u * acc / w) * unit))
        spans.append((start, stop))
        start = stop
    return spans


def tiles(spans: Sequence[Span], total: int) -> bool:
    """9.5: spans "tile `[0, total)` in order": each starts where the last stopped, none
    runs backwards (read into "tile"; the parenthesis names only the starts), the last ends
    at `total`."""
    edge = 0
    for start, stop in spans:
        if start != edge or stop < start:
            return False
        edge = stop
    return edge == total


def spec_chunk_elements(chunk_bytes: int) -> int:
    """Section 9: chunks of `chunk_bytes / 4` elements (section 10: a multiple of 4)."""
    assert chunk_bytes % 4 == 0
    return chunk_bytes // 4


def spec_chunk_spans(length: int, chunk_elements: int) -> list[Span]:
    """Section 9: a part cut into chunks of `chunk_elements`, the last one shorter; none for
    an empty part (9.6: "0 for an empty part")."""
    return [
        (start, min(length, start + chunk_elements)) for start in range(0, length, chunk_elements)
    ]


def is_client(value: Mapping[str, Any]) -> bool:
    """9.2: `client_mode` absent is true exactly when `address` is nil."""
    flag = value.get("client_mode")
    return value["address"] is None if flag is None else bool(flag)


def spec_weights(
    members: Sequence[tuple[float, int]], max_staleness: int, decay: float
) -> list[float | None]:
    """9.6, "Effective weight": `E` the largest epoch of all members; None when stale."""
    top = max(epoch for _, epoch in members)
    return [
        None if top - epoch > max_staleness else weight * decay ** (top - epoch)
        for weight, epoch in members
    ]


FLT_MAX = float(np.finfo(np.float32).max)


def float32_down(value: float) -> float:
    """The largest float32 at most `value` (`value >= 0`): 9.6's "rounded down"."""
    near = np.float32(value)
    if float(near) > value:
        near = np.nextafter(near, np.float32(0))
    return float(near)


def spec_shares(weights: Sequence[float], own: int | None = None) -> list[float]:
    """9.6, "The mean": with `own` (the reducer's index) and every weight its weight times
    a ratio float32 holds exactly, the ratios over the smallest power of two at least their
    exact sum (if none rounds); else `u_i = w_i * 2**-t` (`t` the exponent of the largest
    weight) over the smallest power of two at least their exact sum, rounded down to a
    float32."""

    def over_power_of_two(values: list[float], exact: bool) -> list[float] | None:
        total = sum(map(Fraction, values), Fraction(0))
        e = 0
        while Fraction(2) ** e < total:
            e += 1
        while Fraction(2) ** (e - 1) >= total:
            e -= 1
        shares = [float32_down(v * 2.0**-e) for v in values]
        if exact and any(
            Fraction(s) != Fraction(v) / Fraction(2) ** e
            for s, v in zip(shares, values, strict=True)
        ):
            return None
        return shares

    if own is not None:
        ratios = [Fraction(w) / Fraction(weights[own]) for w in weights]
        if all(0 < r <= FLT_MAX and Fraction(float(np.float32(float(r)))) == r for r in ratios):
            shares = over_power_of_two([float(r) for r in ratios], exact=True)
            if shares is not None:
                return shares
    t = math.frexp(max(weights))[1]
    shares = over_power_of_two([w * 2.0**-t for w in weights], exact=False)
    assert shares is not None
    return shares


def spec_header_ok(
    contributors: Sequence[PeerID],
    dropped: Sequence[tuple[PeerID, str]],
    weight: float,
    chunks: int,
    weights: Mapping[PeerID, float | None],
    expected_chunks: int,
) -> bool:
    """9.6, "What a member checks" of a header (`weights`: every member's effective weight)."""
    listed = list(contributors) + [p for p, _ in dropped]
    if any(p not in weights for p in listed) or len(set(listed)) != len(listed):
        return False
    if any(weights[p] is None for p in contributors):
        return False
    if chunks not in (0, expected_chunks):
        return False
    if weight > 0:
        total = math.fsum(cast(float, weights[p]) for p in contributors)
        return bool(contributors) and weight == total and chunks == expected_chunks
    return chunks == 0


def spec_result_body_ok(body: Mapping[str, Any]) -> bool:
    """9.6's header table, with section 9's "a bool or a float is malformed" for ints."""

    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def is_peer(x: object) -> bool:
        try:
            return isinstance(x, str) and str(PeerID.from_base58(x)) == x
        except Exception:
            return False

    keys = {"contributors", "dropped", "weight", "chunks"}
    if not keys <= set(body) or not set(body) <= keys | {"note"}:
        return False
    contributors, dropped = body["contributors"], body["dropped"]
    weight, chunks = body["weight"], body["chunks"]
    if not isinstance(contributors, list) or len(contributors) > 256:
        return False
    if not all(is_peer(p) for p in contributors):
        return False
    if not isinstance(dropped, list) or len(dropped) > 256:
        return False
    for pair in dropped:
        if not isinstance(pair, list) or len(pair) != 2 or not is_peer(pair[0]):
            return False
        if pair[1] not in REASONS:
            return False
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        return False
    if not math.isfinite(weight) or weight < 0:
        return False
    if not is_int(chunks) or not 0 <= chunks < 2**32:
        return False
    note = body.get("note", "")
    return isinstance(note, str) and len(note) <= 200


# --- helpers to meet the library --------------------------------------------------------------


def declaration(i: int, weight: float, epoch: int, bandwidth: float, client: bool) -> Declaration:
    """Member `IDS[i]` as the library's dataclass (address None for a client)."""
    pid = IDS[i]
    address = None if client else f"{pid}@10.0.{i // 250}.{i % 250}:4000"
    return Declaration(pid, address, weight, epoch, bandwidth, LAYOUT, 0, 0)


def wire(i: int, weight: float, epoch: int, bandwidth: float, client: str) -> dict[str, Any]:
    """9.2's map, written from its table: `client` is "no" (full peer), "nil" (address nil,
    flag absent) or "flag" (`client_mode` true with an address, which is then ignored)."""
    pid = IDS[i]
    value: dict[str, Any] = {
        "address": None if client == "nil" else f"{pid}@10.0.{i // 250}.{i % 250}:4000",
        "weight": weight,
        "epoch": epoch,
        "bandwidth": bandwidth,
        "layout": LAYOUT,
        "count": 0,
    }
    if client == "flag":
        value["client_mode"] = True
    return value


def confirmation_body(
    round_no: int, members: Sequence[tuple[int, dict[str, Any]]], spans: Sequence[Span]
) -> dict[str, Any]:
    """9.5's table: the body a leader sends, written by hand."""
    return {
        "status": "ok",
        "round": round_no,
        "members": [[str(IDS[i]), value] for i, value in members],
        "spans": [[a, b] for a, b in spans],
        "budget": 3.5,
        "group": 12345,
    }


def parses(body: Any, total: int) -> bool:
    """Whether the library takes a confirmation body."""
    try:
        GroupConfirmation.from_body(body, total)
    except RemoteProtocolError:
        return False
    return True


def member_side(conf: GroupConfirmation, codec: str = "none", **params: Any) -> Butterfly:
    """A Butterfly for the first member, for its header and item checks only (no network;
    node, liveness and service are None: those two private checks are the smallest entry
    the signatures offer, short of a whole round over TCP)."""
    config = AveragerConfig(codec=codec, codec_params=params)
    plan = Plan.of(conf, conf.members[0].peer_id, config)
    flat = FlatVector.of([torch.zeros(max(conf.spans[-1][1], 1))])
    none = cast(Any, None)
    zeros = np.zeros(16, np.float32)
    return Butterfly(
        none, plan, flat, get_codec(codec, **params), config, "m", none, none, zeros,
        BufferPool(1 << 16),
    )  # fmt: skip


# --- spans -------------------------------------------------------------------------------------


def random_bandwidths(rng: random.Random, k: int) -> list[float]:
    """Equal, small integers, up to 1e6 apart, or anywhere in float64's range."""
    mode = rng.random()
    if mode < 0.2:
        return [rng.choice([1.0, 3.0, 125e6])] * k
    if mode < 0.4:
        return [float(rng.randint(1, 5)) for _ in range(k)]
    if mode < 0.85:
        return [10 ** rng.uniform(0, 6) for _ in range(k)]
    return [10 ** rng.uniform(-300, 300) for _ in range(k)]


def random_total(rng: random.Random, k: int) -> int:
    """1 to a few million, with the `unit` edge `4096 x 4k` and its neighbours."""
    edge = 4096 * 4 * k
    return rng.choice(
        [rng.randint(1, 50), rng.randint(1, 70_000), rng.randint(1, 4_000_000), edge - 1, edge]
    )


def test_spans_from_the_text_examples() -> None:
    """Hand-worked cases of 9.5's sentences, so the reference itself is pinned."""
    # k = 2 equal: 4096 x 4k = 32768 switches `unit` to 4096; below it ties go to even.
    assert spec_spans(32768, [1.0, 1.0]) == [(0, 16384), (16384, 32768)]
    assert spec_spans(32767, [1.0, 1.0]) == [(0, 16384), (16384, 32767)]  # 16383.5 -> 16384
    assert spec_spans(32765, [1.0, 1.0]) == [(0, 16382), (16382, 32765)]  # 16382.5 -> 16382
    # A liar declaring 1e300 in a pair gets 4x the other, not everything (lower median).
    assert spec_spans(50, [1.0, 1e300]) == [(0, 10), (10, 50)]
    # Lower median of 4 is the 2nd smallest: 2; 100 is clipped to 8.
    assert clip_bandwidths([1.0, 2.0, 3.0, 100.0]) == [1.0, 2.0, 3.0, 8.0]
    # A tiny share rounds to an empty part; the last part always ends at `total`.
    assert spec_spans(10, [1.0, 1e-6, 1.0]) == [(0, 5), (5, 5), (5, 10)]
    assert spec_spans(0, [1.0, 2.0]) == [(0, 0), (0, 0)]
    for total, bandwidths in [
        (32768, [1.0, 1.0]),
        (32767, [1.0, 1.0]),
        (32765, [1.0, 1.0]),
        (50, [1.0, 1e300]),
        (10, [1.0, 1e-6, 1.0]),
        (0, [1.0, 2.0]),
    ]:
        assert split_spans(total, bounded_bandwidths(bandwidths)) == spec_spans(total, bandwidths)


def test_random_spans_match_the_library() -> None:
    """2-20 reducers, bandwidths equal to 1e600 apart, totals 1 to 4M: identical spans."""
    rng = random.Random(95)
    for case in range(3000):
        k = rng.randint(1, 20)
        bandwidths = random_bandwidths(rng, k)
        total = random_total(rng, k)
        assert bounded_bandwidths(bandwidths) == clip_bandwidths(bandwidths), (case, bandwidths)
        mine = spec_spans(total, bandwidths)
        assert tiles(mine, total)
        assert split_spans(total, bounded_bandwidths(bandwidths)) == mine, (case, total)


def test_small_spans_exhaustively() -> None:
    """Every 1-3 reducer mix of awkward bandwidths (ties, extremes) at totals 0-40 and the
    `unit` edges: the rounding ties and the clipping at the ends of float64."""
    values = [1.0, 3.0, 7.0, 0.1, 5e-324, 1.7976931348623157e308]
    for k in (1, 2, 3):
        edges = [4096 * 4 * k - 1, 4096 * 4 * k, 4096 * 4 * k * 3 + 2048]
        for bandwidths in itertools.product(values, repeat=k):
            for total in [*range(41), *edges]:
                mine = spec_spans(total, list(bandwidths))
                theirs = split_spans(total, bounded_bandwidths(list(bandwidths)))
                assert theirs == mine, (total, bandwidths)


# --- chunks ------------------------------------------------------------------------------------


def test_chunks_of_a_part() -> None:
    """Section 9: `chunk_bytes / 4` elements, the last chunk shorter, indices from 0."""
    rng = random.Random(96)
    for case in range(1500):
        chunk_bytes = rng.choice([4096, 2**21, 4 * rng.randint(1024, 2**19)])
        elements = AveragerConfig(chunk_bytes=chunk_bytes).chunk_elements
        assert elements == spec_chunk_elements(chunk_bytes)
        length = rng.choice([0, 1, elements - 1, elements, elements + 1, rng.randint(0, 3 << 21)])
        length = max(length, 0)
        mine = spec_chunk_spans(length, elements)
        assert chunk_count(length, elements) == len(mine), (case, length, elements)
        for index in {0, len(mine) // 2, len(mine) - 1} if mine else ():
            assert chunk_span(length, elements, index) == mine[index], (case, index)


# --- the confirmation ---------------------------------------------------------------------------


@dataclass
class Group:
    """A random confirmed group: wire declarations in member order, and the plan's inputs."""

    indices: list[int]
    values: list[dict[str, Any]]
    total: int
    spans: list[Span]
    max_staleness: int
    decay: float

    def pairs(self) -> list[tuple[int, dict[str, Any]]]:
        """(identity index, wire declaration) in member order."""
        return list(zip(self.indices, self.values, strict=True))


def random_group(rng: random.Random) -> Group:
    """2-20 members, some clients (either way 9.2 allows), at least one reducer."""
    n = rng.randint(2, 20)
    indices = rng.sample(range(len(IDS)), n)
    kinds = [rng.choice(["no", "no", "no", "nil", "flag"]) for _ in range(n)]
    kinds[rng.randrange(n)] = "no"
    top = rng.choice([0, 7, 2**62 - 1])
    bandwidths = random_bandwidths(rng, n)
    values = [
        wire(
            i,
            rng.choice([1.0, 3, 0.25, 10 ** rng.uniform(-5, 5)]),
            max(0, top - rng.randint(0, 5)),
            bandwidths[j],
            kinds[j],
        )
        for j, i in enumerate(indices)
    ]
    reducers = [v["bandwidth"] for v in values if not is_client(v)]
    total = random_total(rng, len(reducers))
    return Group(
        indices,
        values,
        total,
        spec_spans(total, reducers),
        rng.randint(0, 3),
        rng.choice([1.0, 0.5, 0.9, 0.1, 1e-300]),
    )


def test_random_confirmations_give_the_same_plan() -> None:
    """A body built from 9.5's table parses; reducer `i` is the `i`-th non-client member;
    every member's weight and `E` (clients included) are the text's."""
    rng = random.Random(97)
    for case in range(400):
        g = random_group(rng)
        body = confirmation_body(rng.randrange(2**62), g.pairs(), g.spans)
        conf = GroupConfirmation.from_body(body, g.total)
        reducers = [IDS[i] for i, v in g.pairs() if not is_client(v)]
        assert [d.peer_id for d in conf.reducers] == reducers, case
        assert list(conf.spans) == g.spans
        config = AveragerConfig(max_staleness=g.max_staleness, staleness_decay=g.decay)
        weights = spec_weights(
            [(v["weight"], v["epoch"]) for v in g.values], g.max_staleness, g.decay
        )
        for i, value in g.pairs():
            plan = Plan.of(conf, IDS[i], config)
            assert [d.peer_id for d in plan.reducers] == reducers
            assert plan.my_part == (None if is_client(value) else reducers.index(IDS[i]))
            assert plan.max_epoch == max(v["epoch"] for v in g.values)
            mine = dict(zip((IDS[i] for i in g.indices), weights, strict=True))
            assert plan.weights == mine, case


def mutate_spans(rng: random.Random, spans: list[Span], total: int) -> list[Span]:
    """A near-tiling: one boundary moved, a span reversed, one missing or extra, or none."""
    out = list(spans)
    j = rng.randrange(len(out))
    start, stop = out[j]
    how = rng.randrange(7)
    if how == 0:
        out[j] = (start + rng.choice([-1, 1]), stop)
    elif how == 1:
        out[j] = (start, stop + rng.choice([-1, 1]))
    elif how == 2 and j + 1 < len(out):  # the boundary runs backwards, starts still chain
        back = rng.randint(0, start)
        out[j] = (start, back)
        out[j + 1] = (back, out[j + 1][1])
    elif how == 3:
        out.pop(j)
    elif how == 4:
        out.insert(j, (start, start))
    elif how == 5:
        out[-1] = (out[-1][0], total + rng.choice([-1, 1]))
    return out


def test_random_spans_tile_as_the_library_checks() -> None:
    """9.5: spans tile `[0, total)` and there is one per non-client member; else refused."""
    rng = random.Random(98)
    for case in range(1500):
        g = random_group(rng)
        spans = mutate_spans(rng, g.spans, g.total)
        n_reducers = sum(not is_client(v) for v in g.values)
        expect = tiles(spans, g.total) and len(spans) == n_reducers
        body = confirmation_body(5, g.pairs(), spans)
        assert parses(body, g.total) == expect, (case, g.total, spans)
        try:
            check_spans(spans, g.total)
        except ValueError:
            assert not tiles(spans, g.total), (case, spans)
        else:
            assert tiles(spans, g.total), (case, spans)


def test_a_span_that_runs_backwards_is_refused() -> None:
    """The smallest case the parenthesis of 9.5 ("`start` of each = `stop` of the one
    before") lets through and "tile" does not."""
    members = [(0, wire(0, 1.0, 0, 1.0, "no")), (1, wire(1, 1.0, 0, 1.0, "no"))]
    assert not parses(confirmation_body(5, members, [(0, 2), (2, 1)]), 1)
    with pytest.raises(ValueError):
        check_spans([(0, 2), (2, 1)], 1)


def _confirmation_variants() -> list[tuple[str, Callable[[dict[str, Any]], None], bool]]:
    """(what, how to change a valid 3-member body, whether 9.5 still takes it)."""

    def setter(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
        return lambda body: body.__setitem__(key, value)

    def twice(body: dict[str, Any]) -> None:
        body["members"][2][0] = body["members"][0][0]

    def spans_float(body: dict[str, Any]) -> None:
        body["spans"][0][1] = float(body["spans"][0][1])

    def spans_bool(body: dict[str, Any]) -> None:
        body["spans"][0][0] = False

    return [
        ("as built", lambda body: None, True),
        ("budget int", setter("budget", 2), True),
        ("budget tiny", setter("budget", 1e-300), True),
        ("budget 0", setter("budget", 0), False),
        ("budget negative", setter("budget", -1.0), False),
        ("budget inf", setter("budget", math.inf), False),
        ("budget nan", setter("budget", math.nan), False),
        ("budget bool", setter("budget", True), False),
        ("budget str", setter("budget", "1"), False),
        ("round 2**62 - 1", setter("round", 2**62 - 1), True),
        ("round 2**62", setter("round", 2**62), False),
        ("round -1", setter("round", -1), False),
        ("round bool", setter("round", True), False),
        ("group 1", setter("group", 1), True),
        ("group 2**62 - 1", setter("group", 2**62 - 1), True),
        ("group 0", setter("group", 0), False),
        ("group 2**62", setter("group", 2**62), False),
        ("group bool", setter("group", True), False),
        ("group float", setter("group", 5.0), False),
        ("no group", lambda body: body.pop("group"), False),
        ("no members", setter("members", []), False),
        ("a PeerID twice", twice, False),
        ("a span bound as float", spans_float, False),
        ("a span bound as bool", spans_bool, False),
    ]


@pytest.mark.parametrize(
    ("what", "change", "taken"),
    _confirmation_variants(),
    ids=[what for what, _, _ in _confirmation_variants()],
)
def test_confirmation_fields(
    what: str, change: Callable[[dict[str, Any]], None], taken: bool
) -> None:
    """9.5's table (and section 9: ints are msgpack ints, `round` in [0, 2**62))."""
    members = [(i, wire(i, 1.0, 3, float(i + 1), "no")) for i in range(3)]
    body = confirmation_body(5, members, spec_spans(100, [1.0, 2.0, 3.0]))
    change(body)
    assert parses(body, 100) == taken, what


@pytest.mark.parametrize("status", ["full", 5, None, "absent"])
def test_confirmation_status_is_ok(status: object) -> None:
    """9.5: `status` is \"ok\"; any other value (or none) is not a confirmation."""
    members = [(i, wire(i, 1.0, 3, 1.0, "no")) for i in range(2)]
    body = confirmation_body(5, members, spec_spans(100, [1.0, 1.0]))
    if status == "absent":
        del body["status"]
    else:
        body["status"] = status
    assert not parses(body, 100)


@pytest.mark.parametrize(("n", "taken"), [(256, True), (257, False)])
def test_confirmation_members_at_most_256(n: int, taken: bool) -> None:
    """9.5: `members` holds 1 to 256 pairs (here one reducer and the rest clients)."""
    members = [(i, wire(i, 1.0, 0, 1.0, "no" if i == 0 else "nil")) for i in range(n)]
    assert parses(confirmation_body(1, members, [(0, 10)]), 10) == taken


# --- weights and shares -----------------------------------------------------------------------


def test_random_effective_weights() -> None:
    """9.6: `weight * decay ** (E - e)` in float64, None past `max_staleness`."""
    rng = random.Random(99)
    for case in range(3000):
        n = rng.randint(1, 20)
        top = rng.choice([0, 9, 2**62 - 1])
        members = [
            (10 ** rng.uniform(-300, 300), max(0, top - rng.randint(0, 6))) for _ in range(n)
        ]
        max_staleness = rng.randint(0, 4)
        decay = rng.choice([1.0, 0.5, 0.9, 0.3, 1e-300])
        theirs = effective_weights(
            [Member(IDS[j], w, e) for j, (w, e) in enumerate(members)], max_staleness, decay
        )
        mine = spec_weights(members, max_staleness, decay)
        assert theirs == {IDS[j]: w for j, w in enumerate(mine)}, (case, members)


def random_weights(rng: random.Random) -> list[float]:
    """1-20 positive weights, similar or up to 1e60 apart (no float64 overflow)."""
    n = rng.randint(1, 20)
    if rng.random() < 0.5:
        return [rng.uniform(0.1, 10) for _ in range(n)]
    if rng.random() < 0.5:
        return [float(rng.randint(1, 6)) for _ in range(n)]
    return [10 ** rng.uniform(-30, 30) for _ in range(n)]


def test_shares_within_one_float32_step_of_the_text() -> None:
    """9.6's shares, to within one float32 step of the library's (exact agreement is the
    test below), with and without the reducer among the senders."""
    rng = random.Random(100)
    for case in range(3000):
        weights = random_weights(rng)
        own = rng.choice([None, 0, len(weights) - 1])
        ids = dict(zip(IDS[: len(weights)], weights, strict=True))
        theirs = list(convex_shares(ids, own=None if own is None else IDS[own]).values())
        for mine, their in zip(spec_shares(weights, own), theirs, strict=True):
            step = float(np.spacing(np.float32(max(mine, their))))
            assert abs(mine - their) <= step, (case, weights, own)


@pytest.mark.parametrize(
    ("weights", "own"),
    [
        ([3.0, 5.0], None),
        ([3e16, 3.0], None),
        ([0.1, 0.3, 6.0], None),
        ([1e300, 1e300], None),
        ([3.0, 3.0], 0),  # exact ratios: 1/2 each
        ([1.0, 2.0, 2.0], 1),
        ([1.0, 3.0], 1),  # 1/3 is no float32: the second rule
        ([0.1, 0.1, 0.1], 2),
        ([1e300, 1e-300], 1),  # a ratio beyond float32
    ],
    ids=str,
)
def test_shares_exactly_as_the_text_says(weights: list[float], own: int | None) -> None:
    """9.6, "The mean": exact ratios to the reducer's weight over a power of two, or the
    weights over a power of two after scaling by the largest weight's exponent."""
    ids = dict(zip(IDS[: len(weights)], weights, strict=True))
    theirs = list(convex_shares(ids, own=None if own is None else IDS[own]).values())
    assert theirs == spec_shares(weights, own)


# --- a reducer's part ---------------------------------------------------------------------------


def reduce_part(
    rng: random.Random,
    members: Sequence[tuple[float, int]],
    length: int,
    chunk_elements: int,
    max_staleness: int,
    complete: Sequence[bool],
    codec: str = "none",
    values: Sequence[np.ndarray[Any, Any]] | None = None,
) -> tuple[Any, PartReducer, list[np.ndarray[Any, Any]]]:
    """Member 0 reduces a part that every member sends (all chunks, or a prefix when not
    `complete`), chunks in a random order and interleaved; returns the outcome."""
    ms = [Member(IDS[j], w, e) for j, (w, e) in enumerate(members)]
    if values is None:
        values = [
            (rng.gauss(0, 1) * 10 ** rng.uniform(-2, 2) * np.ones(length)
             + np.arange(length) % 7).astype(np.float32)
            for _ in members
        ]  # fmt: skip
    vals = [np.asarray(v, np.float32) for v in values]
    reducer = PartReducer(
        length=length,
        chunk_elements=chunk_elements,
        codec=get_codec(codec),
        members=ms,
        senders=[m.peer_id for m in ms],
        max_staleness=max_staleness,
        decay=0.5,
        acc=vals[0].copy(),
        scratch=np.zeros(chunk_elements, np.float32),
        local=IDS[0],
    )
    for _ in reducer.load_steps():
        pass
    spans = spec_chunk_spans(length, chunk_elements)
    calls = []
    for j in range(1, len(ms)):
        if reducer.is_pending(IDS[j]):
            order = list(range(len(spans)))
            rng.shuffle(order)
            sent = order if complete[j] else order[: rng.randrange(len(spans))]
            calls += [(j, index) for index in sent]
    rng.shuffle(calls)
    for j, index in calls:
        a, b = spans[index]
        chunk = vals[j][a:b]
        raw = codec == "none" and rng.random() < 0.5
        blob = chunk.tobytes() if raw else get_codec(codec).encode(chunk)
        reducer.add_chunk(IDS[j], index, ms[j].epoch, ms[j].weight, blob, raw=raw)
    return reducer.finalize({}), reducer, vals


def test_random_parts_count_as_the_text_says() -> None:
    """9.6: contributors are the non-stale senders whose whole part came (the reducer among
    them); the others are dropped (`stale`, or `timeout` for one cut short); `weight` is the
    fsum of the contributors' effective weights; the mean is the weighted mean within
    float32 rounding; and the header built from all that passes a member's checks."""
    rng = random.Random(101)
    cases = 0
    for case in range(250):
        n = rng.randint(2, 12)
        top = rng.choice([3, 2**62 - 1])
        # Weights 1e400 apart only when every fresh sender completes: a sender cut short
        # that outweighs the rest by 2**64 leaves no result (test_a_heavy_member_...).
        spread = rng.choice([1.0, 8, 200])
        members = [
            (rng.choice([1.0, rng.uniform(0.1, 10), 10 ** rng.uniform(-spread, spread)]),
             top - rng.randint(0, 4))
            for _ in range(n)
        ]  # fmt: skip
        max_staleness = rng.randint(0, 3)
        elements = rng.choice([1024, 1500, 4096])
        length = rng.choice([0, 1, elements, rng.randint(1, 4 * elements)])
        complete = [rng.random() < 0.8 or length == 0 or spread > 8 for _ in range(n)]
        complete[0] = True
        outcome, reducer, vals = reduce_part(
            rng, members, length, elements, max_staleness, complete
        )
        weights = spec_weights(members, max_staleness, 0.5)
        stale = {IDS[j] for j in range(n) if weights[j] is None}
        short = {IDS[j] for j in range(n) if not complete[j] and weights[j] is not None}
        expect = [j for j in range(n) if IDS[j] not in stale | short]
        assert sorted(outcome.contributors) == sorted(IDS[j] for j in expect), case
        assert dict(outcome.dropped) == {
            **{p: DropReason.STALE for p in stale},
            **{p: DropReason.TIMEOUT for p in short},
        }, case
        total = math.fsum(cast(float, weights[j]) for j in expect)
        assert outcome.weight == total, case
        by_peer = {IDS[j]: w for j, w in enumerate(weights)}
        chunks = len(spec_chunk_spans(length, elements)) if outcome.weight > 0 else 0
        assert spec_header_ok(
            outcome.contributors, outcome.dropped, outcome.weight, chunks, by_peer, chunks
        )
        if total > 0 and length:
            mean = np.zeros(length)
            for j in expect:
                mean += cast(float, weights[j]) / total * vals[j].astype(np.float64)
            bound = max(float(np.max(np.abs(vals[j]))) for j in expect)
            tolerance = 8 * (len(expect) + 1) * 2.0**-24 * bound + 1e-45
            got = reducer.mean().astype(np.float64)
            assert float(np.max(np.abs(got - mean))) <= tolerance, case
        cases += 1
    assert cases == 250


def test_chunk_headers_carry_the_declared_weight() -> None:
    """9.5: chunk headers must match the listed declarations (`epoch`, `weight`), not the
    decayed weight; section 9: an index beyond the part, a payload of another size or a
    chunk repeated before the part is complete is `garbage`; 9.6: a stale member is out
    (`stale`) from the start."""
    members = [(1.0, 5), (3.0, 4), (2.0, 1), (1.0, 5), (1.0, 5), (1.0, 5), (1.0, 5)]  # E 5
    ms = [Member(IDS[j], w, e) for j, (w, e) in enumerate(members)]
    vals = [np.full(3000, j, np.float32) for j in range(len(ms))]
    reducer = PartReducer(
        length=3000,
        chunk_elements=1024,
        codec=get_codec("none"),
        members=ms,
        senders=[m.peer_id for m in ms],
        max_staleness=2,
        decay=0.5,
        acc=vals[0].copy(),
        scratch=np.zeros(1024, np.float32),
        local=IDS[0],
    )
    for _ in reducer.load_steps():
        pass
    assert reducer.reason(IDS[2]) == DropReason.STALE
    chunk = vals[1][:1024].tobytes()
    cases = [
        (1, 0, 4, 3.0 * 0.5, chunk),  # the decayed weight: not the declared one
        (3, 0, 4, 1.0, chunk),  # another epoch
        (4, 3, 5, 1.0, chunk),  # chunk 3 of a 3-chunk part
        (5, 2, 5, 1.0, vals[5][2048:2999].tobytes()),  # the last chunk, one value short
    ]
    for j, index, epoch, weight, blob in cases:
        with pytest.raises(ChunkRejected) as caught:
            reducer.add_chunk(IDS[j], index, epoch, weight, blob, raw=True)
        assert caught.value.reason == DropReason.GARBAGE, j
    assert not reducer.add_chunk(IDS[6], 0, 5, 1.0, chunk, raw=True)
    with pytest.raises(ChunkRejected) as caught:
        reducer.add_chunk(IDS[6], 0, 5, 1.0, chunk, raw=True)
    assert caught.value.reason == DropReason.GARBAGE
    outcome = reducer.finalize({})
    assert outcome.contributors == (IDS[0],)
    assert outcome.weight == 1.0


def test_weights_sum_to_a_finite_header_weight() -> None:
    """9.2: a declared weight is at most 1e300, so a group's weights sum to a finite float64
    (two of 1e308 made the reducer's fsum overflow); the largest two sum exactly."""
    members = [(1e300, 0), (1e300, 0)]
    outcome, _, _ = reduce_part(random.Random(103), members, 4, 1024, 2, [True, True])
    assert outcome.weight == 2e300
    for weight, taken in ((1e300, True), (1.0000000000000002e300, False), (1e308, False)):
        try:
            Declaration.from_wire(IDS[0], wire(0, weight, 0, 1.0, "no"))
        except RemoteProtocolError:
            assert not taken, weight
        else:
            assert taken, weight


@pytest.mark.parametrize("others", [0, 1])
def test_a_heavy_member_that_drops_out(others: int) -> None:
    """The reducer, `others` light members that complete, and one of weight 2**70 that
    sends nothing: the contributors hold under 2**-64 of the senders' weight, so 9.6 makes
    the part no result, with a note."""
    members = [(1.0, 0)] * (1 + others) + [(2.0**70, 0)]
    complete = [True] * (1 + others) + [False]
    outcome, _, _ = reduce_part(random.Random(106), members, 4, 1024, 2, complete)
    assert outcome.contributors == () and outcome.weight == 0.0
    assert outcome.note and len(outcome.note) <= 200


@pytest.mark.parametrize(("own", "taken"), [(60000.0, True), (90000.0, False)])
def test_a_mean_float16_cannot_carry_is_no_result(own: float, taken: bool) -> None:
    """9.6: items decode to finite values only, and float16 makes magnitudes above 65504
    infinite (9.1), so a mean of 9 x `own` (the reducer's float32 values) and 1 x 0 is a
    result at 60000 x 0.9 and no result at 90000 x 0.9: `weight` 0 and a `note` saying why."""
    values = [np.full(10, own, np.float32), np.zeros(10, np.float32)]
    outcome, _, _ = reduce_part(
        random.Random(104), [(9.0, 0), (1.0, 0)], 10, 1024, 2, [True, True], "float16", values
    )
    assert (outcome.weight > 0) == taken
    assert (outcome.note == "") == taken
    assert len(outcome.note) <= 200


# --- what a member checks ----------------------------------------------------------------------


def mutate_header(
    rng: random.Random,
    contributors: list[PeerID],
    dropped: list[tuple[PeerID, str]],
    weight: float,
    chunks: int,
    group: Sequence[PeerID],
    stale: Sequence[PeerID],
) -> tuple[list[PeerID], list[tuple[PeerID, str]], float, int]:
    """One of the faults 9.6 names, or a near miss that must still pass."""
    how = rng.randrange(11)
    strangers = [p for p in IDS if p not in group]
    if how == 0:
        contributors = [*contributors, rng.choice(strangers)]
    elif how == 1:
        dropped = [*dropped, (rng.choice(strangers), rng.choice(REASONS))]
    elif how == 2 and contributors:
        contributors = [*contributors, rng.choice(contributors)]
    elif how == 3 and contributors:
        dropped = [*dropped, (rng.choice(contributors), rng.choice(REASONS))]
    elif how == 4 and dropped:
        dropped = [*dropped, (rng.choice(dropped)[0], rng.choice(REASONS))]
    elif how == 5 and stale:
        contributors = [*contributors, rng.choice(stale)]
    elif how == 6:
        weight = math.nextafter(weight, rng.choice([0.0, math.inf]))
    elif how == 7:
        chunks += rng.choice([-1, 1])
    elif how == 8:
        chunks = 0
    elif how == 9:
        weight = 0.0
    elif how == 10:
        contributors, weight = [], max(weight, 1.0)
    return contributors, dropped, weight, max(chunks, 0)


def test_random_headers_are_judged_as_the_text_says() -> None:
    """9.6, "What a member checks": random valid headers of random groups, and each with
    one fault (or a change that is none); the text and the library give the same verdict."""
    rng = random.Random(105)
    verdicts = {True: 0, False: 0}
    for case in range(1200):
        g = random_group(rng)
        members = [
            declaration(i, v["weight"], v["epoch"], v["bandwidth"], is_client(v))
            for i, v in g.pairs()
        ]
        total = max(g.total, 1)
        spans = spec_spans(total, [d.bandwidth for d in members if not d.client_mode])
        conf = GroupConfirmation(1, tuple(members), tuple(spans), 1.0, group_id=1)
        config = AveragerConfig(max_staleness=g.max_staleness, staleness_decay=g.decay)
        plan = Plan.of(conf, members[0].peer_id, config)
        side = member_side(conf)
        side.plan = plan
        weights = dict(
            zip(
                (d.peer_id for d in members),
                spec_weights([(d.weight, d.epoch) for d in members], g.max_staleness, g.decay),
                strict=True,
            )
        )
        group = [d.peer_id for d in members]
        stale = [p for p, w in weights.items() if w is None]
        fresh = [p for p, w in weights.items() if w is not None]
        contributors = rng.sample(fresh, rng.randint(0, len(fresh)))
        rest = [p for p in group if p not in contributors]
        dropped = [(p, rng.choice(REASONS)) for p in rng.sample(rest, rng.randint(0, len(rest)))]
        expected = len(spec_chunk_spans(rng.randint(0, 5000), rng.choice([1024, 4096])))
        weight = math.fsum(cast(float, weights[p]) for p in contributors)
        if rng.random() < 0.1:
            weight = 0.0
        chunks = expected if weight > 0 else 0
        if rng.random() < 0.7:
            contributors, dropped, weight, chunks = mutate_header(
                rng, contributors, dropped, weight, chunks, group, stale
            )
        mine = spec_header_ok(contributors, dropped, weight, chunks, weights, expected)
        header = ResultHeader(
            tuple(contributors),
            tuple((p, DropReason(r)) for p, r in dropped),
            weight,
            chunks,
        )
        try:
            side._check_header(header, expected)
        except RemoteProtocolError:
            theirs = False
        else:
            theirs = True
        assert theirs == mine, (case, header, expected)
        verdicts[mine] += 1
    assert min(verdicts.values()) > 300, verdicts


def _header_bodies() -> list[tuple[str, dict[str, Any]]]:
    """Result header bodies, each one field off 9.6's table or right at its edge."""
    a, b = str(IDS[0]), str(IDS[1])
    base: dict[str, Any] = {"contributors": [a], "dropped": [[b, "timeout"]], "weight": 1.5}
    base["chunks"] = 3
    variants: list[tuple[str, dict[str, Any]]] = [("as built", {})]
    variants += [(f"weight {w!r}", {"weight": w}) for w in [0, 2, 0.0, -0.0, 1e308]]
    variants += [(f"weight {w!r}", {"weight": w}) for w in [-1e-300, math.inf, math.nan]]
    variants += [("weight bool", {"weight": True}), ("weight str", {"weight": "1"})]
    variants += [(f"chunks {c!r}", {"chunks": c}) for c in [0, 2**32 - 1, 2**32, -1, 3.0]]
    variants += [(f"dropped {r}", {"dropped": [[b, r]]}) for r in [*REASONS, "complete", ""]]
    variants += [
        ("note", {"note": "the mean overflows"}),
        ("note 200", {"note": "x" * 200}),
        ("note 201", {"note": "x" * 201}),
        ("note int", {"note": 5}),
        ("extra key", {"t": 1.0}),
        ("contributor not base58", {"contributors": ["0OIl"]}),
        ("contributor bytes", {"contributors": [IDS[0].raw]}),
        ("dropped triple", {"dropped": [[b, "dead", "x"]]}),
        ("256 contributors", {"contributors": [str(p) for p in IDS[:256]]}),
        ("257 contributors", {"contributors": [str(p) for p in IDS[:257]]}),
        ("257 dropped", {"dropped": [[str(p), "dead"] for p in IDS[:257]]}),
    ]
    return [(what, {**base, **change}) for what, change in variants] + [
        ("without chunks", {k: v for k, v in base.items() if k != "chunks"})
    ]


@pytest.mark.parametrize(("what", "body"), _header_bodies(), ids=[w for w, _ in _header_bodies()])
def test_result_header_fields(what: str, body: dict[str, Any]) -> None:
    """9.6's header table: the library parses exactly the bodies the text allows."""
    try:
        ResultHeader.from_body(body)
    except RemoteProtocolError:
        taken = False
    else:
        taken = True
    assert taken == spec_result_body_ok(body), what


def test_an_empty_note_is_omitted() -> None:
    """9.6: `note` is "omitted when empty"."""
    assert "note" not in ResultHeader((IDS[0],), (), 1.0, 2).to_body()
    assert ResultHeader((), (), 0.0, 0, "why").to_body()["note"] == "why"


def _items() -> list[tuple[str, str, dict[str, Any], bool, bool]]:
    """(codec, what, codec params, raw flag, taken): 9.6's items per codec."""
    return [
        (codec, payload, params, raw, taken)
        for codec, params in [("none", {}), ("topk", {"k": 2}), ("float16", {}), ("int8", {})]
        for payload, raw, taken in [
            ("values", True, codec in ("none", "topk")),  # `raw` counts under none and topk
            ("blob", False, True),  # a blob of the round's codec
            ("blob", True, codec not in ("none", "topk")),  # raw ignored: still a blob
            ("short values", True, False),  # not that chunk's element count
            ("nan values", True, False),  # not finite
            ("none blob", False, codec == "none"),  # 9.1: another codec's blob is refused
            ("nan none blob", False, False),
        ]
    ]


@pytest.mark.parametrize(("codec", "payload", "params", "raw", "taken"), _items())
def test_result_items(
    codec: str, payload: str, params: dict[str, Any], raw: bool, taken: bool
) -> None:
    """9.6: an item must decode to its chunk's element count, finite; `raw` counts only
    under `none` and `topk`, the other codecs decode every payload as a blob."""
    members = tuple(declaration(i, 1.0, 0, 1.0, False) for i in range(2))
    conf = GroupConfirmation(1, members, ((0, 4), (4, 8)), 1.0, group_id=1)
    side = member_side(conf, codec, **params)
    values = np.array([1, -2, 0.5, 0], np.float32)
    nan = np.array([1, np.nan, 0, 0], np.float32)
    payloads = {
        "values": values.tobytes(),
        "blob": get_codec(codec, **params).encode(values),
        "short values": values[:3].tobytes(),
        "nan values": nan.tobytes(),
        "none blob": get_codec("none").encode(values),
        "nan none blob": get_codec("none").encode(nan),
    }
    body: dict[str, object] = {"chunk": 0, "raw": True} if raw else {"chunk": 0}
    try:
        side._take(body, payloads[payload], 4, 8)
    except RemoteProtocolError:
        assert not taken
    else:
        assert taken
