"""A training loop fed by each loader, against the same step on a fixed input tensor.

Usage: ``python -m benchmarks.training [--quick] [--device cpu] [--out DIR] [--timeline] ...``

Rows: for each step kind (``eager``; ``graphed``: the whole step one CUDA graph, see
``benchmarks.train_step``), the step on one fixed input tensor (the ceiling), then for each pipeline
(``resize``: the varied set resized to 224x224; ``augment``: RandomResizedCrop(224) + flip), each
loader: ThreadLoader, nvImageCodec in spawned DataLoader workers with a collate, Pillow in forked
DataLoader workers. Every pipeline delivers float32 normalized with ImageNet's mean and std.

Each row runs in a process of its own (decoder caches, CUDA contexts and worker pools do not carry
over): it builds the model and the step, takes ``--warmup`` steps (their img/s kept per ``--steps``
steps: the ramp to the steady state), then ``--windows`` timed windows of ``--steps`` steps each and
reports the median window with the min-max. ``data wait`` is the share of a
window spent blocked on ``next()``. ``extra GPU MB`` is what the loader adds on top of the training
step: ``torch peak`` is torch's peak allocated memory above the step's own peak, ``device`` the
device-wide used memory (worker processes' contexts and nvImageCodec included), sampled, above the
level before the loader started.

``--timeline`` instead profiles each loader's row (of the first kind and pipeline, and each ThreadLoader
variant's) with torch.profiler, writes the chrome traces and prints where the loader's kernels ran
against the training kernels and the host CUDA calls by thread (``benchmarks.timeline``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from benchmarks import common, loaders, report, timeline
from benchmarks.common import Batch, DeviceMemory, SkipRow, Step, names, record_failure
from benchmarks.datasets import OUTPUT_SIZE, ensure_dataset, list_images
from benchmarks.train_step import KINDS, make_step, model_name, random_batch
from threadloader.decode.nvimgcodec import _allocators

PIPELINES = ("resize", "augment")
LOADERS = ("fixed_input", "threadloader", "dali", "spawn_collate_nvimgcodec", "pil_dataloader")
SET = "varied"

SIZED = {  # option: (full run, --quick, what it is)
    "count": (1000, 32, "images in the varied set"),
    "batch_size": (64, 8, "images per step"),
    "workers": (8, 2, "DataLoader workers"),
    "warmup": (70, 1, "steps after the first (start-up) one, before timing (the steady state's start)"),
    "steps": (20, 2, "steps per timed window"),
    "windows": (3, 3, "timed windows per row; the median is reported"),
    "row_timeout": (150.0, 120.0, "seconds before a row's process is stopped"),
    "startup_pause": (1.0, 0.0, "seconds between building a loader and its first batch (a script's set-up)"),
}


@dataclass
class RowSpec:
    """What one row measures; the parent passes it to the row's process as JSON."""

    kind: str
    loader: str
    pipeline: str = "-"  # "-" for the fixed input, which has no pipeline
    engine: str = ""  # ThreadLoader's: "capi" (nvImageCodec's C API) or "python" (its Python API)
    options: dict[str, Any] = field(default_factory=dict)  # more ThreadLoader arguments (a variant row)

    @property
    def name(self) -> str:
        engine = f"[{self.engine}]" if self.engine else ""
        return f"{self.loader}{engine}{common.option_label(self.options)}"


