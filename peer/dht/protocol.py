"""The DHT's four RPCs over the RPC host: handlers for others' requests, calls to others.

Learning rules (the routing table's only inputs):
- A request teaches us its sender: the handshake-verified ``request.peer_id`` with the
  ``sender`` address it claims (None: a client, never added; nor is a sender at a host no
  peer can listen at, such as ``0.0.0.0``: see ``Address.dialable``). The claim is taken
  as it is when its host is the one the request came from (or the table holds the sender
  there already); any other host is checked first, by dialing it on a connection of its own
  (:meth:`RpcHost.prove_address`; a bounded queue, one claim per requesting host at a
  time): otherwise anyone could fill our table, and through our FIND_NODE answers
  everyone's lookups, with an address of its choosing, such as a third party's to flood
  with dials.
- A reply teaches us the node we called when we dialed its address and the handshake
  proved its id (or the table holds it at that address already): a reply over a pooled
  connection the peer opened proves its id, not the address a third party named for it.
  Nodes named *inside* replies are only lookup candidates until they answer.
- A request without a sender says its peer is a client now: it leaves the table (it may
  have restarted in client mode with the same identity, its old address dead; our calls to
  that address went over its client's connection, and its answers kept the dead address
  listed everywhere). Replies do not bring it back: only a request naming an address, or a
  dial of its own to the address (tried for a reply at most once a ``CLIENT_RECHECK``).
- A failed call (timeout, refused, malformed or error reply) counts against the node,
  except a timeout (or a lookup giving up on it) while the node's bytes keep arriving (a
  connection with it received some within the last ``request_timeout``): its link is
  busy, not gone. A volunteer on a slow link whose averaging round was cut short keeps
  receiving what its peers had queued for it for seconds, its DHT answers behind those
  bytes; counting those timeouts emptied its table after every failed round. Such a ping
  keeps the contact but does not refresh it; and only while the contact was seen (it
  answered or asked us something) within ``refresh_interval``.
- A call that could not reach the node (a refused dial, or a connection that broke under
  it: a NAT that forgot its mapping) counts as a failure; where a replacement waits, the
  node is pinged at once instead of evicted, and the ping, on a fresh connection, evicts
  it when it fails too (a reset alone evicted live contacts, for good).
- A node that let a request time out, or that a lookup gave up on, with nothing heard
  from it since, is *silent* for ``SILENT_FOR`` seconds (or until its bytes come again):
  lookups still ask it when replies name it, but do not wait for it (others' tables keep
  naming a frozen node until their own refresh, and each lookup waited a hedge delay for
  each such node: 8 frozen among the closest cost every store and miss ~0.4 s; a test).
- At most ``max_concurrent_requests`` calls are in flight; the deadline of a call
  starts when it gets its slot, so a node overloaded by its own lookups does not
  blame its peers for the wait.
- When learning meets a full bucket, the bucket's least-recently-seen contact is queued
  for a ping (bounded queue; a full queue keeps the old contact), which the DHT's
  maintenance task runs through :meth:`DHTProtocol.run_pings`.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import TypeVar

import trio

from protocol.address import Address
from protocol.dhtid import DHTID
from protocol.errors import ProtocolError, SwarmError
from protocol.identity import PeerID
from protocol.messages import (
    Entry,
    FindNodeRequest,
    FindNodeResponse,
    FindValueRequest,
    FindValueResponse,
    Message,
    NodeInfo,
    PingRequest,
    PingResponse,
    StoreRequest,
    StoreResponse,
)
from protocol.records import RecordError, key_owner, subkey_order

from ..errors import PeerBusyError, PeerUnavailableError, RemoteError
from ..host import RpcHost
from ..remote_hosts import host_group, is_loopback_host
from ..rpc import Reply, Request
from .config import DHTConfig
from .routing import RoutingTable
from .storage import DHTStorage

logger = logging.getLogger(__name__)

_REJOIN_AFTER_JOIN = 60.0
"""Seconds after a contact joined during which its own-id lookup hands nothing over again."""
_REJOINED_MEMORY = 4096
"""Contacts remembered for the once-per-republish-interval rule of ``_rejoined``."""
_MOVED_MEMORY = 256  # contacts' last other addresses, for their own lookups (_on_find_node)

# A FIND_VALUE reply carries at most this many value bytes (the frame limit is a few MiB);
# a key holding more answers in pages (the reply says ``more``; the caller asks again
# ``after`` the last subkey it got). A key may hold 1024 subkeys of 16 KiB.
_MAX_REPLY_VALUE_BYTES = 1 << 20
_ENTRY_OVERHEAD = 200  # subkey, expiration, signature and msgpack headers, generously
_PING_QUEUE = 256
_PROOF_QUEUE = 64  # claimed sender addresses waiting to be dialed; a full queue drops more
_PROVERS = 4  # claimed addresses dialed at once (a dial to a silent host lasts dial_timeout)
SILENT_FOR = 60.0
"""Seconds a node that went silent is asked without being waited for (see the module's
rules); then a lookup waits its hedge delay for it again, once."""
_MAX_SILENT = 4096
CLIENT_RECHECK = 60.0
"""Seconds between dials of the old address of a peer that asked us as a client, tried
when it answers a call there (see the module's rules): it may listen there again."""
_CLIENTS_REMEMBERED = 4096
_RECHECK_SOURCE = "(a client's old address)"  # proofs of those wait for each other

_M = TypeVar("_M", bound=Message)
_UNPARSABLE_REMEMBERED = 1024  # senders of unparsable requests, each named once
_UNPARSABLE_WARNING_INTERVAL = 60.0


class DHTProtocol:
    """Serves and sends ``dht.ping``, ``dht.find_node``, ``dht.find_value``, ``dht.store``."""

    def __init__(
        self,
        host: RpcHost,
        table: RoutingTable,
        storage: DHTStorage | None,
        config: DHTConfig,
        *,
        sender: str | None,
        now: Callable[[], float] = trio.current_time,
    ) -> None:
        self.host = host
        self.table = table
        self.storage = storage  # None in client mode: we store nothing for others
        self.config = config
        self.sender = sender
        self._now = now
        self._ping_send, self._ping_receive = trio.open_memory_channel[NodeInfo](_PING_QUEUE)
        self._checking: set[PeerID] = set()  # contacts with a check_alive ping queued or sent
        self._proof_send, self._proof_receive = trio.open_memory_channel[tuple[NodeInfo, str]](
            _PROOF_QUEUE
        )
        # Claims queued or being dialed: one per sender, and one per host the requests come
        # from (a /64 for IPv6), so that one host's throwaway identities, each claiming an
        # address that never answers, cannot fill the queue and lock out everyone else's.
        self._proving: set[PeerID] = set()
        self._proving_from: set[str] = set()
        self._addresses: dict[tuple[str, PeerID], Address] = {}
        self._limiter = trio.CapacityLimiter(config.max_concurrent_requests)
        # Called with each contact that enters the routing table (the DHT hands keys over),
        # and with ``check=True`` for a known one that may have restarted (see _rejoined).
        self.on_new_contact: Callable[[NodeInfo, bool], None] | None = None
        table.on_promoted = self._joined
        table.on_emptied = self._emptied
        self._deserted = False  # the table emptied, and nobody joined it since
        self._alone_after: NodeInfo | None = None  # see note_left
        self.alone_level = logging.INFO
        """The level of the line that says the table emptied (``Joining.bootstrap`` makes
        it a WARNING for a peer that joined through initial peers)."""
        self.calls_sent = 0
        self.calls_failed = 0
        # contacts whose last ping could not connect (their port closed: a clean exit, or
        # a restart elsewhere), for the "peer left" line; see ping_failure
        self._unreachable: set[PeerID] = set()
        self._unparsable: set[PeerID] = set()  # senders of requests we could not parse
        self._silent: dict[PeerID, float] = {}  # since when (trio time): see is_silent
        # peers whose requests said they are clients (no sender), until one names an
        # address or a dial proves it -> when they last asked, or their address was dialed
        self._clients: dict[PeerID, float] = {}
        # known contacts that looked up their own id (a restart with the same identity),
        # by when we last handed keys over to them for it: see _on_find_node
        self._rejoined_at: dict[PeerID, float] = {}
        # peer -> the address a contact was known at before its latest claim of another
        self._moved: OrderedDict[PeerID, str] = OrderedDict()
        self._next_unparsable_warning = -math.inf

    def register(self) -> None:
        """Install the four handlers on the host."""
        self.host.register_quick(PingRequest.METHOD, self._on_ping)
        self.host.register_quick(FindNodeRequest.METHOD, self._on_find_node)
        self.host.register_quick(FindValueRequest.METHOD, self._on_find_value)
        self.host.register_quick(StoreRequest.METHOD, self._on_store)

    # ---- learning --------------------------------------------------------------------

    def learn(self, node: NodeInfo) -> None:
        """``node`` proved its id to us and is reachable at its address."""
        if node.address is None:
            return
        if self._clients:
            self._clients.pop(node.peer_id, None)  # it listens again
        previous = self.table.get(node.peer_id)
        to_ping = self.table.update(node, self._now())
        if node.peer_id in self.table:
            if previous is None:
                self._joined(node)
            elif previous.address != node.address:  # back elsewhere: perhaps restarted
                self._rejoined(node, node.address)
        if to_ping is not None:
            try:
                self._ping_send.send_nowait(to_ping)
            except trio.WouldBlock:
                self.table.ping_result(to_ping.peer_id, alive=True, now=self._now())

    def _emptied(self, last: NodeInfo) -> None:
        """The last contact left the routing table: say so, at WARNING for a peer that
        joined through initial peers (a peer left alone answered every get with None and
        every store with False, or True from its own storage, and logged only "peer left":
        an outside tester)."""
        self._deserted = True
        self._alone_after = last  # said after its "peer left" line (note_left)

    def note_left(self, node: NodeInfo, why: str) -> None:
        """Log that ``node`` left the routing table, and then, when it was the last
        contact, that this peer is alone (see :meth:`_emptied`)."""
        logger.info("peer left: %s (%s)", node.peer_id.short(), why)
        last, self._alone_after = self._alone_after, None
        if last is not None:
            logger.log(
                self.alone_level,
                "this peer knows no other peer now (its last contact, %s, left): its stores "
                "reach no other node and its gets find nothing until one answers again; it "
                "pings the departed contacts, and its initial peers at each refresh",
                last.peer_id.short(),
            )

    def _joined(self, node: NodeInfo) -> None:
        """``node`` entered the routing table (learned, or promoted from a bucket's
        replacement cache when a contact left)."""
        logger.info("peer joined: %s at %s", node.peer_id.short(), node.address)
        if self._deserted:
            self._deserted = False
            logger.info("in touch with the network again, through %s", node.peer_id.short())
        if self.on_new_contact is not None:
            # its own-id lookup follows the join: no second handover for it (one that
            # restarts after a minute still gets one; see _rejoined)
            window = self.config.republish_interval
            self._rejoined_at[node.peer_id] = self._now() - window + _REJOIN_AFTER_JOIN
            self.on_new_contact(node, False)

    def _rejoined(self, known: NodeInfo, sender: str | None) -> None:
        """A contact we knew looks up its own id, as a node does when it joins (and at each
        refresh): perhaps it restarted with the same identity (a bootstrap host's key
        file), its storage empty. Being known, it got no handover (a rolling restart of
        every holder lost the records whose owners had left: a review). So the handover
        first asks it for one key it should hold, and hands them all over only when it
        has none of that key (a refresh of a node that did not restart costs that one
        request); at most once per ``republish_interval`` for each contact."""
        if self.on_new_contact is None or known.address != sender:
            return  # (at another address: learn() hands over once that one is proven)
        now = self._now()
        last = self._rejoined_at.get(known.peer_id)
        if last is not None and now - last < self.config.republish_interval:
            return
        if len(self._rejoined_at) >= _REJOINED_MEMORY:
            self._rejoined_at = {
                p: t
                for p, t in self._rejoined_at.items()
                if now - t < self.config.republish_interval
            }
            if len(self._rejoined_at) >= _REJOINED_MEMORY:
                return
        self._rejoined_at[known.peer_id] = now
        logger.debug("%s looked up its own id: checking its storage", known.peer_id.short())
        self.on_new_contact(known, True)

    def check_alive(self, peer_id: PeerID) -> None:
        """``peer_id``'s side ended our connection, or a call could not reach it: ping it
        (if it is a contact), so that a peer that left leaves the table now, and one whose
        connection was merely reset stays."""
        node = self.table.get(peer_id)
        if node is None or peer_id in self._checking:
            return  # (one ping at a time: one reset fails every call in flight at once)
        try:
            self._ping_send.send_nowait(node)
        except trio.WouldBlock:  # full: the next failed request asks again
            return
        self._checking.add(peer_id)

    def _learn_sender(self, request: Request, sender: str | None) -> None:
        peer_id = request.peer_id
        if sender is None:
            self._note_client(peer_id)
            return
        address = self._address_of(sender, peer_id)
        if not address.dialable:
            return
        known = self.table.get(peer_id)
        if known is not None and known.address == sender:
            self.learn(known)
            return
        if known is not None and known.address is not None:
            self._moved[peer_id] = known.address  # (see _on_find_node)
            self._moved.move_to_end(peer_id)
            if len(self._moved) > _MOVED_MEMORY:
                self._moved.popitem(last=False)
        if address.host == request.remote_host or self.host.dialed(address):
            self.learn(NodeInfo(peer_id, sender))
        else:
            self._queue_proof(NodeInfo(peer_id, sender), host_group(request.remote_host))

    def _queue_proof(self, node: NodeInfo, source: str) -> None:
        """Have a prover dial ``node`` at its address and learn it if the handshake there
        proves its id; one claim at a time per ``source`` (a requesting host's group)."""
        if node.peer_id in self._proving or source in self._proving_from:
            return  # that claim, or that source's, waits first: it will come again
        try:
            self._proof_send.send_nowait((node, source))
        except trio.WouldBlock:
            return  # busy: it will ask again, or be named by others and answer
        self._proving.add(node.peer_id)
        self._proving_from.add(source)

    def _note_client(self, peer_id: PeerID) -> None:
        """``peer_id`` asked us something as a client (see the module's rules): it leaves
        the table, and replies do not bring it back."""
        if peer_id not in self._clients:
            if len(self._clients) >= _CLIENTS_REMEMBERED:
                self._clients.clear()
            node = self.table.get(peer_id)
            self.table.remove(peer_id)  # (a replacement too)
            if node is not None:
                self.note_left(node, "it asks as a client now")
        self._clients[peer_id] = self._now()

    def _recheck_client(self, node: NodeInfo) -> None:
        """``node``, a peer that asked us as a client, answered a call at its address
        (over its client's connection, most likely): dial that address on a connection of
        its own, at most once a ``CLIENT_RECHECK``, in case it listens there again."""
        now = self._now()
        if now - self._clients[node.peer_id] < CLIENT_RECHECK:
            return
        self._clients[node.peer_id] = now
        self._queue_proof(node, _RECHECK_SOURCE)

    async def _prove_senders(
        self, receive: trio.MemoryReceiveChannel[tuple[NodeInfo, str]]
    ) -> None:
        async for node, source in receive:
            assert node.address is not None
            try:
                address = self._address_of(node.address, node.peer_id)
                if await self.host.prove_address(address):
                    self.learn(node)
            finally:
                self._proving.discard(node.peer_id)
                self._proving_from.discard(source)

    async def run_pings(self) -> None:
        """Ping least-recently-seen contacts of full buckets, and dial the claimed addresses
        of senders that need checking, forever (a maintenance task)."""

        async def worker(receive: trio.MemoryReceiveChannel[NodeInfo]) -> None:
            async for queued in receive:
                # at the address the table holds now: a contact learnt at a new address
                # while its ping waited was evicted by the ping to its old one (a review)
                node = self.table.get(queued.peer_id)
                if node is None:
                    self._checking.discard(queued.peer_id)
                    continue  # it left meanwhile (a ping queued per failed call, before)
                try:
                    ping = PingRequest(self.sender)
                    response, busy = await self._request(node, ping, PingResponse)
                finally:
                    self._checking.discard(node.peer_id)
                now_held = self.table.get(node.peer_id)
                known = now_held is not None  # a failed ping may have evicted it already
                if now_held is not None and now_held.address != node.address:
                    continue  # it moved while the ping was under way: says nothing of it
                if busy:  # kept, but not refreshed: it has not answered
                    self.table.ping_result(node.peer_id, alive=None, now=self._now())
                    continue
                self.table.ping_result(node.peer_id, alive=response is not None, now=self._now())
                if known and node.peer_id not in self.table:
                    self.note_left(node, self.ping_failure(node))

        async with trio.open_nursery() as nursery:
            for _ in range(self.config.max_parallel_pings):
                nursery.start_soon(worker, self._ping_receive.clone())
            for _ in range(_PROVERS):
                nursery.start_soon(self._prove_senders, self._proof_receive.clone())

    # ---- handlers --------------------------------------------------------------------

    def _parse(self, kind: type[_M], request: Request) -> _M:
        """``request``'s body as a ``kind``; one that does not parse is ``bad_request``,
        and said once at WARNING: its sender runs another version of swarm, most likely (a
        mixed-versions trial: a peer of two days before joined, was listed, and had every
        store and get refused, which only DEBUG showed on either side)."""
        try:
            return kind.from_body(request.body)
        except ProtocolError as exc:
            self._warn_unparsable(request, exc)
            raise

    def _warn_unparsable(self, request: Request, exc: ProtocolError) -> None:
        now = self._now()
        if request.peer_id in self._unparsable or now < self._next_unparsable_warning:
            return  # once per peer, and at most once a minute (garbage from a crowd)
        if len(self._unparsable) >= _UNPARSABLE_REMEMBERED:
            self._unparsable.clear()
        self._unparsable.add(request.peer_id)
        self._next_unparsable_warning = now + _UNPARSABLE_WARNING_INTERVAL
        logger.warning(
            "peer %s at %s sent a %s this node cannot parse (%s): another version of swarm"
            " (then it should update), or a faulty peer? Its DHT requests are refused",
            request.peer_id.short(),
            request.remote_host,
            request.method,
            exc,
        )

    def _on_ping(self, request: Request) -> Reply:
        message = self._parse(PingRequest, request)
        self._learn_sender(request, message.sender)
        return Reply(PingResponse().to_body())

    def _on_find_node(self, request: Request) -> Reply:
        message = self._parse(FindNodeRequest, request)
        known = self.table.get(request.peer_id)
        self._learn_sender(request, message.sender)
        own_id = message.target == DHTID.from_peer_id(request.peer_id)
        if known is not None and own_id:
            self._rejoined(known, message.sender)
        nodes = self.table.nearest(message.target, self.config.k, exclude=request.peer_id)
        elsewhere = self._moved.get(request.peer_id) if own_id else None
        if elsewhere is not None and elsewhere != message.sender:
            # Its own PeerID, lately at another address: one of its own from before (a
            # restart on another port), or another process with its key (a copied key
            # file), which nothing else would tell it of. Named beside the k closest, it
            # dials that address to see (DHT._check_twin).
            nodes.append(NodeInfo(request.peer_id, elsewhere))
        return Reply(FindNodeResponse(tuple(nodes)).to_body())

    def _on_find_value(self, request: Request) -> Reply:
        message = self._parse(FindValueRequest, request)
        self._learn_sender(request, message.sender)
        entries: tuple[Entry, ...] | None = None
        more = False
        if self.storage is not None:
            record = self.storage.get(message.key)
            if record:
                entries, more = _page(record.values(), message.after)
        # Unlike the paper, a holder names its closest contacts beside the value (on a first
        # page): a node a store passed on its way holds a partial copy (that one store), and
        # a reader must learn of the closer nodes that hold every writer's subkeys. Later
        # pages of a paged read need none.
        nodes = (
            self.table.nearest(message.key, self.config.k, request.peer_id)
            if message.after is None
            else ()
        )
        return Reply(FindValueResponse(entries or None, tuple(nodes), more).to_body())

    def _on_store(self, request: Request) -> Reply:
        message = self._parse(StoreRequest, request)
        self._learn_sender(request, message.sender)
        owner = key_owner(message.name)
        source = self._quota_source(request.remote_host)
        accepted = []
        for entry in message.entries:
            if self.storage is None:
                accepted.append(False)
                continue
            try:
                accepted.append(self.storage.store(message.key, entry, owner, message.name, source))
            except RecordError as exc:
                logger.debug("refused a record from %s: %s", request.peer_id.short(), exc)
                accepted.append(False)
        nodes = (
            self.table.nearest(message.key, self.config.k, exclude=request.peer_id)
            if message.want_nodes
            else ()
        )
        return Reply(StoreResponse(tuple(accepted), tuple(nodes)).to_body())

    def _quota_source(self, remote_host: str) -> str | None:
        """Whom a STORE from ``remote_host`` is charged to in our storage's per-source
        quota: its host group, as the host's per-IP limits count (an IPv6 /64); None (not
        counted) for an unknown host, and for loopback unless ``storage_quota_loopback``."""
        if remote_host == "?":
            return None
        if not self.config.storage_quota_loopback and is_loopback_host(remote_host):
            return None
        return host_group(remote_host)

    # ---- calls -----------------------------------------------------------------------

    def has_free_slot(self) -> bool:
        """Whether no call of ours waits for a slot (a call made now may have to)."""
        return not self._limiter.statistics().tasks_waiting

    async def ping(self, node: NodeInfo, *, take_slot: bool = True) -> bool:
        """True when ``node`` answered a ping in time, or its bytes kept arriving while the
        ping waited (busy, not gone: see the module's rules). ``take_slot``: as
        :meth:`store`."""
        request = PingRequest(self.sender)
        response, busy = await self._request(node, request, PingResponse, take_slot=take_slot)
        return response is not None or busy

    async def find_node(self, node: NodeInfo, target: DHTID) -> FindNodeResponse | None:
        """``node``'s closest contacts to ``target``; None when it failed."""
        return await self._call(node, FindNodeRequest(self.sender, target), FindNodeResponse)

    async def find_value(
        self, node: NodeInfo, key: DHTID, after: bytes | None = None
    ) -> FindValueResponse | None:
        """``node``'s entries under ``key`` (those whose subkey orders ``after``, when given)
        and closest contacts; None when it failed."""
        request = FindValueRequest(self.sender, key, after)
        return await self._call(node, request, FindValueResponse)

    async def store(
        self,
        node: NodeInfo,
        key: DHTID,
        name: str,
        entries: tuple[Entry, ...],
        *,
        want_nodes: bool = True,
        take_slot: bool = True,
    ) -> StoreResponse | None:
        """Ask ``node`` to store ``entries`` (the reply also names its closest contacts to
        ``key`` when ``want_nodes``); None when it failed. ``take_slot=False``: outside the
        request slots (the caller bounds such calls itself)."""
        request = StoreRequest(self.sender, key, name, entries, want_nodes)
        return await self._call(node, request, StoreResponse, take_slot=take_slot)

    async def _call(
        self, node: NodeInfo, request: Message, response_type: type[_M], *, take_slot: bool = True
    ) -> _M | None:
        response, _ = await self._request(node, request, response_type, take_slot=take_slot)
        return response

    async def _request(
        self, node: NodeInfo, request: Message, response_type: type[_M], *, take_slot: bool = True
    ) -> tuple[_M | None, bool]:
        """``node``'s response (None when the call failed), and whether the call timed out
        while ``node``'s bytes kept arriving (then it does not count against ``node``)."""
        assert node.address is not None
        address = self._address_of(node.address, node.peer_id)
        method: str = getattr(request, "METHOD")  # noqa: B009 - a ClassVar of request types
        # Waiting for a slot is not the peer's fault: no deadline. A free slot is taken
        # without a scheduler pass (the call checkpoints when it sends).
        if take_slot:
            try:
                self._limiter.acquire_nowait()
            except trio.WouldBlock:
                await self._limiter.acquire()
        try:
            self.calls_sent += 1
            maybe_alive = True  # a timeout, or an error answer: slow or busy, not dead
            turned_away = False
            unreachable = False
            with trio.move_on_after(self.config.request_timeout) as deadline:
                try:
                    reply = await self.host.call(address, method, request.to_body())
                    response = response_type.from_body(reply.body)
                except (SwarmError, OSError) as exc:
                    logger.debug("%s to %s failed: %r", method, node.peer_id.short(), exc)
                    maybe_alive = isinstance(exc, RemoteError)
                    if method == PingRequest.METHOD and isinstance(exc, PeerUnavailableError):
                        if len(self._unreachable) > 1024:  # (each is read once, or never)
                            self._unreachable.clear()
                        self._unreachable.add(node.peer_id)
                    # up, but at its limits for our address (which a neighbour behind our
                    # NAT may have used up by flooding it): no sign that it left
                    turned_away = isinstance(exc, PeerBusyError)
                    unreachable = isinstance(exc, PeerUnavailableError) and not turned_away
                else:
                    self._unreachable.discard(node.peer_id)
                    if node.peer_id in self._clients:
                        self._recheck_client(node)
                    elif self._address_proven(node, address):
                        self.learn(node)
                    return response, False
        finally:
            if take_slot:
                self._limiter.release()
        self.calls_failed += 1
        if deadline.cancelled_caught and self.heard_lately(node):
            logger.debug("%s to %s timed out; its bytes keep coming", method, node.peer_id.short())
            return None, True
        if deadline.cancelled_caught:
            self.mark_silent(node)
        if not turned_away or self._busy_too_long(node):
            # (a failed ping decides: it is not pinged again)
            unreachable = unreachable and method != PingRequest.METHOD
            self.record_failure(node, timed_out=maybe_alive or turned_away, unreachable=unreachable)
        return None, False

    def _busy_too_long(self, node: NodeInfo) -> bool:
        """Whether a contact that turned us away as busy has not been heard from for a
        whole ``refresh_interval``: then it counts as failing after all. Busy is a sign of
        life only for so long: whatever answers busy at a departed peer's address (another
        process, an attacker) must not keep a dead contact in our table forever."""
        seen = self.table.last_seen(node.peer_id)
        return seen is not None and self._now() - seen > self.config.refresh_interval

    def _address_proven(self, node: NodeInfo, address: Address) -> bool:
        """Whether ``node`` is known to listen at its address: the table holds it there, or
        we dialed that address and the handshake proved its id. A reply over a connection
        pooled for another reason (the peer dialed us; a client-mode peer does) proves its
        id only: a third party that named it at a made-up address must not put it, or that
        address, into the table."""
        known = self.table.get(node.peer_id)
        return (known is not None and known.address == node.address) or self.host.dialed(address)

    def ping_failure(self, node: NodeInfo) -> str:
        """Why ``node``'s last failed ping failed, in words for the "peer left" line."""
        if node.peer_id in self._unreachable:
            self._unreachable.discard(node.peer_id)
            return "its address no longer takes connections"
        return "no answer to a ping"

    def heard_lately(self, node: NodeInfo) -> bool:
        """Whether bytes from ``node`` arrived, on any connection with it, within the last
        ``request_timeout``: a request to it that timed out (or that a lookup gave up on)
        meanwhile waited behind them. Only for so long, as for a busy signal: a contact
        that sends bytes but has not answered nor asked us anything for a whole
        ``refresh_interval`` counts as failing after all (any stream or unknown method
        would keep it listed otherwise)."""
        since = trio.current_time() - self.config.request_timeout
        return self.host.last_heard(node.peer_id) > since and not self._busy_too_long(node)

    def mark_silent(self, node: NodeInfo) -> None:
        """``node`` let a request of ours go unanswered, nothing heard from it since (see
        the module's rules). An earlier mark stands: a lookup that asked it without
        waiting (it was silent already) learned nothing new."""
        if self.is_silent(node):
            return
        if len(self._silent) >= _MAX_SILENT:
            del self._silent[next(iter(self._silent))]  # the oldest mark
        self._silent[node.peer_id] = trio.current_time()

    def is_silent(self, node: NodeInfo) -> bool:
        """Whether lookups should ask ``node`` without waiting for it: marked silent within
        ``SILENT_FOR`` seconds, and no byte from it since."""
        since = self._silent.get(node.peer_id)
        if since is None:
            return False
        if self.host.last_heard(node.peer_id) > since or (trio.current_time() - since > SILENT_FOR):
            del self._silent[node.peer_id]
            return False
        return True

    def record_failure(self, node: NodeInfo, *, timed_out: bool, unreachable: bool = False) -> None:
        """Count a failed or timed-out request against ``node`` (see the routing table's
        rules; ``unreachable``: a refused dial or a broken connection, then pinged where a
        replacement waits); logs when that takes it out of the table. A failure at an
        address the table no longer holds for the node says nothing of it (it moved while
        the request was under way: a ping to its old address evicted it; a review)."""
        current = self.table.get(node.peer_id)
        if current is not None and current.address != node.address:
            return
        known = current is not None
        if self.table.record_failure(node.peer_id, timed_out=timed_out, unreachable=unreachable):
            self.check_alive(node.peer_id)
        if known and node.peer_id not in self.table:
            # timed out, or answered with an error (slow, busy, or another version)
            why = "requests timed out or were refused" if timed_out else "a request failed"
            self.note_left(node, why)

    def _address_of(self, hostport: str, peer_id: PeerID) -> Address:
        key = (hostport, peer_id)
        address = self._addresses.get(key)
        if address is None:
            if len(self._addresses) > 4096:
                self._addresses.clear()
            address = self._addresses[key] = Address.parse(hostport).with_peer_id(peer_id)
        return address


def _page(entries: Iterable[Entry], after: bytes | None) -> tuple[tuple[Entry, ...], bool]:
    """The entries for one FIND_VALUE reply, in subkey order, from the first after the
    cursor ``after`` until the value budget is spent, and whether any are left over."""
    ordered = sorted(((subkey_order(e.subkey), e) for e in entries), key=itemgetter(0))
    chosen: list[Entry] = []
    spent = 0
    for cursor, entry in ordered:
        if after is not None and cursor <= after:
            continue
        spent += len(entry.value) + _ENTRY_OVERHEAD
        if chosen and spent > _MAX_REPLY_VALUE_BYTES:
            return tuple(chosen), True
        chosen.append(entry)
    return tuple(chosen), False
