"""The DHT protocol's handlers: what this node answers to others' ``dht.ping``,
``dht.find_node``, ``dht.find_value`` and ``dht.store`` (``Serving``, a base class of
:class:`~.protocol.DHTProtocol`; the learning rules its requests follow are written at the
top of :mod:`peer.dht.protocol`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import TypeVar

from protocol.dhtid import DHTID
from protocol.errors import ProtocolError
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

from ..host import RpcHost
from ..remote_hosts import host_group, is_loopback_host
from ..rpc import Reply, Request
from .config import DHTConfig
from .routing import RoutingTable
from .storage import DHTStorage

# (its lines are DHTProtocol's, and were always logged under its module's name)
logger = logging.getLogger("peer.dht.protocol")

# A FIND_VALUE reply carries at most this many value bytes (the frame limit is a few MiB);
# a key holding more answers in pages (the reply says ``more``; the caller asks again
# ``after`` the last subkey it got). A key may hold 1024 subkeys of 16 KiB.
_MAX_REPLY_VALUE_BYTES = 1 << 20
_ENTRY_OVERHEAD = 200  # subkey, expiration, signature and msgpack headers, generously

_M = TypeVar("_M", bound=Message)
_UNPARSABLE_REMEMBERED = 1024  # senders of unparsable requests, each named once
_UNPARSABLE_WARNING_INTERVAL = 60.0


class Serving:
    """The handlers of :class:`~.protocol.DHTProtocol`, one of its base classes (the
    attributes below are the protocol's, set in its constructor)."""

    host: RpcHost
    table: RoutingTable
    storage: DHTStorage | None
    config: DHTConfig
    _now: Callable[[], float]
    _unparsable: set[PeerID]
    _next_unparsable_warning: float
    _moved: OrderedDict[PeerID, str]
    # and two of its methods (its contact bookkeeping's)
    _learn_sender: Callable[[Request, str | None], None]
    _rejoined: Callable[[NodeInfo, str | None], None]

    def register(self) -> None:
        """Install the four handlers on the host."""
        self.host.register_quick(PingRequest.METHOD, self._on_ping)
        self.host.register_quick(FindNodeRequest.METHOD, self._on_find_node)
        self.host.register_quick(FindValueRequest.METHOD, self._on_find_value)
        self.host.register_quick(StoreRequest.METHOD, self._on_store)

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
            " (then it should update), or a faulty peer? Such requests are refused",
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
