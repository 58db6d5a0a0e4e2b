"""Where a fresh process's first batches go, and what the loader's start leaves in device memory.

Usage: ``python -m benchmarks.tools.first_batch [--device cuda] [--count 256] [--pause 1] [--batches 4]``
(once per process: only a process's first loader starts nvImageCodec; run it several times).

In this process: torch's CUDA context and a small step made first, as a training script's model would
be; then a ThreadLoader over the varied set, resized to 224x224, float32, normalized, channels_last
(the training rows' ``resize`` pipeline), a ``--pause`` standing for the script's own set-up, and its
first ``--batches`` batches. While the consumer waits for the first one, every thread's stack is
sampled every ``--interval`` milliseconds (each sample takes the GIL, so keep it coarse). Prints one
JSON object: the constructor's seconds, the first batch's after the pause (its data ready), the next
batches', the loader's stats at the first batch and at the end (``started_on_cpu``: the batches of the
start on the CPU; stage seconds), torch's reserved memory before building and at the end, and per
thread the frames seen most often: its innermost one, and the innermost one of threadloader's.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from benchmarks.datasets import OUTPUT_SIZE, ensure_dataset
from benchmarks.loaders import IMAGENET_MEAN, IMAGENET_STD


def _where(frame: FrameType | None, package: str) -> tuple[str, str]:
    """A stack's innermost frame, and the innermost one in ``package``'s files (or ``""``)."""
    innermost, ours = "", ""
    while frame is not None:
        code = frame.f_code
        here = f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}"
        innermost = innermost or here
        if not ours and code.co_filename.startswith(package):
            ours = here
        frame = frame.f_back
    return innermost, ours


class _Sampler:
    """Every other thread's stack, every ``interval`` seconds, from a thread of its own until stopped."""

    def __init__(self, interval: float, package: str) -> None:
        self.samples: list[tuple[float, str, tuple[str, str]]] = []
        self._interval, self._package, self._stop = interval, package, threading.Event()
        self._thread = threading.Thread(target=self._run, name="first-batch-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self._interval):
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            now = time.perf_counter()
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.samples.append((now, names.get(ident, str(ident)), _where(frame, self._package)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self, start: float, end: float, top: int = 6) -> dict[str, dict[str, int]]:
        """Per thread, its ``top`` most seen frames between ``start`` and ``end`` (``innermost <- ours``)."""
        seen: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for when, name, (innermost, ours) in self.samples:
            if start <= when <= end:
                seen[name][f"{innermost} <- {ours}" if ours and ours != innermost else innermost] += 1
        return {name: dict(counter.most_common(top)) for name, counter in sorted(seen.items())}


def measure(
    root: Path, *, device: str, batch_size: int, pause: float, batches: int, interval: float
) -> dict[str, Any]:
    """One loader's first batches in this process; see the module's docstring."""
    import threadloader
    from threadloader import ThreadLoader

    cuda = device == "cuda"
    model = torch.nn.Linear(512, 512).to(device)  # the script's model: the CUDA context, a step's kernels
    model(torch.randn(batch_size, 512, device=device)).sum().backward()
    if cuda:
        torch.cuda.synchronize()
    reserved_before = torch.cuda.memory_reserved() if cuda else 0
    sampler = _Sampler(interval, package=str(Path(threadloader.__file__).parent))
    try:
        started = time.perf_counter()
        loader = ThreadLoader(
            root,
            batch_size=batch_size,
            drop_last=True,
            size=OUTPUT_SIZE["varied"],
            dtype=torch.float32,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
            device=device,
            channels_last=True,
        )
        with loader:
            built = time.perf_counter()
            time.sleep(pause)
            asked = time.perf_counter()
            iterator = iter(loader)
            next(iterator)
            if cuda:
                torch.cuda.current_stream().synchronize()
            first = time.perf_counter()
            at_first = loader.stats()
            for _ in range(batches - 1):
                next(iterator)
            if cuda:
                torch.cuda.current_stream().synchronize()
            ended = time.perf_counter()
            at_end = loader.stats()
    finally:
        sampler.stop()
    return {
        "device": device,
        "build_s": round(built - started, 4),
        "first_batch_s": round(first - asked, 4),
        "next_batches_s": round(ended - first, 4),
        "stats_at_first_batch": asdict(at_first),
        "stats_at_end": asdict(at_end),
        "torch_reserved_mb": {
            "before": round(reserved_before / 2**20, 1),
            "at_end": round((torch.cuda.memory_reserved() if cuda else 0) / 2**20, 1),
        },
        "threads_while_building_and_pausing": sampler.summary(started, asked),
        "threads_while_waiting_for_the_first_batch": sampler.summary(asked, first),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--count", type=int, default=256, help="images in the varied set")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--pause", type=float, default=1.0, help="seconds between building and iterating")
    p.add_argument("--batches", type=int, default=4, help="batches taken, the first included")
    p.add_argument("--interval", type=float, default=2.0, help="milliseconds between stack samples")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks.tools.first_batch --device cuda needs a CUDA device (or pass --device cpu)")
    if args.batches < 1 or args.count < args.batch_size * args.batches:
        sys.exit(f"need --batches >= 1 and --count >= batch size x batches, got {args.batches}, {args.count}")
    root = ensure_dataset("varied", count=args.count)
    result = measure(
        root,
        device=args.device,
        batch_size=args.batch_size,
        pause=args.pause,
        batches=args.batches,
        interval=args.interval / 1000,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
