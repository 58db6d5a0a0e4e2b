"""``benchmarks.run``'s method: every repeat in a fresh process, medians and ranges, failures as rows,
and ``--threadloader-options`` reaching ThreadLoader."""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from argparse import ArgumentTypeError
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from benchmarks import common, run
from benchmarks.run import Result, Row

from .conftest import run_benchmark

QUICK_CPU = ["--quick", "--device", "cpu", "--only", "threadloader"]


def _needs_data_set() -> None:
    pytest.importorskip("skimage", reason="benchmarks need scikit-image for their photos")


def test_each_repeat_of_a_row_runs_in_a_fresh_child_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _needs_data_set()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    # This test's process is the parent: a row measured here would carry this pid.
    results = run.main([*QUICK_CPU, "--repeats", "2", "--data-root", str(tmp_path / "data")])
    assert isinstance(results, list)
    (result,) = results
    assert [r.status for r in result.repeats] == ["ok", "ok"], result.repeats
    pids = [r.pid for r in result.repeats]
    assert None not in pids and len(set(pids)) == 2 and os.getpid() not in pids, pids
    first, second = (r.images_per_s or 0.0 for r in result.repeats)
    assert result.median("images_per_s") == pytest.approx((first + second) / 2)
    # Each repeat's loader stages over its timed batches. The readers may have made every one of them
    # before the window (they run ahead by their prefetch window), and then waited in it for room.
    for repeat in result.repeats:
        stages = repeat.stage_ms_per_batch
        assert {"read", "decode", "ahead", "wait"} <= stages.keys() and min(stages.values()) >= 0, stages
        assert stages["read"] + stages["decode"] + stages["ahead"] > 0, stages
        assert stages["wait"] <= (repeat.ms_per_batch or 0) + 1.0, repeat


def test_a_rows_stages_are_each_stages_median_over_the_repeats_that_ran() -> None:
    result = Result("x b=8", "threadloader", 8)
    result.repeats = [
        _row(stage_ms_per_batch={"read": 1.0, "decode": 9.0}),
        _row("failed", "killed", stage_ms_per_batch={"read": 100.0, "decode": 100.0}),
        _row(stage_ms_per_batch={"read": 3.0, "decode": 5.0, "parse": 2.0}),
        _row(stage_ms_per_batch={"read": 2.0, "decode": 7.0}),
    ]
    assert result.stages() == {"read": 2.0, "decode": 7.0, "parse": 2.0}
    (row,) = run.results_json([result], command="", hardware={}, config={})["rows"]
    assert row["stage_ms_per_batch"] == {"read": 2.0, "decode": 7.0, "parse": 2.0}
    assert "stage_ms_per_batch" not in row["min"]  # not a number to summarize as one
    assert Result("y", "dali", 8, [_row()]).stages() == {}


def _row(status: str = "ok", reason: str = "", **values: Any) -> Row:
    return Row(name="x b=8", loader="threadloader", batch_size=8, status=status, reason=reason, **values)


def test_median_and_range_over_the_repeats_that_ran() -> None:
    result = Result("x b=8", "threadloader", 8)
    result.repeats = [
        _row(images_per_s=300.0, startup_s=0.5, extra_gpu_mb=None),
        _row("failed", "RowProcessError: killed by SIGSEGV", images_per_s=None),
        _row(images_per_s=100.0, startup_s=0.1, extra_gpu_mb=None),
        _row(images_per_s=200.0, startup_s=0.2, extra_gpu_mb=None),
    ]
    base = Result("p", "pil_dataloader", 8, [_row(images_per_s=v) for v in (10.0, 40.0, 50.0, 1000.0)])
    data = run.results_json([result, base], command="", hardware={}, config={"mode": "throughput"})

    speed = result.spread("images_per_s")
    assert (speed.median, speed.low, speed.high) == (200.0, 100.0, 300.0)  # type: ignore[union-attr]
    assert result.median("startup_s") == 0.2
    assert result.spread("extra_gpu_mb") is None  # measured by no repeat (a CPU run)
    assert base.median("images_per_s") == 45.0  # an even count: the mean of the middle two
    assert (
        result.status == "ok" and result.reason == "1 of 4 repeats failed: RowProcessError: killed by SIGSEGV"
    )

    table = run.write(data, None)
    assert "| x b=8 | 200 (100-300) |" in table and "| 0.20 (0.10-0.50) |" in table
    (row, _) = json.loads(json.dumps(data))["rows"]
    assert (row["images_per_s"], row["min"]["images_per_s"], row["max"]["images_per_s"]) == (200, 100, 300)
    assert row["ratio_vs_pil"] == pytest.approx(200.0 / 45.0)
    assert [r["images_per_s"] for r in row["repeats"]] == [300, None, 100, 200]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("import os; os.abort()", "killed by SIGABRT"),
        ("raise SystemExit('decoder exploded')", "exited with 1: decoder exploded"),
        ("import time; time.sleep(120)", "stopped after 1 s"),
        ("print('no json here')", "printed no row"),
    ],
)
def test_a_child_that_crashes_hangs_or_prints_no_row_fails_with_the_reason(code: str, reason: str) -> None:
    with pytest.raises(common.RowProcessError, match=reason):
        common.run_child(_python(code), timeout=1)


