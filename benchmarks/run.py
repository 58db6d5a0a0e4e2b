"""Measure every loader on the same data with the same method; write report.md/json/png.

Usage: ``python -m benchmarks.run [--set fixed|varied] [--quick] [--training] [--out DIR] ...``

Method, identical for every row: each repeat of each row runs in a fresh process (``--repeats``,
the rows interleaved), so nothing an earlier row cached (nvImageCodec decoders, a CUDA context,
imported modules) makes a later row's start-up or memory look smaller. In that process: build the
loader (``startup_s`` runs from construction to the first batch whose data is ready), take
``--warmup`` batches, then time ``--batches`` batches, the consumer synchronizing the current CUDA
stream after each one as a training step would. ``--training`` replaces that wait with a ResNet-50
step and reports the share of time blocked on the loader. The report gives each row's median over
its repeats, with min and max.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import importlib.util
import json
import os
import platform
import re
import resource
import shlex
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

import PIL
import torch

from benchmarks import loaders
from benchmarks.datasets import OUTPUT_SIZE, SETS, ensure_dataset, list_images
from benchmarks.loaders import Batch, SkipRow
from benchmarks.report import Report, Result, Row, markdown, write
from benchmarks.train_step import make_step

Step = Callable[[Batch], None]
"""What the consumer does with each batch; it must return only once the batch is consumed."""

LOADERS = (
    "pil_dataloader",
    "spawn_collate_nvimgcodec",
    "single_decoder_ceiling",
    "torchvision_gpu",
    "dali",
    "threadloader",
)
GPU_ONLY = frozenset({"spawn_collate_nvimgcodec", "single_decoder_ceiling", "torchvision_gpu"})

_DEFAULTS = {  # option: (full run, --quick)
    "count": (2000, 64),
    "batches": (200, 5),
    "warmup": (20, 1),
    "batch_size": (64, 16),
    "workers": (8, 2),
    "repeats": (3, 1),
    "row_timeout": (300.0, 120.0),
}


@dataclass(frozen=True)
class Case:
    """One row to measure: ``make()`` returns the loader's (not yet started) batch generator."""

    name: str
    loader: str
    batch_size: int
    make: Callable[[], Generator[Batch, None, None]]


def _sync(device: str) -> None:
    """Wait until the work queued on the current stream (the batch's data) is done."""
    if device == "cuda":
        torch.cuda.current_stream().synchronize()


def _release(device: str) -> None:
    """Free what the previous row left so each row starts from the same memory baseline."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def cpu_seconds() -> float:
    """CPU time of this process, its reaped children and its live descendants.

    ``RUSAGE_CHILDREN`` only counts children that have exited, so live DataLoader workers are
    read from ``/proc`` (Linux; elsewhere they are missed until they exit).
    """
    total = sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while scanning
            continue
        fields = text[text.rfind(")") + 2 :].split()  # the command name may contain spaces
        pid = int(stat.parent.name)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
    found: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return total + sum(cpu[pid] for pid in found)


class DeviceMemory:
    """Peak device-wide memory in use, sampled from a thread every ``period_s``.

    Uses ``cudaMemGetInfo`` rather than torch's allocator stats so that memory held by worker
    processes (their CUDA contexts, IPC buffers) and by nvImageCodec's own allocations counts too.
    """

    def __init__(self, device: str, *, period_s: float = 0.05) -> None:
        self._enabled = device == "cuda"
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="mem-sampler", daemon=True)
        self._base = self._peak = 0

    @staticmethod
    def _used() -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _sample(self) -> None:
        while not self._stop.wait(self._period_s):
            self._peak = max(self._peak, self._used())

    def start(self) -> None:
        if self._enabled:
            self._base = self._peak = self._used()
            self._thread.start()

    def stop(self) -> float | None:
        """Stop sampling; return the peak above the starting level in MB (None on CPU)."""
        if not self._enabled or not self._thread.is_alive():
            return None
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._used())
        return (self._peak - self._base) / 2**20


def _take(stream: Iterator[Batch], step: Step, count: int) -> tuple[int, float]:
    """Consume ``count`` batches; return the images seen and the seconds spent blocked in ``next()``.

    A function of its own so no batch outlives it: CUDA IPC batches must be released before the
    workers that produced them are shut down.
    """
    images, waited = 0, 0.0
    for _ in range(count):
        start = time.perf_counter()
        batch = next(stream)
        waited += time.perf_counter() - start
        step(batch)
        images += batch[0].shape[0]
    return images, waited


class RowProcessError(Exception):
    """A row's process crashed, hung or printed no result; its own stderr holds the details."""


