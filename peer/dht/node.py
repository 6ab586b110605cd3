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
import numbers
import random
import statistics
import time
from collections import deque
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
    MAX_TTL,
    Subkey,
    check_key,
    check_subkey,
    decode_value,
    key_owner,
    owner_of,
    sign_entry,
    validate_entry,
)

from ..errors import STOPPED, DuplicateIdentityError, PeerStoppedError
from ..host import RpcHost
from ..interrupts import plain_interrupt
from .config import DHTConfig
from .handover import Handover
from .joining import Joining
from .lookup import MIN_HEDGE_DELAY, LookupResult, Query, iterative_lookup
from .protocol import DHTProtocol
from .publishing import Publishing
from .reading import EntriesRead as EntriesRead
from .reading import Reading
from .routing import RoutingTable
from .storage import DHTStorage
from .upkeep import Upkeep

logger = logging.getLogger(__name__)

_EXPIRE_INTERVAL = 30.0  # seconds between sweeps of expired records
_TWIN_CHECK_EVERY = 60.0  # seconds between dials of one address named with our PeerID
_FIRST_ANSWERS_KEPT = 32  # recent lookups' first-answer delays, for the first hedge


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
        self._publishing = Publishing(self)
        self._reading = Reading(self)
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
        self._service: trio.Nursery | None = None  # serve()'s nursery, while it runs
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

    @property
    def initial_peers_answered(self) -> dict[str, PeerID]:
        """``HOST:PORT`` of each initial peer that answered a contact -> the PeerID its
        handshake proved (``swarm status`` finds two processes on one key file by it)."""
        return self._joining.answered

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
        """Re-store the live records this node stored, to the nodes closest now; how many
        keys were republished. See :meth:`Publishing.republish`.

        Raises:
            Nothing for unreachable peers: a record no node accepts waits for the next round.
        """
        return await self._publishing.republish()

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
        on_given_up: Callable[[NodeInfo, bool], None] | None = None,
        k: int | None = None,
    ) -> LookupResult:
        """An iterative lookup of the ``k`` (default: the config's k) nodes closest to
        ``target``, each asked with ``query``."""
        self._check_running()
        k = self.config.k if k is None else k
        # Twice k seeds: when some of the closest known are dead, the next ones take
        # their place instead of the lookup running dry.
        seeds = self.table.nearest(target, 2 * self.config.k)
        result = await iterative_lookup(
            target,
            seeds,
            query,
            k=k,
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
            raise PeerStoppedError(STOPPED)

    def _given_up(self, node: NodeInfo, proven: bool) -> None:
        # A request outlasted a lookup's hedging: as a timeout (it counts toward
        # max_failures, so a frozen node leaves the table after a few lookups), when
        # ``proven`` (others answered while it stayed silent: not our link stalling, see
        # iterative_lookup) and the node's bytes did not come lately (a busy link).
        if proven and not self.protocol.heard_lately(node):
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

    def _among_closest(self, target: DHTID, closest: Sequence[NodeInfo], count: int) -> bool:
        """Whether we are among the ``count`` nodes closest to ``target``, given the
        ``count`` closest others a lookup found."""
        if len(closest) < count:
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
            why = str(exc)
            if isinstance(exc, msgpack.exceptions.StackError):  # (it says nothing)
                why = "nested deeper than a reader unpacks (1024 levels)"
            raise TypeError(
                f"DHT values must be msgpack-serializable (None, bool, int, float, str, bytes,"
                f" and lists and dicts of them); {type(value).__name__}: {why}"
            ) from exc
        now = self._clock()
        expiration = now + ttl
        if expiration <= now:  # a unix time has ~0.2 us steps: a smaller ttl adds nothing
            raise ValueError(f"ttl of {ttl} s is below the clock's resolution")
        expiration = self._publishing.carry_over((key_id, subkey), now, expiration)
        owner = key_owner(key)
        if owner is not None or owner_of(subkey) is not None:
            entry = sign_entry(self.identity, key_id, subkey, data, expiration, key_owner=owner)
        else:
            entry = Entry(subkey, data, expiration)
        validate_entry(key_id, entry, now=now, key_owner=owner)
        self._check_running()  # before it joins the republish list
        self._publishing.note_published(key, key_id, entry, ttl)
        return await self._publishing.store_entries(key, (entry,))

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
        its closest nodes answer (this node counts when it holds the key; a holder with
        ``replicas`` (k by default) nodes known closer to the key does not count: it may be
        a node a store asked on the way, which holds that store only, while every STORE
        reached the ``replicas`` closest): the newest version of each subkey among them.
        When fewer such nodes hold the key, the lookup runs until the k closest have
        answered.
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
        return await self._reading.read(key, latest=latest)

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
    if isinstance(addresses, bytes | bytearray | memoryview):  # not a list of ints
        raise TypeError(
            "give addresses as text ('PEERID@HOST:PORT'), not"
            f" {type(addresses).__name__} (decode it first)"
        )
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
