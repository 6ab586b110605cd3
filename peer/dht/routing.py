"""The Kademlia routing table: 256 k-buckets by XOR distance, least-recently-seen first.

Sans-I/O: time comes in as an argument and the table never sends anything. When a
full bucket meets a newcomer, :meth:`RoutingTable.update` hands back the bucket's
least-recently-seen contact; the caller pings it and reports with
:meth:`RoutingTable.ping_result`.

Rules:
- A contact enters only once it proved its id (it answered us, or sent us a request
  over a handshake-verified connection) and has an address: client-mode peers and
  third parties merely named in replies never enter.
- Known contact seen again -> moved to the tail (most recently seen), address refreshed,
  failure count reset.
- Bucket with room -> the newcomer is appended.
- Full bucket -> the newcomer goes to the bucket's replacement cache (bounded, freshest
  kept) and the least-recently-seen contact is returned to be pinged, unless a ping of
  it is already pending or it was seen less than ``ping_after`` seconds ago (BEP 5's
  "good" nodes: no need to ask). Answered -> it moves to the tail and the newcomer waits
  in the cache. Failed -> it is evicted and the freshest replacement takes its place.
- Failed RPC -> the contact leaves at once when a replacement waits, otherwise after
  ``max_failures`` failures in a row (a partition should not empty a table). A timeout
  proves less (the peer may be merely slow or overloaded): timeouts only count toward
  ``max_failures``. So does a call that could not reach the contact (a refused dial, or
  a connection that broke under it: a NAT resetting it says nothing of the peer), but
  when a replacement waits, or at ``max_failures``, the contact is returned to be pinged
  instead (one reset fails every call in flight at once), and leaves if that ping fails.
- Contacts not heard from for a while are listed by :meth:`RoutingTable.quiet_contacts`
  (the DHT's refresh pings them and removes those that do not answer: a peer that went
  quiet before it died is met by no failed request in a bucket other contacts keep busy).
"""

from __future__ import annotations

import bisect
import random
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from protocol.dhtid import DHTID, ID_BITS
from protocol.identity import PeerID
from protocol.messages import NodeInfo

DEPARTED_MEMORY = 256
"""Contacts that left the table after failures, remembered (most recent kept) so that a
refresh can try a few again: after a long partition heals they are the only peers on the
other side this node knows, when its initial peers are gone."""


@dataclass(slots=True)
class _Contact:
    node: NodeInfo
    id: int  # DHTID of node.peer_id, kept to sort without rehashing
    last_seen: float
    failures: int = 0


@dataclass(slots=True)
class _Bucket:
    contacts: OrderedDict[PeerID, _Contact] = field(default_factory=OrderedDict)
    replacements: OrderedDict[PeerID, _Contact] = field(default_factory=OrderedDict)
    pending_ping: PeerID | None = None
    last_active: float = float("-inf")  # last lookup into its range or contact seen in it