def record_failure(row: Row | Any, error: Exception) -> None:
    """Marks a row skipped (a :class:`SkipRow`) or failed (traceback printed, first line kept).

    One broken loader must not end a run that measures the others.
    """
    if isinstance(error, SkipRow):
        row.status, row.reason = "skipped", str(error)
        return
    if not isinstance(error, RowProcessError):  # its traceback is the child's, already printed
        traceback.print_exc()
    row.status, row.reason = "failed", f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def measure(case: Case, *, device: str, warmup: int, batches: int, make_step: Callable[[int], Step]) -> Row:
    """Run one case with the shared method; never raises for a skipped or failing loader.

    Args:
        case: The loader configuration.
        device: ``"cuda"`` or ``"cpu"``.
        warmup: Batches consumed after the first and before timing.
        batches: Timed batches.
        make_step: Builds the consumer for a batch size, outside the timed and memory windows.
    """
    row = Row(name=case.name, loader=case.loader, batch_size=case.batch_size, pid=os.getpid())
    _release(device)
    stream = case.make()
    memory = DeviceMemory(device)
    try:
        step = make_step(case.batch_size)
        reserved = 0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            reserved = torch.cuda.memory_reserved()
        memory.start()
        start = time.perf_counter()
        next(stream)
        _sync(device)
        row.startup_s = time.perf_counter() - start
        _take(stream, step, warmup)
        cpu0, start = cpu_seconds(), time.perf_counter()
        row.images, waited = _take(stream, step, batches)
        wall = time.perf_counter() - start
        row.cpu_cores = (cpu_seconds() - cpu0) / wall
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


def _wait_step(device: str) -> Callable[[int], Step]:
    """Throughput mode: the consumer only waits for each batch's data."""
    return lambda _batch_size: lambda _batch: _sync(device)


def _train_step(device: str, size: tuple[int, int]) -> Callable[[int], Step]:
    """Training mode: a fresh ResNet-50 (channels_last, bf16 autocast, SGD) per row, eager steps.

    ``make_step`` runs a step on random data before the row, so weights, optimizer state and cuDNN
    workspaces are in the memory baseline and the row's extra memory is the loader's own.
    """
    return lambda batch_size: make_step(device=device, batch_size=batch_size, size=size)


def cases(args: argparse.Namespace, root: Path) -> list[Case]:
    """The rows selected by the options, all reading the same files and delivering the same output."""
    files = list_images(root)
    common = {"size": OUTPUT_SIZE[args.set], "device": args.device}
    b, w = args.batch_size, args.workers
    pipeline = {"augment": args.augment, "normalize": args.normalize}
    options = args.threadloader_options
    named = "".join(f" {key}={value!r}" for key, value in options.items())  # ThreadLoader rows only

    def ours(name: str, batch_size: int, **kwargs: Any) -> Case:
        return Case(
            f"threadloader {name} b={batch_size}{named}",
            "threadloader",
            batch_size,
            partial(loaders.threadloader, root, batch_size=batch_size, options=options, **kwargs, **common),
        )

    rows = [
        Case(
            f"pil_dataloader w={w} b={b}",
            "pil_dataloader",
            b,
            partial(loaders.pil_dataloader, files, batch_size=b, workers=w, **pipeline, **common),
        ),
        Case(
            f"spawn_collate_nvimgcodec w={w} b={b}",
            "spawn_collate_nvimgcodec",
            b,
            partial(loaders.spawn_collate_nvimgcodec, files, batch_size=b, workers=w, **pipeline, **common),
        ),
        *(
            Case(
                f"single_decoder_ceiling {backend} b={cb}" + (f" {crop} + crop" if crop else ""),
                "single_decoder_ceiling",
                cb,
                partial(
                    loaders.single_decoder_ceiling,
                    files,
                    batch_size=cb,
                    backend=backend,
                    crop=crop,
                    normalize=args.normalize,
                    **common,
                ),
            )
            for backend in args.backends
            for cb in args.ceiling_batch_sizes
            # --augment: decoding a random crop's region against decoding the whole image and cropping
            for crop in (("whole", "region") if args.augment else (None,))
        ),
        Case(
            f"torchvision_gpu b={b}",
            "torchvision_gpu",
            b,
            partial(loaders.torchvision_gpu, files, batch_size=b, **pipeline, **common),
        ),
        Case(
            f"dali w={w} b={b}",
            "dali",
            b,
            partial(loaders.dali, root, batch_size=b, workers=w, **pipeline, **common),
        ),
        ours("default threads", b, num_threads=None, **pipeline),
    ]
    if args.augment:  # the same pipeline decoding whole images and cropping them: what regions save
        rows.append(ours("whole decode + crop", b, num_threads=None, region_decode=False, **pipeline))
    if args.sweep:
        rows += [
            ours(f"t={t}", sb, num_threads=t, **pipeline) for t in args.threads for sb in args.batch_sizes
        ]
    # The forked DataLoader row runs last: on an H200, after it had run in the process, nvImageCodec's
    # hybrid backend failed 114 of 128 region decodes that succeed in a fresh process.
    rows.sort(key=lambda case: case.loader == "pil_dataloader")
    return [c for c in rows if not args.only or c.loader in args.only]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def skip_reason(case: Case, device: str) -> str | None:
    """Rows that cannot run here, decided without starting a process for them.

    The loaders raise :class:`SkipRow` for the same reasons (and others) when they are run anyway.
    """
    if device != "cuda" and case.loader in GPU_ONLY:
        return "needs a CUDA device"
    if case.loader == "dali" and not _installed("nvidia.dali"):
        return "nvidia.dali is not installed"
    return None


