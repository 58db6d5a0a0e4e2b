"""Bad inputs and other formats, shared by the CPU and GPU robustness tests."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import torch
from hypothesis import strategies as st
from PIL import Image

from threadloader import ThreadLoader

from .conftest import encode, photo, script_process

#: Bad samples that every decoder must turn into a SampleError, never a crash, a hang or an image.
#: Each maker writes what it needs under ``root`` and returns the path (or bytes) to load.


#: Good JPEGs to put next to the bad ones in a batch.
GOOD = [encode(photo(64, 80, seed), quality=90) for seed in range(3)]


def _jpeg() -> bytes:
    return encode(photo(64, 80, 5), quality=90)


def zero_bytes(root: Path) -> str:
    path = root / "empty.jpg"
    path.write_bytes(b"")
    return str(path)


def truncated_jpeg(root: Path) -> str:
    data = _jpeg()
    path = root / "truncated.jpg"
    path.write_bytes(data[: len(data) // 2])
    return str(path)


def random_bytes(root: Path) -> str:
    path = root / "random.jpg"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    return str(path)


def text_named_jpg(root: Path) -> str:
    path = root / "notes.jpg"
    path.write_text("this is not an image, whatever its name says\n" * 20)
    return str(path)


def missing_file(root: Path) -> str:
    return str(root / "does-not-exist.jpg")


def unreadable_file(root: Path) -> str:
    path = root / "a-directory.jpg"  # reading a directory fails even as root, unlike chmod 000
    path.mkdir()
    return str(path)


def unsupported_format(root: Path) -> str:
    path = root / "vector.jpg"
    path.write_text('<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect/></svg>')
    return str(path)


BAD_INPUTS = {
    "zero_bytes": (zero_bytes, "decode"),
    "truncated_jpeg": (truncated_jpeg, "decode"),
    "random_bytes": (random_bytes, "decode"),
    "text_named_jpg": (text_named_jpg, "decode"),
    "missing_file": (missing_file, "read"),
    "unreadable_file": (unreadable_file, "read"),
    "unsupported_format": (unsupported_format, "decode"),
}


#: A heap address as an object's default repr shows it (``<_io.BytesIO object at 0x7f...>``), or bare.
HEAP_ADDRESS = re.compile(r"object at |0x[0-9a-fA-F]{8,}")


def fifo_named_jpg(root: Path) -> str:
    """A FIFO with an image's name: opening it for reading waits for a writer that never comes."""
    path = root / "pipe.jpg"
    os.mkfifo(path)
    return str(path)


def release_fifo(path: str) -> None:
    """Ends a reader blocked opening ``path`` (it then reads end-of-file), so a failed test cannot hang."""
    with contextlib.suppress(OSError):  # ENXIO: nobody is blocked reading it
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def corrupted_entropy_jpeg() -> bytes:
    """A JPEG whose entropy-coded data has bytes flipped in the middle (headers intact)."""
    data = bytearray(_jpeg())
    middle = len(data) // 2
    for k in range(middle, middle + 40):
        data[k] ^= 0x5A
    return bytes(data)


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int) -> bytes:
    """``data`` with bytes overwritten at ``edits`` (offset, value) and ``cut`` bytes cut off its end."""
    mutated = bytearray(data)
    for offset, value in edits:
        mutated[offset % len(mutated)] = value
    return bytes(mutated[: max(1, len(mutated) - cut % len(mutated))])


#: Hypothesis arguments for :func:`mutate`.
MUTATIONS = {
    "edits": st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=12),
    "cut": st.integers(0, 10_000),
}


def exit_with_a_loader_open(tmp_path: Path, device: str) -> subprocess.CompletedProcess[str]:
    """Runs a script that starts an epoch, takes one batch and exits without closing anything."""
    command, options = script_process(
        tmp_path,
        textwrap.dedent(
            f"""
            from threadloader import ThreadLoader
            from tests.conftest import encode, photo

            data = [encode(photo(64, 80, i % 7), quality=90) for i in range(400)]
            loader = ThreadLoader(data, batch_size=8, size=(64, 80), device={device!r}, num_threads=4)
            iterator = iter(loader)
            next(iterator)
            print("started", flush=True)
            """
        ),
    )
    return subprocess.run(command, capture_output=True, timeout=60, **options)


def _save(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def other_formats() -> dict[str, bytes]:
    """One image per format and variant the loader must decode like Pillow."""
    rgb = Image.fromarray(photo(48, 64, 21))
    rgba = rgb.copy()
    rgba.putalpha(Image.fromarray((np.arange(48 * 64).reshape(48, 64) % 256).astype(np.uint8)))
    gray16 = Image.fromarray((photo(48, 64, 22)[..., 0].astype(np.uint16) * 257 + 3).astype(np.uint16))
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    palette_alpha = palette.copy()
    palette_alpha.info["transparency"] = 0
    return {
        "png_rgb": _save(rgb, "PNG"),
        "png_rgba": _save(rgba, "PNG"),
        "png_gray_alpha": _save(rgba.convert("LA"), "PNG"),
        "png_gray16": _save(gray16, "PNG"),
        "png_palette": _save(palette, "PNG"),
        "png_palette_transparency": _save(palette_alpha, "PNG", transparency=0),
        "bmp": _save(rgb, "BMP"),
        "tiff": _save(rgb, "TIFF"),
        "tiff_rgba": _save(rgba, "TIFF"),
        "webp_lossless": _save(rgb, "WEBP", lossless=True),
        "webp_lossy": _save(rgb, "WEBP", quality=90),
        "jpeg2000": _save(rgb, "JPEG2000"),
        "gif": _save(palette, "GIF"),
    }


def expected_rgb(name: str, data: bytes) -> np.ndarray:
    """The documented output: RGB uint8, alpha dropped, 16-bit samples reduced to their high byte."""
    with Image.open(io.BytesIO(data)) as image:
        if name == "png_gray16":
            gray = (np.asarray(image, dtype=np.uint32) >> 8).astype(np.uint8)
            return np.repeat(gray[..., None], 3, axis=2)
        return np.array(image.convert("RGB"))


def load_other_format(name: str, device: str) -> tuple[torch.Tensor, np.ndarray]:
    """The :func:`other_formats` case ``name`` through a loader on ``device``: the image, and its
    :func:`expected_rgb`."""
    data = other_formats()[name]
    with ThreadLoader([(data, 0)], batch_size=1, device=device) as loader:
        (images, _), *_ = list(loader)
    return images[0], expected_rgb(name, data)
