"""`swarm` argument parsing, in process (no network, no subprocess)."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from peer.cli import BOOTSTRAP_POOL_BYTES, BOOTSTRAP_STORED_BYTES, _parser, main
from peer.wire import FRAME_POOL


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
    seen: dict[str, Any] = {}

    @asynccontextmanager
    async def fake_open_peer(**kwargs: Any) -> AsyncIterator[None]:
        seen.update(kwargs)
        raise OSError(errno.EADDRINUSE, "Address already in use")
        yield

    monkeypatch.setattr("peer.node.open_peer", fake_open_peer)
    monkeypatch.setattr("peer.cli._configure_logging", lambda *args: None)  # other tests' levels
    monkeypatch.setattr(FRAME_POOL, "limit", FRAME_POOL.limit)  # restored afterwards
    assert main(["bootstrap", "--host", "127.0.0.1"]) == 1
    assert "Address already in use" in capsys.readouterr().err
    assert seen["config"].dht.max_stored_bytes == BOOTSTRAP_STORED_BYTES == 8 << 20
    assert FRAME_POOL.limit == BOOTSTRAP_POOL_BYTES == 4 << 20
