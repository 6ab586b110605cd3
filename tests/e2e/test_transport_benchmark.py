"""``benchmarks/transport.py`` moves real bytes both ways it measures and reports them: the
floor (plain sockets and AES-GCM) and the secure stream, each side's CPU, and their ratio."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests_support_paths import ROOT, env_with_root


@pytest.mark.slow
def test_the_transport_benchmark_reports_both_modes() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "transport.py"), "--mib", "2", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_with_root(),
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for mode in ("floor", "secure"):
        figures = report[mode]
        assert figures["sender_cpu_s"] > 0 and figures["receiver_cpu_s"] > 0
        assert figures["wall_s"] > 0 and figures["gbps"] > 0
    assert report["secure_over_floor_sender"] > 0 and report["secure_over_floor_receiver"] > 0
