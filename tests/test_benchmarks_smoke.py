"""Smoke tests of the benchmarks: ``--quick`` on the CPU must run end to end and report."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from .conftest import run_benchmark

pytest.importorskip("skimage", reason="benchmarks need scikit-image for their photos")
pytest.importorskip("matplotlib", reason="benchmarks need matplotlib for the chart")


def test_quick_cpu_run_writes_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_benchmark("benchmarks.run", ["--quick", "--device", "cpu", "--out", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert {p.name for p in out.iterdir()} >= {"report.md", "report.json", "report.png"}
    rows = json.loads((out / "report.json").read_text())["rows"]
    ok = {row["loader"]: row for row in rows if row["status"] == "ok"}
    assert ok["threadloader"]["images_per_s"] > 0, rows
    assert ok["pil_dataloader"]["images_per_s"] > 0, rows
    assert "| threadloader" in (out / "report.md").read_text()


def test_stage_profile_runs_and_reports_each_stage(tmp_path: Path) -> None:
    args = ["--set", "fixed", "--count", "32", "--augment", "--batches", "2"]
    result = run_benchmark("benchmarks.tools.stages", args, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "augment=True region=True threads=default",
        "augment=True region=False threads=default",
    ]
    assert all("img/s" in line and "'transform'" in line for line in lines)


def test_backends_measures_each_configuration_in_a_process_of_its_own(tmp_path: Path) -> None:
    out = tmp_path / "backends.json"
    configs = 'two={"device": "cpu", "num_threads": 2};one={"device": "cpu", "num_threads": 1}'
    args = ["--sets", "fixed", "--configs", configs, "--count", "32", "--warm", "1", "--batches", "3"]
    result = run_benchmark(
        "benchmarks.tools.backends", [*args, "--batch-size", "8", "--out", str(out)], tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [row["name"] for row in rows] == ["two", "one"], rows
    for row in rows:
        assert row["images_per_s"] > 0 and row["cpu_cores"] >= 0 and row["idle_cpu_s"] < 0.5, row
        assert set(row["stage_ms_per_batch"]) >= {"read", "decode", "transform", "wait"}, row


def test_training_benchmark_reports_each_row_against_the_fixed_input(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--quick", "--device", "cpu", "--pipelines", "resize", "--loaders", "fixed_input,threadloader"]
    result = run_benchmark("benchmarks.training", [*args, "--out", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert {p.name for p in out.iterdir()} >= {"training.md", "training.json", "training.png"}
    rows = json.loads((out / "training.json").read_text())["rows"]
    by = {(r["spec"]["kind"], r["spec"]["loader"]): r for r in rows}
    assert set(by) == {
        (k, loader) for k in ("eager", "graphed") for loader in ("fixed_input", "threadloader")
    }
    fixed, loaded = by["eager", "fixed_input"], by["eager", "threadloader"]
    for row in (fixed, loaded):
        assert row["status"] == "ok", row
        assert len(row["images_per_s"]) == 3 and min(row["images_per_s"]) > 0, row
    assert fixed["ratio"] == 1.0
    # Each row's ratio is its own median throughput over the fixed input's, recomputed here.
    expected = sorted(loaded["images_per_s"])[1] / sorted(fixed["images_per_s"])[1]
    assert loaded["ratio"] == pytest.approx(expected)
    assert by["graphed", "threadloader"]["status"] == "skipped"
    assert "| eager | resize | ThreadLoader |" in (out / "training.md").read_text()
    # Who used the cores, and the readers' own CPU per stage, per window.
    groups = loaded["thread_cores"][0]
    assert "MainThread" in groups and any(name.startswith("threadloader-") for name in groups), groups
    # A window whose batches were all made ahead (prefetch) has no decode of its own: 0 there.
    cpu = loaded["stage_cpu_ms_per_batch"]
    assert len(cpu) == 3 and max(window["decode"] for window in cpu) > 0, cpu


def test_gil_benchmark_measures_the_loop_beside_each_load(tmp_path: Path) -> None:
    args = [
        "--quick",
        "--device",
        "cpu",
        "--switch-intervals",
        "0.005",
        "--backgrounds",
        "threadloader,decode",
    ]
    result = run_benchmark(
        "benchmarks.gil", [*args, "--seconds", "1", "--out", str(tmp_path / "out")], tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads((tmp_path / "out" / "gil.json").read_text())["rows"]
    assert [(r["background"], r["ops"]) for r in rows] == [("threadloader", "cpu"), ("decode", "cpu")]
    for row in rows:
        assert row["op_us_alone"] > 0 and row["op_us_beside"] > 0, row
        assert row["images_per_s_alone"] > 0, row


def test_training_timeline_writes_a_trace(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_benchmark(
        "benchmarks.training",
        [
            *["--quick", "--device", "cpu", "--timeline", "--loaders", "threadloader", "--out", str(out)],
            *["--threadloader-variant", "prefetch=1"],
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    trace = json.loads((out / "timeline-eager-resize-threadloader.json").read_text())
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])
    assert (out / "timeline-eager-resize-threadloader.md").read_text().startswith("GPU timeline")
    variant = (out / "timeline-eager-resize-threadloader-variant1.md").read_text()
    assert variant.startswith("ThreadLoader arguments: {'prefetch': 1}")


def test_stages_beside_a_step_says_it_needs_a_gpu(tmp_path: Path) -> None:
    """The stage-beside-a-step instrument feeds a GPU training step, and says so without a GPU."""
    for args in (["--kind", "eager"], ["--sched", "blocking"]):
        result = run_benchmark("benchmarks.tools.beside_step", args, tmp_path)
        assert result.returncode == 1, args
        assert "needs a CUDA device" in result.stderr, args


def test_decoders_beside_a_step_says_it_needs_a_gpu(tmp_path: Path) -> None:
    """The Decoders-beside-a-step instrument measures nvImageCodec on a GPU, and says so without one."""
    result = run_benchmark("benchmarks.tools.decoders_beside", ["--no-beside"], tmp_path)
    assert result.returncode == 1
    assert "needs a CUDA device" in result.stderr


def test_training_variants_add_a_named_threadloader_row_after_each_default_one() -> None:
    """``--threadloader-variant`` rows carry their arguments to the loader, by name in the report, and
    stay out of the README's summary of default configurations."""
    from benchmarks import report, training

    rows = ["--kinds", "eager", "--pipelines", "resize,augment", "--loaders", "fixed_input,threadloader"]
    args = training.parse_args(
        ["--device", "cpu", *rows, "--threadloader-variant", "prefetch=4,backend=split"]
    )
    specs = training.plan(args)
    assert [(s.pipeline, s.loader, s.options) for s in specs] == [
        ("-", "fixed_input", {}),
        ("resize", "threadloader", {}),
        ("resize", "threadloader", {"prefetch": 4, "backend": "split"}),
        ("augment", "threadloader", {}),
        ("augment", "threadloader", {"prefetch": 4, "backend": "split"}),
    ]
    variant = {"spec": dataclasses.asdict(specs[2]), "status": "ok"}
    assert specs[2].name == "threadloader prefetch=4 backend='split'"
    assert report.training_key(variant)[2].endswith(", prefetch=4, backend='split'")
    assert not report.default_configuration(variant)
    assert report.default_configuration({"spec": dataclasses.asdict(specs[1]), "status": "ok"})


