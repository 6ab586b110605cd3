"""Averaging processes watched over many rounds while members are killed, frozen and restarted.

    python benchmarks/averaging_soak.py                       # ~22 min, 4 members, 1M float32
    python benchmarks/averaging_soak.py --duration 120 --period 4 --size 100000 --workers 3

Starts one ``swarm bootstrap`` (identity file, loopback) and ``--workers`` averaging
processes (this file with ``--worker``; ``peer.run_in_background`` + ``training.Averager``,
each with an identity file). Each member holds one float32 tensor of ``--size`` elements and
three averagers over it, under ``soak/none``, ``soak/float16`` and ``soak/int8``. Round ``k``
starts every ``--period`` seconds (a multiple of 2 s, the default gather window: rounds start
0.5 s into a rendezvous slot) on the wall clock; every member computes ``k`` itself, and one
more than 0.4 s late skips to the next round. Round ``k`` uses codec ``k mod 3``: the member
fills its tensor with its input for round ``k`` (an affine image ``base * s + o`` of one
fixed random vector, ``s`` and ``o`` given by its index and ``k``: every process can compute
every input, and the weighted mean of inputs is one pass) and steps with
``weight = 1 + (index + k) % 4``, ``epoch = k`` and ``max_staleness=0`` (a member whose step
lands in another round than its own is dropped as stale rather than mixing inputs of two
rounds). After the step it checks its tensor against its report: a ``none`` part must be
its own input exactly, others the weighted mean of the contributors' inputs within the
codec's error (none 1e-6, float16 2 * 2**-11, int8 2/254 of the largest input value in the
part), ``all`` iff the contributors are the whole group, the part's weight the sum of
theirs, and ``averaged_fraction`` the share of ``all`` parts.

Events, at fractions of ``--duration`` (``--events`` picks some): 0.25 the last member is
SIGKILLed and restarted 5 s later with the same identity file; 0.45 the second is SIGSTOPped
for ``--freeze`` seconds (30) and SIGCONTed; 0.65 the bootstrap is SIGKILLed and restarted
5 s later on the same port with the same identity; 0.8 the first member is SIGKILLed and
restarted at once (its old declarations and connections still around).

Prints one JSON line per event, one per sample (every ``--sample-every`` s: RSS MiB, open
fds, threads of every process, from /proc) and a summary line. Per member in the summary:

- ``rounds`` (steps that returned), ``outcomes`` (count per outcome), ``full`` (rounds
  ``averaged`` over every member), ``restarts``;
- ``check_failures``: rounds whose tensor disagreed with the report or with the expected
  mean, with the first few reasons (``first_failures``); ``errors``: steps that raised;
- ``start``/``end``: rss_mib, fds, threads at the first sample after its first round and
  at the last one before its last round; ``peak_rss_mib``;
- ``tasks``, ``conns``, ``dht_keys``, ``soak_keys``: first, last and peak of the trio
  tasks in its peer's loop, its RPC connections, the keys in its DHT storage and those of
  them under ``soak/`` (round keys), read in the member after each round (the settled one
  of five readings 0.1 s apart: see ``settled_figures``);
- ``step_s``, ``matchmaking_s``, ``allreduce_s``: medians over the first and the last fifth
  of its rounds; ``fraction``: mean ``averaged_fraction`` over the same;
- ``stderr_lines``: tracebacks, warnings and errors it logged (``--debug``: the
  matchmaker's log too, in ``memberN.log``).

Per event, ``rejoined_after_s``: from the event to the start of the first round that the
member it hit (every member, for the bootstrap) averaged over every member; ``null``:
never. Every member's report of every round is in ``rounds.jsonl`` in the work directory
(named by the first line). Every process the soak starts ends with it (PR_SET_PDEATHSIG,
Linux), at the latest when the soak ends.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import logging
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SWARM = [sys.executable, "-m", "peer.cli"]
CODECS = ("none", "float16", "int8")
EVENTS = ("kill_restart", "freeze", "bootstrap_restart", "kill_restart_at_once")
TOLERANCE = {"none": 1e-6, "float16": 2 * 2**-11, "int8": 2 / 254 + 1e-6}
LATE_S = 0.4  # rounds start 0.5 s into a rendezvous slot; at 1 s in, they take the next one
T0 = time.monotonic()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def now() -> float:
    return round(time.monotonic() - T0, 1)


def emit(**fields: object) -> None:
    print(json.dumps({"t": now(), **fields}), flush=True)


# ---- the member process -----------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _base(size: int) -> Any:
    """One fixed random vector: every input is an affine image of it (cheap to recompute)."""
    import numpy as np

    return np.random.default_rng(12345).standard_normal(size, dtype=np.float32)


def _affine(index: int, k: int) -> tuple[float, float]:
    """Member ``index``'s input for round ``k`` is ``base * scale + offset``."""
    return 1.0 + (index * 7 + k * 3) % 11 / 4, index - 1.5 + (k % 5) / 4


