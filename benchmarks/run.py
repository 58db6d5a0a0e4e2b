"""Measure every loader on the same data with the same method; write report.md/json/png.

Usage: ``python -m benchmarks.run [--set fixed|varied] [--normalize|--augment] [--quick] [--out DIR] ...``

Method, identical for every row: each repeat of each row runs in a fresh process (``--repeats``,
the rows interleaved), so nothing an earlier row cached (nvImageCodec decoders, a CUDA context,
imported modules) makes a later row's start-up or memory look smaller. In that process: build the
loader (``startup_s`` runs from construction to the first batch whose data is ready), take
``--warmup`` batches, then time ``--batches`` batches, the consumer synchronizing the current CUDA
stream after each one as a training step would. The report gives each row's median over its repeats,
with min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks import common, loaders, report
from benchmarks.common import Batch, DeviceMemory, names, record_failure
from benchmarks.datasets import OUTPUT_SIZE, SETS, ensure_dataset, list_images

LOADERS = (
    "pil_dataloader",
    "spawn_collate_nvimgcodec",
    "single_decoder_ceiling",
    "torchvision_gpu",
    "dali",
    "threadloader",
)
GPU_ONLY = frozenset({"spawn_collate_nvimgcodec", "single_decoder_ceiling", "torchvision_gpu"})
BASELINE = "pil_dataloader"
"""Loader family every throughput is compared with: the common Pillow + DataLoader pipeline."""

SIZED = {  # option: (full run, --quick, what it is)
    "count": (2000, 64, "images in the set"),
    "batches": (200, 5, "timed batches"),
    "warmup": (20, 1, "warm-up batches"),
    "batch_size": (64, 16, "batch size of the non-sweep rows"),
    "workers": (8, 2, "DataLoader workers"),
    "repeats": (3, 1, "fresh processes per row; the report gives the median and min-max"),
    "row_timeout": (300.0, 120.0, "seconds before a row's process is stopped"),
}


@dataclass
class Row:
    """One measurement (one repeat, in one process) of a loader configuration, or why it did not run."""

    name: str
    loader: str
    batch_size: int
    status: str = "ok"  # "ok" | "skipped" | "failed"
    reason: str = ""
    images: int = 0
    batches: int = 0
    pid: int | None = None  # the process that measured it
    images_per_s: float | None = None
    ms_per_batch: float | None = None
    startup_s: float | None = None
    cpu_cores: float | None = None
    extra_gpu_mb: float | None = None
    torch_reserved_mb: float | None = None
    data_wait_frac: float | None = None
    #: ThreadLoader rows: ``loader.stats()``'s host ms per timed batch, per stage (summed over its threads).
    stage_ms_per_batch: dict[str, float] = field(default_factory=dict)


#: The measurements summarized over repeats: median, min and max of the repeats that ran (the numbers
#: after ``pid``; the stages are summarized stage by stage, ``Result.stages``).
MEASURES = tuple(f.name for f in fields(Row) if f.name != "stage_ms_per_batch")[8:]


@dataclass
class Result:
    """One configuration measured ``len(repeats)`` times, each repeat in a fresh process."""

    name: str
    loader: str
    batch_size: int
    repeats: list[Row] = field(default_factory=list)

    @property
    def ok(self) -> list[Row]:
        return [r for r in self.repeats if r.status == "ok"]

    @property
    def status(self) -> str:
        """``ok`` when any repeat ran; else the first repeat's (``skipped`` or ``failed``)."""
        return "ok" if self.ok else (self.repeats[0].status if self.repeats else "failed")

    @property
    def reason(self) -> str:
        """Why repeats did not run: the first such reason, with a count when some others did."""
        bad = [r for r in self.repeats if r.status != "ok"]
        if not bad or not self.ok:
            return bad[0].reason if bad else ""
        return f"{len(bad)} of {len(self.repeats)} repeats {bad[0].status}: {bad[0].reason}"

    def spread(self, measure: str) -> report.Spread | None:
        """Median, min and max of ``measure`` over the repeats that ran and measured it."""
        return report.Spread.of([v for r in self.ok if (v := getattr(r, measure)) is not None])

    def median(self, measure: str) -> float | None:
        spread = self.spread(measure)
        return None if spread is None else spread.median

    def stages(self) -> dict[str, float]:
        """Each stage's median host ms per batch over the repeats that recorded it."""
        recorded = [r.stage_ms_per_batch for r in self.ok]
        names = dict.fromkeys(stage for stages in recorded for stage in stages)
        return {stage: statistics.median(s[stage] for s in recorded if stage in s) for stage in names}


