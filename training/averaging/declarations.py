"""What a peer ready to average publishes for a round, on the wire: its declaration (the
value of its owner subkey under ``{prefix}/round/{r}``, see grouping.py), the bounds of each
declared field, and the "done" markers a peer leaves in its place once its round is decided;
each read from the DHT checks what it gets (a hostile peer can write anything there)."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
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


def decided_set(
    declared: list[Declaration], entries: Mapping[Any, Any], me: Declaration
) -> list[Declaration]:
    """``declared`` without the declarations of our layout that came after the round was
    decided with ours: when "done" markers of our layout saw our step tag, the peers that
    wrote them grouped the declarations their reads saw (``saw``), and one none of them
    saw (a newcomer a moment after their close) would make our groups differ from theirs.
    Only markers of our layout count (peers of another group apart, and their reads say
    nothing of when ours decided: a re-check saw 4 peers split 2 + 2 by them), and only
    tagged declarations of our layout are left out (an untagged one, from a peer before
    step tags, no list can name). Unchanged when no marker saw us, or a marker's list was
    cut at ``MAX_SAW`` (it cannot tell)."""
    lists = [
        value["saw"]
        for value in entries.values()
        if saw_tag(value, me.step) and value.get("layout") == me.layout
    ]
    if not lists or any(len(tags) >= MAX_SAW for tags in lists):
        return declared
    seen = set().union(*lists)
    return [
        d
        for d in declared
        if d.peer_id == me.peer_id or d.layout != me.layout or not d.step or d.step in seen
    ]


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
