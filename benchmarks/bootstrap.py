"""Start-up time and memory of `swarm bootstrap` while it serves a 50-peer DHT.

    .venv/bin/python benchmarks/bootstrap.py [--peers 50]

Prints JSON: seconds from exec to the printed address (best and median of 5 starts),
then the resident memory (VmRSS now, VmHWM peak) of one bootstrap process while
N peers in this process join through it and each stores and gets a few keys.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer import open_peer  # noqa: E402


def start_bootstrap() -> tuple[subprocess.Popen[str], str, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "peer.cli", "bootstrap", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()
    return proc, address, time.perf_counter() - t0


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


async def serve_peers(address: str, n: int) -> dict[str, float]:
    ok = total = 0
    async with contextlib.AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(
                open_peer(listen="127.0.0.1:0", initial_peers=[address])
            )
            for _ in range(n)
        ]
        for i, node in enumerate(nodes):
            total += 1
            ok += await node.dht.store(f"bench/{i}", i, ttl=120)
        for i in range(n):
            total += 1
            ok += await nodes[(i + 7) % n].dht.get(f"bench/{i}") == i
    return {"ops": total, "ok": ok}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=50)
    args = parser.parse_args()
    starts = []
    for _ in range(5):
        proc, _, seconds = start_bootstrap()
        starts.append(seconds)
        proc.terminate()
        proc.wait()
    proc, address, _ = start_bootstrap()
    try:
        idle = memory_kib(proc.pid)
        result = trio.run(serve_peers, address, args.peers)
        loaded = memory_kib(proc.pid)
    finally:
        proc.terminate()
        code = proc.wait()
    print(
        json.dumps(
            {
                "start_seconds_best": round(min(starts), 3),
                "start_seconds_median": round(statistics.median(starts), 3),
                "start_target_seconds": 1.0,
                "idle_rss_mib": round(idle["VmRSS"] / 1024, 1),
                "peers": args.peers,
                "dht_ops": result["ops"],
                "dht_ok": result["ok"],
                "rss_mib_after_serving": round(loaded["VmRSS"] / 1024, 1),
                "peak_rss_mib": round(loaded["VmHWM"] / 1024, 1),
                "rss_target_mib": 60,
                "exit_code_on_sigterm": code,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
