"""Matchmaking rules, pure: declarations, rendezvous rounds, the Moshpit grid, leaders.

Rounds. Round ``r`` of an averager is the DHT key ``{prefix}/round/{r}``; it *closes* at
unix time ``r * window``. A peer that becomes ready at time ``t`` joins the round that closes
next if that is at least ``window / 2`` away, or if somebody has already declared in it and
it is still ``margin`` away; otherwise the round after. So peers that step within about half
a window of each other meet, a lone peer waits between ``window / 2`` and ``1.5 * window``,
and nobody needs a counter that all peers must agree on.

Groups. Everybody who declared in a round computes the same grouping from the same set:
full (non-client) peers are ranked by ``sha256(seed | peer id)`` where the seed changes
every ``d`` rounds, placed on a ``d``-dimensional grid with sides ``<= group_size`` (see
``grid_sides``), and grouped by all coordinates but one; the free coordinate cycles with
the shared ``phase`` (the lower median of the round counts declared, ``phase_of``). After
``d`` rounds over a stable population every peer has (indirectly) averaged with every
other (exactly, when ``n`` fills the grid). Client-mode peers join the smallest groups
that have room; when none has, one full peer (one per round) leaves the group with the
most of them to start one for clients. Singletons are merged or balanced away wherever
group_size allows (see ``_merge_singletons``). Each group's leader is its first non-client
member in hash order.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.address import Address
from protocol.errors import ProtocolError, RemoteProtocolError, brief
from protocol.identity import PeerID

MAX_EPOCH = 1 << 62
MAX_WEIGHT = 1e300
"""The largest weight a peer may declare: a group (at most 256 members) then sums its
weights to a finite float64. Two members of weight 1e308 made every reducer's exact sum
(``math.fsum``) overflow, and every member's step raise ``OverflowError``."""
MAX_LAYOUT = 64  # characters of a layout fingerprint on the wire (a short hash)
MAX_DETAIL = 200  # characters of a declaration's detail (words for error messages)
MAX_STEP_TAG = 1 << 32  # a declaration's step tag is below this (5 bytes in msgpack)
MAX_SAW = 1024  # step tags a "done" marker lists (within the DHT's 16 KiB per value)
LAYOUT_VERSION = "v9"
"""The averaging wire's version, part of every layout fingerprint (``Averager.layout_id``)
and named at the end of a declaration's detail: peers of other versions group apart."""
_VERSION_WORDS = re.compile(r", layout (v\d+)$")
DECLARATION_KEYS = frozenset(
    {"address", "weight", "epoch", "bandwidth", "client_mode", "layout", "count", "total"}
    | {"group_size", "detail", "step"}
)


