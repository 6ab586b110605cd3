"""What a step reports: per part, who was averaged and who was dropped and why.

The report is exact and local: ``PartReport.status`` says what *this* peer's values in the
part now are. ``"all"``: the mean over every group member; ``"some"``: the mean over
``contributors`` only (the others are in ``dropped``); ``"none"``: this peer kept its own
local values (``note`` says why). ``averaged_fraction`` is the share of the vector whose
status is ``"all"``; a partial result is never reported as full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from protocol.identity import PeerID

from .layout import Span
from .reducer import DropReason


class PartStatus(StrEnum):
    ALL = "all"
    SOME = "some"
    NONE = "none"


class Outcome(StrEnum):
    """How the step went, in one word."""

    AVERAGED = "averaged"  # the whole vector is the mean over the whole group
    PARTIAL = "partial"  # some parts averaged over fewer members, or kept local
    FAILED = "failed"  # a group formed but this peer kept every local value
    ALONE = "alone"  # no group for us (nobody else of our layout came, or the grouping left
    # us out: the note says which): untouched
    UNCONFIRMED = "unconfirmed"  # no leader confirmed us in time (or we were left out)


@dataclass(frozen=True, slots=True)
class PartReport:
    """One part of the vector after the round, from this peer's point of view."""

    index: int
    reducer: PeerID
    span: Span  # [start, stop) in the flat vector
    status: PartStatus
    contributors: tuple[PeerID, ...]  # whose values the reducer averaged (empty: no result)
    dropped: Mapping[PeerID, DropReason]  # group members left out of this part, and why
    received: bool  # this peer's values in the span are the reducer's result
    weight: float = 0.0  # total (staleness-decayed) weight of the contributors
    note: str = ""  # why the result was not received, when it was not
    counted: bool = False
    """The reducer's result header listed this peer among the contributors: its values
    went into the part's mean, whether or not that result reached this peer (with
    ``topk``, what it sent for the part is then no longer owed: docs/averaging.md)."""

    @property
    def size(self) -> int:
        return self.span[1] - self.span[0]


@dataclass(frozen=True, slots=True)
class AveragingInfo:
    """The result of :meth:`~training.averaging.Averager.step`."""

    outcome: Outcome
    round: int  # rendezvous round number (see grouping)
    group: tuple[PeerID, ...]  # who took part, this peer included (just us when alone)
    leader: PeerID | None
    parts: tuple[PartReport, ...]
    total: int  # elements in the flat vector
    epoch: int = 0  # largest epoch declared in the group
    matchmaking_s: float = 0.0  # seconds from the call to the confirmed group
    allreduce_s: float = 0.0  # seconds of butterfly (0 when no group formed)
    note: str = ""
    dropped: Mapping[PeerID, DropReason] = field(default_factory=dict)  # union over parts
    me: PeerID | None = None  # this peer (marked "(us)" where the line names it)
    # made of the group's tag (its first 8 bytes; None without a group): consecutive steps
    # of a slot share a round number, and this tells which steps of peers were one exchange
    group_id: int | None = None

    @property
    def averaged_fraction(self) -> float:
        """Share of the vector now averaged over the whole group (0.0 without a group)."""
        return _fraction(self.parts, self.total, (PartStatus.ALL,))

    @property
    def received_fraction(self) -> float:
        """Share of the vector replaced by a group result (over all or some members)."""
        return _fraction(self.parts, self.total, (PartStatus.ALL, PartStatus.SOME))

    @property
    def stale(self) -> tuple[PeerID, ...]:
        return tuple(p for p, r in self.dropped.items() if r is DropReason.STALE)

    @property
    def averaged(self) -> bool:
        return self.outcome is Outcome.AVERAGED

    def __str__(self) -> str:
        """One line: ``partial 75% over 4 peers in round 12 (parts: all all all none)``;
        without a group, ``alone in round 12; no partner``."""
        if len(self.group) <= 1 and not self.parts:
            text = f"{self.outcome} in round {self.round}"
        else:
            text = f"{self.outcome} {self.averaged_fraction:.0%} over {len(self.group)} peers"
            if self.received_fraction > self.averaged_fraction:  # parts averaged over fewer
                text += f", {self.received_fraction:.0%} over some of them"
            text += f" in round {self.round}"
        if self.parts:
            text += f" (parts: {' '.join(str(p.status) for p in self.parts)})"
        if self.dropped:
            text += " dropped: " + ", ".join(
                f"{p.short()}{' (us)' if p == self.me else ''} {r}" for p, r in self.dropped.items()
            )
        return text + (f"; {self.note}" if self.note else "")


def _fraction(parts: Sequence[PartReport], total: int, statuses: tuple[PartStatus, ...]) -> float:
    if not parts:
        return 0.0
    if total == 0:
        return 1.0 if all(p.status in statuses for p in parts) else 0.0
    return sum(p.size for p in parts if p.status in statuses) / total


def part_status(
    group: Sequence[PeerID], contributors: Sequence[PeerID], received: bool
) -> PartStatus:
    if not received or not contributors:
        return PartStatus.NONE
    if set(contributors) >= set(group):
        return PartStatus.ALL
    return PartStatus.SOME


def outcome_of(parts: Sequence[PartReport], total: int) -> Outcome:
    if _fraction(parts, total, (PartStatus.ALL,)) >= 1.0:
        return Outcome.AVERAGED
    if _fraction(parts, total, (PartStatus.ALL, PartStatus.SOME)) > 0.0:
        return Outcome.PARTIAL
    return Outcome.FAILED


def merge_dropped(parts: Sequence[PartReport]) -> dict[PeerID, DropReason]:
    """Every member dropped somewhere, with the first reason seen (parts in order)."""
    out: dict[PeerID, DropReason] = {}
    for part in parts:
        for peer_id, reason in part.dropped.items():
            out.setdefault(peer_id, reason)
    return out
