"""A local swarm that really trains: one bootstrap node and N volunteers (3 by default).

    make demo                                  # or: .venv/bin/python examples/demo_swarm.py
    .venv/bin/python examples/demo_swarm.py --peers 4 --rounds 30

The parent starts `swarm bootstrap` and N volunteer processes. Each volunteer holds
its own shard of a synthetic classification task (non-IID: its shard is biased
towards some classes), trains a small MLP locally, and every few steps averages its
parameters with the others through the DHT-matched butterfly all-reduce
(`training.Averager`, int8-compressed). After every round, each volunteer prints its
model's loss and accuracy on a shared held-out set; averaging is what lets every
volunteer do well on all classes.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

NUM_CLASSES = 4
DIM = 16
MAX_PEERS = 64  # each volunteer is a process that imports torch
SILENCE = 600.0  # seconds without a line from any volunteer before the demo gives up


class Terminated(Exception):
    """SIGTERM to the demo (`kill PID`, a process manager): unwinds to the clean-up, which
    stops the volunteers and the bootstrap node (left running before: an outside tester)."""


def _terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up must finish
    raise Terminated


def _silence_stdout() -> None:
    """Whoever read our stdout is gone (`| head`, the parent demo died): write the rest to
    /dev/null, so that neither a print nor the exit's flush fails."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def make_data(seed: int, n: int, bias: int | None):
    """Gaussian blobs, one per class; a biased shard draws 90% from one class."""
    import torch

    g = torch.Generator().manual_seed(1234)
    centers = torch.randn(NUM_CLASSES, DIM, generator=g) * 0.9
    g = torch.Generator().manual_seed(seed)
    if bias is None:
        labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    else:
        labels = torch.where(
            torch.rand(n, generator=g) < 0.9,
            torch.full((n,), bias),
            torch.randint(0, NUM_CLASSES, (n,), generator=g),
        )
    x = centers[labels] + torch.randn(n, DIM, generator=g) * 1.4
    return x, labels


LIVE_TTL = 10.0
"""Seconds a volunteer's "still training" mark lasts; each round renews it, so a volunteer
that died stops being waited for at the final meeting within this long."""


async def barrier(node, name: str, expected: int) -> None:
    """Announce ourselves under ``name`` and wait (bounded) until every volunteer has, or
    at least every one still alive (whose "demo/live" mark has not expired)."""
    import trio

    with trio.move_on_after(60):
        while True:
            await node.dht.store(name, True, ttl=120, subkey=str(node.peer_id))
            present = await node.dht.get(name) or {}
            if len(present) >= expected:
                return
            live = await node.dht.get("demo/live") or {}
            if name == "demo/finished" and live and set(live) <= set(present):
                return
            await trio.sleep(0.5)


async def volunteer(args: argparse.Namespace) -> None:
    import torch

    from peer import open_peer
    from training import Averager

    torch.manual_seed(0)  # same initial weights everywhere, as after a state download
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, NUM_CLASSES)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    x, y = make_data(seed=100 + args.index, n=2000, bias=args.index % NUM_CLASSES)
    tensors = list(model.parameters())

    async with open_peer(listen="127.0.0.1:0", initial_peers=[args.initial_peer]) as node:
        averager = Averager(node, prefix="demo/params", tensors=tensors, codec="int8", group_size=8)
        await barrier(node, "demo/started", args.peers)  # so that rounds line up
        gen = torch.Generator().manual_seed(args.index)
        for round_no in range(args.rounds):
            for _ in range(args.local_steps):
                batch = torch.randint(0, len(x), (32,), generator=gen)
                loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                info = await averager.step(weight=1.0, epoch=round_no, timeout=15.0)
            report(args.index, round_no, model, info)
            await node.dht.store("demo/live", round_no, ttl=LIVE_TTL, subkey=str(node.peer_id))
        # Everyone finishes local work at a slightly different time: meet once more so
        # that all volunteers end with the same, averaged model.
        await barrier(node, "demo/finished", args.peers)
        with torch.no_grad():
            info = await averager.step(weight=1.0, epoch=args.rounds, timeout=15.0)
        report(args.index, args.rounds, model, info)


def report(index: int, round_no: int, model, info) -> None:
    """One JSON line: the model as it is after this round's averaging, on the shared
    held-out set (a training batch's loss would predate the averaging)."""
    import torch

    x_test, y_test = make_data(seed=999, n=2000, bias=None)
    with torch.no_grad():
        logits = model(x_test)
        loss = torch.nn.functional.cross_entropy(logits, y_test).item()
        accuracy = (logits.argmax(1) == y_test).float().mean().item()
    record = {
        "volunteer": index,
        "round": round_no,
        "test_loss": round(loss, 4),
        "test_accuracy": round(accuracy, 4),
        "group_size": len(info.group),
        "averaged_fraction": round(info.averaged_fraction, 3),
    }
    print(json.dumps(record), flush=True)


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


