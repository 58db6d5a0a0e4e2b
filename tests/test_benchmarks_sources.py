"""Smoke test of the sources benchmark: ``--quick`` on the CPU runs every source and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import run_benchmark

pytest.importorskip("skimage", reason="benchmarks need scikit-image for their photos")
pytest.importorskip("fsspec", reason="the URL rows need fsspec: pip install -e '.[remote]'")


def test_quick_sources_run_reports_every_source(tmp_path: Path) -> None:
    out = tmp_path / "sources.json"
    result = run_benchmark("benchmarks.sources", ["--quick", "--device", "cpu", "--out", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    summary = {row["source"]: row for row in report["summary"]}
    from benchmarks.sources import SOURCES

    assert list(summary) == list(SOURCES)
    for source, row in summary.items():
        assert row["runs"] == 1 and row["images_per_s"] > 0, (source, row)
        assert ("index_s" in row) == source.startswith("tar"), (source, row)
    assert all(row["images"] == 3 * 16 for row in report["rows"])  # 3 timed batches of 16
    assert "| tar_memory |" in result.stdout
