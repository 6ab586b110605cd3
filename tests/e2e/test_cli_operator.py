"""`swarm` as a bootstrap host scripts it: real processes on loopback, read from the docs."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from tests_support_paths import env_with_root

from peer import run_in_background
from peer.background import BackgroundPeer

SWARM = [sys.executable, "-m", "peer.cli"]


@pytest.fixture
def node() -> Iterator[BackgroundPeer]:
    with run_in_background(listen="127.0.0.1:0") as peer:
        yield peer


def _status(*args: str, timeout: str = "20") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SWARM, "status", "--json", "--timeout", timeout, "--initial-peers", *args],
        capture_output=True,
        text=True,
        timeout=40,
        env=env_with_root(),
    )


def _start_bootstrap(*args: str) -> tuple[subprocess.Popen[str], str]:
    """A `swarm bootstrap` process on 127.0.0.1 and the address it printed."""
    proc = subprocess.Popen(
        [*SWARM, "bootstrap", "--host", "127.0.0.1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_with_root(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    ready, _, _ = select.select([proc.stdout], [], [], 15.0)
    address = proc.stdout.readline().strip() if ready else ""
    if not address:
        proc.kill()
        _, err = proc.communicate(timeout=15)
        pytest.fail(f"swarm bootstrap printed no address: {err}")
    return proc, address


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()  # also ends a stopped (SIGSTOP) process
    proc.communicate(timeout=15)


def test_status_with_an_initial_peer_given_twice(node: BackgroundPeer) -> None:
    """Was a KeyError traceback from the DHT join (one address, two contacts)."""
    spelled_otherwise = node.address.replace(":", ":0", 1)  # port 0NNNNN: the same address
    out = _status(node.address, node.address, spelled_otherwise)
    assert "Traceback" not in out.stderr
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["peers"] == [
        {"peer_id": node.address.split("@")[0], "address": node.address}
    ]


def test_status_counts_a_node_reached_under_two_names_once() -> None:
    """A node announcing `localhost`, asked at 127.0.0.1: listed at both, counted twice, and
    stderr warned of a copied key file (an outside tester, with the docs' systemd unit's
    announced DNS name checked through the IP)."""
    with (
        run_in_background(listen="127.0.0.1:0", announce_host="localhost") as first,
        run_in_background(listen="127.0.0.1:0", initial_peers=[first.address]) as second,
    ):
        out = _status(first.address.replace("@localhost:", "@127.0.0.1:"))
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["num_peers"] == 2, report
        assert {p["peer_id"] for p in report["peers"]} == {str(first.peer_id), str(second.peer_id)}
        assert "identity" not in out.stderr, out.stderr


def test_bootstrap_with_an_initial_peer_given_twice(node: BackgroundPeer) -> None:
    """Was a KeyError traceback and exit code 1: the same list given to every bootstrap
    host is easily pasted with a repeat."""
    proc, _ = _start_bootstrap("--initial-peers", node.address, node.address)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
        assert "Traceback" not in err and f"peer joined: {node.address[:8]}" in err
    finally:
        _end(proc)


@pytest.mark.slow
def test_status_lists_what_it_found_when_the_timeout_cuts_the_walk_short(
    node: BackgroundPeer,
) -> None:
    """A frozen peer in the DHT holds the walk past --timeout: the peers found by then are
    still printed, in the same JSON shape (was: nothing on stdout, so `| jq` failed)."""
    frozen, frozen_address = _start_bootstrap("--initial-peers", node.address)
    try:
        before = _status(node.address)
        assert before.returncode == 0, before.stderr
        assert json.loads(before.stdout)["num_peers"] == 2
        frozen.send_signal(signal.SIGSTOP)  # accepts connections (the kernel does), never answers

        out = _status(node.address, timeout="2.5")  # under the crawl's 3 s per peer
        assert out.returncode == 1
        report = json.loads(out.stdout)
        assert report == {
            "num_peers": 1,
            "peers": [{"peer_id": node.address.split("@")[0], "address": node.address}],
        }
        assert frozen_address not in out.stdout
        assert out.stderr.splitlines()[-1] == (
            "swarm status: no complete answer within 2.5 s (1 peer(s) found by then)"
        )
    finally:
        _end(frozen)


def _close_stderr() -> None:
    os.close(2)  # as `2>&-` does (some supervisors and cron setups)


def test_status_with_stderr_closed_keeps_its_json_clean() -> None:
    """print(file=sys.stderr) with sys.stderr None writes to stdout: the error line came
    after the JSON, and `json.loads` of the output failed."""
    out = subprocess.run(
        [*SWARM, "status", "--json", "--timeout", "20", "--initial-peers", "127.0.0.1:1"],
        stdout=subprocess.PIPE,
        text=True,
        timeout=40,
        env=env_with_root(),
        preexec_fn=_close_stderr,
    )
    assert out.returncode == 1
    assert json.loads(out.stdout) == {"num_peers": 0, "peers": []}


def test_bootstrap_with_stderr_closed_prints_no_error_where_the_address_goes() -> None:
    """Was "swarm bootstrap: cannot listen on ..." on stdout, read by a script as the
    address of the node."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [*SWARM, "bootstrap", "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.PIPE,
            text=True,
            timeout=40,
            env=env_with_root(),
            preexec_fn=_close_stderr,
        )
    assert (out.returncode, out.stdout) == (1, "")


def test_status_says_once_that_no_peer_answered() -> None:
    """The DHT's warning and the command's own line said the same, one after the other."""
    out = _status("127.0.0.1:1")
    assert out.returncode == 1
    [line] = out.stderr.splitlines()
    assert line.startswith("swarm status: no peer answered (tried 127.0.0.1:1: cannot reach ")


def test_status_cut_short_during_the_join_names_the_initial_peers() -> None:
    """The timeout ended the join itself (the initial peer accepted and said nothing): the
    line still says which initial peer was tried, not only that nobody answered."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        out = _status(address, timeout="1.5")
    assert (out.returncode, json.loads(out.stdout)["num_peers"]) == (1, 0)
    [line] = out.stderr.splitlines()
    assert line == (
        "swarm status: no complete answer within 1.5 s "
        f"(no peer answered by then; tried {address}: no answer yet)"
    )
