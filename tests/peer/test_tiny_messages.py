"""A peer that sends a stream of tiny transport messages (one byte of plaintext, 19 bytes
on the wire) no longer holds the receiving node's event loop: a megabyte read at once held
~55,000 of them, all deciphered without a scheduler pass (a security review's peer froze a
node 0.7-1 s per connection so used, and its averaging stopped). The receiver lets the
other tasks run after every ~5 ms of deciphering. (Empty messages, beyond a few in a row,
are a protocol violation: ``tests/protocol/test_noise.py``.)"""

from __future__ import annotations

import trio
import trio.testing
from secure_pairs import secure_pair

from protocol.identity import Identity

MESSAGES = 120_000  # ~2.3 MB on the wire: reads grow to a megabyte


async def test_a_flood_of_one_byte_messages_lets_other_tasks_run() -> None:
    sender, receiver = await secure_pair(
        Identity.from_seed(b"s" * 32), Identity.from_seed(b"r" * 32)
    )
    transport = sender._transport
    blob = b"".join(transport.seal(b"x") for _ in range(MESSAGES))
    runs: list[int] = []  # bytes deciphered between two turns of the ticker
    received = 0
    done = False

    async def ticker() -> None:
        last = 0
        while not done:
            runs.append(received - last)
            last = received
            await trio.lowlevel.checkpoint()

    async def receive() -> None:
        nonlocal received, done
        buffer = bytearray(1 << 20)
        while received < MESSAGES:
            received += await receiver.receive_into(buffer)
        done = True

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.transport_stream.send_all, blob)
            nursery.start_soon(receive)
            nursery.start_soon(ticker)
    assert received == MESSAGES
    # ~5 ms of deciphering between turns: a few thousand messages on a fast machine
    # (before: every message of a megabyte's read, ~55,000)
    assert max(runs) < 20_000, max(runs)
