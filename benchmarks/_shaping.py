"""Rate-limited links for benchmarks, two ways.

``ShapedNetwork`` (anywhere): a ``Network`` whose streams share one uplink and one downlink
budget per peer, like a host behind a link of ``rate`` bits per second.

    network = ShapedNetwork(rate_bits=1e9)        # 1 Gbit/s each way
    async with open_peer(network=network) as node: ...

``KernelShaper`` (Linux, root): the kernel shapes the loopback device with ``tc`` (an HTB
class per peer); each peer listens on and dials from its own loopback address
(``BoundTcpNetwork``). The link then moves while the process computes, as a real NIC does.

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

import os
import shutil
import socket
import subprocess
from collections.abc import Awaitable, Callable
from types import TracebackType
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
        admit: Callable[[str], bool] | None = None,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def wrapped(stream: trio.abc.Stream) -> None:
            await handler(ShapedStream(stream, self.up, self.down))

        await self.inner.serve(host, port, wrapped, admit=admit, task_status=task_status)


# -- kernel shaping --------------------------------------------------------------------------

PEER_ADDRESS_BASE = 20
"""Peer i of a kernel-shaped run sends from 127.0.0.(20 + i); 127.0.0.1 stays unshaped."""
KERNEL_BURST = 128 * 1024
"""HTB burst in bytes: two of loopback's 64 KiB GSO packets. Over any interval T at most
rate * T + burst bytes leave a peer, the stream shaper's rule with half its default slack."""


def peer_address(index: int) -> str:
    """The loopback address peer ``index`` listens on and dials from in a kernel-shaped run."""
    return f"127.0.0.{PEER_ADDRESS_BASE + index}"


class BoundTcpNetwork(TcpNetwork):
    """Real TCP whose outgoing connections leave from ``source`` (so ``tc`` can tell the
    peers' traffic apart on the loopback device)."""

    def __init__(self, source: str) -> None:
        self.source = source

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        stream = await trio.open_tcp_stream(host, port, local_address=self.source)
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)  # as TcpNetwork does
        return stream


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")


class KernelShaper:
    """``with KernelShaper(peers=4, rate_bits=1e9):`` each peer's uplink (everything sent
    from ``peer_address(i)``) is an HTB class of ``rate_bits`` with HTB's default FIFO queue
    (acknowledgements wait behind bulk data, as on a plain link). Other loopback traffic is
    not shaped. Only uplinks are shaped: in a butterfly every peer receives as much as it
    sends, spread over the others, so no downlink carries more than the rate on average.
    The qdisc is removed on exit."""

    def __init__(self, peers: int, rate_bits: float) -> None:
        self.peers = peers
        self.rate = f"{int(rate_bits)}bit"

    @staticmethod
    def unavailable() -> str | None:
        """Why kernel shaping cannot run here, or None when it can."""
        if os.name != "posix" or os.geteuid() != 0:
            return "needs root"
        if shutil.which("tc") is None:
            return "needs tc (iproute2)"
        shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
        if shown.returncode != 0:
            return f"tc failed: {shown.stderr.strip()}"
        if "htb 1:" not in shown.stdout and not shown.stdout.startswith("qdisc noqueue"):
            return f"lo already has a qdisc we would replace: {shown.stdout.strip()}"
        return None

    def __enter__(self) -> KernelShaper:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        # Unclassified traffic (``default`` names no class) is sent unshaped.
        _tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "0xffff")
        try:
            for i in range(self.peers):
                cls, burst = f"1:{10 + i:x}", str(KERNEL_BURST)
                limits = ["rate", self.rate, "ceil", self.rate, "burst", burst, "cburst", burst]
                _tc("class", "add", "dev", "lo", "parent", "1:", "classid", cls, "htb", *limits)
                where = ["dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1"]
                match = ["match", "ip", "src", f"{peer_address(i)}/32", "flowid", cls]
                _tc("filter", "add", *where, "u32", *match)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
