"""The DHT's one config dataclass."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from protocol.messages import MAX_NODES
from protocol.records import MAX_VALUE_BYTES

from ..config_types import check_field_types
from .storage import ENTRY_OVERHEAD


@dataclass(frozen=True, slots=True)
class DHTConfig:
    """Tuning of one DHT node. The defaults follow the Kademlia paper unless noted."""

    k: int = 20  # bucket size, and how many nodes hold each key (see ``replicas``)
    # How many of the closest nodes a store reaches: None means k, the paper's rule. Fewer
    # replicas cost fewer STORE RPCs (hivemind 1.1's DHTNode stores to 5 of k = 20) and
    # survive less churn: a key is lost when all its holders leave before a republish.
    replicas: int | None = None
    alpha: int = 3  # requests in flight per lookup
    # A get ends once this many of the k closest nodes holding the key have answered
    # (their entries merged, newest version of each subkey; at most k count); the paper's
    # FIND_VALUE stops at the first.
    value_quorum: int = 3
    request_timeout: float = 3.0  # seconds for one DHT RPC, connection included
    # When no initial peer answered and some turned us away as busy (their limits for our
    # address: a crowd behind one NAT joining at once), a join dials those again, backing
    # off, and starts no new try after this many seconds (0: no retries). With the
    # HostConfig defaults (a burst of 128, then 16 per second per host) 30 s lets a crowd
    # of 600 from one host in; a node still turning us away then is likely held full by
    # connections that do not idle out, and a volunteer is better told than kept waiting.
    busy_join_timeout: float = 30.0
    # A get keeps only as many requests in flight as it still needs holders; after a silence
    # of twice its first answer's delay (before one, of recent lookups' first answers), at
    # most this long, it asks one more node (a dead or frozen node among the closest then
    # delays it about two round trips, not request_timeout).
    hedge_after: float = 1.0
    # DHT RPCs this node has in flight at once (its lookups queue for a slot beyond, and
    # a slot's wait does not count toward request_timeout). Enough for one lookup's final
    # fan-out; more only buys timeouts when the CPU, not the network, is the bottleneck.
    max_concurrent_requests: int = 16
    # A bucket with no lookup into its range and no contact seen in it for this long is
    # refreshed by a lookup of a random id in it (BEP 5 uses 15 minutes, the paper an hour).
    refresh_interval: float = 600.0
    # How often an owner re-stores the records it put into the DHT while they are valid,
    # so they move to the nodes that are closest *now* (joins, deaths, healed partitions).
    republish_interval: float = 300.0
    # Records with less than this many seconds left are not republished (they would be
    # gone before anyone missed them).
    republish_margin: float = 5.0
    max_republished_records: int = 10_000  # bounds the owner's republish list
    client_mode: bool = False  # query and store, never store for others nor enter tables
    max_stored_keys: int = 100_000  # keys this node stores for others; new keys refused beyond
    # and bytes of values, each entry counting 512 more (storage.ENTRY_OVERHEAD: its memory
    # cost); new entries refused beyond
    max_stored_bytes: int = 256 << 20
    # One remote host (an IPv4 address, an IPv6 /64: peer.remote_hosts.host_group) holds at most
    # this share of each limit above (keys where it holds an entry; bytes of its entries),
    # so that it cannot fill the store and have every other STORE refused until its
    # entries expire: it takes 8 hosts to fill a node. 1/8 still lets one honest host (a
    # neighbour handing its keys over, a NAT's crowd) hold 12,500 keys and 32 MiB here
    # (about 60k small entries; on a bootstrap node, 1 MiB of its 8: about 1,900).
    max_stored_share_per_host: float = 0.125
    # Count loopback hosts too. Off, as HostConfig.rate_limit_loopback: local experiments
    # run hundreds of peers on 127.0.0.1, one host to the quota.
    storage_quota_loopback: bool = False
    # Failed RPCs in a row after which a contact leaves its bucket even when no replacement
    # waits; with a replacement it leaves at the first failure that is not a timeout.
    max_failures: int = 3
    # A full bucket pings its least-recently-seen contact before choosing between it and a
    # newcomer only when that contact was last heard from this long ago (BEP 5's "good"
    # nodes); failed RPCs evict dead contacts sooner anyway. Each refresh also pings every
    # contact quiet for this long and drops those that do not answer (a peer that went
    # quiet, then died, meets no failed request otherwise).
    ping_after: float = 60.0
    # Concurrent pings of least-recently-seen contacts of full buckets.
    max_parallel_pings: int = 8

    @property
    def store_replicas(self) -> int:
        """How many of the closest nodes each store reaches (``replicas``, or k)."""
        return self.k if self.replicas is None else self.replicas

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in (
            "k",
            "alpha",
            "value_quorum",
            "max_concurrent_requests",
            "max_republished_records",  # (records not on the list are never republished)
            "max_stored_keys",
            "max_stored_bytes",
            "max_failures",
            "max_parallel_pings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(
                    f"DHTConfig.{name} must be an integer of at least 1, got {value!r}"
                )
        if self.replicas is not None and not (
            isinstance(self.replicas, numbers.Integral)
            and not isinstance(self.replicas, bool)
            and 1 <= self.replicas <= self.k
        ):
            raise ValueError(
                f"DHTConfig.replicas must be None (k) or an integer in [1, k={self.k}], "
                f"got {self.replicas!r}"
            )
        if self.k > MAX_NODES:  # the k closest travel in one reply
            raise ValueError(
                f"DHTConfig.k must be at most {MAX_NODES} (the nodes one DHT reply may name, "
                f"protocol.messages.MAX_NODES), got {self.k}"
            )
        for name in ("request_timeout", "hedge_after", "refresh_interval", "republish_interval"):
            value = getattr(self, name)
            if not value > 0:  # NaN too; math.inf: never
                raise ValueError(f"DHTConfig.{name} must be positive seconds, got {value!r}")
        for name in ("busy_join_timeout", "republish_margin", "ping_after"):
            value = getattr(self, name)
            if not value >= 0:  # NaN too
                raise ValueError(f"DHTConfig.{name} must be seconds >= 0, got {value!r}")
        if not 0 < self.max_stored_share_per_host <= 1:
            raise ValueError(
                "DHTConfig.max_stored_share_per_host must be in (0, 1], "
                f"got {self.max_stored_share_per_host!r}"
            )
        largest = MAX_VALUE_BYTES + ENTRY_OVERHEAD
        if self.max_stored_bytes * self.max_stored_share_per_host < largest:
            raise ValueError(
                "DHTConfig: max_stored_bytes x max_stored_share_per_host must hold one "
                f"largest entry ({largest} bytes: a {MAX_VALUE_BYTES}-byte value and its "
                f"{ENTRY_OVERHEAD} bytes of overhead), got {self.max_stored_bytes} x "
                f"{self.max_stored_share_per_host}"
            )
