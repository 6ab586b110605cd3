"""A peer whose connection ends in the middle of a frame most likely died writing it (killed
between two of its transport messages): the host reports the connection lost, as it does
for one that ends between frames or inside a transport message (a review: a cut on a
transport-message boundary read as a protocol violation only, and the DHT did not check on
the contact)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from peer.host import open_rpc_host
from peer.rpc import HandlerRegistry, RpcConnection
from peer.secure import secure_handshake
from protocol.address import Address
from protocol.framing import encode_frame_header
from protocol.identity import Identity, PeerID


@pytest.mark.parametrize("cut", ["between", "boundary", "inside"])
async def test_a_connection_cut_mid_frame_is_reported_lost(cut: str) -> None:
    lost: list[PeerID] = []
    came = trio.Event()

    def on_lost(peer_id: PeerID) -> None:
        lost.append(peer_id)
        came.set()

    me = Identity.generate()
    with trio.fail_after(20):
        async with open_rpc_host(Identity.generate(), listen=Address("127.0.0.1", 0)) as host:
            host.on_connection_lost = on_lost
            assert host.listen_address is not None
            raw = await trio.open_tcp_stream("127.0.0.1", host.listen_address.port)
            stream = await secure_handshake(raw, me, initiator=True)
            if cut != "between":  # whole transport messages: half of a 1 MiB frame
                await stream.send_all(encode_frame_header(1 << 20) + bytes(1 << 19))
            if cut == "inside":  # then half of one more transport message
                await raw.send_all(stream._transport.seal(bytes(1000))[:500])
            await raw.aclose()  # the process died: its kernel closes the socket
            await came.wait()
            assert lost == [me.peer_id]


@pytest.mark.parametrize("cut", ["clean", "mid_frame"])
async def test_a_peer_that_closes_on_reading_our_bye_has_not_departed(
    autojump_clock: trio.testing.MockClock, cut: str
) -> None:
    """Our idle timer's bye: the peer closes at once, cutting off a large request it was
    writing (on a transport-message boundary). That is no departure, as its clean close is
    not (a review: the cut read as one, and the host pinged back the live peer, what the
    bye is there to spare)."""
    ours, theirs = trio.testing.memory_stream_pair()
    peer = Identity.from_seed(b"p" * 32)
    conn = RpcConnection(ours, peer.peer_id, HandlerRegistry(), idle_timeout=10.0)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(conn.run)
            bye = await theirs.receive_some()  # our idle timer's bye (the only frame)
            assert bye and conn.closing and not conn.closed
            if cut == "mid_frame":
                await theirs.send_all(encode_frame_header(1 << 20) + bytes(1 << 18))
            await theirs.aclose()
    assert conn.closed and not conn.lost
