"""Average a tensor between processes started by hand on one machine.

    .venv/bin/python examples/average_tensors.py                          # prints its address
    .venv/bin/python examples/average_tensors.py --initial-peers ADDRESS  # in other terminals

Each process fills a tensor with its own value and averages it with whoever steps at the
same time; within a few rounds every process holds the mean of all the values. The first
process is the others' way in: start them before it has run its --rounds (rounds alone
count too), or they fail to join once it has left.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from peer import PeerUnavailableError, run_in_background
from protocol.errors import AddressError
from training import Averager, LayoutMismatchError


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
        "--codec", default="none", choices=["none", "float16", "int8"], help="all-reduce codec"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

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


if __name__ == "__main__":
    try:
        main()
    except (AddressError, PeerUnavailableError) as exc:  # a wrong or gone initial peer
        sys.exit(f"average_tensors: {exc}")
    except LayoutMismatchError as exc:  # another --codec, or another version of swarm
        sys.exit(f"average_tensors: {exc}")
    except KeyboardInterrupt:  # Ctrl-C: the peer has stopped on the way out
        sys.exit(130)
