"""The blocking twin of the peer's DHT, for the background peer (see peer.background)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from protocol.address import Address
from protocol.dhtid import DHTID
from protocol.identity import PeerID
from protocol.records import Subkey

from .dht import EntriesRead, LookupStats
from .dht.lookup import LookupResult
from .dht.node import address_list

if TYPE_CHECKING:
    from .background_peer import BackgroundPeer

__all__ = ["BackgroundDHT"]


class BackgroundDHT:
    """The blocking twin of :class:`peer.dht.DHT`: same methods, no ``await`` (but for the
    ones the peer runs itself: ``serve``, ``bootstrap``, ``hand_over``)."""

    def __init__(self, owner: BackgroundPeer) -> None:
        self._owner = owner

    def store(self, key: str, value: Any, ttl: float = 60.0, subkey: Subkey = None) -> bool:
        """See :meth:`peer.dht.DHT.store`.

        Raises:
            RecordTooLargeError: (a ValueError) a key, subkey or value over its limit.
            RecordError: a subkey or key bound to another peer; a key that is not a str.
            ValueError: a ttl out of range. TypeError: a value msgpack cannot serialize.
            PeerStoppedError: the peer is no longer running.
        """
        dht = self._owner.peer.dht
        return self._owner.run(dht.store, key, value, ttl, subkey)

    def get(self, key: str, *, latest: bool = True) -> Any:
        """See :meth:`peer.dht.DHT.get`.

        Raises:
            RecordTooLargeError: (a ValueError) the key is over its limit.
            RecordError: the key is not a str.
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(partial(self._owner.peer.dht.get, key, latest=latest))

    def get_entries(self, key: str, *, latest: bool = True) -> dict[Subkey, tuple[Any, float]]:
        """See :meth:`peer.dht.DHT.get_entries`.

        Raises:
            RecordTooLargeError: (a ValueError) the key is over its limit.
            RecordError: the key is not a str.
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(partial(self._owner.peer.dht.get_entries, key, latest=latest))

    def read_entries(self, key: str, *, latest: bool = True) -> EntriesRead:
        """See :meth:`peer.dht.DHT.read_entries`.

        Raises:
            RecordTooLargeError: (a ValueError) the key is over its limit.
            RecordError: the key is not a str.
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(partial(self._owner.peer.dht.read_entries, key, latest=latest))

    def find_peers(self) -> list[tuple[PeerID, str]]:
        """See :meth:`peer.dht.DHT.find_peers`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(self._owner.peer.dht.find_peers)

    def contact(self, addresses: Sequence[Address | str]) -> list[Address]:
        """See :meth:`peer.dht.DHT.contact`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(self._owner.peer.dht.contact, address_list(addresses))

    @property
    def contact_errors(self) -> dict[str, str]:
        """See :attr:`peer.dht.DHT.contact_errors`."""
        return self._owner.run_sync(lambda: dict(self._owner.peer.dht.contact_errors))

    @property
    def initial_peers_answered(self) -> dict[str, PeerID]:
        """See :attr:`peer.dht.DHT.initial_peers_answered`."""
        return self._owner.run_sync(lambda: dict(self._owner.peer.dht.initial_peers_answered))

    @property
    def stats(self) -> LookupStats:
        """A copy of :attr:`peer.dht.DHT.stats` (this node's lookups so far), read on the
        peer's loop."""
        return self._owner.run_sync(lambda: copy.copy(self._owner.peer.dht.stats))

    def find_nodes(self, target: DHTID) -> LookupResult:
        """See :meth:`peer.dht.DHT.find_nodes`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(self._owner.peer.dht.find_nodes, target)

    def refresh(self) -> None:
        """See :meth:`peer.dht.DHT.refresh`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        self._owner.run(self._owner.peer.dht.refresh)

    def republish(self) -> int:
        """See :meth:`peer.dht.DHT.republish`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(self._owner.peer.dht.republish)

    def drop_silent_contacts(self) -> int:
        """See :meth:`peer.dht.DHT.drop_silent_contacts`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run(self._owner.peer.dht.drop_silent_contacts)

    def now(self) -> float:
        """See :meth:`peer.dht.DHT.now`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run_sync(self._owner.peer.dht.now)

    def routing_table_peers(self) -> list[tuple[PeerID, str]]:
        """See :meth:`peer.dht.DHT.routing_table_peers`.

        Raises:
            PeerStoppedError: the peer is no longer running.
        """
        return self._owner.run_sync(self._owner.peer.dht.routing_table_peers)
