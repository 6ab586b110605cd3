"""The DHT's four RPCs over the RPC host: handlers for others' requests, calls to others.
The handlers are in :mod:`.serving`, the contact bookkeeping in :mod:`.learning` (base
classes of :class:`DHTProtocol`); the rules below hold for all three.

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
  A reply over a connection we dialed at another address teaches us the node at that
  one: a peer killed and restarted elsewhere with its key answered calls to its dead
  address over its new connection, and a client kept it at the dead address for half an
  hour and more (an outside tester's soak).
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
- Nor does a timeout (or a dial or connection gone silent: ``PeerSilentError``) while no
  request of ours sent since was answered, for the first ``CUT_OFF_GRACE`` seconds of
  such a silence: our own link may be the one stalled or down, and then every contact
  fails at once. A client-mode volunteer whose link stalled for half a second lost every
  contact to its in-flight requests' timeouts, and nobody dials a client back: it stepped
  alone until its refresh re-dialed its initial peers. Such a ping keeps the contact,
  unrefreshed, as above; nor is the node marked silent. (Bytes from anyone are not
  enough: after a stall, fresh connections work while the old ones still carry what was
  sent during it; a lookup's give-up counts only when answers came meanwhile, see
  ``iterative_lookup``.)
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
from collections.abc import Callable
from typing import TypeVar

import trio

from protocol.address import Address
from protocol.dhtid import DHTID
from protocol.errors import ProtocolError, RemoteProtocolError, SwarmError
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

from ..errors import PeerBusyError, PeerSilentError, PeerUnavailableError, RemoteError
from ..host import RpcHost
from ..network import out_of_files
from .config import DHTConfig
from .learning import CLIENT_RECHECK as CLIENT_RECHECK
from .learning import Learning, Unanswered
from .routing import RoutingTable
from .serving import Serving
from .storage import DHTStorage

logger = logging.getLogger(__name__)

_PING_QUEUE = 256
_PROOF_QUEUE = 64  # claimed sender addresses waiting to be dialed; a full queue drops more
SILENT_FOR = 60.0
"""Seconds a node that went silent is asked without being waited for (see the module's
rules); then a lookup waits its hedge delay for it again, once."""
_MAX_SILENT = 4096
_REFUSERS_REMEMBERED = 1024  # peers that refused our requests as unparsable, named once
_REFUSED_WARNING_INTERVAL = 60.0
CUT_OFF_GRACE = 60.0
"""Seconds during which requests that time out while no request of ours sent since is
answered do not count against their nodes (see the module's rules): our own link may
have stalled. A silence that lasts longer counts, so that the last contact of a node
that is not cut off but alone (its only contact froze) still leaves in time."""

_M = TypeVar("_M", bound=Message)


class DHTProtocol(Learning, Serving):
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
        self.has_initial_peers = False
        """Set by ``Joining.bootstrap``: the line that says the table emptied is then a
        WARNING (INFO for a network's first node) and names them among those it pings."""
        self.calls_sent = 0
        self.calls_failed = 0
        # contacts whose last ping could not connect (their port closed: a clean exit, or
        # a restart elsewhere), for the "peer left" line; see ping_failure
        self._unreachable: set[PeerID] = set()
        self._unparsable: set[PeerID] = set()  # senders of requests we could not parse
        self._silent: dict[PeerID, float] = {}  # since when (trio time): see is_silent
        self._cut_off_at: float | None = None  # see _cut_off (trio time)
        self._answered_sent = -math.inf  # when the latest-sent request answered was sent
        # peers whose requests said they are clients (no sender), until one names an
        # address or a dial proves it -> when they last asked, or their address was dialed
        self._clients: dict[PeerID, float] = {}
        # known contacts that looked up their own id (a restart with the same identity),
        # by when we last handed keys over to them for it: see _on_find_node
        self._rejoined_at: dict[PeerID, float] = {}
        # peer -> the address a contact was known at before its latest claim of another
        self._moved: OrderedDict[PeerID, str] = OrderedDict()
        self._next_unparsable_warning = -math.inf
        # peers that refused a request of ours as unparsable (or sent a reply we could not
        # parse), each named once at WARNING, at most once a minute: see _warn_refused
        self._refusers: set[PeerID] = set()
        self._next_refused_warning = -math.inf

    # ---- calls -----------------------------------------------------------------------

    def has_free_slot(self) -> bool:
        """Whether no call of ours waits for a slot (a call made now may have to)."""
        return not self._limiter.statistics().tasks_waiting

    async def ping(self, node: NodeInfo, *, take_slot: bool = True) -> bool:
        """True when ``node`` answered a ping in time, or its bytes kept arriving while the
        ping waited (busy, not gone: see the module's rules). ``take_slot``: as
        :meth:`store`."""
        return await self.ping_or_why(node, take_slot=take_slot) is None

    async def ping_or_why(self, node: NodeInfo, *, take_slot: bool = True) -> str | None:
        """:meth:`ping`, saying why it failed: None when ``node`` answered (or was busy),
        else a short reason for a person. A node that answered with an error or with a
        reply we cannot parse runs another version of swarm, most likely: "no answer"
        told a volunteer whose bootstrap node was upgraded first nothing true (a tester)."""
        request = PingRequest(self.sender)
        errors: list[BaseException] = []
        response, unanswered = await self._request(
            node, request, PingResponse, take_slot=take_slot, errors=errors
        )
        if response is not None or unanswered is Unanswered.BUSY:
            return None
        if not errors:
            return f"no answer to a ping within {self.config.request_timeout:g} s"
        exc = errors[-1]
        if isinstance(exc, RemoteError):
            return f"it answered a ping with an error ({exc}): another version of swarm?"
        if isinstance(exc, ProtocolError):
            return f"its answer to a ping does not parse ({exc}): another version of swarm?"
        return f"no answer to a ping ({exc})" if str(exc) else "no answer to a ping"

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
        self,
        node: NodeInfo,
        request: Message,
        response_type: type[_M],
        *,
        take_slot: bool = True,
        errors: list[BaseException] | None = None,
    ) -> tuple[_M | None, Unanswered | None]:
        """``node``'s response (None when the call failed), and when it failed, what that
        says of ``node`` (only ``Unanswered.FAILED`` counted against it); the call's error,
        if any, goes into ``errors``."""
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
            silent = False  # nothing came from it in time: a dial or connection gone silent
            ours = False
            asked = trio.current_time()
            with trio.move_on_after(self.config.request_timeout) as deadline:
                try:
                    reply = await self.host.call(address, method, request.to_body())
                    response = response_type.from_body(reply.body)
                except (SwarmError, OSError) as exc:
                    logger.debug("%s to %s failed: %r", method, node.peer_id.short(), exc)
                    if errors is not None:
                        errors.append(exc)
                    self._warn_refused(node, method, exc)
                    maybe_alive = isinstance(exc, RemoteError)
                    # this process out of file descriptors: no news of the contact (each
                    # contact was evicted as "a request failed" and the table emptied within
                    # 0.1 s of a tester's process running out, its peers all well)
                    ours = out_of_files(exc)
                    if method == PingRequest.METHOD and isinstance(exc, PeerUnavailableError):
                        if len(self._unreachable) > 1024:  # (each is read once, or never)
                            self._unreachable.clear()
                        self._unreachable.add(node.peer_id)
                    # up, but at its limits for our address (which a neighbour behind our
                    # NAT may have used up by flooding it): no sign that it left
                    turned_away = isinstance(exc, PeerBusyError)
                    silent = isinstance(exc, PeerSilentError)
                    unreachable = isinstance(exc, PeerUnavailableError) and not turned_away
                else:
                    self._answered_sent = max(self._answered_sent, asked)
                    self._unreachable.discard(node.peer_id)
                    if node.peer_id in self._clients:
                        self._recheck_client(node)
                    elif (elsewhere := self.host.reached_elsewhere(address)) is not None:
                        # over the connection we dialed at another address: it listens
                        # there (restarted elsewhere?), not provably at this one
                        self.learn(NodeInfo(node.peer_id, elsewhere))
                    elif self._address_proven(node, address):
                        self.learn(node)
                    return response, None
        finally:
            if take_slot:
                self._limiter.release()
        self.calls_failed += 1
        if self.host.stopped or ours:  # our shutdown or our limits: no news of the contact
            return None, Unanswered.CUT_OFF
        if deadline.cancelled_caught and self.heard_lately(node):
            logger.debug("%s to %s timed out; its bytes keep coming", method, node.peer_id.short())
            return None, Unanswered.BUSY
        if (deadline.cancelled_caught or silent) and self._cut_off(asked):
            logger.debug(
                "%s to %s timed out; nothing came from anyone", method, node.peer_id.short()
            )
            return None, Unanswered.CUT_OFF
        if deadline.cancelled_caught:
            self.mark_silent(node)
        if not turned_away or self._busy_too_long(node):
            # (a failed ping decides: it is not pinged again)
            unreachable = unreachable and method != PingRequest.METHOD
            self.record_failure(node, timed_out=maybe_alive or turned_away, unreachable=unreachable)
        return None, Unanswered.FAILED

    def _warn_refused(self, node: NodeInfo, method: str, exc: BaseException) -> None:
        """Say once per peer, at WARNING (at most once a minute), that a peer refused a
        request of ours as one it cannot parse, or answered one with a reply we cannot
        parse: one of us runs another version of swarm. Only the receiving side said so
        (a mixed-versions trial: an older node's hand-overs to a newer one were refused 8
        times, and its log at the default level said nothing)."""
        refused = isinstance(exc, RemoteError) and exc.code == "bad_request"
        if not refused and not isinstance(exc, RemoteProtocolError):
            return
        now = self._now()
        if node.peer_id in self._refusers or now < self._next_refused_warning:
            return
        if len(self._refusers) >= _REFUSERS_REMEMBERED:
            self._refusers.clear()
        self._refusers.add(node.peer_id)
        self._next_refused_warning = now + _REFUSED_WARNING_INTERVAL
        what = "refused our" if refused else "sent a reply this node cannot parse to our"
        logger.warning(
            "peer %s at %s %s %s (%s): another version of swarm (the older side should"
            " update), or a faulty peer?",
            node.peer_id.short(),
            node.address,
            what,
            method,
            exc,
        )

    def _cut_off(self, asked: float) -> bool:
        """Whether a request sent at ``asked`` that timed out says nothing of its node: no
        request of ours sent since was answered (our link may be the one stalled), and this
        silence began less than ``CUT_OFF_GRACE`` seconds ago (see the module's rules)."""
        if self._answered_sent >= asked:
            return False
        began = self._cut_off_at
        if began is None or self._answered_sent >= began:
            began = self._cut_off_at = asked  # a new silence
        return trio.current_time() - began < CUT_OFF_GRACE

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
