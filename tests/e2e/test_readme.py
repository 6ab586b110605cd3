"""The README's research-script example runs as written (with a real bootstrap node)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support_paths import ROOT, env_with_root

pytestmark = pytest.mark.slow


def _readme_script() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (script,) = [b for b in blocks if "Averager(" in b and "trio.run(main)" in b]
    return script


def test_readme_research_script_runs(tmp_path: Path) -> None:
    script = _readme_script()
    assert len(script.strip().splitlines()) <= 21  # a few lines beside a plain loop
    boot = subprocess.Popen(
        [sys.executable, "-m", "peer.cli", "bootstrap", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env_with_root(),
    )
    try:
        assert boot.stdout is not None
        address = boot.stdout.readline().strip()
        # Same script, pointed at our bootstrap node and shortened to two averaging rounds.
        script = script.replace("PEERID@HOST:PORT", address).replace("range(1000)", "range(20)")
        path = tmp_path / "research.py"
        path.write_text(script)
        out = subprocess.run(
            [sys.executable, str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env_with_root(),
        )
        assert out.returncode == 0, out.stderr[-3000:]
        lines = out.stdout.strip().splitlines()
        assert [line.split()[0] for line in lines] == ["9", "19"]
    finally:
        boot.terminate()
        boot.wait(timeout=15)
        assert boot.stdout is not None
        boot.stdout.close()
