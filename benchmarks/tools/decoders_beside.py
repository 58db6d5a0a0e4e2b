"""nvImageCodec Decoders alone and beside a graphed training step: which backend keeps its speed.

Usage: ``python -m benchmarks.tools.decoders_beside [--sets varied,fixed] [--count 1000]
[--configs 'all;HYBRID_CPU_GPU,HYBRID_CPU_GPU;...'] [--chunks 32,64] [--no-beside] [--out FILE]``.
Needs a CUDA device.

Each configuration is a list of Decoders, one thread each, with their backends (:func:`backends`:
``all``, ``split-F``, ``adaptive-F``, or a backend kind's name), pulling chunks of
``--chunks`` images from one shared queue of in-memory JPEGs (two passes over the set); images the JPEG
engine (``HW_GPU_ONLY``) refuses, progressive and grayscale ones, go back on the queue for the other
threads. Images per second over the whole run, first alone, then (four passes) while the main thread
replays the ResNet-50 step of ``benchmarks.train_step`` captured in a CUDA graph, on a fixed tensor, as
fast as it can; ``step_ratio`` is the step's speed beside the Decoders over its speed alone. The
decision it informs: ``backend="auto"`` leaves the JPEG engine out (docs/design.md, "Decoder engines").
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import hardware
from benchmarks.datasets import OUTPUT_SIZE, ensure_dataset, list_images
from benchmarks.train_step import make_step, random_batch

#: The backend kind whose refusals go back on the queue.
ENGINE = "HW_GPU_ONLY"


def backends(nv: Any, spec: str) -> list[Any] | None:
    """The backends of an nvImageCodec Decoder, by name.

    ``all``: nvImageCodec's defaults, every backend (the library's ``backend="all"``); ``split-F``: the
    hardware engine takes a fraction F of each batch (fixed), the CUDA and hybrid decoders the rest;
    ``adaptive-F``: the same, balanced by nvImageCodec to minimize idle time; or one backend kind's name.
    """
    if spec == "all":
        return None
    policy_of = {"split": nv.LoadHintPolicy.FIXED, "adaptive": nv.LoadHintPolicy.ADAPTIVE_MINIMIZE_IDLE_TIME}
    kind, _, share = spec.partition("-")
    if kind in policy_of:
        return [
            nv.Backend(nv.BackendKind.HW_GPU_ONLY, load_hint=float(share), load_hint_policy=policy_of[kind]),
            nv.Backend(nv.BackendKind.GPU_ONLY, load_hint=1.0),
            nv.Backend(nv.BackendKind.HYBRID_CPU_GPU, load_hint=1.0),
        ]
    return [nv.Backend(getattr(nv.BackendKind, kind))]


class _Queue:
    """Chunks of images for the threads of one configuration, and what the JPEG engine gave back."""

    def __init__(self, blobs: list[bytes], chunk: int, passes: int, engines: int, others: bool) -> None:
        self._lock = threading.Lock()
        self._chunks = [blobs[i : i + chunk] for _ in range(passes) for i in range(0, len(blobs), chunk)]
        self._next = 0
        self._refused: list[list[bytes]] = []
        self._engines_left = engines if others else 0  # the others wait for refusals until these end

    def take(self, engine: bool) -> list[bytes] | None:
        """The next chunk (refusals first, for threads other than the engine's), ``None`` at the end."""
        while True:
            with self._lock:
                if not engine and self._refused:
                    return self._refused.pop()
                if self._next < len(self._chunks):
                    self._next += 1
                    return self._chunks[self._next - 1]
                if engine or self._engines_left == 0:
                    return None
            time.sleep(0.0005)

    def refuse(self, chunk: list[bytes]) -> None:
        with self._lock:
            self._refused.append(chunk)

    def engine_done(self) -> None:
        with self._lock:
            self._engines_left = max(0, self._engines_left - 1)


def _run(
    nv: Any,
    decoders: list[Any],
    kinds: list[str],
    blobs: list[bytes],
    *,
    chunk: int,
    passes: int,
    step: Callable[[], None] | None,
    priority: int = 0,
) -> tuple[float, int, int, float]:
    """Decodes ``passes`` over ``blobs``; returns (images/s, images decoded, steps run, seconds)."""
    params = nv.DecodeParams(apply_exif_orientation=True, color_spec=nv.SRGB, sample_format=nv.I_RGB)
    engines = sum(kind == ENGINE for kind in kinds)
    others = engines < len(kinds)
    queue = _Queue(blobs, chunk, passes, engines, others)
    counts = [0] * len(kinds)
    streams = [torch.cuda.Stream(priority=priority) for _ in kinds]

    def work(i: int) -> None:
        engine = kinds[i] == ENGINE
        try:
            while (items := queue.take(engine)) is not None:
                outs = decoders[i].decode(items, params=params, cuda_stream=streams[i].cuda_stream)
                refused = [data for data, out in zip(items, outs, strict=True) if out is None]
                counts[i] += len(items) - len(refused)
                if refused and engine and others:
                    queue.refuse(refused)
        finally:
            if engine:
                queue.engine_done()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(kinds))]
    torch.cuda.synchronize()
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    steps = 0
    while step is not None and any(thread.is_alive() for thread in threads):
        step()
        steps += 1
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return sum(counts) / seconds, sum(counts), steps, seconds


