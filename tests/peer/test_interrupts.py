"""Ctrl-C during an awaited DHT call comes out as a plain KeyboardInterrupt (peer/interrupts.py).

Trio delivers the interrupt to the main task; while that task waits in one of a lookup's
nurseries, the nursery raised it inside a BaseExceptionGroup, which ``except
KeyboardInterrupt`` missed (an outside tester). These tests run their own ``trio.run``: the
interrupt goes to the main task, which pytest-trio's test task is not.
"""

from __future__ import annotations

import signal
import socket

import pytest
import trio

from peer import open_peer
from peer.interrupts import interrupt_in


async def _interrupt_after(delay: float) -> None:
    await trio.sleep(delay)
    signal.raise_signal(signal.SIGINT)


async def _dht_until_interrupted(delay: float) -> None:
    with trio.fail_after(30):
        async with open_peer("127.0.0.1:0") as a, open_peer("127.0.0.1:0", [a.address]):
            # a system task: protected from the interrupt, which goes to this main task
            trio.lowlevel.spawn_system_task(_interrupt_after, delay)
            for i in range(100_000):
                await a.dht.store(f"key{i % 7}", i, ttl=30.0)
                await a.dht.get(f"key{i % 5}")


@pytest.mark.parametrize("delay", [0.05, 0.2, 0.5])
def test_ctrl_c_during_dht_calls_is_a_plain_keyboard_interrupt(delay: float) -> None:
    # before the change, all three came out as BaseExceptionGroup([KeyboardInterrupt()])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # trio's own then
    with pytest.raises(KeyboardInterrupt):
        trio.run(_dht_until_interrupted, delay)


def test_interrupt_in_finds_it_at_any_depth() -> None:
    interrupt = KeyboardInterrupt()
    nested = BaseExceptionGroup("outer", [ValueError(), BaseExceptionGroup("inner", [interrupt])])
    assert interrupt_in(nested) is interrupt
    assert interrupt_in(BaseExceptionGroup("none", [ValueError(), trio.TooSlowError()])) is None


async def _join_until_interrupted(silent_port: int) -> None:
    with trio.fail_after(30):
        trio.lowlevel.spawn_system_task(_interrupt_after, 0.3)
        # the initial peer accepts and never answers: the join waits in the bootstrap's
        # nurseries when the interrupt comes
        async with open_peer("127.0.0.1:0", [f"127.0.0.1:{silent_port}"]):
            raise AssertionError("joined a peer that never answers")


def test_ctrl_c_while_open_peer_joins_is_a_plain_keyboard_interrupt() -> None:
    # an outside tester: BaseExceptionGroup('Exceptions from Trio nursery', [KeyboardInterrupt()])
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with pytest.raises(KeyboardInterrupt):
            trio.run(_join_until_interrupted, silent.getsockname()[1])
