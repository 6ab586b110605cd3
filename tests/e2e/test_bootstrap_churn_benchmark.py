"""``benchmarks/bootstrap_churn.py`` has distinct peers visit a real ``swarm bootstrap`` and
reports the node's resident memory as they come and go."""

from __future__ import annotations

import pytest
from tests_support_paths import run_benchmark


@pytest.mark.slow
def test_the_bootstrap_churn_benchmark_reports_memory_per_batch_of_visitors() -> None:
    report = run_benchmark(
        "bootstrap_churn.py", "--peers", "8", "--at-once", "2", "--every", "4", "--settle", "0.5"
    )
    assert report["peers"] == 8 and report["wall_s"] > 0
    visitors = [sample["visitors"] for sample in report["rss"]]
    assert visitors == [0, 4, 8, 8]
    assert all(0 < sample["VmRSS"] <= sample["VmHWM"] for sample in report["rss"])
