"""One round of matchmaking as this peer sees it (``RoundState``), what the round ended
with (``MatchResult``), and the error for peers of another layout: shared by the
matchmaker (matchmaking.py) and the confirmation of its groups (confirmation.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import trio

from protocol.errors import ProtocolError
from protocol.identity import PeerID

from .grouping import Declaration
from .messages import GroupConfirmation


class LayoutMismatchError(ProtocolError):
    """Peers under the same prefix average tensors of another layout or codec."""


@dataclass
class RoundState:
    """This peer's view of one round while it is in it."""

    number: int
    me: Declaration
    closed: trio.Event = field(default_factory=trio.Event)
    wake: trio.Event = field(default_factory=trio.Event)  # a joiner asks us to close now
    leader: PeerID | None = None
    leader_address: str | None = None
    is_leader: bool = False
    order: dict[PeerID, int] = field(default_factory=dict)  # position in the computed group
    expected: set[PeerID] = field(default_factory=set)
    left: set[PeerID] = field(default_factory=set)  # expected, then pinged: out of the round
    elsewhere: set[PeerID] = field(default_factory=set)  # in another group of our view
    joined: dict[PeerID, Declaration] = field(default_factory=dict)
    waiting: Counter[PeerID] = field(default_factory=Counter)  # join calls still waiting
    changed: trio.Event = field(default_factory=trio.Event)
    confirmation: GroupConfirmation | None = None
    answered: trio.Event = field(default_factory=trio.Event)
    answered_at: float = 0.0  # trio time a leader answered its group (see Confirmation)
    budget: float = 0.0
    others_seen: int = 0  # the most other declarations a read of the round found
    # the "done" markers of others (see withdraw) by layout, from the read that found most
    others_done: Counter[str | None] = field(default_factory=Counter)
    store_s: float = 0.0  # how long storing our declaration took
    unheard: bool = False  # our last read of the round asked other nodes and none answered
    # peers of our last rounds that this round's pings found gone (Matchmaker._ping_missing)
    departed: set[PeerID] = field(default_factory=set)
    # -- a member's walk down the ranked members (see Confirmation._join) --
    give_up: float = 0.0  # when a member stops waiting for any leader of this round
    gone: set[PeerID] = field(default_factory=set)  # failed at once: skipped this round
    alive: set[PeerID] = field(default_factory=set)  # answered our ping (see on_join)
    attempt: tuple[PeerID, trio.CancelScope] | None = None  # our join call in flight
    settled: bool = False  # our walk ended (confirmed, led, or gave up)

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


@dataclass(frozen=True, slots=True)
class MatchResult:
    """A confirmed group, or why there is none (``confirmation`` None)."""

    round: int
    confirmation: GroupConfirmation | None
    leader: PeerID | None
    declared: int  # declarations seen in the round
    note: str = ""
    alone: bool = False
    retry: bool = False  # the leader was no longer in the round: worth another round
    strangers: int = 0  # peers of another layout in the round (when alone)
    late: str = ""  # when alone: others of the round had their groups before we read it
    # when alone: peers of our layout were in the round, and the grouping left us out (all
    # client-mode like us, no room for a client, or the odd one of pairs)
    left_out: bool = False
