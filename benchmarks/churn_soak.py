"""Two `swarm bootstrap` processes watched while volunteers come and go (loopback TCP).

    python benchmarks/churn_soak.py                      # ~15 min: 5 min churn, 10 min quiet
    python benchmarks/churn_soak.py --churn 60 --quiet 60 --peers 5

Starts bootstrap A, then B joining A (both with an identity file). Pinger peers (they ping
both every second) and client-mode peers stay throughout. Every ``--wave-every`` seconds
during the churn, ``--per-wave`` worker processes of ``--peers`` peers each join through a
random bootstrap node and store and get random keys; each leaves cleanly after 40-70 s, is
SIGKILLed after 20-50 s, or is frozen (SIGSTOP) after 20-50 s and SIGKILLed after 60-120 s.
At ``--restart-at`` B is SIGKILLed and restarted with the same identity and port. When the
churn ends every churn process is SIGKILLed; a newcomer joins 30 s later and again 90 s
before the end.

Prints one JSON line per event and per sample: each bootstrap's RSS, open fds, threads,
CPU seconds, routing-table size (its ``peer joined`` minus ``peer left`` log lines), and
what ``swarm status --json`` against it reports against the peers known to be up (``stale``:
reported but not up before nor after the walk; ``missing``: up before and after, not
reported); then a summary line. Every process it starts ends with it (PR_SET_PDEATHSIG,
Linux), or at the latest when the soak ends.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SWARM = [sys.executable, "-m", "peer.cli"]
T0 = time.monotonic()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _spawn(cmd: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, cwd=ROOT, text=True, preexec_fn=_die_with_parent, **kwargs)


def now() -> float:
    return round(time.monotonic() - T0, 1)


def emit(**fields: object) -> None:
    print(json.dumps({"t": now(), **fields}), flush=True)


def peer_id(address: str) -> str:
    return address.split("@", 1)[0]


# ---- the worker process -----------------------------------------------------------------


async def _worker(args: argparse.Namespace) -> None:
    import trio

    sys.path.insert(0, str(ROOT))
    from peer import open_peer
    from protocol.address import Address
    from protocol.messages import NodeInfo

    rng = random.Random(os.getpid())
    client = args.mode == "client"
    joins = []
    async with contextlib.AsyncExitStack() as stack:
        nodes = []
        for _ in range(args.n):
            started = trio.current_time()
            node = await stack.enter_async_context(
                open_peer(
                    listen=None if client else "127.0.0.1:0",
                    client_mode=client,
                    initial_peers=[rng.choice(args.bootstraps)],
                    ensure_bootstrap_success=False,
                )
            )
            nodes.append(node)
            joins.append(round(trio.current_time() - started, 2))
            if not client:
                print(json.dumps({"peer": node.address}), flush=True)
        print(json.dumps({"joins": joins}), flush=True)

        async def work(node: Any) -> None:
            while True:
                await trio.sleep(rng.uniform(0.5, 2.0))
                key = f"churn/{rng.randrange(200)}"
                with trio.move_on_after(10), contextlib.suppress(Exception):
                    if rng.random() < 0.5:
                        await node.dht.store(key, rng.random(), ttl=rng.uniform(20, 120))
                    else:
                        await node.dht.get(key)

        async def ping(node: Any) -> None:
            targets = [Address.parse(b) for b in args.bootstraps]
            while True:
                for target in targets:
                    with trio.move_on_after(5), contextlib.suppress(Exception):
                        await node.dht.protocol.ping(NodeInfo(target.peer_id, target.hostport))
                await trio.sleep(1.0)

        with trio.move_on_after(args.lifetime):
            async with trio.open_nursery() as nursery:
                for node in nodes:
                    nursery.start_soon(ping if args.mode == "pinger" else work, node)
        # the peers stop one after another from here (each drains its connections)
        print(json.dumps({"leaving": True}), flush=True)


# ---- the driver -------------------------------------------------------------------------


class Bootstrap:
    def __init__(self, name: str, workdir: str, initial: list[str]) -> None:
        self.name = name
        self.identity = os.path.join(workdir, f"{name}.key")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.initial = initial
        self.start(port=0)

    def start(self, port: int) -> None:
        self.log_offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        cmd = [*SWARM, "bootstrap", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--identity", self.identity]
        if self.initial:
            cmd += ["--initial-peers", *self.initial]
        with open(self.log_path, "a") as log:
            self.proc = _spawn(cmd, stdout=subprocess.PIPE, stderr=log)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 20)
        line = self.proc.stdout.readline().strip() if ready else ""
        if not line:
            raise RuntimeError(f"bootstrap {self.name} printed no address")
        self.address = line
        self.port = int(line.rsplit(":", 1)[1])

    def log_text(self) -> str:
        with open(self.log_path) as f:
            f.seek(self.log_offset)
            return f.read()

    def sample(self) -> dict[str, Any]:
        pid = self.proc.pid
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        text = self.log_text()
        return {
            "rss_mib": int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) // 1024,  # type: ignore[union-attr]
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(re.search(r"Threads:\s+(\d+)", status).group(1)),  # type: ignore[union-attr]
            "cpu_s": round((int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"), 1),
            "table": text.count("peer joined") - text.count("peer left"),
        }

    def stop(self) -> int | str:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return "killed after 15 s"


class Worker:
    def __init__(self, bootstraps: list[str], n: int, mode: str, lifetime: float) -> None:
        cmd = [sys.executable, __file__, "--worker", "--bootstraps", *bootstraps]
        cmd += ["--n", str(n), "--mode", mode, "--lifetime", str(lifetime)]
        self.proc = _spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.addresses: list[str] = []
        self.joins: list[float] | None = None
        self.mode = mode
        self.frozen = False
        self.leaving = False
        self.fate: tuple[str, float, float] = ("stay", 0.0, 0.0)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            if "peer" in message:
                self.addresses.append(message["peer"])
            elif "joins" in message:
                self.joins = message["joins"]
            elif "leaving" in message:
                self.leaving = True

    def up(self) -> bool:
        return self.proc.poll() is None and not self.frozen and not self.leaving

    def apply_fate(self, t: float) -> None:
        fate, first, second = self.fate
        if self.proc.poll() is not None:
            return
        if fate == "kill" and t >= first:
            self.proc.kill()
        elif fate == "freeze_kill" and t >= first and not self.frozen:
            self.proc.send_signal(signal.SIGSTOP)
            self.frozen = True
        elif fate == "freeze_kill" and t >= second:
            self.proc.kill()

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _status(address: str) -> dict[str, Any]:
    started = time.monotonic()
    cmd = [*SWARM, "status", "--json", "--initial-peers", address, "--timeout", "30"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    try:
        ids = {p["peer_id"] for p in json.loads(out.stdout)["peers"]}
    except (json.JSONDecodeError, KeyError):
        ids = set()
    return {"rc": out.returncode, "ids": ids, "secs": round(time.monotonic() - started, 1)}


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(1)
        self.workdir = tempfile.mkdtemp(prefix="churn-soak-")
        self.workers: list[Worker] = []
        self.samples: list[dict[str, Any]] = []
        self.late_joins: list[list[float] | None] = []

    def live(self) -> set[str]:
        ids = {peer_id(b.address) for b in self.boots}
        for worker in self.workers:
            if worker.up():
                ids |= {peer_id(a) for a in worker.addresses}
        return ids

    def sample(self) -> None:
        row: dict[str, Any] = {}
        for boot in self.boots:
            before = self.live()
            status = _status(boot.address)
            after = self.live()
            ids = status.pop("ids")
            row[boot.name] = {
                **boot.sample(),
                "status": {
                    **status,
                    "n": len(ids),
                    "stale": len(ids - before - after),
                    "missing": len((before & after) - ids),
                },
            }
        row["live"] = len(self.live())
        row["frozen"] = sum(w.frozen and w.proc.poll() is None for w in self.workers)
        emit(**row)
        self.samples.append({"t": now(), **row})

    def wave(self) -> None:
        addresses = [b.address for b in self.boots]
        for _ in range(self.args.per_wave):
            mode = self.rng.choice(["server", "server", "server", "client"])
            fate = self.rng.choice(["clean", "kill", "freeze_kill"])
            lifetime = self.rng.uniform(40, 70) if fate == "clean" else 10_000.0
            worker = Worker(addresses, self.args.peers, mode, lifetime)
            worker.fate = (
                fate,
                now() + self.rng.uniform(20, 50),
                now() + self.rng.uniform(60, 120),
            )
            self.workers.append(worker)
        emit(event="wave", processes=sum(w.proc.poll() is None for w in self.workers))

    def restart_b(self) -> None:
        b = self.boots[1]
        old = b.address
        b.proc.kill()
        b.proc.wait()
        emit(event="B killed")
        time.sleep(5)
        b.start(port=b.port)
        emit(event="B restarted", same_address=b.address == old)

    def run(self) -> None:
        args = self.args
        a = Bootstrap("A", self.workdir, [])
        self.boots = [a, Bootstrap("B", self.workdir, [a.address])]
        emit(event="up", A=a.address, B=self.boots[1].address, workdir=self.workdir)
        addresses = [b.address for b in self.boots]
        self.workers += [Worker(addresses, 3, "pinger", 1e6), Worker(addresses, 3, "client", 1e6)]
        last_wave = last_sample = -1e9
        restarted = churn_over = False
        late_at = [args.churn + 30, args.churn + args.quiet - 90]
        late: list[Worker] = []
        while now() < args.churn + args.quiet:
            t = now()
            if t < args.churn and t - last_wave >= args.wave_every:
                last_wave = t
                self.wave()
            for worker in self.workers:
                worker.apply_fate(t)
            if t >= args.churn and not churn_over:
                churn_over = True
                self.churn_over_at = now()
                for worker in self.workers:
                    if worker.mode != "pinger":
                        worker.end()
                emit(event="churn over: every churn process SIGKILLed")
            if late_at and t >= late_at[0]:
                late_at.pop(0)
                late.append(Worker([b.address for b in self.boots], 5, "server", 60))
                self.workers.append(late[-1])
            while late and late[0].joins is not None:
                self.late_joins.append(late.pop(0).joins)
                emit(event="newcomer joined", joins=self.late_joins[-1])
            if not restarted and t >= args.restart_at:
                restarted = True
                self.restart_b()
            if t - last_sample >= args.sample_every:
                last_sample = t
                self.sample()
            time.sleep(1)
        self.summary()

    def summary(self) -> None:
        """Peaks and last values; when each routing table came back to the peers up (from
        then on, ``table`` equals ``live`` less itself), counted from the end of the churn."""
        end = getattr(self, "churn_over_at", math.inf)
        quiet = [s for s in self.samples if s["t"] > end]
        result: dict[str, Any] = {"event": "summary", "newcomer_join_seconds": self.late_joins}
        for boot in self.boots:
            name = boot.name
            rows = [s[name] for s in self.samples]
            exact = [s[name]["table"] == s["live"] - 1 for s in quiet]
            settled = next((i for i in range(len(quiet)) if all(exact[i:])), None)
            result[name] = {
                "rss_mib_max": max(r["rss_mib"] for r in rows),
                "rss_mib_last": rows[-1]["rss_mib"],
                "fds_max": max(r["fds"] for r in rows),
                "fds_last": rows[-1]["fds"],
                "threads_max": max(r["threads"] for r in rows),
                "cpu_s": rows[-1]["cpu_s"],
                "table_last": rows[-1]["table"],
                "table_matches_live_after_s": (
                    None if settled is None else round(quiet[settled]["t"] - end, 1)
                ),
                "quiet_status_exact": sum(
                    s[name]["status"]["stale"] == s[name]["status"]["missing"] == 0 for s in quiet
                ),
                "quiet_samples": len(quiet),
            }
        result["live_last"] = self.samples[-1]["live"] if self.samples else None
        emit(**result)

    def close(self) -> None:
        for worker in self.workers:
            worker.end()
        for boot in getattr(self, "boots", []):
            emit(event="stop", name=boot.name, exit_code=boot.stop())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--churn", type=float, default=300.0, help="seconds of churn")
    # long enough for both nodes' first refresh (540-660 s after each start) to run
    parser.add_argument("--quiet", type=float, default=600.0, help="seconds watched after")
    parser.add_argument("--wave-every", type=float, default=30.0)
    parser.add_argument("--per-wave", type=int, default=2, help="worker processes per wave")
    parser.add_argument("--peers", type=int, default=10, help="peers per worker process")
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument("--restart-at", type=float, default=120.0)
    # the worker process (this file, run by the driver)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bootstraps", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--lifetime", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import trio

        trio.run(_worker, args)
        return
    soak = Soak(args)
    try:
        soak.run()
    finally:
        soak.close()


if __name__ == "__main__":
    main()
