"""Benchmark JPEG data sets cut from the photos scikit-image ships, so runs need no download.

Synthetic noise or flat images decode at unrealistic speeds (entropy decoding dominates JPEG
cost), so every image is a crop of a real photograph. Sets are written in an ImageFolder layout
(``root/<set>/class_xx/img_00001.jpg``) and cached: a manifest records what was built and a
matching manifest means the files are reused.

CLI: ``python -m benchmarks.datasets --set fixed --count 2000 [--root DIR] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np
from PIL import Image

VERSION = 1
"""Bump when the generator changes, so cached sets are rebuilt."""

SETS = ("fixed", "varied")
OUTPUT_SIZE = {"fixed": (256, 256), "varied": (224, 224)}
"""(height, width) every loader delivers for a set: ``fixed`` is stored at that size already."""

_PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "camera",
    "stereo_motorcycle",
    "immunohistochemistry",
    "hubble_deep_field",
    "retina",
    "coins",
)
"""scikit-image photos available offline in 0.26 (others need pooch)."""

_CLASSES = 10

_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class _Spec:
    """How one image is cut from its photo and encoded."""

    photo: int
    width: int
    height: int
    scale: float
    pos: tuple[float, float]
    flip: bool
    quality: int
    gray: bool
    subsampling: int  # Pillow: 0 = 4:4:4, 2 = 4:2:0
    progressive: bool


def default_root() -> Path:
    """Cache directory: ``$THREADLOADER_BENCH_CACHE`` or ``~/.cache/threadloader-bench``."""
    env = os.environ.get("THREADLOADER_BENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "threadloader-bench"


@functools.cache
def _photos() -> tuple[Image.Image, ...]:
    """Load the source photos once as RGB (gray ones replicated), imported lazily: skimage is slow."""
    from skimage import data

    out = []
    for name in _PHOTOS:
        arr = getattr(data, name)()
        if isinstance(arr, tuple):  # stereo_motorcycle -> (left, right, disparity)
            arr = arr[0]
        out.append(Image.fromarray(arr).convert("RGB"))
    for im in out:
        im.load()
    return tuple(out)


class _Common(TypedDict):
    """The parameters both sets draw first, in this order."""

    photo: int
    scale: float
    pos: tuple[float, float]
    flip: bool


def _spec(name: str, index: int, seed: int) -> _Spec:
    """Draw one image's parameters from an RNG keyed by (seed, index): independent of thread order."""
    rng = np.random.default_rng([seed, index])
    common: _Common = {
        "photo": int(rng.integers(len(_PHOTOS))),  # random, so every class (and batch) mixes content
        "scale": float(rng.uniform(0.8, 1.25)),
        "pos": (float(rng.random()), float(rng.random())),
        "flip": bool(rng.random() < 0.5),
    }
    if name == "fixed":
        return _Spec(
            width=256, height=256, quality=90, gray=False, subsampling=2, progressive=False, **common
        )
    kind = rng.random()  # 5% gray, 5% 4:4:4, 5% progressive, the rest 4:2:0 baseline
    return _Spec(
        width=int(rng.integers(350, 801)),
        height=int(rng.integers(350, 801)),
        quality=int(rng.integers(75, 96)),
        gray=bool(kind < 0.05),
        subsampling=0 if 0.05 <= kind < 0.10 else 2,
        progressive=bool(0.10 <= kind < 0.15),
        **common,
    )


def _encode(spec: _Spec) -> bytes:
    """Crop at a random scale and place (upscaling when the photo is too small), flip, encode."""
    photo = _photos()[spec.photo]
    crop_w, crop_h = spec.width / spec.scale, spec.height / spec.scale
    fit = min(1.0, photo.width / crop_w, photo.height / crop_h)
    crop_w, crop_h = min(crop_w * fit, photo.width), min(crop_h * fit, photo.height)
    x0 = spec.pos[0] * (photo.width - crop_w)
    y0 = spec.pos[1] * (photo.height - crop_h)
    box = (x0, y0, x0 + crop_w, y0 + crop_h)
    im = photo.resize((spec.width, spec.height), Image.Resampling.BICUBIC, box=box)
    if spec.flip:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if spec.gray:
        im = im.convert("L")
    buf = io.BytesIO()
    im.save(
        buf,
        "JPEG",
        quality=spec.quality,
        subsampling=spec.subsampling,
        progressive=spec.progressive,
    )
    return buf.getvalue()


def _relpath(index: int) -> Path:
    """ImageFolder path of image ``index``: classes are dealt round-robin."""
    return Path(f"class_{index % _CLASSES:02d}") / f"img_{index + 1:05d}.jpg"


def _manifest(name: str, count: int, seed: int) -> dict[str, object]:
    return {"set": name, "count": count, "seed": seed, "version": VERSION}


def ensure_dataset(name: str, *, count: int, root: Path | None = None, seed: int = 0) -> Path:
    """Return the directory of set ``name``, building it unless a matching cached copy exists.

    Builds into a temporary sibling and renames it into place, so an interrupted build is never
    mistaken for a complete one.

    Args:
        name: ``"fixed"`` (256x256, q90, 4:2:0) or ``"varied"`` (ImageNet-like mix).
        count: Number of images.
        root: Cache directory; defaults to `default_root()`.
        seed: Seed; the same (name, count, seed) gives the same images.

    Returns:
        The ImageFolder root, ``root/<name>``.
    """
    if name not in SETS:
        raise ValueError(f"unknown set {name!r}; choose from {SETS}")
    root = Path(root) if root is not None else default_root()
    target = root / name
    wanted = _manifest(name, count, seed)
    try:
        if json.loads((target / _MANIFEST).read_text()) == wanted:
            return target
    except (OSError, ValueError):
        pass
    tmp = root / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for cls in range(min(count, _CLASSES)):
            (tmp / f"class_{cls:02d}").mkdir(parents=True)
        _photos()  # load before the pool so threads do not race on the cache

        def write(index: int) -> None:
            (tmp / _relpath(index)).write_bytes(_encode(_spec(name, index, seed)))

        with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
            list(pool.map(write, range(count)))
        (tmp / _MANIFEST).write_text(json.dumps(wanted, indent=2) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left behind when the build failed
    return target


def list_images(root: str | os.PathLike[str]) -> list[tuple[Path, int]]:
    """(path, class index) pairs in ImageFolder order: sorted class dirs, then sorted files."""
    classes = sorted(p for p in Path(root).iterdir() if p.is_dir())
    return [(f, label) for label, d in enumerate(classes) for f in sorted(d.glob("*.jpg"))]


def main(argv: Sequence[str] | None = None) -> None:
    """Build (or confirm the cache of) one set and print where it lives."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=SETS, default="fixed")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument(
        "--root",
        type=Path,
        help="cache dir (default: $THREADLOADER_BENCH_CACHE or ~/.cache/threadloader-bench)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = ensure_dataset(args.set, count=args.count, root=args.root, seed=args.seed)
    print(f"{path} ({args.count} images, {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
