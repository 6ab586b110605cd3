"""Average a tensor between processes started by hand on one machine.

    .venv/bin/python examples/average_tensors.py                          # prints its address
    .venv/bin/python examples/average_tensors.py --initial-peers ADDRESS  # in other terminals

Each process fills a tensor with its own value and averages it with whoever steps at the
same time; within a few rounds every process holds the mean of all the values. Rounds are
paced --pause seconds apart (1 s), so that processes started by hand a few seconds apart
still meet: unpaced, two processes ran their 20 rounds in ~6 s and a third started 10 s
later averaged with nobody. The first process is the others' way in: start them before it
has run its --rounds (rounds alone count too), or they fail to join once it has left.
Ctrl-C stops a process within a second or two (1.2-1.4 s mid-round here: the step unwinds
and the peer closes in ~0.05 s, the rest is the interpreter's and torch's own exit), without
a traceback (exit code 130).
"""

from __future__ import annotations

import signal
import sys

# Ctrl-C while torch imports (a second or two): exit quietly, as at any later moment
signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import argparse  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from peer import PeerUnavailableError, run_in_background  # noqa: E402
from protocol.errors import AddressError  # noqa: E402
from training import Averager, LayoutMismatchError  # noqa: E402

signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt from here on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--initial-peers", nargs="+", default=[], help="PEERID@HOST:PORT (omit: start a new swarm)"
    )
    parser.add_argument(
        "--value", type=float, default=random.uniform(0, 100), help="this process's value"
    )
    parser.add_argument("--rounds", type=int, default=20, help="averaging rounds (default 20)")
    parser.add_argument(
        "--pause", type=float, default=1.0, help="seconds between rounds (default 1)"
    )
    parser.add_argument(
        "--codec", default="none", choices=["none", "float16", "int8"], help="all-reduce codec"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not 0 <= args.pause <= 3600:
        parser.error(f"--pause must be between 0 and 3600 seconds, got {args.pause}")

    tensor = torch.full((100_000,), args.value)
    with run_in_background(listen="127.0.0.1:0", initial_peers=args.initial_peers) as node:
        print(f"address: {node.address}   (my value: {args.value:.3f})", flush=True)
        averager = Averager(node, "example/average", [tensor], codec=args.codec)
        for i in range(args.rounds):
            info = averager.step(timeout=30.0)  # a background peer's step blocks: no await
            print(
                f"round {i}: {info.outcome}, group of {len(info.group)}, "
                f"{info.averaged_fraction:.0%} averaged, value now {tensor[0].item():.3f}",
                flush=True,
            )
            if i + 1 < args.rounds:
                time.sleep(args.pause)  # the work a training step would do


if __name__ == "__main__":
    try:
        main()
    except (AddressError, PeerUnavailableError) as exc:  # a wrong or gone initial peer
        sys.exit(f"average_tensors: {exc}")
    except LayoutMismatchError as exc:  # another --codec, or another version of swarm
        sys.exit(f"average_tensors: {exc}")
    except KeyboardInterrupt:  # Ctrl-C: the peer has stopped on the way out
        sys.exit(130)
