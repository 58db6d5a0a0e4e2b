"""Which CUDA tensors are alive at each batch: the device memory bound of ``prefetch``, looked into.

Usage: ``python -m benchmarks.tools.memory_census [--prefetch 1] [--batches 24] [--no-warmup]``.

The loader of ``tests/test_gpu.py::test_memory_bounded_by_prefetch`` (256x256 JPEGs in memory, batches
of 16 resized to float32 256x256, 2 reader threads, one batch per decode call, a consumer that sleeps
2 ms a batch so that the window fills), with a census after each batch: torch's allocated bytes, the
peak so far, and the live CUDA tensors the garbage collector can see, counted by size. Where the
peak passes the test's bound, the census says whether batches outside the window are alive (a batch
released late, as biased reference counting did on 3.13t) or something else holds the memory (the
warm-up, the resize's temporaries, cuBLAS workspaces: torch's, not counted as tensors). ``--no-warmup``
runs without the background warm-up (``THREADLOADER_WARMUP=0``). It answers a failure of that test on
a free-threaded Python (docs/design.md, "Free-threaded Python").
"""

from __future__ import annotations

import argparse
import collections
import gc
import io
import os
import sys
import time
import warnings

import torch

BATCH = 16
SIDE = 256
MIB = 2**20


def _jpegs(count: int) -> list[tuple[bytes, int]]:
    """``count`` distinct 256x256 JPEGs in memory, as the test's."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    blobs = []
    for index in range(count):
        pixels = torch.randint(0, 256, (SIDE // 8, SIDE // 8, 3), generator=generator, dtype=torch.uint8)
        image = Image.fromarray(pixels.numpy()).resize((SIDE, SIDE), Image.Resampling.BILINEAR)
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=90)
        blobs.append((buffer.getvalue(), index))
    return blobs


def live_cuda_tensors() -> collections.Counter[int]:
    """The CUDA tensors the garbage collector sees, counted by their storage's bytes."""
    sizes: collections.Counter[int] = collections.Counter()
    with warnings.catch_warnings():  # isinstance() of a deprecated torch object warns
        warnings.simplefilter("ignore", FutureWarning)
        for thing in gc.get_objects():
            try:
                if isinstance(thing, torch.Tensor) and thing.is_cuda:
                    sizes[thing.untyped_storage().nbytes()] += 1
            except Exception:  # an object half torn down by another thread: not counted
                continue
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--no-warmup", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_census needs a CUDA device: it counts device memory")
    if args.no_warmup:
        os.environ["THREADLOADER_WARMUP"] = "0"
    from threadloader import ThreadLoader

    samples = _jpegs(32) * (args.batches * BATCH // 32 + 1)
    batch_bytes = BATCH * 3 * SIDE * SIDE * 4
    bound = (2 * args.prefetch + 2) * batch_bytes * 2.5  # the test's
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    print(f"Python {sys.version.split()[0]}, GIL {'on' if gil else 'off'}, torch {torch.__version__}")
    print(f"one batch {batch_bytes / MIB:.1f} MiB; bound at prefetch={args.prefetch}: {bound / MIB:.1f} MiB")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with ThreadLoader(
        samples[: args.batches * BATCH],
        batch_size=BATCH,
        size=(SIDE, SIDE),
        dtype=torch.float32,
        device="cuda",
        num_threads=2,
        prefetch=args.prefetch,
        decode_batch_size=BATCH,
    ) as loader:
        for number, (images, _) in enumerate(loader):
            del images
            time.sleep(0.002)
            torch.cuda.synchronize()
            census = live_cuda_tensors()
            batches = census.get(batch_bytes, 0)
            others = sum(size * n for size, n in census.items() if size != batch_bytes)
            print(
                f"batch {number:2d}: allocated {(torch.cuda.memory_allocated() - base) / MIB:6.1f} MiB, "
                f"peak {(torch.cuda.max_memory_allocated() - base) / MIB:6.1f} MiB; live output batches "
                f"{batches}, other CUDA tensors {sum(census.values()) - batches} ({others / MIB:.1f} MiB)"
            )
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    verdict = "within" if peak <= bound else "over"
    left = torch.cuda.memory_allocated() - base
    # torch's cuBLAS workspaces (32 MiB for each cuBLAS handle and stream that ran a matrix product:
    # the resize where Triton is missing) are allocations, not tensors: what clearing them frees.
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    workspaces = left - (torch.cuda.memory_allocated() - base)
    print(
        f"peak {peak / MIB:.1f} MiB: {verdict} the bound; left after close {left / MIB:.1f} MiB, of which "
        f"cuBLAS workspaces {workspaces / MIB:.1f} MiB"
    )


if __name__ == "__main__":
    main()
