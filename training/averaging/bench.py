"""Peers this averager saw send garbage, kept out of the groups it leads for a while.

A member that sends garbage (undecodable chunks, a lying result header, an epoch other than
the one it declared) is dropped from the parts it spoiled, but it declares again next round
and, grouped again, spoils that round too: its contributions are dropped everywhere, so
every part is averaged over only *some* of the group, round after round. So a peer that saw
garbage *itself* (as the reducer the chunks came to, or as the member that fetched a
result) benches the sender: for its next ``BENCH_STEPS`` steps, doubled at each new offense
up to ``MAX_BENCH_STEPS``, it leaves the peer out of the groups it leads (the join is
refused with status ``benched``) and skips it as a leader. What other peers report (a
reducer's list of dropped senders) is never taken on trust: a liar could bench honest
peers. Nor is a dead, frozen or slow peer benched: that may be our own link's fault. A peer
whose values are NaN is not benched either: in the group, it gets the others' mean and
heals.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from protocol.identity import PeerID

BENCH_STEPS = 4
"""Steps of ours a first offender sits out (then 8, 16, ... at each new offense)."""
MAX_BENCH_STEPS = 256
MAX_BENCHED = 1024
"""Offenders remembered; beyond, the one whose last offense is oldest is forgotten."""


@dataclass(slots=True)
class _Record:
    offenses: int
    until: int  # the last of our steps (by count) that it sits out
    reason: str


class Bench:
    """Offenders and how long each sits out, counted in this averager's steps."""

    def __init__(self) -> None:
        self._records: OrderedDict[PeerID, _Record] = OrderedDict()
        self.steps = 0

    def tick(self) -> None:
        """One more step of ours (call at the start of each)."""
        self.steps += 1

    def record(self, peer_id: PeerID, reason: str) -> None:
        """``peer_id`` sent us garbage (``reason``, e.g. "garbage in round 12")."""
        old = self._records.pop(peer_id, None)
        offenses = 1 if old is None else old.offenses + 1
        length = min(BENCH_STEPS << min(offenses - 1, 16), MAX_BENCH_STEPS)
        self._records[peer_id] = _Record(offenses, self.steps + length, reason)
        while len(self._records) > MAX_BENCHED:
            self._records.popitem(last=False)

    def reason(self, peer_id: PeerID) -> str | None:
        """Why ``peer_id`` is benched now, with how many more steps; None when it is not."""
        record = self._records.get(peer_id)
        if record is None or self.steps > record.until:
            return None
        left = record.until - self.steps + 1
        return f"{record.reason} (benched for {left} more step(s) of ours)"

    def __contains__(self, peer_id: object) -> bool:
        return isinstance(peer_id, PeerID) and self.reason(peer_id) is not None
