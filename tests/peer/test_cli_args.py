"""`swarm` argument parsing, in process (no network, no subprocess)."""

from __future__ import annotations

import errno
import importlib.metadata
import io
import logging
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from peer.cli import BOOTSTRAP_POOL_BYTES, BOOTSTRAP_STORED_BYTES, _parser, main
from peer.wire import FRAME_POOL
from protocol import Identity


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "bootstrap"],
        ["bootstrap", "-v"],
        ["--verbose", "bootstrap", "--port", "5"],
        ["bootstrap", "--port", "5", "--verbose"],
        ["-v", "status", "--initial-peers", "a@h:1"],
        ["status", "--initial-peers", "a@h:1", "-v"],
        ["-v", "bootstrap", "-v"],
    ],
)
def test_verbose_before_or_after_the_command(argv: list[str]) -> None:
    assert _parser().parse_args(argv).verbose is True


@pytest.mark.parametrize("command", ["bootstrap", "status"])
def test_initial_peers_given_twice_keeps_every_address(command: str) -> None:
    """argparse's default kept only the last --initial-peers: a dead address given after
    a live one hid the live one ("no peer answered")."""
    argv = [command, "--initial-peers", "a@h:1", "b@h:2", "--initial-peers", "c@h:3"]
    assert _parser().parse_args(argv).initial_peers == ["a@h:1", "b@h:2", "c@h:3"]
    parser = _parser()
    assert parser.parse_args([command, "--initial-peers", "a@h:1"]).initial_peers == ["a@h:1"]
    if command == "bootstrap":  # not given: None; given without an address: [] (warned)
        assert parser.parse_args([command]).initial_peers is None
        assert parser.parse_args([command, "--initial-peers"]).initial_peers == []


