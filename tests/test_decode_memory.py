"""The CPU path's memory for one huge image: Pillow's decode and the loader's output, and no more copies
(``max_pixels=None`` lets a small file declare any size); and the pixels of the one-copy array."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from threadloader.decode import pillow

from .conftest import encode, pil_reference

ROOT = Path(__file__).resolve().parent.parent


def declaring(width: int, height: int) -> bytes:
    """A JPEG of a few hundred bytes whose header declares ``width`` x ``height``: a 16x16 JPEG with
    its frame header's sides changed. libjpeg decodes it whole, the missing data grey."""
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 30, 200)).save(out, "JPEG", quality=50)
    data = bytearray(out.getvalue())
    at = 2
    while data[at + 1] not in (0xC0, 0xC1, 0xC2):  # to the start of frame
        at += 2 + struct.unpack(">H", data[at + 2 : at + 4])[0]
    struct.pack_into(">HH", data, at + 5, height, width)
    return bytes(data)


#: Decodes ``argv[2]`` with Pillow alone ("pillow") or a CPU ThreadLoader ("loader"), and prints the
#: peak resident memory it added (bytes) and the output's size.
PEAK_SCRIPT = """
import resource, sys
import torch
from PIL import Image
from threadloader import ThreadLoader

what, path = sys.argv[1], sys.argv[2]
unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
torch.zeros(8).add_(1)
before, output = peak(), 0
if what == "pillow":
    Image.MAX_IMAGE_PIXELS = None
    with Image.open(path) as image:
        image.load()
else:
    with ThreadLoader([path], max_pixels=None, num_threads=1) as loader:
        (images,), _ = next(iter(loader))
        output = images.numel() * images.element_size()
print(peak() - before, output)
"""


def peak_of(what: str, path: Path) -> tuple[int, int]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, what, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env | {"OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    peak, output = result.stdout.split()
    return int(peak), int(output)


def available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024


SIDE = 8000  # 64 megapixels: Pillow's decode 256 MB, the RGB output 192 MB


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="reads the free memory from /proc/meminfo")
def test_a_huge_image_needs_pillows_decode_and_the_output_alone(tmp_path: Path) -> None:
    if available_bytes() < 2 * 7 * SIDE * SIDE:
        pytest.skip(f"needs about {2 * 7 * SIDE * SIDE / 2**30:.1f} GiB of free memory")
    path = tmp_path / "huge.jpg"
    path.write_bytes(declaring(SIDE, SIDE))
    decode, _ = peak_of("pillow", path)
    loader, output = peak_of("loader", path)
    assert output == 3 * SIDE * SIDE
    # The loader's own copies beyond Pillow's and its output: a few MB. np.array's copy through
    # tobytes cost one more image and a half (the join of the packed rows, then the array).
    extra = loader - decode - output
    assert extra < 0.1 * output, f"{extra / 2**20:.0f} MiB beyond decode + output ({decode=}, {loader=})"


@pytest.mark.parametrize(
    "size",
    [(1, 1), (3, 2), (17, 5), (300_000, 1), (4, 200_000), (513, 1031)],
    ids=["1x1", "3x2", "17x5", "a row over the chunk", "many chunks", "odd sides"],
)
def test_the_one_copy_array_is_numpys(size: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(size))
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    array = pillow._rgb_array(image)
    assert array.flags.c_contiguous and array.flags.writeable and array.flags.owndata
    np.testing.assert_array_equal(array, pixels)
    np.testing.assert_array_equal(array, np.array(image))


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "CMYK", "LA", "1"])
def test_converted_modes_decode_as_pillow_does(mode: str) -> None:
    rng = np.random.default_rng(3)
    data = encode(
        rng.integers(0, 256, (37, 53, 3), dtype=np.uint8), "PNG" if mode != "CMYK" else "TIFF", mode
    )
    np.testing.assert_array_equal(pillow.decode_rgb(data), pil_reference(data))


def test_a_turned_image_decodes_as_pillow_does() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees
    out = io.BytesIO()
    rng = np.random.default_rng(4)
    Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(out, "PNG", exif=exif)
    decoded = pillow.decode_rgb(out.getvalue())
    assert decoded.shape == (30, 20, 3)
    np.testing.assert_array_equal(decoded, pil_reference(out.getvalue()))
