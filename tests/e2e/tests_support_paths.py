"""Paths, a bootstrap process and a benchmark runner, shared by the end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def env_with_root() -> dict[str, str]:
    """The environment for a subprocess that must import the project from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_benchmark(script: str, *args: str, timeout: float = 120) -> Any:
    """Run ``benchmarks/<script>`` with ``args`` from this checkout; the JSON it prints."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_with_root(),
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@contextlib.contextmanager
def bootstrap_process(wait: float) -> Iterator[str]:
    """A real `swarm bootstrap` on 127.0.0.1: the address it prints (within ``wait``
    seconds, else the test fails); the process is killed afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "peer.cli", "bootstrap", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env_with_root(),
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], wait)
        if not ready:
            pytest.fail(f"swarm bootstrap printed no address within {wait:g} s")
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