def run_child(command: Sequence[str], row: Row, *, timeout: float) -> Row:
    """One repeat of a row in a fresh process: ``command`` prints the :class:`Row` as JSON last.

    A process that crashes, hangs past ``timeout`` seconds or prints no row gives ``row`` back, failed
    with the reason. The child runs in a session of its own, killed whole when it ends, so that no
    DataLoader worker of a crashed or hung row outlives it into the next row; its stderr (progress,
    tracebacks) is passed on.
    """
    timed_out = False
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
        finally:
            with contextlib.suppress(ProcessLookupError):  # the usual case: the whole session has ended
                os.killpg(child.pid, signal.SIGKILL)
    sys.stderr.write(err)
    if timed_out:
        failure: str | None = f"stopped after {timeout:g} s"
    elif child.returncode < 0:
        failure = f"killed by {signal.Signals(-child.returncode).name}"
    elif child.returncode > 0:
        failure = f"exited with {child.returncode}: " + (err.strip().splitlines() or ["no message"])[-1]
    else:
        try:
            return Row(**json.loads(out.strip().splitlines()[-1]))
        except (IndexError, ValueError, TypeError) as e:  # nothing printed, or not a row
            failure = f"printed no row: {type(e).__name__}: {e}"
    record_failure(row, RowProcessError(failure))
    return row