def _number(value: object) -> float:
    """A declared int or float (msgpack's number types; text and bools are malformed)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{type(value).__name__} is not a number")
    return float(value)


@dataclass(frozen=True, slots=True)
class Declaration:
    """What a peer ready to average publishes for a round (value of its owner subkey)."""

    peer_id: PeerID
    address: str | None  # "PEERID@HOST:PORT", None for client mode
    weight: float
    epoch: int
    bandwidth: float
    layout: str  # fingerprint of what must match: shapes, dtypes, codec, group size
    count: int  # rounds this averager has been through: the grid phase
    total: int = 0  # elements in the flat vector (for error messages)
    group_size: int = 0  # the averager's group_size (for error messages; 0: not said)
    detail: str = ""  # dtypes, codec, staleness rule in words (for error messages)
    step: int = 0  # a random tag of this step's declarations (see closed_marker); 0: none

    @property
    def client_mode(self) -> bool:
        return self.address is None

    def reads_like(self, other: Declaration) -> bool:
        """Whether ``other`` declares the same settings in words (its version aside): with
        another fingerprint, it runs another version of swarm when its ``version`` is not
        ours, else its layout differs in what the words leave out."""
        return bool(other.detail) and (
            other.total,
            other.group_size,
            _VERSION_WORDS.sub("", other.detail),
        ) == (self.total, self.group_size, _VERSION_WORDS.sub("", self.detail))

    @property
    def version(self) -> str | None:
        """The layout version its detail ends with; None for details that name none
        (versions before v5, or a detail left out)."""
        found = _VERSION_WORDS.search(self.detail)
        return found.group(1) if found else None

    def describe_layout(self) -> str:
        """What the layout fingerprint covers, as far as the declaration says it."""
        size = f", group_size {self.group_size}" if self.group_size else ""
        detail = f", {self.detail}" if self.detail else ""
        return f"{self.total} elements{size}{detail} ({self.layout})"

    def to_wire(self, *, tagged: bool = True) -> dict[str, Any]:
        """The declaration as stored in the DHT; ``tagged`` False leaves out the step tag,
        which only the DHT's readers use (peers of versions before it refuse a join or a
        confirmation whose declarations carry keys they do not know)."""
        wire = {
            "address": self.address,
            "weight": self.weight,
            "epoch": self.epoch,
            "bandwidth": self.bandwidth,
            "client_mode": self.client_mode,
            "layout": self.layout,
            "count": self.count,
            "total": self.total,
            "group_size": self.group_size,
            "detail": self.detail,
            "step": self.step,
        }
        if not tagged:
            del wire["step"]
        return wire

    @classmethod
    def from_wire(cls, peer_id: PeerID, value: Any) -> Declaration:
        """Validate a declaration read from the DHT or an RPC body.

        Raises:
            RemoteProtocolError: on any missing, mistyped or out-of-range field.
        """
        if not isinstance(value, Mapping):
            raise RemoteProtocolError("a declaration is a map")
        try:
            address = value["address"]
            weight = _number(value["weight"])
            epoch = value["epoch"]
            bandwidth = _number(value["bandwidth"])
            layout = value["layout"]
            count = value["count"]
            total = value.get("total", 0)
            group_size = value.get("group_size", 0)
            detail = value.get("detail", "")
            step = value.get("step", 0)
            if type(step) is not int or not 0 <= step < MAX_STEP_TAG:
                step = 0  # no tag: older peers ignore the key, so the rest still counts
            client_mode = value.get("client_mode", address is None)
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"malformed declaration: {exc!r}") from None
        if type(client_mode) is not bool:
            raise RemoteProtocolError("declared client_mode is not a bool")
        if address is not None and not isinstance(address, str):
            raise RemoteProtocolError("a declared address is a str or nil")
        if client_mode:
            address = None
        elif address is None:
            raise RemoteProtocolError("a declaration without client mode needs an address")
        else:
            try:
                named = Address.parse(address).peer_id
            except ProtocolError as exc:
                raise RemoteProtocolError(f"bad address in declaration: {exc}") from None
            if named is not None and named != peer_id:  # others would dial that peer for us
                raise RemoteProtocolError("a declaration's address names another peer")
            if named is None:
                # dialed without a PeerID, whoever answers there would pass for the member:
                # a lying leader that listed an honest member under a host of its own made
                # every member take that host's garbage for the member's, and bench it
                # (a review); the PeerID makes the handshake prove who answers
                raise RemoteProtocolError("a declaration's address must name its PeerID")
        if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
            raise RemoteProtocolError(f"declared weight {weight} is not in (0, {MAX_WEIGHT:g}]")
        if not (math.isfinite(bandwidth) and bandwidth > 0):
            raise RemoteProtocolError(f"declared bandwidth {bandwidth} is not positive")
        integers = (
            ("epoch", epoch),
            ("count", count),
            ("total", total),
            ("group_size", group_size),
        )
        for name, number in integers:
            if type(number) is not int or not 0 <= number < MAX_EPOCH:
                raise RemoteProtocolError(f"declared {name} {brief(number)} is out of range")
        if not _is_layout(layout):
            raise RemoteProtocolError("declared layout is not a short string")
        if type(detail) is not str or len(detail) > MAX_DETAIL:
            raise RemoteProtocolError("declared detail is not a short string")
        return cls(
            peer_id, address, weight, epoch, bandwidth, layout, count, total, group_size, detail,
            step,
        )  # fmt: skip


def parse_declarations(entries: Mapping[Any, Any]) -> list[Declaration]:
    """The valid declarations among DHT ``{subkey: value}`` entries (others are skipped)."""
    out: list[Declaration] = []
    for subkey, value in entries.items():
        if not isinstance(subkey, str):
            continue
        try:
            out.append(Declaration.from_wire(PeerID.from_base58(subkey), value))
        except ProtocolError:
            continue
    return out


def done_marker(layout: str) -> dict[str, Any]:
    """What a peer leaves in a round in place of its declaration once its round is decided
    (``Matchmaker.withdraw``). It names the peer's layout: a peer that declares after the
    others' groups closed reads only such markers, and must still learn of a mismatch."""
    return {"done": True, "layout": layout}


