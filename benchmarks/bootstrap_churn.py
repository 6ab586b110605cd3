"""Memory of `swarm bootstrap` as thousands of distinct peers come and go.

    .venv/bin/python benchmarks/bootstrap_churn.py [--peers 6000] [--at-once 4] [--every 1000]
        [--settle 20]

A volunteer gets a fresh key (a new PeerID) at every start unless it keeps a key file, so a
public bootstrap node meets ever new peers. This starts one bootstrap process, then has
``--peers`` peers of this process, each with a fresh identity, join through it over
loopback TCP, store and get one small key, and leave (``--at-once`` at a time). Prints
JSON: the node's resident memory (VmRSS, and the VmHWM peak) before, after every
``--every`` visitors, and ``--settle`` seconds after the last left. What the node keeps per
peer it met (addresses, join times, rate-limit buckets, departed contacts) is capped by
count, so the figure levels off after a few thousand.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _args import at_least, positive_seconds  # noqa: E402

from peer import open_peer  # noqa: E402

BOOTSTRAP = [sys.executable, "-m", "peer.cli", "bootstrap", "--host", "127.0.0.1"]


def _memory(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = round(int(value.split()[0]) / 1024, 1)  # kB -> MiB
    return fields


async def _visit(address: str, index: int) -> None:
    async with open_peer("127.0.0.1:0", [address]) as guest:
        await guest.dht.store(f"churn/{index % 64}", index, ttl=30.0)
        await guest.dht.get(f"churn/{(index + 1) % 64}")


async def _churn(address: str, pid: int, args: argparse.Namespace) -> dict[str, object]:
    samples = [{"visitors": 0, **_memory(pid)}]
    started = time.perf_counter()
    slots = trio.Semaphore(args.at_once)
    done = 0

    async def one(index: int) -> None:
        nonlocal done
        try:
            await _visit(address, index)
        finally:
            slots.release()
        done += 1
        if done % args.every == 0:
            samples.append({"visitors": done, **_memory(pid)})
            print(json.dumps(samples[-1]), file=sys.stderr, flush=True)  # (a long run's progress)

    async with trio.open_nursery() as nursery:
        for index in range(args.peers):
            await slots.acquire()  # a task only for a free slot, which it releases
            nursery.start_soon(one, index)
    wall = time.perf_counter() - started
    await trio.sleep(args.settle)  # the node notices the last ones gone
    samples.append({"visitors": done, "after_s": args.settle, **_memory(pid)})
    return {"peers": args.peers, "at_once": args.at_once, "wall_s": round(wall, 1), "rss": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=at_least(1), default=6000)
    parser.add_argument("--at-once", type=at_least(1), default=4)
    parser.add_argument("--every", type=at_least(1), default=1000)
    parser.add_argument("--settle", type=positive_seconds, default=20.0)
    args = parser.parse_args()
    node = subprocess.Popen(
        [*BOOTSTRAP, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert node.stdout is not None
        address = node.stdout.readline().strip()
        if not address:
            raise SystemExit("bootstrap_churn: swarm bootstrap printed no address")
        report = trio.run(_churn, address, node.pid, args)
    finally:
        node.terminate()
        node.wait(timeout=30)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
