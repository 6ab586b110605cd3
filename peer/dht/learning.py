"""The DHT protocol's contact bookkeeping: what the routing table learns from requests and
replies (senders, proven or queued for a dial; clients; contacts that join, rejoin and
leave), and the pings of contacts that may have left (``Learning``, a base class of
:class:`~.protocol.DHTProtocol`). The rules it keeps, "the module's rules" below, are
written at the top of :mod:`peer.dht.protocol`.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from protocol.address import Address
from protocol.identity import PeerID
from protocol.messages import NodeInfo, PingRequest, PingResponse

from ..host import RpcHost
from ..remote_hosts import host_group
from ..rpc import Request
from .config import DHTConfig
from .routing import RoutingTable

# (its lines are DHTProtocol's, and were always logged under its module's name)
logger = logging.getLogger("peer.dht.protocol")

_REJOIN_AFTER_JOIN = 60.0
"""Seconds after a contact joined during which its own-id lookup hands nothing over again."""
_REJOINED_MEMORY = 4096
"""Contacts remembered for the once-per-republish-interval rule of ``_rejoined``."""
_MOVED_MEMORY = 256  # contacts' last other addresses, for their own lookups (_on_find_node)
_PROVERS = 4  # claimed addresses dialed at once (a dial to a silent host lasts dial_timeout)
CLIENT_RECHECK = 60.0
"""Seconds between dials of the old address of a peer that asked us as a client, tried
when it answers a call there (see the module's rules): it may listen there again."""
_CLIENTS_REMEMBERED = 4096
_RECHECK_SOURCE = "(a client's old address)"  # proofs of those wait for each other


class Unanswered(enum.Enum):
    """What a call that got no answer says of the node asked (see the module's rules)."""

    FAILED = "failed"  # counted against the node
    BUSY = "busy"  # timed out while the node's bytes kept arriving: up, its link full
    CUT_OFF = "cut off"  # timed out, no later request of ours answered: our link, perhaps


class Learning:
    """The contact bookkeeping of :class:`~.protocol.DHTProtocol`, one of its base classes
    (the attributes below are the protocol's, set in its constructor)."""

    host: RpcHost
    table: RoutingTable
    config: DHTConfig
    sender: str | None
    _now: Callable[[], float]
    _ping_send: trio.MemorySendChannel[NodeInfo]
    _ping_receive: trio.MemoryReceiveChannel[NodeInfo]
    _checking: set[PeerID]
    _proof_send: trio.MemorySendChannel[tuple[NodeInfo, str]]
    _proof_receive: trio.MemoryReceiveChannel[tuple[NodeInfo, str]]
    _proving: set[PeerID]
    _proving_from: set[str]
    on_new_contact: Callable[[NodeInfo, bool], None] | None
    _deserted: bool
    _alone_after: NodeInfo | None
    has_initial_peers: bool
    _clients: dict[PeerID, float]
    _rejoined_at: dict[PeerID, float]
    _moved: OrderedDict[PeerID, str]
    # and three of its methods (its calls)
    _address_of: Callable[[str, PeerID], Address]
    _request: Callable[..., Awaitable[tuple[Any, Unanswered | None]]]
    ping_failure: Callable[[NodeInfo], str]

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
            # (a peer with no initial peers, the first bootstrap node, has none to ping: its
            # line said it would, an outside tester saw)
            initial = ", and its initial peers" if self.has_initial_peers else ""
            logger.log(
                logging.WARNING if self.has_initial_peers else logging.INFO,
                "this peer knows no other peer now (its last contact, %s, left): its stores "
                "reach no other node and its gets find nothing until one answers again; it "
                "pings the departed contacts%s at each refresh",
                last.peer_id.short(),
                initial,
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
            self._remember_rejoin(node.peer_id, self._now() - window + _REJOIN_AFTER_JOIN)
            self.on_new_contact(node, False)

    def _remember_rejoin(self, peer_id: PeerID, at: float) -> bool:
        """Note ``peer_id``'s handover ``at``; False when ``_REJOINED_MEMORY`` contacts had
        one within ``republish_interval``. Older notes go first: each peer ever joined was
        kept for good (an outside tester's bootstrap node, 7,000 distinct visitors: 7,000
        notes, one per fresh key)."""
        if len(self._rejoined_at) >= _REJOINED_MEMORY:
            now = self._now()
            self._rejoined_at = {
                p: t
                for p, t in self._rejoined_at.items()
                if now - t < self.config.republish_interval
            }
            if len(self._rejoined_at) >= _REJOINED_MEMORY:
                return False
        self._rejoined_at[peer_id] = at
        return True

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
        if not self._remember_rejoin(known.peer_id, now):
            return
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
                    response, unanswered = await self._request(node, ping, PingResponse)
                finally:
                    self._checking.discard(node.peer_id)
                now_held = self.table.get(node.peer_id)
                known = now_held is not None  # a failed ping may have evicted it already
                if now_held is not None and now_held.address != node.address:
                    continue  # it moved while the ping was under way: says nothing of it
                if unanswered in (Unanswered.BUSY, Unanswered.CUT_OFF):
                    # kept, but not refreshed: it has not answered (busy, or we were cut off)
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
