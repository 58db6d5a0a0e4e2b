"""A ThreadLoader's host time per stage beside a training step, and alone: which stage slows down.

CLI: ``python -m benchmarks.tools.beside_step [--kind graphed] [--augment] [--options JSON]
[--side-stream] [--sched blocking]``. Needs a CUDA device.

One row per call, in its own process: the step of ``benchmarks.train_step`` (ResNet-50, batch 64) on a
fixed tensor, then fed by a ThreadLoader over the varied set (``--options`` adds keyword arguments,
say ``'{"gpu_decoders": 4}'``); ``loader.stats()``'s host milliseconds per batch for each stage (summed
over reader threads), beside the step and then for as many batches alone. ``--side-stream`` runs the
step on a stream of its own instead of the default one; ``--sched`` sets the CUDA context's host
scheduling (``spin``, ``yield``, ``blocking``) before anything makes it: two questions about why the
decoder slows down beside a graphed step. ``peak_torch_mb`` is torch's peak above the step's own;
``readers_busy_*`` the share of the reader threads' time spent in a timed stage.
Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from benchmarks.common import IMAGENET_MEAN, IMAGENET_STD, endless
from benchmarks.datasets import OUTPUT_SIZE, ensure_dataset
from benchmarks.loaders import augmentation
from benchmarks.train_step import make_step, random_batch
from threadloader import LoaderStats, ThreadLoader

#: Batches taken untimed before the loader is timed alone: more than its readers hold ready by default.
_DRAIN = 8

#: ``CU_CTX_SCHED_*``: how the host waits for the GPU (the driver's default is ``auto``).
SCHED = {"spin": 1, "yield": 2, "blocking": 4}


def set_scheduling(name: str) -> None:
    """Sets the primary context's scheduling flags, before torch or nvImageCodec makes the context."""
    cuda = ctypes.CDLL("libcuda.so.1")
    device = ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0):
        raise RuntimeError("the CUDA driver did not start")
    if cuda.cuDevicePrimaryCtxSetFlags_v2(device, SCHED[name]):
        raise RuntimeError(f"could not set the context's scheduling to {name!r}")


def _per_batch(before: LoaderStats, after: LoaderStats, batches: int) -> dict[str, float]:
    return {
        stage: round((after.stage_seconds[stage] - before.stage_seconds[stage]) / batches * 1e3, 2)
        for stage in before.stage_seconds
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The row: the step's time on a fixed tensor and fed by the loader, stages beside it and alone."""
    size, steps = OUTPUT_SIZE["varied"], args.steps
    root = ensure_dataset("varied", count=args.count)
    step = make_step(device="cuda", batch_size=64, size=size, kind=args.kind)
    side = torch.cuda.Stream() if args.side_stream else None

    def run_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        if side is None:
            step(batch)
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for tensor in batch:
                tensor.record_stream(side)
            step(batch)

    fixed = random_batch(device="cuda", batch_size=64, size=size)
    for _ in range(5):
        run_step(fixed)
    started = time.perf_counter()
    for _ in range(steps):
        run_step(fixed)
    fixed_ms = (time.perf_counter() - started) / steps * 1e3
    torch.cuda.reset_peak_memory_stats()
    run_step(fixed)
    step_peak = torch.cuda.max_memory_allocated()  # the step's own, as benchmarks.training takes it
    options: dict[str, Any] = {
        "batch_size": 64,
        "drop_last": True,
        "size": None if args.augment else size,
        "dtype": torch.float32,
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        "device": "cuda",
        "channels_last": True,
        "transform": augmentation(size) if args.augment else None,
        **json.loads(args.options),
    }
    with ThreadLoader(root, **options) as loader:
        batches: Iterator[tuple[Any, Any]] = endless(loader)  # sized images: one tensor a batch
        for _ in range(15):
            images, targets = next(batches)
            run_step((images, targets.cuda()))
        before, started, waited = loader.stats(), time.perf_counter(), 0.0
        for _ in range(steps):
            asked = time.perf_counter()
            images, targets = next(batches)
            waited += time.perf_counter() - asked
            run_step((images, targets.cuda()))
        wall = time.perf_counter() - started
        beside = _per_batch(before, loader.stats(), steps)
        for _ in range(_DRAIN):  # what the readers made ahead while the step ran is not "alone"
            next(batches)
        torch.cuda.synchronize()
        before, started = loader.stats(), time.perf_counter()
        for _ in range(steps):
            next(batches)
        torch.cuda.synchronize()
        alone_s = time.perf_counter() - started
        alone = _per_batch(before, loader.stats(), steps)
        readers = loader.num_threads
    step_ms = wall / steps * 1e3
    return {
        "options": args.options,
        "kind": args.kind,
        "augment": args.augment,
        "side_stream": args.side_stream,
        "sched": args.sched,
        "fixed_ms": round(fixed_ms, 2),
        "step_ms": round(step_ms, 2),
        "ratio": round(fixed_ms / step_ms, 3),
        "wait": round(waited / wall, 3),
        "alone_img_s": round(64 * steps / alone_s),
        "peak_torch_mb": round((torch.cuda.max_memory_allocated() - step_peak) / 2**20),
        "beside_ms_per_batch": beside,
        "alone_ms_per_batch": alone,
        # The share of the readers' time inside a timed stage: well below 1 while the consumer waits
        # for data, the readers wait for something no stage times (the window, a lock).
        "readers_busy_beside": _busy(beside, readers, step_ms),
        "readers_busy_alone": _busy(alone, readers, alone_s / steps * 1e3),
        # The share of their time the readers sat with the prefetch window full (see STAGES).
        "readers_ahead_beside": round(beside["ahead"] / (readers * step_ms), 3),
    }


def _busy(stages: dict[str, float], readers: int, batch_ms: float) -> float:
    """Reader milliseconds in working stages per reader millisecond.

    ``ahead`` is the readers idle with the window full, ``wait`` the consumer's own time, neither work.
    """
    work = sum(ms for stage, ms in stages.items() if stage not in ("ahead", "wait"))
    return round(work / (readers * batch_ms), 3)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("eager", "graphed"), default="graphed")
    p.add_argument("--augment", action="store_true", help="RandomResizedCrop + flip instead of a resize")
    p.add_argument("--options", default="{}", help="more ThreadLoader keyword arguments, as JSON")
    p.add_argument("--steps", type=int, default=40, help="batches beside the step, then alone")
    p.add_argument("--count", type=int, default=1000, help="images in the varied set")
    p.add_argument("--side-stream", action="store_true", help="run the step on a stream of its own")
    p.add_argument("--sched", choices=sorted(SCHED), help="the CUDA context's host scheduling")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    message = "benchmarks.tools.beside_step needs a CUDA device (it feeds a GPU training step)"
    try:
        if args.sched:  # before torch makes the context
            set_scheduling(args.sched)
    except (OSError, RuntimeError) as exc:
        print(f"{message}: {exc}", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print(message, file=sys.stderr)
        return 1
    print("RESULT", json.dumps(measure(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
