"""Token buckets keyed by remote host: how often one host may start an expensive exchange.

An inbound Noise handshake costs the responder two X25519 operations, a key pair and a
signature (about 2 ms of CPU per connection measured on a ``swarm bootstrap``), while the
opener may replay one recorded first message for free. Counting only open connections
(``HostConfig.max_connections_per_ip``) does not bound that: a host that opens and closes
connections in a loop keeps a core busy. A bucket per host bounds the rate, and a burst
lets a crowd behind one NAT join at once.
"""

from __future__ import annotations

import math
from collections import OrderedDict

__all__ = ["HostRateLimiter"]

_MAX_HOSTS = 4096
"""Buckets kept; beyond, the least recently used host is forgotten (it starts full again)."""


class HostRateLimiter:
    """``rate`` events per second per key on average, in bursts of at most ``burst``.

    A key's bucket holds up to ``burst`` tokens, refills at ``rate`` per second, and each
    event takes one token. The clock is passed in (trio time), so virtual time works.
    ``rate`` of ``math.inf`` turns the limit off.
    """

    def __init__(self, rate: float, burst: int, max_hosts: int = _MAX_HOSTS) -> None:
        if not rate > 0:
            raise ValueError(f"the rate must be positive, got {rate}")
        if burst < 1:
            raise ValueError(f"the burst must be at least 1, got {burst}")
        self.rate = rate
        self.burst = burst
        self._max_hosts = max_hosts
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, time
        self.refused = 0
        """Events refused so far."""

    def allow(self, key: str, now: float) -> bool:
        """Take a token from ``key``'s bucket: False (counted in ``refused``) when empty."""
        if math.isinf(self.rate):
            return True
        tokens, then = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        else:
            self.refused += 1
        self._buckets[key] = (tokens, now)  # most recently used last
        if len(self._buckets) > self._max_hosts:
            self._buckets.popitem(last=False)
        return allowed
