"""What peers that announce large frames and abandon them cost a `swarm bootstrap` node.

    .venv/bin/python benchmarks/stalled_frames.py [--connections 100] [--sent-kib 2200]

Starts `swarm bootstrap` on loopback, then opens ``--connections`` secure connections to
it from this process (its own Noise handshake, a fresh identity each), and on each
announces a frame of the largest size (4 MiB), sends ``--sent-kib`` of it (or what the
kernel takes within 0.5 s, when the node is not reading that connection) and goes quiet.
Prints JSON: the node's resident memory (VmRSS) idle, with the frames stalled, and 10 s
after the connections closed, and its peak (VmHWM), in MiB. Each connection's memory is
bounded by the node's receive budget (``HostConfig.receive_budget``: 8 MiB for a bootstrap
node); the per-host connection limit (128) applies, loopback included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer.secure import SecureStream, secure_handshake  # noqa: E402
from protocol.address import Address  # noqa: E402
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, encode_frame_header  # noqa: E402
from protocol.identity import Identity  # noqa: E402

BOOTSTRAP = [sys.executable, "-m", "peer.cli", "bootstrap", "--host", "127.0.0.1", "--port", "0"]


def memory_mib(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = round(int(value.split()[0]) / 1024, 1)
    return fields


async def stall(address: Address, count: int, sent: int) -> list[SecureStream]:
    """``count`` connections, each with ``sent`` bytes of a 4 MiB frame sent."""
    streams = []
    body = bytes(sent)
    for _ in range(count):
        raw = await trio.open_tcp_stream(address.host, address.port)
        stream = await secure_handshake(raw, Identity.generate(), initiator=True)
        # a frame the node does not read yet (its receive budget is spent) stops filling
        # once the kernel's buffers are full: go on with the next connection
        with trio.move_on_after(0.5):
            await stream.send_all(encode_frame_header(DEFAULT_MAX_FRAME_SIZE) + body)
        streams.append(stream)
    return streams


async def run(pid: int, address: Address, count: int, sent: int) -> dict[str, object]:
    await trio.sleep(1.0)
    idle = memory_mib(pid)
    streams = await stall(address, count, sent)
    await trio.sleep(3.0)
    stalled = memory_mib(pid)
    for stream in streams:
        await stream.aclose()
    await trio.sleep(10.0)
    after = memory_mib(pid)
    return {
        "connections": count,
        "sent_kib_of_4096": sent >> 10,
        "rss_idle_mib": idle["VmRSS"],
        "rss_stalled_mib": stalled["VmRSS"],
        "rss_10s_after_close_mib": after["VmRSS"],
        "peak_mib": after["VmHWM"],
    }


@contextlib.contextmanager
def bootstrap_node() -> Iterator[tuple[int, Address]]:
    """A `swarm bootstrap` process on loopback: its pid and address, stopped after."""
    proc = subprocess.Popen(
        BOOTSTRAP, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout is not None
        yield proc.pid, Address.parse(proc.stdout.readline().strip())
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=100)
    parser.add_argument("--sent-kib", type=int, default=2200)
    args = parser.parse_args()
    with bootstrap_node() as (pid, address):
        report = trio.run(run, pid, address, args.connections, args.sent_kib << 10)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
