"""Where a GPU loader's start-up goes, phase by phase, in this (fresh) process.

Usage: ``python -m benchmarks.tools.startup_phases [--extensions libnvjpeg_ext,jpeg_turbo]`` (run it twice:
Triton caches its kernels on disk).

Each phase is what a reader thread's first batch would otherwise pay, in the order the background
warm-up (``threadloader._warmup``) meets them: nvImageCodec's library and instance, the C API's
self-test with the first Decoder, the first batch of the resize pipeline (the resampling kernel's first
launch), the first random crops (the region pool's Decoder, the region check, the crop kernel).
``--extensions`` loads only the nvImageCodec extension modules whose file names contain one of the
given words (through a folder of links to them), to see whether the instance's and the first Decoder's
seconds are the other codecs' libraries. Prints one JSON object of seconds per phase.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def phases(extensions: Sequence[str] = ()) -> dict[str, float]:
    """Seconds per phase, each timed from the end of the one before; see the module's ``--extensions``."""
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
    from threadloader.decode.nvimgcodec import _capi
    from threadloader.decode.nvimgcodec import NvImageCodecDecoder
    from threadloader.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop

    mark("nvImageCodec library", _capi.library)
    if extensions:
        _capi.library().extensions = _linked(_capi.library().extensions, extensions)
    mark("nvImageCodec instance (the codecs' libraries)", _capi.load)
    decoder = NvImageCodecDecoder(torch.device("cuda", 0), decode_threads=14)
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


def _linked(folder: Path, words: Sequence[str]) -> Path:
    """A new folder of links to the extension modules in ``folder`` whose names contain one of ``words``."""
    chosen = [name for name in sorted(os.listdir(folder)) if any(word in name for word in words)]
    if not chosen:
        sys.exit(f"no extension module in {folder} matches {list(words)}: {sorted(os.listdir(folder))}")
    links = Path(tempfile.mkdtemp(prefix="nvimgcodec-extensions-"))
    atexit.register(shutil.rmtree, links, ignore_errors=True)
    for name in chosen:
        (links / name).symlink_to(folder / name)
    print(f"extension modules loaded: {chosen}", file=sys.stderr)
    return links


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--extensions",
        default="",
        help="comma-separated words: load only the extension modules whose file names contain one",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.tools.startup_phases measures the GPU path: it needs a CUDA device")
    print(json.dumps(phases([w for w in args.extensions.split(",") if w]), indent=2))


if __name__ == "__main__":
    main()
