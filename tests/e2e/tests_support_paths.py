"""Paths, and a bootstrap process, shared by the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def env_with_root() -> dict[str, str]:
    """The environment for a subprocess that must import the project from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


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
