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
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import trio


# not __name__: that is "__main__" under `python -m peer.cli`, outside the "peer" tree
logger = logging.getLogger("peer.cli")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
BOOTSTRAP_STORED_BYTES = 8 << 20
BOOTSTRAP_POOL_BYTES = 4 << 20
BOOTSTRAP_RECEIVE_BYTES = 8 << 20  # large frames on their way in (DHT messages are small)
BOOTSTRAP_SEND_BYTES = 8 << 20  # and on their way out (FIND_VALUE pages: up to 1 MiB each)
_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # listen on all -> announce loopback


class _Interrupted(BaseException):
    """A stop signal arrived before the trio loop ran: unwinds the start-up to main()."""


class _SignalStop:
    """Owns SIGINT/SIGTERM for the whole run of main(): the first one stops, later ones are ignored.

    Until ``hand_over()`` (just before ``trio.run``) a signal raises _Interrupted, wherever
    the start-up is; after it, a signal cancels the scope given to ``cancelling()`` through
    the trio token (safe in a signal handler), or is kept for ``cancelling()`` to see.

    Later signals reach the same handler, which ignores them. It must stay a Python
    handler while main() runs: Python runs the handlers of signals that arrived together
    one after another, and one whose handler was set to SIG_IGN in between is reported as
    "ignored due to race condition" (a traceback on stderr, e.g. for SIGINT then SIGTERM).
    Only ``restore()``, after the trio loop, sets SIG_IGN, which outlives even the
    interpreter's own teardown, so ``timeout``'s double SIGTERM cannot kill a node that is
    stopping.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._raise = True
        self._cancel: Callable[[], object] | None = None
        # Taken over even when ignored from the start: a shell script starts its background
        # jobs with SIGINT ignored (`swarm bootstrap & ... kill -INT $!`), and a node that
        # kept ignoring it never stopped there (an outside tester; the contract is "stops
        # cleanly on SIGINT/SIGTERM").
        self.signals = _STOP_SIGNALS
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        # The _Interrupted a handler raises where Python cannot propagate it (a weakref
        # callback during an import) is printed as "Exception ignored"; start-up then goes
        # on and stops where it next looks at ``signum``. No traceback for that.
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._quiet_if_interrupted

    def _quiet_if_interrupted(self, unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, _Interrupted):
            self._unraisable(unraisable)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # already stopping
            return
        self.signum = signum
        if self._raise:
            raise _Interrupted
        if self._cancel is not None:
            self._cancel()

    def hand_over(self) -> None:
        """From now on a signal never raises: the trio loop is about to start."""
        self._raise = False

    @contextmanager
    def cancelling(self, scope: trio.CancelScope) -> Iterator[None]:
        """Within this block (inside trio), a stop signal cancels ``scope``."""
        import trio

        token = trio.lowlevel.current_trio_token()
        outer, self._cancel = self._cancel, lambda: token.run_sync_soon(scope.cancel)
        try:
            if self.signum is not None:  # came between hand_over() and here
                scope.cancel()
            yield
        finally:
            self._cancel = outer

    def restore(self) -> None:
        """Put the previous handlers back, unless a signal arrived (then ignore them for good)."""
        self._raise = False  # main() is returning: a signal now must not raise past it
        sys.unraisablehook = self._unraisable
        if self.signum is None:
            for s, handler in self._previous.items():
                if handler is not None:  # None: not set from Python, nothing to put back
                    signal.signal(s, handler)
            return
        # Blocked while switching: signal.signal() runs the handlers of signals already
        # caught, then sets SIG_IGN; one caught in between would be "ignored due to race
        # condition". A blocked one stays with the kernel, which drops it at SIG_IGN.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        try:
            for s in self.signals:
                signal.signal(s, signal.SIG_IGN)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm",
        description="Host and inspect the peer-to-peer network of a swarm training run.",
        epilog="Run 'swarm COMMAND --help' for the options of one command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
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
        type=_host,
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


def _silence_stdout() -> None:
    """Nobody reads stdout any more: send the rest to /dev/null, so exit does not fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


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


