"""Butterfly all-reduce between processes on loopback, against torch.distributed gloo.

    python benchmarks/allreduce.py                      # 2 and 4 peers, 16M floats, ~5 min
    python benchmarks/allreduce.py --peers 2 --rates loopback --steps 2   # a quick look
    ALLREDUCE_PROFILE=/tmp/prof python benchmarks/allreduce.py ...       # py-spy each worker
    ALLREDUCE_TRACE=/tmp/rows python benchmarks/allreduce.py ...         # every worker's rows

Prints one JSON document. For each peer count: gloo's ``all_reduce`` of the same tensor in
as many processes (no encryption), then for each link (plain loopback; shaped to 1 Gbit/s
and 100 Mbit/s per peer and direction) and codec: the median over ``--steps`` rounds (after
a warmup round: every connection is open by then; only the rounds every peer averaged in
full count, ``steps_timed`` of them, ``all_averaged`` says whether all did) of the slowest
peer's butterfly time (``allreduce_s``, matchmaking excluded, as gloo's time excludes its
rendezvous) and of its whole step (``step_s``, matchmaking included), the mean CPU time of a peer's
step (``cpu_s``; well under ``step_s`` x cores / peers: the peers waited for each other;
the figure to watch on a loaded machine), and how many large buffers a peer allocated per
step (``fresh_buffers``: received frames, upload blobs, results, float64 sums; each one
page-faults).
``--chunk-bytes`` and ``--max-inflight`` override the ``AveragerConfig`` defaults.
Shaped runs add the wire-time lower bound ``2 (n-1)/n * encoded bytes / rate`` and the
ratio to it. Two shapers, named in the report: ``--shaper stream`` (the default) shapes
inside each peer with a rate-limiting stream wrapper, which moves bytes only while the
peer's event loop runs; ``--shaper kernel`` (Linux, root, ``tc``) has the kernel shape each
peer's uplink on the loopback device (an HTB class per peer address, see
``_shaping.KernelShaper``): the link goes on moving while the peer computes, as a NIC does,
and real TCP runs through a bottleneck queue, acknowledgements behind bulk data. Every peer
is its own process (one trio loop, one core's worth of Python); the Noise channel encrypts
every byte.

Two floors say what the machine allows, measured in the same run: ``cpu_floor_s`` (each
result: ``allreduce_cpu_s`` x peers / cores, where ``allreduce_cpu_s`` is a peer's CPU from
the moment its group was matched, the window ``allreduce_s`` times: the round time if the
peers' CPU work overlapped perfectly on this machine's cores; ``cpu_s`` still includes the
matchmaking's DHT traffic) and, per peer count, ``aead_floor_s``: AES-GCM sealing
and opening, in 64 KiB transport messages, of the bytes each peer sends and receives with
``none`` (2 (n-1)/n of the vector each way), for all peers, on this machine's cores: what
encryption alone costs before any socket, copy or sum.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _args import at_least, positive_seconds
from _shaping import KERNEL_BURST, LINK_BUFFER, KernelShaper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"
"""The loopback interface's name, for GLOO_SOCKET_IFNAME."""
CHUNK_BYTES = 2 << 20  # AveragerConfig.chunk_bytes' default
RATES = {"loopback": 0.0, "1gbit": 1e9, "100mbit": 1e8}


def encoded_bytes(codec: str, size: int, chunk: int) -> int:
    from protocol.codecs import get_codec

    c = get_codec(codec)
    full, rest = divmod(size, chunk)
    return full * c.encoded_size(chunk) + (c.encoded_size(rest) if rest else 0)


# -- our peers -----------------------------------------------------------------------------


