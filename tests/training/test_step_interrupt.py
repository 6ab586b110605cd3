"""Ctrl-C during ``await averager.step(...)`` comes out as a plain KeyboardInterrupt, in
whichever phase it comes (an outside tester: 23 of 36 came out as a BaseExceptionGroup,
from the nurseries of gathering, joining and leading). Each case runs its own
``trio.run``: trio delivers the interrupt to the main task, which pytest-trio's is not."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import trio

from peer import PeerStoppedError, open_peer
from training import Averager


async def _interrupt_after(delay: float) -> None:
    await trio.sleep(delay)
    signal.raise_signal(signal.SIGINT)


async def _partner(averager: Averager) -> None:
    epoch = 0
    while True:
        try:
            await averager.step(weight=1.0, epoch=epoch, timeout=10.0)
        except PeerStoppedError:  # its peer stopped under it as the run ended
            return
        epoch += 1


async def _steps_until_interrupted(delay: float) -> None:
    with trio.fail_after(60):
        async with open_peer("127.0.0.1:0") as a, open_peer("127.0.0.1:0", [a.address]) as b:
            mine = Averager(a, prefix="ki/p", tensors=[np.ones(1 << 20, np.float32)])
            theirs = Averager(b, prefix="ki/p", tensors=[np.zeros(1 << 20, np.float32)])
            # system tasks: protected from the interrupt, which goes to this main task
            trio.lowlevel.spawn_system_task(_partner, theirs)
            trio.lowlevel.spawn_system_task(_interrupt_after, delay)
            for epoch in range(1000):
                await mine.step(weight=1.0, epoch=epoch, timeout=10.0)


@pytest.mark.parametrize("delay", [0.05, 0.4, 1.0, 2.5])
def test_ctrl_c_during_a_step_is_a_plain_keyboard_interrupt(delay: float) -> None:
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # trio's own then
    with pytest.raises(KeyboardInterrupt):
        trio.run(_steps_until_interrupted, delay)