def solo_accuracy(steps: int) -> float:
    """Baseline: volunteer 0's model trained alone on its own shard for as many steps."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, NUM_CLASSES)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    x, y = make_data(seed=100, n=2000, bias=0)
    x_test, y_test = make_data(seed=999, n=2000, bias=None)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = torch.randint(0, len(x), (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=3, help="volunteer processes (default 3)")
    parser.add_argument(
        "--rounds", type=int, default=15, help="averaging rounds, plus a last meeting (15)"
    )
    parser.add_argument(
        "--local-steps", type=int, default=10, help="local SGD steps between averagings (10)"
    )
    parser.add_argument("--volunteer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peer", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # (--local-steps 0 averaged untrained models: chance accuracy, reported as a success)
    for flag, value in (
        ("--peers", args.peers),
        ("--rounds", args.rounds),
        ("--local-steps", args.local_steps),
    ):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.peers > MAX_PEERS:  # a million started processes until the machine gave in
        parser.error(f"--peers must be at most {MAX_PEERS}, got {args.peers}")
    if args.volunteer:
        return _volunteer_main(args)

    signal.signal(signal.SIGTERM, _terminated)
    processes: list[subprocess.Popen[str]] = []  # the bootstrap node first, then volunteers
    try:
        swarm = Path(sys.executable).with_name("swarm")
        processes.append(
            subprocess.Popen(
                [str(swarm), "bootstrap", "--host", "127.0.0.1"], stdout=subprocess.PIPE, text=True
            )
        )
        return _run(args, processes[0], processes)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: let the clean-up end
        print("demo interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("demo terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:  # `| head -3`: nobody reads the rest
        _silence_stdout()
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the clean-up runs to its end
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for proc in reversed(processes):  # the volunteers, then the bootstrap node
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def _volunteer_main(args: argparse.Namespace) -> int:
    """One volunteer process; every way it ends is one line at most, never a traceback."""
    code = 0
    try:
        import trio  # (Ctrl-C in the first second lands here: within the try)

        from protocol.errors import SwarmError

        try:
            trio.run(volunteer, args)
        except* SwarmError as group:  # e.g. the bootstrap node died before we joined
            print(f"volunteer {args.index}: {group.exceptions[0]}", file=sys.stderr)
            code = 1
        except* BrokenPipeError:  # the demo that reads our lines is gone: so are we
            _silence_stdout()
            code = 1
    except* KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one: no atexit traceback
        code = 130
    return code


def _run(
    args: argparse.Namespace, boot: subprocess.Popen[str], processes: list[subprocess.Popen[str]]
) -> int:
    """Start the volunteers (appended to ``processes``), print their lines, then the
    summary."""
    assert boot.stdout is not None
    address = boot.stdout.readline().strip()
    if not address:
        print("demo: the bootstrap node printed no address", file=sys.stderr)
        return 1
    print(f"bootstrap node: {address}", flush=True)
    workers: list[subprocess.Popen[str]] = []
    for i in range(args.peers):
        workers.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--volunteer",
                    f"--index={i}",
                    f"--initial-peer={address}",
                    f"--peers={args.peers}",
                    f"--rounds={args.rounds}",
                    f"--local-steps={args.local_steps}",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        processes.append(workers[-1])
    lines: queue.Queue[str | None] = queue.Queue()
    for worker in workers:
        threading.Thread(target=_pump, args=(worker, lines), daemon=True).start()
    final: dict[int, dict[str, float]] = {}
    running = len(workers)
    while running:
        try:
            line = lines.get(timeout=SILENCE)
        except queue.Empty:  # a volunteer stopped for good (SIGSTOP), say
            print(f"demo: no volunteer printed for {SILENCE:.0f} s; stopping", file=sys.stderr)
            return 1
        if line is None:
            running -= 1
            continue
        record = json.loads(line)
        final[record["volunteer"]] = record
        print(
            f"volunteer {record['volunteer']} round {record['round']:3d}  "
            f"test loss {record['test_loss']:.3f}  accuracy {record['test_accuracy']:.3f}  "
            f"group {record['group_size']}  averaged {record['averaged_fraction']:.2f}",
            flush=True,
        )
    for worker in workers:
        worker.wait(timeout=60)
    failed = [i for i, w in enumerate(workers) if w.returncode != 0]
    # a volunteer that died has no final accuracy (its last line predates its death)
    accuracies = [
        None if i in failed or i not in final else final[i]["test_accuracy"]
        for i in range(args.peers)
    ]
    solo = solo_accuracy(args.rounds * args.local_steps)
    print(
        json.dumps(
            {
                "swarm_final_test_accuracy": accuracies,
                "solo_test_accuracy_volunteer_0": round(solo, 4),
                "failed_volunteers": len(failed),
            }
        )
    )
    return 1 if failed or len(final) != args.peers else 0


if __name__ == "__main__":
    raise SystemExit(main())
