"""Where the time goes: a ThreadLoader's stage seconds, and raw region against whole-image decoding.

CLI: ``python -m benchmarks.tools.stages [--set varied] [--augment] [--threads 1,2] [--raw-decode]``.

The loader rows print images/s and ``loader.stats()``'s host seconds per stage (summed over threads)
over ``--batches`` batches after a warm-up. ``--raw-decode`` times nvImageCodec alone on preloaded
bytes, one thread, per backend: whole images against the regions RandomResizedCrop draws for them,
without any resize, which is what region decoding saves at the decoder.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Sequence

import torch

from benchmarks.common import IMAGENET_MEAN, IMAGENET_STD, endless, shuffled_threadloader, sync
from benchmarks.datasets import OUTPUT_SIZE, SETS, ensure_dataset, list_images
from benchmarks.loaders import augmentation
from threadloader.transforms import RandomResizedCrop


def loader_row(
    root: os.PathLike[str], *, set_name: str, augment: bool, region: bool, threads: int | None, batches: int
) -> str:
    """Runs one loader configuration and describes its throughput and stages."""
    size = OUTPUT_SIZE[set_name]
    options = (
        {"transform": augmentation(size), "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
        if augment
        else {"size": size}
    )
    with shuffled_threadloader(
        root, batch_size=32, num_threads=threads, region_decode=region, **options
    ) as loader:
        stream, device = endless(loader), loader.device.type
        for _ in range(10):
            next(stream)
        sync(device)
        before, started = loader.stats(), time.perf_counter()
        for _ in range(batches):
            next(stream)
        sync(device)
        images, seconds, after = batches * 32, time.perf_counter() - started, loader.stats()
    stages = {k: round(after.stage_seconds[k] - before.stage_seconds[k], 2) for k in after.stage_seconds}
    return (
        f"augment={augment} region={region} threads={threads or 'default'}: {images / seconds:,.0f} img/s, "
        f"region_decodes {after.region_decodes - before.region_decodes}, "
        f"cpu_fallbacks {after.cpu_fallbacks - before.cpu_fallbacks}, stage seconds {stages}"
    )


def raw_decode_rows(root: os.PathLike[str], *, count: int = 1024, batch: int = 128) -> list[str]:
    """nvImageCodec alone, one thread: whole images against RandomResizedCrop(224) regions of them."""
    from nvidia import nvimgcodec as nv

    blobs = [path.read_bytes() for path, _ in list_images(root)][:count]
    params = nv.DecodeParams(apply_exif_orientation=True, color_spec=nv.SRGB, sample_format=nv.I_RGB)
    crops = RandomResizedCrop(224)
    rows = []
    for name, kind in (("all", None), ("hardware", "HW_GPU_ONLY"), ("hybrid", "HYBRID_CPU_GPU")):
        decoder = nv.Decoder(backends=None if kind is None else [nv.Backend(getattr(nv, kind))])
        streams = [nv.CodeStream(data) for data in blobs]
        regions = [crops.sample((cs.height, cs.width), random.Random(i)) for i, cs in enumerate(streams)]
        parts = [
            cs.get_sub_code_stream(region=nv.Region(t, left, t + h, left + w))
            for cs, (t, left, h, w) in zip(streams, regions, strict=True)
        ]
        speeds = {}
        for label, sources in (("whole", streams), ("region", parts)):
            decoder.decode(sources[:batch], params=params)  # warm-up
            torch.cuda.synchronize()
            started, decoded = time.perf_counter(), 0
            for start in range(0, len(sources), batch):
                decoded += sum(
                    out is not None for out in decoder.decode(sources[start : start + batch], params=params)
                )
            torch.cuda.synchronize()
            speeds[label] = (decoded / (time.perf_counter() - started), decoded)
        rows.append(
            f"raw decode {name}: whole {speeds['whole'][0]:,.0f} img/s ({speeds['whole'][1]} decoded), "
            f"region {speeds['region'][0]:,.0f} img/s ({speeds['region'][1]} decoded): "
            f"{speeds['region'][0] / speeds['whole'][0]:.2f}x"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Prints the selected rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=SETS, default="varied")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--augment", action="store_true", help="RandomResizedCrop + flip + normalize")
    parser.add_argument("--threads", default="0", help="comma list of reader threads (0: default)")
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--raw-decode", action="store_true")
    args = parser.parse_args(argv)
    root = ensure_dataset(args.set, count=args.count)
    for threads in (int(t) for t in args.threads.split(",")):
        for region in (True, False) if args.augment else (True,):
            print(
                loader_row(
                    root,
                    set_name=args.set,
                    augment=args.augment,
                    region=region,
                    threads=threads or None,
                    batches=args.batches,
                ),
                flush=True,
            )
    if args.raw_decode:
        for row in raw_decode_rows(root):
            print(row, flush=True)


if __name__ == "__main__":
    main()