async def _bootstrap(args: argparse.Namespace, stop: _SignalStop) -> int:
    import trio

    from protocol.address import Address
    from protocol.errors import SwarmError
    from protocol.identity import Identity

    from .contacts import contacts_file, keep_contacts, load_contacts
    from .dht import DHTConfig
    from .host_config import HostConfig
    from .node import PeerConfig, open_peer
    from .wire import FRAME_POOL

    # A bootstrap node stays small whatever peers send it: it keeps at most 8 MiB of
    # others' records (about 16k small ones, counting each entry's overhead), 4 MiB of large
    # buffers for reuse, 8 MiB of large frames on their way in and 8 MiB on their way out,
    # where a volunteer keeps 256 MiB, 96 MiB, 256 MiB and 256 MiB.
    FRAME_POOL.limit = BOOTSTRAP_POOL_BYTES
    config = PeerConfig(
        host=HostConfig(
            receive_budget=BOOTSTRAP_RECEIVE_BYTES,
            receive_budget_per_host=BOOTSTRAP_RECEIVE_BYTES // 8,  # it averages nothing
            send_budget=BOOTSTRAP_SEND_BYTES,
            send_budget_per_host=BOOTSTRAP_SEND_BYTES // 8,
        ),
        dht=DHTConfig(max_stored_bytes=BOOTSTRAP_STORED_BYTES),
    )
    try:
        listen = Address(args.host, args.port).hostport  # brackets an IPv6 host
        initial_peers = _unique_peers(args.initial_peers or [])  # each once, however often given
        identity = None if args.identity is None else Identity.load_or_create(args.identity)
    except SwarmError as exc:  # a bad host or port; a key file that holds no key
        return _fail("bootstrap", str(exc))
    except OSError as exc:  # the key file cannot be read or created (it names the file)
        return _fail("bootstrap", f"identity file {args.identity}: {exc.strerror or exc}")
    if args.initial_peers == []:  # `--initial-peers $PEERS` with PEERS empty, say
        logger.warning("--initial-peers was given without an address: starting a new network alone")
    contacts = None if args.identity is None else contacts_file(args.identity)
    if args.identity is not None:
        _warn_if_others_can_use(args.identity)
    announce = args.announce_host or _WILDCARD_HOSTS.get(args.host, args.host)
    if args.announce_host is None and args.host in _WILDCARD_HOSTS:
        # the default --host: the printed address only works on this machine
        logger.warning(
            "listening on %s, announcing %s: peers on other machines cannot use this "
            "address; give --announce-host with this machine's public IP or DNS name",
            args.host,
            announce,
        )
    up = False
    try:
        # a signal while starting cancels the start; once up, it ends only the wait, so
        # the node's own shutdown runs uncancelled
        with trio.CancelScope() as starting, stop.cancelling(starting):
            async with open_peer(
                listen=listen,
                initial_peers=initial_peers,
                identity=identity,
                announce_host=announce,
                config=config,
                ensure_bootstrap_success=False,  # a backup of bootstrap nodes that are down
            ) as node:
                up = True
                # serving from before the address is out: a signal sent as soon as it is
                # read ends the wait, not the node's own shutdown
                with trio.CancelScope() as serving, stop.cancelling(serving):
                    try:
                        print(node.address, flush=True)
                    except BrokenPipeError:
                        _silence_stdout()
                        logger.warning("stdout is closed: the address is only in this log")
                    except OSError as exc:  # e.g. `> /dev/full`
                        _silence_stdout()
                        return _fail(
                            "bootstrap", f"cannot print the address: {exc.strerror or exc}"
                        )
                    logger.info("bootstrap node %s is up", node.address)
                    if contacts is None:
                        await trio.sleep_forever()
                    # after the address is out: dead contacts must not delay the start
                    await keep_contacts(node.dht, contacts, load_contacts(contacts))
                if stop.signum is not None:
                    logger.info("received %s, stopping", signal.Signals(stop.signum).name)
    except SwarmError as exc:
        return _fail("bootstrap", str(exc))
    except ValueError as exc:  # open_peer refused the host to announce (e.g. --host 0x7f.1)
        if up:
            raise
        return _fail("bootstrap", str(exc))
    except OSError as exc:
        if up:
            return _fail("bootstrap", str(exc))
        # binding: the port is taken, the host is no address of this machine or unknown
        return _fail("bootstrap", f"cannot listen on {listen}: {exc.strerror or exc}")
    return 0


