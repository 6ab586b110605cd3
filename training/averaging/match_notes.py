"""The notes a step's ``MatchResult`` carries when matchmaking found no group, or a poor
one: why this peer was alone (nobody came, the grouping left it out, its clock, its late
read), that its declarations store too slowly for ``gather_window``, and what an earlier
round of the same step said (peers of another layout, a group that did not take us, a
round followed out of step). Pure functions of what the matchmaker saw (matchmaking.py)."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from peer import Peer

from .grouping import Declaration
from .round_state import MatchResult, RoundState


def _left_alone_note(
    me: Declaration, others: list[Declaration], group_size: int, known_peers: int
) -> str:
    """Why no group took us, when the round closed: nobody else came, or the grouping left
    us out (two client-mode peers cannot average: neither can reduce a part; an odd peer
    sits out with ``group_size=2``). ``known_peers``: our DHT routing table's size (none:
    say so, a newcomer that joined through a freshly restarted bootstrap node sees nobody)."""
    ours = [d for d in others if d.layout == me.layout]
    if not ours and not known_peers:
        # (a slow link saturated by a round's transfers can fail every ping, too: a
        # 10 Mbit/s peer among 1 Gbit/s ones lost all its contacts for 20 s in a trial)
        return (
            "no partner (this node knows no other peer in the DHT: none joined yet, all "
            "left, or our link was too busy to answer their pings)"
        )
    if not ours:
        return "no partner"
    note = f"no partner: {len(ours)} other peer(s) declared, "
    if me.client_mode and all(d.client_mode for d in ours):
        return note + "all client-mode like us (a group needs a peer that accepts connections)"
    note += f"and the groups (at most {group_size}) left us out this round"
    if me.client_mode:  # see grouping._most_full: why no full peer was spared for us
        note += (
            " (every group was full; a full peer is spared for clients only from a group of"
            " 3 or more full peers, one per round)"
        )
    return note


def _with_slow_link(result: MatchResult, store_times: list[float], window: float) -> MatchResult:
    """``result``, its note saying so when storing our declarations takes more than a
    quarter of the gather window (the median of the last few, at least 3): peers a moment
    apart then miss each other's rounds. Two trials, 4 peers at ~430 ms round trip (2 %
    loss), stores 0.8 s (median; p95 1.3 s): with the 2 s window they split into pairs
    that met in alternate rounds, each reporting "averaged 100% over 2 peers", in 77-88 %
    of their steps, with nothing said; 3 s still split half of them; 4 s (5 times the
    median store) had all four in 216 of 220 steps. At 50 ms each way stores took 0.2 s,
    and 60 of 60 steps had all four with the 2 s window."""
    if len(store_times) < 3:
        return result
    typical = statistics.median(store_times)
    if typical <= window / 4:
        return result
    wanted = math.ceil(round(10 * typical, 3)) / 2  # 5 x, up to half a second
    note = (
        f"storing our declaration takes {typical:.2f} s, over a quarter of gather_window "
        f"({window:g} s): on links this slow, peers a moment apart miss each other's rounds, "
        "and the swarm may split into groups that average apart, each in full; set "
        f"gather_window to {wanted:g} s or more (5 times that) on every peer of the prefix"
    )
    return replace(result, note=f"{result.note}; {note}" if result.note else note)


def _clock_note(node: Peer) -> str:
    """Why a peer whose clock is off by more than network time corrects meets nobody:
    rounds are slots of the clock, and its own are others' past or future (a trial's
    peer 5,000 s behind read "nobody declared" every step; the clock's warning was in the
    log only)."""
    gap = node.clock.uncorrected
    if not gap:
        return ""
    return (
        f"this machine's clock and its peers' differ by {abs(gap):.0f} s more than network "
        "time corrects (peer.netclock's warning in the log says by how much in all): rounds "
        "are cut by the clock, so set the wrong clock"
    )


def _late_note(state: RoundState, window: float) -> str:
    """When peers of the round had their groups already as we read it (their "done"
    markers): they did not wait for us, so say so, and how slow our own store was (a
    peer whose DHT store or read takes a good part of the window never meets anyone, and
    "no partner" alone sent its owner looking for a missing swarm)."""
    done = state.others_done
    if not done:
        return ""
    note = f"{done.total()} other peer(s) had finished matchmaking in this round when we read it"
    foreign = sum(n for layout, n in done.items() if layout not in (None, state.me.layout))
    if foreign:  # not a peer that was too slow for the swarm: one of another swarm's kind
        note += f" ({foreign} of another layout)"
    if state.store_s > window / 4:
        note += f" (storing our declaration took {state.store_s:.2f} s: a slow link or DHT?)"
    return note


def _with_strangers(result: MatchResult, strangers: MatchResult | None) -> MatchResult:
    """A step that followed a lone round into the next one still says, when alone, that
    peers of another layout came in the first (the user's clue to a mismatch)."""
    if strangers is None or not result.alone or result.strangers >= strangers.strangers:
        return result
    note = f"{result.note}; round {strangers.round}: {strangers.note}"
    return replace(result, note=note, strangers=strangers.strangers)


def _with_missed(result: MatchResult, missed: MatchResult | None) -> MatchResult:
    """A step that followed a lone round into the next one, alone again, still says that
    the others of the first had finished matchmaking before our read got through."""
    if missed is None or missed is result or not result.alone:
        return result
    return replace(result, note=f"{result.note}; round {missed.round}: {missed.late}")


def _with_refused(result: MatchResult, refused: MatchResult | None) -> MatchResult:
    """A step that tried the next round after a group left it out (its leader benched us,
    or had no room), and found none there either, still says why the first did not take
    it: "alone ...; nobody declared in this round" alone sent a benched peer looking for a
    prefix or gather_window mismatch (an outside tester)."""
    if refused is None or refused is result or result.confirmation is not None:
        return result
    return replace(
        result, note=f"{result.note}; before that, round {refused.round}: {refused.note}"
    )


def _out_of_step_note(number: int) -> str:
    """What a step that followed out of lone round ``number`` and was alone again says."""
    return (
        f"; alone in round {number} too, where a peer of our layout had stepped in the rounds"
        " just before without us: it steps this prefix in other slots than we do (work"
        " between steps that keeps the peers a slot or more apart, or several Averagers"
        " stepped one after another); lone steps move one of them a round at a time until"
        " they share a slot (docs/averaging.md, rounds)"
    )
