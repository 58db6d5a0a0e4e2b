"""``python -m threadloader [DIR]``: load a folder (or the bundled sample photos) and print throughput.

The quickest check that an installation works and decodes where you expect: on the GPU when one and
nvImageCodec are usable, else on the CPU with Pillow.
"""

from __future__ import annotations

import argparse
import io
import random
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import torch
from PIL import Image

from . import ThreadLoader


def sample_photos(count: int, *, side: int = 256, seed: int = 0) -> list[tuple[bytes, int]]:
    """``count`` JPEGs (quality 90) cut from the bundled photographs: random crops, flips and scales.

    Targets are the index of the photograph each crop came from.
    """
    folder = resources.files("threadloader") / "_sample"
    photos = [
        Image.open(io.BytesIO(f.read_bytes())).convert("RGB")
        for f in sorted(folder.iterdir(), key=str)
        if f.name.endswith(".jpg")
    ]

    def make(i: int) -> tuple[bytes, int]:
        rng = random.Random(seed * 1_000_003 + i)
        label = i % len(photos)
        photo = photos[label]
        crop = rng.randint(side // 2, min(photo.size))
        left, top = rng.randint(0, photo.width - crop), rng.randint(0, photo.height - crop)
        image = photo.crop((left, top, left + crop, top + crop)).resize((side, side), Image.BILINEAR)
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        out = io.BytesIO()
        image.save(out, "JPEG", quality=90)
        return out.getvalue(), label

    with ThreadPoolExecutor() as pool:
        return list(pool.map(make, range(count)))


def main(argv: list[str] | None = None) -> None:
    """Runs the demo: a few epochs over the data, then one line of throughput."""
    parser = argparse.ArgumentParser(prog="python -m threadloader", description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", help="an ImageFolder directory (default: bundled sample photos)")
    parser.add_argument("--count", type=int, default=1024, help="sample images to generate (default 1024)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--size", type=int, default=224, help="output side (default 224)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: GPU if usable)")
    args = parser.parse_args(argv)

    source = args.folder or sample_photos(args.count)
    start = time.perf_counter()
    with ThreadLoader(
        source,
        batch_size=args.batch_size,
        shuffle=True,
        seed=0,
        size=(args.size, args.size),
        dtype=torch.float32,
        device=args.device,
    ) as loader:
        device = loader.device
        sync = torch.cuda.current_stream(device).synchronize if device.type == "cuda" else (lambda: None)
        next(iter(loader))
        sync()
        first = time.perf_counter() - start
        images = 0
        start = time.perf_counter()
        for _ in range(args.epochs):
            for batch, _targets in loader:
                images += batch.shape[0]
        sync()
        elapsed = time.perf_counter() - start
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Pillow)"
        print(
            f"threadloader: {images / elapsed:,.0f} images/s on {device} ({where}); {images} images of "
            f"{args.size}x{args.size} in batches of {args.batch_size}, {loader.num_threads} threads; "
            f"first batch after {first:.2f} s"
        )


if __name__ == "__main__":
    main()
