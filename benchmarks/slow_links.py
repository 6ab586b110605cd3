"""How often peers on slow links average all together: the memory network, virtual time.

    python benchmarks/slow_links.py                          # 200 ms each way, 8 runs
    python benchmarks/slow_links.py --latency 0.1 --late 0.02 --runs 4
    python benchmarks/slow_links.py --window 4

``--peers`` peers (4) join one memory network whose every write arrives ``--latency``
seconds later (one way), plus ``|normal(0, --jitter)|`` seconds; a share ``--late`` of the
writes (2 %) arrives ``0.2 + 2 x latency`` seconds later instead, holding back what follows
on its connection, as a lost TCP segment does until it is sent again (writes stay in order
on a connection). ``--window-bytes`` bounds the bytes in flight per direction of a
connection (0: none), so that large parts take round trips to move; ``--bootstrap`` DHT-only
peers join first and the others through the first of them. Each peer steps one Averager
(``--window``: ``gather_window``; ``--size`` float32, ``none``) ``--steps`` times, with
``--pause`` seconds of "work" between steps, starting 0.37 s apart. Closer to the WAN trial
of docs/averaging.md: ``--latency 0.2 --jitter 0.04 --late 0.02 --size 1000000
--window-bytes 1048576 --bootstrap 1``. Virtual time (trio's MockClock): a run takes
seconds of CPU, not minutes, and nothing here is a speed figure. Prints one JSON document:
for each run, the steps in which all peers averaged together (``full``), the group sizes,
and the mean matchmaking and step time; then the mean of ``full`` over the runs. Runs differ
by their identities and late writes (seeded) and by trio's scheduling (randomized), so
compare means over several runs.

A WAN trial (session 43: 4 processes over an emulated 200 ms link with 2 % loss) split into
pairs that met in alternate slots; this models that kind of link without root or an
emulator. A model only: a change that gained here (session 44's read lag) gained nothing in
the real-TCP trial (docs/benchmarks.md), so confirm a gain over real links.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import random
import statistics
import sys
from contextlib import AsyncExitStack
from hashlib import sha256
from pathlib import Path

import numpy as np
import trio
import trio.testing
from _args import at_least, positive_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's code

from peer import MemoryNetwork, open_peer
from protocol.identity import Identity
from training import Averager, AveragerConfig

T0 = 1_700_000_000.0  # unix time at virtual time 0


class LossyNetwork(MemoryNetwork):
    """A memory network where a share of the writes arrive late (seeded)."""

    def __init__(
        self, latency: float, late: float, jitter: float, window: int | None, seed: int
    ) -> None:
        super().__init__(latency=latency, window=window)
        self.late, self.jitter = late, jitter
        self.rng = random.Random(seed)

    def extra_latency(self, a: str, b: str) -> float:
        late = self.rng.random() < self.late
        extra = abs(self.rng.gauss(0.0, self.jitter)) if self.jitter else 0.0
        return super().extra_latency(a, b) + extra + (0.2 + 2 * self.latency if late else 0.0)


async def one_run(args: argparse.Namespace, seed: int) -> dict[str, object]:
    window = None if args.window_bytes == 0 else args.window_bytes
    net = LossyNetwork(args.latency, args.late, args.jitter, window, seed)
    sizes: collections.Counter[int] = collections.Counter()
    matchmaking: list[float] = []

    def clock() -> float:
        return T0 + trio.current_time()

    async with AsyncExitStack() as stack:
        nodes = []
        for i in range(args.peers + args.bootstrap):
            host = f"10.0.0.{i + 1}"
            nodes.append(
                await stack.enter_async_context(
                    open_peer(
                        listen=f"{host}:1000",
                        initial_peers=[nodes[0].address] if nodes else [],
                        network=net.interface(host),
                        clock=clock,
                        identity=Identity.from_seed(sha256(b"%d/%d" % (seed, i)).digest()),
                    )
                )
            )
        await trio.sleep(5)  # routing tables settle
        start = trio.current_time()

        volunteers = nodes[args.bootstrap :]

        async def volunteer(i: int) -> None:
            array = np.full(args.size, float(i), np.float32)
            config = AveragerConfig(gather_window=args.window, clock=clock)
            averager = Averager(volunteers[i], prefix="bench/slow", tensors=[array], config=config)
            await trio.sleep(0.37 * i)
            epoch = 0
            for _ in range(args.steps):
                info = await averager.step(weight=1.0, epoch=epoch, timeout=30.0)
                epoch = max(epoch, info.epoch) + 1
                sizes[len(info.group)] += 1
                matchmaking.append(info.matchmaking_s)
                await trio.sleep(args.pause)
            averager.close()

        async with trio.open_nursery() as nursery:
            for i in range(args.peers):
                nursery.start_soon(volunteer, i)
        elapsed = trio.current_time() - start
    return {
        "seed": seed,
        "full": sizes[args.peers],
        "steps": sum(sizes.values()),
        "group_sizes": {str(k): v for k, v in sorted(sizes.items())},
        "matchmaking_s": round(statistics.mean(matchmaking), 3),
        "step_s": round(elapsed / args.steps, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=at_least(2), default=4)
    parser.add_argument("--latency", type=positive_seconds, default=0.2)
    parser.add_argument("--late", type=float, default=0.02, help="share of writes late")
    parser.add_argument("--window", type=positive_seconds, default=2.0)
    parser.add_argument("--steps", type=at_least(1), default=30)
    parser.add_argument("--pause", type=positive_seconds, default=3.0)
    parser.add_argument("--runs", type=at_least(1), default=8)
    parser.add_argument("--size", type=at_least(1), default=10_000, help="float32 per peer")
    parser.add_argument("--jitter", type=float, default=0.0, help="s, |normal| per write")
    parser.add_argument("--window-bytes", type=at_least(0), default=0, help="0: no limit")
    parser.add_argument("--bootstrap", type=at_least(0), default=0, help="DHT-only peers first")
    parser.add_argument("--first-seed", type=at_least(1), default=1)
    args = parser.parse_args()
    # the slow-link warning, once per averager and run: the figures here say it
    logging.getLogger("training").setLevel(logging.ERROR)
    if not 0.0 <= args.late < 1.0:
        parser.error(f"--late must be in [0, 1), got {args.late}")
    if not 0.0 <= args.jitter < 10.0:
        parser.error(f"--jitter must be seconds in [0, 10), got {args.jitter}")
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.runs):
        clock = trio.testing.MockClock(autojump_threshold=0)
        runs.append(trio.run(one_run, args, seed, clock=clock))
    settings = {k: v for k, v in vars(args).items() if k not in ("runs", "first_seed")}
    print(
        json.dumps(
            {
                **settings,
                "runs": runs,
                "full_mean": round(statistics.mean(r["full"] for r in runs), 1),  # type: ignore[misc]
                "steps_per_run": args.peers * args.steps,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
