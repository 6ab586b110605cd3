"""The background peer in a plain training script, as an ML user writes one.

A ``DataLoader(num_workers=2)`` made after ``run_in_background`` forks its workers (the
Linux default start method): each child holds copies of the peer's socket descriptors.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

import peer
from protocol.address import Address

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork and /proc: Linux")


def _inet_sockets() -> int:
    """How many TCP/IP sockets this process holds (AF_UNIX ones, trio's wakeup pairs, not)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except OSError:  # not a socket (or already closed: the listing's own descriptor)
            continue
        try:
            count += sock.family in (socket.AF_INET, socket.AF_INET6)
        finally:
            sock.detach()
    return count


@contextmanager
def forked_child() -> Iterator[int]:
    """A forked child that lives, doing nothing, as an idle DataLoader worker, until the
    block ends (its own alarm kills it if the test dies first). Yields the number of TCP
    sockets the child holds."""
    report_read, report_write = os.pipe()
    wait_read, wait_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            signal.alarm(20)
            os.write(report_write, str(_inet_sockets()).encode())
            os.close(wait_write)
            os.read(wait_read, 1)  # until the parent closes its end
        finally:
            os._exit(0)
    os.close(report_write)
    os.close(wait_read)
    try:
        yield int(os.read(report_read, 32))
    finally:
        os.close(report_read)
        os.close(wait_write)
        os.waitpid(pid, 0)


@pytest.mark.slow
def test_a_peer_that_left_is_gone_for_others_while_a_forked_worker_lives() -> None:
    """Before: the child's copies of the departed peer's sockets kept its connections open
    (no FIN: the other side kept it pooled, and a call over it waited for its deadline) and
    its listening socket accepting (a dial waited for the 10 s handshake timeout, not a
    refusal). A peer that leaves must be seen gone at once, as without the fork."""
    with peer.run_in_background() as survivor:
        leaving = peer.run_in_background(initial_peers=[survivor.address])
        leaver = leaving.__enter__()
        left = False
        try:
            assert leaver.dht.store("fork/k", 1, ttl=30.0)  # a connection both ways
            address = Address.parse(leaver.address)
            with forked_child():
                leaving.__exit__(None, None, None)
                left = True

                async def call_the_departed() -> float:
                    start = trio.current_time()
                    with trio.fail_after(5):
                        # over the pooled connection (it must have seen the FIN), then
                        # over a fresh dial (it must be refused)
                        for _ in range(2):
                            with pytest.raises(peer.PeerUnavailableError):
                                await survivor.peer.rpc.call(address, "no.such.method", {})
                    return trio.current_time() - start

                assert survivor.run(call_the_departed) < 2.0
        finally:
            if not left:
                leaving.__exit__(None, None, None)


@pytest.mark.slow
def test_a_forked_child_holds_none_of_the_peers_sockets_and_the_parent_serves_on() -> None:
    with (
        peer.run_in_background() as other,
        peer.run_in_background(initial_peers=[other.address]) as node,
    ):
        assert other.dht.store("fork/x", 2, ttl=30.0)
        assert node.dht.store("fork/y", 3, ttl=30.0)
        with forked_child() as sockets_in_child:
            assert sockets_in_child == 0
            assert node.dht.get("fork/x") == 2
            assert other.dht.get("fork/y") == 3


@pytest.mark.slow
def test_a_peer_entered_without_with_keeps_running_when_its_context_is_garbage() -> None:
    """``node = run_in_background().__enter__()`` (a notebook cell): before, the generator
    context was collected at once, which stopped the peer; the first call then raised
    "the background peer has stopped". The peer now runs until the interpreter exits."""
    script = textwrap.dedent(
        """
        import gc
        import peer
        node = peer.run_in_background().__enter__()
        gc.collect()
        assert node.dht.store("gc/k", 1, ttl=30.0)
        print(node.dht.get("gc/k"), flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0 and done.stdout == "1\n", done.stderr


def test_forgetting_the_with_block_names_the_mistake() -> None:
    block = peer.run_in_background()
    with pytest.raises(AttributeError, match=r"with peer\.run_in_background\(\.\.\.\) as node"):
        block.dht.store("k", 1)


@pytest.mark.slow
async def test_an_async_peer_that_left_is_gone_while_a_forked_worker_lives() -> None:
    """The async API with a DataLoader worker forked inside the trio program."""
    async with peer.open_peer() as survivor:
        with trio.fail_after(10):
            async with peer.open_peer(initial_peers=[survivor.address]) as leaver:
                assert await leaver.dht.store("fork/k", 1, ttl=30.0)
                address = Address.parse(leaver.address)
                child = forked_child()
                child.__enter__()
        try:
            start = trio.current_time()
            with trio.fail_after(5):
                for _ in range(2):
                    with pytest.raises(peer.PeerUnavailableError):
                        await survivor.rpc.call(address, "no.such.method", {})
            assert trio.current_time() - start < 2.0
        finally:
            child.__exit__(None, None, None)


class Preempted(Exception):
    """What a training script's SIGUSR1 handler raises (a cluster's preemption notice)."""


def test_an_exception_from_a_signal_handler_cancels_the_call_it_interrupts() -> None:
    """Before, only KeyboardInterrupt cancelled the call: a handler's own exception left
    it running on the loop (an averaging step went on writing into the tensors while the
    script saved its checkpoint, and refused the next step as "already in a step")."""
    unwound = threading.Event()
    entered = threading.Event()

    async def long_call() -> None:
        try:
            entered.set()
            await trio.sleep(10)
        finally:
            unwound.set()

    def preempt(signum: int, frame: object) -> None:
        raise Preempted

    previous = signal.signal(signal.SIGUSR1, preempt)
    try:
        with peer.run_in_background() as node:
            threading.Thread(
                target=lambda: entered.wait(10) and os.kill(os.getpid(), signal.SIGUSR1)
            ).start()
            with pytest.raises(Preempted):
                node.run(long_call)
            assert unwound.is_set()  # cancelled before the exception reached us
            assert node.run(trio.sleep, 0) is None  # and the peer serves the next call
    finally:
        signal.signal(signal.SIGUSR1, previous)