def _graphed_step() -> tuple[Callable[[], None], float]:
    """The graphed ResNet-50 step on a fixed tensor, and its milliseconds alone."""
    size = OUTPUT_SIZE["varied"]
    step = make_step(device="cuda", batch_size=64, size=size, kind="graphed")
    fixed = random_batch(device="cuda", batch_size=64, size=size)
    for _ in range(5):
        step(fixed)
    started = time.perf_counter()
    for _ in range(30):
        step(fixed)
    return (lambda: step(fixed)), (time.perf_counter() - started) / 30 * 1e3


def rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per set, configuration and chunk size."""
    from nvidia import nvimgcodec as nv

    step, step_ms = (None, 0.0) if args.no_beside else _graphed_step()
    if step is not None:
        print(f"graphed step alone: {step_ms:.2f} ms", flush=True)
    found: list[dict[str, Any]] = []
    for name in args.sets.split(","):
        root = ensure_dataset(name, count=args.count)
        blobs = [path.read_bytes() for path, _ in list_images(root)][: args.count]
        for config in args.configs.split(";"):
            kinds = config.split(",")
            sharing = sum(kind != ENGINE for kind in kinds) or 1  # the engine's threads use little CPU
            decoders = [
                nv.Decoder(
                    device_id=0,
                    max_num_cpu_threads=max(2, args.cpu // sharing),
                    backends=backends(nv, k),
                    options=args.options,
                )
                for k in kinds
            ]
            for decoder in decoders:  # warm-up
                decoder.decode(blobs[:64], cuda_stream=torch.cuda.current_stream().cuda_stream)
            for chunk in (int(c) for c in args.chunks.split(",")):
                rate, decoded, _, _ = _run(
                    nv, decoders, kinds, blobs, chunk=chunk, passes=2, step=None, priority=args.priority
                )
                row: dict[str, Any] = {
                    "set": name,
                    "config": config,
                    "chunk": chunk,
                    "options": args.options,
                    "priority": args.priority,
                    "alone": round(rate),
                }
                line = f"{name:6} {config:40} chunk {chunk:3}: alone {rate:8,.0f} img/s ({decoded})"
                if step is not None:
                    rate, decoded, steps, seconds = _run(
                        nv, decoders, kinds, blobs, chunk=chunk, passes=4, step=step, priority=args.priority
                    )
                    ms = seconds / max(1, steps) * 1e3
                    row |= {
                        "beside": round(rate),
                        "step_ms": round(ms, 2),
                        "step_ratio": round(step_ms / ms, 3),
                    }
                    line += f" | beside {rate:8,.0f} img/s, step {ms:.1f} ms ({step_ms / ms:.2f}x)"
                print(line, flush=True)
                found.append(row)
            del decoders
    return found


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="varied,fixed")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument(
        "--configs",
        default="all;all,all;split-0.65;HW_GPU_ONLY;HYBRID_CPU_GPU;HYBRID_CPU_GPU,HYBRID_CPU_GPU;"
        "HW_GPU_ONLY,HYBRID_CPU_GPU;HW_GPU_ONLY,HYBRID_CPU_GPU,HYBRID_CPU_GPU",
        help="';'-separated configurations, each a ','-separated list of one Decoder's backends per thread",
    )
    p.add_argument("--chunks", default="32,64", help="images per decode call")
    p.add_argument(
        "--cpu", type=int, default=14, help="nvImageCodec CPU threads, shared by the non-engine Decoders"
    )
    p.add_argument("--options", default="", help="nvImageCodec's options string for every Decoder")
    p.add_argument(
        "--priority", type=int, default=0, help="CUDA stream priority of the decode calls (-1: high)"
    )
    p.add_argument("--no-beside", action="store_true", help="only alone, no training step")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.tools.decoders_beside needs a CUDA device (nvImageCodec on a GPU)", file=sys.stderr)
        return 1
    found = rows(args)
    if args.out:
        args.out.write_text(json.dumps({"hardware": hardware("cuda"), "rows": found}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
