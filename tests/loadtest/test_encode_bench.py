"""loadtest/encode_bench.py at a toy size: both parts run, the overlap's bytes equal the
baseline's, and the settings part finds the default at equal quality to itself."""

from __future__ import annotations

import pytest

from tests.loadtest.test_bench_smoke import _run

pytestmark = pytest.mark.e2e  # a benchmark script end to end, in its own processes


def test_encode_bench_smoke(tmp_path) -> None:  # noqa: ANN001
    report = _run("encode_bench.py", ["--clips", "demo", "--demo-clips", "1", "--presets", "ultrafast,medium",
                                      "--crfs", "18", "--requests", "2", "--reps", "1", "--size", "64x64x5",
                                      "--steps", "1"], tmp_path, timeout=900)
    s = report["settings"]
    assert s["equal_quality"]["medium"]["crf"] == 18  # the default equals itself
    assert s["more_threads"]["demo"]["same_bytes"] is False  # the thread count is part of the bytes
    o = report["overlap"]
    assert o["bytes_equal"] and not any(r["errors"] for rs in o["runs"].values() for r in rs)
    assert report["command"] and report["machine"]["cpus"] >= 1
