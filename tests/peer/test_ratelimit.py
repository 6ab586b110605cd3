"""HostRateLimiter: a token bucket per host, with a burst, refilled over time."""

from __future__ import annotations

import math

import pytest

from peer.ratelimit import HostRateLimiter


def test_a_burst_then_the_rate() -> None:
    limiter = HostRateLimiter(rate=2.0, burst=3)
    assert [limiter.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b", 0.0)  # another host has its own bucket
    assert not limiter.allow("a", 0.4)  # 0.8 of a token
    assert limiter.allow("a", 0.6)  # 1.2 tokens: one taken
    assert not limiter.allow("a", 0.6)
    assert limiter.refused == 3


def test_the_bucket_refills_to_the_burst_only() -> None:
    limiter = HostRateLimiter(rate=10.0, burst=2)
    assert limiter.allow("a", 0.0)
    allowed = [limiter.allow("a", 1000.0) for _ in range(3)]
    assert allowed == [True, True, False]


def test_refusals_do_not_earn_tokens() -> None:
    """Asking again and again while refused does not open the bucket any sooner."""
    limiter = HostRateLimiter(rate=1.0, burst=1)
    assert limiter.allow("a", 0.0)
    assert not any(limiter.allow("a", t / 10) for t in range(1, 10))
    assert limiter.allow("a", 1.0)


def test_memory_is_bounded_and_a_forgotten_host_starts_full() -> None:
    limiter = HostRateLimiter(rate=1.0, burst=1, max_hosts=3)
    for host in ("a", "b", "c", "d"):
        assert limiter.allow(host, 0.0)
    assert len(limiter._buckets) == 3
    assert limiter.allow("a", 0.0)  # forgotten, so full again
    assert not limiter.allow("d", 0.0)  # still remembered


def test_an_infinite_rate_turns_it_off_and_bad_settings_are_refused() -> None:
    limiter = HostRateLimiter(rate=math.inf, burst=1)
    assert all(limiter.allow("a", 0.0) for _ in range(100))
    with pytest.raises(ValueError, match="rate"):
        HostRateLimiter(rate=0.0, burst=1)
    with pytest.raises(ValueError, match="burst"):
        HostRateLimiter(rate=1.0, burst=0)
