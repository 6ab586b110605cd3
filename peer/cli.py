"""The ``swarm`` command line.

    swarm [-v] bootstrap [--host H] [--port P] [--announce-host H] [--identity FILE]
                         [--initial-peers ADDR ...]
    swarm [-v] status --initial-peers ADDR [--json] [--timeout SECONDS]

``bootstrap`` runs a DHT-only peer and never imports torch; ``status`` joins as a
client (no inbound connections), crawls the DHT and reports the peers it finds.

Signals: the first SIGINT/SIGTERM stops the command (``bootstrap`` exits 0), whenever
it comes; later ones, of either kind, are ignored, so a second signal cannot cut the
shutdown short. This holds also when SIGINT was ignored when the command started (a
shell script's background job, ``swarm bootstrap &``): the command takes it over.

The commands themselves run in ``peer.cli_commands``; the signal handling is
``peer.cli_signals``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import ipaddress
import logging
import math
import os
import re
import sys
from collections.abc import Sequence

from .cli_commands import BOOTSTRAP_POOL_BYTES as BOOTSTRAP_POOL_BYTES
from .cli_commands import BOOTSTRAP_RECEIVE_BYTES as BOOTSTRAP_RECEIVE_BYTES
from .cli_commands import BOOTSTRAP_SEND_BYTES as BOOTSTRAP_SEND_BYTES
from .cli_commands import BOOTSTRAP_STORED_BYTES as BOOTSTRAP_STORED_BYTES
from .cli_commands import _bootstrap, _print_status, _status
from .cli_signals import _Interrupted, _SignalStop


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 0 to 65535, got {text!r}")
    return port


def _file_name(text: str) -> str:
    if not text:  # Path("") is the current directory
        raise argparse.ArgumentTypeError("the file name is empty")
    return text


def _host(text: str) -> str:
    """A host name or IP address; an IPv6 one with or without brackets (``::1``, ``[::1]``)."""
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if ":" in host or host != text:
        try:
            return str(ipaddress.IPv6Address(host))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a host name or IP address (give the host without a port)"
            ) from None
    if not host:
        raise argparse.ArgumentTypeError("the host is empty")
    return host


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _check_host_name(text: str, host: str) -> None:
    """Refuse what the wire's Address lets through (a resolver on some peer may know it)
    but no peer's resolver looks up: an IP with a final dot, a label that starts or ends
    with a hyphen, other characters than letters, digits, ``-`` and ``_``."""
    name = host.encode("idna").decode("ascii") if not host.isascii() else host
    if name.endswith("."):
        with contextlib.suppress(ValueError):
            ipaddress.IPv4Address(name[:-1])
            raise argparse.ArgumentTypeError(
                f"{text!r} is an IP address with a final dot, which resolvers do not look "
                f"up: give {name[:-1]}"
            )
        name = name[:-1]
    if not all(_HOST_LABEL.fullmatch(label) for label in name.split(".")):
        raise argparse.ArgumentTypeError(
            f"host {text!r} is not a valid host name (letters, digits, '-' and '_' in each "
            "dot-separated label, which neither starts nor ends with '-')"
        )


def _listen_host(text: str) -> str:
    """A host to listen on, checked as ``--announce-host`` is: a malformed name is a usage
    error (exit code 2) too, not a failed start (1; an outside tester)."""
    host = _host(text)
    if ":" not in host:
        _check_host_name(text, host)
        if all(c in "0123456789abcdefABCDEFxX." for c in host):
            # what resolvers read as an IPv4 address (inet_aton's forms: `0` is 0.0.0.0,
            # `127.1` 127.0.0.1), as a dotted quad: announced as given, it was refused as
            # undialable, a failed start (exit 1) blaming --announce-host (an outside tester)
            import socket  # (lazily: the signals are taken over after this module loads)

            with contextlib.suppress(OSError):  # not one: a name (`cafe`)
                host = socket.inet_ntoa(socket.inet_aton(host))
    return host


def _announce_host(text: str) -> str:
    """A host other peers can dial (not ``0.0.0.0``, ``::``, broadcast or multicast)."""
    from protocol.address import Address  # lazily, as the rest: --help stays instant
    from protocol.errors import AddressError

    host = _host(text)
    try:
        dialable = Address(host, 1).dialable
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if ":" not in host:
        _check_host_name(text, host)
    if not dialable:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an address peers can dial: give this machine's public IP or DNS name"
        )
    return host


def _version() -> str:
    """This installation's version (from its metadata; "unknown" when run from a tree
    that was never installed)."""
    try:
        return importlib.metadata.version("swarm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm",
        description="Host and inspect the peer-to-peer network of a swarm training run.",
        epilog="Run 'swarm COMMAND --help' for the options of one command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"swarm {_version()}")
    # the same flag after the command; SUPPRESS keeps it from resetting a top-level -v
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at DEBUG level"
    )
    commands = parser.add_subparsers(
        title="commands", dest="command", required=True, metavar="COMMAND"
    )

    boot = commands.add_parser(
        "bootstrap",
        parents=[common],
        help="host a DHT-only bootstrap node",
        description="Host a DHT-only bootstrap node (no training, no torch). Prints its "
        "address PEERID@HOST:PORT on one line on stdout, logs peers that join and leave to "
        "stderr, and stops cleanly (exit code 0) on SIGINT or SIGTERM.",
    )
    boot.add_argument(
        "--host",
        type=_listen_host,
        default="0.0.0.0",
        help="interface to listen on (default: 0.0.0.0, all IPv4 ones; :: for all IPv6 ones)",
    )
    boot.add_argument(
        "--port",
        type=_port,
        default=0,
        help="TCP port (default: any free port; pick a fixed one for a public node)",
    )
    boot.add_argument(
        "--announce-host",
        type=_announce_host,
        default=None,
        metavar="HOST",
        help="host written into the printed address, without a port (default: --host, or "
        "127.0.0.1 for 0.0.0.0 and ::1 for ::; set your public IP or DNS name)",
    )
    boot.add_argument(
        "--identity",
        type=_file_name,
        default=None,
        metavar="FILE",
        help="Ed25519 key file, created (mode 0600) when missing; keeps the address across "
        "restarts. The node's contacts are kept in FILE.contacts and dialed at a restart, "
        "so that it finds its swarm again on another port too",
    )
    boot.add_argument(
        "--initial-peers",
        nargs="*",
        action="extend",  # given twice: every address counts (the default kept the last)
        default=None,  # [] when given without an address (warned about: an empty variable?)
        metavar="ADDR",
        help="PEERID@HOST:PORT of nodes to join (other bootstrap nodes)",
    )

    status = commands.add_parser(
        "status",
        parents=[common],
        help="list the peers reachable through the DHT",
        description="Join as a client, walk the DHT and list every peer that answered. "
        "Exit code 0 when at least one peer answered and the walk ended within --timeout; "
        "1 otherwise (a walk cut short still prints the peers found by then).",
    )
    status.add_argument(
        "--initial-peers",
        nargs="+",
        action="extend",
        required=True,
        metavar="ADDR",
        help="PEERID@HOST:PORT of any node in the swarm",
    )
    status.add_argument(
        "--json", action="store_true", help='print {"num_peers": N, "peers": [...]} for scripts'
    )
    status.add_argument(
        "--timeout",
        type=_seconds,
        default=20.0,
        metavar="SECONDS",
        help="give up after SECONDS (default: 20)",
    )
    for sub in (boot, status):  # an unknown flag is reported with its command's usage
        sub.set_defaults(command_parser=sub)
    return parser


def _configure_logging(verbose: bool, ours: int) -> None:
    """Logs to stderr: everything at DEBUG with -v; else this project's loggers (``peer.*``,
    ``protocol.*``) from level ``ours`` and the libraries' from WARNING."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name in ("peer", "protocol"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else ours)


