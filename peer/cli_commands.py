"""The ``swarm`` commands once parsed (see peer.cli): ``bootstrap`` and ``status``, each
run inside ``trio.run`` by main()."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cli_signals import _SignalStop

# "peer.cli", not __name__: these were the command line's records before they moved here
logger = logging.getLogger("peer.cli")

BOOTSTRAP_STORED_BYTES = 8 << 20
BOOTSTRAP_POOL_BYTES = 4 << 20
BOOTSTRAP_RECEIVE_BYTES = 8 << 20  # large frames on their way in (DHT messages are small)
BOOTSTRAP_SEND_BYTES = 8 << 20  # and on their way out (FIND_VALUE pages: up to 1 MiB each)
_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # listen on all -> announce loopback


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
        # each once, however often given; a blank one is none (a quoted empty variable,
        # `--initial-peers "$PEERS"`, as an unquoted one gives no word at all)
        given = [a for a in args.initial_peers or [] if a.strip()]
        initial_peers = _unique_peers(given)
        identity = None if args.identity is None else Identity.load_or_create(args.identity)
    except SwarmError as exc:  # a bad host or port; a key file that holds no key
        return _fail("bootstrap", str(exc))
    except OSError as exc:  # the key file cannot be read or created (it names the file)
        return _fail("bootstrap", _identity_file_error(args.identity, exc))
    if args.initial_peers is not None and not given:  # `--initial-peers $PEERS`, PEERS empty
        logger.warning("--initial-peers was given without an address: starting a new network alone")
    contacts = None if args.identity is None else contacts_file(args.identity)
    if args.identity is not None:
        _warn_if_others_can_use(args.identity)
    announce = args.announce_host or _WILDCARD_HOSTS.get(args.host, args.host)
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
                if args.announce_host is None and args.host in _WILDCARD_HOSTS:
                    # the default --host: the printed address only works on this machine
                    # (said once listening: a start that fails says one line, its error)
                    logger.warning(
                        "listening on %s, announcing %s: peers on other machines cannot use "
                        "this address; give --announce-host with this machine's public IP "
                        "or DNS name",
                        args.host,
                        announce,
                    )
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


def _identity_file_error(path: str, exc: OSError) -> str:
    folder = os.path.dirname(path) or "."
    if isinstance(exc, FileNotFoundError) and not os.path.isdir(folder):
        # "No such file or directory" read as "the key file is missing", which is created
        return (
            f"identity file {path}: its folder {folder} does not exist (the key file is "
            "created, its folder is not: mkdir -p it first)"
        )
    return f"identity file {path}: {exc.strerror or exc}"


def _fail(command: str, message: str) -> int:
    print(f"swarm {command}: {message}", file=sys.stderr)
    return 1


def _silence_stdout() -> None:
    """Nobody reads stdout any more: send the rest to /dev/null, so exit does not fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


async def _status(args: argparse.Namespace, stop: _SignalStop) -> dict[str, Any] | str:
    """The report (what was found by ``--timeout``, if the walk took longer), or why there
    is none."""
    import trio

    from protocol.errors import SwarmError
    from protocol.identity import PeerID

    from .crawl import crawl
    from .dht import DHTConfig
    from .endpoints import distinct_endpoints
    from .node import PeerConfig, open_peer

    # Busy initial peers are dialed again for at most half the timeout (not the default
    # 30 s, past it): the report then still says they were busy, and the walk has time.
    busy_join = min(DHTConfig().busy_join_timeout, args.timeout / 2)
    config = PeerConfig(dht=DHTConfig(busy_join_timeout=busy_join))
    answered: dict[PeerID, str] = {}  # filled as the walk goes: kept when it is cut short
    elsewhere: dict[PeerID, set[str]] = {}  # a PeerID's other addresses that answered
    errors: dict[str, str] = {}
    short_of_files: set[str] = set()  # peers not asked: this process had no file left
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
                    await crawl(
                        node,
                        answered=answered,
                        elsewhere=elsewhere,
                        short_of_files=short_of_files,
                    )
                    # the walk starts from the routing table, which keeps one address per
                    # PeerID: two processes on one key file, both given, showed as one
                    # (an outside tester, 5 of 5 runs); the join proved each address
                    for hostport, pid in node.dht.initial_peers_answered.items():
                        if pid in answered and answered[pid] != hostport:
                            elsewhere.setdefault(pid, set()).add(hostport)
    except (SwarmError, OSError) as exc:
        return str(exc)
    # a PeerID that answered at several addresses is several processes with one key file:
    # each is listed (a trial's status hid one of two such twins); but one node reached
    # under two names (`localhost` and `127.0.0.1`) is listed once, and is no twin
    for pid, more in list(elsewhere.items()):
        kept = await distinct_endpoints([answered[pid], *sorted(more)])
        if len(kept) > 1:
            elsewhere[pid] = set(kept[1:])
        else:
            del elsewhere[pid]
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
        "_short_of_files": len(short_of_files - {addr for _, addr in peers}),
        "_twins": {str(pid): sorted([answered[pid], *more]) for pid, more in elsewhere.items()},
    }


def _print_status(report: dict[str, Any] | str, args: argparse.Namespace) -> int:
    if isinstance(report, str):
        print(f"swarm status: {report}", file=sys.stderr)
        return 1
    errors = report.pop("_errors", {})
    timed_out = report.pop("_timed_out", False)
    short_of_files = report.pop("_short_of_files", 0)
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
    if short_of_files:  # as for a timeout: what was found, said incomplete
        from .network import open_files_limit

        print(
            f"swarm status: this process ran out of file descriptors ({open_files_limit()}):"
            f" {short_of_files} peer(s) not asked, the list is incomplete; raise the limit",
            file=sys.stderr,
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