def test_quick_sources_run_reports_every_source(tmp_path: Path) -> None:
    pytest.importorskip("fsspec", reason="the URL rows need fsspec: pip install -e '.[remote]'")
    from benchmarks.sources import SOURCES

    out = tmp_path / "sources.json"
    result = run_benchmark("benchmarks.sources", ["--quick", "--device", "cpu", "--out", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    summary = {row["source"]: row for row in report["summary"]}
    assert list(summary) == list(SOURCES)
    for source, row in summary.items():
        assert row["runs"] == 1 and row["images_per_s"] > 0, (source, row)
        assert ("index_s" in row) == source.startswith("tar"), (source, row)
    assert all(row["images"] == 3 * 16 for row in report["rows"])  # 3 timed batches of 16
    assert "| tar_memory |" in result.stdout


def test_a_failed_fixed_input_row_gives_no_ratio() -> None:
    """A baseline that failed after a window is no ceiling: rows beside it read 1.57x of it."""
    from benchmarks.training import RowSpec, TrainingRow, ratio

    loader = TrainingRow(RowSpec("eager", "threadloader", "resize"), images_per_s=[2350.0])
    failed = TrainingRow(RowSpec("eager", "fixed_input"), status="failed", images_per_s=[1500.0])
    ok = TrainingRow(RowSpec("eager", "fixed_input"), images_per_s=[2500.0])
    assert ratio(loader, [failed, loader]) is None
    assert ratio(loader, [failed, ok, loader]) == 2350.0 / 2500.0


@pytest.mark.parametrize("tar", [False, True])
def test_file_reads_reports_what_each_way_of_reading_costs_the_main_thread(tmp_path: Path, tar: bool) -> None:
    args = ["--files", "128", "--rounds", "1", "--seconds", "0.2", "--rate", "2000"] + ["--tar"] * tar
    result = run_benchmark("benchmarks.tools.file_reads", args, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "round 1: alone" in result.stdout and "python: " in result.stdout and "c: " in result.stdout
    last = result.stdout.splitlines()[-1]
    assert "Python's reads" in last and ("per tar member" if tar else "per file") in last, result.stdout


def test_memory_census_says_it_needs_a_gpu(tmp_path: Path) -> None:
    result = run_benchmark("benchmarks.tools.memory_census", ["--batches", "2"], tmp_path)
    assert result.returncode == 1
    assert "needs a CUDA device" in result.stderr