def closed_marker(layout: str, declaration: Declaration, saw: Iterable[int]) -> dict[str, Any]:
    """A "done" marker that keeps its peer's declaration (``closed``) and the step tags of
    the others' declarations in the read that decided the peer's step (``saw``): a peer
    whose declaration that read had, and whose own read comes after the marker, still
    counts the withdrawn peer as declared (protocol.md 9.2). (A peer left alone writes its
    marker a few ms after its read, and peers that close early before the slot's end:
    without their declarations, a slower reader computed another phase and other groups.)
    A later step of that peer in the same slot declares another tag, which no marker of
    the earlier step names."""
    tags = sorted({t for t in saw if 0 < t < MAX_STEP_TAG})[:MAX_SAW]
    # what grouping and a mismatch's error read, not the words for error messages (up to
    # 200 characters) nor the tag: the marker is written beside the butterfly, over the
    # same links
    kept = declaration.to_wire(tagged=False)
    del kept["detail"]
    return {**done_marker(layout), "closed": kept, "saw": tags}


def parse_closed(entries: Mapping[Any, Any], exclude: str, step: int) -> list[Declaration]:
    """The declarations kept by "done" markers (``closed_marker``) that saw step tag
    ``step`` (ours), but ``exclude``'s (ours); a marker whose kept declaration or tag list
    is malformed keeps none, and so does every marker for a peer without a tag (0)."""
    out: list[Declaration] = []
    if not 0 < step < MAX_STEP_TAG:
        return out
    for subkey, value in entries.items():
        if subkey == exclude or not isinstance(subkey, str) or not isinstance(value, Mapping):
            continue
        if not saw_tag(value, step) or "closed" not in value:
            continue
        try:
            out.append(Declaration.from_wire(PeerID.from_base58(subkey), value["closed"]))
        except ProtocolError:
            continue
    return out


def saw_tag(value: object, step: int) -> bool:
    """Whether ``value`` is a "done" marker whose read saw step tag ``step`` (``saw``)."""
    return (
        isinstance(value, Mapping)
        and value.get("done") is True
        and 0 < step < MAX_STEP_TAG
        and _lists_tag(value.get("saw"), step)
    )


def _lists_tag(saw: object, step: int) -> bool:
    """Whether ``saw`` is a well-formed tag list (at most MAX_SAW ints in (0, 2**32), bools
    not counted as ints) holding ``step``."""
    if not isinstance(saw, list) or len(saw) > MAX_SAW:
        return False
    if not all(type(t) is int and 0 < t < MAX_STEP_TAG for t in saw):
        return False
    return step in saw


def parse_done(entries: Mapping[Any, Any], exclude: str) -> Counter[str | None]:
    """The "done" markers among DHT ``{subkey: value}`` entries, but ``exclude``'s (ours),
    counted by layout; None counts the markers of unknown layout (an older peer's, without
    one, or one that is not a short string)."""
    layouts: Counter[str | None] = Counter()
    for subkey, value in entries.items():
        if subkey != exclude and isinstance(value, Mapping) and value.get("done") is True:
            layout = value.get("layout")
            layouts[layout if _is_layout(layout) else None] += 1
    return layouts


def peers_of_layout(entries: Mapping[Any, Any], layout: str, exclude: str) -> list[PeerID]:
    """The peers, but ``exclude`` (us), whose valid declaration or "done" marker among DHT
    ``{subkey: value}`` entries names ``layout``: who stepped in that round with our
    settings (a subkey is owner-bound, so each entry is its peer's own word)."""
    out = [d.peer_id for d in parse_declarations(entries) if d.layout == layout]
    for subkey, value in entries.items():
        if not isinstance(subkey, str) or not isinstance(value, Mapping):
            continue
        if value.get("done") is True and value.get("layout") == layout:
            try:
                out.append(PeerID.from_base58(subkey))
            except ProtocolError:
                continue
    return [peer for peer in out if str(peer) != exclude]


