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
  that outlives it, and refuses it otherwise.
- Entries vanish at their expiration (``expiration <= now``); every store is first
  checked by :func:`protocol.records.validate_entry` (size, ttl, owner signature).

The clock is injected and must be unix time, because expirations travel between
peers: tests on trio's virtual clock pass ``lambda: EPOCH + trio.current_time()``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterator

from protocol.dhtid import DHTID
from protocol.identity import PeerID
from protocol.messages import Entry
from protocol.records import MAX_SUBKEYS_PER_KEY, validate_entry

logger = logging.getLogger(__name__)

ENTRY_OVERHEAD = 512
"""Bytes each entry counts toward ``max_bytes`` on top of its value: what holding it costs
in memory (its subkey, signature and objects: ~420 bytes measured for a 128-byte subkey),
so that many tiny values cannot hold far more memory than the budget says."""
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


def merge_entry(record: Record, entry: Entry, max_subkeys: int = MAX_SUBKEYS_PER_KEY) -> bool:
    """Merge ``entry`` into ``record`` in place under the module rules.

    Returns:
        True when the entry is now held (new, newer, or identical), False when refused.
    """
    subkey = entry.subkey
    old = record.get(subkey)
    if old is not None:
        if old == entry:
            return True
        if not supersedes(entry, old):
            return False
    elif len(record) >= max_subkeys:
        soonest = min(record, key=lambda s: record[s].expiration)
        if record[soonest].expiration >= entry.expiration:
            return False
        del record[soonest]
    record[subkey] = entry
    return True


def _cost(entry: Entry) -> int:
    return len(entry.value) + ENTRY_OVERHEAD


def _size(record: Record) -> int:
    return sum(_cost(entry) for entry in record.values())


class DHTStorage:
    """Records this node holds, for itself and for others."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        max_keys: int = 100_000,
        max_bytes: int = 256 << 20,
        max_subkeys_per_key: int = MAX_SUBKEYS_PER_KEY,
    ) -> None:
        self._clock = clock
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self.max_subkeys_per_key = max_subkeys_per_key
        self._records: dict[DHTID, Record] = {}
        self._names: dict[DHTID, str] = {}  # key text, when a STORE told it (handover)
        self.num_bytes = 0  # values held plus ENTRY_OVERHEAD per entry: what peers control
        self.num_entries = 0  # live and not yet expired entries, over every key
        # (expiration, tiebreak, key, subkey); stale items (an entry replaced by a newer
        # version, or dropped from a full dictionary) are skipped when popped, and the heap
        # is rebuilt once they outnumber the entries held (a peer that keeps re-storing
        # one subkey with a later expiration must not grow it until the old ones expire)
        self._expiry: list[tuple[float, int, DHTID, Subkey]] = []
        self._counter = itertools.count()

    def now(self) -> float:
        return self._clock()

    def store(
        self, key: DHTID, entry: Entry, key_owner: PeerID | None = None, name: str | None = None
    ) -> bool:
        """Validate and merge one entry (``key_owner``: the owner the key's text names;
        ``name``: the key's text, kept while the key lives so it can be handed over).

        Returns:
            True when the entry is held, False when a newer one wins or storage is full
            (``max_keys`` keys, or ``max_bytes`` of values and their overhead).

        Raises:
            RecordError: the entry is invalid (oversized, expired, bad or missing signature).
        """
        now = self._clock()
        validate_entry(key, entry, now=now, key_owner=key_owner)
        self.expire()
        if self.num_bytes + _cost(entry) > self.max_bytes:
            logger.debug("storage full (%d bytes): refused an entry", self.max_bytes)
            return False
        record = self._records.get(key)
        if record is None:
            if len(self._records) >= self.max_keys:
                logger.debug("storage full (%d keys): refused a new key", self.max_keys)
                return False
            record = self._records[key] = {}
        before, held = _size(record), len(record)
        again = record.get(entry.subkey) == entry  # a republish: already in the heap
        accepted = merge_entry(record, entry, self.max_subkeys_per_key)
        if accepted:
            if name is not None:
                self._names[key] = name
            self.num_bytes += _size(record) - before
            self.num_entries += len(record) - held
            if not again:
                item = (entry.expiration, next(self._counter), key, entry.subkey)
                heapq.heappush(self._expiry, item)
                if len(self._expiry) > 2 * self.num_entries + _HEAP_SLACK:
                    self._rebuild_expiry()
        elif not record:
            del self._records[key]
        return accepted

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
                self.num_bytes -= _cost(entry)
                self.num_entries -= 1
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