def results_json(results: list[Result], **context: Any) -> dict[str, Any]:
    """The run's JSON: ``context`` (command, hardware, config), then the rows.

    Per row: each measure's median under its own name, its ``min`` and ``max``, the ratio of medians
    to the baseline, and every repeat as measured.
    """
    base = next((r.median("images_per_s") for r in results if r.loader == BASELINE and r.ok), None)
    rows = []
    for result in results:
        spreads = {m: result.spread(m) for m in MEASURES}
        speed = result.median("images_per_s")
        rows.append(
            {"name": result.name, "loader": result.loader, "batch_size": result.batch_size}
            | {"status": result.status, "reason": result.reason}
            | {m: s and s.median for m, s in spreads.items()}
            | {"min": {m: s and s.low for m, s in spreads.items()}}
            | {"max": {m: s and s.high for m, s in spreads.items()}}
            | {"ratio_vs_pil": None if base is None or speed is None else speed / base}
            | {"stage_ms_per_batch": result.stages()}
            | {"repeats": [asdict(r) for r in result.repeats]}
        )
    return context | {"rows": rows}


def write(data: dict[str, Any], out: Path | None) -> str:
    """The run's page (its throughput and memory tables), and with ``out`` report.md, .json and .png."""
    result = report.ResultFile((out or Path()) / "report.json", data)
    text = "\n".join(report.throughput_tables([result]) + report.memory_tables([result], []))
    if out is not None:
        common.write_results(out, "report", text, data)
        if common.can_chart():
            report.throughput_chart([result], "images/s")(out / "report.png")
    return text


# --- one row, in its own process -------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One row to measure: ``make()`` returns the loader's (not yet started) batch generator."""

    name: str
    loader: str
    batch_size: int
    make: Callable[[], Generator[Batch, None, None]]
    #: Where a ThreadLoader row's generator leaves ``loader.stats`` once built (``Work.on_stats``).
    stats: list[Callable[[], Any]] = field(default_factory=list)


def measure(case: Case, *, device: str, warmup: int, batches: int) -> Row:
    """Run one case with the shared method; never raises for a skipped or failing loader.

    Args:
        case: The loader configuration.
        device: ``"cuda"`` or ``"cpu"``.
        warmup: Batches consumed after the first and before timing.
        batches: Timed batches, the consumer waiting for each one's data.
    """
    row = Row(name=case.name, loader=case.loader, batch_size=case.batch_size, pid=os.getpid())
    common.release(device)
    loaders.preload(case.loader)  # imports are no one's start-up
    stream = case.make()
    memory = DeviceMemory(device)

    def step(_batch: Batch) -> None:  # a consumer that only waits for the batch's data
        common.sync(device)

    try:
        reserved = 0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            reserved = torch.cuda.memory_reserved()
        memory.start()
        start = time.perf_counter()
        next(stream)
        common.sync(device)
        row.startup_s = time.perf_counter() - start
        common.take(stream, step, warmup)
        stats = case.stats[0] if case.stats else None
        cpu0 = common.cpu_seconds()  # a walk over /proc: outside the clock and the stages' snapshots
        before = stats() if stats is not None else None
        start = time.perf_counter()
        row.images, waited = common.take(stream, step, batches)
        wall = time.perf_counter() - start
        after = stats() if stats is not None else None
        row.cpu_cores = (common.cpu_seconds() - cpu0) / wall
        if before is not None and after is not None:
            row.stage_ms_per_batch = common.stage_ms(before, after)
        row.batches = batches
        row.images_per_s = row.images / wall
        row.ms_per_batch = 1000 * wall / batches
        row.data_wait_frac = waited / wall
        row.extra_gpu_mb = memory.stop()
        if device == "cuda":
            row.torch_reserved_mb = (torch.cuda.max_memory_reserved() - reserved) / 2**20
    except Exception as e:
        record_failure(row, e)
    finally:
        memory.stop()
        stream.close()
    return row


