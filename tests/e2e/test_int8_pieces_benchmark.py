"""``benchmarks/int8_pieces.py`` encodes and decodes a model's vector both ways it compares
(a blob per chunk, a blob per tensor of a chunk) and reports both."""

from __future__ import annotations

import pytest
from tests_support_paths import run_benchmark


@pytest.mark.slow
def test_the_int8_pieces_benchmark_reports_both_forms() -> None:
    small = ["--width", "64", "--layers", "2", "--vocab", "100", "--context", "16", "--reps", "1"]
    report = run_benchmark("int8_pieces.py", *small)
    assert report["tensors"] == 2 + 2 * 12 + 2
    for form in ("one_blob_per_chunk", "one_blob_per_tensor"):
        assert report[form]["encode_s"] > 0 and report[form]["decode_s"] > 0
    # 27 boundaries inside the one chunk, each a 24-byte header and a scale more at most
    extra = report["one_blob_per_tensor"]["wire_bytes"] - report["one_blob_per_chunk"]["wire_bytes"]
    assert 0 < extra <= 27 * 28