async def swarm_worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import trio
    from _shaping import BoundTcpNetwork, ShapedNetwork, peer_address

    from peer import Network, open_peer
    from training import Averager, AveragerConfig

    if args.torch_threads:  # 0: torch's own default (every core)
        torch.set_num_threads(args.torch_threads)
    network: Network | None = None
    host = "127.0.0.1"
    if args.rate and args.shaper == "kernel":  # tc shapes what leaves our own address
        host = peer_address(args.index)
        network = BoundTcpNetwork(host)
    elif args.rate:
        network = ShapedNetwork(args.rate, args.link_buffer)
    initial = [args.initial_peer] if args.initial_peer else []
    async with open_peer(listen=f"{host}:0", initial_peers=initial, network=network) as node:
        _emit({"address": node.address})
        await trio.to_thread.run_sync(sys.stdin.readline)  # everybody is up: go
        tensor = torch.from_numpy(
            np.random.default_rng(args.index).standard_normal(args.size, dtype=np.float32)
        )
        tuning = {"chunk_bytes": args.chunk_bytes, "max_inflight": args.max_inflight}
        config = AveragerConfig(
            gather_window=args.window,
            stall_timeout=10.0,
            **{k: v for k, v in tuning.items() if v is not None},  # else the defaults
        )
        for codec in args.codecs:
            averager = Averager(node, f"bench/{codec}", [tensor], codec=codec, config=config)
            matched = _mark_matched(averager)
            for step in range(args.warmup + args.steps):
                # Everybody starts each step together: a peer whose step went alone (slow
                # start, a hiccup) would otherwise stay one round off for the whole run.
                _emit({"barrier": True})
                await trio.to_thread.run_sync(sys.stdin.readline)
                fresh = _fresh_buffers(averager)
                start, cpu = time.perf_counter(), time.process_time()
                matched.clear()
                info = await averager.step(weight=1.0, timeout=args.timeout)
                end_cpu = time.process_time()
                allreduce_cpu = end_cpu - matched.get("cpu", cpu)
                cpu = end_cpu - cpu
                fresh = {k: v - fresh[k] for k, v in _fresh_buffers(averager).items()}
                _emit(
                    {
                        "codec": codec,
                        "step": step,
                        "step_s": time.perf_counter() - start,
                        "allreduce_s": info.allreduce_s,
                        "cpu_s": cpu,
                        "allreduce_cpu_s": allreduce_cpu,
                        "outcome": str(info.outcome),
                        "fraction": info.averaged_fraction,
                        "group": len(info.group),
                        "info": str(info),
                        "fresh_buffers": fresh,
                        "end": time.time(),
                    }
                )
            averager.close()
        _emit({"done": True})
        await trio.to_thread.run_sync(sys.stdin.readline)  # stop (others may still fetch)


def _mark_matched(averager: Any) -> dict[str, float]:
    """A dict that gets this process's CPU time (``"cpu"``) when each step's matchmaking
    ends and its all-reduce begins: the all-reduce's own CPU, which ``cpu_floor_s`` compares
    with ``allreduce_s``, leaves out the CPU of the DHT traffic before it."""
    marks: dict[str, float] = {}
    find_group = averager._matchmaker.find_group

    async def marked(*args: Any, **kwargs: Any) -> Any:
        try:
            return await find_group(*args, **kwargs)
        finally:
            marks["cpu"] = time.process_time()

    averager._matchmaker.find_group = marked
    return marks


def _fresh_buffers(averager: Any) -> dict[str, int]:
    """Large buffers allocated so far (each one page-faults): frames, uploads, results."""
    from peer.wire import FRAME_POOL

    return {
        "frames": FRAME_POOL.allocated,
        "uploads": averager._pool.allocated,
        "results": averager._results.allocated,
        "wide_sums": averager._wide.allocated,
    }


