"""Measure every loader on the same data with the same method; write report.md/json/png.

Usage: ``python -m benchmarks.run [--set fixed|varied] [--quick] [--training] [--out DIR] ...``

Method, identical for every row: build the loader (``startup_s`` runs from construction to the first
batch whose data is ready), take ``--warmup`` batches, then time ``--batches`` batches, the consumer
synchronizing the current CUDA stream after each one as a training step would. ``--training``
replaces that wait with a ResNet-50 step and reports the share of time blocked on the loader.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

import PIL
import torch

from benchmarks import loaders
from benchmarks.datasets import OUTPUT_SIZE, SETS, ensure_dataset, list_images
from benchmarks.loaders import Batch, SkipRow
from benchmarks.report import Report, Row, markdown, write
from benchmarks.train_step import make_step

Step = Callable[[Batch], None]
"""What the consumer does with each batch; it must return only once the batch is consumed."""

LOADERS = (
    "pil_dataloader",
    "spawn_collate_nvimgcodec",
    "single_decoder_ceiling",
    "torchvision_gpu",
    "threadloader",
)

_DEFAULTS = {  # option: (full run, --quick)
    "count": (2000, 64),
    "batches": (200, 5),
    "warmup": (20, 1),
    "batch_size": (64, 16),
    "workers": (8, 2),
}


@dataclass(frozen=True)
class Case:
    """One row to measure: ``make()`` returns the loader's (not yet started) batch generator."""

    name: str
    loader: str
    batch_size: int
    make: Callable[[], Iterator[Batch]]


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


def record_failure(row: Row | Any, error: Exception) -> None:
    """Marks a row skipped (a :class:`SkipRow`) or failed (traceback printed, first line kept).

    One broken loader must not end a run that measures the others.
    """
    if isinstance(error, SkipRow):
        row.status, row.reason = "skipped", str(error)
        return
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
    row = Row(name=case.name, loader=case.loader, batch_size=case.batch_size)
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
    """The rows selected by the options, all reading the same files."""
    files = list_images(root)
    common = {"size": OUTPUT_SIZE[args.set], "device": args.device}
    b, w = args.batch_size, args.workers
    pipeline = {"augment": args.augment, "normalize": args.normalize}  # the PIL and threadloader rows'
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
            partial(loaders.spawn_collate_nvimgcodec, files, batch_size=b, workers=w, **common),
        ),
        *(
            Case(
                f"single_decoder_ceiling {backend} b={cb}" + (f" {crop} + crop" if crop else ""),
                "single_decoder_ceiling",
                cb,
                partial(
                    loaders.single_decoder_ceiling, files, batch_size=cb, backend=backend, crop=crop, **common
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
            partial(loaders.torchvision_gpu, files, batch_size=b, **common),
        ),
        Case(
            f"threadloader default threads b={b}",
            "threadloader",
            b,
            partial(loaders.threadloader, root, batch_size=b, num_threads=None, **pipeline, **common),
        ),
    ]
    if args.augment:  # the same pipeline decoding whole images and cropping them: what regions save
        rows.append(
            Case(
                f"threadloader whole decode + crop b={b}",
                "threadloader",
                b,
                partial(
                    loaders.threadloader,
                    root,
                    batch_size=b,
                    num_threads=None,
                    region_decode=False,
                    **pipeline,
                    **common,
                ),
            )
        )
    if args.sweep:
        rows += [
            Case(
                f"threadloader t={t} b={sb}",
                "threadloader",
                sb,
                partial(loaders.threadloader, root, batch_size=sb, num_threads=t, **pipeline, **common),
            )
            for t in args.threads
            for sb in args.batch_sizes
        ]
    # The forked DataLoader row runs last: on an H200, after it had run in the process, nvImageCodec's
    # hybrid backend failed 114 of 128 region decodes that succeed in a fresh process.
    rows.sort(key=lambda case: case.loader == "pil_dataloader")
    return [c for c in rows if not args.only or c.loader in args.only]


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
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nvimgcodec": version("nvidia-nvimgcodec-cu12", "nvidia-nvimgcodec-cu13", "nvidia-nvimgcodec-cu11"),
        "torchvision": version("torchvision"),
        "pillow": PIL.__version__,
        "threadloader": getattr(sys.modules.get("threadloader"), "__version__", None),
    }


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
    return args


def main(argv: Sequence[str] | None = None) -> Report:
    """Build or reuse the data set, measure every selected row, print and write the report."""
    args = parse_args(argv)
    root = ensure_dataset(args.set, count=args.count, root=args.data_root, seed=args.seed)
    for path, _ in list_images(root):  # warm the page cache so the first row does not pay for it
        path.read_bytes()
    make_step = _train_step(args.device, OUTPUT_SIZE[args.set]) if args.training else _wait_step(args.device)
    selected = cases(args, root)
    rows = []
    for i, case in enumerate(selected, 1):
        print(f"[{i}/{len(selected)}] {case.name} ...", file=sys.stderr, flush=True)
        row = measure(case, device=args.device, warmup=args.warmup, batches=args.batches, make_step=make_step)
        rows.append(row)
        done = f"{row.images_per_s:,.0f} img/s" if row.status == "ok" else f"{row.status}: {row.reason}"
        print(f"    {done}", file=sys.stderr, flush=True)
    report = Report(
        hardware=hardware(args.device),  # after the rows, so the loaders' packages are imported
        config={
            "mode": "training" if args.training else "throughput",
            "augment": args.augment,
            "normalize": args.normalize,
            "set": args.set,
            "count": args.count,
            "output_size": "x".join(map(str, OUTPUT_SIZE[args.set])),
            "warmup": args.warmup,
            "batches": args.batches,
            "device": args.device,
            "data": str(root),
        },
        rows=rows,
    )
    print(markdown(report))
    if args.out:
        for path in write(report, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
