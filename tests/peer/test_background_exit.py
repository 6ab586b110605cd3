"""Leaving a ``run_in_background`` block by an exception (Ctrl-C in a script) stops the
peer at once, as leaving ``open_peer`` by one does; leaving it normally still lets the
peer finish the requests it serves (up to ``drain_timeout``). A trial's Ctrl-C mid-round
took 3 s to leave the block, and its partner waited those 3 s for nothing."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio

import peer
from peer import Reply, Request
from protocol.address import Address


def _serving_a_slow_request(server: peer.BackgroundPeer, client: peer.BackgroundPeer) -> None:
    """Have ``client`` call a handler of ``server`` that never answers; return once the
    server is serving it."""
    serving = threading.Event()

    async def slow(request: Request) -> Reply:
        serving.set()
        await trio.sleep(60)
        return Reply()

    async def register() -> None:
        server.peer.rpc.register("slow", slow)

    server.run(register)

    async def call() -> None:
        with trio.move_on_after(30):
            await client.peer.rpc.call(Address.parse(server.address), "slow")

    def caller() -> None:
        with contextlib.suppress(Exception):  # the server went away: expected
            client.run(call)

    threading.Thread(target=caller, daemon=True).start()
    assert serving.wait(10)


@pytest.mark.parametrize("by_exception", [True, False], ids=["exception", "normally"])
def test_leaving_by_an_exception_does_not_drain(by_exception: bool) -> None:
    with peer.run_in_background() as client:
        block = peer.run_in_background()
        server = block.__enter__()
        _serving_a_slow_request(server, client)
        start = time.monotonic()
        if by_exception:
            block.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
        else:
            block.__exit__(None, None, None)
        took = time.monotonic() - start
    drain = peer.PeerConfig().host.drain_timeout
    if by_exception:
        assert took < drain / 2, took  # (3 s before: the drain)
    else:
        assert took >= drain * 0.9, took  # it waited for the request it served


NEVER_LEFT = """
import sys, threading, time
sys.path.insert(0, sys.argv[1])
from peer import PeerStoppedError, run_in_background

node = run_in_background().__enter__()  # a notebook's style: never left


def progress():  # the script's own (non-daemon) thread, until the peer stops
    try:
        while True:
            node.dht.store("progress", time.time(), ttl=30.0)
            time.sleep(0.05)
    except PeerStoppedError:
        print("stopped", flush=True)


threading.Thread(target=progress).start()
time.sleep(0.3)
"""


def test_a_peer_never_left_stops_before_python_waits_for_the_scripts_threads() -> None:
    """The peer stops at the interpreter's exit (dht.md); Python waits for non-daemon
    threads before atexit's hooks run, so a thread looping until PeerStoppedError held the
    exit forever (a trial: killed by its timeout)."""
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", NEVER_LEFT, root], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "stopped\n", out.stdout