def member_input(index: int, k: int, size: int) -> Any:
    """Member ``index``'s tensor for round ``k``: any process can recompute it."""
    import numpy as np

    scale, offset = _affine(index, k)
    return _base(size) * np.float32(scale) + np.float32(offset)


def member_weight(index: int, k: int) -> float:
    return float(1 + (index + k) % 4)


def check_round(info: Any, values: Any, index: int, k: int, names: dict[str, int]) -> list[str]:
    """What is wrong with ``values`` after a step of round ``k`` reported as ``info``."""
    import numpy as np

    size = len(values)
    own = member_input(index, k, size)
    problems: list[str] = []
    if not info.parts:
        if not np.array_equal(values, own):
            problems.append(f"{info.outcome} but the tensor changed")
        return problems
    codec = CODECS[info.epoch % 3]
    group = {str(p) for p in info.group}
    base = _base(size)
    all_elements = 0
    for part in info.parts:
        a, b = part.span
        contributors = [str(c) for c in part.contributors]
        if str(part.status) == "none":
            if not np.array_equal(values[a:b], own[a:b]):
                problems.append(f"part {part.index} none but not our own values")
            continue
        if str(part.status) == "all":
            all_elements += b - a
        if (str(part.status) == "all") != (set(contributors) == group):
            problems.append(f"part {part.index} {part.status} with contributors {contributors}")
        unknown = [c for c in contributors if c not in names]
        if unknown:
            problems.append(f"part {part.index}: unknown contributors {unknown}")
            continue
        # every contributor stepped round info.epoch (max_staleness 0): the weighted mean
        # of affine images of base is one affine image of it
        total = slope = intercept = scale = 0.0
        peak = float(np.abs(base[a:b]).max(initial=0.0))
        for c in contributors:
            w = member_weight(names[c], info.epoch)
            s, o = _affine(names[c], info.epoch)
            total += w
            slope += w * s
            intercept += w * o
            scale = max(scale, s * peak + abs(o))  # the contributors' largest |value|
        mean = base[a:b].astype(np.float64) * (slope / total) + intercept / total
        err = float(np.abs(values[a:b] - mean).max(initial=0.0))
        if err > TOLERANCE[codec] * scale:
            problems.append(
                f"part {part.index} ({codec}) off the mean by {err:.3g} (scale {scale:.3g})"
            )
        if abs(part.weight - total) > 1e-9 * total:
            problems.append(f"part {part.index} weight {part.weight} != {total}")
    if abs(info.averaged_fraction - all_elements / size) > 1e-12:
        problems.append(f"averaged_fraction {info.averaged_fraction} != {all_elements / size}")
    return problems


def count_tasks(task: Any) -> int:
    return 1 + sum(count_tasks(t) for n in task.child_nurseries for t in n.child_tasks)


