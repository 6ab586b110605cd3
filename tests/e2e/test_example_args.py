"""The examples refuse counts below 1 with a usage line (exit code 2), before starting
anything: `demo_swarm.py --rounds -1` crashed its volunteers with tracebacks, and
`--local-steps 0` "trained" to chance accuracy and reported success (trials)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from tests_support_paths import ROOT, env_with_root

CASES = [
    ("demo_swarm.py", "--peers", "0"),
    ("demo_swarm.py", "--rounds", "-1"),
    ("demo_swarm.py", "--local-steps", "0"),
]


@pytest.mark.parametrize(("script", "flag", "value"), CASES)
def test_a_count_below_one_is_a_usage_error(script: str, flag: str, value: str) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), flag, value],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_with_root(),
    )
    assert out.returncode == 2, out.stderr
    assert f"error: {flag} must be at least 1, got {value}" in out.stderr
    assert "Traceback" not in out.stderr


def test_more_volunteers_than_the_demo_starts_is_a_usage_error() -> None:
    """`--peers 1000000` started processes (each importing torch) until the machine gave in
    (an outside tester: a load of 83 on 2 cores)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo_swarm.py"), "--peers", "65"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_with_root(),
    )
    assert out.returncode == 2, out.stderr
    assert "error: --peers must be at most 64, got 65" in out.stderr


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux's /proc)."""
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        return [int(child) for child in listing.read().split()]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie nobody reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_the_demo_alone_stops_its_bootstrap_node_and_volunteers() -> None:
    """`kill PID` of the demo (a process manager, `timeout --foreground`) left its `swarm
    bootstrap` running for good and printed its volunteers' BrokenPipeError tracebacks
    (an outside tester)."""
    demo = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "demo_swarm.py"), "--peers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_with_root(),
    )
    try:
        assert demo.stdout is not None
        assert demo.stdout.readline().startswith("bootstrap node: ")
        assert demo.stdout.readline().startswith("volunteer 0 round   0")
        children = _children(demo.pid)
        assert len(children) == 2  # the bootstrap node and the volunteer
        demo.send_signal(signal.SIGTERM)
        _, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate(timeout=30)
    assert demo.returncode == 128 + signal.SIGTERM, err
    assert "demo terminated" in err and "Traceback" not in err, err
    assert not [pid for pid in children if _running(pid)]


@pytest.mark.parametrize(
    ("address", "words"),
    [
        ("notanaddress", "address 'notanaddress' has no port"),
        ("127.0.0.1:1", "no initial peer answered"),  # nothing listens on port 1
    ],
)
def test_a_wrong_initial_peer_is_one_line_not_a_traceback(address: str, words: str) -> None:
    """An examples walk: 27-33 lines of traceback around the one line that said it."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "average_tensors.py"), "--initial-peers", address],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_with_root(),
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("average_tensors: ") and words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("demo_swarm.py", "--rounds", "1", "--peers", "2"),
        ("train_mlp.py", "--steps", "2", "--peers", "2"),
    ],
    ids=["demo_swarm", "train_mlp"],
)
def test_the_examples_close_what_they_open(args: tuple[str, ...]) -> None:
    """A trial under `python -X dev`: both left each child's stdout pipe open
    ("ResourceWarning: unclosed file", under `-W error` "Exception ignored in")."""
    script, *rest = args
    strict = [sys.executable, "-X", "dev", "-W", "error::ResourceWarning"]
    out = subprocess.run(
        [*strict, str(ROOT / "examples" / script), *rest],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_with_root(),
    )
    assert out.returncode == 0, out.stderr
    assert "ResourceWarning" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr


@pytest.mark.slow
def test_another_codec_beside_the_first_process_is_one_line_not_a_traceback() -> None:
    """Two hand-started processes of another --codec (or of another swarm version): each
    said so in a LayoutMismatchError traceback of ~20 lines (a mixed-version trial). Two
    processes of one codec run first: having met their own layout they stay (``alone``
    while not outnumbered) and outlast the newcomer. A lone first process raised at the
    mismatch too, and when it left first (a loaded machine), the newcomer, its only
    contact gone, said so as well (a WARNING line)."""
    example = str(ROOT / "examples" / "average_tensors.py")
    first = _started(example, "--rounds", "1000", "--codec", "none")
    others = [first]
    try:
        assert first.stdout is not None
        address = first.stdout.readline().split()[1]  # "address: PEERID@HOST:PORT ..."
        others.append(
            _started(example, "--rounds", "1000", "--codec", "none", "--initial-peers", address)
        )
        assert others[1].stdout is not None
        others[1].stdout.readline()  # its address: it is up
        out = subprocess.run(
            [sys.executable, example, "--initial-peers", address, "--codec", "int8"],
            capture_output=True,
            text=True,
            timeout=90,
            env=env_with_root(),
        )
    finally:
        for process in others:
            process.kill()
            process.communicate(timeout=30)
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("average_tensors: every other peer under 'example/average'")
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr


def _started(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_with_root(),
    )
