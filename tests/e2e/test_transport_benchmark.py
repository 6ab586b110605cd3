"""``benchmarks/transport.py`` moves real bytes both ways it measures and reports them: the
floor (plain sockets and AES-GCM) and the secure stream, each side's CPU, and their ratio."""

from __future__ import annotations

import pytest
from tests_support_paths import run_benchmark


@pytest.mark.slow
def test_the_transport_benchmark_reports_both_modes() -> None:
    report = run_benchmark("transport.py", "--mib", "2", "--repeat", "1")
    for mode in ("floor", "secure"):
        figures = report[mode]
        assert figures["sender_cpu_s"] > 0 and figures["receiver_cpu_s"] > 0
        assert figures["wall_s"] > 0 and figures["gbps"] > 0
    assert report["secure_over_floor_sender"] > 0 and report["secure_over_floor_receiver"] > 0
