"""The DHT node: store and get, lookups, bootstrap, and the maintenance that keeps it healthy.

    dht = DHT(host, identity, DHTConfig(), sender="10.0.0.1:4000")
    async with trio.open_nursery() as nursery:
        await nursery.start(dht.serve)          # pings, bucket refresh, republish
        await dht.bootstrap([Address.parse("PEERID@10.0.0.2:4000")])
        await dht.store("run/progress", {"epoch": 3}, ttl=30.0, subkey=str(identity.peer_id))
        await dht.get("run/progress")           # {"<peer id>": {"epoch": 3}}

Values are msgpack-serialized user values. A STORE goes to the k closest nodes that
answered a lookup of the key (and to ourselves when we are among them); each STORE
reply names the callee's closest contacts, so the stores are the lookup's own RPCs. A
GET asks the closest nodes first and merges what the first ``value_quorum`` holders of
the key answer (the paper's FIND_VALUE ends at the first holder), so it sees every subkey
and the newest version of each unless all of those holders missed a store. Owners
re-store what they stored while it lives (see ``republish``).
"""

from __future__ import annotations

import heapq
import logging
import math
import numbers
import random
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import msgpack
import trio

from protocol.address import Address
from protocol.dhtid import DHTID
from protocol.errors import SwarmError
from protocol.identity import Identity, PeerID
from protocol.messages import Entry, NodeInfo
from protocol.noise import IdentityMismatchError
from protocol.records import (
    MAX_ENTRIES_PER_STORE,
    MAX_SUBKEYS_PER_KEY,
    MAX_TTL,
    RecordError,
    Subkey,
    check_key,
    decode_value,
    key_owner,
    owner_of,
    sign_entry,
    subkey_order,
    validate_entry,
)

from ..errors import DuplicateIdentityError, PeerBusyError, PeerStoppedError, SelfDialError
from ..host import RpcHost
from .config import DHTConfig
from .lookup import MIN_HEDGE_DELAY, LookupResult, Query, iterative_lookup
from .protocol import DHTProtocol
from .routing import DEPARTED_MEMORY, RoutingTable
from .storage import DHTStorage, Record, merge_entry, supersedes

logger = logging.getLogger(__name__)

_REPUBLISH_PARALLEL = 4
_EXPIRE_INTERVAL = 30.0  # seconds between sweeps of expired records
_HANDOVER_QUEUE = 64
_FIRST_ANSWERS_KEPT = 32  # recent lookups' first-answer delays, for the first hedge
_HANDOVER_MAX_KEYS = 10_000  # a handover scans every key we hold, once per new contact
# The closest holders of a key that hand it to a newcomer: more than one, because the
# closest may not know the newcomer, or may not hold the key yet (its own handover is
# still on the way when the newcomer meets it).
_HANDOVER_SENDERS = 3
_BACKGROUND_STORES = 32  # stores re-sent after their lookup gave up on them, at once
_CONTACT_AT_ONCE = 32  # known contacts dialed at once (see DHT.contact)
_HANDOVER_PARALLEL = 8  # STOREs in flight to one newcomer (a round trip each, one key each)
_HANDOVER_NEWCOMERS = 4  # newcomers served at once
# A key holds at most 1024 subkeys of 16 KiB: 17 replies of 1 MiB; a node that keeps
# saying "more" gets no further than this.
_MAX_VALUE_PAGES = 32
_OWN_ADDRESS = "that is this peer's own address"
_RECONTACTS_PER_REFRESH = 8  # departed contacts a refresh pings (see refresh)
# A contact that left the table is pinged again this long after, then 4x as long after
# each silence, until the next delay would pass refresh_interval (refreshes take over):
# 5 pings in 10 minutes (see DHT._recontact_soon)
_RECONTACT_FIRST = 2.0
_RECONTACT_GROWTH = 4.0
_RECONTACTS_AT_ONCE = 8
# Initial peers that turned us away as busy (their limits for our address, which a crowd
# behind our NAT joining at once uses up) are dialed again after a mean delay of this
# much, doubling up to _BUSY_RETRY_MAX, each delay jittered by x0.5-1.5 so that the crowd
# spreads out (the limit refills at 16 connections per second).
_BUSY_RETRY_FIRST = 0.5
_BUSY_RETRY_MAX = 4.0
_LATER = 1e-6  # seconds one of our stores must outlast our last one by (float noise aside)


@dataclass(frozen=True, slots=True)
class EntriesRead:
    """What a read of a key found (:meth:`DHT.read_entries`)."""

    entries: dict[Subkey, tuple[Any, float]]  # as get_entries returns them
    asked: int  # other nodes asked (0: this node's own copy was enough)
    answered: int  # of them, those whose whole copy came (asked but none answered: the
    # entries are only what this node stores itself, nothing for a client)


@dataclass(slots=True)
class LookupStats:
    """Counters over this node's lookups (tests and benchmarks read them)."""

    lookups: int = 0
    total_rounds: int = 0
    max_rounds: int = 0

    def record(self, result: LookupResult) -> None:
        self.lookups += 1
        self.total_rounds += result.rounds
        self.max_rounds = max(self.max_rounds, result.rounds)


