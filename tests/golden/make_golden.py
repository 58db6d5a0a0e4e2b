"""Makes ``tests/golden/torchvision.npz``: torchvision.transforms.v2's outputs for test_golden.py.

CI has no torchvision (PyPI's does not import beside the CPU build of torch that CI installs), so the
torchvision parity tests compare with these outputs instead; where torchvision imports they also
compare with it live. The inputs are saved too (made from the seeds below), so the goldens do not
depend on the test helpers staying the same.

Run from the repository root, with torchvision installed: ``python -m tests.golden.make_golden``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..conftest import photo

PATH = Path(__file__).with_name("torchvision.npz")

#: The transform cases' image: (height, width, seed) for ``photo``.
IMAGE_SPEC = (75, 101, 3)
RESIZE_SIZES: dict[str, int | tuple[int, int]] = {"50": 50, "33x47": (33, 47), "120x160": (120, 160)}
CENTER_CROP_SIZES: dict[str, int | tuple[int, int]] = {
    "40x60": (40, 60),
    "75x101": (75, 101),
    "80x110": (80, 110),
    "33": 33,
}
CROP_SIZE = 32
CROP_SEEDS = range(20)
FLIP_SEEDS = range(10)
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)

#: RandomResizedCrop regions: image sizes, options, seeds.
REGION_SIZES = ((75, 101), (300, 200), (64, 64), (20, 500))
REGION_OPTIONS: dict[str, dict[str, tuple[float, float]]] = {
    "default": {"scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3)},
    "wide": {"scale": (0.2, 0.9), "ratio": (0.5, 2.0)},
}
REGION_SEEDS = range(100)

#: The loader's output format: images of several sizes in one batch, resized, scaled, normalized.
LOADER_SPECS = ((75, 101, 20), (60, 80, 21), (48, 64, 22), (60, 80, 23))
LOADER_SIZE = (50, 60)
LOADER_MEAN, LOADER_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def inputs() -> dict[str, np.ndarray]:
    """The input images, ``(H, W, 3)`` uint8, made from the seeds above."""
    made = {"input/image": photo(*IMAGE_SPEC)}
    for i, spec in enumerate(LOADER_SPECS):
        made[f"input/loader/{i}"] = photo(*spec)
    return made


def chw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1).contiguous()


def png(array: np.ndarray) -> bytes:
    """Lossless, so the loader decodes exactly the saved pixels whatever the libjpeg."""
    out = io.BytesIO()
    Image.fromarray(array).save(out, "PNG")
    return out.getvalue()


def torchvision_outputs(v2: Any, given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every case through torchvision.transforms.v2, keyed as test_golden.py reads them."""
    image = chw(given["input/image"])
    floats = v2.ToDtype(torch.float32, scale=True)(image)
    out: dict[str, np.ndarray] = {}
    for key, size in RESIZE_SIZES.items():
        out[f"resize/{key}/uint8"] = v2.Resize(size, antialias=True)(image).numpy()
        out[f"resize/{key}/float32"] = v2.Resize(size, antialias=True)(floats).numpy()
    for key, size in CENTER_CROP_SIZES.items():
        out[f"center_crop/{key}"] = v2.CenterCrop(size)(image).numpy()
    for seed in CROP_SEEDS:
        torch.manual_seed(seed)
        out[f"random_resized_crop/{seed}"] = v2.RandomResizedCrop(CROP_SIZE, antialias=True)(image).numpy()
    flips = []
    for seed in FLIP_SEEDS:
        torch.manual_seed(seed)
        flips.append(torch.equal(v2.RandomHorizontalFlip()(image), image.flip(-1)))
    out["flip"] = np.array(flips)
    out["normalize"] = v2.Normalize(MEAN, STD)(floats).numpy()
    for name, options in REGION_OPTIONS.items():
        for height, width in REGION_SIZES:
            crop = v2.RandomResizedCrop(CROP_SIZE, **options)
            regions = []
            for seed in REGION_SEEDS:
                torch.manual_seed(seed)
                params = crop.make_params([torch.empty(3, height, width, dtype=torch.uint8)])
                regions.append([params["top"], params["left"], params["height"], params["width"]])
            out[f"regions/{name}/{height}x{width}"] = np.array(regions, dtype=np.int32)
    loader_inputs = [chw(given[f"input/loader/{i}"]) for i in range(len(LOADER_SPECS))]
    as_float = v2.Compose(
        [
            v2.ToDtype(torch.float32, scale=True),
            v2.Resize(LOADER_SIZE, antialias=True),
            v2.Normalize(LOADER_MEAN, LOADER_STD),
        ]
    )
    out["loader/float32"] = torch.stack([as_float(x) for x in loader_inputs]).numpy()
    as_uint8 = v2.Resize(LOADER_SIZE, antialias=True)
    out["loader/uint8"] = torch.stack([as_uint8(x) for x in loader_inputs]).numpy()
    return out


def main() -> None:
    """Writes the golden file and prints its size."""
    import torchvision
    from torchvision.transforms import v2

    given = inputs()
    arrays = {**given, **torchvision_outputs(v2, given)}
    arrays["versions"] = np.array([f"torch {torch.__version__}", f"torchvision {torchvision.__version__}"])
    np.savez_compressed(PATH, **arrays)  # type: ignore[arg-type]
    print(f"wrote {PATH} ({PATH.stat().st_size / 1024:.0f} KiB, {len(arrays)} arrays)")


if __name__ == "__main__":
    main()
