"""What the per-host limits and quotas count by (``host_group``), and which hosts are
this machine (``is_loopback_host``)."""

from __future__ import annotations

import pytest

from peer.remote_hosts import host_group, is_loopback_host


@pytest.mark.parametrize(
    ("host", "group"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),  # one subscriber holds the /64
        ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
        ("::ffff:203.0.113.7", "203.0.113.7"),  # a dual-stack socket's view of IPv4
        ("fe80::1%eth0", "fe80::1"),  # every machine of a LAN shares fe80::/64
        ("fe80::2", "fe80::2"),
        ("fd12:3456:789a:1::5", "fd12:3456:789a:1::5"),  # unique-local: a LAN's too
        ("mem-host", "mem-host"),  # the memory network's names
    ],
)
def test_host_group(host: str, group: str) -> None:
    assert host_group(host) == group


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("::ffff:203.0.113.7", False),
        ("203.0.113.7", False),
        ("fe80::1%lo", False),
        ("?", False),
        ("mem-host", False),
    ],
)
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback
