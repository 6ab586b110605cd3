"""Two ends of a secure connection over in-memory streams, for tests of what rides on one."""

from __future__ import annotations

import trio
import trio.testing

from peer.secure import SecureStream, secure_handshake
from protocol.identity import Identity


async def secure_pair(
    initiator: Identity, responder: Identity
) -> tuple[SecureStream, SecureStream]:
    """The initiator's end and the responder's, handshake done."""
    left, right = trio.testing.memory_stream_pair()
    streams: dict[bool, SecureStream] = {}

    async def shake(raw: trio.abc.Stream, identity: Identity, is_initiator: bool) -> None:
        streams[is_initiator] = await secure_handshake(raw, identity, initiator=is_initiator)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(shake, left, initiator, True)
        nursery.start_soon(shake, right, responder, False)
    return streams[True], streams[False]