def test_a_child_that_prints_its_row_gives_that_row() -> None:
    printed = _row(images_per_s=123.0, pid=42)
    code = f"print('progress'); print({json.dumps(json.dumps(asdict(printed)))})"
    assert Row(**common.run_child(_python(code), timeout=30)) == printed


def test_threadloader_options_are_parsed_as_literals_or_strings() -> None:
    parsed = common.threadloader_options("gpu_decoders=2, backend=split,pair=(1, 2),x=None,y=0.5")
    assert parsed == {"gpu_decoders": 2, "backend": "split", "pair": (1, 2), "x": None, "y": 0.5}
    with pytest.raises(ArgumentTypeError, match="num_threads is set by the rows"):
        common.threadloader_options("num_threads=4")


def test_threadloader_options_reach_every_threadloader_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threadloader

    got: list[dict[str, Any]] = []

    class Recorded(Exception):
        pass

    def fake(*args: object, **kwargs: Any) -> None:
        got.append(kwargs)
        raise Recorded

    monkeypatch.setattr(threadloader, "ThreadLoader", fake)
    options = ["--threadloader-options", "decode_threads=2,backend=split"]
    args = run.parse_args(["--device", "cpu", "--augment", "--threads", "1", "--batch-sizes", "4", *options])
    (tmp_path / "c" / "a.jpg").parent.mkdir(parents=True)
    (tmp_path / "c" / "a.jpg").write_bytes(b"")
    ours = [c for c in run.cases(args, tmp_path) if c.loader == "threadloader"]
    assert len(ours) == 3  # the default row, whole decode + crop, and the sweep's one
    for case in ours:
        assert case.name.endswith(" decode_threads=2 backend='split'"), case.name
        with pytest.raises(Recorded):
            next(case.make())
    assert [(k["decode_threads"], k["backend"]) for k in got] == [(2, "split")] * 3


