"""Matchmaking over the DHT: declare for a round, gather, group, and confirm with the leader.

    decl -> choose round r (see grouping) -> store {prefix}/round/{r}[my id] = decl
         -> poll until r closes (or early: everybody seen last round is back)
            (gathering.py, a base class of the Matchmaker)
         -> make_groups(declared) -> my group and its leader
         -> confirmation (confirmation.py, a base class of the Matchmaker): the leader
            answers its members' joins with the final member list; a member joins the
            leader, or the next-ranked member when the leader is a ghost

Everything is bounded by the step's deadline. Peers of another layout are checked for in
layout_check.py (a base class too); the notes its results carry, in match_notes.py.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import trio

from peer import Peer
from protocol.identity import PeerID

from .bench import Bench
from .config import DECLARATION_SLACK, AveragerConfig
from .confirmation import Confirmation
from .gathering import Gathering, _same_layout
from .grouping import (
    Declaration,
    closed_marker,
    done_marker,
    find_group,
    leader_of,
    make_groups,
    parse_declarations,
    peers_of_layout,
    round_closing_after,
    round_key,
    saw_tag,
)
from .layout_check import LayoutCheck
from .match_notes import (
    _clock_note,
    _late_note,
    _left_alone_note,
    _out_of_step_note,
    _with_missed,
    _with_refused,
    _with_slow_link,
    _with_strangers,
)
from .messages import GroupConfirmation
from .round_state import MatchResult, RoundState

logger = logging.getLogger(__name__)


class Matchmaker(Gathering, LayoutCheck, Confirmation):
    """Finds a group for each step of one averager."""

    def __init__(
        self,
        node: Peer,
        prefix: str,
        config: AveragerConfig,
        total: int,
        clock: Callable[[], float],
    ) -> None:
        self.node = node
        self.prefix = prefix
        self.config = config
        self.total = total
        self.clock = clock
        # declarations of our layout seen in the last rounds (us included): peers of another
        # layout are no company, so they neither count for closing early nor for following;
        # nor do ghosts: the declarations (peer, step tag) of peers that failed our joins in
        # our last round, which stay in its key for the next step in the same slot; the same
        # peer declaring anew (another tag: a frozen one that came back) counts again
        self._views: list[frozenset[PeerID]] = []
        self._addresses: dict[PeerID, str] = {}  # of the peers in _views, as they declared
        self._lone_steps = 0  # our steps in a row that ended alone (see _out_of_step)
        self._store_times: list[float] = []  # seconds our last declarations took to store
        self._slow_warned = False  # whether the slow-link note was logged (once)
        self._step_rounds: list[int] = []  # the rounds our last steps ended in (3 at most)
        # the groups we were confirmed in, by round (the last few): our step's tag there
        # and the members. A member's "done" marker there that saw that tag tells of the
        # group with us, not of a peer that went on without us (a pair's survivor, alone in
        # the slot after its partner died, was told "1 other peer(s) had finished
        # matchmaking in this round": an outside tester). The marker of a member's later
        # step in that slot saw another tag of ours, or none, and counts (a review: leaving
        # out every marker of the members hid from a slow reader those that went on)
        self._grouped: dict[int, tuple[int, frozenset[str]]] = {}
        self._ghosts: set[tuple[PeerID, int]] = set()
        # the round our last read decided, the declaration it grouped, the others' step tags
        self._kept: tuple[int, Declaration, set[int]] | None = None
        # the grid phase of the last round of this step in which we read peers of our
        # layout (``phase_of`` of theirs and ours), None when we read none
        self.seen_phase: int | None = None
        self._foreign: set[str] = set()  # other layouts seen (warned about once; bounded)
        # Whether a peer of our own layout ever came beside us (declared, or done before we
        # read the round): then a round where only peers of other layouts showed up is their
        # mistake, not ours (we sit it out)...
        self._own_layout_seen = False
        # ... unless such strangers with company keep coming: rounds in a row (since we last
        # met our own layout) where others came, none of ours, some layout two or more
        self._outnumbered = 0
        self._subkey = str(node.peer_id)
        self._layout: str | None = None  # ours (set by find_group), named by our done markers
        # the round whose key still holds our declaration (perhaps: a store cut short), until
        # a "done" marker replaced it; and a replacement running in the background after a
        # step cut short (see withdraw_left_over)
        self._unwithdrawn: int | None = None
        self._withdrawing: trio.Event | None = None
        self.current: RoundState | None = None
        # the round we led and confirmed, until our step leaves it (the averager clears it)
        self.led: RoundState | None = None
        self.bench = Bench()  # peers that sent us garbage (the averager records them)

    # -- member side ---------------------------------------------------------------------

    async def find_group(
        self, me: Declaration, deadline: float, on_round: Callable[[int], None]
    ) -> MatchResult:
        """Declare, gather, and get a confirmed group before ``deadline`` (trio time).

        ``on_round(number)`` is called once the round is chosen, before declaring.

        Raises:
            LayoutMismatchError: every other peer of the round has another layout or codec
                and we never met our own (see ``_check_layouts``), or the leader refused ours.
        """
        window = self.config.gather_window
        if self._withdrawing is not None:  # its marker must not land after our declaration
            with trio.move_on_at(deadline):
                await self._withdrawing.wait()
        self._layout = me.layout
        self.seen_phase = None
        earliest = 0
        lone_retry = True
        strangers: MatchResult | None = None  # a lone round with peers of another layout
        missed: MatchResult | None = None  # a lone round whose others had not waited for us
        refused: MatchResult | None = None  # a round with a group that did not take us
        followed: int | None = None  # a lone round we followed out of (_out_of_step)
        while True:
            number = max(await self._choose_round(deadline), earliest)
            earliest = number + 1
            state = RoundState(number, me)
            self.current = state
            self.led = None
            on_round(number)
            try:
                result = await self._run_round(state, deadline)
            finally:
                state.closed.set()
                state.answered.set()
                state.settled = True
                state.notify()
                self.current = None
                if state.is_leader and state.confirmation is not None:
                    self.led = state
            # The leader had left that round (we saw its declaration from an earlier step),
            # answered already, or is gone: try the next round, time allowing.
            logger.debug(
                "round %d: %s (%d declared, leader %s)%s",
                number,
                "confirmed" if result.confirmation else result.note,
                result.declared,
                result.leader and result.leader.short(),
                ", retrying" if result.retry else "",
            )
            # Alone although others were in our last rounds: most likely they arrived just
            # after us at a slot boundary and declared in the next round. Follow them, once
            # (not when peers of our layout were in this round and the grouping left us out:
            # they average now, the next round cannot be better, and our "done" marker would
            # tell them we had found a group).
            lonely = result.alone and not result.left_out and lone_retry
            retry = result.retry or (lonely and self._others_recently(state.departed))
            if (
                lonely and not retry and self._lone_steps >= _LONE_STEPS
                and deadline - trio.current_time() >= 2 * window
            ):  # fmt: skip
                retry = await self._out_of_step(number, deadline)
                followed = number if retry else followed
            lone_retry = lone_retry and not result.alone
            if result.confirmation is not None:
                self._note_grouped(number, me.step, result.confirmation)
            if result.strangers and (strangers is None or result.strangers > strangers.strangers):
                strangers = result
            if result.late:
                missed = result
            if result.confirmation is None and not result.alone and result.note:
                refused = result
            self._store_times = [*self._store_times[-(_STORE_TIMES - 1) :], state.store_s]
            if not retry or deadline - trio.current_time() < 2 * window:
                self._lone_steps = self._lone_steps + 1 if result.alone else 0
                self._step_rounds = [*self._step_rounds[-2:], number]
                if followed is not None and result.alone:
                    result = replace(result, note=result.note + _out_of_step_note(followed))
                result = _with_refused(
                    _with_missed(_with_strangers(result, strangers), missed), refused
                )
                slow = _with_slow_link(result, self._store_times, window)
                if slow is not result and not self._slow_warned:  # (reports may go unread)
                    self._slow_warned = True
                    added = slow.note[len(result.note) + 2 :] if result.note else slow.note
                    logger.warning("under %r: %s", self.prefix, added)
                return slow
            await self.withdraw(number, min(deadline, trio.current_time() + window / 4))

    def _note_grouped(self, number: int, step: int, confirmation: GroupConfirmation) -> None:
        members = frozenset(str(m.peer_id) for m in confirmation.members)
        self._grouped[number] = (step, members)
        while len(self._grouped) > _GROUPED_ROUNDS:
            del self._grouped[min(self._grouped)]

    def _without_us(self, number: int, values: dict[Any, Any]) -> dict[Any, Any]:
        """Round ``number``'s entries but the markers of its group with us (see _grouped)."""
        grouped = self._grouped.get(number)
        if grouped is None:
            return values
        step, members = grouped
        return {s: v for s, v in values.items() if s not in members or not saw_tag(v, step)}

    def _others_recently(self, departed: set[PeerID]) -> bool:
        """Whether other peers declared in one of the rounds before the last one, but those
        that this round's pings found gone (a pair's survivor waited a whole slot more
        for its dead partner)."""
        return max((len(v - departed) for v in self._views[:-1]), default=0) >= 2

    def _remember_addresses(self, declared: list[Declaration]) -> None:
        """The addresses of the peers in the views we remember (see ``_ping_missing``)."""
        known = frozenset().union(*self._views)
        for d in declared:
            if d.peer_id in known and d.address is not None:
                self._addresses[d.peer_id] = d.address
        for peer_id in self._addresses.keys() - known:
            del self._addresses[peer_id]

    async def _out_of_step(self, number: int, deadline: float) -> bool:
        """Whether we, alone in round ``number``, follow into the next round because a peer
        of our layout stepped in one of the rounds since our last step of this prefix
        (``_LOOK_BACK`` to ``_MAX_LOOK_BACK`` rounds back) without us.

        Such a peer steps this prefix in other slots than we do: two peers that each step
        two prefixes in turn, one a slot behind the other, are each alone in every round (an
        outside tester's loop stayed so for 8 iterations in 4 runs of 6), and so are two
        with the same work between steps that started a slot apart. Following moves our
        phase one round later. With our cadence ``p`` (the fewest rounds between our last
        steps), the nearest peer seen ``d`` rounds back (the gap before us) and the farthest
        within a cadence ``f`` back (it steps again ``p - f`` rounds after us: the gap after
        us), we follow when ``d > p - f`` and stay when ``d < p - f``. Of two peers
        ``f == d``: the one with ``2d > p`` follows and the other, which sees it ``p - d``
        back, stays, so the gap closes by a round per lone step, and they meet when the
        follower comes from ``p - 1`` rounds back. Of three or more spread over the
        cadence, the gaps cannot all grow from one peer to the next, so one moves
        (``2d > p`` alone had peers 2, 1 and 2 rounds apart of 5 all stay for good: a
        review, 0 of 30 steps averaged). A tie (``d == p - f``, e.g. two prefixes in turn),
        or a cadence of one round, is a coin per peer and round (hashed, so a test with
        fixed identities replays): a rule that made both follow kept them apart, and one by
        PeerID order locked some pairs into an offset for good (a review: 22 of 24 steps
        averaged before, 0 after). A look-back fixed at 3 rounds and a coin in every case
        never met for ``p >= 5`` (a review); in a sweep of 84 timings (two peers, 0 to 11 s
        of work between steps, one or two prefixes, the second a quarter to 1.75 slots
        later, two identity seeds, 10 iterations) this rule averaged 2192 of 2520 steps
        against 1738 for that one, more in 25 timings and fewer in none."""
        if self._layout is None:
            return False
        # the shortest of our last gaps: a gap we followed in is a round longer, and two
        # peers that both followed once took the other for nearer than half a cadence, and
        # both stayed (two prefixes in turn)
        rounds = [*self._step_rounds, number]
        cadence = min((b - a for a, b in itertools.pairwise(rounds)), default=0)
        look_back = min(max(_LOOK_BACK, cadence - 1), _MAX_LOOK_BACK, number)
        layout = self._layout
        seen: list[int] = []  # how many rounds back a peer of our layout stepped

        async def read(back: int) -> None:
            entries = await self.node.dht.get_entries(round_key(self.prefix, number - back))
            values = self._without_us(number - back, {s: v for s, (v, _) in entries.items()})
            if peers_of_layout(values, layout, self._subkey):
                seen.append(back)

        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                for back in range(1, look_back + 1):
                    nursery.start_soon(read, back)
        if not seen:
            return False
        # the gap before us (the nearest peer back) against the gap after us (the farthest
        # back within a cadence steps again ``cadence - farthest`` rounds after us): a
        # peer whose gap before is the wider moves into the narrower one
        nearest = min(seen)
        farthest = max((back for back in seen if back < cadence), default=nearest)
        if cadence >= 2 and nearest != cadence - farthest:
            return nearest > cadence - farthest
        return _heads(self.node.peer_id, self.prefix, number)

    async def withdraw(self, number: int, deadline: float) -> None:
        """Replace our declaration in round ``number`` by a "done" marker (the caller runs
        this once the round is decided): a later step reusing the slot's key, or a peer that
        reads it late, must not take us for a peer still waiting there. The marker names our
        layout: a peer that reads only markers still learns whether it is the odd one."""
        key = round_key(self.prefix, number)
        value = {"done": True} if self._layout is None else done_marker(self._layout)
        if self._layout is not None and self._kept is not None and self._kept[0] == number:
            value = closed_marker(self._layout, self._kept[1], self._kept[2])
        with trio.move_on_at(deadline):
            await self.node.dht.store(key, value, ttl=self._ttl(), subkey=self._subkey)
            if self._unwithdrawn == number:
                self._unwithdrawn = None

    def withdraw_left_over(self) -> None:
        """After a step: replace, in the background, a declaration of ours that its step
        left in its round, cut short (cancelled by its caller, or an error) before its
        "done" marker was stored. It read as a peer still waiting there: a client-mode
        peer cannot be pinged, and two peers that stepped on in the same slot were each
        left alone beside it (an outside tester's fuzzer). The next step waits for it."""
        number = self._unwithdrawn
        if number is None or self._withdrawing is not None:
            return
        done = trio.Event()

        async def replace_it() -> None:
            try:
                await self.withdraw(number, trio.current_time() + self._ttl() / 2)
            finally:
                self._withdrawing = None
                done.set()

        if self.node.start_background(replace_it, name=f"withdraw {self.prefix} round"):
            self._withdrawing = done

    def _ttl(self) -> float:
        # Long enough to outlive slow DHT operations (an unresponsive node costs a request
        # timeout per lookup). Counted from the store, so that a later store under the same
        # subkey (done marker, next step in the same slot) expires later and replaces it.
        return 3 * self.config.gather_window + self.config.join_timeout + DECLARATION_SLACK

    async def _choose_round(self, deadline: float) -> int:
        window = self.config.gather_window
        now = self.clock()
        number = round_closing_after(now, window)
        if number * window - now < window / 2:
            margin = number * window - now >= window / 8
            if not (margin and await self._declared(number, deadline)):
                number += 1
        return number

    async def _declared(self, number: int, deadline: float) -> bool:
        """Whether a peer of our layout declared in round ``number`` (one of another
        layout, a misconfigured or newer peer, drew a correct newcomer into a round where
        it could only fail, while the next round's peers waited for it: a tester)."""
        with trio.move_on_at(deadline):
            entries = await self.node.dht.get_entries(round_key(self.prefix, number))
            declared = parse_declarations({s: v for s, (v, _) in entries.items()})
            return any(
                d.layout == self._layout and str(d.peer_id) != self._subkey for d in declared
            )
        return False

    async def _run_round(self, state: RoundState, deadline: float) -> MatchResult:
        window, key = self.config.gather_window, round_key(self.prefix, state.number)
        close_in = state.number * window - self.clock()
        close_at = trio.current_time() + close_in
        started = trio.current_time()
        self._unwithdrawn = state.number
        with trio.move_on_at(deadline):
            await self.node.dht.store(key, state.me.to_wire(), ttl=self._ttl(), subkey=self._subkey)
        state.store_s = trio.current_time() - started
        # A slow store (an unresponsive DHT node) means the others' stores are slow too:
        # give them a moment to land before reading.
        settle = window / 4
        close_at = max(close_at, trio.current_time() + settle)
        declared, done = await self._gather(state, key, min(close_at, deadline), deadline)
        # what that read grouped: our marker keeps it for the others' later reads (see
        # grouping.closed_marker)
        saw = {d.step for d in declared if d.peer_id != state.me.peer_id}
        self._kept = (state.number, state.me, saw)
        if trio.current_time() >= deadline:  # the step's timeout ended the gather
            self._kept = None
            state.closed.set()
            return self._cut_short(state, close_at - deadline)
        mine = next((d for d in declared if d.peer_id == state.me.peer_id), None)
        if mine is None:
            declared.append(state.me)
        elif mine.address != state.me.address:  # another process with our key overwrote ours
            state.closed.set()
            note = (
                f"another process declared under this peer's PeerID, at {mine.address} (the "
                "same identity: a copied key file?): peers cannot tell the two apart, so this "
                "one stays out; give each peer its own identity"
            )
            logger.warning("%s", note)
            return MatchResult(state.number, None, None, len(declared), note)
        ghosts, self._ghosts = self._ghosts, set()
        view = _same_layout(declared, state.me, ghosts)
        self._views = [*self._views[-2:], view]
        self._remember_addresses(declared)
        groups = make_groups(declared, self.config.group_size, self.prefix)
        others = [d for d in declared if d.peer_id != state.me.peer_id]
        self._check_layouts(state.me, others, done)
        group = find_group(groups, state.me.peer_id) or [state.me]
        state.elsewhere = {d.peer_id for g in groups if g is not group for d in g}
        leader = leader_of(group)
        state.leader = None if leader is None else leader.peer_id
        state.leader_address = None if leader is None else leader.address
        state.order = {d.peer_id: i for i, d in enumerate(group)}
        # The leader answers within join_timeout of the slot's close; a leader that does not
        # (frozen, or its DHT lookups hang) is given up on well before the step's deadline.
        state.give_up = min(
            deadline,
            self._after_slot_close(state, self.config.join_timeout + self.config.stall_timeout),
        )
        if leader is None or len(group) < 2:
            state.closed.set()
            note = _left_alone_note(
                state.me, others, self.config.group_size, len(self.node.dht.table)
            )
            late = _late_note(state, window)
            foreign = sum(d.layout != state.me.layout for d in others)
            if not others and (clock := _clock_note(self.node)):
                note += f" ({clock})"
            if foreign:
                note += f" of our layout ({foreign} peer(s) of another layout declared)"
            elif not others and state.unheard and len(self.node.dht.table):
                # Our read got only our own copy: not a sign of an empty round (a trial: a
                # 10 Mbit/s peer among 1 Gbit/s ones, its link still busy after a round cut
                # short, read "nobody declared" in rounds where three had). (An empty table
                # has its own note above.)
                note += (
                    " (none of the nodes our read of this round asked answered: a busy or "
                    "slow link, ours or theirs, or nodes that left?)"
                )
            elif not others and not late and len(self.node.dht.table):
                # Rounds are slots of gather_window: peers with another one never read the
                # same round key, and nothing else tells them from an empty swarm (a trial:
                # 2.1 s beside 2.0 s, alone every step, nothing logged anywhere).
                note += (
                    " (nobody declared in this round; peers meet only with the same prefix "
                    f"and gather_window, {window:g} s here)"
                )
            if late:
                note += f"; {late}"
            ours = [d for d in others if d.layout == state.me.layout]
            return MatchResult(
                state.number, None, None, len(declared), note, alone=True, strangers=foreign,
                late=late, left_out=bool(ours),
            )  # fmt: skip
        if leader.peer_id == state.me.peer_id:
            state.is_leader = True
            state.expected = self._expected(state, group)
            state.joined[state.me.peer_id] = state.me
            state.closed.set()
            return await self._lead(state, group, deadline, len(declared))
        state.closed.set()
        result = await self._join(state, group, deadline, len(declared))
        gone = [d for d in declared if d.peer_id in state.gone]
        # found gone in this round: out of its count (already out if a ghost before)
        self._views[-1] -= {d.peer_id for d in gone}
        self._ghosts = {(d.peer_id, d.step) for d in gone}
        return result

    def _cut_short(self, state: RoundState, early_by: float) -> MatchResult:
        """The deadline came before the round closed (or could be read): no group, whoever
        declared; not "alone", which says that nobody else did."""
        note = "the timeout ended the gather window before a group formed"
        if early_by > 0:
            note += f" (the round closes {early_by:.2f} s after the deadline; allow more than "
            note += "1.5 x gather_window for matchmaking, plus the all-reduce)"
        if state.others_seen:
            note += f"; {state.others_seen} other peer(s) had declared"
        return MatchResult(state.number, None, None, state.others_seen + 1, note)


_LONE_STEPS = 2
"""Steps of a prefix in a row that ended alone before a lone one may follow a peer seen in
the rounds before (``Matchmaker._out_of_step``): pairs that fall into step by themselves
after a lone step or two are left to it (following moved some into an offset they never
left: a review)."""

_GROUPED_ROUNDS = 8  # rounds whose groups with us Matchmaker._grouped remembers
_STORE_TIMES = 5  # our last declarations' store times whose median _with_slow_link weighs
_LOOK_BACK = 3
"""Rounds before a lone one in which a peer of our layout that stepped without us makes a
lone step follow into the next round, on a coin toss (``Matchmaker._out_of_step``); more
when our own steps of the prefix are further apart, up to ``_MAX_LOOK_BACK``."""

_MAX_LOOK_BACK = 16
"""The most rounds a lone step reads back (one DHT get each, concurrently)."""


def _heads(peer_id: PeerID, prefix: str, number: int) -> bool:
    """A fair coin for ``peer_id`` in round ``number`` of ``prefix``: independent between
    peers and rounds, the same in every run."""
    digest = hashlib.sha256(b"%s|%s|%d" % (peer_id.raw, prefix.encode(), number)).digest()
    return digest[0] & 1 == 1
