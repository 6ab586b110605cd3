"""Reading a key: its holders asked closest first, their copies merged (the newest version of
each subkey, every signature checked), and holders with an older version repaired. A part of
:class:`peer.dht.node.DHT`, kept apart from its lookups and stores.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.dhtid import DHTID
from protocol.identity import PeerID
from protocol.messages import Entry, NodeInfo
from protocol.records import (
    MAX_ENTRIES_PER_STORE,
    MAX_SUBKEYS_PER_KEY,
    RecordError,
    Subkey,
    check_key,
    decode_value,
    key_owner,
    subkey_order,
    validate_entry,
)

from .storage import Record, merge_entry, supersedes

if TYPE_CHECKING:
    from .node import DHT

logger = logging.getLogger("peer.dht.node")

# A key holds at most 1024 subkeys of 16 KiB: 17 replies of 1 MiB; a node that keeps
# saying "more" gets no further than this.
_MAX_VALUE_PAGES = 32
_READ_SUBKEYS = 4 * MAX_SUBKEYS_PER_KEY
"""Subkeys a read's merge of its holders' copies takes before trimming them to the best
supported MAX_SUBKEYS_PER_KEY (room for a few holders' differing full copies; bounded)."""


@dataclass(frozen=True, slots=True)
class EntriesRead:
    """What a read of a key found (:meth:`DHT.read_entries`)."""

    entries: dict[Subkey, tuple[Any, float]]  # as get_entries returns them
    asked: int  # other nodes asked (0: this node's own copy was enough)
    answered: int  # of them, those whose whole copy came (asked but none answered: the
    # entries are only what this node stores itself, nothing for a client)


class Reading:
    """How a :class:`DHT` reads a key (:meth:`DHT.read_entries`)."""

    def __init__(self, dht: DHT) -> None:
        self._dht = dht

    async def read(self, key: str, *, latest: bool) -> EntriesRead:
        """:meth:`DHT.read_entries` (its docstring says what a read returns)."""
        key_id, owner = check_key(key), key_owner(key)
        self._dht._check_running()  # also when this node's own copy would answer alone
        record: Record = {}
        values: dict[Subkey, Any] = {}
        # how many holders sent a valid entry for each subkey: when the copies together
        # hold more subkeys than a key may, those most holders agree on are kept (one
        # holder's 1024 long-lived entries, a liar's or a flooder's, pushed every honest
        # subkey out of the merge: a review)
        support: dict[Subkey, int] = {}
        # each holder's older versions, not checked yet (see the trim below)
        unchecked: list[tuple[set[Subkey], list[Entry]]] = []
        local = self._dht.storage.get(key_id) if self._dht.storage is not None else {}
        for entry in local.values():
            self._merge(key_id, owner, record, values, entry, verified=True)
            support[entry.subkey] = 1
        quorum = min(self._dht.config.value_quorum, self._dht.config.k) if latest else 1
        config = self._dht.config
        holders = Holders(
            key_id, config.k, quorum, closest_first=latest, replicas=config.store_replicas
        )
        if self._dht.storage is not None:  # a client is no node of the key's k closest
            holders.answered(self._dht.peer_id, self._dht.node_id, bool(local))
        holders.learn(self._dht.table.nearest(key_id, 2 * self._dht.config.k))  # the lookup's seeds

        asked = answered = 0
        copies: list[tuple[NodeInfo, list[Entry]]] = []  # each holder's whole copy

        async def query(node: NodeInfo) -> Sequence[NodeInfo] | None:
            nonlocal asked, answered
            asked += 1
            response = await self._dht.protocol.find_value(node, key_id)
            if response is None:
                holders.failed(node)
                return None
            nodes = response.nodes
            budget = MAX_SUBKEYS_PER_KEY  # entries one holder may make us check
            cursor: bytes | None = None
            received: list[Entry] = []
            for page in range(1, _MAX_VALUE_PAGES + 1):
                entries = (response.entries or ())[:budget]
                budget -= len(entries)
                received += entries
                if not (response.more and entries and budget):
                    break
                # the rest of a key too large for one reply, page by page, in subkey order;
                # a holder whose pages do not move forward, or that names more entries
                # than a key holds, is done (each signed entry costs a signature check)
                after = subkey_order(entries[-1].subkey)
                if cursor is not None and after <= cursor:
                    break
                cursor = after
                response = await self._dht.protocol.find_value(node, key_id, after=after)
                if response is None:
                    # It failed partway (died during the read): part of a key must not pass
                    # for all of it, nor count toward the quorum. Others are asked instead.
                    logger.debug("%s failed after %d pages of %s", node.peer_id.short(), page, key)
                    holders.failed(node)
                    return None
            answered += 1  # a whole copy (a node that fails partway did not answer)
            valid: set[Subkey] = set()
            older: list[Entry] = []  # lost to a version held: not checked yet
            for entry in received:
                checked = self._merge(key_id, owner, record, values, entry, verified=False)
                if checked:
                    valid.add(entry.subkey)
                elif checked is None:
                    older.append(entry)
            for subkey in valid:
                support[subkey] = support.get(subkey, 0) + 1
            # a holder is one that sent a valid entry (invalid ones counted toward the
            # quorum, and a few nodes near a key hid an owner's signed value: a review)
            holds = bool(valid) or any(self._valid(key_id, owner, e) for e in older)
            if older:  # their support counts too, checked only if the read must trim
                unchecked.append((valid, older))
            if received and latest:
                copies.append((node, received))
            holders.learn(nodes)
            holders.answered(node.peer_id, DHTID.from_peer_id(node.peer_id), holds)
            return nodes

        if not holders.enough():
            # Once some node holds the key, at most as many requests in flight as holders
            # are still missing: the closest nodes are asked first and normally hold it, so
            # a get costs ~quorum RPCs. Before that, a plain lookup (a miss fans out).
            def wanted() -> int:
                return holders.missing() if holders.any else self._dht.config.k

            await self._dht._lookup(key_id, query, stop=holders.enough, wanted=wanted)
        if len(record) > MAX_SUBKEYS_PER_KEY:
            # a holder with an older version of a subkey supports it as much as one with
            # the newest (counting only those merged first made the support depend on the
            # order copies came in, and a liar's junk outranked them: a review)
            for counted, entries in unchecked:
                for entry in entries:
                    subkey = entry.subkey
                    if (
                        subkey in record
                        and subkey not in counted
                        and self._valid(key_id, owner, entry)
                    ):
                        counted.add(subkey)
                        support[subkey] = support.get(subkey, 0) + 1
            ranked = sorted(record, key=lambda s: (support.get(s, 0), record[s].expiration))
            for subkey in ranked[: len(record) - MAX_SUBKEYS_PER_KEY]:
                del record[subkey]
                values.pop(subkey, None)
        if latest:
            self._repair(key, key_id, record, copies)
        return EntriesRead(live_entries(record, values, self._dht.now()), asked, answered)

    def _repair(
        self,
        key: str,
        key_id: DHTID,
        record: Record,
        copies: Sequence[tuple[NodeInfo, Sequence[Entry]]],
    ) -> None:
        """Read repair: a holder that answered with an older version of a subkey than the
        read's winner is sent the winner (in the background, one STORE of at most
        MAX_ENTRIES_PER_STORE entries: a later read sends the rest). After a healed
        partition the two sides' holders of a key written on both held different versions
        until the owners republished (up to ``republish_interval``); readers whose holders
        all held the losing one read it. Only versions a holder has replaced, not subkeys
        it lacks: a matchmaking key's holders each miss some declarations, and filling them
        in on every read would be a store per get. Not this node's own copy: its storage
        charges what it holds to the host that sent it, and a remote reader's repair does
        that."""
        now = self._dht.now()
        winners = {s: e for s, e in record.items() if e.expiration > now}
        for node, entries in copies:
            if node.peer_id == self._dht.peer_id:
                continue
            newer: dict[Subkey, Entry] = {}  # by subkey: a reply may list one twice
            for old in entries:
                new = winners.get(old.subkey)
                if new is not None and new != old and supersedes(new, old):
                    newer[old.subkey] = new
                    if len(newer) == MAX_ENTRIES_PER_STORE:
                        break
            if newer and self._dht._publishing.store_in_background(
                node, key_id, key, tuple(newer.values()), pool="repair"
            ):
                self._dht.stats.repairs += 1

    def _merge(
        self,
        key_id: DHTID,
        owner: PeerID | None,
        record: Record,
        values: dict[Subkey, Any],
        entry: Entry,
        *,
        verified: bool,
    ) -> bool | None:
        """Merge ``entry`` into a read's ``record``: whether it is valid (None: not
        checked, it loses to the version held anyway). The record takes up to
        ``_READ_SUBKEYS`` subkeys, then only newer versions of those it holds (the read
        keeps the best supported ``MAX_SUBKEYS_PER_KEY`` of them at its end)."""
        old = record.get(entry.subkey)
        if old is not None and old == entry:
            return True  # the same one, checked when it came
        if old is not None and not supersedes(entry, old):
            return None  # loses anyway: no need to verify it
        if old is None and len(record) >= _READ_SUBKEYS:
            return None
        if not verified and not self._valid(key_id, owner, entry):
            return False
        try:
            value = decode_value(entry.value)
        except (RecordError, ValueError, TypeError) as exc:
            logger.debug("dropped an undecodable entry from a lookup: %r", exc)
            return False
        if merge_entry(record, entry, _READ_SUBKEYS):
            values[entry.subkey] = value
        return True

    def _valid(self, key_id: DHTID, owner: PeerID | None, entry: Entry) -> bool:
        """Whether ``entry``, from a lookup, passes ``validate_entry`` for ``key_id``."""
        try:
            validate_entry(key_id, entry, now=self._dht.now(), key_owner=owner)
        except (RecordError, ValueError, TypeError) as exc:
            logger.debug("dropped an invalid entry from a lookup: %r", exc)
            return False
        return True


class Holders:
    """Which nodes a get heard from, to end it at ``quorum`` holders of the key.

    With ``closest_first``, a holder counts only while fewer than ``replicas`` nodes are
    known to be closer to the key (its own reply names its closest contacts): a node
    asked on the way by a store's lookup keeps a copy of that one store, so a holder
    outside the closest may hold a few of a shared key's subkeys, or an old version (a
    getter far from the key met such nodes first and saw 25 of 40 writers' subkeys); the
    ``replicas`` closest (k by default) got every store. (Counted among the k closest
    with fewer replicas, such copies ended reads with 2 of 20 subkeys: a re-check.)
    """

    def __init__(
        self,
        target: DHTID,
        k: int,
        quorum: int,
        *,
        closest_first: bool,
        replicas: int | None = None,
    ) -> None:
        self._target = target
        self._k = k
        self._replicas = k if replicas is None else replicas
        self._quorum = quorum
        self._closest_first = closest_first
        # peer -> (distance to the key, True/False: answered holding it or not; None: not
        # yet answered); failed nodes leave
        self._nodes: dict[PeerID, tuple[int, bool | None]] = {}
        # addresses at which a node failed (the lookup asks it again only elsewhere)
        self._failed: dict[PeerID, set[str]] = {}
        # the one node not yet answered that stands for each address: one address, one
        # node (made-up PeerIDs at an address that never answers, which the lookup never
        # asks, held gets from ending at their quorum: a security review)
        self._at: dict[str, PeerID] = {}
        self.any = False  # some node answered holding the key

    def learn(self, nodes: Sequence[NodeInfo]) -> None:
        """Candidates, as the lookup takes them: the k closest of a reply, dialable ones."""
        dialable = [n for n in nodes if n.address is not None]
        for node in heapq.nsmallest(self._k, dialable, key=self._distance):
            failed_at = self._failed.get(node.peer_id, ())
            if node.peer_id in self._nodes or node.address in failed_at:
                continue
            assert node.address is not None
            if self._at.setdefault(node.address, node.peer_id) == node.peer_id:
                self._nodes[node.peer_id] = (self._distance(node), None)

    def _distance(self, node: NodeInfo) -> int:
        return DHTID.from_peer_id(node.peer_id) ^ self._target

    def answered(self, peer_id: PeerID, node_id: DHTID, holds: bool) -> None:
        self._nodes[peer_id] = (node_id ^ self._target, holds)
        self.any = self.any or holds

    def failed(self, node: NodeInfo) -> None:
        if self._nodes.get(node.peer_id, (0, None))[1] is None:
            # (one that answered proved itself: its request at another address, a liar's
            # silent one, failing later takes nothing back)
            self._nodes.pop(node.peer_id, None)
        if node.address is not None:
            self._failed.setdefault(node.peer_id, set()).add(node.address)
            if self._at.get(node.address) == node.peer_id:
                del self._at[node.address]  # (another PeerID named there may be the one)

    def _counted(self) -> int:
        if not self._closest_first:
            return sum(bool(holds) for _, holds in self._nodes.values())
        # ``replicas`` nodes known closer to the key: not one of its holders
        closest = heapq.nsmallest(self._replicas, self._nodes.values(), key=lambda item: item[0])
        return sum(bool(holds) for _, holds in closest)

    def enough(self) -> bool:
        return self._counted() >= self._quorum

    def missing(self) -> int:
        return max(self._quorum - self._counted(), 1)


def live_entries(
    record: Record, values: dict[Subkey, Any], now: float
) -> dict[Subkey, tuple[Any, float]]:
    return {s: (values[s], e.expiration) for s, e in record.items() if e.expiration > now}
