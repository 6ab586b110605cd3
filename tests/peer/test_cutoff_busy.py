"""A handshake cut off to make room for a newer connection (it stalled: a second without
completing) says "busy" (``BUSY_SIGNAL``) when we had not answered yet, as a refused
connection does; one that timed out, or that we had already answered, is just closed. A
handshake we answered is never cut for a newcomer before it stalls: the newcomer is told
busy instead (one not answered yet, a silent connection, may be cut at any age)."""

from __future__ import annotations

import trio
import trio.testing

from peer.host import HostConfig, open_rpc_host
from peer.memnet import MemoryNetwork
from protocol.address import Address
from protocol.identity import Identity
from protocol.noise import BUSY_SIGNAL, NoiseHandshake

SERVER = Identity.from_seed(b"s" * 32)


async def _everything(stream: trio.abc.Stream) -> bytes:
    """What the far end sends until it closes (a reset counts as a close)."""
    got = b""
    try:
        while chunk := await stream.receive_some():
            got += chunk
    except trio.BrokenResourceError:
        pass
    return got


async def test_a_handshake_cut_off_before_our_reply_gets_the_busy_signal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    config = HostConfig(max_connections=2, max_connections_per_ip=2)
    async with open_rpc_host(
        SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
    ):
        with trio.fail_after(5):
            first = await net.interface("a").connect("s", 1)  # sends nothing
            await trio.testing.wait_all_tasks_blocked()
            second = await net.interface("b").connect("s", 1)
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(1.1)  # both stalled
            third = await net.interface("c").connect("s", 1)  # takes the oldest one's slot
            assert await _everything(first) == BUSY_SIGNAL
            for stream in (second, third):
                with trio.move_on_after(1) as still_open:
                    await stream.receive_some()
                assert still_open.cancelled_caught
                await stream.aclose()


async def test_a_handshake_that_times_out_is_closed_without_a_word(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    config = HostConfig(handshake_timeout=10.0)
    async with open_rpc_host(
        SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
    ):
        with trio.fail_after(30):
            silent = await net.interface("a").connect("s", 1)
            start = trio.current_time()
            assert await _everything(silent) == b""  # gone, not busy: it was us who stalled
            assert trio.current_time() - start >= 10.0


async def test_a_handshake_cut_off_after_our_reply_is_just_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    config = HostConfig(max_connections=1, max_connections_per_ip=2)
    async with open_rpc_host(
        SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
    ):
        with trio.fail_after(5):
            dialer = await net.interface("a").connect("s", 1)
            noise = NoiseHandshake(Identity.from_seed(b"d" * 32), initiator=True)
            await dialer.send_all(noise.data_to_send())
            reply = await dialer.receive_some()  # message 2: the server answered
            assert reply and not reply.startswith(BUSY_SIGNAL)
            # no message 3: the server waits for it when the next dialer, a second later,
            # takes the slot
            await trio.sleep(1.1)
            later = await net.interface("b").connect("s", 1)
            assert await _everything(dialer) == b""  # a busy signal here would read as Noise
            await later.aclose()


async def test_a_newcomer_at_a_node_full_of_young_handshakes_is_told_busy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every slot held by a handshake under a second old: the newcomer cut off the oldest,
    answered already most likely, so that dialer was not told busy (a crowd's calls failed
    as lost connections; a review). The newcomer is told busy now, the handshakes go on."""
    net = MemoryNetwork()
    config = HostConfig(max_connections=1, max_connections_per_ip=2)
    async with open_rpc_host(
        SERVER, listen=Address("s", 1), network=net.interface("s"), config=config
    ):
        with trio.fail_after(5):
            dialer = await net.interface("a").connect("s", 1)
            noise = NoiseHandshake(Identity.from_seed(b"d" * 32), initiator=True)
            await dialer.send_all(noise.data_to_send())
            reply = await dialer.receive_some()  # message 2: the server answered
            assert reply and not reply.startswith(BUSY_SIGNAL)
            later = await net.interface("b").connect("s", 1)
            assert await _everything(later) == BUSY_SIGNAL
            with trio.move_on_after(0.5) as still_open:
                await dialer.receive_some()
            assert still_open.cancelled_caught
            await dialer.aclose()
