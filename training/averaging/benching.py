"""Benching the peers a step of the :class:`~.averager.Averager` saw send garbage itself
(``Benching``, a base class of it): what counts as seen, and a sender's non-finite values
that did not heal. The bench itself, and why it trusts no hearsay, is bench.py's."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from peer import Peer
from protocol.identity import PeerID

from .matchmaking import Matchmaker
from .plan import Liveness
from .reducer import DropReason
from .report import PartReport

logger = logging.getLogger("training.averaging.averager")  # (the log names stay as they were)


class Benching:
    """The benching of :class:`~.averager.Averager`, one of its base classes (the
    attributes below are the averager's)."""

    node: Peer
    _matchmaker: Matchmaker
    # senders our reducer dropped as nonfinite in our last step with a group (and its round)
    _nonfinite: tuple[int, set[PeerID]]

    def _bench_garbage(
        self,
        round_no: int,
        leader: PeerID | None,
        parts: Sequence[PartReport],
        liveness: Liveness,
    ) -> None:
        """Bench the peers we saw send garbage ourselves this round (see bench.py): senders
        our own reducer dropped as such, and reducers whose result we found to be garbage.
        Not what other reducers' headers say: that is hearsay.

        Whoever led the round: sizes, epochs and weights are checked against the
        confirmation, and a lying leader that told members different things (each join
        gets its own answer) could make honest peers' data look like garbage to each
        other, but such members carry different group tags (``plan.group_tag``, a digest
        of the confirmation each received) and never take each other's chunks or results.
        Garbage under our own tag came from a member told exactly what we were told.
        (Before the tags were digests, only the leader and the culprit's own round's
        members benched, and a persistent culprit was in up to half of the next rounds.)

        A sender our part dropped as ``nonfinite`` is not benched (it receives the others'
        mean, which heals a NaN), unless our part drops it so again in our next step with a
        group: then nothing healed (random bytes under ``none`` read as non-finite values:
        an outside trial's junk sender kept every round at 25 % partial, never benched)."""
        me = self.node.peer_id
        if leader is None:
            return
        mine = [part for part in parts if part.reducer == me]
        seen = {p: f"garbage chunks in round {round_no}" for part in mine
                for p, reason in part.dropped.items() if reason is DropReason.GARBAGE}  # fmt: skip
        seen.update(
            (p, f"garbage a result in round {round_no}")
            for p, reason in liveness.bad.items()
            if reason is DropReason.GARBAGE
        )
        nonfinite = {
            p for part in mine for p, reason in part.dropped.items()
            if reason is DropReason.NONFINITE
        }  # fmt: skip
        before, self._nonfinite = self._nonfinite, (round_no, nonfinite)
        # (two steps can share a round number: a step retried in its slot)
        rounds = f"rounds {before[0]} and {round_no}"
        if before[0] == round_no:
            rounds = f"round {round_no}"
        for peer_id in nonfinite & before[1]:
            seen.setdefault(
                peer_id, f"non-finite values in two steps in a row ({rounds}; not healed)"
            )
        for peer_id, what in seen.items():
            if peer_id != me:
                self._matchmaker.bench.record(peer_id, f"it sent us {what}")
                logger.info("round %d: benched %s (it sent us %s)", round_no, peer_id.short(), what)