@dataclass
class TrainingRow:
    """One measured (or skipped) row."""

    spec: RowSpec
    status: str = "ok"  # "ok" | "skipped" | "failed"
    reason: str = ""
    batch_size: int = 0
    images_per_s: list[float] = field(default_factory=list)  # one per timed window
    ms_per_step: list[float] = field(default_factory=list)
    data_wait_frac: list[float] = field(default_factory=list)
    #: Host seconds blocked in next() per window, over its wall time; device_wait_frac: the GPU's wait
    #: for the batches over it (common.take), CUDA rows only.
    device_wait_frac: list[float] = field(default_factory=list)
    #: Per step, the main (step's) thread's CPU ms (on CUDA, the sync's spin too) and its voluntary
    #: (blocked: GIL, locks) and involuntary (preempted) context switches, these empty off Linux.
    main_cpu_ms_per_step: list[float] = field(default_factory=list)
    main_voluntary_per_step: list[float] = field(default_factory=list)
    main_involuntary_per_step: list[float] = field(default_factory=list)
    #: CPU seconds of this process and its workers (DataLoader's) over the window's wall seconds.
    process_cores: list[float] = field(default_factory=list)
    #: Per window, the cores each group of this process's threads used (``common.cores_by_group``:
    #: the step's ``MainThread``, the readers, nvImageCodec's pool, CUDA's and torch's threads).
    thread_cores: list[dict[str, float]] = field(default_factory=list)
    #: ThreadLoader rows: per window, ``loader.stats()``'s host ms per batch handed out, per stage
    #: (summed over the reader threads, so they can add up to more than a step).
    stage_ms_per_batch: list[dict[str, float]] = field(default_factory=list)
    #: The same windows' CPU ms per batch of the timing threads in each stage: the rest of a stage's
    #: ms was waiting (for the GIL beside the step, a lock, the GPU) or other threads' work
    #: (nvImageCodec's in ``decode``), as ``LoaderStats.stage_cpu_seconds`` says.
    stage_cpu_ms_per_batch: list[dict[str, float]] = field(default_factory=list)
    #: ThreadLoader rows on the GPU: per window, nvImageCodec's calls to the allocators per step
    #: (``_allocators.Counts``' fields); empty where its Decoders have none.
    allocator_calls_per_step: list[dict[str, float]] = field(default_factory=list)
    #: ThreadLoader rows: per window, its samples decoded by Pillow while nvImageCodec was starting
    #: (``LoaderStats.started_on_cpu``): whether a window still held the CPU start.
    started_on_cpu: list[int] = field(default_factory=list)
    startup_s: float | None = None  # building the loader and its first batch's data, the pause left out
    build_s: float | None = None  # the loader's constructor (or its first next(), where that builds it)
    first_batch_s: float | None = None  # after the pause, to the first batch's data ready
    extra_torch_peak_mb: float | None = None
    extra_device_mb: float | None = None
    #: After the windows, torch's caching allocator per CUDA stream, MiB ``[reserved, allocated]``:
    #: the step's own stream, and every other (a loader's readers' and allocation streams, the
    #: fixed input's none), largest first. A stream's freed blocks serve only that stream.
    step_stream_mb: list[float] = field(default_factory=list)
    other_streams_mb: list[list[float]] = field(default_factory=list)
    row_s: float | None = None  # the row's process, start to end
    #: img/s of each ``--steps`` steps of the warm-up (the last part may be shorter): the ramp to the
    #: steady state the windows measure. Beside the graphed step ThreadLoader's decode calls are slower
    #: over the first thousands of images (docs/benchmarks.md, "One machine session, both interpreters").
    warmup_images_per_s: list[float] = field(default_factory=list)

    def median(self, values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainingRow:
        names = {f.name for f in fields(cls)}
        row = cls(**{k: v for k, v in data.items() if k in names})
        row.spec = RowSpec(**data["spec"])
        return row


# --- one row, in its own process -------------------------------------------------------------------


def fixed_input(*, size: tuple[int, int], batch_size: int, device: str) -> Generator[Batch, None, None]:
    """The same batch forever, on the device and channels_last: the step with no loader (the ceiling)."""
    batch = random_batch(device=device, batch_size=batch_size, size=size)
    while True:
        yield batch


def _loader(
    spec: RowSpec,
    args: argparse.Namespace,
    on_built: Callable[[], None],
    on_stats: Callable[[Callable[[], Any]], None],
) -> Generator[Batch, None, None]:
    """The row's batch generator (not started: its first ``next()`` builds the loader, then ``on_built``)."""
    size, device, b = OUTPUT_SIZE[SET], args.device, args.batch_size
    if spec.loader == "fixed_input":
        return fixed_input(size=size, batch_size=b, device=device)
    work = loaders.Work(
        size,
        b,
        device,
        augment=spec.pipeline == "augment",
        normalize=True,
        on_built=on_built,
        on_stats=on_stats,
    )
    if spec.loader == "threadloader":
        engine, options = spec.engine or None, spec.options
        return loaders.threadloader(
            args.root, work, num_threads=None, channels_last=True, engine=engine, options=options
        )
    source = args.root if spec.loader == "dali" else list_images(args.root)
    return getattr(loaders, spec.loader)(source, work, workers=args.workers)


def _progress(message: str) -> None:
    print(f"    {message}", file=sys.stderr, flush=True)


def measure(spec: RowSpec, args: argparse.Namespace) -> TrainingRow:
    """Runs one row in this process; never raises for a skipped or failing loader."""
    row, device, size = TrainingRow(spec, batch_size=args.batch_size), args.device, OUTPUT_SIZE[SET]
    stream: Generator[Batch, None, None] | None = None
    memory = DeviceMemory(device)
    try:
        common.release(device)  # before building the step, never after (see release)
        step = make_step(device=device, batch_size=args.batch_size, size=size, kind=spec.kind)
        # Baseline: one more step on its own input, its peak the training's own.
        baseline = next(fixed_input(size=size, batch_size=args.batch_size, device=device))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step(baseline)
        step_peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        memory.start()
        built: list[float] = []
        stats: list[Callable[[], Any]] = []  # the ThreadLoader's stats(), once built

        def pause() -> None:  # the script's own set-up between building the loader and its loop
            built.append(time.perf_counter())
            time.sleep(args.startup_pause)

        loaders.preload(spec.loader)  # imports are no one's start-up
        stream = _loader(spec, args, pause, stats.append)
        started = time.perf_counter()
        first = next(stream)
        common.sync(device)  # the first batch's data ready, as benchmarks.run times it: no step in it
        ended = time.perf_counter()
        step(first)
        del first
        if built:  # fixed input builds nothing
            row.build_s = built[0] - started
            row.first_batch_s = ended - built[0] - args.startup_pause
            row.startup_s = row.build_s + row.first_batch_s
        else:
            row.startup_s = ended - started
        row.warmup_images_per_s = _warm_up(stream, step, args.warmup, args.steps)
        ramp = ", ".join(f"{rate:,.0f}" for rate in row.warmup_images_per_s)
        _progress(f"started in {row.startup_s:.1f} s, warmed up at {ramp or '-'} img/s")
        if args.profile:
            _profile(row, stream, step, args, stats=stats[0] if stats else None)
        else:
            for window in range(args.windows):
                _window(row, stream, step, args.steps, args.device, stats=stats[0] if stats else None)
                _progress(f"window {window + 1}: {row.images_per_s[-1]:,.0f} img/s, {_diagnostics(row)}")
        if device == "cuda":
            streams = common.memory_by_stream(torch.cuda.memory_snapshot())
            row.step_stream_mb = streams.pop(torch.cuda.current_stream().cuda_stream, [0.0, 0.0])
            row.other_streams_mb = sorted(streams.values(), reverse=True)
        row.extra_device_mb = memory.stop()
        if device == "cuda":
            row.extra_torch_peak_mb = (torch.cuda.max_memory_allocated() - step_peak) / 2**20
    except Exception as e:
        record_failure(row, e)
    finally:
        memory.stop()
        if stream is not None:
            stream.close()
    return row


def _warm_up(stream: Iterator[Batch], step: Step, steps: int, part: int) -> list[float]:
    """Takes ``steps`` steps, in parts of ``part``; returns each part's img/s (the step syncs)."""
    rates = []
    for first in range(0, steps, part):
        started = time.perf_counter()
        images, _ = common.take(stream, step, min(part, steps - first))
        rates.append(images / (time.perf_counter() - started))
    return rates


def _window(
    row: TrainingRow,
    stream: Iterator[Batch],
    step: Step,
    steps: int,
    device: str,
    *,
    stats: Callable[[], Any] | None = None,
) -> None:
    """One timed window of ``steps`` steps, run in the calling (main) thread; appends its values.

    ``stats``: the row's ``ThreadLoader.stats``, read before and after the window for its stages.
    """
    on_device: list[float] | None = [] if device == "cuda" else None
    # All processes' CPU (DataLoader workers too), read outside the wall clock: a walk over /proc
    # takes milliseconds, which would stretch the window (cpu_seconds leaves its own CPU out). The
    # other counts are read next to the clock, so that none of them takes in the walks either: the
    # main thread's switches while it walks, the readers' stages and allocations meanwhile.
    threads = common.thread_cpu()
    process_cpu = common.cpu_seconds()
    before = stats() if stats is not None else None
    allocations = _allocators.counts()
    switches = common.context_switches()
    started = time.perf_counter()
    thread_cpu = time.thread_time()
    images, waited = common.take(stream, step, steps, on_device=on_device)
    thread_cpu = time.thread_time() - thread_cpu
    wall = time.perf_counter() - started
    switched = common.context_switches()
    allocated = _allocators.counts()
    after = stats() if stats is not None else None
    process_cpu = common.cpu_seconds() - process_cpu
    row.thread_cores.append(common.cores_by_group(threads, common.thread_cpu(), wall))
    if before is not None and after is not None:
        row.stage_ms_per_batch.append(common.stage_ms(before, after))
        row.stage_cpu_ms_per_batch.append(common.stage_ms(before, after, cpu=True))
        row.started_on_cpu.append(after.started_on_cpu - before.started_on_cpu)
    if allocations is not None and allocated is not None:
        calls = zip(allocated._fields, allocated, allocations, strict=True)
        row.allocator_calls_per_step.append({name: (now - was) / steps for name, now, was in calls})
    row.images_per_s.append(images / wall)
    row.ms_per_step.append(1000 * wall / steps)
    row.data_wait_frac.append(waited / wall)
    if on_device:
        row.device_wait_frac.append(on_device[0] / wall)
    row.main_cpu_ms_per_step.append(1000 * thread_cpu / steps)
    row.process_cores.append(process_cpu / wall)
    if switches is not None and switched is not None:
        row.main_voluntary_per_step.append((switched[0] - switches[0]) / steps)
        row.main_involuntary_per_step.append((switched[1] - switches[1]) / steps)


def _diagnostics(row: TrainingRow) -> str:
    """The last window's main thread and process CPU, for its progress line."""
    switches = (
        f"{row.main_voluntary_per_step[-1]:.1f} vol + {row.main_involuntary_per_step[-1]:.1f} invol "
        "switches/step"
        if row.main_voluntary_per_step
        else "switches unknown"
    )
    allocations = ""
    if row.allocator_calls_per_step:
        calls = row.allocator_calls_per_step[-1]
        allocations = ", nvImageCodec's device mallocs/frees per step {:.2f}/{:.2f}".format(
            calls["device_mallocs"], calls["device_frees"]
        )
    return (
        f"main {row.main_cpu_ms_per_step[-1]:.1f} ms CPU/step, {switches}, {row.process_cores[-1]:.1f} cores"
        + allocations
    )


def _profile(
    row: TrainingRow,
    stream: Iterator[Batch],
    step: Step,
    args: argparse.Namespace,
    *,
    stats: Callable[[], Any] | None = None,
) -> None:
    """Profiles a window; writes the chrome trace and the timeline summary into ``--out``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        _window(row, stream, step, args.steps, args.device, stats=stats)
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / f"timeline-{args.profile}.json"
    prof.export_chrome_trace(str(trace))
    readers = [
        t.native_id for t in threading.enumerate() if t.name.startswith("threadloader-e") and t.native_id
    ]
    summary = timeline.summarize(
        timeline.read_trace(trace), main_tid=threading.get_native_id(), reader_tids=readers
    )
    text = summary.text(steps=args.steps)
    if row.spec.options:
        text = f"ThreadLoader arguments: {row.spec.options}\n\n{text}"
    if row.stage_ms_per_batch:
        stages = row.stage_ms_per_batch[-1]
        text += "\n\nThreadLoader's host ms per batch, per stage (summed over its threads): " + ", ".join(
            f"{stage} {ms:.2f}" for stage, ms in stages.items()
        )
    (args.out / f"timeline-{args.profile}.md").write_text(text + "\n")
    print(text, file=sys.stderr, flush=True)
    _progress(f"wrote {trace}")


# --- the parent: one process per row, then the report ---------------------------------------------


def plan(args: argparse.Namespace) -> list[RowSpec]:
    """The rows, grouped by step kind, the fixed-input ceiling first in each group."""
    specs = []
    for kind in args.kinds:
        if "fixed_input" in args.loaders:
            specs.append(RowSpec(kind, "fixed_input"))
        for pipeline in args.pipelines:
            for loader in args.loaders:
                if loader == "fixed_input":
                    continue
                engines = args.engines if loader == "threadloader" and args.device == "cuda" else [""]
                for engine in engines:
                    specs.append(RowSpec(kind, loader, pipeline, engine=engine))
                    if loader == "threadloader":
                        specs.extend(
                            RowSpec(kind, loader, pipeline, engine=engine, options=options)
                            for options in args.threadloader_variant or ()
                        )
    return specs


def _skip_reason(spec: RowSpec, device: str) -> str | None:
    """Rows that cannot run here, decided without starting a process for them."""
    if device != "cuda" and spec.kind == "graphed":
        return "CUDA graphs need a CUDA device"
    if device != "cuda" and spec.loader == "spawn_collate_nvimgcodec":
        return "needs a CUDA device"
    if spec.loader == "dali" and not common.installed("nvidia.dali"):
        return "nvidia.dali is not installed"
    return None


def run_row(spec: RowSpec, args: argparse.Namespace, argv: Sequence[str]) -> TrainingRow:
    """Runs one row in a child process (this module with ``--row``) and reads its result."""
    reason = _skip_reason(spec, args.device)
    if reason is not None:
        return TrainingRow(spec, status="skipped", reason=reason, batch_size=args.batch_size)
    command = [sys.executable, "-m", "benchmarks.training", *argv, "--row", json.dumps(asdict(spec))]
    started = time.perf_counter()
    try:
        row = TrainingRow.from_json(common.run_child(command, timeout=args.row_timeout))
    except common.RowProcessError as e:
        row = TrainingRow(spec, batch_size=args.batch_size)
        record_failure(row, e)
    row.row_s = time.perf_counter() - started
    return row


def ratio(row: TrainingRow, rows: Sequence[TrainingRow]) -> float | None:
    """Median throughput over the fixed-input step's of the same kind."""
    # Only a baseline that ran: a failed one's partial windows are no ceiling (ratios above 1 came of it).
    bases = (r for r in rows if r.spec.loader == "fixed_input" and r.spec.kind == row.spec.kind)
    base = next((r for r in bases if r.status == "ok"), None)
    ours, theirs = row.median(row.images_per_s), base.median(base.images_per_s) if base else None
    return ours / theirs if ours is not None and theirs else None


def _model_label(device: str) -> str:
    try:
        return model_name(device)
    except SkipRow as e:
        return f"none ({e})"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse options; unset sizes take the full-run or ``--quick`` default."""
    p = common.parser("benchmarks.training", __doc__, SIZED, "training.md, training.json and training.png")
    p.add_argument("--kinds", type=names(KINDS), default=list(KINDS), help="eager,graphed")
    p.add_argument("--pipelines", type=names(PIPELINES), default=list(PIPELINES), help="resize,augment")
    p.add_argument("--loaders", type=names(LOADERS), default=list(LOADERS), help=", ".join(LOADERS))
    p.add_argument(
        "--engines", type=names(common.ENGINES), default=list(common.ENGINES),
        help="ThreadLoader rows on a GPU: nvImageCodec's C API, its Python API (default both)",
    )  # fmt: skip
    p.add_argument(
        "--threadloader-variant",
        type=common.threadloader_options,
        action="append",
        metavar="NAME=VALUE,...",
        help="after each ThreadLoader row, one more with these arguments (repeatable), as "
        "benchmarks.run's --threadloader-options",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="profile each loader's row of the first --kinds and --pipelines with torch.profiler "
        "(DALI's too: its kernels against the step's, as ThreadLoader's)",
    )
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: run this one row, print it as JSON
    p.add_argument("--profile", help=argparse.SUPPRESS)  # internal: profile the row, name its files
    args = common.parse(p, argv, SIZED)
    if min(args.steps, args.windows) < 1 or args.warmup < 0:
        p.error(
            f"need --steps and --windows >= 1 and --warmup >= 0, got {args.steps}, {args.windows}, "
            f"{args.warmup}"
        )
    if args.timeline and args.out is None:
        p.error("--timeline writes a chrome trace: give --out DIR")
    return args


def write(data: dict[str, Any], out: Path | None) -> str:
    """The run's page (its training and memory tables), and with ``out`` training.md, .json and .png."""
    result = report.ResultFile((out or Path()) / "training.json", data)
    text = "\n".join(report.training_table([result]) + report.memory_tables([], [result]))
    if out is not None:
        common.write_results(out, "training", text, data)
        if common.can_chart():
            report.training_chart([result])(out / "training.png")
    return text


def main(argv: Sequence[str] | None = None) -> list[TrainingRow]:
    """Measure every selected row in its own process; print and write the report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.root = ensure_dataset(SET, count=args.count, root=args.data_root)
    if args.row is not None:  # a row's own process
        row = measure(RowSpec(**json.loads(args.row)), args)
        print(json.dumps(asdict(row)))
        return [row]
    common.warm_page_cache(list_images(args.root))
    if args.timeline:
        profiled = []
        for loader in (name for name in args.loaders if name != "fixed_input"):
            variants = (args.threadloader_variant or ()) if loader == "threadloader" else ()
            for number, options in enumerate([{}, *variants]):
                spec = RowSpec(args.kinds[0], loader, args.pipelines[0], options=options)
                _progress(f"timeline: {spec.kind} step, {spec.pipeline}, {spec.name}")
                profile = f"{spec.kind}-{spec.pipeline}-{loader}" + (f"-variant{number}" if number else "")
                profiled.append(run_row(spec, args, [*argv, "--profile", profile]))
        return profiled
    specs, rows, started = plan(args), [], time.perf_counter()
    for i, spec in enumerate(specs, 1):
        elapsed = time.perf_counter() - started
        print(
            f"[{i}/{len(specs)}, {elapsed:.0f} s] {spec.kind} {spec.pipeline} {spec.name} ...",
            file=sys.stderr,
            flush=True,
        )
        row = run_row(spec, args, argv)
        rows.append(row)
        median = row.median(row.images_per_s)
        done = f"{median:,.0f} img/s" if median is not None else f"{row.status}: {row.reason}"
        print(f"    {done} ({row.row_s or 0:.0f} s)", file=sys.stderr, flush=True)
    config: dict[str, object] = {
        "set": SET,
        "count": args.count,
        "batch_size": args.batch_size,
        "model": _model_label(args.device),
        "warmup": args.warmup,
        "steps": args.steps,
        "windows": args.windows,
        "workers": args.workers,
        "startup_pause": args.startup_pause,
        "device": args.device,
        "wall_s": round(time.perf_counter() - started),
    }
    data = {
        "command": common.command_line("benchmarks.training", argv),
        "hardware": common.hardware(args.device),
        "config": config,
        "rows": [asdict(r) | {"ratio": ratio(r, rows)} for r in rows],
    }
    print(write(data, args.out))
    return rows


if __name__ == "__main__":
    main()
