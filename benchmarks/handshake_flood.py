"""What a connection flood from one host costs a peer, with the handshake rate limit on and off.

    .venv/bin/python benchmarks/handshake_flood.py [--connections 2000]

A peer (the DHT node `swarm bootstrap` runs) is started in a process of its own, once with
the default ``HostConfig`` and once with ``handshake_rate_per_ip=inf`` (the limit off). A
flooder opens connections to it one after another, each sending one recorded Noise first
message (replaying it costs the flooder nothing; answering costs the peer a key pair, two
X25519 and a signature) and reading the answer, if any, before closing. Meanwhile an honest
peer in another process pings it over its own connection. Prints JSON per setting: the
peer's CPU per flood connection (from /proc), how many were answered with a handshake,
the flood's rate, and the honest pings' p50/max latency and failures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer import PeerConfig, open_peer  # noqa: E402
from peer.host import HostConfig  # noqa: E402
from protocol.address import Address  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.messages import NodeInfo  # noqa: E402
from protocol.noise import BUSY_SIGNAL, NoiseHandshake  # noqa: E402


async def serve(rate: float) -> None:
    # The flood comes from this machine: loopback is exempt unless asked for.
    config = PeerConfig(host=HostConfig(handshake_rate_per_ip=rate, rate_limit_loopback=True))
    async with open_peer(listen="127.0.0.1:0", config=config) as node:
        print(node.address, flush=True)
        await trio.sleep_forever()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flood(host: str, port: int, count: int) -> tuple[int, float]:
    """Open ``count`` connections one after another; how many got a handshake answer."""
    first_message = NoiseHandshake(Identity.generate(), initiator=True).data_to_send()
    answered = 0
    start = time.perf_counter()
    for _ in range(count):
        with socket.create_connection((host, port)) as sock:
            sock.settimeout(2.0)
            try:
                sock.sendall(first_message)
                reply = sock.recv(4096)
                answered += len(reply) > len(BUSY_SIGNAL)  # message 2, not the busy signal
            except OSError:
                pass  # closed or reset at once: refused
    return answered, time.perf_counter() - start


def ping_while(address: str, stop: threading.Event) -> dict[str, Any]:
    """Ping ``address`` from a peer of our own every 20 ms until ``stop`` is set."""
    latencies: list[float] = []
    failures = 0

    async def run() -> None:
        nonlocal failures
        # a client joined through the peer it pings (alone, it warns that it knows nobody)
        async with open_peer(listen=None, initial_peers=[address]) as node:
            parsed = Address.parse(address)
            assert parsed.peer_id is not None
            target = NodeInfo(parsed.peer_id, f"{parsed.host}:{parsed.port}")
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    with trio.fail_after(2.0):
                        assert await node.dht.protocol.ping(target)
                    latencies.append(time.perf_counter() - start)
                except Exception:
                    failures += 1
                await trio.sleep(0.02)

    trio.run(run)
    return {
        "pings": len(latencies),
        "ping_failures": failures,
        "ping_p50_ms": round(1e3 * statistics.median(latencies), 2) if latencies else None,
        "ping_max_ms": round(1e3 * max(latencies), 2) if latencies else None,
    }


def measure(rate: float, connections: int) -> dict[str, Any]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(rate)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        host, port = address.split("@", 1)[1].rsplit(":", 1)
        stop = threading.Event()
        pings: dict[str, Any] = {}
        pinger = threading.Thread(target=lambda: pings.update(ping_while(address, stop)))
        pinger.start()
        time.sleep(1.0)  # the pinger's connection is up before the flood
        before = cpu_seconds(proc.pid)
        answered, seconds = flood(host, int(port), connections)
        time.sleep(0.3)  # the last refusals and handshakes finish
        cpu = cpu_seconds(proc.pid) - before
        stop.set()
        pinger.join()
    finally:
        proc.terminate()
        proc.wait(10)
    return {
        "handshake_rate_per_ip": rate if math.isfinite(rate) else "inf",
        "connections": connections,
        "answered_with_a_handshake": answered,
        "flood_per_s": round(connections / seconds),
        "peer_cpu_s": round(cpu, 2),
        "peer_cpu_ms_per_connection": round(1e3 * cpu / connections, 3),
        **pings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--serve", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        trio.run(serve, args.serve)
        return
    limited = measure(HostConfig().handshake_rate_per_ip, args.connections)
    unlimited = measure(math.inf, args.connections)
    report = {
        "limit_on": limited,
        "limit_off": unlimited,
        "cpu_per_connection_ratio_off_over_on": round(
            unlimited["peer_cpu_ms_per_connection"] / limited["peer_cpu_ms_per_connection"], 1
        ),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
