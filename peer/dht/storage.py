"""The local value store: ``key -> {subkey -> Entry}`` with expiry on an injected clock.

Rules (the same ones merge answers from many nodes in a lookup, see :func:`merge_entry`):
- A key holds a dictionary of subkeys; a plain value is the subkey ``None``, one subkey
  among the others (so no store, signed or not, can push another writer's subkey out:
  an unsigned plain value must not erase owner-bound entries).
- Per subkey, the later expiration wins; an identical entry is accepted again (a
  republish), an older one is refused (a replay). Between two different entries that
  expire at the same time (two peers storing at once on clocks that agree, or one peer
  twice within its clock's resolution) the smaller serialized value wins (then owner
  key, then signature): every node then keeps the same one, whatever the arrival order,
  so every reader gets the same answer (:func:`supersedes`).
- A full dictionary (``max_subkeys``) drops its soonest-expiring subkey for a newcomer
  that outlives it, and refuses it otherwise (:func:`admit`). Where the store knows who
  sent each entry, a full dictionary is fair to its writers first: a source holding more
  than its share of the key's subkeys (``SUBKEY_SHARE_PER_SOURCE``: it wrote them while
  there was room) gives way to any other writer, soonest-expiring entry first, whatever
  the expirations; a source at its share only replaces its own entries.
- Entries vanish at their expiration (``expiration <= now``); every store is first
  checked by :func:`protocol.records.validate_entry` (size, ttl, owner signature).
- Limits: ``max_keys`` keys and ``max_bytes`` (values plus ``ENTRY_OVERHEAD`` per entry) in
  all; and each *source* (the remote host a STORE came from, named by the caller) may hold
  at most ``max_share_per_source`` of each, counting the keys where it holds an entry and
  the bytes of its entries: one host must not fill the store and lock everyone else out
  until its entries expire. An entry is charged to the source that stored it until it
  leaves (expired, replaced by a newer version, dropped from a full dictionary); an
  identical one stored again changes nothing. Entries with no source (this node's own
  stores) count toward the totals only.

The clock is injected and must be unix time, because expirations travel between
peers: tests on trio's virtual clock pass ``lambda: EPOCH + trio.current_time()``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from protocol.dhtid import DHTID
from protocol.identity import PeerID
from protocol.messages import Entry
from protocol.records import MAX_SUBKEYS_PER_KEY, validate_entry

logger = logging.getLogger(__name__)

ENTRY_OVERHEAD = 512
"""Bytes each entry counts toward ``max_bytes`` on top of its value: what holding it costs
in memory (its subkey, signature and objects: ~420 bytes measured for a 128-byte subkey),
so that many tiny values cannot hold far more memory than the budget says."""
SUBKEY_SHARE_PER_SOURCE = 0.25
"""The share of one key's ``max_subkeys_per_key`` a source may keep once the dictionary is
full: a full dictionary makes room for a newcomer that outlives its soonest-expiring
entry, so one host storing long ttls under a shared key (a matchmaking round) would
otherwise push every other writer out of it. While there is room, a source may write
more (a node handing a large dictionary over to a newcomer, hundreds of peers behind one
NAT declaring in one round); what it holds beyond its share gives way to other writers
once the dictionary is full."""
_HEAP_SLACK = 1024
"""Stale expiry items tolerated on top of one per entry held, before a rebuild."""

Subkey = None | str | int | bytes
Record = dict[Subkey, Entry]


def _tiebreak(entry: Entry) -> tuple[bytes, bytes, bytes]:
    return entry.value, entry.owner_key or b"", entry.signature or b""


def supersedes(entry: Entry, old: Entry) -> bool:
    """Whether ``entry`` replaces ``old`` (same key and subkey): it expires later, or at
    the same time and orders first by (value, owner key, signature). A total order, so
    that nodes that saw two entries in different orders keep the same one."""
    if entry.expiration != old.expiration:
        return entry.expiration > old.expiration
    return _tiebreak(entry) < _tiebreak(old)


def admit(record: Record, entry: Entry, max_subkeys: int) -> tuple[bool, Entry | None]:
    """Whether ``record`` would take ``entry`` under the module rules, without changing it.

    Returns:
        (taken, leaving): ``leaving`` is the entry that would make room for it (the
        subkey's older version, or the soonest-expiring subkey of a full dictionary), the
        held entry itself when ``entry`` is identical to it, or None.
    """
    old = record.get(entry.subkey)
    if old is not None:
        return (old == entry or supersedes(entry, old)), old
    if len(record) < max_subkeys:
        return True, None
    soonest = min(record, key=lambda s: record[s].expiration)
    leaving = record[soonest]
    return leaving.expiration < entry.expiration, leaving


def merge_entry(record: Record, entry: Entry, max_subkeys: int = MAX_SUBKEYS_PER_KEY) -> bool:
    """Merge ``entry`` into ``record`` in place under the module rules.

    Returns:
        True when the entry is now held (new, newer, or identical), False when refused.
    """
    taken, leaving = admit(record, entry, max_subkeys)
    if taken:
        if leaving is not None and leaving.subkey != entry.subkey:
            del record[leaving.subkey]
        record[entry.subkey] = entry
    return taken


def _expiration(entry: Entry) -> float:
    return entry.expiration


def _cost(entry: Entry) -> int:
    return len(entry.value) + ENTRY_OVERHEAD


_K = TypeVar("_K")


def _decrease(counts: dict[_K, int], key: _K, amount: int) -> None:
    """Take ``amount`` off ``counts[key]``, dropping the key at zero (counts stay bounded
    by what is held)."""
    left = counts[key] - amount
    if left:
        counts[key] = left
    else:
        del counts[key]


class DHTStorage:
    """Records this node holds, for itself and for others."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        max_keys: int = 100_000,
        max_bytes: int = 256 << 20,
        max_subkeys_per_key: int = MAX_SUBKEYS_PER_KEY,
        max_share_per_source: float = 0.125,
        subkey_share_per_source: float = SUBKEY_SHARE_PER_SOURCE,
    ) -> None:
        if not 0 < max_share_per_source <= 1:
            raise ValueError(f"max_share_per_source must be in (0, 1], not {max_share_per_source}")
        self._clock = clock
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self.max_subkeys_per_key = max_subkeys_per_key
        self.max_keys_per_source = max(1, int(max_keys * max_share_per_source))
        self.max_bytes_per_source = max(1, int(max_bytes * max_share_per_source))
        self.max_subkeys_per_source = max(1, int(max_subkeys_per_key * subkey_share_per_source))
        self._records: dict[DHTID, Record] = {}
        self._names: dict[DHTID, str] = {}  # key text, when a STORE told it (handover)
        self.num_bytes = 0  # values held plus ENTRY_OVERHEAD per entry: what peers control
        self.num_entries = 0  # live and not yet expired entries, over every key
        # who stored each entry that has a source, and what each source holds (no zeros)
        self._sources: dict[DHTID, dict[Subkey, str]] = {}
        self._subkeys_by_source: dict[DHTID, Counter[str]] = {}  # per key, no zeros
        self._keys_by_source: dict[str, int] = {}
        self._bytes_by_source: dict[str, int] = {}
        # (expiration, tiebreak, key, subkey); stale items (an entry replaced by a newer
        # version, or dropped from a full dictionary) are skipped when popped, and the heap
        # is rebuilt once they outnumber the entries held (a peer that keeps re-storing
        # one subkey with a later expiration must not grow it until the old ones expire)
        self._expiry: list[tuple[float, int, DHTID, Subkey]] = []
        self._counter = itertools.count()

    def now(self) -> float:
        return self._clock()

    def store(
        self,
        key: DHTID,
        entry: Entry,
        key_owner: PeerID | None = None,
        name: str | None = None,
        source: str | None = None,
    ) -> bool:
        """Validate and merge one entry (``key_owner``: the owner the key's text names;
        ``name``: the key's text, kept while the key lives so it can be handed over;
        ``source``: the remote host that sent it, charged for it while it is held; None
        for this node's own stores).

        Returns:
            True when the entry is held, False when a newer one wins or storage is full
            (``max_keys`` keys, or ``max_bytes`` of values and their overhead, in all or
            for ``source``).

        Raises:
            RecordError: the entry is invalid (oversized, expired, bad or missing signature).
        """
        now = self._clock()
        record = self._records.get(key)
        held = None if record is None else record.get(entry.subkey)
        # The same entry again (a republish, or a replay: a security review's peer sent one
        # signed store of 64 entries 128 times at once, 1.7 s of signature checks on our
        # loop) was checked when stored, and is valid as long as it lives.
        if held is None or held.expiration <= now or held != entry:
            validate_entry(key, entry, now=now, key_owner=key_owner)
        self.expire()
        record = self._records.get(key)
        if record is None and len(self._records) >= self.max_keys:
            logger.debug("storage full (%d keys): refused a new key", self.max_keys)
            return False
        if record and entry.subkey not in record and len(record) >= self.max_subkeys_per_key:
            leaving = self._room_for(key, record, entry, source)
            taken = leaving is not None
        else:
            taken, leaving = admit(record or {}, entry, self.max_subkeys_per_key)
        if not taken:
            return False
        if leaving != entry:  # an identical one again (a republish) changes nothing
            # the entry it replaces makes room (a full store refused an owner's newer
            # version of its own entry, and kept serving the stale one: a review)
            freed = 0 if leaving is None else _cost(leaving)
            if self.num_bytes + _cost(entry) - freed > self.max_bytes:
                logger.debug("storage full (%d bytes): refused an entry", self.max_bytes)
                return False
            if source is not None and not self._within_quota(key, entry, leaving, source):
                return False
            if record is None:
                record = self._records[key] = {}
            if leaving is not None:
                if leaving.subkey != entry.subkey:
                    del record[leaving.subkey]
                self._release(key, leaving)
            record[entry.subkey] = entry
            self._hold(key, entry, source)
            item = (entry.expiration, next(self._counter), key, entry.subkey)
            heapq.heappush(self._expiry, item)
            if len(self._expiry) > 2 * self.num_entries + _HEAP_SLACK:
                self._rebuild_expiry()
        if name is not None:
            self._names[key] = name
        return True

    def _within_quota(self, key: DHTID, entry: Entry, leaving: Entry | None, source: str) -> bool:
        """Whether ``source`` may hold ``entry`` besides what it holds, ``leaving`` (the
        entry it replaces) refunded if that was its own."""
        sources = self._sources.get(key, {})
        keys = self._keys_by_source.get(source, 0)
        num_bytes = self._bytes_by_source.get(source, 0) + _cost(entry)
        counts = self._subkeys_by_source.get(key)
        subkeys_here = counts[source] if counts else 0
        if leaving is not None and sources.get(leaving.subkey) == source:
            num_bytes -= _cost(leaving)  # its own: the entry takes its place
        new_key = not subkeys_here
        if num_bytes > self.max_bytes_per_source or (new_key and keys >= self.max_keys_per_source):
            logger.debug(
                "storage quota: %s holds %d keys and %d bytes here, %d subkeys of this key:"
                " refused an entry",
                source,
                keys,
                self._bytes_by_source.get(source, 0),
                subkeys_here,
            )
            return False
        return True

    def _room_for(
        self, key: DHTID, record: Record, entry: Entry, source: str | None
    ) -> Entry | None:
        """The entry of ``key``'s full dictionary that gives way to ``entry``, a new
        subkey from ``source``, or None when it is refused (see the module rules)."""
        counts = self._subkeys_by_source.get(key)
        candidates: Iterable[Entry] = record.values()
        if counts:
            sources = self._sources[key]
            share = self.max_subkeys_per_source
            if source is not None and counts[source] >= share:
                candidates = [record[s] for s, held in sources.items() if held == source]
            else:
                heaviest, held = max(counts.items(), key=lambda item: item[1])
                if held > share:  # written while there was room: yields to anyone else
                    mine = (record[s] for s, by in sources.items() if by == heaviest)
                    return min(mine, key=_expiration)
        soonest = min(candidates, key=_expiration)
        return soonest if soonest.expiration < entry.expiration else None

    def _hold(self, key: DHTID, entry: Entry, source: str | None) -> None:
        """Count ``entry``, just put into ``key``'s record, for ``source``."""
        cost = _cost(entry)
        self.num_bytes += cost
        self.num_entries += 1
        if source is None:
            return
        counts = self._subkeys_by_source.setdefault(key, Counter())
        if not counts[source]:
            self._keys_by_source[source] = self._keys_by_source.get(source, 0) + 1
        counts[source] += 1
        self._sources.setdefault(key, {})[entry.subkey] = source
        self._bytes_by_source[source] = self._bytes_by_source.get(source, 0) + cost

    def _release(self, key: DHTID, entry: Entry) -> None:
        """Uncount ``entry``, just taken out of ``key``'s record, and refund its source."""
        cost = _cost(entry)
        self.num_bytes -= cost
        self.num_entries -= 1
        sources = self._sources.get(key)
        if sources is None or entry.subkey not in sources:
            return
        source = sources.pop(entry.subkey)
        if not sources:
            del self._sources[key]
        _decrease(self._bytes_by_source, source, cost)
        counts = self._subkeys_by_source[key]
        _decrease(counts, source, 1)
        if not counts:
            del self._subkeys_by_source[key]
        if not counts[source]:
            _decrease(self._keys_by_source, source, 1)

    def held_by(self, source: str) -> tuple[int, int]:
        """What ``source`` holds here: (keys with an entry of its, bytes as counted)."""
        return self._keys_by_source.get(source, 0), self._bytes_by_source.get(source, 0)

    def get(self, key: DHTID) -> Record:
        """A copy of the live entries of ``key`` (empty when none)."""
        record = self._records.get(key)
        if record is None:
            return {}
        now = self._clock()
        return {s: e for s, e in record.items() if e.expiration > now}

    def expire(self) -> int:
        """Drop expired entries now; returns how many went."""
        now = self._clock()
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            expiration, _, key, subkey = heapq.heappop(self._expiry)
            record = self._records.get(key)
            if record is None:
                continue
            entry = record.get(subkey)
            if entry is not None and entry.expiration == expiration:
                del record[subkey]
                self._release(key, entry)
                dropped += 1
                if not record:
                    del self._records[key]
                    self._names.pop(key, None)
        return dropped

    def _rebuild_expiry(self) -> None:
        """One heap item per entry held: drops the stale ones."""
        self._expiry = [
            (entry.expiration, next(self._counter), key, subkey)
            for key, record in self._records.items()
            for subkey, entry in record.items()
        ]
        heapq.heapify(self._expiry)

    def name_of(self, key: DHTID) -> str | None:
        """The text of ``key``, if a store told it and the key still lives here."""
        return self._names.get(key) if key in self._records else None

    def keys(self) -> Iterator[DHTID]:
        return iter(list(self._records))

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records
