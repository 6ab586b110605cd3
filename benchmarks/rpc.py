"""The RPC layer alone: an empty request and reply between random pairs of N peers in one
process over loopback TCP, every connection up before timing.

    python benchmarks/rpc.py                  # 64 peers, 8,000 calls a phase, ~30 s
    python benchmarks/rpc.py --peers 16 --calls 2000

What ``dht.py`` measures with its DHT work taken away: the same process shape (64 peers,
one connection per pair that talks, 200 calls at once), calls of a method that does nothing
(a quick handler: no task per request). Prints one JSON document: calls per second and
CPU microseconds per call (both ends, this one process) one at a time and 200 at once. A
DHT store asks its k = 20 closest nodes (20 RPCs), so ``1e6 / (20 * cpu_us_per_call)`` is
the most stores per second one process could make even if the DHT cost nothing.

The young-generation GC threshold is scaled with the peer count and the peers' objects are
frozen before timing, as ``dht.py`` does (see there); ``--gc-default`` keeps Python's
threshold (the objects are frozen all the same).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

import trio

# This tree's code, not the installed one (see dht.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer import Peer, Reply, Request, open_peer
from protocol.identity import Identity

METHOD = "bench.nothing"


def _nothing(request: Request) -> Reply:
    return Reply({})


async def _run_peer(index: int, *, task_status: trio.TaskStatus[Peer]) -> None:
    identity = Identity.from_seed((9_000 + index).to_bytes(32, "big"))
    async with open_peer("127.0.0.1:0", [], identity=identity) as node:
        node.rpc.register_quick(METHOD, _nothing)
        task_status.started(node)
        await trio.sleep_forever()


async def _phase(
    pairs: list[tuple[Peer, Peer]], calls: int, at_once: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            a, b = rng.choice(pairs)
            await a.rpc.call(b.address, METHOD, {"q": 1})

    start, cpu = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as nursery:
        for _ in range(at_once):
            nursery.start_soon(worker)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "calls": calls,
        "at_once": at_once,
        "calls_per_s": round(calls / wall),
        "cpu_us_per_call": round(1e6 * cpu / calls),
    }


async def main(
    n_peers: int, calls: int, at_once: int, seed: int, scale_gc: bool = True
) -> dict[str, Any]:
    report: dict[str, Any] = {"peers": n_peers}
    async with trio.open_nursery() as nursery:
        peers = [await nursery.start(_run_peer, i) for i in range(n_peers)]
        pairs = [(a, b) for a in peers for b in peers if a is not b]
        dials = trio.CapacityLimiter(16)  # thousands of handshakes at once would time out

        async def connect(a: Peer, b: Peer) -> None:
            async with dials:
                await a.rpc.call(b.address, METHOD, {})

        async with trio.open_nursery() as connecting:
            for a, b in pairs:
                connecting.start_soon(connect, a, b)
        report["connections"] = sum(p.rpc.num_connections for p in peers) // 2
        if scale_gc:
            threshold0, *older = gc.get_threshold()
            gc.set_threshold(threshold0 * n_peers, *older)
        report["gc_threshold"] = gc.get_threshold()
        gc.collect()
        gc.freeze()
        report["one_at_a_time"] = await _phase(pairs, max(calls // 4, 1), 1, seed)
        report["concurrent"] = await _phase(pairs, calls, at_once, seed + 1)
        us = report["concurrent"]["cpu_us_per_call"]
        report["stores_per_s_bound_k20"] = round(1e6 / (20 * us))
        nursery.cancel_scope.cancel()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--calls", type=int, default=8000)
    parser.add_argument("--at-once", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gc-default",
        action="store_true",
        help="keep Python's GC threshold instead of scaling it with the peer count",
    )
    args = parser.parse_args()
    if args.peers < 2 or args.calls < 1 or args.at_once < 1:
        parser.error("--peers must be at least 2, --calls and --at-once at least 1")
    # one connection per pair of peers, both ends in this process: ~2 descriptors a pair
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = args.peers * (args.peers - 1) * 2 + 256
    if soft < wanted and (hard == resource.RLIM_INFINITY or hard >= wanted):
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    report = trio.run(main, args.peers, args.calls, args.at_once, args.seed, not args.gc_default)
    print(json.dumps(report, indent=2))
