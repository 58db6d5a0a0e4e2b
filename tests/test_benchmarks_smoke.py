"""Smoke test of the benchmark harness: ``--quick`` on the CPU must run end to end and report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("skimage", reason="benchmarks need scikit-image for their photos")
pytest.importorskip("matplotlib", reason="benchmarks need matplotlib for the chart")


def test_quick_cpu_run_writes_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # A subprocess, as CI runs it: DataLoader workers and threads stay out of the test process.
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--device", "cpu", "--out", str(out)],
        cwd=REPO,
        env=os.environ | {"THREADLOADER_BENCH_CACHE": str(tmp_path / "data")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert {p.name for p in out.iterdir()} >= {"report.md", "report.json", "report.png"}
    rows = json.loads((out / "report.json").read_text())["rows"]
    ok = {row["loader"]: row for row in rows if row["status"] == "ok"}
    assert ok["threadloader"]["images_per_s"] > 0, rows
    assert ok["pil_dataloader"]["images_per_s"] > 0, rows
    assert "| threadloader" in (out / "report.md").read_text()


def test_stage_profile_runs_and_reports_each_stage(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.stages",
            "--set",
            "fixed",
            "--count",
            "32",
            "--augment",
            "--batches",
            "2",
        ],
        cwd=REPO,
        env=os.environ | {"THREADLOADER_BENCH_CACHE": str(tmp_path / "data"), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "augment=True region=True threads=default",
        "augment=True region=False threads=default",
    ]
    assert all("img/s" in line and "'transform'" in line for line in lines)
