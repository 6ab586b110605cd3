"""Rate-limited links for benchmarks: a ``Network`` whose streams share one uplink and one
downlink budget per peer, like a host behind a link of ``rate`` bits per second.

    network = ShapedNetwork(rate_bits=1e9)        # 1 Gbit/s each way
    async with open_peer(network=network) as node: ...

Shaping is a virtual-finish-time token bucket: every write (and every read) reserves
``len / rate`` seconds of the link and sleeps until its slot, with ``burst`` bytes of slack.
Reads are shaped too, so TCP flow control slows the sender down to our downlink.

The slack plays the kernel's socket buffers: a real link goes on sending what was written
(and receiving into the buffer) while the process computes; here the link only moves while
our task runs, so each CPU-bound stretch longer than ``burst / rate`` costs link time. No
credit builds up while the link idles, so over any interval T at most rate * T + burst
bytes pass.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from peer import TcpNetwork

SLICE = 256 * 1024
"""Bytes written per reservation (and the burst): coarse slices keep the shaper cheap; the
average rate still never exceeds ``rate`` (over any interval T: at most rate * T + burst)."""
READ = 1 << 20
"""Most bytes read at once (each read is charged to the downlink after it returns)."""
LINK_BUFFER = SLICE
"""Default slack in bytes (2 ms at 1 Gbit/s, 21 ms at 100 Mbit/s). More slack plays a larger
socket buffer (Linux autotunes the send buffer up to 4 MiB here, ``net.ipv4.tcp_wmem``) but
also lets each transfer that starts on an idle link finish up to ``slack / rate`` early: with
1 MiB, 2-peer rounds at 100 Mbit/s measured 0.97-0.99x of the wire-time lower bound. So the
quoted figures keep this strict default; ``benchmarks/allreduce.py --link-buffer`` varies it."""


class Link:
    """One direction of a peer's link: ``rate`` bytes per second, ``burst`` bytes of slack."""

    def __init__(self, rate_bytes: float, burst: int = LINK_BUFFER) -> None:
        self.rate = rate_bytes
        self.burst = burst / rate_bytes
        self._free_at = 0.0

    async def take(self, size: int) -> None:
        now = trio.current_time()
        start = max(now, self._free_at)
        self._free_at = start + size / self.rate
        wait = self._free_at - self.burst - now
        if wait > 0:
            await trio.sleep(wait)
        else:
            await trio.lowlevel.checkpoint()


class ShapedStream(trio.abc.Stream):
    def __init__(self, inner: trio.abc.Stream, up: Link, down: Link) -> None:
        self.inner = inner
        self.up = up
        self.down = down
        self.remote_host = "127.0.0.1"

    async def send_all(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), SLICE):
            piece = view[start : start + SLICE]
            await self.up.take(len(piece))
            await self.inner.send_all(piece)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self.inner.receive_some(min(max_bytes or READ, READ))
        if data:
            await self.down.take(len(data))
        return bytes(data)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ShapedNetwork:
    """Real TCP, shaped to ``rate_bits`` per second each way for this peer."""

    def __init__(self, rate_bits: float, buffer: int = LINK_BUFFER) -> None:
        self.inner = TcpNetwork()
        self.up = Link(rate_bits / 8, buffer)
        self.down = Link(rate_bits / 8, buffer)

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        return ShapedStream(await self.inner.connect(host, port), self.up, self.down)

    async def serve(
        self,
        host: str,
        port: int,
        handler: Callable[[trio.abc.Stream], Awaitable[None]],
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def wrapped(stream: trio.abc.Stream) -> None:
            await handler(ShapedStream(stream, self.up, self.down))

        await self.inner.serve(host, port, wrapped, task_status=task_status)
