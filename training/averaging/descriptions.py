"""Words for reports and errors: the sentences a step's note is made of (why members were
dropped, when the cause was this peer's own timeout, their leaving, or an epoch too far
behind or ahead), and the layout settings in words for the error a peer of another layout
gets."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

import trio

from peer import Peer
from protocol.codecs import Codec
from protocol.identity import PeerID

from .config import AveragerConfig
from .grouping import LAYOUT_VERSION, MAX_DETAIL
from .plan import Liveness, Plan
from .reducer import DropReason

if TYPE_CHECKING:
    from .grouping import Declaration
    from .layout import TensorLayout
    from .reducing import ReducerService


def sentences(*notes: str) -> str:
    """The non-empty ``notes`` as one note, "; " between them."""
    return "; ".join(note for note in notes if note)


def cut_here(service: ReducerService | None) -> str:
    """The note of a step whose own part's cutoff (our step's timeout, less the result's
    share) dropped members still sending: every report lists them as ``timeout``, which
    read as their fault when our short timeout was the cause (an outside tester). Not
    members that withdrew (their own step ended), also ``timeout``: the note blamed our
    cutoff on survivors whose own timeout was 30 s (another tester)."""
    if service is None or not service.cut:
        return ""
    return (
        f"our part's cutoff (this step's timeout) came before {len(service.cut)} member(s)"
        " had sent it all: it dropped them as timeout"
    )


def deadline_note(parts: int, stalled: bool = False) -> str:
    """The note of a step whose timeout ended its all-reduce before ``parts`` parts came
    back: their reducers are reported as ``timeout`` (the note of each part says why), and
    the step's note said nothing, which read as the others' fault (an outside tester).
    ``stalled``: this process stood still during the all-reduce (said in the note), the
    likely cause: more time would not have helped a process suspended past its timeout,
    as the advice said (another tester)."""
    if not parts:
        return ""
    said = f"this step's timeout came before {parts} part(s) were done: their reducers are "
    if stalled:
        return said + "reported as timeout (this process standing still is the likely cause)"
    return said + (
        "reported as timeout (allow the step more time if they were slow; a reducer that "
        "stays alive and serves no result holds every step to its timeout)"
    )


def left_note(dropped: Mapping[PeerID, DropReason], liveness: Liveness) -> str:
    """Members dropped as ``dead`` or ``timeout`` that said their step had ended (they
    answered a ping out of the round, or withdrew: cancelled, timed out, or their averager
    closed): alive, although an outside tester took such a report for a death."""
    left = sorted(
        f"{p.short()} (dropped as {r})"
        for p, r in dropped.items()
        if r in (DropReason.DEAD, DropReason.TIMEOUT) and p in liveness.left
    )
    if not left:
        return ""
    whose = "its step" if len(left) == 1 else "their steps"
    return (
        f"{', '.join(left)}: {whose} left the round (cancelled, timed out, or averager "
        "closed); the peer is alive"
    )


def stale_note(plan: Plan, max_staleness: int) -> str:
    """Why staleness left contributions out, when it concerns this peer: its own epoch too
    far behind the group's newest, or every other member's too far behind its own (the
    whole group then took on this peer's values, and its report alone said nothing: an
    outside tester asked for a word of warning)."""
    me = plan.member(plan.me)
    if me is None or len(plan.members) < 2:
        return ""
    where = "docs/averaging.md, Weights and staleness"
    if plan.weights.get(plan.me, 0.0) is None:
        return (
            f"our epoch {me.epoch} is more than max_staleness ({max_staleness}) behind the "
            f"group's newest ({plan.max_epoch}): our values were left out as stale (a stale "
            f"member receives the others' mean); continue from info.epoch ({where})"
        )
    others = [m for m in plan.members if m.peer_id != plan.me]
    if all(plan.weights.get(m.peer_id, 0.0) is None for m in others):
        newest_other = max(m.epoch for m in others)
        return (
            f"every other member's epoch (at most {newest_other}) is more than max_staleness "
            f"({max_staleness}) behind ours ({me.epoch}): they were left out as stale (they "
            f"receive our values); is our epoch a local count rather than the swarm's? ({where})"
        )
    return ""


def describe_settings(layout: TensorLayout, codec: Codec, config: AveragerConfig) -> str:
    """What the layout fingerprint covers, in words, for the error a peer of another
    layout gets (the fingerprint alone does not say which setting differs); at most
    ``MAX_DETAIL`` characters, always ending with the layout version (``reads_like``)."""
    dtypes = Counter(layout.dtypes)
    kinds = ", ".join(f"{n} {dtype}" for dtype, n in sorted(dtypes.items()))
    args = ", ".join(f"{k}={v}" for k, v in codec.params.items() if k != "max_elements")
    codec_text = f"{codec.name}({args})" if args else codec.name
    rest = (
        f"codec {codec_text}, chunk_bytes {config.chunk_bytes}, max_staleness "
        f"{config.max_staleness}, staleness_decay {config.staleness_decay}"
    )
    version = f", layout {LAYOUT_VERSION}"
    # With several dtypes their order is part of the layout too: [float32, float16] and
    # [float16, float32] counted alike, and a tester was told "another version of swarm".
    order = " ".join(layout.dtypes) if len(dtypes) > 1 else ""
    shapes = " ".join("x".join(map(str, shape)) or "()" for shape in layout.shapes)

    def words(order: str, shapes: str) -> str:
        in_order = f"; dtypes {order}" if order else ""
        tensors = f"{len(layout.shapes)} tensor{'s' * (len(layout.shapes) != 1)}"
        return f"{tensors} ({kinds}{in_order}; shapes {shapes}), {rest}"

    # The dtypes in order and the shapes themselves when they fit the declaration's detail
    # (a transposed weight then reads as such), else a hash of the shapes, then of the
    # dtypes' order too, else the words cut short before the version.
    text = words(order, shapes)
    if len(text) + len(version) > MAX_DETAIL:
        shapes = f"hash {digest(layout.shapes)}"
        text = words(order, shapes)
    if len(text) + len(version) > MAX_DETAIL and order:
        text = words(f"hash {digest(layout.dtypes)}", shapes)
    return text[: MAX_DETAIL - len(version)] + version


TWIN_NOTED_FOR = 600.0
"""Seconds after the last sign of another process with our key that reports still say so."""


def twin_note(node: Peer) -> str:
    """That another process uses this peer's identity, while one was seen lately (the
    host's warning is logged once; a trial's twin, told nothing else, read "nobody
    declared" step after step while three peers averaged)."""
    twin = node.rpc.twin
    if twin is None or trio.current_time() - twin[1] > TWIN_NOTED_FOR:
        return ""
    return (
        f"another process uses this peer's identity (seen at {twin[0]}: a copied key "
        "file?): peers cannot tell the two apart, and their rounds suffer; give each peer "
        "its own identity"
    )