def test_threadloader_options_reach_the_row_processes(tmp_path: Path) -> None:
    _needs_data_set()
    out = tmp_path / "out"
    args = [*QUICK_CPU, "--threadloader-options", "max_pixels=1", "--out", str(out)]
    result = run_benchmark("benchmarks.run", args, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    (row,) = json.loads((out / "report.json").read_text())["rows"]
    assert row["name"].endswith(" max_pixels=1"), row
    assert row["status"] == "failed" and "over the limit of 1" in row["reason"], row


def test_a_run_without_matplotlib_keeps_its_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python with no matplotlib build (free-threaded 3.13t) writes the tables and JSON, no chart."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes ``import matplotlib`` raise ImportError
    result = Result("x b=8", "threadloader", 8, [_row(images_per_s=100.0)])
    run.write(run.results_json([result], hardware={}, config={"mode": "throughput"}), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]
    assert json.loads((tmp_path / "report.json").read_text())["rows"][0]["name"] == "x b=8"


class _Starting:
    """A loader whose ``stats().started_on_cpu`` follows a script: its value after each batch taken."""

    num_threads, prefetch, decode_batch_size = 1, 1, 4

    def __init__(self, started: list[int]) -> None:
        self.started, self.taken = started, 0

    def batches(self) -> Any:
        for index in range(20):
            self.taken += 1
            yield index

    def stats(self) -> Any:
        return type("Stats", (), {"started_on_cpu": self.started[min(self.taken, len(self.started)) - 1]})


@pytest.mark.parametrize(
    ("started", "kept"),
    [
        ([0], [0, 1, 2, 3]),  # nvImageCodec had started: nothing dropped
        ([4, 8, 8, 8], [0, 4, 5, 6]),  # Pillow's batches, then one batch in flight past them, dropped
        ([4, 4, 4], [0, 3, 4, 5]),
    ],
)
def test_threadloader_rows_time_batches_past_the_cpu_start(started: list[int], kept: list[int]) -> None:
    """A row's warm-up must not end inside the start: the first batch is kept (start-up is timed on
    it), then batches are dropped until Pillow's count has stayed put for a loader's batches in flight."""
    from benchmarks import loaders

    loader = _Starting(started)
    batches = loaders.past_the_cpu_start(loader, loader.batches(), batch_size=4)
    assert [next(batches) for _ in range(4)] == kept


def test_threadloader_rows_cross_no_epoch_boundary_and_read_in_the_other_rows_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other rows are endless (a wrapping batch sampler, DALI's wrapping reader); each new epoch of
    ThreadLoader drained and refilled its readers, several times in every timed window of the small
    sets: a cost only ThreadLoader's rows paid."""
    import numpy as np
    from PIL import Image

    from benchmarks import loaders
    from threadloader import ThreadLoader

    for target, cls in enumerate(["a", "b"]):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.fromarray(np.full((6, 6, 3), 40 * i + target, np.uint8)).save(tmp_path / cls / f"{i}.png")
    passes = []
    original = ThreadLoader.__iter__
    monkeypatch.setattr(ThreadLoader, "__iter__", lambda self: passes.append(1) or original(self))
    work = loaders.Work(size=(6, 6), batch_size=4, device="cpu")
    batches = loaders.threadloader(tmp_path, work, num_threads=2)
    targets = [next(batches)[1].tolist() for _ in range(6)]  # 24 images: four times over the 6
    batches.close()
    labels = [0, 0, 0, 1, 1, 1]  # the folder's order
    assert targets == [
        [labels[i] for i in batch] for batch in itertools.islice(loaders.endless_batches(6, 4), 6)
    ]
    assert passes == [1]


def test_a_training_rows_startup_is_its_first_batch_without_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """startup_s took in the first training step (a quarter of a second here), which benchmarks.run's
    start-up, in the same memory table, does not; and the warm-up is the first step and --warmup more."""
    import argparse
    import time

    from benchmarks import training

    steps: list[float] = []

    def make_step(**_: Any) -> Any:
        def step(batch: Any) -> None:
            steps.append(time.perf_counter())
            time.sleep(0.25)

        return step

    monkeypatch.setattr(training, "make_step", make_step)
    args = argparse.Namespace(
        device="cpu", batch_size=2, startup_pause=0.0, warmup=2, windows=1, steps=1, profile=None, workers=1
    )
    row = training.measure(training.RowSpec(kind="eager", loader="fixed_input"), args)
    assert row.status == "ok", row.reason
    assert row.startup_s is not None and row.startup_s < 0.1
    assert len(steps) == 1 + 1 + 2 + 1  # the baseline, the first batch's, the warm-up, the window
    assert row.device_wait_frac == []  # the GPU's wait: CUDA rows only


def test_a_training_rows_warm_up_is_kept_as_its_ramp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up's img/s per --steps steps (the last part shorter): beside a busy GPU the first
    thousands of images decode slower, and a row reports only windows after it."""
    import time

    from benchmarks import training

    sleeps = iter([0.0, 0.0] + [0.02] * 2 + [0.04] * 2 + [0.08] + [0.0] * 10)

    def make_step(**_: Any) -> Any:
        def step(batch: Any) -> None:
            time.sleep(next(sleeps))

        return step

    monkeypatch.setattr(training, "make_step", make_step)
    args = _training_args(warmup=5, steps=2, windows=1)
    row = training.measure(training.RowSpec(kind="eager", loader="fixed_input"), args)
    assert row.status == "ok", row.reason
    expected = [2 * 2 / (2 * 0.02), 2 * 2 / (2 * 0.04), 2 / 0.08]  # batch 2: images over the part's sleeps
    assert len(row.warmup_images_per_s) == 3
    for rate, ideal in zip(row.warmup_images_per_s, expected, strict=True):
        assert ideal * 0.5 < rate <= ideal * 1.01
    assert row.warmup_images_per_s[0] > row.warmup_images_per_s[1] > row.warmup_images_per_s[2]


LINUX_STATUS = Path("/proc/thread-self/status").is_file()


def _training_args(**sizes: Any) -> Any:
    import argparse

    values = dict(device="cpu", batch_size=2, startup_pause=0.0, warmup=1, windows=2, steps=4, profile=None)
    return argparse.Namespace(**(values | {"workers": 1} | sizes))


def test_a_training_windows_main_thread_cpu_and_switches_are_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step that sleeps 10 ms (one voluntary switch), then spins for 10 ms of its CPU time."""
    import time

    from benchmarks import training

    def make_step(**_: Any) -> Any:
        def step(batch: Any) -> None:
            time.sleep(0.01)
            end = time.thread_time() + 0.01  # CPU time: preempted or not
            while time.thread_time() < end:
                pass

        return step

    monkeypatch.setattr(training, "make_step", make_step)
    row = training.measure(training.RowSpec(kind="eager", loader="fixed_input"), _training_args())
    assert row.status == "ok", row.reason
    assert len(row.main_cpu_ms_per_step) == len(row.process_cores) == 2
    for cpu, wall, cores in zip(row.main_cpu_ms_per_step, row.ms_per_step, row.process_cores, strict=True):
        assert 10 <= cpu <= wall - 9, (cpu, wall)  # the spin counts, the sleep does not
        assert cores >= 0.95 * cpu / wall, (cores, cpu, wall)  # the process's CPU includes the thread's
    if LINUX_STATUS:
        assert len(row.main_voluntary_per_step) == len(row.main_involuntary_per_step) == 2
        assert all(1 <= v <= 3 for v in row.main_voluntary_per_step), row.main_voluntary_per_step
        assert all(v >= 0 and (v * 4).is_integer() for v in row.main_involuntary_per_step)


def test_a_training_rows_diagnostics_beside_the_threadloader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A row's own process (``--row``), in-process: its JSON carries one value of each per window."""
    _needs_data_set()
    from benchmarks import training

    spec = training.RowSpec("eager", "threadloader", "resize")
    argv = ["--quick", "--device", "cpu", "--data-root", str(tmp_path / "data")]
    training.main([*argv, "--row", json.dumps(asdict(spec))])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["status"] == "ok", row
    windows, steps = len(row["ms_per_step"]), 2  # --quick's
    assert windows == 3
    for cpu, wall, cores in zip(
        row["main_cpu_ms_per_step"], row["ms_per_step"], row["process_cores"], strict=True
    ):
        assert 0 < cpu <= 1.02 * wall, (cpu, wall)  # a thread uses no more CPU than wall time
        assert cores >= 0.95 * cpu / wall, (cores, cpu, wall)  # the readers' CPU on top of the step's
    switches = row["main_voluntary_per_step"], row["main_involuntary_per_step"]
    for values in switches:
        assert len(values) == (windows if LINUX_STATUS else 0), values
        assert all(v >= 0 and (v * steps).is_integer() for v in values), values
    # The loader's host time per batch handed out, per window. A window may hand out only batches made
    # before it (readers run ahead by up to their prefetch window), so its reads and decodes can be 0;
    # then the readers waited in it for room, which its batches freed.
    stages = row["stage_ms_per_batch"]
    assert len(stages) == windows
    for window, wall, wait in zip(stages, row["ms_per_step"], row["data_wait_frac"], strict=True):
        assert {"read", "decode", "transform", "wait"} <= window.keys(), window
        assert all(ms >= 0 for ms in window.values()), window
        assert window["wait"] <= wait * wall + 1.0, (window, wait * wall)
    assert sum(w["read"] + w["decode"] + w["ahead"] for w in stages) > 0, stages


def test_a_fixed_input_row_has_no_loader_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import training

    monkeypatch.setattr(training, "make_step", lambda **_: lambda batch: None)
    row = training.measure(training.RowSpec(kind="eager", loader="fixed_input"), _training_args())
    assert row.status == "ok", row.reason
    assert row.stage_ms_per_batch == []


def test_an_old_training_row_reads_with_no_diagnostics() -> None:
    from benchmarks.training import TrainingRow

    row = TrainingRow.from_json({"spec": {"kind": "eager", "loader": "fixed_input"}, "ms_per_step": [4.0]})
    assert row.main_cpu_ms_per_step == row.main_voluntary_per_step == row.process_cores == []
    assert row.main_involuntary_per_step == []


@pytest.mark.skipif(not LINUX_STATUS, reason="/proc/thread-self/status: Linux only")
def test_context_switches_count_a_sleep_as_voluntary() -> None:
    import time

    before = common.context_switches()
    time.sleep(0.01)
    after = common.context_switches()
    assert before is not None and after is not None
    assert after[0] >= before[0] + 1 and after[1] >= before[1], (before, after)


def test_no_context_switches_without_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off Linux the counts are None, and a training row keeps its other values, its switches empty."""
    from benchmarks import training

    monkeypatch.setattr(common, "THREAD_STATUS", tmp_path / "missing")
    assert common.context_switches() is None
    (tmp_path / "status").write_text("Name:\tpython\nvoluntary_ctxt_switches:\t3\n")
    monkeypatch.setattr(common, "THREAD_STATUS", tmp_path / "status")
    assert common.context_switches() is None  # one count of two
    monkeypatch.setattr(common, "THREAD_STATUS", tmp_path / "missing")
    monkeypatch.setattr(training, "make_step", lambda **_: lambda batch: None)
    row = training.measure(training.RowSpec(kind="eager", loader="fixed_input"), _training_args(windows=1))
    assert row.status == "ok", row.reason
    assert row.main_voluntary_per_step == row.main_involuntary_per_step == []
    assert len(row.main_cpu_ms_per_step) == len(row.process_cores) == 1


def test_a_rows_imports_are_no_part_of_its_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ThreadLoader's package is imported with the benchmarks; DALI's and nvImageCodec's rows imported
    theirs inside the timed first batch (its import here: a quarter of a second)."""
    import importlib

    import torch

    from benchmarks import loaders, run

    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(0.25)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(loaders.IMPORTS, "slow", ("slow_to_import",))

    def batches() -> Any:
        importlib.import_module("slow_to_import")  # as the DALI row imports DALI when it builds
        while True:
            yield torch.zeros(2, 3, 4, 4), torch.zeros(2)

    row = run.measure(run.Case("slow", "slow", 2, batches), device="cpu", warmup=1, batches=2)
    assert row.startup_s is not None and row.startup_s < 0.2


def _spin(seconds: float) -> None:
    """Use ``seconds`` of this thread's CPU time, preempted or not."""
    import time

    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _slow_walks(monkeypatch: pytest.MonkeyPatch, seconds: float, then: Any = None) -> None:
    """Each walk over /proc (``common.cpu_seconds``) costs ``seconds`` of this thread's CPU, then runs
    ``then``."""
    real, me = common.proc_stat, Path(f"/proc/{os.getpid()}/stat")

    def proc_stat(path: Path) -> Any:
        if path == me:
            _spin(seconds)
            if then is not None:
                then()
        return real(path)

    monkeypatch.setattr(common, "proc_stat", proc_stat)


#: What a batch costs the fake loaders below (CPU seconds), and what a walk over /proc costs.
SPIN_S, WALK_S = 0.01, 0.2


@pytest.mark.skipif(not LINUX_STATUS, reason="/proc: Linux only")
def test_cpu_seconds_leave_out_their_own_walks_over_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two readings around 0.1 s of CPU differ by 0.1 s: the walks (0.2 s each here) are no one's work."""
    _slow_walks(monkeypatch, WALK_S)
    first = common.cpu_seconds()
    _spin(0.1)
    assert common.cpu_seconds() - first == pytest.approx(0.1, abs=0.03)


@pytest.mark.skipif(not LINUX_STATUS, reason="/proc: Linux only")
def test_a_rows_cpu_cores_are_over_its_timed_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader using 10 ms of CPU per batch and nothing else: its cores are that CPU over the window's
    wall time. The walk over /proc before the window counted in its CPU and not in its clock (4-5 cores
    here, a loader that used one)."""
    import torch

    def batches() -> Any:
        while True:
            _spin(SPIN_S)
            yield torch.zeros(2, 3, 4, 4), torch.zeros(2)

    _slow_walks(monkeypatch, WALK_S)
    count = 5
    row = run.measure(run.Case("spin", "spin", 2, batches), device="cpu", warmup=0, batches=count)
    assert row.status == "ok", row.reason
    assert row.ms_per_batch is not None and row.cpu_cores is not None
    wall = row.ms_per_batch * count / 1000
    assert row.cpu_cores == pytest.approx(count * SPIN_S / wall, abs=0.15), (row.cpu_cores, wall)


@pytest.mark.skipif(not LINUX_STATUS, reason="/proc: Linux only")
def test_a_training_windows_counts_are_over_its_clock_not_the_walks_over_proc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step: one voluntary switch, 4 ms of a reader's "read" stage, 10 ms of CPU. Each walk over
    /proc (two a window, outside its clock): 0.2 s of CPU, 5 voluntary and 3 involuntary switches of
    the main thread, a second of the readers' stages. The window counts the steps' only."""
    import types

    import torch

    from benchmarks import training

    status = tmp_path / "status"
    switches = {"voluntary": 100, "involuntary": 50}
    loader = {"batches": 7, "read": 1.0, "cpu": 0}

    def write_status() -> None:
        status.write_text(
            "Name:\tpython\n"
            f"voluntary_ctxt_switches:\t{switches['voluntary']}\n"
            f"nonvoluntary_ctxt_switches:\t{switches['involuntary']}\n"
        )

    def walked() -> None:
        switches["voluntary"] += 5
        switches["involuntary"] += 3
        loader["read"] += 1.0
        loader["cpu"] += 100
        write_status()

    def stats() -> Any:
        return types.SimpleNamespace(
            batches=loader["batches"], stage_seconds={"read": loader["read"]}, started_on_cpu=loader["cpu"]
        )

    def stream() -> Any:
        while True:
            loader["batches"] += 1
            yield torch.zeros(2, 3, 4, 4), torch.zeros(2)

    def step(batch: Any) -> None:
        _spin(SPIN_S)
        switches["voluntary"] += 1
        loader["read"] += 0.004
        loader["cpu"] += 2
        write_status()

    write_status()
    monkeypatch.setattr(common, "THREAD_STATUS", status)
    _slow_walks(monkeypatch, WALK_S, walked)
    row = training.TrainingRow(training.RowSpec("eager", "threadloader", "resize"))
    steps = 4
    training._window(row, stream(), step, steps, "cpu", stats=stats)
    assert row.main_voluntary_per_step == [1.0] and row.main_involuntary_per_step == [0.0], row
    ((stage,),) = (list(s.items()) for s in row.stage_ms_per_batch)
    assert stage == ("read", pytest.approx(4.0)), row.stage_ms_per_batch
    assert row.started_on_cpu == [2 * steps], row.started_on_cpu
    (ms,), (cores,) = row.ms_per_step, row.process_cores
    assert cores == pytest.approx(steps * SPIN_S / (ms * steps / 1000), abs=0.15), (cores, ms)


def test_memory_by_stream_sums_each_streams_segments() -> None:
    """torch.cuda.memory_snapshot()'s segments (the keys it gives), summed per stream in MiB."""
    mib = 2**20
    segments = [
        {"stream": 0, "total_size": 20 * mib, "allocated_size": 2 * mib, "device": 0},
        {"stream": 94, "total_size": 64 * mib, "allocated_size": 48 * mib, "device": 0},
        {"stream": 0, "total_size": 2 * mib, "allocated_size": 0, "device": 0},
        {"stream": 95, "total_size": 32 * mib, "allocated_size": 0, "device": 0},
    ]
    assert common.memory_by_stream(segments) == {0: [22.0, 2.0], 94: [64.0, 48.0], 95: [32.0, 0.0]}
    assert common.memory_by_stream([]) == {}


def test_cores_by_group_counts_threads_named_alike_together() -> None:
    """Two threads named ``spinner-0`` and ``spinner-1`` that spin 0.3 s of their own CPU each: one group."""
    spin = 0.3
    started = threading.Barrier(3, timeout=10)
    done = threading.Event()

    def spinner() -> None:
        started.wait()
        until = time.thread_time() + spin
        while time.thread_time() < until:
            pass
        done.wait(10)  # alive at the second reading: an ended thread is not counted

    threads = [threading.Thread(target=spinner, name=f"spinner-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    before = common.thread_cpu()
    wall = time.perf_counter()
    started.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(
        common.thread_cpu()[t.native_id][1] < spin - 0.02 for t in threads if t.native_id
    ):
        time.sleep(0.05)  # /proc counts in ticks (10 ms): until it shows both spins
    wall = time.perf_counter() - wall
    cores = common.cores_by_group(before, common.thread_cpu(), wall)
    done.set()
    for thread in threads:
        thread.join(10)
    assert "spinner-#" in cores and "spinner-0" not in cores, cores
    assert 2 * (spin - 0.02) <= cores["spinner-#"] * wall < 2 * spin + 0.2, (cores, wall)
