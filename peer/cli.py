"""The ``swarm`` command line.

    swarm bootstrap [--host H] [--port P] [--identity FILE] [--initial-peers ADDR ...]
    swarm status --initial-peers ADDR [--json]

``bootstrap`` runs a DHT-only peer and never imports torch; ``status`` joins as a
client (no inbound connections), crawls the DHT and reports the peers it finds.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

import trio

logger = logging.getLogger("swarm")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    boot = commands.add_parser("bootstrap", help="host a DHT-only bootstrap node")
    boot.add_argument("--host", default="0.0.0.0", help="interface to listen on (default 0.0.0.0)")
    boot.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    boot.add_argument(
        "--announce-host",
        default=None,
        help="host to print in the address (default: --host, or 127.0.0.1 for 0.0.0.0)",
    )
    boot.add_argument("--identity", default=None, help="key file; created (mode 0600) when missing")
    boot.add_argument(
        "--initial-peers", nargs="*", default=[], metavar="ADDR", help="join an existing network"
    )

    status = commands.add_parser("status", help="show what the swarm looks like now")
    status.add_argument("--initial-peers", nargs="+", required=True, metavar="ADDR")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--timeout", type=float, default=20.0, help="give up after SECONDS")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "bootstrap":
            return trio.run(_bootstrap, args)
        if args.command == "status":
            return trio.run(_status, args)
    except KeyboardInterrupt:
        return 0
    raise AssertionError(args.command)


async def _bootstrap(args: argparse.Namespace) -> int:
    from protocol.errors import SwarmError

    from .node import open_peer

    announce = args.announce_host or ("127.0.0.1" if args.host == "0.0.0.0" else args.host)
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_peer(
                listen=f"{args.host}:{args.port}",
                initial_peers=args.initial_peers,
                identity=args.identity,
                announce_host=announce,
            ) as node:
                print(node.address, flush=True)
                logger.info("bootstrap node %s is up", node.address)
                async for signum in signals:
                    logger.info("received %s, stopping", signal.Signals(signum).name)
                    break
    except (SwarmError, OSError) as exc:
        print(f"swarm bootstrap: {exc}", file=sys.stderr)
        return 1
    return 0


async def _status(args: argparse.Namespace) -> int:
    from protocol.errors import SwarmError

    from .crawl import crawl
    from .node import open_peer

    try:
        with trio.fail_after(args.timeout):
            async with open_peer(
                listen=None, initial_peers=args.initial_peers, client_mode=True
            ) as node:
                peers = await crawl(node)
    except trio.TooSlowError:
        print(f"swarm status: no answer within {args.timeout} s", file=sys.stderr)
        return 1
    except (SwarmError, OSError) as exc:
        print(f"swarm status: {exc}", file=sys.stderr)
        return 1
    report: dict[str, Any] = {
        "num_peers": len(peers),
        "peers": [{"peer_id": str(pid), "address": f"{pid}@{addr}"} for pid, addr in peers],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{len(peers)} peer(s) reachable")
        for entry in report["peers"]:
            print(f"  {entry['address']}")
    if not peers:  # not even an initial peer: the swarm was not reached
        tried = ", ".join(args.initial_peers)
        print(f"swarm status: no peer answered (tried {tried})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
