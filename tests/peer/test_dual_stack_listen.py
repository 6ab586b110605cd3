"""A listen host that resolves to an IPv6 and an IPv4 address, with port 0, listens on one
port at both (an outside tester: each address got a port of its own from the OS, the
printed address named the first, and IPv4 dialers were refused there)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
import trio.abc
from ipv6_loopback import ipv6_loopback

from peer import open_peer


class _DualHost(trio.abc.HostnameResolver):
    """Resolves ``dualhost`` to ``::1`` and ``127.0.0.1``, as ``localhost`` does where
    /etc/hosts lists both (Fedora), or a name with A and AAAA records."""

    async def getaddrinfo(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name == "dualhost":
            p = int(port or 0)
            return [
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", p, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", p)),
            ]
        return await trio.to_thread.run_sync(socket.getaddrinfo, host, port, *args)

    async def getnameinfo(self, sockaddr: Any, flags: int) -> Any:
        return socket.getnameinfo(sockaddr, flags)


def _accepts(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family) as probe:
        probe.settimeout(5)
        return probe.connect_ex((host, port)) == 0


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
async def test_every_address_of_the_listen_host_takes_the_announced_port() -> None:
    trio.socket.set_custom_hostname_resolver(_DualHost())
    try:
        with trio.fail_after(20):
            async with open_peer("dualhost:0") as node:
                port = int(node.address.rsplit(":", 1)[1])
                for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
                    assert await trio.to_thread.run_sync(_accepts, family, host, port), host
    finally:
        trio.socket.set_custom_hostname_resolver(None)
