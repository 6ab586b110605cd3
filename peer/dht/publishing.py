"""What a DHT node stores: its stores to the k closest nodes (the lookup's own RPCs), the
expirations it stamps them with, the records it republishes, and the STOREs it sends again in
the background. A part of :class:`peer.dht.node.DHT`, kept apart from its lookups and reads.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from protocol.dhtid import DHTID
from protocol.messages import Entry, NodeInfo
from protocol.records import MAX_ENTRIES_PER_STORE, MAX_TTL, RecordError, Subkey, key_owner

from .bounded import each_bounded
from .storage import supersedes

if TYPE_CHECKING:
    from .node import DHT

logger = logging.getLogger("peer.dht.node")

_REPUBLISH_PARALLEL = 4
_BACKGROUND_STORES = 32  # stores re-sent after their lookup gave up on them, at once
_BACKGROUND_REPAIRS = 8  # read repairs in flight at once (a pool of their own: a holder
# that keeps answering with old versions and never replies must not hold the one above)
_LATER = 1e-6  # seconds one of our stores must outlast our last one by (float noise aside)


class Publishing:
    """How a :class:`DHT` stores and republishes what it stored."""

    def __init__(self, dht: DHT) -> None:
        self._dht = dht
        # (key id, subkey) -> (key text, entry) of what this node stored, to republish
        self.published: OrderedDict[tuple[DHTID, Subkey], tuple[str, Entry]] = OrderedDict()
        # (key id, subkey) -> (expiration, the same on trio's clock) of our latest store
        # there (see carry_over)
        self.stamped: OrderedDict[tuple[DHTID, Subkey], tuple[float, float]] = OrderedDict()
        self.in_background = {"resend": 0, "repair": 0}  # background stores in flight

    async def republish(self) -> int:
        """Re-store the live records this node stored, to the nodes closest now.

        Returns:
            How many keys were republished.

        Raises:
            Nothing for unreachable peers: a record no node accepts waits for the next round.
        """
        now = self._dht.now()
        by_key: dict[str, list[Entry]] = {}
        for (key_id, subkey), (key, entry) in list(self.published.items()):
            if entry.expiration <= now + self._dht.config.republish_margin:
                if entry.expiration <= now:
                    del self.published[key_id, subkey]
                continue
            by_key.setdefault(key, []).append(entry)

        async def one(job: tuple[str, list[Entry]]) -> None:
            key, entries = job
            for start in range(0, len(entries), MAX_ENTRIES_PER_STORE):
                chunk = tuple(entries[start : start + MAX_ENTRIES_PER_STORE])
                await self.store_entries(key, chunk)

        await each_bounded(by_key.items(), one, _REPUBLISH_PARALLEL)
        return len(by_key)

    def carry_over(self, slot: tuple[DHTID, Subkey], now: float, expiration: float) -> float:
        """The expiration to store under ``slot``: ``expiration``, unless our time moved
        back (network time following peers whose clocks are behind ours) since one of our
        earlier stores there. Counted on trio's monotonic clock, which no correction moves,
        this store expires later than that one; by our time it expires earlier, and every
        node would keep the old value until the old expiration (up to the size of the
        correction: a trial's peer, corrected 15 s back, had its averaging declarations
        refused for three rounds). Such a store goes out just after the old expiration: it
        replaces the old value, and lives at most the correction longer than its ttl. So
        do our next stores there, until their own expirations are the later ones (a
        recheck found the next store after the first refused again)."""
        lasts_until = trio.current_time() + (expiration - now)  # on the monotonic clock
        last = self.stamped.get(slot)
        if last is not None:
            old_expiration, old_lasts_until = last
            if expiration <= old_expiration and lasts_until > old_lasts_until + _LATER:
                later = math.nextafter(old_expiration, math.inf)
                if later - now <= MAX_TTL:
                    expiration = later
        if last is None or expiration > last[0]:  # else refused: the old one stays live
            self.stamped[slot] = (expiration, lasts_until)
            self.stamped.move_to_end(slot)
        stamped = self.stamped  # oldest first: drop the expired and beyond the bound
        while stamped and (
            len(stamped) > self._dht.config.max_republished_records
            or next(iter(stamped.values()))[0] < now
        ):
            stamped.popitem(last=False)
        return expiration

    def note_published(self, key: str, key_id: DHTID, entry: Entry, ttl: float) -> None:
        """Republish ``entry`` from now on, unless the record we republish outlives it: a
        store every node refuses (an older version) must not end the republishing of the
        live one (the owner's record was lost once its first holders left)."""
        slot = (key_id, entry.subkey)
        published = self.published.get(slot)
        if published is not None and not supersedes(entry, published[1]):
            return
        if ttl > self._dht.config.republish_interval:
            self.published[slot] = (key, entry)
            self.published.move_to_end(slot)
            while len(self.published) > self._dht.config.max_republished_records:
                self.published.popitem(last=False)
        else:  # gone, or nearly, by the next pass (e.g. an averaging round's declaration)
            self.published.pop(slot, None)

    async def store_entries(self, key: str, entries: tuple[Entry, ...]) -> bool:
        """Store while looking up: each STORE reply names the callee's closest contacts,
        so the lookup of the k closest nodes and the stores to them are the same RPCs
        (a node asked early that turns out not to be among the k closest keeps a copy
        too, until it expires). The last round's replies name contacts too: in a large
        network a round that found nothing closer does not prove the k closest are known
        (skipping them there lost 8 of 1,000 keys among 500 peers)."""
        key_id, owner = DHTID.from_key(key), key_owner(key)
        stored = False

        async def query(node: NodeInfo) -> Sequence[NodeInfo] | None:
            nonlocal stored
            response = await self._dht.protocol.store(node, key_id, key, entries)
            if response is None:
                return None
            stored = stored or any(response.accepted)
            return response.nodes

        def given_up(node: NodeInfo, proven: bool) -> None:
            # sent again: its outcome counts for or against the node, not the give-up
            if not self.store_in_background(node, key_id, key, entries):
                self._dht._given_up(node, proven)

        replicas = self._dht.config.store_replicas
        result = await self._dht._lookup(key_id, query, on_given_up=given_up, k=replicas)
        among = self._dht._among_closest(key_id, result.closest, replicas)
        if self._dht.storage is not None and among:
            for entry in entries:
                try:
                    stored = self._dht.storage.store(key_id, entry, owner, key) or stored
                except RecordError as exc:
                    logger.debug("local store refused: %s", exc)
        return stored

    def store_in_background(
        self,
        node: NodeInfo,
        key_id: DHTID,
        key: str,
        entries: tuple[Entry, ...],
        pool: str = "resend",
    ) -> bool:
        """Send again, in the service nursery and within the request timeout, a STORE that
        its lookup gave up on (too slow, then cancelled when the lookup ended): a slow node
        among the k closest, whose connection had idled out, missed most stores (its dial
        outlasted the lookup); or (``pool="repair"``) a read repair.
        Outside the request slots (they bound this node's CPU, and these mostly wait on
        the network), at most _BACKGROUND_STORES (_BACKGROUND_REPAIRS) at once; beyond,
        republish (a later read) covers it. At most MAX_ENTRIES_PER_STORE ``entries``.

        Returns:
            Whether it was sent (its outcome then counts for or against the node)."""
        limit = _BACKGROUND_REPAIRS if pool == "repair" else _BACKGROUND_STORES
        if self._dht._service is None or self.in_background[pool] >= limit:
            return False

        async def send() -> None:
            try:
                await self._dht.protocol.store(node, key_id, key, entries, take_slot=False)
            finally:
                self.in_background[pool] -= 1

        self.in_background[pool] += 1
        self._dht._service.start_soon(send)
        return True
