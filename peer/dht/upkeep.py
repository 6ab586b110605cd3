"""The DHT's upkeep: refreshes that re-dial missing initial peers, ping quiet contacts and
look up stale buckets; departed contacts pinged again soon after they left; far buckets
filled right after a join. A part of :class:`peer.dht.node.DHT`, kept apart from its lookups
and records.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from protocol.dhtid import DHTID
from protocol.identity import PeerID
from protocol.messages import NodeInfo

from .routing import DEPARTED_MEMORY

if TYPE_CHECKING:
    from .node import DHT

logger = logging.getLogger(__name__)

_RECONTACTS_PER_REFRESH = 8  # departed contacts a refresh pings (see Upkeep.refresh)
# A contact that left the table is pinged again 2 s after, then 3 s after that silence and
# 1.5x as long after each next one, up to once a minute, for half an hour (refreshes take
# over then): 36 pings for a peer that is really gone (see Upkeep.recontact_soon)
_RECONTACT_FIRST = 2.0
_RECONTACT_SECOND = 3.0
_RECONTACT_GROWTH = 1.5
_RECONTACT_MAX_DELAY = 60.0
_RECONTACT_FOR = 1800.0
_RECONTACTS_AT_ONCE = 8


class Upkeep:
    """What keeps a :class:`DHT`'s routing table true as peers come, go and fall silent."""

    def __init__(self, dht: DHT) -> None:
        self._dht = dht
        # departed contact -> (when to ping it next, the delay after that, the contact,
        # when it left); see recontact_soon
        self._recontacts: dict[PeerID, tuple[float, float, NodeInfo, float]] = {}
        self._recontact_added = trio.Event()

    def on_departed(self, node: NodeInfo) -> None:
        """``node`` left the routing table: ping it again soon (see :meth:`recontact_soon`)."""
        self._recontacts.pop(node.peer_id, None)  # (newest last: the oldest go first)
        now = trio.current_time()
        self._recontacts[node.peer_id] = (now + _RECONTACT_FIRST, _RECONTACT_SECOND, node, now)
        while len(self._recontacts) > DEPARTED_MEMORY:
            del self._recontacts[next(iter(self._recontacts))]
        self._recontact_added.set()

    async def recontact_soon(self) -> None:
        """Ping each contact that left the table 2, 5, 9.5, 16, 26, 42, 64, 99 and 150 s
        after it left, then every 60 s, for 30 minutes: one that answers comes back (and
        learns us). After a partition heals, both sides had dropped each other and met
        again only at the next refresh, up to 10 minutes later: averaging stayed split that
        long (tests/training/test_averaging_bad_networks.py). With pings only 2, 10, 42,
        170 and 682 s after a contact left, 30 peers split for 5 minutes stayed split for
        4 minutes after the heal; with 2, 10, 42 s, then every minute, a link down for 20 s
        kept its peer out of the DHT for 25 s more (an outside tester's proxy). Each wait
        is now at most about two thirds of the time since the contact left, so a split
        heals within about two thirds of its length after its end (a minute at most), the
        ping's own time aside. A peer that is really gone costs 36 failed pings (a refused
        dial, or a timeout outside the request slots), about one a minute. At most 8 run at
        once, each freeing its slot as it ends (in batches that waited for their slowest,
        the others' slots stood idle), the longest due first; a ping task is started only
        for a free slot (a queue of tasks grew without bound while departures came faster
        than silent contacts' pings ended)."""
        slots = trio.Semaphore(_RECONTACTS_AT_ONCE)
        pinging: set[PeerID] = set()
        async with trio.open_nursery() as nursery:
            while True:
                first = min(
                    (when for p, (when, _, _, _) in self._recontacts.items() if p not in pinging),
                    default=math.inf,
                )
                with trio.move_on_at(first):
                    await self._recontact_added.wait()
                self._recontact_added = trio.Event()
                now = trio.current_time()
                due = sorted(
                    (when, peer_id)
                    for peer_id, (when, _, _, _) in self._recontacts.items()
                    if when <= now and peer_id not in pinging
                )
                for _, peer_id in due:
                    await slots.acquire()  # a task only for a free slot: no queue of tasks
                    entry = self._recontacts.pop(peer_id, None)
                    if entry is None or not self._dht.table.has_departed(peer_id):
                        slots.release()
                        continue  # back already, or forgotten (while we waited for the slot)
                    _, delay, node, left = entry
                    now = trio.current_time()
                    if now + delay <= left + _RECONTACT_FOR:
                        after = min(delay * _RECONTACT_GROWTH, _RECONTACT_MAX_DELAY)
                        self._recontacts[peer_id] = (now + delay, after, node, left)
                    pinging.add(peer_id)
                    nursery.start_soon(self._recontact, slots, pinging, node)

    async def _recontact(self, slots: trio.Semaphore, pinging: set[PeerID], node: NodeInfo) -> None:
        try:
            await self._dht.protocol.ping(node, take_slot=False)
        finally:
            slots.release()
            pinging.discard(node.peer_id)
            self._recontact_added.set()  # its next ping may be due already

    async def _recontact_departed(self) -> None:
        """Ping a few contacts that left the table after failures (our former neighbours
        first, then some at random): one that answers comes back, and learns us."""
        departed = sorted(
            self._dht.table.departed_nodes(),
            key=lambda n: DHTID.from_peer_id(n.peer_id) ^ self._dht.node_id,
        )
        half = _RECONTACTS_PER_REFRESH // 2
        rest = departed[half:]
        chosen = departed[:half] + self._dht._rng.sample(rest, min(len(rest), half))
        async with trio.open_nursery() as nursery:
            for node in chosen:
                nursery.start_soon(self._dht.protocol.ping, node)

    async def refresh_far_buckets(self) -> None:
        """After joining, look up a random id in every bucket farther than our closest
        neighbour (the Kademlia paper's join, section 2.3): the lookup of our own id fills
        the near buckets only, and a far bucket left empty until the first refresh pass
        (10 minutes) keeps every lookup of a key in that range inside our half of the
        network (1,000 peers: 2 of 300 keys stored there, and not found)."""
        now = trio.current_time()
        stale = self._dht.table.stale_buckets(now, self._dht.config.refresh_interval)
        async with trio.open_nursery() as nursery:
            for index in stale:
                target = self._dht.table.random_id_in_bucket(index, self._dht._rng)
                nursery.start_soon(self._dht.find_nodes, target)

    async def refresh(self) -> None:
        """One maintenance round: drop expired records, re-contact initial peers missing
        from the table (heals partitions), ping quiet contacts and drop those that do not
        answer, look up our own id, refresh stale buckets.

        Raises:
            Nothing for unreachable peers (they are dropped from the table in time).
        """
        if self._dht.storage is not None:
            self._dht.storage.expire()
        await self._dht._joining.redial_missing()
        await self._recontact_departed()
        await self.drop_silent_contacts()
        await self._dht.find_nodes(self._dht.node_id)
        now = trio.current_time()
        for index in self._dht.table.stale_buckets(now, self._dht.config.refresh_interval):
            await self._dht.find_nodes(self._dht.table.random_id_in_bucket(index, self._dht._rng))

    async def drop_silent_contacts(self) -> int:
        """Ping every contact not heard from for ``ping_after`` seconds (BEP 5's
        "questionable" nodes) and remove those that do not answer, unless no contact at all
        answered or was heard from in that time (then this node is the one cut off, and
        failed pings only count as failures). A replacement that takes a removed contact's
        place and is quiet too is pinged in the same pass.

        A peer that went quiet before it died (its connections had idled out) ends no
        connection in use, so nothing pings it; in a bucket that other contacts keep busy
        no bucket refresh asks it, and lookups of far ids never do: it stayed in a
        bootstrap node's table, and in its answers to newcomers, for hours (a soak of 100
        peers, 70 killed: 9 still listed 4 hours later). Now it leaves at the next refresh
        (every ``refresh_interval``), costing one ping per quiet contact per refresh.

        Returns:
            How many contacts were removed.

        Raises:
            Nothing for unreachable peers: that is what it looks for.
        """
        since = trio.current_time() - self._dht.config.ping_after
        pinged: set[PeerID] = set()
        removed = 0
        while True:
            quiet = [n for n in self._dht.table.quiet_contacts(since) if n.peer_id not in pinged]
            pinged.update(n.peer_id for n in quiet)
            silent = await self._unanswered_pings(quiet)
            if not silent or not self._dht.table.heard_from_since(since):
                return removed
            for node in silent:
                if node.peer_id in self._dht.table:  # (a failed ping may have evicted it already)
                    self._dht.table.remove(node.peer_id)
                    self._dht.protocol.note_left(node, self._dht.protocol.ping_failure(node))
                    removed += 1

    async def _unanswered_pings(self, nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
        """Ping ``nodes``; those that did not answer (an answer refreshes its contact)."""
        silent: list[NodeInfo] = []
        limiter = trio.CapacityLimiter(self._dht.config.max_parallel_pings)

        async def one(node: NodeInfo) -> None:
            async with limiter:
                if not await self._dht.protocol.ping(node):
                    silent.append(node)

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(one, node)
        return silent
