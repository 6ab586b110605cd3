"""A background peer's async API awaited from another thread's trio loop is refused with a
clear RuntimeError, and the peer keeps serving. It used to answer that first call, then
die on trio's internal assertion (the reply woke a task of another loop); every later call
said only "the background peer has stopped" (a trial). Its blocking facade called inside a
trio run is refused with a RuntimeError that names the way out."""

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


def test_a_blocking_call_inside_a_trio_run_names_the_way_out() -> None:
    """A facade call inside ``trio.run`` on the caller's thread raised trio's bare "this is
    a blocking function; call it from a thread" (an outside tester): the error names the
    trio run and the ways out, and a call through ``trio.to_thread`` works."""
    with run_in_background("127.0.0.1:0") as node:
        assert node.dht.store("k", 1)

        async def inside() -> Any:
            for call in (
                lambda: node.dht.get("k"),
                lambda: node.clock.now(),
                lambda: node.run(node.peer.dht.get, "k"),
            ):
                with pytest.raises(RuntimeError, match=r"inside a trio run.*open_peer.*to_thread"):
                    call()
            return await trio.to_thread.run_sync(node.dht.get, "k")

        assert trio.run(_bounded, inside) == 1
        assert node.dht.get("k") == 1  # still serving