def inner_figures(node: Any) -> dict[str, int]:
    """Read in the peer's own thread: its trio tasks, connections, DHT storage."""
    import trio

    peer = node.peer
    storage = peer.dht.storage
    keys = list(storage.keys()) if storage is not None else []
    soak = sum(1 for key in keys if (storage.name_of(key) or "").startswith("soak/"))
    return {
        "tasks": count_tasks(trio.lowlevel.current_root_task()),
        "conns": peer.rpc.num_connections,
        "dht_keys": len(keys),
        "soak_keys": soak,
    }


SETTLE_READS, SETTLE_GAP_S = 5, 0.1


def settled_figures(node: Any) -> dict[str, int]:
    """:func:`inner_figures` right after a round, the reading with the fewest tasks beyond
    the connections' own among ``SETTLE_READS`` taken ``SETTLE_GAP_S`` apart: a result
    stream or a ping that is still ending as the step returns (more often on a loaded
    machine) is not a task left behind, while one that is stays in every reading."""
    readings = []
    for i in range(SETTLE_READS):
        if i:
            time.sleep(SETTLE_GAP_S)
        readings.append(node.run_sync(inner_figures, node))
    return min(readings, key=lambda r: r["tasks"] - 4 * r["conns"])


def names_in(workdir: str) -> dict[str, int]:
    """PeerID -> member index, from the identity files of the members."""
    from protocol.identity import Identity

    names = {}
    for path in Path(workdir).glob("member*.key"):
        index = int(path.stem.removeprefix("member"))
        names[str(Identity.load_or_create(path).peer_id)] = index
    return names


def _member(args: argparse.Namespace) -> None:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    import peer
    from training import Averager, AveragerConfig

    if args.debug:  # the matchmaker's round-by-round log, in memberN.log
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("training").setLevel(logging.DEBUG)
        logging.getLogger("peer").setLevel(logging.INFO)
    index = args.index
    tensor = np.zeros(args.size, dtype=np.float32)
    identity = os.path.join(args.workdir, f"member{index}.key")
    with peer.run_in_background(initial_peers=[args.bootstrap], identity=identity) as node:
        averagers = [
            Averager(
                node, f"soak/{codec}", [tensor], config=AveragerConfig(codec=codec, max_staleness=0)
            )
            for codec in CODECS
        ]
        print(json.dumps({"ready": str(node.peer_id), "pid": os.getpid()}), flush=True)
        schedule_path = Path(args.workdir, "schedule.json")
        while not schedule_path.exists():
            time.sleep(0.05)
        schedule = json.loads(schedule_path.read_text())
        start, period, end = schedule["start"], schedule["period"], schedule["end"]
        names = names_in(args.workdir)
        last_k = -1
        while True:
            # up to LATE_S late (a loaded machine) it still steps round k, in the same slot
            k = max(last_k + 1, math.ceil((time.time() - start - LATE_S) / period))
            at = start + k * period
            if at >= end:
                break
            time.sleep(max(0.0, at - time.time()))
            if time.time() > at + LATE_S:  # stopped (SIGSTOP) while it slept: too late
                continue
            last_k = k
            tensor[:] = member_input(index, k, args.size)
            t0 = time.monotonic()
            row: dict[str, Any] = {"k": k, "codec": CODECS[k % 3]}
            try:
                info = averagers[k % 3].step_blocking(
                    weight=member_weight(index, k), epoch=k, timeout=args.timeout
                )
            except Exception as exc:
                row.update(error=f"{type(exc).__name__}: {exc}", step_s=time.monotonic() - t0)
            else:
                row["step_s"] = round(time.monotonic() - t0, 3)
                if any(str(p) not in names for p in info.group):
                    names = names_in(args.workdir)
                row.update(
                    outcome=str(info.outcome),
                    group=sorted(names.get(str(p), -1) for p in info.group),
                    epoch=info.epoch,
                    fraction=info.averaged_fraction,
                    received=info.received_fraction,
                    matchmaking_s=round(info.matchmaking_s, 3),
                    allreduce_s=round(info.allreduce_s, 3),
                    dropped={
                        str(names.get(str(p), str(p))): str(r) for p, r in info.dropped.items()
                    },
                    note=info.note,
                    problems=check_round(info, tensor, index, k, names),
                )
            row.update(settled_figures(node))
            print(json.dumps(row), flush=True)
        for averager in averagers:
            averager.close()
    print(json.dumps({"done": True}), flush=True)


