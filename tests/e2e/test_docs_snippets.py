"""The Python snippets in README.md and docs/*.md run as a reader copies them.

Every snippet may use only what it imports or defines, beside the placeholders the
text names (`BOOTSTRAP`, `params`, `tensors`, `node`); the DHT page's two scripts run
for real against a peer on loopback.
"""

from __future__ import annotations

import ast
import builtins
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support_paths import ROOT, env_with_root

from peer import run_in_background

DOCS = [ROOT / "README.md", *(ROOT / "docs" / f"{n}.md" for n in ("dht", "averaging", "bootstrap"))]
"""The pages whose snippets a reader runs (protocol.md's listings are signatures)."""
PLACEHOLDERS = {"BOOTSTRAP", "params", "tensors", "node"}
"""Names a snippet's surrounding text tells the reader to supply."""


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def undefined_names(source: str) -> set[str]:
    """Names a snippet reads but never imports, assigns or defines (scopes merged: a
    snippet is short, and a name it binds anywhere counts as bound)."""
    tree = compile(source, "<snippet>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    bound: set[str] = set()
    read: set[str] = set()
    for item in ast.walk(tree):
        if isinstance(item, ast.Name):
            (read if isinstance(item.ctx, ast.Load) else bound).add(item.id)
        elif isinstance(item, ast.alias):
            bound.add((item.asname or item.name).split(".")[0])
        elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(item.name)
        elif isinstance(item, ast.arg):
            bound.add(item.arg)
    return read - bound - set(dir(builtins)) - PLACEHOLDERS


def test_the_checker_catches_a_missing_import() -> None:
    assert undefined_names("import peer\nAverager(peer, 'p', [])\n") == {"Averager"}
    assert undefined_names("from training import Averager\nAverager(1, 'p', [])\n") == set()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_snippet_uses_only_what_it_imports(path: Path) -> None:
    for block in python_blocks(path.read_text()):
        assert undefined_names(block) == set(), block


def test_the_dht_page_scripts_run_as_written() -> None:
    scripts = [
        b for b in python_blocks((ROOT / "docs" / "dht.md").read_text()) if "PEERID@HOST:PORT" in b
    ]
    assert len(scripts) == 2  # the async one and the background one
    with run_in_background() as bootstrap:
        for script in scripts:
            out = subprocess.run(
                [sys.executable, "-c", script.replace("PEERID@HOST:PORT", bootstrap.address)],
                capture_output=True,
                text=True,
                timeout=30,
                env=env_with_root(),
            )
            assert out.returncode == 0, out.stderr[-3000:]
        # both stored run1/config under the placeholder's bootstrap node
        assert bootstrap.dht.get("run1/config") == {"lr": 0.1}