def cases(args: argparse.Namespace, root: Path) -> list[Case]:
    """The rows selected by the options, all reading the same files and delivering the same output."""
    files, b, w = list_images(root), args.batch_size, args.workers

    def case(loader: str, label: str, source: Any, batch_size: int = b, **kwargs: Any) -> Case:
        """A row of ``loaders.<loader>`` over ``source`` (the files, or their folder)."""
        stats: list[Callable[[], Any]] = []
        size, device = OUTPUT_SIZE[args.set], args.device
        work = loaders.Work(size, batch_size, device, args.augment, args.normalize, on_stats=stats.append)
        make = partial(getattr(loaders, loader), source, work, **kwargs)
        return Case(f"{loader} {label}", loader, batch_size, make, stats)

    def ours(label: str, batch_size: int, **kwargs: Any) -> Case:
        label += f" b={batch_size}{common.option_label(args.threadloader_options)}"
        return case("threadloader", label, root, batch_size, options=args.threadloader_options, **kwargs)

    rows = [
        case("pil_dataloader", f"w={w} b={b}", files, workers=w),
        case("spawn_collate_nvimgcodec", f"w={w} b={b}", files, workers=w),
        *(
            case(
                "single_decoder_ceiling",
                f"{backend} b={cb}" + (f" {crop} + crop" if crop else ""),
                files,
                cb,
                backend=backend,
                crop=crop,
            )
            for backend in args.backends
            for cb in args.ceiling_batch_sizes
            # --augment: decoding a random crop's region against decoding the whole image and cropping
            for crop in (("whole", "region") if args.augment else (None,))
        ),
        case("torchvision_gpu", f"b={b}", files),
        case("dali", f"w={w} b={b}", root, workers=w),
        ours("default threads", b, num_threads=None),
    ]
    if args.augment:  # the same pipeline decoding whole images and cropping them: what regions save
        rows.append(ours("whole decode + crop", b, num_threads=None, region_decode=False))
    if args.sweep:
        rows += [ours(f"t={t}", sb, num_threads=t) for t in args.threads for sb in args.batch_sizes]
    # The forked DataLoader row runs last: on an H200, after it had run in the process, nvImageCodec's
    # hybrid backend failed 114 of 128 region decodes that succeed in a fresh process.
    rows.sort(key=lambda c: c.loader == "pil_dataloader")
    return [c for c in rows if not args.only or c.loader in args.only]


# --- the parent: each repeat of each row in a process of its own, then the report -----------------


def skip_reason(case: Case, device: str) -> str | None:
    """Rows that cannot run here, decided without starting a process for them.

    The loaders raise :class:`~benchmarks.common.SkipRow` for the same reasons (and others) when they
    are run anyway.
    """
    if device != "cuda" and case.loader in GPU_ONLY:
        return "needs a CUDA device"
    if case.loader == "dali" and not common.installed("nvidia.dali"):
        return "nvidia.dali is not installed"
    return None