def setting_differences(ours: Declaration, theirs: Declaration) -> str:
    """The settings in which ``theirs`` differs from ``ours``, as far as their words say:
    "group_size 8 (ours: group_size 4)", joined by ", "; empty when the words agree (the
    difference is in what they leave out, or another version of swarm). A mismatch error
    quoted both whole descriptions, ~250 characters each, and left the user to find the
    one setting that differed (an outside tester)."""
    mine, other = _settings(ours), _settings(theirs)
    changed = []
    for key, text in other.items():
        if key not in mine or mine[key] == text:
            continue  # (a setting only one side names: words cut short, or an old peer)
        changed += _what_differs(mine[key], text)
    return ", ".join(changed)


def _what_differs(ours: str, theirs: str) -> list[str]:
    """One setting's difference; for the tensors' words, only the items in parentheses
    that differ ("dtypes bfloat16 float16 (ours: dtypes float16 bfloat16)")."""
    head, _, inner = theirs.partition(" (")
    our_head, _, our_inner = ours.partition(" (")
    if head != our_head or not inner.endswith(")") or not our_inner.endswith(")"):
        return [f"{theirs} (ours: {ours})"]
    our_items, their_items = our_inner[:-1].split("; "), inner[:-1].split("; ")
    if len(our_items) != len(their_items):
        return [f"{theirs} (ours: {ours})"]
    return [f"{t} (ours: {o})" for o, t in zip(our_items, their_items, strict=True) if o != t]


def _settings(declaration: Declaration) -> dict[str, str]:
    """A declaration's described settings by name: "group_size" -> "group_size 4",
    "tensors" -> "2 tensors (...)" (a number first: named by the word after it)."""
    parts = [f"{declaration.total} elements"]
    if declaration.group_size:
        parts.append(f"group_size {declaration.group_size}")
    parts += _top_level_parts(declaration.detail)
    settings = {}
    for part in parts:
        words = part.split()
        if not words:
            continue
        # "1 tensor" and "2 tensors" name one setting
        number_first = words[0][0].isdigit() and len(words) > 1
        settings[words[1].rstrip("s") if number_first else words[0]] = part
    return settings


def _top_level_parts(text: str) -> list[str]:
    """``text`` split at the ", " outside parentheses (the tensors' words hold some)."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "([":
            depth += 1
        elif char in ")]":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0 and text.startswith(", ", index):
            parts.append(text[start:index])
            start = index + 2
    parts.append(text[start:])
    return [part for part in parts if part]


def digest(value: object) -> str:
    """A short hash of ``value``'s repr, for the words of a layout too long to spell out."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:8]
