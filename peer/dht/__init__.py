"""Kademlia DHT: routing table, local storage, iterative lookups, RPCs, and the node."""

from __future__ import annotations

from .config import DHTConfig as DHTConfig
from .lookup import LookupResult as LookupResult
from .lookup import LookupState as LookupState
from .lookup import iterative_lookup as iterative_lookup
from .node import DHT as DHT
from .node import LookupStats as LookupStats
from .reading import EntriesRead as EntriesRead
from .routing import RoutingTable as RoutingTable
from .storage import DHTStorage as DHTStorage
from .storage import merge_entry as merge_entry

__all__ = [
    "DHT",
    "DHTConfig",
    "DHTStorage",
    "EntriesRead",
    "LookupResult",
    "LookupState",
    "LookupStats",
    "RoutingTable",
    "iterative_lookup",
    "merge_entry",
]