def run_swarm(n: int, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    kernel = rate and args.shaper == "kernel"
    with KernelShaper(n, rate) if kernel else contextlib.nullcontext():
        rows = _run_workers(n, rate, args)
    if trace := os.environ.get("ALLREDUCE_TRACE"):  # a folder: every worker's raw rows
        Path(trace, f"rows{n}_{int(rate)}.json").write_text(json.dumps(rows))
    return summarize(rows, n, rate, args)


def _run_workers(n: int, rate: float, args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """Every worker's rows (one process per peer, released step by step together)."""
    base = [sys.executable, __file__, "--worker", "--size", str(args.size), "--rate", str(rate)]
    base += ["--steps", str(args.steps), "--warmup", "1", "--window", str(args.window)]
    base += ["--timeout", str(args.timeout), "--codecs", *args.codecs]
    base += ["--link-buffer", str(args.link_buffer), "--shaper", args.shaper]
    base += ["--torch-threads", str(args.torch_threads)]
    for name in ("chunk_bytes", "max_inflight"):
        if getattr(args, name) is not None:
            base += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    procs: list[subprocess.Popen[str]] = []
    try:
        address = ""
        profile = os.environ.get("ALLREDUCE_PROFILE")  # a folder: py-spy each worker
        for i in range(n):
            cmd = [*base, "--index", str(i), "--initial-peer", address]
            if profile:
                out = f"{profile}/worker{n}_{int(rate)}_{i}.txt"
                cmd = ["py-spy", "record", "-r", "250", "-f", "raw", "-o", out, "--", *cmd]
            procs.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
            first = _read_json(procs[-1])["address"]
            address = address or first
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        rows: list[list[dict[str, Any]]] = [[] for _ in procs]
        done = [False] * n
        while not all(done):  # each worker's rows up to its next barrier, then release all
            for i, p in enumerate(procs):
                while not done[i] and "barrier" not in (row := _read_json(p)):
                    done[i] = "done" in row
                    if not done[i]:
                        rows[i].append(row)
            for i, p in enumerate(procs):
                if not done[i]:
                    p.stdin.write("go\n")  # type: ignore[union-attr]
                    p.stdin.flush()  # type: ignore[union-attr]
        for p in procs:
            p.stdin.write("stop\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return rows


def summarize(
    rows: list[list[dict[str, Any]]], n: int, rate: float, args: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for codec in args.codecs:
        steps = [[r for r in mine if r["codec"] == codec and r["step"] >= 1] for mine in rows]
        per_step = list(zip(*steps, strict=True))
        # Times of the rounds every peer averaged in full only: a round that formed no group
        # (allreduce_s 0) or gave up on a part must not pass for a fast all-reduce.
        timed = [step for step in per_step if all(_averaged_all(r, n) for r in step)]
        allreduce = [max(r["allreduce_s"] for r in step) for step in timed]
        total = [max(r["step_s"] for r in step) for step in timed]
        cpu = [statistics.mean(r["cpu_s"] for r in step) for step in timed]
        allreduce_cpu = [statistics.mean(r["allreduce_cpu_s"] for r in step) for step in timed]
        cores = os.cpu_count() or 1
        result: dict[str, Any] = {
            "allreduce_s": _median(allreduce),
            "step_s": _median(total),
            "cpu_s": _median(cpu),  # per peer, matchmaking included
            "allreduce_cpu_s": _median(allreduce_cpu),  # per peer, from the matched group on
            # the round time if the peers' all-reduce CPU overlapped perfectly on the cores
            "cpu_floor_s": _median([c * n / min(n, cores) for c in allreduce_cpu]),
            "steps_timed": len(timed),  # of ``steps``: the rounds the medians are over
            # large buffers a peer allocated per step (each one page-faults), by use
            "fresh_buffers": {
                key: round(statistics.mean(r["fresh_buffers"][key] for st in per_step for r in st))
                for key in per_step[0][0]["fresh_buffers"]
            },
            "all_averaged": len(timed) == len(per_step),
        }
        short = [r["info"] for step in per_step for r in step if not _averaged_all(r, n)]
        if short:  # what the rounds that did not average everything reported
            result["not_averaged"] = short[:4]
        if rate:
            wire = encoded_bytes(codec, args.size, (args.chunk_bytes or CHUNK_BYTES) // 4)
            bound = 2 * (n - 1) / n * wire / (rate / 8)
            result["lower_bound_s"] = round(bound, 4)
            result["ratio_to_bound"] = _ratio(result["allreduce_s"], bound)
        out[codec] = result
    return out


def _averaged_all(row: dict[str, Any], n: int) -> bool:
    """Whether this peer's step averaged the whole vector over all ``n`` peers."""
    return bool(row["fraction"] == 1.0 and row["group"] == n)


def _median(values: list[float]) -> float | None:
    """The median, rounded; None when no round qualified."""
    return round(statistics.median(values), 4) if values else None


def _ratio(value: float | None, baseline: float) -> float | None:
    return None if value is None else round(value / baseline, 3)


# -- the cost of encryption alone ----------------------------------------------------------


def aead_floor(n: int, size: int) -> float:
    """Seconds to AES-GCM seal and open, in 64 KiB transport messages, what every peer sends
    and receives in a ``none`` round (best of 3), with the peers spread over this machine's
    cores."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from protocol.noise.cipher import TAG_LENGTH
    from protocol.noise.transport import MAX_PLAINTEXT_PER_MESSAGE

    per_peer = 2 * (n - 1) / n * 4 * size  # bytes each way: uploads, then results
    piece = MAX_PLAINTEXT_PER_MESSAGE
    messages = max(1, round(per_peer / piece))
    aead = AESGCM(bytes(32))
    plain = bytearray(piece)
    sealed = bytearray(piece + TAG_LENGTH)
    nonce = bytes(12)
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(messages):
            aead.encrypt_into(nonce, plain, None, sealed)
            aead.decrypt_into(nonce, sealed, None, plain)
        best = min(best, time.process_time() - start)
    cores = os.cpu_count() or 1
    return best * n / min(n, cores)


# -- gloo ----------------------------------------------------------------------------------


def gloo_worker(args: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.store}",  # a file, not a TCPStore (which listens on *)
        rank=args.index,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    tensor = torch.randn(args.size)
    times = []
    for _ in range(1 + args.steps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    _emit({"times": times[1:]})


def run_gloo(n: int, args: argparse.Namespace) -> float:
    """gloo's all_reduce time in ``n`` processes (median over steps of the slowest rank).

    The processes meet through a file (no TCP rendezvous) and gloo's own sockets bind the
    loopback interface, so nothing listens beyond 127.0.0.1 (a TCPStore listens on every
    address, and gloo otherwise binds the address the host name resolves to).
    """
    import tempfile

    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", _LOOPBACK)}
    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, __file__, "--gloo-worker", "--world", str(n)]
        cmd += ["--store", str(Path(folder, "store")), "--size", str(args.size)]
        cmd += ["--steps", str(args.steps), "--timeout", str(args.timeout)]
        procs: list[subprocess.Popen[str]] = []
        try:
            for i in range(n):
                procs.append(
                    subprocess.Popen(
                        [*cmd, "--index", str(i)], stdout=subprocess.PIPE, text=True, env=env
                    )
                )
            times = [_read_json(p)["times"] for p in procs]
            for p in procs:
                p.wait(timeout=60)
        finally:  # one that failed leaves the others waiting for it: end them
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return round(statistics.median(max(step) for step in zip(*times, strict=True)), 4)


# -- main ----------------------------------------------------------------------------------


def _read_json(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The next JSON line a worker printed (other lines, e.g. a profiler's, are skipped).

    Raises:
        RuntimeError: if the worker exited.
    """
    assert proc.stdout is not None
    while line := proc.stdout.readline():
        if line.startswith("{"):
            row: dict[str, Any] = json.loads(line)
            return row
    raise RuntimeError(f"worker exited with {proc.wait()}")


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=at_least(2), nargs="+", default=[2, 4])
    parser.add_argument("--size", type=at_least(1), default=16 * (1 << 20), help="float32 elements")
    parser.add_argument(
        "--codecs",
        nargs="+",
        default=["none", "float16", "int8"],
        choices=["none", "float16", "int8"],  # (topk needs parameters this script has not)
    )
    parser.add_argument("--rates", nargs="+", default=list(RATES), choices=list(RATES))
    parser.add_argument(
        "--steps", type=at_least(1), default=3, help="measured rounds after 1 warmup"
    )
    parser.add_argument(
        "--window", type=positive_seconds, default=1.0, help="gather window, seconds"
    )
    parser.add_argument("--timeout", type=positive_seconds, default=120.0)
    parser.add_argument("--chunk-bytes", type=at_least(1), help="AveragerConfig.chunk_bytes")
    parser.add_argument("--max-inflight", type=at_least(1), help="AveragerConfig.max_inflight")
    parser.add_argument(
        "--link-buffer",
        type=at_least(1),
        default=LINK_BUFFER,
        help="shaped links: bytes written ahead of the link (the socket buffer; see _shaping)",
    )
    parser.add_argument(
        "--shaper",
        choices=["stream", "kernel"],
        default="stream",
        help="shaped links: stream (a rate-limiting stream wrapper in each peer) or kernel"
        " (Linux tc on the loopback device; needs root)",
    )
    parser.add_argument(
        "--torch-threads",
        type=at_least(0),
        default=1,
        help="torch intra-op threads per peer process (0: torch's default, every core; "
        "several processes share the cores here, so 1 by default)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peer", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=at_least(0), default=1, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import trio

        trio.run(swarm_worker, args)
        return
    if args.gloo_worker:
        gloo_worker(args)
        return
    if args.shaper == "kernel" and (why := KernelShaper.unavailable()):
        parser.error(f"--shaper kernel: {why}")
    report: dict[str, Any] = {
        "size_elements": args.size,
        "size_mib": args.size * 4 / (1 << 20),
        "cpus": os.cpu_count(),
        "steps": args.steps,
        "shaper": args.shaper,
        "torch_threads": args.torch_threads,
        # slack of the shaped links: bytes a peer may send at once beyond the rate
        "link_buffer_bytes": KERNEL_BURST if args.shaper == "kernel" else args.link_buffer,
        "runs": {},
    }
    for n in args.peers:
        entry: dict[str, Any] = {
            "gloo_allreduce_s": run_gloo(n, args),
            "aead_floor_s": round(aead_floor(n, args.size), 4),
        }
        for name in args.rates:
            entry[name] = run_swarm(n, RATES[name], args)
            if name == "loopback":
                for result in entry[name].values():
                    result["ratio_to_gloo"] = _ratio(
                        result["allreduce_s"], entry["gloo_allreduce_s"]
                    )
        report["runs"][str(n)] = entry
        print(json.dumps({"progress": n, **entry}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