def _is_layout(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_LAYOUT


def round_closing_after(now: float, window: float) -> int:
    """The first round that closes strictly after ``now``."""
    return math.floor(now / window) + 1


def round_key(prefix: str, round_no: int) -> str:
    return f"{prefix}/round/{round_no}"


def rank_key(seed: bytes, peer_id: PeerID) -> bytes:
    return hashlib.sha256(seed + peer_id.raw).digest()


def grid_sides(n: int, group_size: int) -> tuple[int, ...]:
    """The grid for ``n`` peers, in the fewest dimensions ``d`` with ``group_size**d >= n``:
    sides of at most ``group_size`` whose product is exactly ``n`` when some are (the most
    even such, largest first), else ``d`` equal sides ``m``, the smallest with
    ``m**d >= n``. A grid that ``n`` fills (8 peers at group size 4: 4 x 2) has no short
    line, so ``d`` rounds give the exact mean; 3 x 3 for those 8 left a short line every
    round, and the mean was only approached (the spread fell ~3x per round). Where no sides
    fit exactly, unequal ones mixed worse than equal ones in as many cases as they mixed
    better (a simulation of 3d rounds, n up to 70), so the equal ones stay."""
    group_size = max(group_size, 1)
    d = 1
    while group_size**d < n:
        d += 1
    m = max(1, math.ceil(n ** (1.0 / d)))
    while m**d < n:
        m += 1
    while m > 1 and (m - 1) ** d >= n:
        m -= 1
    best: tuple[int, int, tuple[int, ...]] | None = None

    def search(sides: tuple[int, ...], product: int) -> None:
        nonlocal best
        left = d - len(sides)
        if not left:
            key = (product, max(sides), sides)
            if product >= n and (best is None or key < best):
                best = key
            return
        # this side is at most the previous one (largest first); the rest can multiply by
        # at most side**(left - 1), so it must be at least n / product ** (1 / left)
        top = sides[-1] if sides else group_size
        low = max(1, math.ceil((n / product) ** (1.0 / left) - 1e-9))
        for side in range(min(top, group_size), low - 1, -1):
            if product * side * side ** (left - 1) < n:
                break
            search((*sides, side), product * side)

    search((), 1)
    assert best is not None
    return best[2] if best[0] == n else (m,) * d


def make_groups(
    declarations: Sequence[Declaration], group_size: int, prefix: str
) -> list[list[Declaration]]:
    """Deterministic grouping of one round's declarations (same input, same output).

    Peers are first split by layout fingerprint (only equal layouts average together); each
    group is sorted in hash order (leader first).
    """
    by_layout: dict[str, list[Declaration]] = {}
    for decl in sorted(declarations, key=lambda d: d.peer_id.raw):
        by_layout.setdefault(decl.layout, []).append(decl)
    groups: list[list[Declaration]] = []
    for layout in sorted(by_layout):
        groups.extend(_group_one_layout(by_layout[layout], group_size, prefix))
    return groups


def _group_one_layout(
    decls: list[Declaration], group_size: int, prefix: str
) -> list[list[Declaration]]:
    full = [d for d in decls if not d.client_mode]
    clients = [d for d in decls if d.client_mode]
    phase = phase_of(decls)
    sides = grid_sides(max(len(full), 1), group_size)
    d = len(sides)
    block_seed = hashlib.sha256(f"{prefix}|grid|{phase // d}".encode()).digest()
    round_seed = hashlib.sha256(f"{prefix}|round|{phase}".encode()).digest()
    ranked = sorted(full, key=lambda x: rank_key(block_seed, x.peer_id))
    free_axis = phase % d
    cells: dict[tuple[int, ...], list[Declaration]] = {}
    for rank, decl in enumerate(ranked):
        digits = []
        for side in sides:  # mixed radix: the first side varies fastest
            rank, digit = divmod(rank, side)
            digits.append(digit)
        digits[free_axis] = -1
        cells.setdefault(tuple(digits), []).append(decl)
    groups = [cells[key] for key in sorted(cells)]
    _merge_singletons(groups, group_size)
    _rotate_the_odd_one(groups, ranked[phase % len(ranked)] if ranked else None)
    clients.sort(key=lambda x: rank_key(round_seed, x.peer_id))
    leftovers: list[list[Declaration]] = []
    lent = False
    for client in clients:
        roomy = [g for g in groups if len(g) < group_size]
        if roomy:
            min(roomy, key=len).append(client)
        elif not lent and (lender := _most_full(groups)) is not None:
            # Every group is full: one full peer leaves the group with the most of them to
            # start a group for clients. Else full peers that fill their groups exactly (4
            # of them, group_size 4) would shut a client out round after round. Only one
            # per round: a client's declaration cannot be checked, and ghost clients (that
            # never join) would otherwise pull every full peer away from the others.
            taken = max(i for i, d in enumerate(lender) if not d.client_mode)
            groups.append([lender.pop(taken), client])
            lent = True
        else:
            leftovers.append([client])  # no room: alone (and without a leader) this round
    groups.extend(leftovers)
    return [sorted(g, key=lambda x: rank_key(round_seed, x.peer_id)) for g in groups]


def phase_of(declarations: Sequence[Declaration]) -> int:
    """The grid phase of a round: the lower median of the declared round counts (0 for
    none). Every other rule of the grouping is fixed, so whoever chose the phase would choose
    the grid and the order within each group, and with it who leads; a median leaves one
    declarer no choice while two or more others declare the same count (the largest count,
    the rule before, let a peer pick the phase under which it led every round and refused
    every join)."""
    counts = sorted(d.count for d in declarations)
    return counts[(len(counts) - 1) // 2] if counts else 0


def _most_full(groups: Sequence[list[Declaration]]) -> list[Declaration] | None:
    """The first group with the most full (non-client) members, if it has three or more:
    one of them can lead another group and two stay together. (Lent from a pair, the one
    left behind would be the only full peer of its group: with ghost clients, alone.)"""
    counts = [sum(not d.client_mode for d in g) for g in groups]
    if not counts or max(counts) < 3:
        return None
    return groups[counts.index(max(counts))]


def _merge_singletons(groups: list[list[Declaration]], group_size: int) -> None:
    """Leave nobody alone that can be grouped (a grid that ``n`` does not fill has short
    lines): a singleton joins the smallest group with room; if none has room, it takes the
    last member of the largest group of 3 or more (10 peers in groups of 3: 3, 3, 2, 2, not
    3, 3, 3, 1, where the free axis is a full side of the 3 x 3 x 3 grid). Groups never
    exceed ``group_size``: with pairs and an odd count, one peer stays out of the round
    (the grid puts another one out in the next)."""
    i = 0
    while i < len(groups):
        if len(groups[i]) == 1 and len(groups) > 1:
            others = [g for j, g in enumerate(groups) if j != i]
            roomy = [g for g in others if len(g) < group_size]
            largest = max(others, key=len)
            if roomy:
                min(roomy, key=len).extend(groups.pop(i))
                continue
            if len(largest) >= 3:
                groups[i].append(largest.pop())
        i += 1


def _rotate_the_odd_one(groups: list[list[Declaration]], out: Declaration | None) -> None:
    """A peer left alone by the grid (pairs and an odd count: nobody has room) is the one
    whose grid line is short, and it stayed out in d - 1 of every d rounds (9 peers in
    pairs: the same peer out 3 rounds in a row, a trial). ``out`` (the caller's pick, a
    different peer each round of a block) sits out instead: it trades places with the
    singleton."""
    alone = [g for g in groups if len(g) == 1]
    if len(alone) != 1 or len(groups) < 2 or out is None:
        return
    for group in groups:
        for j, decl in enumerate(group):
            if decl is out:
                group[j], alone[0][0] = alone[0][0], decl
                return


def leader_of(group: Sequence[Declaration]) -> Declaration | None:
    """The first non-client member (groups are already in hash order), or None."""
    return next((d for d in group if not d.client_mode), None)


def find_group(
    groups: Sequence[Sequence[Declaration]], peer_id: PeerID
) -> Sequence[Declaration] | None:
    return next((g for g in groups if any(d.peer_id == peer_id for d in g)), None)


def majority_layout(declarations: Sequence[Declaration]) -> str | None:
    """The most common layout fingerprint (ties: the smallest), or None when empty."""
    counts = Counter(d.layout for d in declarations)
    if not counts:
        return None
    return min(counts, key=lambda layout: (-counts[layout], layout))