def _guard_closed_stdio() -> None:
    """Started with stdout or stderr closed (``>&-``, ``2>&-``): /dev/null takes the
    descriptor, so that no socket becomes fd 1 or 2, and stderr's lines go nowhere instead
    of to stdout (``print(file=None)`` writes to stdout: into the JSON, or where the
    address is read from). A closed stdout stays ``sys.stdout is None``: nowhere to report.
    """
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - as long as the process


def _command_named(argv: Sequence[str]) -> str | None:
    """The first command name in ``argv``, read without the parser."""
    return next((arg for arg in argv if arg in ("bootstrap", "status")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `swarm` command; returns the exit code."""
    stop = _SignalStop()  # first: a signal during the imports below must end cleanly too
    command = None
    try:
        if stop.signum is not None:  # came while the handlers went in
            raise _Interrupted
        _guard_closed_stdio()  # (inside: a signal may come as soon as the handlers are in)
        args, unknown = _parser().parse_known_args(argv)
        if unknown:  # (parse_args would print the top-level usage, not the command's)
            args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        command = args.command
        # a bootstrap node logs peers joining and leaving (INFO); status says what went
        # wrong in its own last line (the DHT's "no initial peer answered" repeated it)
        _configure_logging(args.verbose, logging.INFO if command == "bootstrap" else logging.ERROR)
        import trio

        if command == "bootstrap":
            stop.hand_over()
            return trio.run(_bootstrap, args, stop)
        if command == "status":
            stop.hand_over()
            report = trio.run(_status, args, stop)
            if stop.signum is not None:
                return 128 + stop.signum  # interrupted: not a health-check answer
            return _print_status(report, args)
        raise AssertionError(command)
    except _Interrupted:
        assert stop.signum is not None
        if command is None:  # still parsing: the command line says which it was
            command = _command_named(sys.argv[1:] if argv is None else argv)
        # a bootstrap node stops cleanly; anything else was cut short (a health check
        # interrupted must not read as healthy)
        return 0 if command == "bootstrap" else 128 + stop.signum
    finally:
        stop.restore()


if __name__ == "__main__":
    raise SystemExit(main())