@pytest.mark.parametrize("argv", [["bootstrap"], ["status", "--initial-peers", "a@h:1"]])
def test_not_verbose_by_default(argv: list[str]) -> None:
    assert _parser().parse_args(argv).verbose is False


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "1e999", "soon", ""])
def test_status_refuses_a_timeout_that_is_not_a_positive_number(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["status", "--initial-peers", "a@h:1", "--timeout", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "swarm status: error: argument --timeout: "
        f"expected a positive number of seconds, got {value!r}"
    )


def test_status_timeout_is_seconds_as_a_float() -> None:
    args = _parser().parse_args(["status", "--initial-peers", "a@h:1", "--timeout", "2.5"])
    assert args.timeout == 2.5
    assert _parser().parse_args(["status", "--initial-peers", "a@h:1"]).timeout == 20.0


@pytest.mark.parametrize("argv", [["--help"], ["bootstrap", "--help"], ["status", "--help"]])
def test_help_reads_as_prose(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(argv)
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text  # no raw reST from a docstring
    description = text.split("\n\n")[1]
    assert description[0].isupper() and description.rstrip().endswith(".")
    if argv == ["--help"]:
        assert "bootstrap" in text and "status" in text


def test_version_is_the_installed_one(capsys: pytest.CaptureFixture[str]) -> None:
    """``swarm --version`` answered "the following arguments are required: COMMAND"."""
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"swarm {importlib.metadata.version('swarm')}\n"


@pytest.mark.parametrize(
    ("given", "host"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("example.org", "example.org"),
        ("::1", "::1"),
        ("[::1]", "::1"),
        ("::", "::"),
        ("[2001:db8::7]", "2001:db8::7"),
        ("0:0:0:0:0:0:0:1", "::1"),  # one spelling, so that "::" is recognised as "all"
    ],
)
@pytest.mark.parametrize("flag", ["--host", "--announce-host"])
def test_bootstrap_hosts_are_names_or_ips_with_ipv6_unbracketed(
    flag: str, given: str, host: str
) -> None:
    if flag == "--announce-host" and host == "::":
        return  # listening on all interfaces is fine; announcing "all" is not (below)
    args = _parser().parse_args(["bootstrap", flag, given])
    assert getattr(args, flag[2:].replace("-", "_")) == host


@pytest.mark.parametrize("given", ["0.0.0.0", "::", "[::]", "255.255.255.255", "224.0.0.1", "0"])
def test_bootstrap_refuses_to_announce_a_host_no_peer_dials(
    given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Peers skip contacts at such hosts: announcing one would leave the node in no table."""
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["bootstrap", "--announce-host", given])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(
            f"{given!r} is not an address peers can dial: give this machine's public IP or DNS name"
        )
    )


@pytest.mark.parametrize("given", ["127.0.0.1:5", "example.org:80", "[::1]:5", "[foo]", "::g", ""])
@pytest.mark.parametrize("flag", ["--host", "--announce-host"])
def test_bootstrap_refuses_a_host_with_a_port_in_one_line(
    flag: str, given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["bootstrap", flag, given])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"swarm bootstrap: error: argument {flag}: ")
    if given:
        assert last.endswith(
            f"{given!r} is not a host name or IP address (give the host without a port)"
        )
    else:
        assert last.endswith("the host is empty")


def test_a_bootstrap_node_keeps_small_budgets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bootstrap node stays under 60 MiB whatever peers send it: 8 MiB of others' records
    and 4 MiB of pooled frame buffers (a flood of tiny entries, then frames of 64 KiB to
    4 MiB, peaked at 59 MiB of RSS; with a volunteer's budgets it reached 119 MiB)."""
    seen = _bootstrap_until_open_peer(["--host", "127.0.0.1"], monkeypatch)
    assert "Address already in use" in capsys.readouterr().err
    assert seen["config"].dht.max_stored_bytes == BOOTSTRAP_STORED_BYTES == 8 << 20
    assert FRAME_POOL.limit == BOOTSTRAP_POOL_BYTES == 4 << 20


@pytest.mark.parametrize("given", ["70000", "65536", "-1", "0x10", "abc"])
def test_bootstrap_refuses_a_port_out_of_range_as_a_usage_error(
    given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was exit code 1 for 70000 or -1 but 2 for abc: the same mistake, two answers."""
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["bootstrap", "--port", given])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "swarm bootstrap: error: argument --port: "
        f"expected a TCP port from 0 to 65535, got {given!r}"
    )


@pytest.mark.parametrize("given", ["0", "31337", "65535"])
def test_bootstrap_takes_any_tcp_port(given: str) -> None:
    assert _parser().parse_args(["bootstrap", "--port", given]).port == int(given)


def test_bootstrap_refuses_an_empty_identity_file_name(capsys: pytest.CaptureFixture[str]) -> None:
    """Was "identity file : Is a directory" (the empty path is the current directory)."""
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["bootstrap", "--identity", ""])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith("argument --identity: the file name is empty")
    )


class _FullStdout(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def _bootstrap_until_open_peer(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, *, up: bool = False
) -> dict[str, Any]:
    """Run `swarm bootstrap` in process up to open_peer, which fails (with ``up``: starts,
    and the address then cannot be printed); its arguments."""
    seen: dict[str, Any] = {}

    @asynccontextmanager
    async def fake_open_peer(**kwargs: Any) -> AsyncIterator[SimpleNamespace]:
        seen.update(kwargs)
        if not up:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        yield SimpleNamespace(address=f"{'1' * 44}@{kwargs['announce_host']}:1")

    if up:
        monkeypatch.setattr("sys.stdout", _FullStdout())
        monkeypatch.setattr("peer.cli_commands._silence_stdout", lambda: None)
    monkeypatch.setattr("peer.node.open_peer", fake_open_peer)
    monkeypatch.setattr("peer.cli._configure_logging", lambda *args: None)  # other tests' levels
    monkeypatch.setattr(FRAME_POOL, "limit", FRAME_POOL.limit)  # restored afterwards
    assert main(["bootstrap", *argv]) == 1
    return seen


def test_bootstrap_warns_that_a_wildcard_host_prints_a_loopback_address(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The default --host 0.0.0.0 prints PEERID@127.0.0.1:PORT, which no other machine can
    use: said nowhere at run time before."""
    with caplog.at_level(logging.WARNING, logger="peer.cli"):
        seen = _bootstrap_until_open_peer([], monkeypatch, up=True)
    assert seen["announce_host"] == "127.0.0.1"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "listening on 0.0.0.0, announcing 127.0.0.1: peers on other machines cannot use this "
        "address; give --announce-host with this machine's public IP or DNS name"
    ]


@pytest.mark.parametrize("host", ["0", "127.1", "0x7f.1"])
def test_bootstrap_listens_on_an_ipv4_in_any_form_resolvers_read(
    host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--host 0` (or `127.1`) was announced as given, refused as undialable: exit 1 with
    an error about announce_host, a flag never given (an outside tester)."""
    seen = _bootstrap_until_open_peer(["--host", host], monkeypatch, up=True)
    dotted = "0.0.0.0" if host == "0" else "127.0.0.1"
    assert seen["listen"] == f"{dotted}:0"
    assert seen["announce_host"] == "127.0.0.1"


def test_a_failed_start_on_the_default_host_says_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The warning about the loopback address came before the error of a port in use: two
    lines where the docs promise one (an outside tester)."""
    with caplog.at_level(logging.WARNING, logger="peer.cli"):
        _bootstrap_until_open_peer(["--port", "4000"], monkeypatch)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(
    "argv", [["--host", "127.0.0.1"], ["--announce-host", "203.0.113.7"], ["--host", "::1"]]
)
def test_bootstrap_does_not_warn_about_a_host_given_on_purpose(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="peer.cli"):
        _bootstrap_until_open_peer(argv, monkeypatch)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o620, 0o604])
def test_bootstrap_warns_about_a_key_file_open_to_other_users(
    mode: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = tmp_path / "node.key"
    Identity.from_seed(bytes(32)).save(key)
    key.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="peer.cli"):
        seen = _bootstrap_until_open_peer(
            ["--host", "127.0.0.1", "--identity", str(key)], monkeypatch
        )
    assert seen["identity"].peer_id == Identity.from_seed(bytes(32)).peer_id  # still runs
    assert [r.getMessage() for r in caplog.records] == [
        f"identity file {key} has mode {mode:04o}, open to other users: whoever reads the key "
        f"can impersonate this node (run chmod 600 {key})"
    ]


def test_bootstrap_creates_its_key_file_without_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    key = tmp_path / "node.key"
    with caplog.at_level(logging.WARNING, logger="peer.cli"):
        _bootstrap_until_open_peer(["--host", "127.0.0.1", "--identity", str(key)], monkeypatch)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_bootstrap_warns_about_initial_peers_given_without_an_address(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`--initial-peers $PEERS` with PEERS empty started a lone network in silence (an
    evaluator's script); a node given no --initial-peers at all starts alone unwarned."""
    for blank in ([], [""], ["  "]):  # `$PEERS` unquoted, quoted (a quoting habit)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="peer.cli"):
            seen = _bootstrap_until_open_peer(
                ["--host", "127.0.0.1", "--initial-peers", *blank], monkeypatch
            )
        assert seen["initial_peers"] == []
        assert [r.getMessage() for r in caplog.records] == [
            "--initial-peers was given without an address: starting a new network alone"
        ]


def test_bootstrap_contacts_each_initial_peer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same address twice (also spelled differently: port 01) reached open_peer twice,
    whose DHT join then crashed with a KeyError traceback."""
    a = "6KKPsmJY8vaenxMPzr674T1cSeZmq4u8pzQcXN7eTAGK@127.0.0.1:1"
    b = "127.0.0.1:2"
    seen = _bootstrap_until_open_peer(
        ["--host", "127.0.0.1", "--initial-peers", a, b, a, a.replace(":1", ":01"), b],
        monkeypatch,
    )
    assert seen["initial_peers"] == [a, b]


def test_bootstrap_takes_an_initial_peer_pasted_with_spaces_or_a_carriage_return(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = "6KKPsmJY8vaenxMPzr674T1cSeZmq4u8pzQcXN7eTAGK@127.0.0.1:1"
    seen = _bootstrap_until_open_peer(
        ["--host", "127.0.0.1", "--initial-peers", f" {a}", f"{a}\r", f"{a}\n"], monkeypatch
    )
    assert seen["initial_peers"] == [a]


A = "6KKPsmJY8vaenxMPzr674T1cSeZmq4u8pzQcXN7eTAGK@127.0.0.1:1"


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (
            f"{A},{A}",
            f"{A + ',' + A!r} is several addresses: give them separated by spaces, unquoted "
            "(--initial-peers ADDR ADDR)",
        ),
        (
            f"{A} 127.0.0.1:2",
            f"{A + ' 127.0.0.1:2'!r} is several addresses: give them separated by spaces, "
            "unquoted (--initial-peers ADDR ADDR)",
        ),
        (f"{A},", f"malformed address {A + ','!r}: a stray comma"),
        (
            "xyz0@127.0.0.1:1",
            "malformed address 'xyz0@127.0.0.1:1': PeerID 'xyz0': invalid base58 character '0'",
        ),
        (" 127.0.0.1:99999", "malformed address ' 127.0.0.1:99999': port 99999 out of range"),
    ],
)
def test_status_names_a_malformed_initial_peer_in_one_line(
    given: str, said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was e.g. "invalid base58 character '0'", naming no address (and for "A,B": "not
    HOST:PORT", with no hint that several addresses are given apart)."""
    monkeypatch.setattr("peer.cli._configure_logging", lambda *args: None)  # other tests' levels
    assert main(["status", "--initial-peers", given]) == 1
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"swarm status: {said}\n")


@pytest.mark.parametrize("command", ["bootstrap", "status --initial-peers a@h:1"])
def test_an_unknown_flag_shows_its_commands_usage(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It used to print the top-level usage (`swarm [-h] [-v] COMMAND ...`)."""
    with pytest.raises(SystemExit) as exit_info:
        main([*command.split(), "--bogus", "x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: swarm {command.split()[0]}" in err
    assert "unrecognized arguments: --bogus x" in err


@pytest.mark.parametrize("given", ["x..y", "a/b", "a" * 64, "-foo", "foo-.org", "a!b"])
@pytest.mark.parametrize("flag", ["--host", "--announce-host"])
def test_bootstrap_refuses_a_host_with_a_bad_name_in_one_line(
    flag: str, given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was "invalid _announce_host value" (the parser's function name), and ``x..y`` was
    announced, which other nodes then failed to dial; ``--host x..y`` failed the start
    (exit code 1) where ``--announce-host x..y`` was a usage error (2: an outside tester)."""
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["bootstrap", f"{flag}={given}"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"swarm bootstrap: error: argument {flag}: host ")
    assert "_host" not in last


def test_bootstrap_refuses_to_announce_an_ip_with_a_final_dot(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No resolver looks "127.0.0.1." up: the printed address was one nobody could dial."""
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["bootstrap", "--announce-host", "203.0.113.7."])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("give 203.0.113.7")


@pytest.mark.parametrize("given", ["a_b.example.org", "example.org.", "bücher.de", "x-1.y"])
def test_bootstrap_announces_the_host_names_resolvers_take(given: str) -> None:
    assert _parser().parse_args(["bootstrap", "--announce-host", given]).announce_host == given


def test_status_short_of_files_prints_what_it_found_and_exits_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Peers the walk could not dial for want of a file descriptor make the list
    incomplete: it is printed, stderr says why, and the exit code is 1 (an outside
    tester's walk under ``ulimit -n 24`` listed 15 of 30 peers and exited 0)."""
    from peer.cli_commands import _print_status

    peer_id = str(Identity.from_seed(b"p" * 32).peer_id)
    report: dict[str, Any] = {
        "num_peers": 1,
        "peers": [{"peer_id": peer_id, "address": f"{peer_id}@127.0.0.1:4000"}],
        "_errors": {},
        "_timed_out": False,
        "_twins": {},
        "_short_of_files": 3,
    }
    args = SimpleNamespace(json=True, timeout=20.0, initial_peers=[])
    assert _print_status(report, args) == 1  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert '"num_peers": 1' in out
    assert "ran out of file descriptors (ulimit -n" in err
    assert "3 peer(s) not asked, the list is incomplete; raise the limit" in err


def test_a_signal_while_the_handlers_go_in_is_a_clean_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGINT's handler goes in, then SIGTERM's: a signal that came once the first was in
    ran it inside the second ``signal.signal`` call, and its _Interrupted came out of the
    constructor, before main() could catch it (a traceback and exit code 1 in a CI run of
    `test_a_signal_as_soon_as_the_command_owns_the_signals`). Simulated here: the first
    handler runs during the second install."""
    import signal

    from peer import cli_signals

    real = signal.signal
    installed: list[Any] = []

    def install(signum: int, handler: Any) -> Any:
        if installed:  # the signal arrives now, between the two installs
            installed[0](signal.SIGINT, None)
        installed.append(handler)
        return real(signum, handler)

    monkeypatch.setattr(cli_signals.signal, "signal", install)
    stop = cli_signals._SignalStop()
    monkeypatch.setattr(cli_signals.signal, "signal", real)
    try:
        assert stop.signum == signal.SIGINT
    finally:
        stop.restore()
        for signum, previous in stop._previous.items():
            real(signum, previous)


def test_signals_after_the_first_wait_blocked_until_they_are_ignored() -> None:
    """Once a signal stops the loop, later ones are blocked in this thread until
    ``restore()`` ignores them: each one caught was written to trio's wakeup socket, and
    one that came while trio closed it printed a BrokenPipeError traceback on a clean stop
    (an outside tester, 1 of ~80 stops by ``timeout``, which sends SIGTERM twice). A real
    second signal comes too, and is dropped: no handler runs, nothing is left pending."""
    import signal
    import threading

    from peer import cli_signals

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    stop = cli_signals._SignalStop()
    previous = dict(stop._previous)
    try:
        stop.hand_over()
        stop._handle(signal.SIGTERM, None)  # the first, as the loop runs
        assert {signal.SIGINT, signal.SIGTERM} <= signal.pthread_sigmask(signal.SIG_BLOCK, [])
        # a second, to this thread (the process's other threads may take one sent to it)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        assert signal.SIGTERM in signal.sigpending()
        stop.restore()  # SIG_IGN drops it
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
        assert signal.SIGTERM not in signal.sigpending()
        assert stop.signum == signal.SIGTERM
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