class DHT:
    """One Kademlia node on an RPC host. Construct, then run :meth:`serve` in a nursery."""

    def __init__(
        self,
        host: RpcHost,
        identity: Identity,
        config: DHTConfig | None = None,
        *,
        sender: str | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``sender``: our routable ``HOST:PORT`` (None in client mode); ``clock``: unix time.

        Raises:
            ValueError: if ``sender`` is None outside client mode.
        """
        self.config = config = config or DHTConfig()
        if sender is None and not config.client_mode:
            raise ValueError("a DHT node that is not in client mode needs a sender address")
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        self.node_id = DHTID.from_peer_id(self.peer_id)
        self.table = RoutingTable(
            self.node_id, config.k, max_failures=config.max_failures, ping_after=config.ping_after
        )
        self.storage: DHTStorage | None = None
        if not config.client_mode:
            self.storage = DHTStorage(
                clock=clock,
                max_keys=config.max_stored_keys,
                max_bytes=config.max_stored_bytes,
                max_share_per_source=config.max_stored_share_per_host,
            )
        self.protocol = DHTProtocol(
            host, self.table, self.storage, config, sender=None if config.client_mode else sender
        )
        self.protocol.register()
        # New contacts whose keys we may hold, for the handover task (bounded: a burst of
        # joins drops some, and republish covers those).
        self._newcomers_send, self._newcomers = trio.open_memory_channel[NodeInfo](_HANDOVER_QUEUE)
        if self.storage is not None:
            self.protocol.on_new_contact = self._on_new_contact
        host.on_connection_lost = self.protocol.check_alive
        self.host = host
        self.stats = LookupStats()
        # seconds to the first answer of recent lookups: the silence before a lookup's
        # first answer that means a frozen node (else hedge_after for each, in turn)
        self._first_answers: deque[float] = deque(maxlen=_FIRST_ANSWERS_KEPT)
        self._clock = clock
        self._rng = random.Random(self.peer_id.raw)
        self._initial_peers: list[Address] = []
        # initial peers that did not answer at the last contact -> why (for error messages)
        self.contact_errors: dict[str, str] = {}
        self._twins: set[str] = set()  # initial peers that proved our own PeerID
        # initial peers whose address proved another PeerID, each said once (with it)
        self._changed_identities: set[tuple[str, PeerID]] = set()
        # (key id, subkey) -> (key text, entry) of what this node stored, to republish
        self._published: OrderedDict[tuple[DHTID, Subkey], tuple[str, Entry]] = OrderedDict()
        # (key id, subkey) -> (expiration, the same on trio's clock) of our latest store
        # there (see _carry_over)
        self._stamped: OrderedDict[tuple[DHTID, Subkey], tuple[float, float]] = OrderedDict()
        self._service: trio.Nursery | None = None  # serve()'s nursery, while it runs
        self._background_stores = 0
        # departed contact -> (when to ping it next, the delay after that); see
        # _recontact_soon
        self._recontacts: dict[PeerID, tuple[float, float, NodeInfo]] = {}
        self._recontact_added = trio.Event()
        self.table.on_departed = self._on_departed

    def now(self) -> float:
        """The unix time this node stamps expirations with (its injected clock)."""
        return self._clock()

    # ---- service ---------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the maintenance tasks until cancelled: pings of full buckets' oldest
        contacts, bucket refresh every ``refresh_interval``, republish every
        ``republish_interval``."""
        try:
            async with trio.open_nursery() as nursery:
                self._service = nursery
                nursery.start_soon(self.protocol.run_pings)
                nursery.start_soon(self._every, self.config.refresh_interval, self.refresh)
                nursery.start_soon(self._every, self.config.republish_interval, self.republish)
                nursery.start_soon(self._every, _EXPIRE_INTERVAL, self._expire)
                nursery.start_soon(self._hand_over_to_newcomers)
                nursery.start_soon(self._recontact_soon)
                task_status.started()
        finally:
            self._service = None

    async def _every(self, interval: float, job: Callable[[], Any]) -> None:
        while True:
            await trio.sleep(interval * self._rng.uniform(0.9, 1.1))
            try:
                await job()
            except SwarmError:
                logger.warning("DHT maintenance %s failed", job.__name__, exc_info=True)

    async def _expire(self) -> None:
        """Free the records that expired: stores and refreshes do it too, but a node that
        nobody stores to held expired records for up to ``refresh_interval`` (10 minutes:
        a bootstrap node's memory stayed at its churn peak that long)."""
        if self.storage is not None:
            self.storage.expire()
        await trio.lowlevel.checkpoint()

    async def bootstrap(self, initial_peers: Sequence[Address], *, warn: bool = True) -> int:
        """Join through ``initial_peers``: ping them, then look up our own id.

        The join goes on as soon as one of them answered; the others are still dialed in
        the background (see ``_contact``). When none answered but some turned us away as
        busy, those are dialed again with jittered exponential backoff until one answers;
        no new try starts after ``busy_join_timeout`` (each one is bounded by
        ``request_timeout``).

        Args:
            warn: log a warning naming each initial peer when none answered (off when the
                caller raises that instead).

        Returns:
            How many initial peers had answered when the join went on (0: we are alone,
            e.g. the first node).

        Raises:
            Nothing for unreachable peers: they count as not answering.
        """
        deadline = trio.current_time() + self.config.busy_join_timeout
        self._initial_peers = list(dict.fromkeys(initial_peers))  # each one contacted once
        reached, busy = await self._contact(self._initial_peers, until_one=True)
        if not reached and busy and self.config.busy_join_timeout > 0:
            reached = await self._retry_busy(busy, deadline)
        if reached:
            await self.find_nodes(self.node_id)
            await self._refresh_far_buckets()
        else:
            # our own address among them is no failure (the same list on every host)
            others = [  # (a twin, another process with our key, is worth the warning)
                a
                for a in self._initial_peers
                if self.contact_errors.get(str(a)) != _OWN_ADDRESS
                and (a.peer_id != self.peer_id or str(a) in self._twins)
            ]
            if others and warn:
                tried = "; ".join(
                    f"{a}: {self._said(str(a)) or self.contact_errors.get(str(a), '?')}"
                    for a in others
                )
                logger.warning("no initial peer answered (tried %s)", tried)
        return reached

    async def contact(self, addresses: Sequence[Address]) -> list[Address]:
        """Dial and ping each of ``addresses`` (those with our own PeerID, or one already in
        the routing table, skipped), at most ``_CONTACT_AT_ONCE`` at a time, each dial
        within the host's ``dial_timeout`` and its ping within ``request_timeout``: those
        that answer join the routing table and learn our address. Then, if any answered,
        look up our own id, as a join does. For contacts known from before, such as a
        restarted bootstrap node's saved ones (``peer.contacts``): unlike initial peers,
        one that does not answer is said at DEBUG only and never tried again here.

        Returns:
            Those that answered.
        """
        self._check_running()
        answered: list[Address] = []
        limiter = trio.CapacityLimiter(_CONTACT_AT_ONCE)

        async def one(address: Address) -> None:
            async with limiter:  # (held while the dial runs: a dial outlives no waiter here)
                try:
                    peer_id = await self.host.connect(address)
                except (SwarmError, OSError) as exc:
                    logger.debug("contact %s: %r", address, exc)
                    return
                if peer_id != self.peer_id and await self.protocol.ping(
                    NodeInfo(peer_id, address.hostport)
                ):
                    answered.append(address)

        # (one in the table already is skipped: at an old address, the call would reach it
        # over its pooled connection, answer, and put that address back in the table)
        wanted = [
            a
            for a in dict.fromkeys(addresses)
            if a.peer_id != self.peer_id and (a.peer_id is None or a.peer_id not in self.table)
        ]
        async with trio.open_nursery() as nursery:
            for address in wanted:
                nursery.start_soon(one, address)
        if answered:
            await self.find_nodes(self.node_id)
        return answered

    async def _retry_busy(self, busy: list[Address], deadline: float) -> int:
        """Dial the initial peers in ``busy`` again, backing off, until one answers, none
        is busy any more, or the next try would start after ``deadline`` (trio time).

        Returns:
            How many answered at the try that ended it (0: none did).
        """
        logger.info(
            "initial peers busy (at their connection limits for our address, as when many"
            " peers behind one NAT join at once): trying %s again for up to %.0f s",
            ", ".join(str(a) for a in busy),
            max(deadline - trio.current_time(), 0.0),
        )
        started, tries, delay = trio.current_time(), 1, _BUSY_RETRY_FIRST
        while busy:
            wait = delay * self._rng.uniform(0.5, 1.5)
            if trio.current_time() + wait > deadline:
                break
            await trio.sleep(wait)
            delay = min(2 * delay, _BUSY_RETRY_MAX)
            tries += 1
            reached, busy = await self._contact(busy, until_one=True)
            if reached:
                logger.debug("joined after %d tries", tries)
                return reached
        elapsed = trio.current_time() - started
        for address in busy:  # the final error says how long they stayed busy
            key = str(address)
            self.contact_errors[key] = (
                f"busy at each of {tries} tries over {elapsed:.0f} s: {self.contact_errors[key]}"
            )
        return 0

    async def _contact(
        self, addresses: Sequence[Address], *, until_one: bool = False
    ) -> tuple[int, list[Address]]:
        """Dial and ping each of ``addresses`` (``contact_errors`` says why one failed).

        ``until_one``: return once one answered; the others go on in the service nursery
        (each within ``request_timeout``), and those that answer join the routing table.
        A silent one (it accepts connections and never answers: a hung process, a proxy
        that black-holes) held every join up for the whole ``request_timeout``.

        Returns:
            How many had answered by then, and those that turned us away as busy
            (PeerBusyError).
        """
        reached = 0
        busy: list[Address] = []
        pending = len(addresses)
        settled = trio.Event()  # every one is done, or (until_one) one answered

        async def one(address: Address) -> None:
            nonlocal pending
            try:
                await dial(address)
            finally:
                pending -= 1
                if not pending or (until_one and reached):
                    settled.set()

        async def dial(address: Address) -> None:
            nonlocal reached
            key = str(address)
            self.contact_errors[key] = f"no answer within {self.config.request_timeout} s"
            with trio.move_on_after(self.config.request_timeout):
                try:  # (a pooled connection is reused; a new one proves the id)
                    peer_id = await self.host.connect(address)
                except DuplicateIdentityError as exc:  # another process with our key
                    self.contact_errors[key] = str(exc)
                    self._twins.add(key)
                    return
                except SelfDialError:  # our own HOST:PORT, given without a PeerID
                    self.contact_errors[key] = _OWN_ADDRESS
                    return
                except PeerBusyError as exc:  # up, but not now: bootstrap tries it again
                    logger.debug("initial peer %s: %r", address, exc)
                    self.contact_errors[key] = str(exc)
                    busy.append(address)
                    return
                except (SwarmError, OSError) as exc:
                    logger.debug("initial peer %s: %r", address, exc)
                    self.contact_errors[key] = str(exc) or type(exc).__name__
                    if (mismatch := _cause_of_type(exc, IdentityMismatchError)) is not None:
                        self._identity_changed(key, address, mismatch)
                    return
                if peer_id == self.peer_id:
                    self.contact_errors[key] = _OWN_ADDRESS
                    return
                if await self.protocol.ping(NodeInfo(peer_id, address.hostport)):
                    reached += 1
                    self.contact_errors.pop(key, None)  # (the same address given twice)
                else:
                    self.contact_errors[key] = "no answer to a ping"

        background = self._service if until_one else None
        if background is None:  # (or bootstrap() before serve(): all of them, as before)
            async with trio.open_nursery() as nursery:
                for address in addresses:
                    nursery.start_soon(one, address)
        elif addresses:
            for address in addresses:
                background.start_soon(one, address)
            await settled.wait()
        return reached, list(busy)

    def _said(self, key: str) -> str:
        """A short stand-in for an initial peer's error already logged in full (the
        changed identity), so that a summary does not repeat ~300 characters."""
        if any(warned == key for warned, _ in self._changed_identities):
            return "answers with another identity (the warning above)"
        return ""

    def _identity_changed(self, key: str, address: Address, exc: IdentityMismatchError) -> None:
        """An initial peer's address proved another identity: its node lost its key file
        (or another program took its port). Said once per address and identity, at
        WARNING, since it is re-tried at every refresh and nothing else would tell (a
        trial: volunteers given a restarted bootstrap's old address never found it again,
        and only DEBUG said why)."""
        hostport = address.hostport
        text = (
            f"{hostport} now answers with another identity, {exc.actual}, not {exc.expected}:"
            f" that node lost its key file (or another program took its port); give"
            f" {exc.actual}@{hostport}, or {hostport} to accept any identity there"
        )
        self.contact_errors[key] = text
        if (key, exc.actual) not in self._changed_identities:
            if len(self._changed_identities) >= 1024:
                self._changed_identities.clear()
            self._changed_identities.add((key, exc.actual))
            logger.warning("initial peer %s: %s", address, text)

    async def _recontact_departed(self) -> None:
        """Ping a few contacts that left the table after failures (our former neighbours
        first, then some at random): one that answers comes back, and learns us."""
        departed = sorted(
            self.table.departed_nodes(),
            key=lambda n: DHTID.from_peer_id(n.peer_id) ^ self.node_id,
        )
        half = _RECONTACTS_PER_REFRESH // 2
        rest = departed[half:]
        chosen = departed[:half] + self._rng.sample(rest, min(len(rest), half))
        async with trio.open_nursery() as nursery:
            for node in chosen:
                nursery.start_soon(self.protocol.ping, node)

    def _on_departed(self, node: NodeInfo) -> None:
        self._recontacts.pop(node.peer_id, None)  # (newest last: the oldest go first)
        due = trio.current_time() + _RECONTACT_FIRST
        self._recontacts[node.peer_id] = (due, _RECONTACT_FIRST * _RECONTACT_GROWTH, node)
        while len(self._recontacts) > DEPARTED_MEMORY:
            del self._recontacts[next(iter(self._recontacts))]
        self._recontact_added.set()

    async def _recontact_soon(self) -> None:
        """Ping each contact that left the table 2 s after it left, then 8, 32, 128 and
        512 s after each silence (while the delay stays within ``refresh_interval``): one
        that answers comes back (and learns us). After a partition heals, both sides had
        dropped each other and met again only at the next refresh, up to 10 minutes later:
        averaging stayed split that long (tests/training/test_averaging_bad_networks.py).
        A peer that is really gone costs 5 failed pings (a refused dial, or a timeout
        outside the request slots)."""
        while True:
            first = min((due for due, _, _ in self._recontacts.values()), default=math.inf)
            with trio.move_on_at(first):
                await self._recontact_added.wait()
            self._recontact_added = trio.Event()
            now = trio.current_time()
            due = [p for p, (when, _, _) in self._recontacts.items() if when <= now]
            async with trio.open_nursery() as nursery:
                for peer_id in due[:_RECONTACTS_AT_ONCE]:
                    _, delay, node = self._recontacts.pop(peer_id)
                    if not self.table.has_departed(peer_id):
                        continue  # back already, or forgotten
                    if delay <= self.config.refresh_interval:
                        self._recontacts[peer_id] = (now + delay, delay * _RECONTACT_GROWTH, node)
                    nursery.start_soon(partial(self.protocol.ping, take_slot=False), node)

    async def _refresh_far_buckets(self) -> None:
        """After joining, look up a random id in every bucket farther than our closest
        neighbour (the Kademlia paper's join, section 2.3): the lookup of our own id fills
        the near buckets only, and a far bucket left empty until the first refresh pass
        (10 minutes) keeps every lookup of a key in that range inside our half of the
        network (1,000 peers: 2 of 300 keys stored there, and not found)."""
        now = trio.current_time()
        stale = self.table.stale_buckets(now, self.config.refresh_interval)
        async with trio.open_nursery() as nursery:
            for index in stale:
                target = self.table.random_id_in_bucket(index, self._rng)
                nursery.start_soon(self.find_nodes, target)

    async def refresh(self) -> None:
        """One maintenance round: drop expired records, re-contact initial peers missing
        from the table (heals partitions), ping quiet contacts and drop those that do not
        answer, look up our own id, refresh stale buckets.

        Raises:
            Nothing for unreachable peers (they are dropped from the table in time).
        """
        if self.storage is not None:
            self.storage.expire()
        missing = [a for a in self._initial_peers if a.peer_id not in self.table]
        if missing:
            await self._contact(missing)
        await self._recontact_departed()
        await self.drop_silent_contacts()
        await self.find_nodes(self.node_id)
        now = trio.current_time()
        for index in self.table.stale_buckets(now, self.config.refresh_interval):
            await self.find_nodes(self.table.random_id_in_bucket(index, self._rng))

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
        since = trio.current_time() - self.config.ping_after
        pinged: set[PeerID] = set()
        removed = 0
        while True:
            quiet = [n for n in self.table.quiet_contacts(since) if n.peer_id not in pinged]
            pinged.update(n.peer_id for n in quiet)
            silent = await self._unanswered_pings(quiet)
            if not silent or not self.table.heard_from_since(since):
                return removed
            for node in silent:
                if node.peer_id in self.table:  # (a failed ping may have evicted it already)
                    self.table.remove(node.peer_id)
                    why = self.protocol.ping_failure(node)
                    logger.info("peer left: %s (%s)", node.peer_id.short(), why)
                    removed += 1

    async def _unanswered_pings(self, nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
        """Ping ``nodes``; those that did not answer (an answer refreshes its contact)."""
        silent: list[NodeInfo] = []
        limiter = trio.CapacityLimiter(self.config.max_parallel_pings)

        async def one(node: NodeInfo) -> None:
            async with limiter:
                if not await self.protocol.ping(node):
                    silent.append(node)

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(one, node)
        return silent

    def _on_new_contact(self, node: NodeInfo) -> None:
        try:
            self._newcomers_send.send_nowait(node)
        except trio.WouldBlock:
            logger.debug("handover queue full: %s waits for republish", node.peer_id.short())

    async def _hand_over_to_newcomers(self) -> None:
        slots = trio.Semaphore(_HANDOVER_NEWCOMERS)  # the rest wait in the bounded queue

        async def one(node: NodeInfo) -> None:
            try:
                await self.hand_over(node)
            except SwarmError:
                logger.debug("handover to %s failed", node.peer_id.short(), exc_info=True)
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            async for node in self._newcomers:
                await slots.acquire()
                nursery.start_soon(one, node)

    async def hand_over(self, node: NodeInfo) -> int:
        """Store at ``node``, a new contact, the keys we hold for which it is among the k
        closest nodes we know, when we are among the ``_HANDOVER_SENDERS`` (3) closest to the
        key of the others (the paper's join rule, with a few senders per key, not all k).

        Returns:
            How many keys were handed over.

        Raises:
            Nothing for an unreachable node: what it does not get, republish brings.
        """
        if self.storage is None:
            return 0
        if len(self.storage) > _HANDOVER_MAX_KEYS:
            return 0  # one pass per newcomer would cost too much: republish covers it
        new_id = DHTID.from_peer_id(node.peer_id)
        # Counting the contacts closer to the key than us (or the newcomer) among all of
        # them decides as among the k + 1 nearest would (the thresholds are at most k),
        # without sorting the table or rehashing ids once per key (~5x less CPU).
        others = self.table.contact_ids(exclude=node.peer_id)
        k = self.config.k
        todo: list[tuple[DHTID, str]] = []
        for index, key_id in enumerate(self.storage.keys()):
            if index % 256 == 255:
                await trio.lowlevel.checkpoint()
            name = self.storage.name_of(key_id)
            if name is None:
                continue
            if should_hand_over(others, key_id, self.node_id, new_id, k):
                todo.append((key_id, name))
        sent = 0

        async def one(job: tuple[DHTID, str]) -> None:
            nonlocal sent
            assert self.storage is not None
            key_id, name = job
            entries = tuple(self.storage.get(key_id).values())
            for start in range(0, len(entries), MAX_ENTRIES_PER_STORE):
                chunk = entries[start : start + MAX_ENTRIES_PER_STORE]
                reply = await self.protocol.store(node, key_id, name, chunk, want_nodes=False)
                if reply is None:  # gone or unreachable: republish covers the rest
                    raise _NewcomerGone
            sent += bool(entries)

        try:
            await _each_bounded(todo, one, _HANDOVER_PARALLEL)
        except* _NewcomerGone:
            pass  # the other workers were cancelled with it
        if sent:
            logger.debug("handed %d keys over to %s", sent, node.peer_id.short())
        return sent

    async def republish(self) -> int:
        """Re-store the live records this node stored, to the nodes closest now.

        Returns:
            How many keys were republished.

        Raises:
            Nothing for unreachable peers: a record no node accepts waits for the next round.
        """
        now = self._clock()
        by_key: dict[str, list[Entry]] = {}
        for (key_id, subkey), (key, entry) in list(self._published.items()):
            if entry.expiration <= now + self.config.republish_margin:
                if entry.expiration <= now:
                    del self._published[key_id, subkey]
                continue
            by_key.setdefault(key, []).append(entry)

        async def one(job: tuple[str, list[Entry]]) -> None:
            key, entries = job
            for start in range(0, len(entries), MAX_ENTRIES_PER_STORE):
                chunk = tuple(entries[start : start + MAX_ENTRIES_PER_STORE])
                await self._store_entries(key, chunk)

        await _each_bounded(by_key.items(), one, _REPUBLISH_PARALLEL)
        return len(by_key)

    # ---- lookups ---------------------------------------------------------------------

    async def find_nodes(self, target: DHTID) -> LookupResult:
        """Iterative FIND_NODE: the (at most k) closest nodes to ``target`` that answered.

        Raises:
            Nothing for unreachable peers: they are left out of the result.
        """

        async def query(node: NodeInfo) -> Sequence[NodeInfo] | None:
            response = await self.protocol.find_node(node, target)
            return None if response is None else response.nodes

        return await self._lookup(target, query)

    async def _lookup(
        self,
        target: DHTID,
        query: Query,
        stop: Callable[[], bool] | None = None,
        wanted: Callable[[], int] | None = None,
        on_given_up: Callable[[NodeInfo], None] | None = None,
    ) -> LookupResult:
        self._check_running()
        # Twice k seeds: when some of the closest known are dead, the next ones take
        # their place instead of the lookup running dry.
        seeds = self.table.nearest(target, 2 * self.config.k)
        result = await iterative_lookup(
            target,
            seeds,
            query,
            k=self.config.k,
            alpha=self.config.alpha,
            exclude=self.peer_id,
            stop=stop,
            wanted=wanted,
            hedge_after=self.config.hedge_after,
            may_hedge=self.protocol.has_free_slot,
            on_given_up=on_given_up or self._given_up,
            max_in_flight=self.config.max_concurrent_requests,
            first_hedge=self._first_hedge(),
        )
        if result.first_answer_s is not None:
            self._first_answers.append(result.first_answer_s)
        self.table.mark_lookup(target, trio.current_time())
        self.stats.record(result)
        return result

    def _first_hedge(self) -> float | None:
        """Twice the median first-answer delay of recent lookups (at least 50 ms), or
        None before there are any (then ``hedge_after``)."""
        if not self._first_answers:
            return None
        return max(2 * statistics.median(self._first_answers), MIN_HEDGE_DELAY)

    def _check_running(self) -> None:
        self.host.check_loop()
        if self.host.stopped:  # the nursery is gone: no lookup could run, none may lie
            raise PeerStoppedError("this peer has stopped: its open_peer context has ended")

    def _given_up(self, node: NodeInfo) -> None:
        # A request outlasted a lookup's hedging: as a timeout (it counts toward
        # max_failures, so a frozen node leaves the table after a few lookups), unless the
        # node's bytes came lately (a busy link, not a frozen node: DHTProtocol's rules).
        if not self.protocol.heard_lately(node):
            self.protocol.record_failure(node, timed_out=True)

    def _among_closest(self, target: DHTID, closest: Sequence[NodeInfo]) -> bool:
        if len(closest) < self.config.k:
            return True
        farthest = DHTID.from_peer_id(closest[-1].peer_id)
        return self.node_id.distance(target) < farthest.distance(target)

    # ---- store and get ---------------------------------------------------------------

    async def store(self, key: str, value: Any, ttl: float = 60.0, subkey: Subkey = None) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) for ``ttl`` seconds.

        A ``subkey`` equal to ``str(peer_id)`` makes an owner-bound record, and a key
        marked ``[owner:PEERID]`` (``protocol.records.owned_key(name, peer_id)``) an owned
        key, under which only that peer may write (any subkey); both are signed here and
        every storing node and reader checks the signature.
        The expiration is the version: a store replaces what is there only if it expires
        later (so an update with a shorter ttl than the previous value is refused).

        Returns:
            True when at least one node (maybe this one) accepted it.

        Raises:
            RecordTooLargeError: (a ValueError) the key, subkey or serialized value is
                over its limit (MAX_KEY_BYTES, MAX_SUBKEY_BYTES, MAX_VALUE_BYTES).
            RecordError: the subkey or the key is bound to another peer, or the key (not
                a str) or the subkey is of a wrong type.
            ValueError: ``ttl`` is not in (0, MAX_TTL], or too small to move the clock.
            TypeError: ``ttl`` is not a number, or ``value`` cannot be serialized with
                msgpack (or would not read back: a tuple as a dict key, an extension type).
            PeerStoppedError: this peer's ``open_peer`` context has ended.
        """
        key_id = check_key(key)
        if not isinstance(ttl, numbers.Real) or isinstance(ttl, bool):
            raise TypeError(f"ttl must be a number of seconds, got {type(ttl).__name__}")
        ttl = float(ttl)  # numpy's numbers too: records hold a Python float expiration
        if not 0 < ttl <= MAX_TTL:
            raise ValueError(f"ttl must be in (0, {MAX_TTL}] seconds, got {ttl}")
        try:
            data = msgpack.packb(value, use_bin_type=True)
            # what readers will get must unpack too: a tuple as a dict key packs, but comes
            # back as a list, which no dict can hold; extension types are refused
            decode_value(data)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(
                f"DHT values must be msgpack-serializable (None, bool, int, float, str, bytes,"
                f" and lists and dicts of them); {type(value).__name__}: {exc}"
            ) from exc
        now = self._clock()
        expiration = now + ttl
        if expiration <= now:  # a unix time has ~0.2 us steps: a smaller ttl adds nothing
            raise ValueError(f"ttl of {ttl} s is below the clock's resolution")
        expiration = self._carry_over((key_id, subkey), now, expiration)
        owner = key_owner(key)
        if owner is not None or owner_of(subkey) is not None:
            entry = sign_entry(self.identity, key_id, subkey, data, expiration, key_owner=owner)
        else:
            entry = Entry(subkey, data, expiration)
        validate_entry(key_id, entry, now=now, key_owner=owner)
        self._check_running()  # before it joins the republish list
        self._note_published(key, key_id, entry, ttl)
        return await self._store_entries(key, (entry,))

    def _carry_over(self, slot: tuple[DHTID, Subkey], now: float, expiration: float) -> float:
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
        last = self._stamped.get(slot)
        if last is not None:
            old_expiration, old_lasts_until = last
            if expiration <= old_expiration and lasts_until > old_lasts_until + _LATER:
                later = math.nextafter(old_expiration, math.inf)
                if later - now <= MAX_TTL:
                    expiration = later
        if last is None or expiration > last[0]:  # else refused: the old one stays live
            self._stamped[slot] = (expiration, lasts_until)
            self._stamped.move_to_end(slot)
        stamped = self._stamped  # oldest first: drop the expired and beyond the bound
        while stamped and (
            len(stamped) > self.config.max_republished_records
            or next(iter(stamped.values()))[0] < now
        ):
            stamped.popitem(last=False)
        return expiration

    def _note_published(self, key: str, key_id: DHTID, entry: Entry, ttl: float) -> None:
        """Republish ``entry`` from now on, unless the record we republish outlives it: a
        store every node refuses (an older version) must not end the republishing of the
        live one (the owner's record was lost once its first holders left)."""
        slot = (key_id, entry.subkey)
        published = self._published.get(slot)
        if published is not None and not supersedes(entry, published[1]):
            return
        if ttl > self.config.republish_interval:
            self._published[slot] = (key, entry)
            self._published.move_to_end(slot)
            while len(self._published) > self.config.max_republished_records:
                self._published.popitem(last=False)
        else:  # gone, or nearly, by the next pass (e.g. an averaging round's declaration)
            self._published.pop(slot, None)

    async def _store_entries(self, key: str, entries: tuple[Entry, ...]) -> bool:
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
            response = await self.protocol.store(node, key_id, key, entries)
            if response is None:
                return None
            stored = stored or any(response.accepted)
            return response.nodes

        def given_up(node: NodeInfo) -> None:
            # sent again: its outcome counts for or against the node, not the give-up
            if not self._store_in_background(node, key_id, key, entries):
                self._given_up(node)

        result = await self._lookup(key_id, query, on_given_up=given_up)
        if self.storage is not None and self._among_closest(key_id, result.closest):
            for entry in entries:
                try:
                    stored = self.storage.store(key_id, entry, owner, key) or stored
                except RecordError as exc:
                    logger.debug("local store refused: %s", exc)
        return stored

    def _store_in_background(
        self, node: NodeInfo, key_id: DHTID, key: str, entries: tuple[Entry, ...]
    ) -> bool:
        """Send again, in the service nursery and within the request timeout, a STORE that
        its lookup gave up on (too slow, then cancelled when the lookup ended): a slow node
        among the k closest, whose connection had idled out, missed most stores (its dial
        outlasted the lookup).
        Outside the request slots (they bound this node's CPU, and these mostly wait on
        the network), at most _BACKGROUND_STORES at once; beyond, republish covers it.

        Returns:
            Whether it was sent (its outcome then counts for or against the node)."""
        if self._service is None or self._background_stores >= _BACKGROUND_STORES:
            return False

        async def send() -> None:
            try:
                await self.protocol.store(node, key_id, key, entries, take_slot=False)
            finally:
                self._background_stores -= 1

        self._background_stores += 1
        self._service.start_soon(send)
        return True

    async def get_entries(
        self, key: str, *, latest: bool = True
    ) -> dict[Subkey, tuple[Any, float]]:
        """Every live ``subkey -> (value, expiration)`` under ``key`` (empty when none);
        see :meth:`read_entries`."""
        return (await self.read_entries(key, latest=latest)).entries

    async def read_entries(self, key: str, *, latest: bool = True) -> EntriesRead:
        """Every live ``subkey -> (value, expiration)`` under ``key`` (empty when none),
        and how many other nodes were asked and answered: a read that asked others and
        heard from none saw only what this node stores itself (nothing, for a client; a
        busy link, a partition), which an empty or lone result cannot tell from a key
        nobody else stored.

        ``latest=True`` merges what the first ``value_quorum`` holders of the key among
        its k closest nodes answer (this node counts when it holds the key; a holder with
        k nodes known closer to the key does not count: it may be a node a store asked on
        the way, which holds that store only, while every STORE reached the k closest): the
        newest version of each subkey among them. When fewer such nodes hold the key, the
        lookup runs until the k closest have answered.
        ``latest=False`` returns after the first node that holds anything (faster; may
        miss subkeys or newer versions).
        A holder counts once every page of a key too large for one reply has come: one
        that fails partway counts as failed, and its pages are dropped (so with no other
        holder, the result is empty rather than part of the key).

        Raises:
            RecordTooLargeError: (a ValueError) the key is over MAX_KEY_BYTES.
            RecordError: the key is not a str.
            PeerStoppedError: this peer's ``open_peer`` context has ended.
        """
        key_id, owner = check_key(key), key_owner(key)
        self._check_running()  # also when this node's own copy would answer alone
        record: Record = {}
        values: dict[Subkey, Any] = {}
        local = self.storage.get(key_id) if self.storage is not None else {}
        for entry in local.values():
            self._merge(key_id, owner, record, values, entry, verified=True)
        quorum = min(self.config.value_quorum, self.config.k) if latest else 1
        holders = _Holders(key_id, self.config.k, quorum, closest_first=latest)
        if self.storage is not None:  # a client is no node of the key's k closest
            holders.answered(self.peer_id, self.node_id, bool(local))
        holders.learn(self.table.nearest(key_id, 2 * self.config.k))  # the lookup's seeds

        asked = answered = 0

        async def query(node: NodeInfo) -> Sequence[NodeInfo] | None:
            nonlocal asked, answered
            asked += 1
            response = await self.protocol.find_value(node, key_id)
            if response is None:
                holders.failed(node)
                return None
            nodes = response.nodes
            holds = bool(response.entries)
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
                response = await self.protocol.find_value(node, key_id, after=after)
                if response is None:
                    # It failed partway (died during the read): part of a key must not pass
                    # for all of it, nor count toward the quorum. Others are asked instead.
                    logger.debug("%s failed after %d pages of %s", node.peer_id.short(), page, key)
                    holders.failed(node)
                    return None
            answered += 1  # a whole copy (a node that fails partway did not answer)
            for entry in received:
                self._merge(key_id, owner, record, values, entry, verified=False)
            holders.learn(nodes)
            holders.answered(node.peer_id, DHTID.from_peer_id(node.peer_id), holds)
            return nodes

        if not holders.enough():
            # Once some node holds the key, at most as many requests in flight as holders
            # are still missing: the closest nodes are asked first and normally hold it, so
            # a get costs ~quorum RPCs. Before that, a plain lookup (a miss fans out).
            def wanted() -> int:
                return holders.missing() if holders.any else self.config.k

            await self._lookup(key_id, query, stop=holders.enough, wanted=wanted)
        return EntriesRead(_live(record, values, self._clock()), asked, answered)

    def _merge(
        self,
        key_id: DHTID,
        owner: PeerID | None,
        record: Record,
        values: dict[Subkey, Any],
        entry: Entry,
        *,
        verified: bool,
    ) -> None:
        old = record.get(entry.subkey)
        if old is not None and (old == entry or not supersedes(entry, old)):
            return  # loses anyway (or is the same one): no need to verify it
        try:
            if not verified:
                validate_entry(key_id, entry, now=self._clock(), key_owner=owner)
            value = decode_value(entry.value)
        except (RecordError, ValueError, TypeError) as exc:
            logger.debug("dropped an invalid entry from a lookup: %r", exc)
            return
        if merge_entry(record, entry):
            values[entry.subkey] = value

    async def get(self, key: str, *, latest: bool = True) -> Any:
        """The value under ``key``: a plain value, ``{subkey: value}`` for a dictionary
        key (a plain value stored beside subkeys is the ``None`` entry there), or None when
        nothing live is stored.

        Raises:
            RecordTooLargeError: (a ValueError) the key is over MAX_KEY_BYTES.
            RecordError: the key is not a str.
            PeerStoppedError: this peer's ``open_peer`` context has ended.
        """
        entries = await self.get_entries(key, latest=latest)
        if not entries:
            return None
        if len(entries) == 1 and None in entries:
            return entries[None][0]
        return {subkey: value for subkey, (value, _) in entries.items()}

    # ---- peers -----------------------------------------------------------------------

    def routing_table_peers(self) -> list[tuple[PeerID, str]]:
        """``(peer_id, "HOST:PORT")`` of every routing-table contact, far buckets first."""
        return [(n.peer_id, n.address) for n in self.table.nodes() if n.address is not None]

    async def find_peers(self) -> list[tuple[PeerID, str]]:
        """Look up our own neighbourhood, then list the routing table.

        Raises:
            Nothing for unreachable peers: they are left out.
        """
        await self.find_nodes(self.node_id)
        return self.routing_table_peers()


class _Holders:
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
        self._failed: set[PeerID] = set()  # never asked again by the lookup
        self.any = False  # some node answered holding the key

    def learn(self, nodes: Sequence[NodeInfo]) -> None:
        """Candidates, as the lookup takes them: the k closest of a reply, dialable ones."""
        dialable = [n for n in nodes if n.address is not None]
        for node in heapq.nsmallest(self._k, dialable, key=self._distance):
            if node.peer_id not in self._nodes and node.peer_id not in self._failed:
                self._nodes[node.peer_id] = (self._distance(node), None)

    def _distance(self, node: NodeInfo) -> int:
        return DHTID.from_peer_id(node.peer_id) ^ self._target

    def answered(self, peer_id: PeerID, node_id: DHTID, holds: bool) -> None:
        self._nodes[peer_id] = (node_id ^ self._target, holds)
        self.any = self.any or holds

    def failed(self, node: NodeInfo) -> None:
        self._nodes.pop(node.peer_id, None)
        self._failed.add(node.peer_id)

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


def _live(record: Record, values: dict[Subkey, Any], now: float) -> dict[Subkey, tuple[Any, float]]:
    return {s: (values[s], e.expiration) for s, e in record.items() if e.expiration > now}


_Job = TypeVar("_Job")


_E = TypeVar("_E", bound=BaseException)


def _cause_of_type(exc: BaseException, kind: type[_E]) -> _E | None:
    """The first exception of ``kind`` in ``exc``'s chain of causes (``exc`` included)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 16:
        if isinstance(current, kind):
            return current
        current, seen = current.__cause__, seen + 1
    return None


class _NewcomerGone(Exception):
    """A handover STORE failed: the newcomer left or cannot be reached."""


async def _each_bounded(
    jobs: Iterable[_Job], work: Callable[[_Job], Awaitable[None]], parallel: int
) -> None:
    """``await work(job)`` for each job, ``parallel`` at a time, from ``parallel`` tasks.

    One task per job, each waiting on a limiter, cost a bootstrap node ~4 KiB per waiting
    key: a handover of 2,500 keys to 3 newcomers at once held 7,500 tasks, its RSS went
    from 40 to 70 MiB, and the allocator kept it after they ended (a churn trial).
    """
    pending = iter(jobs)

    async def worker() -> None:
        for job in pending:  # the workers share one iterator: each job is taken once
            await work(job)

    async with trio.open_nursery() as nursery:
        for _ in range(parallel):
            nursery.start_soon(worker)


def should_hand_over(others: Sequence[int], key: int, us: int, newcomer: int, k: int) -> bool:
    """Whether we hand ``key`` to ``newcomer``: it is among the k closest to the key of
    the nodes we know (``others``: our contacts' ids, the newcomer's excluded, and us), and
    we are among the ``_HANDOVER_SENDERS`` closest of them (the closer ones send it)."""
    ours, theirs = us ^ key, newcomer ^ key
    if _count_closer(others, key, ours, _HANDOVER_SENDERS) >= _HANDOVER_SENDERS:
        return False  # closer holders hand it over
    needed = k - (ours < theirs)
    return _count_closer(others, key, theirs, needed) < needed


def _count_closer(ids: Sequence[int], key: int, distance: int, enough: int) -> int:
    """How many of ``ids`` are closer to ``key`` than ``distance``, counting up to ``enough``."""
    count = 0
    for other in ids:
        if other ^ key < distance:
            count += 1
            if count >= enough:
                break
    return count
