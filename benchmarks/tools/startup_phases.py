"""Where a GPU loader's start-up goes, phase by phase, in this (fresh) process.

Usage: ``python -m benchmarks.tools.startup_phases`` (run it twice: Triton caches its kernels on disk).

Each phase is what a reader thread's first batch would otherwise pay, in the order the background
warm-up (``threadloader._warmup``) meets them: nvImageCodec's library and instance, the C API's
self-test with the first Decoder, the first batch of the resize pipeline (the resampling kernel's first
launch), the first random crops (the region pool's Decoder, the region check, the crop kernel).
Prints one JSON object of seconds per phase.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch


def phases() -> dict[str, float]:
    """Seconds per phase, each timed from the end of the one before."""
    marks: dict[str, float] = {}
    last = time.perf_counter()

    def mark(name: str, work: Callable[[], object]) -> None:
        nonlocal last
        work()
        torch.cuda.synchronize()
        now = time.perf_counter()
        marks[name] = round(now - last, 3)
        last = now

    mark("CUDA context", lambda: torch.zeros(1, device="cuda"))
    from threadloader._handoff import ReaderStream
    from threadloader._output import OutputFormat
    from threadloader._pipeline import BatchProducer
    from threadloader._stats import StatsRecorder
    from threadloader._warmup import warmup_source
    from threadloader.decode import _capi
    from threadloader.decode.nvimgcodec import NvImageCodecDecoder
    from threadloader.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop

    mark("nvImageCodec library", _capi.library)
    mark("nvImageCodec instance (the codecs' libraries)", _capi.load)
    decoder = NvImageCodecDecoder(torch.device("cuda", 0), cpu_threads=14)
    mark("self-test (a Decoder, one decode) and the pool's first Decoder", lambda: decoder.engine)
    samples = warmup_source() * 4
    reader = ReaderStream(torch.device("cuda", 0))
    output = OutputFormat(size=(224, 224), dtype=torch.float32, mean=(0.5,) * 3, std=(0.5,) * 3)

    def batch(transform: Compose | None) -> Callable[[], object]:
        producer = BatchProducer(
            source=samples,
            decoder=decoder,
            output=output,
            on_error="skip",
            stats=StatsRecorder(),
            transform=transform,
        )
        return lambda: producer.produce([range(len(samples))], reader)

    crop = Compose([RandomResizedCrop(224), RandomHorizontalFlip()])
    mark("first resize batch of 16 photos (the resampling kernel's first launch)", batch(None))
    mark("second resize batch", batch(None))
    mark("first crop batch (the region pool's Decoder, the region check, the crop kernel)", batch(crop))
    mark("second crop batch", batch(crop))
    return marks


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks.tools.startup_phases measures the GPU path: it needs a CUDA device")
    print(json.dumps(phases(), indent=2))


if __name__ == "__main__":
    main()
