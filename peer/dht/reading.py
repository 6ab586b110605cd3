"""What a read of a key needs beside its lookup: when enough holders answered, and which
entries are live."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from protocol.dhtid import DHTID
from protocol.identity import PeerID
from protocol.messages import NodeInfo
from protocol.records import Subkey

from .storage import Record


class Holders:
    """Which nodes a get heard from, to end it at ``quorum`` holders of the key.

    With ``closest_first``, a holder counts only while fewer than k nodes are known to be
    closer to the key (its own reply names its closest contacts): a node asked on the
    way by a store's lookup keeps a copy of that one store, so a holder outside the k
    closest may hold a few of a shared key's subkeys, or an old version (a getter far
    from the key met such nodes first and saw 25 of 40 writers' subkeys); the k closest
    got every store.
    """

    def __init__(self, target: DHTID, k: int, quorum: int, *, closest_first: bool) -> None:
        self._target = target
        self._k = k
        self._quorum = quorum
        self._closest_first = closest_first
        # peer -> (distance to the key, True/False: answered holding it or not; None: not
        # yet answered); failed nodes leave
        self._nodes: dict[PeerID, tuple[int, bool | None]] = {}
        # addresses at which a node failed (the lookup asks it again only elsewhere)
        self._failed: dict[PeerID, set[str]] = {}
        self.any = False  # some node answered holding the key

    def learn(self, nodes: Sequence[NodeInfo]) -> None:
        """Candidates, as the lookup takes them: the k closest of a reply, dialable ones."""
        dialable = [n for n in nodes if n.address is not None]
        for node in heapq.nsmallest(self._k, dialable, key=self._distance):
            failed_at = self._failed.get(node.peer_id, ())
            if node.peer_id not in self._nodes and node.address not in failed_at:
                self._nodes[node.peer_id] = (self._distance(node), None)

    def _distance(self, node: NodeInfo) -> int:
        return DHTID.from_peer_id(node.peer_id) ^ self._target

    def answered(self, peer_id: PeerID, node_id: DHTID, holds: bool) -> None:
        self._nodes[peer_id] = (node_id ^ self._target, holds)
        self.any = self.any or holds

    def failed(self, node: NodeInfo) -> None:
        self._nodes.pop(node.peer_id, None)
        if node.address is not None:
            self._failed.setdefault(node.peer_id, set()).add(node.address)

    def _counted(self) -> int:
        if not self._closest_first:
            return sum(bool(holds) for _, holds in self._nodes.values())
        # k nodes known closer to the key: not one of its k holders
        closest = heapq.nsmallest(self._k, self._nodes.values(), key=lambda item: item[0])
        return sum(bool(holds) for _, holds in closest)

    def enough(self) -> bool:
        return self._counted() >= self._quorum

    def missing(self) -> int:
        return max(self._quorum - self._counted(), 1)


def live_entries(
    record: Record, values: dict[Subkey, Any], now: float
) -> dict[Subkey, tuple[Any, float]]:
    return {s: (values[s], e.expiration) for s, e in record.items() if e.expiration > now}