class RoutingTable:
    """k-buckets around ``local_id`` with replacement caches; see the module rules."""

    def __init__(
        self,
        local_id: DHTID,
        k: int = 20,
        *,
        replacement_cache_size: int | None = None,
        max_failures: int = 3,
        ping_after: float = 0.0,
    ) -> None:
        self.local_id = local_id
        self.k = k
        self.replacement_cache_size = (
            k if replacement_cache_size is None else replacement_cache_size
        )
        self.max_failures = max_failures
        self.ping_after = ping_after
        self._buckets: defaultdict[int, _Bucket] = defaultdict(_Bucket)  # made on first use
        self._index: dict[PeerID, int] = {}  # peer -> bucket index, for contacts only
        self._nonempty: list[int] = []  # indices of buckets with contacts, ascending
        self._departed: OrderedDict[PeerID, NodeInfo] = OrderedDict()  # oldest first
        self.on_promoted: Callable[[NodeInfo], None] | None = None
        """Called with a replacement that took an evicted contact's place."""
        self.on_departed: Callable[[NodeInfo], None] | None = None
        """Called with a contact that left the table (after failures, or removed)."""
        self.on_emptied: Callable[[NodeInfo], None] | None = None
        """Called with the last contact when it left, the table empty then."""

    # ---- queries ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._index

    def last_seen(self, peer_id: PeerID) -> float | None:
        """When the contact ``peer_id`` was last heard from (None: not a contact)."""
        index = self._index.get(peer_id)
        return None if index is None else self._buckets[index].contacts[peer_id].last_seen

    def get(self, peer_id: PeerID) -> NodeInfo | None:
        index = self._index.get(peer_id)
        if index is None:
            return None
        return self._buckets[index].contacts[peer_id].node

    def nodes(self) -> Iterator[NodeInfo]:
        """Every contact, far buckets first, least recently seen first within a bucket."""
        for index in reversed(list(self._nonempty)):
            for contact in list(self._buckets[index].contacts.values()):
                yield contact.node

    def bucket_nodes(self, index: int) -> list[NodeInfo]:
        """Contacts of bucket ``index``, least recently seen first."""
        return [c.node for c in self._buckets[index].contacts.values()]

    def replacement_nodes(self, index: int) -> list[NodeInfo]:
        """The replacement cache of bucket ``index``, oldest first."""
        return [c.node for c in self._buckets[index].replacements.values()]

    def contact_ids(self, exclude: PeerID | None = None) -> list[int]:
        """The ids of every contact (not the replacements), but ``exclude``'s."""
        return [
            contact.id
            for index in self._nonempty
            for peer_id, contact in self._buckets[index].contacts.items()
            if peer_id != exclude
        ]

    def departed_nodes(self) -> list[NodeInfo]:
        """Contacts that left the table after failures (not since seen again), oldest first."""
        return list(self._departed.values())

    def has_departed(self, peer_id: PeerID) -> bool:
        """Whether ``peer_id`` left the table after failures and was not seen since."""
        return peer_id in self._departed

    def quiet_contacts(self, since: float) -> list[NodeInfo]:
        """Contacts last heard from before ``since``, least recently seen first."""
        quiet = [
            contact
            for index in self._nonempty
            for contact in self._buckets[index].contacts.values()
            if contact.last_seen < since
        ]
        quiet.sort(key=lambda contact: contact.last_seen)
        return [contact.node for contact in quiet]

    def heard_from_since(self, since: float) -> bool:
        """Whether some contact was heard from at ``since`` or later."""
        return any(
            contact.last_seen >= since
            for index in self._nonempty
            for contact in self._buckets[index].contacts.values()
        )

    def nearest(self, target: int, count: int, exclude: PeerID | None = None) -> list[NodeInfo]:
        """Up to ``count`` contacts closest to ``target`` by XOR distance, closest first."""
        # Relative to the target, bucket b = bucket_index(target) holds every contact
        # closer than 2**b, buckets below b lie together in [2**b, 2**(b+1)), and each
        # bucket j above b lies in [2**j, 2**(j+1)): visit them in that order.
        b = self.local_id.bucket_index(target)
        buckets = self._buckets
        chosen: list[_Contact] = []
        if b >= 0:
            chosen.extend(buckets[b].contacts.values())
        below = [j for j in self._nonempty if j < b]
        if len(chosen) <= count and below:
            for j in below:
                chosen.extend(buckets[j].contacts.values())
        chosen.sort(key=lambda c: c.id ^ target)
        for j in self._nonempty:
            if len(chosen) > count:
                break
            if j > b:
                chosen.extend(sorted(buckets[j].contacts.values(), key=lambda c: c.id ^ target))
        result = [c.node for c in chosen[: count + 1] if c.node.peer_id != exclude]
        return result[:count]

    # ---- updates ---------------------------------------------------------------------

    def update(self, node: NodeInfo, now: float) -> NodeInfo | None:
        """Record a verified contact with ``node``.

        Returns:
            The least-recently-seen contact of ``node``'s bucket when that bucket is full
            and no ping of it is pending yet: ping it, then call :meth:`ping_result`.
        """
        if node.address is None:
            return None
        node_id = DHTID.from_peer_id(node.peer_id)
        index = self.local_id.bucket_index(node_id)
        if index < 0:
            return None
        bucket = self._buckets[index]
        bucket.last_active = now
        contact = bucket.contacts.get(node.peer_id)
        if contact is not None:
            contact.node = node
            contact.failures = 0
            contact.last_seen = now
            bucket.contacts.move_to_end(node.peer_id)
            return None
        if len(bucket.contacts) < self.k:
            bucket.replacements.pop(node.peer_id, None)
            self._add(index, _Contact(node, node_id, now))
            return None
        bucket.replacements.pop(node.peer_id, None)
        bucket.replacements[node.peer_id] = _Contact(node, node_id, now)
        while len(bucket.replacements) > self.replacement_cache_size:
            bucket.replacements.popitem(last=False)
        oldest = next(iter(bucket.contacts.values()))
        if bucket.pending_ping is not None or now - oldest.last_seen < self.ping_after:
            return None
        bucket.pending_ping = oldest.node.peer_id
        return oldest.node

    def ping_result(self, peer_id: PeerID, alive: bool | None, now: float) -> None:
        """Report the outcome of a ping asked for by :meth:`update` (None: no answer, but
        its bytes kept coming: the contact stays as it was, neither refreshed nor evicted)."""
        index = self._bucket_of(peer_id)
        bucket = self._buckets[index]
        if bucket.pending_ping == peer_id:
            bucket.pending_ping = None
        contact = bucket.contacts.get(peer_id)
        if contact is None or alive is None:
            return
        if alive:
            self.update(contact.node, now)
        else:
            self._evict(index, peer_id)

    def record_failure(
        self, peer_id: PeerID, *, timed_out: bool = False, unreachable: bool = False
    ) -> bool:
        """A request to ``peer_id`` failed: refused, broken or malformed, or ``timed_out``,
        or ``unreachable`` (a refused dial, or the connection broke under it).

        Returns:
            True when the contact stays but should be pinged now (it was ``unreachable``
            and a replacement waits, or its failures reached ``max_failures``): ping it,
            then call :meth:`ping_result`.
        """
        index = self._bucket_of(peer_id)
        bucket = self._buckets[index]
        if not timed_out:
            bucket.replacements.pop(peer_id, None)
        contact = bucket.contacts.get(peer_id)
        if contact is None:
            return False
        if unreachable:
            # a ping decides (see the module's rules), where a replacement waits or
            # max_failures is reached: one reset fails every call in flight on the
            # connection at once, and three of them counted to max_failures evicted a
            # live contact all the same (a review of the fix)
            if bucket.replacements:
                return True
            contact.failures += 1
            return contact.failures >= self.max_failures
        contact.failures += 1
        if contact.failures >= self.max_failures or (bucket.replacements and not timed_out):
            self._evict(index, peer_id)
        return False

    def remove(self, peer_id: PeerID) -> None:
        """Forget ``peer_id`` (contact or replacement); a replacement takes its place."""
        index = self._bucket_of(peer_id)
        self._buckets[index].replacements.pop(peer_id, None)
        if peer_id in self._buckets[index].contacts:
            self._evict(index, peer_id)

    def _evict(self, index: int, peer_id: PeerID) -> None:
        bucket = self._buckets[index]
        contact = bucket.contacts.pop(peer_id)
        del self._index[peer_id]
        self._departed.pop(peer_id, None)
        self._departed[peer_id] = contact.node
        if len(self._departed) > DEPARTED_MEMORY:
            self._departed.popitem(last=False)
        if self.on_departed is not None:
            self.on_departed(contact.node)
        if bucket.pending_ping == peer_id:
            bucket.pending_ping = None
        if bucket.replacements:
            _, replacement = bucket.replacements.popitem(last=True)
            self._add(index, replacement)
            if self.on_promoted is not None:
                self.on_promoted(replacement.node)
        elif not bucket.contacts:
            self._nonempty.remove(index)
        if not self._index and self.on_emptied is not None:
            self.on_emptied(contact.node)

    def _add(self, index: int, contact: _Contact) -> None:
        contacts = self._buckets[index].contacts
        if not contacts:
            bisect.insort(self._nonempty, index)
        contacts[contact.node.peer_id] = contact
        self._index[contact.node.peer_id] = index
        self._departed.pop(contact.node.peer_id, None)

    def _bucket_of(self, peer_id: PeerID) -> int:
        index = self._index.get(peer_id)
        if index is None:
            index = self.local_id.bucket_index(DHTID.from_peer_id(peer_id))
        return max(index, 0)

    # ---- refresh ---------------------------------------------------------------------

    def mark_lookup(self, target: int, now: float) -> None:
        """A lookup of ``target`` ran: its bucket counts as refreshed at ``now``."""
        index = self.local_id.bucket_index(target)
        if index >= 0:
            self._buckets[index].last_active = now

    def stale_buckets(self, now: float, interval: float) -> list[int]:
        """Buckets to refresh, farthest first: those with neither a lookup into their range
        nor a contact seen in them for ``interval`` seconds (BEP 5's rule: traffic keeps
        buckets fresh, refresh lookups are for quiet ranges).

        Only buckets above the closest non-empty one count: the closer ones are covered by
        the lookup of our own id.
        """
        if not self._nonempty:
            return []
        return [
            i
            for i in range(ID_BITS - 1, self._nonempty[0], -1)
            if now - self._buckets[i].last_active >= interval
        ]

    def random_id_in_bucket(self, index: int, rng: random.Random) -> DHTID:
        """A random id whose distance from us falls in bucket ``index``."""
        offset = (1 << index) | rng.getrandbits(index) if index > 0 else 1
        return DHTID(int(self.local_id) ^ offset)