def _warn_if_others_can_use(path: str) -> None:
    """Whoever reads the key file can impersonate the node: say so when others may."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        return
    if mode & 0o077:
        logger.warning(
            "identity file %s has mode %04o, open to other users: whoever reads the key "
            "can impersonate this node (run chmod 600 %s)",
            path,
            mode,
            path,
        )


def _unique_peers(addresses: Sequence[str]) -> list[str]:
    """The initial peers, each once (as parsed: ``h:01`` is ``h:1``), in the order given.

    Raises:
        ProtocolError: naming the first address that is malformed.
    """
    from protocol.address import Address
    from protocol.errors import ProtocolError

    unique: dict[str, None] = {}
    for given in addresses:
        text = given.strip()  # pasted with a space, or a CR from a file written on Windows
        if "," in text or len(text.split()) > 1:  # `--initial-peers "A,B"` or `"A B"`
            if len(text.replace(",", " ").split()) == 1:  # `"A,"`: one, and a stray comma
                raise ProtocolError(f"malformed address {given!r}: a stray comma")
            raise ProtocolError(
                f"{given!r} is several addresses: give them separated by spaces, unquoted "
                "(--initial-peers ADDR ADDR)"
            )
        try:
            unique[str(Address.parse(text))] = None
        except ProtocolError as exc:
            message, named = str(exc), f"malformed address {text!r}: "
            if message.startswith(named):  # named as given (the text is stripped)
                message = message[len(named) :]
            elif repr(text) in message:
                raise
            raise ProtocolError(f"malformed address {given!r}: {message}") from None
    return list(unique)


def _fail(command: str, message: str) -> int:
    print(f"swarm {command}: {message}", file=sys.stderr)
    return 1


async def _status(args: argparse.Namespace, stop: _SignalStop) -> dict[str, Any] | str:
    """The report (what was found by ``--timeout``, if the walk took longer), or why there
    is none."""
    import trio

    from protocol.errors import SwarmError
    from protocol.identity import PeerID

    from .crawl import crawl
    from .dht import DHTConfig
    from .node import PeerConfig, open_peer

    # Busy initial peers are dialed again for at most half the timeout (not the default
    # 30 s, past it): the report then still says they were busy, and the walk has time.
    busy_join = min(DHTConfig().busy_join_timeout, args.timeout / 2)
    config = PeerConfig(dht=DHTConfig(busy_join_timeout=busy_join))
    answered: dict[PeerID, str] = {}  # filled as the walk goes: kept when it is cut short
    elsewhere: dict[PeerID, set[str]] = {}  # a PeerID's other addresses that answered
    errors: dict[str, str] = {}
    try:
        with trio.CancelScope() as scope, stop.cancelling(scope):
            with trio.move_on_after(args.timeout) as deadline:
                async with open_peer(  # nobody answering is a report too: 0 peers, exit 1
                    listen=None,
                    initial_peers=_unique_peers(args.initial_peers),
                    client_mode=True,
                    config=config,
                    ensure_bootstrap_success=False,
                ) as node:
                    errors = dict(node.dht.contact_errors)
                    await crawl(node, answered=answered, elsewhere=elsewhere)
    except (SwarmError, OSError) as exc:
        return str(exc)
    # a PeerID that answered at several addresses is several processes with one key file:
    # each is listed (a trial's status hid one of two such twins)
    peers = sorted(
        (pid, addr)
        for pid, first in answered.items()
        for addr in [first, *sorted(elsewhere.get(pid, ()))]
    )
    return {
        "num_peers": len(peers),
        "peers": [{"peer_id": str(pid), "address": f"{pid}@{addr}"} for pid, addr in peers],
        "_errors": errors,  # why initial peers did not answer (stderr only)
        "_timed_out": deadline.cancelled_caught,
        "_twins": {str(pid): sorted([answered[pid], *more]) for pid, more in elsewhere.items()},
    }


def _print_status(report: dict[str, Any] | str, args: argparse.Namespace) -> int:
    if isinstance(report, str):
        print(f"swarm status: {report}", file=sys.stderr)
        return 1
    errors = report.pop("_errors", {})
    timed_out = report.pop("_timed_out", False)
    for peer_id, addresses in report.pop("_twins", {}).items():
        print(
            f"swarm status: {peer_id} answered at {' and '.join(addresses)}: several "
            "processes use one identity (a copied key file?), and peers cannot tell them "
            "apart; give each its own",
            file=sys.stderr,
        )
    if sys.stdout is None:  # started with stdout closed (`>&-`): nowhere to report
        return 1
    try:
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(f"{report['num_peers']} peer(s) reachable")
            for entry in report["peers"]:
                print(f"  {entry['address']}")
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `swarm status --json | head -3`
        _silence_stdout()
        return 1
    except OSError as exc:  # e.g. `> /dev/full`
        _silence_stdout()
        return _fail("status", f"cannot write the report: {exc.strerror or exc}")
    if timed_out:  # the same JSON shape, so that scripts can still read what was found
        found = (
            f"{report['num_peers']} peer(s) found by then"
            if report["peers"]
            else f"no peer answered by then; tried {_tried(args, errors, 'no answer yet')}"
        )
        print(
            f"swarm status: no complete answer within {args.timeout} s ({found})", file=sys.stderr
        )
        return 1
    if not report["peers"]:  # not even an initial peer: the swarm was not reached
        print(
            f"swarm status: no peer answered (tried {_tried(args, errors, '?')})", file=sys.stderr
        )
        return 1
    return 0


def _tried(args: argparse.Namespace, errors: dict[str, str], unknown: str) -> str:
    """Each initial peer with why it did not answer (``unknown`` where nothing says)."""
    return "; ".join(f"{a}: {errors.get(a, unknown)}" for a in _unique_peers(args.initial_peers))


if __name__ == "__main__":
    raise SystemExit(main())
