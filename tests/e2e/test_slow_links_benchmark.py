"""``benchmarks/slow_links.py`` runs real averaging steps on the memory network and counts
what happened: every step of every peer is counted once, by the size of its group."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests_support_paths import ROOT, env_with_root, run_benchmark


@pytest.mark.slow
def test_the_slow_links_benchmark_counts_every_step() -> None:
    report = run_benchmark(
        "slow_links.py", "--peers", "2", "--steps", "3", "--runs", "2", "--latency", "0.05"
    )
    assert len(report["runs"]) == 2 and report["steps_per_run"] == 6
    for run in report["runs"]:
        sizes = {int(k): v for k, v in run["group_sizes"].items()}
        assert sum(sizes.values()) == run["steps"] == 6
        assert run["full"] == sizes.get(2, 0) and set(sizes) <= {1, 2}
        assert run["step_s"] > 3.0  # virtual seconds: the 3 s pause is in every step
    assert report["full_mean"] == sum(r["full"] for r in report["runs"]) / 2


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [("--late", "1.5", "--late must be in [0, 1)"), ("--jitter", "nan", "--jitter must be")],
)
def test_the_slow_links_benchmark_refuses_bad_link_settings(
    flag: str, value: str, said: str
) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "slow_links.py"), flag, value],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_with_root(),
    )
    assert out.returncode == 2 and said in out.stderr, out.stderr
