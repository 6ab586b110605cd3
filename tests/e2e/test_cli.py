"""The real `swarm` command line, as subprocesses on loopback."""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from tests_support_paths import env_with_root

from peer import open_peer
from protocol import Identity
from tests.peer.ipv6_loopback import ipv6_loopback

pytestmark = pytest.mark.slow

SWARM = [sys.executable, "-m", "peer.cli"]


class Bootstrap:
    """A `swarm bootstrap` process; its address is the first line it prints."""

    def __init__(self, *args: str, host: str = "127.0.0.1") -> None:
        self.proc = subprocess.Popen(
            [*SWARM, "bootstrap", "--host", host, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_with_root(),
        )
        assert self.proc.stdout is not None
        # bounded: a bootstrap that never prints fails the test instead of hanging it
        ready, _, _ = select.select([self.proc.stdout], [], [], 30.0)
        if not ready:
            self.proc.kill()
            pytest.fail("swarm bootstrap printed no address within 30 s")
        self.address = self.proc.stdout.readline().strip()
        shown = host if host.startswith("[") or ":" not in host else f"[{host}]"
        assert f"@{shown}:" in self.address, self.proc.stderr.read() if not self.address else ""

    def __enter__(self) -> Bootstrap:
        return self

    def __exit__(self, *exc: object) -> None:
        """Killed if still running (a failed assertion must not leave it behind)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.stop()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=15)
        finally:
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def bootstraps() -> Iterator[list[Bootstrap]]:
    started: list[Bootstrap] = []
    yield started
    for node in started:
        if node.proc.poll() is None:
            node.proc.kill()
        node.stop()


def _read_until(stream: object, needle: str, timeout: float = 30.0) -> str:
    """What a process wrote on ``stream`` (a pipe) up to the first ``needle``; bounded."""
    fd = stream.fileno()  # type: ignore[attr-defined]
    seen = b""
    deadline = time.monotonic() + timeout
    while needle.encode() not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            pytest.fail(f"no {needle!r} within {timeout} s; got {seen.decode()!r}")
        seen += chunk
    return seen.decode()


def _run_status(address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SWARM, "status", "--initial-peers", address, "--json", "--timeout", "20"],
        capture_output=True,
        text=True,
        timeout=40,
        env=env_with_root(),
    )


def _status(address: str) -> dict[str, object]:
    out = _run_status(address)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_three_bootstraps_find_each_other_and_survive_the_first(
    bootstraps: list[Bootstrap], tmp_path: Path
) -> None:
    key = tmp_path / "first.key"
    first = Bootstrap("--identity", str(key))
    bootstraps.append(first)
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    second = Bootstrap("--initial-peers", first.address)
    bootstraps.append(second)
    third = Bootstrap("--initial-peers", first.address)
    bootstraps.append(third)
    everyone = {first.address, second.address, third.address}

    for node in bootstraps:
        report = _status(node.address)
        assert {p["address"] for p in report["peers"]} == everyone  # type: ignore[index,union-attr]
        assert report["num_peers"] == 3

    assert first.stop(signal.SIGINT) == 0

    async def store_via_second_get_via_third() -> None:
        with trio.fail_after(30):
            async with open_peer(listen=None, initial_peers=[second.address]) as writer:
                assert await writer.dht.store("after-the-first-left", {"ok": 1}, ttl=60)
            async with open_peer(listen=None, initial_peers=[third.address]) as reader:
                assert await reader.dht.get("after-the-first-left") == {"ok": 1}

    trio.run(store_via_second_get_via_third)
    report = _status(third.address)
    assert {p["address"] for p in report["peers"]} == {second.address, third.address}  # type: ignore[index,union-attr]


def test_bootstrap_keeps_its_address_across_restarts(
    bootstraps: list[Bootstrap], tmp_path: Path
) -> None:
    key = tmp_path / "boot.key"
    node = Bootstrap("--identity", str(key))
    bootstraps.append(node)
    first_id = node.address.split("@")[0]
    assert node.stop() == 0
    again = Bootstrap("--identity", str(key))
    bootstraps.append(again)
    assert again.address.split("@")[0] == first_id


def test_a_bootstrap_killed_and_restarted_on_another_port_finds_its_swarm_again(
    bootstraps: list[Bootstrap], tmp_path: Path
) -> None:
    """(a trial: without its saved contacts it served an empty network, and newcomers that
    joined through it averaged alone)"""
    key = tmp_path / "boot.key"
    first = Bootstrap("--identity", str(key))
    bootstraps.append(first)
    other = Bootstrap("--initial-peers", first.address)  # stands for a volunteer
    bootstraps.append(other)
    contacts = tmp_path / "boot.key.contacts"
    deadline = time.monotonic() + 20
    while other.address not in (contacts.read_text() if contacts.exists() else ""):
        assert time.monotonic() < deadline, "the contact was not saved within 20 s"
        time.sleep(0.1)
    first.proc.kill()  # no clean stop: what was saved is all there is
    first.stop()
    again = Bootstrap("--identity", str(key))  # port 0: another port
    bootstraps.append(again)
    assert again.address.split("@")[0] == first.address.split("@")[0]
    assert again.address != first.address
    deadline = time.monotonic() + 20  # (it dials its saved contacts once its address is out)
    while True:
        report = _status(again.address)
        seen = {p["address"] for p in report["peers"]}  # type: ignore[index,union-attr]
        if seen == {other.address, again.address} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert seen == {other.address, again.address}


def test_bootstrap_refuses_a_corrupt_identity_file(tmp_path: Path) -> None:
    key = tmp_path / "bad.key"
    key.write_bytes(b"not a key")
    out = subprocess.run(
        [*SWARM, "bootstrap", "--host", "127.0.0.1", "--identity", str(key)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env_with_root(),
    )
    assert out.returncode != 0
    assert "identity file" in out.stderr
    assert key.read_bytes() == b"not a key"  # nothing lost


def test_status_fails_when_no_peer_answers() -> None:
    out = _run_status("6KKPsmJY8vaenxMPzr674T1cSeZmq4u8pzQcXN7eTAGK@127.0.0.1:1")  # no one there
    assert out.returncode == 1
    assert json.loads(out.stdout) == {"num_peers": 0, "peers": []}  # still valid JSON
    assert "no peer answered" in out.stderr


def test_bootstrap_and_status_do_not_import_torch_or_numpy() -> None:
    code = (
        "import sys, peer.cli, peer.node, peer.crawl; "
        "bad = [m for m in ('torch', 'numpy', 'training') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env_with_root())


def test_bootstrap_logs_peers_that_join_at_info(bootstraps: list[Bootstrap]) -> None:
    first = Bootstrap()
    bootstraps.append(first)
    second = Bootstrap("--initial-peers", first.address)
    bootstraps.append(second)
    short_id = second.address[:6]  # logs show a prefix of the PeerID
    log = _read_until(first.proc.stderr, f"peer joined: {short_id}")
    assert " INFO peer.dht." in log
    assert " DEBUG " not in log  # DEBUG only with -v


def test_verbose_after_the_command_logs_debug() -> None:
    argv = [*SWARM, "status", "--initial-peers", "127.0.0.1:1", "--timeout", "10"]
    quiet = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env_with_root())
    loud = subprocess.run(
        [*argv, "-v"], capture_output=True, text=True, timeout=30, env=env_with_root()
    )
    assert quiet.returncode == loud.returncode == 1
    assert " DEBUG peer." not in quiet.stderr
    assert " DEBUG peer." in loud.stderr


def test_status_rejects_a_negative_timeout_in_one_line() -> None:
    out = subprocess.run(
        [*SWARM, "status", "--initial-peers", "127.0.0.1:1", "--timeout", "-1"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env_with_root(),
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "argument --timeout: expected a positive number of seconds" in out.stderr


def _closed_pipe() -> int:
    """The write end of a pipe nobody reads: every write to it fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def test_status_into_a_closed_pipe_fails_quietly(bootstraps: list[Bootstrap]) -> None:
    node = Bootstrap()
    bootstraps.append(node)
    stdout = _closed_pipe()  # like `swarm status --json | head -0`
    try:
        out = subprocess.run(
            [*SWARM, "status", "--initial-peers", node.address, "--json"],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=40,
            env=env_with_root(),
        )
    finally:
        os.close(stdout)
    assert out.returncode == 1
    assert out.stderr == ""  # no traceback, no "Exception ignored" at exit


def test_bootstrap_keeps_serving_when_stdout_is_closed(bootstraps: list[Bootstrap]) -> None:
    stdout = _closed_pipe()
    try:
        proc = subprocess.Popen(
            [*SWARM, "bootstrap", "--host", "127.0.0.1"],
            stdout=stdout,
            stderr=subprocess.PIPE,
            env=env_with_root(),
        )
    finally:
        os.close(stdout)
    try:
        log = _read_until(proc.stderr, " is up\n")
        assert "stdout is closed" in log
        address = log.split("bootstrap node ")[1].split(" is up")[0]
        assert _status(address)["num_peers"] == 1
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert b"Traceback" not in err and b"Exception ignored" not in err


def test_status_with_stdout_closed_fails_quietly(bootstraps: list[Bootstrap]) -> None:
    """`swarm status ... >&-`: Python starts with no sys.stdout at all."""
    node = Bootstrap()
    bootstraps.append(node)
    out = subprocess.run(
        [*SWARM, "status", "--initial-peers", node.address, "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=40,
        env=env_with_root(),
        preexec_fn=lambda: os.close(1),  # in the child only
    )
    assert out.returncode == 1
    assert out.stderr == ""


def _run_bootstrap(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`swarm bootstrap` that is expected to stop by itself (on an error)."""
    return subprocess.run(
        [*SWARM, "bootstrap", *args],
        **{"capture_output": True, "text": True, "timeout": 30, "env": env_with_root(), **kwargs},
    )


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_bootstrap_listens_on_ipv6_and_status_reaches_it(
    bootstraps: list[Bootstrap], host: str
) -> None:
    node = Bootstrap("--port", "0", host=host)
    bootstraps.append(node)
    peer_id, _, hostport = node.address.partition("@")
    assert hostport.startswith("[::1]:") and int(hostport.removeprefix("[::1]:")) > 0
    report = _status(node.address)
    assert report["peers"] == [{"peer_id": peer_id, "address": node.address}]


def test_bootstrap_names_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _run_bootstrap("--host", "127.0.0.1", "--port", str(port))
    in_use = os.strerror(errno.EADDRINUSE)
    assert out.returncode == 1
    assert out.stderr == f"swarm bootstrap: cannot listen on 127.0.0.1:{port}: {in_use}\n"


def test_bootstrap_names_a_host_that_does_not_resolve() -> None:
    # the resolver is stubbed: the same answer with or without DNS on this machine
    script = (
        "import socket, sys\n"
        "real = socket.getaddrinfo\n"
        "def getaddrinfo(host, *args, **kwargs):\n"
        "    if host in ('999.1.1.1', b'999.1.1.1'):\n"
        "        raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')\n"
        "    return real(host, *args, **kwargs)\n"
        "socket.getaddrinfo = getaddrinfo\n"
        "from peer import cli\n"
        "sys.exit(cli.main(['bootstrap', '--host', '999.1.1.1']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        env=env_with_root(),
    )
    assert out.returncode == 1
    assert out.stderr == (
        "swarm bootstrap: cannot listen on 999.1.1.1:0: Name or service not known\n"
    )


def test_bootstrap_names_the_identity_file_it_cannot_create(tmp_path: Path) -> None:
    key = tmp_path / "nonexistent" / "dir" / "x.key"
    out = _run_bootstrap("--host", "127.0.0.1", "--identity", str(key))
    assert out.returncode == 1
    # "No such file or directory" read as "the key file is missing" (an outside tester),
    # which the node creates: the folder is what is missing
    assert out.stderr == (
        f"swarm bootstrap: identity file {key}: its folder {key.parent} does not exist (the "
        "key file is created, its folder is not: mkdir -p it first)\n"
    )
    assert not key.parent.exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_status_into_a_full_disk_fails_in_one_line(bootstraps: list[Bootstrap]) -> None:
    node = Bootstrap()
    bootstraps.append(node)
    for json_flag in (["--json"], []):
        with open("/dev/full", "w") as full:
            out = subprocess.run(
                [*SWARM, "status", "--initial-peers", node.address, *json_flag],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=40,
                env=env_with_root(),
            )
        full_disk = os.strerror(errno.ENOSPC)
        assert out.returncode == 1
        assert out.stderr == f"swarm status: cannot write the report: {full_disk}\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_bootstrap_into_a_full_disk_fails_in_one_line() -> None:
    with open("/dev/full", "w") as full:
        out = _run_bootstrap(
            "--host", "127.0.0.1", stdout=full, capture_output=False, stderr=subprocess.PIPE
        )
    assert out.returncode == 1
    assert out.stderr.endswith(
        f"swarm bootstrap: cannot print the address: {os.strerror(errno.ENOSPC)}\n"
    )
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr


NOBODY = "6KKPsmJY8vaenxMPzr674T1cSeZmq4u8pzQcXN7eTAGK@127.0.0.1:1"  # no one listens there


def test_bootstrap_warns_naming_each_initial_peer_that_did_not_answer(
    bootstraps: list[Bootstrap],
) -> None:
    node = Bootstrap("--initial-peers", NOBODY)
    bootstraps.append(node)
    log = _read_until(node.proc.stderr, " is up\n")
    warning = next(line for line in log.splitlines() if " WARNING peer.dht.joining: " in line)
    assert warning.split(" WARNING peer.dht.joining: ")[1].startswith(
        f"no initial peer answered (tried {NOBODY}: "
    )


def test_bootstrap_does_not_count_itself_among_the_initial_peers(
    bootstraps: list[Bootstrap], tmp_path: Path
) -> None:
    """The same list on every bootstrap host names each host too: not a reason to warn."""
    key = tmp_path / "own.key"
    own = Identity.from_seed(bytes(range(32)))
    own.save(key)
    itself = f"{own.peer_id}@127.0.0.1:1"
    alone = Bootstrap("--identity", str(key), "--initial-peers", itself)
    bootstraps.append(alone)
    assert " WARNING " not in _read_until(alone.proc.stderr, " is up\n")

    with_another = Bootstrap("--identity", str(key), "--initial-peers", itself, NOBODY)
    bootstraps.append(with_another)
    log = _read_until(with_another.proc.stderr, " is up\n")
    warning = next(line for line in log.splitlines() if " WARNING peer.dht.joining: " in line)
    assert f"(tried {NOBODY}: " in warning and itself not in warning


@pytest.mark.slow
@pytest.mark.parametrize("with_peer_id", [True, False], ids=["PEERID@HOST:PORT", "HOST:PORT"])
def test_status_lists_both_processes_on_one_key_file_when_given_both(
    bootstraps: list[Bootstrap], tmp_path: Path, with_peer_id: bool
) -> None:
    """Two bootstrap nodes on one key file that know nothing of each other, both given to
    ``swarm status``: the walk starts from the routing table, which keeps one address per
    PeerID, so status listed one and warned of nothing (an outside tester, 5 of 5 runs)."""
    key = str(tmp_path / "shared.key")
    twins = [Bootstrap("--identity", key), Bootstrap("--identity", key)]
    bootstraps.extend(twins)
    given = [t.address if with_peer_id else t.address.split("@")[1] for t in twins]
    out = subprocess.run(
        [*SWARM, "status", "--initial-peers", *given, "--json", "--timeout", "20"],
        capture_output=True,
        text=True,
        timeout=40,
        env=env_with_root(),
    )
    assert out.returncode == 0, out.stderr
    listed = {peer["address"] for peer in json.loads(out.stdout)["peers"]}
    assert listed == {t.address for t in twins}
    peer_id, hostports = (
        twins[0].address.split("@")[0],
        sorted(t.address.split("@")[1] for t in twins),
    )
    assert f"swarm status: {peer_id} answered at {' and '.join(hostports)}: several" in out.stderr
