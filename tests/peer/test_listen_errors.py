"""A listen address that cannot be bound names itself in the error (a new-user trial got a
bare "[Errno 98] Address already in use" from ``open_peer``)."""

from __future__ import annotations

import errno
import socket

import pytest
import trio

from peer import open_peer


async def test_a_port_in_use_is_named_in_the_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with trio.fail_after(10), pytest.raises(OSError) as info:
            async with open_peer(f"127.0.0.1:{port}"):
                pass  # pragma: no cover - never entered
    assert info.value.errno == errno.EADDRINUSE
    assert f"127.0.0.1:{port}" in str(info.value)
