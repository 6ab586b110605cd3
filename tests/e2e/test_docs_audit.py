"""What README.md and docs/*.md promise, checked the way a reader who trusts them would.

The pages name defaults, limits and commands; a reader copies them. These tests read the
figures from the pages themselves, so a default changed in the code (or a page edited
wrongly) fails here instead of misleading users.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support_paths import ROOT

import protocol.framing
import protocol.messages
import protocol.records
import protocol.rpc

# from the modules, not `from peer import ...`: see the last test
from peer.background import run_in_background
from peer.dht import DHTConfig
from peer.host import HostConfig
from peer.netclock import ClockConfig
from peer.node import open_peer

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
UNITS = {None: 1, "s": 1, "ms": 1e-3, "min": 60, "MiB": 1 << 20}

# "`request_timeout` (3 s)", "`HostConfig.drain_timeout`, 3 s", "`refresh_interval`, ~10 min",
# "`HostConfig.idle_timeout` is 60 s"
NAMED_DEFAULT = re.compile(
    r"`(?:(?P<cls>\w+Config)\.)?(?P<name>[a-z_]+)`(?:,| is)? \(?~?"
    r"(?P<number>\d+(?:\.\d+)?) ?(?P<unit>s|ms|min|MiB)?\b"
)


def page_text(path: Path) -> str:
    """The page with its line breaks folded, as a reader sees a paragraph."""
    return " ".join(path.read_text().split())


def config_default(cls_name: str | None, name: str) -> float | None:
    """The default of config field ``name`` (in ``cls_name``, or the one config that has it)."""
    from training import AveragerConfig  # here: importing training loads torch

    configs = {
        "DHTConfig": DHTConfig,
        "HostConfig": HostConfig,
        "ClockConfig": ClockConfig,
        "AveragerConfig": AveragerConfig,
    }
    owners = [configs[cls_name]] if cls_name else list(configs.values())
    defaults = {
        f.default
        for cls in owners
        for f in dataclasses.fields(cls)
        if f.name == name and isinstance(f.default, int | float)
    }
    assert len(defaults) <= 1, f"{name} has several defaults: say which config"
    return defaults.pop() if defaults else None


def test_every_config_default_the_pages_name_is_the_codes() -> None:
    checked = []
    for path in PAGES:
        for match in NAMED_DEFAULT.finditer(page_text(path)):
            default = config_default(match["cls"], match["name"])
            if default is None:
                continue  # not a config field (a codec name, a report field)
            stated = float(match["number"]) * UNITS[match["unit"]]
            assert stated == default, f"{path.name}: {match[0]!r}, but the default is {default}"
            checked.append(match["name"])
    # the pages name these; a page that stops naming them needs no check, a regex that
    # stops finding them does
    assert {"request_timeout", "hedge_after", "idle_timeout", "silence_timeout"} <= set(checked)


def test_the_limits_table_of_the_protocol_page_is_the_codes() -> None:
    table = (ROOT / "docs" / "protocol.md").read_text().split("## 10. Limits at a glance")[1]
    modules = (protocol.rpc, protocol.framing, protocol.messages, protocol.records)
    checked = 0
    for row in re.findall(r"^\| (`.+?) \| (.+?) \|", table, flags=re.M):
        names = re.findall(r"`(\w+)`", row[0])
        values = [v.strip() for v in row[1].split(",")]
        assert len(names) == len(values), row
        for name, value in zip(names, values, strict=True):
            number, _, unit = value.partition(" ")
            stated = float(number) * UNITS[unit or None]
            actual = next(getattr(m, name) for m in modules if hasattr(m, name))
            assert stated == actual, f"protocol.md says {name} = {value}, the code {actual}"
            checked += 1
    assert checked >= 15


def test_the_default_listen_address_is_the_one_the_pages_name() -> None:
    """README and dht.md tell a reader that a default peer is reachable from its own machine
    only; the snippets rely on it (they name no listen address)."""
    for start in (open_peer, run_in_background):
        assert inspect.signature(start).parameters["listen"].default == "127.0.0.1:0"
    assert "listen on `127.0.0.1:0` by default" in page_text(ROOT / "docs" / "dht.md")
    assert "listens on `127.0.0.1:0` by default" in page_text(ROOT / "README.md")


@pytest.mark.slow  # a pytest run in a subprocess (~5 s: it imports torch)
def test_the_pytest_commands_in_the_pages_collect_the_training_tests() -> None:
    """averaging.md and dht.md give `.venv/bin/pytest tests/training...` beside their figures.
    The console script does not put the checkout on sys.path, tests/conftest.py puts tests/
    there, and `import peer` then finds the directory tests/peer (a namespace package, found
    before the editable install's finder): peer/__init__.py never runs, and every module that
    does `from peer import X` fails to collect."""
    pytest_script = Path(sys.executable).with_name("pytest")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as in a reader's shell
    out = subprocess.run(
        [str(pytest_script), "--collect-only", "-q", "tests/training/test_matchmaking.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout[-2000:]
