"""A part's senders as its reducer sees them: the members, why one's contribution is
missing (``DropReason``), a refused chunk, each sender's state during the reduction, and
what a finalized part was averaged over. The reduction itself is reducer.py's."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from protocol.identity import PeerID


class DropReason(StrEnum):
    """Why a member's contribution is missing from a part."""

    DEAD = "dead"  # its host refused connections or the connection broke
    FROZEN = "frozen"  # it stopped delivering and did not answer a ping
    TIMEOUT = "timeout"  # still delivering at the cutoff; a reducer: no result by the deadline
    GARBAGE = "garbage"  # malformed chunk, wrong size, repeated chunk, lying header
    NONFINITE = "nonfinite"  # NaN or infinity in its values
    STALE = "stale"  # epoch more than max_staleness behind the group


@dataclass(frozen=True, slots=True)
class Member:
    """A group member as the reducer sees it (from the leader's confirmed list)."""

    peer_id: PeerID
    weight: float
    epoch: int


class _Sender:
    __slots__ = (
        "done", "epoch", "largest", "reason", "received", "retained", "retained_bytes", "share",
        "waiting", "weight",
    )  # fmt: skip

    def __init__(self, weight: float, epoch: int, n_chunks: int) -> None:
        self.weight = weight  # effective (staleness-decayed)
        self.share = 0.0  # see scans.convex_shares: a float32 factor in [0, 1]
        self.epoch = epoch
        self.received = bytearray(n_chunks)
        # (chunk, blob, raw, added): kept until complete; ``added`` once in the sum
        self.retained: list[tuple[int, bytes | memoryview, bool, bool]] = []
        self.retained_bytes = 0
        self.largest = 0.0  # largest share * |value| among its chunks so far
        self.waiting: set[int] = set()  # chunks whose calls wait for admission (reducing)
        self.done = False
        self.reason: DropReason | None = None


class ChunkRejected(Exception):
    """A chunk was refused; ``reason`` says why (the sender is dropped for the part)."""

    def __init__(self, reason: DropReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PartOutcome:
    """What a finalized part was averaged over."""

    contributors: tuple[PeerID, ...]
    dropped: tuple[tuple[PeerID, DropReason], ...]
    weight: float  # total effective weight of the contributors (0: no result)
    note: str = ""  # why there is no result although some sent everything (overflow)
