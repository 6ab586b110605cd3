"""The DHT node: store and get, and lookups. Its other parts have files of their own: joining
(``joining.py``), the upkeep of its routing table (``upkeep.py``) and the handover of keys
to newcomers (``handover.py``).

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

import logging
import math
import numbers
import random
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import trio

from protocol.address import Address
from protocol.dhtid import DHTID
from protocol.errors import SwarmError
from protocol.identity import Identity, PeerID
from protocol.messages import Entry, NodeInfo
from protocol.records import (
    MAX_ENTRIES_PER_STORE,
    MAX_SUBKEYS_PER_KEY,
    MAX_TTL,
    RecordError,
    Subkey,
    check_key,
    check_subkey,
    decode_value,
    key_owner,
    owner_of,
    sign_entry,
    subkey_order,
    validate_entry,
)

from ..errors import DuplicateIdentityError, PeerStoppedError
from ..host import RpcHost
from ..interrupts import plain_interrupt
from .bounded import each_bounded
from .config import DHTConfig
from .handover import Handover
from .joining import Joining
from .lookup import MIN_HEDGE_DELAY, LookupResult, Query, iterative_lookup
from .protocol import DHTProtocol
from .reading import Holders, live_entries
from .routing import RoutingTable
from .storage import DHTStorage, Record, merge_entry, supersedes
from .upkeep import Upkeep

logger = logging.getLogger(__name__)

_REPUBLISH_PARALLEL = 4
_EXPIRE_INTERVAL = 30.0  # seconds between sweeps of expired records
_TWIN_CHECK_EVERY = 60.0  # seconds between dials of one address named with our PeerID
_FIRST_ANSWERS_KEPT = 32  # recent lookups' first-answer delays, for the first hedge
_BACKGROUND_STORES = 32  # stores re-sent after their lookup gave up on them, at once
_BACKGROUND_REPAIRS = 8  # read repairs in flight at once (a pool of their own: a holder
# that keeps answering with old versions and never replies must not hold the one above)
# A key holds at most 1024 subkeys of 16 KiB: 17 replies of 1 MiB; a node that keeps
# saying "more" gets no further than this.
_MAX_VALUE_PAGES = 32
_READ_SUBKEYS = 4 * MAX_SUBKEYS_PER_KEY
"""Subkeys a read's merge of its holders' copies takes before trimming them to the best
supported MAX_SUBKEYS_PER_KEY (room for a few holders' differing full copies; bounded)."""
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
    repairs: int = 0  # holders sent a newer version of a key they answered with (read repair)

    def record(self, result: LookupResult) -> None:
        self.lookups += 1
        self.total_rounds += result.rounds
        self.max_rounds = max(self.max_rounds, result.rounds)


class DHT:
    """One Kademlia node on an RPC host. Construct, then run :meth:`serve` in a nursery.

    Attributes a script reads (besides the methods): ``config`` (the DHTConfig),
    ``peer_id``, ``table`` (the routing table), ``stats`` (a LookupStats: this node's
    lookups since it started, ``lookups``, ``total_rounds`` and ``max_rounds``, and the
    read repairs it sent, ``repairs``; cumulative, so read it before and after to count
    one lookup's rounds).
    """

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
        self._joining = Joining(self)
        self._upkeep = Upkeep(self)
        self._handover = Handover(self)
        if self.storage is not None:
            self.protocol.on_new_contact = self._handover.on_new_contact
        host.on_connection_lost = self.protocol.check_alive
        self.host = host
        self.stats = LookupStats()
        # seconds to the first answer of recent lookups: the silence before a lookup's
        # first answer that means a frozen node (else hedge_after for each, in turn)
        self._first_answers: deque[float] = deque(maxlen=_FIRST_ANSWERS_KEPT)
        self._clock = clock
        self._rng = random.Random(self.peer_id.raw)
        # (key id, subkey) -> (key text, entry) of what this node stored, to republish
        self._published: OrderedDict[tuple[DHTID, Subkey], tuple[str, Entry]] = OrderedDict()
        # (key id, subkey) -> (expiration, the same on trio's clock) of our latest store
        # there (see _carry_over)
        self._stamped: OrderedDict[tuple[DHTID, Subkey], tuple[float, float]] = OrderedDict()
        self._service: trio.Nursery | None = None  # serve()'s nursery, while it runs
        self._in_background = {"resend": 0, "repair": 0}  # background stores in flight
        self._twin_checks: dict[str, float] = {}  # our PeerID's other addresses: last dial
        self._checking_twins = 0
        self.table.on_departed = self._upkeep.on_departed

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
                nursery.start_soon(self._handover.run)
                nursery.start_soon(self._upkeep.recontact_soon)
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

    # ---- joining and upkeep (joining.py, upkeep.py, handover.py) ----------------------

    async def bootstrap(self, initial_peers: Sequence[Address], *, warn: bool = True) -> int:
        """Join through ``initial_peers``; how many had answered when the join went on (0:
        we are alone). See :meth:`Joining.bootstrap`."""
        return await self._joining.bootstrap(initial_peers, warn=warn)

    @plain_interrupt
    async def contact(self, addresses: Sequence[Address | str]) -> list[Address]:
        """Dial and ping contacts known from before (``Address`` objects, or their text
        ``PEERID@HOST:PORT`` / ``HOST:PORT``); those that answered. See
        :meth:`Joining.contact`.

        Raises:
            AddressError: (a ValueError) a text that is no address.
            TypeError: an item that is neither, or an argument that is no list.
        """
        return await self._joining.contact(address_list(addresses))

    @property
    def contact_errors(self) -> dict[str, str]:
        """Initial peers that did not answer at the last contact -> why."""
        return self._joining.contact_errors

    @plain_interrupt
    async def refresh(self) -> None:
        """One maintenance round (the service runs one every ``refresh_interval``). See
        :meth:`Upkeep.refresh`."""
        await self._upkeep.refresh()

    @plain_interrupt
    async def drop_silent_contacts(self) -> int:
        """Ping the contacts quiet for ``ping_after`` and remove those that do not answer;
        how many were removed. See :meth:`Upkeep.drop_silent_contacts`."""
        return await self._upkeep.drop_silent_contacts()

    async def hand_over(self, node: NodeInfo) -> int:
        """Store at ``node``, a new contact, the keys it should hold; how many. See
        :meth:`Handover.hand_over`."""
        return await self._handover.hand_over(node)

    @plain_interrupt
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

        await each_bounded(by_key.items(), one, _REPUBLISH_PARALLEL)
        return len(by_key)

    # ---- lookups ---------------------------------------------------------------------

    @plain_interrupt
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
            silent=self._silent_stranger,
            on_excluded=self._check_twin,
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
            self.protocol.mark_silent(node)

    def _check_twin(self, node: NodeInfo) -> None:
        """A reply named our own PeerID at ``node.address``: ours, an old one of ours (a
        restart on another port), or another process's with our key (a copied key file:
        a trial's second process was told nothing, and beside it healthy peers' rounds
        went partial). Dial it once a minute at most, in the background: a handshake that
        proves our PeerID there warns (``RpcHost``), and tells the twin too."""
        where = node.address
        if where is None or where == self.protocol.sender or self._service is None:
            return
        now = trio.current_time()
        last = self._twin_checks.get(where)
        if (last is not None and now - last < _TWIN_CHECK_EVERY) or self._checking_twins >= 2:
            return
        if len(self._twin_checks) >= 64:
            self._twin_checks.clear()
        self._twin_checks[where] = now

        async def check() -> None:
            try:
                with trio.move_on_after(self.config.request_timeout):
                    await self.host.connect(Address.parse(where).with_peer_id(self.peer_id))
            except DuplicateIdentityError:  # (the host warned) an address others knew us
                self.host.twin = (where, trio.current_time())  # at: not an alias of ours
            except (SwarmError, OSError) as exc:
                logger.debug("our PeerID at %s: %r", where, exc)
            finally:
                self._checking_twins -= 1

        self._checking_twins += 1
        self._service.start_soon(check)

    def _silent_stranger(self, node: NodeInfo) -> bool:
        """Whether a lookup asks ``node`` without waiting for it: silent (DHTProtocol's
        rules), and not in our routing table (a contact of ours is waited for, so that its
        failures count and a frozen one leaves after ``max_failures`` lookups; others'
        tables keep naming it after that)."""
        return node.peer_id not in self.table and self.protocol.is_silent(node)

    def _among_closest(self, target: DHTID, closest: Sequence[NodeInfo]) -> bool:
        if len(closest) < self.config.k:
            return True
        farthest = DHTID.from_peer_id(closest[-1].peer_id)
        return self.node_id.distance(target) < farthest.distance(target)

    # ---- store and get ---------------------------------------------------------------

    @plain_interrupt
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
        check_subkey(subkey)  # before it is looked up (a list subkey is unhashable)
        if not isinstance(ttl, numbers.Real) or isinstance(ttl, bool):
            raise TypeError(f"ttl must be a number of seconds, got {type(ttl).__name__}")
        try:
            ttl = float(ttl)  # numpy's numbers too: records hold a Python float expiration
        except OverflowError:  # an int or Fraction beyond float64
            raise ValueError(
                f"ttl must be in (0, {MAX_TTL}] seconds, got a number beyond float64's range"
            ) from None
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
        if self._service is None or self._in_background[pool] >= limit:
            return False

        async def send() -> None:
            try:
                await self.protocol.store(node, key_id, key, entries, take_slot=False)
            finally:
                self._in_background[pool] -= 1

        self._in_background[pool] += 1
        self._service.start_soon(send)
        return True

    @plain_interrupt
    async def get_entries(
        self, key: str, *, latest: bool = True
    ) -> dict[Subkey, tuple[Any, float]]:
        """Every live ``subkey -> (value, expiration)`` under ``key`` (empty when none);
        see :meth:`read_entries`."""
        return (await self.read_entries(key, latest=latest)).entries

    @plain_interrupt
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
        # how many holders sent a valid entry for each subkey: when the copies together
        # hold more subkeys than a key may, those most holders agree on are kept (one
        # holder's 1024 long-lived entries, a liar's or a flooder's, pushed every honest
        # subkey out of the merge: a review)
        support: dict[Subkey, int] = {}
        # each holder's older versions, not checked yet (see the trim below)
        unchecked: list[tuple[set[Subkey], list[Entry]]] = []
        local = self.storage.get(key_id) if self.storage is not None else {}
        for entry in local.values():
            self._merge(key_id, owner, record, values, entry, verified=True)
            support[entry.subkey] = 1
        quorum = min(self.config.value_quorum, self.config.k) if latest else 1
        holders = Holders(key_id, self.config.k, quorum, closest_first=latest)
        if self.storage is not None:  # a client is no node of the key's k closest
            holders.answered(self.peer_id, self.node_id, bool(local))
        holders.learn(self.table.nearest(key_id, 2 * self.config.k))  # the lookup's seeds

        asked = answered = 0
        copies: list[tuple[NodeInfo, list[Entry]]] = []  # each holder's whole copy

        async def query(node: NodeInfo) -> Sequence[NodeInfo] | None:
            nonlocal asked, answered
            asked += 1
            response = await self.protocol.find_value(node, key_id)
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
                response = await self.protocol.find_value(node, key_id, after=after)
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
                return holders.missing() if holders.any else self.config.k

            await self._lookup(key_id, query, stop=holders.enough, wanted=wanted)
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
        return EntriesRead(live_entries(record, values, self._clock()), asked, answered)

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
        now = self._clock()
        winners = {s: e for s, e in record.items() if e.expiration > now}
        for node, entries in copies:
            if node.peer_id == self.peer_id:
                continue
            newer: dict[Subkey, Entry] = {}  # by subkey: a reply may list one twice
            for old in entries:
                new = winners.get(old.subkey)
                if new is not None and new != old and supersedes(new, old):
                    newer[old.subkey] = new
                    if len(newer) == MAX_ENTRIES_PER_STORE:
                        break
            if newer and self._store_in_background(
                node, key_id, key, tuple(newer.values()), pool="repair"
            ):
                self.stats.repairs += 1

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
            validate_entry(key_id, entry, now=self._clock(), key_owner=owner)
        except (RecordError, ValueError, TypeError) as exc:
            logger.debug("dropped an invalid entry from a lookup: %r", exc)
            return False
        return True

    @plain_interrupt
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

    @plain_interrupt
    async def find_peers(self) -> list[tuple[PeerID, str]]:
        """Look up our own neighbourhood, then list the routing table.

        Raises:
            Nothing for unreachable peers: they are left out.
        """
        await self.find_nodes(self.node_id)
        return self.routing_table_peers()


def address_list(addresses: Sequence[Address | str] | Address | str) -> list[Address]:
    """``Address`` objects for :meth:`DHT.contact`'s argument: one address (its text is
    not a list of characters) or a list of them, texts parsed.

    Raises:
        AddressError: (a ValueError) a text that is no address.
        TypeError: an item that is neither, or an argument that is no list.
    """
    if isinstance(addresses, str | Address):
        addresses = [addresses]
    try:
        items = list(addresses)
    except TypeError:  # (list() said "'int' object is not iterable")
        raise TypeError(
            "addresses must be an address (PEERID@HOST:PORT or HOST:PORT, or an Address)"
            f" or a list of them, got {type(addresses).__name__}"
        ) from None
    return [_address(item) for item in items]


def _address(item: Address | str) -> Address:
    """An ``Address``, or one parsed from its text (as every other API takes it)."""
    if isinstance(item, Address):
        return item
    if isinstance(item, str):
        return Address.parse(item)
    raise TypeError(f"an address must be an Address or its text, not {type(item).__name__}")