def measure_rows(selected: Sequence[Case], args: argparse.Namespace, argv: Sequence[str]) -> list[Result]:
    """Every repeat of every row, each in a fresh process of this module, the rows interleaved.

    Interleaved, so that a drift of the machine (clocks, other load) spreads over all rows; a row
    that is skipped once is not run again.
    """
    results = [Result(case.name, case.loader, case.batch_size) for case in selected]
    for repeat in range(1, args.repeats + 1):
        for i, (case, result) in enumerate(zip(selected, results, strict=True), 1):
            if result.repeats and result.status == "skipped":
                continue
            print(
                f"[{repeat}/{args.repeats}: {i}/{len(selected)}] {case.name} ...", file=sys.stderr, flush=True
            )
            row = Row(name=case.name, loader=case.loader, batch_size=case.batch_size)
            reason = skip_reason(case, args.device)
            if reason is not None:
                row.status, row.reason = "skipped", reason
            else:
                command = [sys.executable, "-m", "benchmarks.run", *argv, "--_row", case.name]
                try:
                    row = Row(**common.run_child(command, timeout=args.row_timeout))
                except common.RowProcessError as e:
                    record_failure(row, e)
            result.repeats.append(row)
            done = f"{row.images_per_s:,.0f} img/s" if row.status == "ok" else f"{row.status}: {row.reason}"
            print(f"    {done}", file=sys.stderr, flush=True)
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse options; unset sizes take the full-run or ``--quick`` default."""
    p = common.parser("benchmarks.run", __doc__, SIZED, "report.md, report.json and report.png")
    p.add_argument("--set", choices=SETS, default="fixed", help="data set (default: fixed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", type=names(LOADERS), default=[], help=f"comma list of {', '.join(LOADERS)}")
    p.add_argument(
        "--sweep",
        action=argparse.BooleanOptionalAction,
        help="threadloader rows over --threads x --batch-sizes (default: on, off for --quick)",
    )
    p.add_argument("--threads", type=common.ints, default=[2, 4, 8, 12, 16], help="sweep num_threads")
    p.add_argument("--batch-sizes", type=common.ints, default=[32, 64, 128, 256], help="sweep batch sizes")
    p.add_argument("--ceiling-batch-sizes", type=common.ints, default=[64, 256])
    p.add_argument("--backends", type=names(loaders.BACKENDS), default=list(loaders.BACKENDS))
    p.add_argument(
        "--threadloader-options",
        type=common.threadloader_options,
        default={},
        metavar="NAME=VALUE,...",
        help="more ThreadLoader keyword arguments for every threadloader row, e.g. "
        "'decode_threads=2,backend=cuda' (values are Python literals, else strings); shown in the row names",
    )
    # internal: measure this one row here and print it as JSON (what each row's process runs)
    p.add_argument("--_row", dest="row", help=argparse.SUPPRESS)
    p.add_argument(
        "--augment",
        action="store_true",
        help="RandomResizedCrop + flip + normalize (training augmentation) instead of resize, and a "
        "threadloader row decoding whole images instead of crop regions",
    )
    p.add_argument("--normalize", action="store_true", help="normalize with ImageNet's mean and std")
    args = common.parse(p, argv, SIZED)
    args.normalize = args.normalize or args.augment
    args.sweep = not args.quick if args.sweep is None else args.sweep
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def main(argv: Sequence[str] | None = None) -> list[Result] | Row:
    """Build or reuse the data set, measure every selected row, print and write the report.

    With ``--_row NAME`` (what :func:`measure_rows` runs): measure that one row here, print it as JSON.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    root = ensure_dataset(args.set, count=args.count, root=args.data_root, seed=args.seed)
    selected = cases(args, root)
    if args.row is not None:
        case = next((c for c in selected if c.name == args.row), None)
        if case is None:
            raise SystemExit(
                f"no row named {args.row!r} with these options; rows: {[c.name for c in selected]}"
            )
        row = measure(case, device=args.device, warmup=args.warmup, batches=args.batches)
        print(json.dumps(asdict(row)))
        return row
    common.warm_page_cache(list_images(root))
    results = measure_rows(selected, args, argv)
    config = {
        "mode": "throughput",
        "augment": args.augment,
        "normalize": args.normalize,
        "set": args.set,
        "count": args.count,
        "output_size": "x".join(map(str, OUTPUT_SIZE[args.set])),
        "warmup": args.warmup,
        "batches": args.batches,
        "repeats": args.repeats,
        "device": args.device,
        "data": str(root),
    }
    if args.threadloader_options:
        config["threadloader_options"] = args.threadloader_options
    # The hardware after the rows: no CUDA context in this process while they run.
    data = results_json(
        results,
        command=common.command_line("benchmarks.run", argv),
        hardware=common.hardware(args.device),
        config=config,
    )
    print(write(data, args.out))
    return results


if __name__ == "__main__":
    main()
