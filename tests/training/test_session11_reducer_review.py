"""Review of session 11's averaging mechanism, from the outside: a retried chunk whose first
call still waits at the reducer takes that call's place (ReducerService._supersede)."""

from __future__ import annotations

import numpy as np
import trio
import trio.testing
from test_new_mechanisms_review import CHUNK, chunk_sender, peer, service_for


async def test_a_retry_keeps_the_senders_place_in_the_admission_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Senders wait for admission in the order they came (docs/averaging.md: the retain
    budget). A sender whose connection died silently while its chunks waited, first in
    line, sends them again flagged ``retry``: it must keep its place, not go to the end
    of the line behind every sender that came after it (served last, it may miss the
    cutoff and be dropped from the part)."""
    service, _ = service_for(3, retain_budget=0)  # one sender admitted at a time
    values = {i: np.full(2 * CHUNK, float(i), np.float32) for i in (1, 2, 3)}
    answers: list[str] = []
    send = chunk_sender(service, values, answers)

    with trio.fail_after(30):
        await service.load()
        async with trio.open_nursery() as nursery:
            await send(1, 0)  # sender 1 is admitted and holds the budget
            nursery.start_soon(send, 2, 0)  # first in line...
            await trio.sleep(0.5)
            nursery.start_soon(send, 3, 0)  # ... then sender 3
            await trio.sleep(0.5)
            assert service._queue == [peer(2), peer(3)]
            nursery.start_soon(send, 2, 0, True)  # sender 2's chunk again, over a new dial
            await trio.sleep(0.5)
            assert service._queue == [peer(2), peer(3)], answers
            await send(1, 1)  # sender 1 completes: the budget goes to the first in line
            await trio.sleep(0.5)
            assert peer(2) in service._admitted, answers
            assert peer(3) not in service._admitted, answers
            for sender in (2, 3):
                await send(sender, 1)
                await trio.sleep(0.5)
        outcome = await service.reduce(trio.current_time() + 5)
    assert set(outcome.contributors) == {peer(i) for i in range(4)}, answers
