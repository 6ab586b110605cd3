"""Averaging between separate processes over real loopback TCP, as a user runs it: a
``swarm bootstrap`` node and one process per peer, each driven line by line on stdin."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SWARM = Path(sys.executable).with_name("swarm")
READ_TIMEOUT = 15.0
START_TIMEOUT = 30.0  # importing torch takes 2-7 s per process on a busy 2-core VM

# One peer: reads JSON commands on stdin, answers one JSON line each on stdout.
#   {"op": "step", "weight": w, "timeout": t}  -> the report, or {"error": ...}
#   {"op": "freeze_next_round"}                -> its next butterfly starts with SIGSTOP
WORKER = r"""
import json, os, signal, sys, time
import numpy as np
import peer
from training import Averager, AveragerConfig
from training.averaging import butterfly

bootstrap, value, size, config = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tensor = np.full(size, value, dtype=np.float32)
freeze = []
run = butterfly.Butterfly.run
async def run_maybe_frozen(self, cutoff, deadline):
    if freeze:
        freeze.clear()
        os.kill(os.getpid(), signal.SIGSTOP)  # mid-round: group confirmed, nothing sent
    return await run(self, cutoff, deadline)
butterfly.Butterfly.run = run_maybe_frozen

with peer.run_in_background(initial_peers=[bootstrap]) as node:
    averager = Averager(node, "t/proc", [tensor], config=AveragerConfig(**json.loads(config)))
    print(json.dumps({"ready": str(node.peer_id)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "freeze_next_round":
            freeze.append(True)
            print(json.dumps({"ok": True}), flush=True)
            continue
        t0 = time.monotonic()
        try:
            info = averager.step_blocking(weight=command["weight"], timeout=command["timeout"])
        except Exception as exc:
            reply = {"error": type(exc).__name__, "message": str(exc)}
        else:
            reply = {
                "outcome": str(info.outcome), "note": info.note,
                "group": [str(p) for p in info.group],
                "averaged_fraction": info.averaged_fraction,
                "parts": [
                    {"span": list(p.span), "status": str(p.status), "weight": p.weight,
                     "contributors": [str(c) for c in p.contributors]}
                    for p in info.parts
                ],
            }
        reply["elapsed"] = time.monotonic() - t0
        reply["values"] = tensor.tolist()
        print(json.dumps(reply), flush=True)
"""

FAST = {"gather_window": 0.5, "join_timeout": 0.3, "stall_timeout": 1.0, "chunk_bytes": 4096}


class Worker:
    """One averaging process."""

    def __init__(self, bootstrap: str, value: float, size: int, config: dict[str, Any]) -> None:
        self.value = value
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, bootstrap, repr(value), str(size), json.dumps(config)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.peer_id = ""

    def wait_ready(self) -> None:
        self.peer_id = self.read(START_TIMEOUT)["ready"]

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = READ_TIMEOUT) -> dict[str, Any]:
        """The next reply line; fails the test (instead of hanging) after ``timeout``."""
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), True)
        end = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < end:
                if sel.select(end - time.monotonic()):
                    line = self.proc.stdout.readline()
                    assert line, f"worker exited with {self.proc.poll()}"
                    return json.loads(line)  # type: ignore[no-any-return]
        raise AssertionError(f"no reply within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@contextmanager
def swarm() -> Iterator[tuple[str, list[Worker]]]:
    """A bootstrap node, and a list that the test fills with workers; all killed after."""
    boot = subprocess.Popen(
        [str(SWARM), "bootstrap", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    workers: list[Worker] = []
    try:
        assert boot.stdout is not None
        address = boot.stdout.readline().strip()
        assert "@127.0.0.1:" in address
        yield address, workers
    finally:
        for worker in workers:
            worker.stop()
        boot.kill()
        boot.wait()
        if boot.stdout is not None:
            boot.stdout.close()


def start(
    address: str, workers: list[Worker], values: list[float], sizes: list[int]
) -> list[Worker]:
    """Workers whose tensors start filled with ``values``, all started at once (each
    imports torch) and ready."""
    new = [Worker(address, v, n, FAST) for v, n in zip(values, sizes, strict=True)]
    workers.extend(new)
    for worker in new:
        worker.wait_ready()
    return new


def at_the_start_of_a_slot() -> None:
    """Wait until a round's slot is an eighth old (unix time; slots are gather_window long).

    A step picks the round that closes next when at least half a window is left, else asks
    the DHT whether anyone declared there. Peers told to step together just before that
    half-way mark could split: the first declared in that round, the second asked before
    the first's store landed (a slow store on a busy machine) and went to the next one,
    both then alone (seen in a full run under load). Sent an eighth into the slot, every
    peer that reads its clock within 3/8 of a window (or 1/8 early) takes the same round.
    """
    window = FAST["gather_window"]
    time.sleep((window / 8 - time.time()) % window)


def step_together(
    workers: list[Worker], timeout: float, weights: list[float] | None = None
) -> list[dict[str, Any]]:
    weights = weights or [1.0] * len(workers)
    at_the_start_of_a_slot()
    for worker, weight in zip(workers, weights, strict=True):
        worker.send(op="step", weight=weight, timeout=timeout)
    return [worker.read(timeout + 5.0) for worker in workers]


def check_report(
    reply: dict[str, Any], initial: np.ndarray, by_id: dict[str, tuple[float, float]]
) -> None:
    """Every part holds what the report says: the weighted mean of its contributors'
    values (each worker's tensor starts filled with one value), or our own values."""
    values = np.asarray(reply["values"])
    for part in reply["parts"]:
        a, b = part["span"]
        if part["status"] == "none":
            np.testing.assert_array_equal(values[a:b], initial[a:b])
            continue
        pairs = [by_id[c] for c in part["contributors"]]
        weight = sum(w for _, w in pairs)
        mean = sum(v * w for v, w in pairs) / weight
        np.testing.assert_allclose(values[a:b], mean, rtol=1e-6)
        assert part["weight"] == pytest.approx(weight)
        assert (part["status"] == "all") == (set(part["contributors"]) == set(reply["group"]))
    averaged = sum(p["span"][1] - p["span"][0] for p in reply["parts"] if p["status"] == "all")
    assert reply["averaged_fraction"] == pytest.approx(
        averaged / len(values) if reply["parts"] else 0.0
    )


def test_a_misconfigured_newcomer_does_not_raise_in_a_peer_of_the_swarm() -> None:
    """A peer that averaged with its own layout, then meets only a newcomer of another
    layout in a round, sits that round out (alone); the newcomer gets the
    LayoutMismatchError. (Before: both raised, so one misconfigured volunteer stepping
    beside a lone correct peer crashed that peer's training loop; and a peer that closed
    its round early on the newcomer's declaration withdrew before the newcomer read it.)"""
    with swarm() as (address, workers):
        # the odd one has one element more: another layout; it waits for its turn
        a, b, odd = start(address, workers, [1.0, 3.0, 5.0], [64, 64, 65])
        first = step_together([a, b], timeout=6.0)
        assert all(r["outcome"] == "averaged" for r in first), first
        b.stop()
        replies = step_together([a, odd], timeout=4.0)
        assert replies[1].get("error") == "LayoutMismatchError", replies
        assert "error" not in replies[0], replies[0]
        assert replies[0]["outcome"] == "alone"
        assert replies[0]["values"] == first[0]["values"]  # untouched
        assert replies[0]["elapsed"] < 4.5


def test_a_member_frozen_mid_round_then_thawed_rejoins_the_next_round() -> None:
    """SIGSTOP after the group is confirmed (connections stay open): the others return
    within a few stall timeouts with the frozen member reported, their values exactly what
    their reports say; thawed, the member's own step ends (honestly reported) and the next
    round averages all three again."""
    with swarm() as (address, workers):
        peers = start(address, workers, [1.0, 2.0, 4.0], [3000] * 3)
        frozen = peers[2]
        frozen.send(op="freeze_next_round")
        assert frozen.read()["ok"]
        weights = [1.0, 2.0, 3.0]
        at_the_start_of_a_slot()
        for worker, weight in zip(peers, weights, strict=True):
            worker.send(op="step", weight=weight, timeout=6.0)
        survivors = [worker.read(11.0) for worker in peers[:2]]
        deadline = time.monotonic() + 5.0
        while _state(frozen.proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(frozen.proc.pid) == "T", "the member never froze"
        by_id = {w.peer_id: (w.value, wt) for w, wt in zip(peers, weights, strict=True)}
        for worker, reply in zip(peers[:2], survivors, strict=True):
            assert reply["elapsed"] < 6.0  # 0.5 s gather + stall 1.0 + ping, not the deadline
            assert reply["outcome"] in ("partial", "failed", "unconfirmed")  # frozen leader
            assert reply["averaged_fraction"] < 1.0
            check_report(reply, np.full(3000, worker.value), by_id)
        os.kill(frozen.proc.pid, signal.SIGCONT)
        thawed = frozen.read(8.0)
        assert thawed.get("error") is None, thawed
        check_report(thawed, np.full(3000, frozen.value), by_id)
        # Next round, from each member's current values, with everybody back.
        current = {
            w.peer_id: np.asarray(r["values"])
            for w, r in zip(peers, [*survivors, thawed], strict=True)
        }
        again = step_together(peers, timeout=6.0, weights=weights)
        assert all(r["outcome"] == "averaged" and len(r["group"]) == 3 for r in again), again
        expected = sum(current[w.peer_id] * wt for w, wt in zip(peers, weights, strict=True)) / 6.0
        for reply in again:
            np.testing.assert_allclose(reply["values"], expected, rtol=1e-6)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