# ---- the driver -------------------------------------------------------------------------


def proc_figures(pid: int) -> dict[str, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # exited, not yet reaped
        return None
    return {
        "rss_mib": int(fields["VmRSS"].split()[0]) // 1024,
        "fds": fds,
        "threads": int(fields["Threads"]),
    }


class Bootstrap:
    def __init__(self, workdir: str) -> None:
        self.identity = os.path.join(workdir, "bootstrap.key")
        self.log_path = os.path.join(workdir, "bootstrap.log")
        self.start(port=0)

    def start(self, port: int) -> None:
        cmd = [*SWARM, "bootstrap", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--identity", self.identity]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=log,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline().strip() if ready else ""
        if not line:
            raise RuntimeError("the bootstrap printed no address")
        self.address = line
        self.port = int(line.rsplit(":", 1)[1])

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Member:
    """One averaging process, restartable with the same identity file."""

    def __init__(self, index: int, args: argparse.Namespace, workdir: str, bootstrap: str) -> None:
        self.index = index
        self.args = args
        self.workdir = workdir
        self.bootstrap = bootstrap
        self.rows: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.done = False
        self.frozen = False
        self.start()

    def start(self) -> None:
        a = self.args
        cmd = [sys.executable, __file__, "--worker", "--index", str(self.index)]
        cmd += ["--bootstrap", self.bootstrap, "--workdir", self.workdir]
        cmd += ["--size", str(a.size), "--timeout", str(a.timeout)]
        cmd += ["--debug"] if a.debug else []
        self.ready.clear()
        with open(os.path.join(self.workdir, f"member{self.index}.log"), "a") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=log,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            if "ready" in message:
                self.peer_id = message["ready"]
                self.ready.set()
            elif "done" in message:
                self.done = True
            else:
                message["t"] = now()
                message["pid"] = proc.pid
                self.rows.append(message)
                with open(os.path.join(self.workdir, "rounds.jsonl"), "a") as f:
                    f.write(json.dumps({"member": self.index, **message}) + "\n")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stderr_lines(self) -> dict[str, int]:
        text = Path(self.workdir, f"member{self.index}.log").read_text(errors="replace")
        return {
            "traceback": text.count("Traceback"),
            "warning": sum("Warning" in line or "WARNING" in line for line in text.splitlines()),
            "error": sum("ERROR" in line for line in text.splitlines()),
        }


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # Kept afterwards (keys, logs, rounds.jsonl) for a post-mortem; named in the "up" line.
        if args.workdir:
            os.makedirs(args.workdir, exist_ok=True)
            self.workdir = args.workdir
        else:
            self.workdir = tempfile.mkdtemp(prefix="averaging-soak-")
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.members: list[Member] = []

    def schedule_events(self) -> list[tuple[float, str, int]]:
        d, last = self.args.duration, self.args.workers - 1
        events = [
            (0.25 * d, "kill_restart", last),
            (0.45 * d, "freeze", min(1, last)),
            (0.65 * d, "bootstrap_restart", -1),
            (0.8 * d, "kill_restart_at_once", 0),
        ]
        return [e for e in events if e[1] in self.args.events]

    def run(self) -> None:
        args = self.args
        self.boot = Bootstrap(self.workdir)
        emit(event="up", bootstrap=self.boot.address, workdir=self.workdir)
        self.members = [
            Member(i, args, self.workdir, self.boot.address) for i in range(args.workers)
        ]
        for member in self.members:
            if not member.ready.wait(60):
                raise RuntimeError(f"member {member.index} did not start")
        # rounds start half a second into a 2 s rendezvous slot (the default gather window):
        # members that step together then always pick the same slot
        start = math.ceil((time.time() + 2.0) / 2.0) * 2.0 + 0.5
        self.start_wall = start
        self.end_wall = start + args.duration
        schedule = {"start": start, "period": args.period, "end": self.end_wall}
        tmp = Path(self.workdir, "schedule.tmp")
        tmp.write_text(json.dumps(schedule))
        tmp.rename(Path(self.workdir, "schedule.json"))
        emit(event="members ready", pids=[m.proc.pid for m in self.members])
        events = self.schedule_events()
        thaw_at: float | None = None
        last_sample = -1e9
        while time.time() < self.end_wall + args.timeout + 5:
            elapsed = time.time() - start
            if events and elapsed >= events[0][0]:
                self.apply(*events.pop(0)[1:])
                if self.events[-1]["event"] == "freeze":
                    thaw_at = time.time() + args.freeze
            if thaw_at is not None and time.time() >= thaw_at:
                thaw_at = None
                frozen = next(m for m in self.members if m.frozen)
                os.kill(frozen.proc.pid, signal.SIGCONT)
                frozen.frozen = False
                emit(event="thawed", member=frozen.index)
            if time.monotonic() - last_sample >= args.sample_every:
                last_sample = time.monotonic()
                self.sample()
            if all(not m.alive() for m in self.members):
                break
            time.sleep(0.2)
        self.sample()
        self.summary()

    def apply(self, kind: str, index: int) -> None:
        record = {"event": kind, "member": index, "wall": time.time()}
        self.events.append(record)
        emit(**{k: v for k, v in record.items() if k != "wall"})
        if kind == "bootstrap_restart":
            port = self.boot.port
            self.boot.proc.kill()
            self.boot.proc.wait()
            time.sleep(5)
            old = self.boot.address
            self.boot.start(port=port)
            emit(event="bootstrap restarted", same_address=self.boot.address == old)
            return
        member = self.members[index]
        if kind == "freeze":
            os.kill(member.proc.pid, signal.SIGSTOP)
            member.frozen = True
            return
        member.kill()
        if kind == "kill_restart":
            time.sleep(5)
        member.start()
        ok = member.ready.wait(60)
        emit(event="member restarted", member=index, ready=ok, pid=member.proc.pid)

    def sample(self) -> None:
        row: dict[str, Any] = {"bootstrap": proc_figures(self.boot.proc.pid)}
        for member in self.members:
            figures = proc_figures(member.proc.pid)
            if figures is not None:
                figures["rounds"] = len(member.rows)
                figures["pid"] = member.proc.pid
            row[f"m{member.index}"] = figures
        emit(**row)
        self.samples.append({"t": now(), **row})

    def full(self, row: dict[str, Any]) -> bool:
        return row.get("outcome") == "averaged" and len(row.get("group", [])) == self.args.workers

    def member_summary(self, member: Member) -> dict[str, Any]:
        rows = [r for r in member.rows]
        outcomes: dict[str, int] = {}
        for r in rows:
            key = r.get("outcome", "error")
            outcomes[key] = outcomes.get(key, 0) + 1
        failures = [r for r in rows if r.get("problems")]
        fifth = max(1, len(rows) // 5)
        first, last = rows[:fifth], rows[-fifth:]

        def median(rs: list[dict[str, Any]], key: str) -> float | None:
            values = [r[key] for r in rs if key in r]
            return round(statistics.median(values), 3) if values else None

        def mean(rs: list[dict[str, Any]], key: str) -> float | None:
            values = [r[key] for r in rs if key in r]
            return round(statistics.fmean(values), 4) if values else None

        first_round_t = rows[0]["t"] if rows else None
        last_round_t = rows[-1]["t"] if rows else None
        # up to its last round: not the process on its way out (fds closed)
        mine = [
            s[f"m{member.index}"]
            for s in self.samples
            if s.get(f"m{member.index}") and last_round_t is not None and s["t"] <= last_round_t
        ]
        after_first = [
            s[f"m{member.index}"]
            for s in self.samples
            if first_round_t is not None and s["t"] > first_round_t and s.get(f"m{member.index}")
        ]
        pick = ("rss_mib", "fds", "threads")
        return {
            "rounds": len(rows),
            "outcomes": outcomes,
            "full": sum(self.full(r) for r in rows),
            "check_failures": len(failures),
            "first_failures": [(r["k"], r["problems"][:2]) for r in failures[:5]],
            "errors": [(r["k"], r["error"]) for r in rows if "error" in r][:5],
            "start": {k: after_first[0][k] for k in pick} if after_first else None,
            "end": {k: mine[-1][k] for k in pick} if mine else None,
            "peak_rss_mib": max((s["rss_mib"] for s in mine), default=None),
            **{
                key: [rows[0].get(key), rows[-1].get(key), max(r.get(key, 0) for r in rows)]
                for key in ("tasks", "conns", "dht_keys", "soak_keys")
                if rows
            },
            "step_s": [median(first, "step_s"), median(last, "step_s")],
            "matchmaking_s": [median(first, "matchmaking_s"), median(last, "matchmaking_s")],
            "allreduce_s": [median(first, "allreduce_s"), median(last, "allreduce_s")],
            "fraction": [mean(first, "fraction"), mean(last, "fraction")],
            "restarts": len({r["pid"] for r in rows}) - 1,
            "stderr_lines": member.stderr_lines(),
        }

    def rejoined_after(self, event: dict[str, Any]) -> float | None:
        """Seconds from the event to the first full round of the member it hit (of all
        members for the bootstrap), counted by round start (wall clock)."""
        start, period = self.start_wall, self.args.period
        targets = self.members if event["member"] < 0 else [self.members[event["member"]]]
        times = []
        for member in targets:
            ks = [
                r["k"]
                for r in member.rows
                if self.full(r) and start + r["k"] * period > event["wall"]
            ]
            if not ks:
                return None
            times.append(start + min(ks) * period - event["wall"])
        return round(max(times), 1)

    def summary(self) -> None:
        boot = [s["bootstrap"] for s in self.samples if s.get("bootstrap")]
        result: dict[str, Any] = {
            "event": "summary",
            "duration_s": self.args.duration,
            "period_s": self.args.period,
            "size": self.args.size,
            "bootstrap": {"start": boot[0] if boot else None, "end": boot[-1] if boot else None},
            "events": [
                {
                    "event": e["event"],
                    "member": e["member"],
                    "rejoined_after_s": self.rejoined_after(e),
                }
                for e in self.events
            ],
        }
        for member in self.members:
            result[f"m{member.index}"] = self.member_summary(member)
        emit(**result)
        self.result = result

    def close(self) -> None:
        for member in self.members:
            if member.frozen and member.alive():
                os.kill(member.proc.pid, signal.SIGCONT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                member.proc.wait(
                    timeout=max(0.0, self.end_wall + 10 - time.time())
                    if hasattr(self, "end_wall")
                    else 0
                )
            member.kill()
        if hasattr(self, "boot"):
            self.boot.end()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1320.0, help="seconds of rounds")
    parser.add_argument("--period", type=float, default=6.0, help="seconds between round starts")
    parser.add_argument("--workers", type=int, default=4, help="averaging processes")
    parser.add_argument("--size", type=int, default=1_000_000, help="float32 elements per member")
    parser.add_argument("--timeout", type=float, default=20.0, help="each step's timeout")
    parser.add_argument("--freeze", type=float, default=30.0, help="seconds SIGSTOPped")
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument(
        "--events", default=",".join(EVENTS), type=lambda s: [e for e in s.split(",") if e],
        help=f"comma-separated subset of {','.join(EVENTS)} ('' for none)",
    )  # fmt: skip
    parser.add_argument("--debug", action="store_true", help="members log matchmaking")
    parser.add_argument(
        "--workdir",
        help="keys, logs and rounds.jsonl here (made if missing, kept) instead of a new "
        "folder under the system's temporary directory (kept too, named in the 'up' line)",
    )
    # the member process (this file, run by the driver)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _member(args)
        return
    soak = Soak(args)
    try:
        soak.run()
    finally:
        soak.close()


if __name__ == "__main__":
    main()
