"""A background peer's async API awaited from another thread's trio loop is refused with a
clear RuntimeError, and the peer keeps serving. It used to answer that first call, then
die on trio's internal assertion (the reply woke a task of another loop); every later call
said only "the background peer has stopped" (a trial)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from peer import run_in_background


async def _bounded(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    with trio.fail_after(20):
        return await fn(*args)


def test_the_async_api_awaited_on_another_loop_is_refused_and_the_peer_lives() -> None:
    with (
        run_in_background("127.0.0.1:0") as first,
        run_in_background("127.0.0.1:0", [first.address]) as node,
    ):
        assert node.dht.store("k", 1)
        for call in (
            lambda: trio.run(_bounded, node.peer.dht.get, "k"),
            lambda: trio.run(_bounded, node.peer.dht.store, "k", 2),
            lambda: trio.run(_bounded, node.peer.rpc.call, first.address, "dht.ping"),
        ):
            with pytest.raises(RuntimeError, match=r"runs on another trio loop .*node\.run"):
                call()
        assert node.dht.get("k") == 1  # still serving
        assert first.dht.get("k") == 1
        assert node.run(node.peer.dht.get, "k") == 1  # the right way
