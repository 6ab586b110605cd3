"""Data-parallel training of a small MLP: gradients averaged every step across processes.

    .venv/bin/python examples/train_mlp.py                 # 3 processes, 40 steps
    .venv/bin/python examples/train_mlp.py --peers 4 --steps 100 --codec int8

The parent runs a bootstrap peer and starts N worker processes of this script. Every
worker starts from the same weights, draws its own batches of a synthetic regression task
(a random teacher network), and after each backward averages its gradients with whoever
is ready (`Averager.step_blocking`, the blocking form for plain scripts), then steps its
optimizer: like PyTorch DDP, but over the swarm. Every 10 epochs of the swarm (counted from
the gradient rounds' reports, not by a local step count, so that a late worker meets the
others) it also averages its parameters (a second Averager), which pulls the models back
together after a round that did not reach everybody; until one such round has brought
it the others' values, a worker averages its parameters with a tiny weight, so that one
joining late takes on the swarm's parameters instead of pulling them back toward its
fresh ones. At the end the parent prints every
worker's test loss beside one process trained alone with the same total batch (N x the
worker batch).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import torch

DIM, HIDDEN, BATCH = 16, 64, 32


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights in every process
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
    )


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of a fixed random teacher network (the same for every seed)."""
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(DIM, 32, generator=teacher) / 4
    w2 = torch.randn(32, 1, generator=teacher)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=gen)
    return x, torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(n, 1, generator=gen)


def test_loss(model: torch.nn.Module) -> float:
    x, y = make_data(seed=999, n=2000)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def worker(args: argparse.Namespace) -> None:
    import peer
    from training import Averager

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = make_data(seed=100 + args.index, n=args.steps * BATCH)
    with peer.run_in_background(initial_peers=[args.bootstrap]) as node:
        # meet the others first (bounded), so that the first rounds already have company
        node.dht.store("train_mlp/ready", True, ttl=120, subkey=str(node.peer_id))
        until = time.monotonic() + 60
        while len(node.dht.get("train_mlp/ready") or {}) < args.peers and time.monotonic() < until:
            time.sleep(0.2)
        params = Averager(node, "train_mlp/params", list(model.parameters()), codec=args.codec)
        grads = None
        epoch = 0
        # A tiny weight in parameter rounds until one has brought us the others' values: a
        # worker that joins a running swarm then takes on its parameters instead of pulling
        # them back toward its own fresh ones (workers that start together are equal anyway)
        synced = False
        for step in range(args.steps):
            batch = slice(step * BATCH, (step + 1) * BATCH)
            loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
            opt.zero_grad(set_to_none=False)  # the same .grad tensors every step
            loss.backward()
            if grads is None:  # .grad exists from the first backward on
                grads = Averager(
                    node, "train_mlp/grads", [p.grad for p in model.parameters()], codec=args.codec
                )
            info = grads.step_blocking(weight=BATCH, epoch=epoch, timeout=30.0)
            epoch = max(epoch, info.epoch) + 1  # the swarm's progress (see the README)
            opt.step()
            if epoch % 10 == 0:  # by the swarm's epoch, not a local count (docs/averaging.md)
                report = params.step_blocking(
                    weight=1.0 if synced else 1e-3, epoch=epoch, timeout=30.0
                )
                synced = synced or (len(report.group) > 1 and report.received_fraction == 1.0)
                print(
                    f"worker {args.index} step {step + 1}: loss {loss.item():.4f}, grads "
                    f"{info.averaged_fraction:.0%} over {len(info.group)}, params {report}",
                    flush=True,
                )
        print(json.dumps({"worker": args.index, "test_loss": test_loss(model)}), flush=True)
        params.close()
        if grads is not None:
            grads.close()


def solo(peers: int, steps: int) -> float:
    """One process, the same steps, every worker's batch at once (what DDP would match)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    shards = [make_data(seed=100 + i, n=steps * BATCH) for i in range(peers)]
    for step in range(steps):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        x = torch.cat([s[0][batch] for s in shards])
        y = torch.cat([s[1][batch] for s in shards])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return test_loss(model)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be (and unwound the same)."""


def _terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up must finish
    raise _Terminated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=3, help="worker processes (default 3)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument(
        "--codec",
        default="none",
        choices=["none", "float16", "int8"],
        help="all-reduce codec (default none)",
    )
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)  # set for workers
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peers < 1 or args.steps < 1:
        parser.error(f"--peers and --steps must be at least 1, got {args.peers}, {args.steps}")
    if args.index is not None:
        worker(args)
        return

    import peer

    # `kill PID` of this process: unwind as Ctrl-C does, so that the workers are stopped
    # (they printed BrokenPipeError tracebacks once this process was gone: a tester)
    signal.signal(signal.SIGTERM, _terminated)
    print(f"test loss before training: {test_loss(make_model()):.4f}", flush=True)
    with peer.run_in_background() as bootstrap:
        common = ["--bootstrap", bootstrap.address, "--peers", str(args.peers)]
        common += ["--steps", str(args.steps), "--codec", args.codec]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--index", str(i), *common],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(args.peers)
        ]
        results: dict[int, float] = {}
        try:
            for proc in procs:  # each step is bounded (timeout=30.0), so workers end
                assert proc.stdout is not None
                for line in proc.stdout:
                    print(line, end="", flush=True)
                    if line.startswith("{"):
                        record = json.loads(line)
                        results[record["worker"]] = record["test_loss"]
                proc.wait()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if proc.stdout is not None:
                    proc.stdout.close()
    for index, loss in sorted(results.items()):
        print(f"worker {index}: test loss {loss:.4f}")
    batch = args.peers * BATCH
    print(f"one process, batch {batch}: test loss {solo(args.peers, args.steps):.4f}")


if __name__ == "__main__":
    try:
        main()
    except _Terminated:
        sys.exit(128 + signal.SIGTERM)
    except KeyboardInterrupt:  # Ctrl-C reaches every worker too; each stops its own peer
        sys.exit(130)