def hardware(device: str) -> dict[str, object]:
    """What the numbers depend on, recorded with them."""

    def version(*dists: str) -> str | None:
        for dist in dists:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return None

    info: dict[str, object] = {}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "gpu_memory_gb": round(props.total_memory / 2**30),
            "cuda": torch.version.cuda,
        }
    return info | {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version() + ("t" if sysconfig.get_config_var("Py_GIL_DISABLED") else ""),
        "gil": sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True,
        "torch": torch.__version__,
        "nvimgcodec": version("nvidia-nvimgcodec-cu12", "nvidia-nvimgcodec-cu13", "nvidia-nvimgcodec-cu11"),
        "torchvision": version("torchvision"),
        "pillow": PIL.__version__,
        "threadloader": getattr(sys.modules.get("threadloader"), "__version__", None),
    }


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that made a report, kept in its JSON so that docs can quote it."""
    return shlex.join(["python", "-m", module, *argv])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        unknown = set(names) - set(choices)
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {sorted(unknown)}; choose from {', '.join(choices)}")
        return names

    return parse


def threadloader_options(text: str) -> dict[str, Any]:
    """``key=value,...`` for every ThreadLoader row: values are Python literals, else plain strings.

    ``gpu_decoders=2,backend=split`` gives ``{"gpu_decoders": 2, "backend": "split"}``; a comma
    inside a value (``size=(1, 2)``) is kept, since pairs split only before ``name=``.
    """
    options: dict[str, Any] = {}
    for item in re.split(r",\s*(?=[A-Za-z_]\w*\s*=)", text.strip()):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key.isidentifier():
            raise argparse.ArgumentTypeError(f"expected name=value pairs separated by commas, got {item!r}")
        if key in loaders.THREADLOADER_ROW_ARGUMENTS:
            raise argparse.ArgumentTypeError(
                f"{key} is set by the rows themselves, as are "
                f"{', '.join(sorted(loaders.THREADLOADER_ROW_ARGUMENTS - {key}))}: use --batch-size, "
                "--threads, --augment or --normalize instead"
            )
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # not a literal: a plain string, as ``backend=split``
            options[key] = value
    return options


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse options; unset sizes take the full-run or ``--quick`` default."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=SETS, help="data set (default: fixed; varied with --training)")
    p.add_argument("--count", type=int, help="images in the set (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-root", type=Path, help="data set cache dir (default: see benchmarks.datasets)")
    p.add_argument("--batches", type=int, help="timed batches (default 200)")
    p.add_argument("--warmup", type=int, help="warm-up batches (default 20)")
    p.add_argument("--batch-size", type=int, help="batch size of the non-sweep rows (default 64)")
    p.add_argument("--workers", type=int, help="DataLoader workers (default 8)")
    p.add_argument("--only", type=_names(LOADERS), default=[], help=f"comma list of {', '.join(LOADERS)}")
    p.add_argument(
        "--sweep",
        action=argparse.BooleanOptionalAction,
        help="threadloader rows over --threads x --batch-sizes (default: on, off for --quick/--training)",
    )
    p.add_argument("--threads", type=_ints, default=[2, 4, 8, 12, 16], help="sweep num_threads")
    p.add_argument("--batch-sizes", type=_ints, default=[32, 64, 128, 256], help="sweep batch sizes")
    p.add_argument("--ceiling-batch-sizes", type=_ints, default=[64, 256])
    p.add_argument("--backends", type=_names(loaders.BACKENDS), default=list(loaders.BACKENDS))
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--out", type=Path, help="write report.md, report.json and report.png here")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (count 64, 5 batches)")
    p.add_argument("--training", action="store_true", help="feed a ResNet-50 training step")
    p.add_argument(
        "--repeats",
        type=int,
        help="fresh processes per row; the report gives the median and min-max (default 3)",
    )
    p.add_argument(
        "--row-timeout", type=float, help="seconds before a row's process is stopped (default 300)"
    )
    p.add_argument(
        "--threadloader-options",
        type=threadloader_options,
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
        help="PIL and threadloader rows: RandomResizedCrop + flip + normalize (training augmentation) "
        "instead of resize, and a threadloader row decoding whole images instead of crop regions",
    )
    p.add_argument(
        "--normalize",
        action="store_true",
        help="PIL and threadloader rows: normalize with ImageNet's mean and std (implied by --augment)",
    )
    args = p.parse_args(argv)
    for name, (full, quick) in _DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.set = args.set or ("varied" if args.training else "fixed")
    args.normalize = args.normalize or args.augment
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.sweep is None:
        args.sweep = not (args.quick or args.training)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


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
            if reason is None:
                command = [sys.executable, "-m", "benchmarks.run", *argv, "--_row", case.name]
                row = run_child(command, row, timeout=args.row_timeout)
            else:
                row.status, row.reason = "skipped", reason
            result.repeats.append(row)
            done = f"{row.images_per_s:,.0f} img/s" if row.status == "ok" else f"{row.status}: {row.reason}"
            print(f"    {done}", file=sys.stderr, flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> Report | Row:
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
        make_step = (
            _train_step(args.device, OUTPUT_SIZE[args.set]) if args.training else _wait_step(args.device)
        )
        row = measure(case, device=args.device, warmup=args.warmup, batches=args.batches, make_step=make_step)
        print(json.dumps(asdict(row)))
        return row
    for path, _ in list_images(root):  # warm the page cache so the first row does not pay for it
        path.read_bytes()
    rows = measure_rows(selected, args, argv)
    report = Report(
        command=command_line("benchmarks.run", argv),
        hardware=hardware(args.device),  # after the rows: no CUDA context in this process while they run
        config={
            "mode": "training" if args.training else "throughput",
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
        | ({"threadloader_options": args.threadloader_options} if args.threadloader_options else {}),
        rows=rows,
    )
    print(markdown(report))
    if args.out:
        for path in write(report, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
