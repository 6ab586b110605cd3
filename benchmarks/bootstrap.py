"""Start-up time and memory of `swarm bootstrap` while it serves a 50-peer DHT.

    .venv/bin/python benchmarks/bootstrap.py [--peers 50]

Prints JSON: seconds from exec to the printed address (best and median of 5 starts),
then the resident memory (VmRSS now, VmHWM peak) of one bootstrap process while
N peers in this process join through it and each stores and gets a few keys. The node runs
with ``--identity`` as a deployed one does, so it saves its contacts; restarted on another
port while the peers run, it dials them: the report says how many it saved, how long that
start took, and how many peers learnt its new address within 2 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _args import at_least  # noqa: E402

from peer import open_peer  # noqa: E402
from peer.contacts import contacts_file, load_contacts  # noqa: E402

T = TypeVar("T")

BOOTSTRAP = [sys.executable, "-m", "peer.cli", "bootstrap", "--host", "127.0.0.1"]


STARTED: list[subprocess.Popen[str]] = []  # every node started: stopped on the way out


def start_bootstrap(identity: Path) -> tuple[subprocess.Popen[str], str, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*BOOTSTRAP, "--identity", str(identity)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    STARTED.append(proc)
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


async def serve_peers(
    proc: subprocess.Popen[str], address: str, n: int, identity: Path
) -> dict[str, Any]:
    """N peers join through the node and store and get; its memory is read; then, with the
    peers still up, it is stopped and started again on another port (``--port 0``): how
    many contacts it saved, how long the start took, how many peers learnt its new address
    within 2 s."""
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
        loaded = memory_kib(proc.pid)
        proc.terminate()
        code = await trio.to_thread.run_sync(proc.wait)
        saved = len(load_contacts(contacts_file(identity)))
        again, new_address, seconds = await trio.to_thread.run_sync(start_bootstrap, identity)
        try:
            await trio.sleep(2)
            hostport = new_address.split("@", 1)[1]
            learnt = sum(
                any(known == hostport for _, known in node.dht.routing_table_peers())
                for node in nodes
            )
        finally:
            again.terminate()
            await trio.to_thread.run_sync(again.wait)
    return {
        "ops": total,
        "ok": ok,
        "loaded": loaded,
        "exit_code": code,
        "saved": saved,
        "restart_seconds": seconds,
        "learnt": learnt,
    }


async def until_sigterm(fn: Callable[..., Awaitable[T]], *args: Any) -> T | None:
    """``fn(*args)``, or None if a SIGTERM came first (the peers then close cleanly)."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            result: list[T] = []

            async def run() -> None:
                result.append(await fn(*args))
                nursery.cancel_scope.cancel()

            nursery.start_soon(run)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
    return result[0] if result else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=at_least(1), default=50)
    args = parser.parse_args()
    # SIGTERM (`timeout`) unwinds like Ctrl-C: the nodes are stopped and the key file
    # removed (inside trio.run, a signal receiver takes over: see until_sigterm)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as directory:
        identity = Path(directory) / "bootstrap.key"
        try:
            starts = []
            for _ in range(5):
                proc, _, seconds = start_bootstrap(identity)
                starts.append(seconds)
                proc.terminate()
                proc.wait()
            proc, address, _ = start_bootstrap(identity)
            idle = memory_kib(proc.pid)
            result = trio.run(until_sigterm, serve_peers, proc, address, args.peers, identity)
        finally:
            for proc in STARTED:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()
    if result is None:
        sys.exit(143)
    loaded = result["loaded"]
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
                "exit_code_on_sigterm": result["exit_code"],
                "restart_on_another_port": {
                    "saved_contacts": result["saved"],
                    "start_seconds": round(result["restart_seconds"], 3),
                    "peers_with_its_new_address_2s_later": result["learnt"],
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
