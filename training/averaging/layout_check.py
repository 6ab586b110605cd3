"""Peers of another layout under our prefix: when they are the odd ones out, and when we
are (``LayoutCheck``, a base class of :class:`~.matchmaking.Matchmaker`), and what tells
the two kinds apart in words (their settings, or another version of swarm)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection

from .descriptions import setting_differences
from .grouping import LAYOUT_VERSION, Declaration
from .round_state import LayoutMismatchError

logger = logging.getLogger("training.averaging.matchmaking")  # (the log names stay as they were)

MAX_FOREIGN_LAYOUTS = 16
"""Other layouts an averager remembers (and warns about, once each): a peer declaring a new
one every round costs neither memory nor a warning per round."""


OUTNUMBERED_ROUNDS = 3
"""Rounds in a row where only peers of other layouts came (declared, or left their "done"
markers), two or more of one layout, after which a peer that has met its own layout before
gets ``LayoutMismatchError`` too: it is the one left behind (the swarm changed its model),
not a correct peer beside a misconfigured newcomer."""

_OTHER_VERSION = (
    "the settings read the same on both sides: peers of another version of swarm (ours"
    f" averages with layout {LAYOUT_VERSION}); update the older side"
)
_UNSAID = (
    f"the settings read the same on both sides, both of layout {LAYOUT_VERSION}: the tensors"
    " differ in what these words leave out (the order of their dtypes or shapes, or a codec"
    " parameter); list the same tensors in the same order on every peer"
)


def _same_words_note(me: Declaration, others: Collection[Declaration]) -> str:
    """Why peers whose settings read as ours (``reads_like``) have another layout: another
    version of swarm only when their declared version is not ours (a tester's peers, all
    of v9, listed a float32 and a float16 tensor in opposite orders and were told to update
    "the older side"); else something the words leave out. Empty if none reads as ours."""
    alike = [d for d in others if d.layout != me.layout and me.reads_like(d)]
    notes = [_OTHER_VERSION] * any(d.version != me.version for d in alike)
    notes += [_UNSAID] * any(d.version == me.version for d in alike)
    return "; ".join(notes)


def _differences(me: Declaration, others: Collection[Declaration]) -> str:
    """The settings in which each other layout among ``others`` differs from ours, one
    layout after another ("; " between them)."""
    strangers = {d.layout: d for d in others if d.layout != me.layout}
    found = {setting_differences(me, d) for d in strangers.values()}
    return "; ".join(sorted(text for text in found if text))


class LayoutCheck:
    """The layout check of :class:`~.matchmaking.Matchmaker`, one of its base classes (the
    attributes below are the matchmaker's)."""

    prefix: str
    _own_layout_seen: bool
    _outnumbered: int
    _foreign: set[str]

    def _check_layouts(
        self, me: Declaration, others: list[Declaration], done: Counter[str | None]
    ) -> None:
        """Peers of another layout (shapes, dtypes, codec, group size, staleness rule) group
        apart. A peer that has met its own layout before (under this averager) is not the
        odd one out at once: a round where only peers of other layouts came is theirs to fail
        (it is alone there), so that one misconfigured peer cannot raise in correct ones. But
        when, for ``OUTNUMBERED_ROUNDS`` rounds in a row, only strangers came and some of them
        had company, they are the swarm (its owner changed the layout, and we were left
        behind): we are told, not ``alone`` forever.

        ``done`` counts the others' "done" markers by layout: peers whose round was decided
        before we read it (a swarm that closed early). They count like declared peers of
        their layout, so a newcomer that comes after the groups closed is told too; markers
        of unknown layout (older peers) count for nothing.

        Raises: LayoutMismatchError: every other peer (declared or done) has another
            layout, and no peer of ours ever came beside us (declared or done), or none did
            for ``OUTNUMBERED_ROUNDS`` rounds in which strangers had company."""
        foreign = sorted({d.describe_layout() for d in others if d.layout != me.layout})
        same_words = _same_words_note(me, others)
        kinds = Counter(d.layout for d in others if d.layout != me.layout)
        # Done strangers count toward OUTNUMBERED_ROUNDS too: two markers of one layout are
        # a group of it that averaged in our round, as much evidence as two declarations;
        # else a peer left behind by a swarm that closes early (before it declares) would
        # read only their markers and sit out every round, never told.
        done_kinds = Counter(
            {layout: n for layout, n in done.items() if layout not in (None, me.layout)}
        )
        kinds.update(done_kinds)
        ours = bool(done[me.layout]) or any(d.layout == me.layout for d in others)
        if ours:
            self._own_layout_seen = True
            self._outnumbered = 0
        elif max(kinds.values(), default=0) >= 2:
            self._outnumbered += 1
        if kinds and not ours:
            sides = [f"ours: {me.describe_layout()}"] + [f"theirs: {foreign}"] * bool(foreign)
            if differs := _differences(me, others):
                sides.insert(0, f"theirs differ in: {differs}")
            if same_words:
                sides.append(same_words)
            if done_kinds:  # all a marker tells of its peer is the layout fingerprint
                sides.append(
                    f"{done_kinds.total()} peer(s) that had finished matchmaking before we read "
                    f"the round: layout {sorted(done_kinds)}"
                )
            if not self._own_layout_seen:
                raise LayoutMismatchError(
                    f"every other peer under {self.prefix!r} has another tensor layout, codec, "
                    f"group_size or staleness rule ({'; '.join(sides)})"
                )
            if self._outnumbered >= OUTNUMBERED_ROUNDS:
                raise LayoutMismatchError(
                    f"for {self._outnumbered} rounds only peers of another tensor layout, "
                    f"codec, group_size or staleness rule averaged under {self.prefix!r} "
                    f"({'; '.join(sides)}), none of ours"
                )
        # Once per foreign layout fingerprint, not per description: a peer's "done" marker
        # keeps its declaration without the detail, which described the same layout in
        # other words, and it was warned about twice, the second time without what differs
        # (an outside tester). The fullest description of each is the one shown.
        described: dict[str, str] = {}
        for d in others:
            text = d.describe_layout()
            if d.layout != me.layout and len(text) > len(described.get(d.layout, "")):
                described[d.layout] = text
        room = MAX_FOREIGN_LAYOUTS - len(self._foreign)
        new = sorted(set(described) - self._foreign)[:room]
        if new:  # a split swarm averages less: say so, once
            self._foreign.update(new)
            # the new layouts only, each with its own declarers: a warning that listed every
            # foreign layout of the read named only the new one's peers, as if they had
            # declared them all, and grew with the strangers (300: 40,785 characters)
            foreign = [described[layout] for layout in new]
            strays = [d for d in others if d.layout in new]
            differs = _differences(me, strays)
            # who: an operator could not tell which volunteer was misconfigured (a tester)
            strangers = sorted({_who(d) for d in strays})
            shown = ", ".join(strangers[:8]) + (", ..." if len(strangers) > 8 else "")
            logger.warning(
                "peers under %r declared another tensor layout, codec, group_size or "
                "staleness rule: they cannot average with us, only among themselves, if "
                "several (%sours: %s; theirs: %s, declared by %s%s)",
                self.prefix, f"theirs differ in: {differs}; " if differs else "",
                me.describe_layout(), foreign, shown, f"; {same_words}" if same_words else "",
            )  # fmt: skip


def _who(declaration: Declaration) -> str:
    """A declarer as a person can find it: its short PeerID and where it listens."""
    where = declaration.address.rpartition("@")[2] if declaration.address else "client mode"
    return f"{declaration.peer_id.short()} at {where}"
