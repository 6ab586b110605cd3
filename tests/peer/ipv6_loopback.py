"""Whether this machine has an IPv6 loopback address (tests of ``::1`` skip without one)."""

from __future__ import annotations

import socket


def ipv6_loopback() -> bool:
    """True when ``::1`` can be bound here."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True
