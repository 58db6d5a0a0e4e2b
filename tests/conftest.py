"""Shared fixtures: a corpus of JPEGs covering the cases decoders get wrong, Pillow references, and
guards that reader threads are gone after each test."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import http.client
import io
import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset

from threadloader.decode import DecodedBatch, ImageDecoder, PillowDecoder, RegionOf, StageRecorder

if not torch.cuda.is_available():
    # Triton's kernels (transforms/_kernels.py) then run in its interpreter, on CPU tensors, where a
    # test asks for it: tests/test_kernels.py. Read by Triton when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _gpu_unusable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    try:
        from nvidia import nvimgcodec

        nvimgcodec.Decoder()
    except Exception as exc:  # any failure means the GPU path cannot run here
        return f"nvImageCodec unusable: {type(exc).__name__}: {exc}"
    return None


GPU_SKIP_REASON = _gpu_unusable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {GPU_SKIP_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth, photo-like RGB image (gradients, blobs, mild noise): realistic for JPEG, cheap to make."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        fy, fx = rng.uniform(0.5, 4, 2).tolist()
        phase = rng.uniform(0, 6)
        wave = np.sin(fx * np.pi * x / max(width, 1) + phase) * np.cos(fy * np.pi * y / max(height, 1))
        base = 128 + 90 * wave
        channels.append(base + rng.normal(0, 6, (height, width)))
    return np.clip(np.stack(channels, axis=-1), 0, 255).astype(np.uint8)


def encode(array: np.ndarray, fmt: str = "JPEG", mode: str | None = None, **save: object) -> bytes:
    image = Image.fromarray(array)
    if mode is not None:
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def write_files(folder: Path, payloads: list[bytes], name: str = "{}.jpg") -> list[str]:
    """Writes each payload to ``folder / name.format(i)``; the paths, in order."""
    paths = []
    for i, data in enumerate(payloads):
        path = folder / name.format(i)
        path.write_bytes(data)
        paths.append(str(path))
    return paths


def distinct_jpegs(count: int, height: int, width: int, first_seed: int = 0) -> list[bytes]:
    """``count`` small JPEGs, each from a seed of its own, so that a wrong sample shows in the pixels."""
    return [encode(photo(height, width, seed=first_seed + i), quality=90) for i in range(count)]


def with_orientation(array: np.ndarray, orientation: int) -> bytes:
    image = Image.fromarray(array)
    exif = image.getexif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    image.save(out, "JPEG", quality=92, exif=exif.tobytes())
    return out.getvalue()


def with_gray_sampling(data: bytes, factors: int = 0x22) -> bytes:
    """A baseline grayscale JPEG rewritten to declare other sampling factors, as some encoders write."""
    sof = data.index(b"\xff\xc0")
    patched = bytearray(data)
    patched[sof + 11] = factors  # FF C0, length(2), precision, height(2), width(2), Nf, C1, H1V1
    return bytes(patched)


def header_only_png(width: int, height: int) -> bytes:
    """A PNG that declares ``width x height`` RGB pixels and holds none: a decompression bomb's header.

    Its header opens; decoding it fails. So a pixel limit that answers "over the limit" for it was
    checked from the header, before any decoding.
    """

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def pil_reference(data: bytes) -> np.ndarray:
    """What every decoder must produce: RGB uint8 HWC, EXIF orientation applied."""
    with Image.open(io.BytesIO(data)) as image:
        return np.array(ImageOps.exif_transpose(image).convert("RGB"))


def mean_abs_diff(tensor: torch.Tensor, reference: np.ndarray) -> float:
    """Mean absolute difference in 0-255 units between a (3, H, W) or (H, W, 3) tensor and a reference."""
    array = tensor.detach().cpu()
    if array.shape[0] == 3 and array.shape[-1] != 3:
        array = array.permute(1, 2, 0)
    return float(np.abs(array.numpy().astype(np.int16) - reference.astype(np.int16)).mean())


#: The GPU path against an independent reference (Pillow's pixels), per image, in 0-255 units: the
#: mean absolute difference, the worst pixel row's mean, and the largest single difference. nvJPEG and
#: libjpeg round the IDCT and chroma upsampling differently (whole images: means of 0.00-0.03 measured
#: on an H200). The row and max checks fail an image with one corrupted row, which a mean over the
#: image (or a batch) would pass. Random crops are compared with the CPU path, whose uint8 resize (torch's
#: fixed-point kernel) is within 1 of the GPU's float one: worst per image mean 0.21, row 0.35, max 3 on
#: an H200. The session's worst values are printed at the end of a GPU run.
GPU_TOLERANCE = {"mean": 0.3, "row": 0.5, "max": 4.0}
_WORST_GPU_DIFF: dict[str, float] = {}


def image_diff(actual: torch.Tensor, reference: np.ndarray | torch.Tensor) -> dict[str, float]:
    """Mean, worst-row mean and max absolute difference of two images, (3, H, W) or (H, W, 3)."""

    def hwc(image: np.ndarray | torch.Tensor) -> np.ndarray:
        array = image.detach().cpu().double().numpy() if isinstance(image, torch.Tensor) else image
        array = np.asarray(array, dtype=np.float64)
        return array.transpose(1, 2, 0) if array.shape[0] == 3 and array.shape[-1] != 3 else array

    a, b = hwc(actual), hwc(reference)
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = np.abs(a - b)
    return {"mean": float(diff.mean()), "row": float(diff.mean(axis=(1, 2)).max()), "max": float(diff.max())}


def gpu_mismatch(actual: torch.Tensor, reference: np.ndarray | torch.Tensor) -> str | None:
    """``None`` when a GPU output is within :data:`GPU_TOLERANCE` of its reference, else what is over."""
    diff = image_diff(actual, reference)
    for key, value in diff.items():
        _WORST_GPU_DIFF[key] = max(_WORST_GPU_DIFF.get(key, 0.0), value)
    over = [f"{key} {diff[key]:.3g} > {limit}" for key, limit in GPU_TOLERANCE.items() if diff[key] > limit]
    return ", ".join(over) or None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _WORST_GPU_DIFF:
        worst = ", ".join(f"{key} {value:.3f}" for key, value in _WORST_GPU_DIFF.items())
        terminalreporter.write_line(
            f"GPU against references, worst per image: {worst} (limits {GPU_TOLERANCE})"
        )


def jpeg_corpus() -> dict[str, bytes]:
    """JPEGs covering what decoders get wrong: grayscale at several sizes and qualities, CMYK,
    chroma subsampling, progressive, odd sizes, 1x1, and all eight EXIF orientations."""
    corpus: dict[str, bytes] = {}
    for i, (w, h) in enumerate([(333, 222), (500, 375), (640, 480), (800, 600), (701, 533)]):
        for quality in (75, 95):
            corpus[f"gray_{w}x{h}_q{quality}"] = encode(photo(h, w, i), mode="L", quality=quality)
    for w, h in ((500, 375), (640, 480), (800, 600)):
        corpus[f"gray_2x2_sampling_{w}x{h}"] = with_gray_sampling(
            encode(photo(h, w, 15), mode="L", quality=85)
        )
    corpus["gray_progressive"] = encode(photo(480, 640, 7), mode="L", quality=85, progressive=True)
    corpus["cmyk"] = encode(photo(300, 400, 8), mode="CMYK", quality=90)
    for subsampling, name in ((0, "444"), (1, "422"), (2, "420")):
        corpus[f"rgb_{name}"] = encode(photo(300, 400, 9), quality=90, subsampling=subsampling)
    corpus["progressive"] = encode(photo(400, 600, 10), quality=85, progressive=True)
    corpus["odd_257x193"] = encode(photo(193, 257, 11), quality=90)
    corpus["rgb_1x1"] = encode(photo(1, 1, 12), quality=90)
    corpus["gray_1x1"] = encode(photo(1, 1, 13), mode="L", quality=90)
    for orientation in range(1, 9):
        corpus[f"exif_{orientation}"] = with_orientation(photo(60, 90, 14), orientation)
    return corpus


@pytest.fixture(scope="session")
def corpus() -> dict[str, bytes]:
    return jpeg_corpus()


@pytest.fixture(scope="module")
def refs(blobs: list[bytes]) -> list[np.ndarray]:
    """Pillow's pixels of each of the module's ``blobs`` (a fixture of the module's own)."""
    return [pil_reference(b) for b in blobs]


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """root/<class>/<n>.jpg with 3 classes of 5, 4 and 3 images, 48x64 each."""
    root = tmp_path / "folder"
    for c, (name, count) in enumerate((("cat", 5), ("dog", 4), ("eel", 3))):
        (root / name).mkdir(parents=True)
        for i in range(count):
            (root / name / f"{i:03d}.jpg").write_bytes(encode(photo(48, 64, seed=10 * c + i), quality=90))
    (root / "dog" / "notes.txt").write_text("not an image")
    return root


def resident_bytes() -> int:
    """This process's resident memory (RSS), after giving freed heap memory back where glibc can.

    RSS, not tracemalloc: tracemalloc does not see torch's allocations, which are the ones that grow.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class SlowSamples(Dataset):
    """``(blob, index)`` after a short sleep, so that reader threads are mid-batch when the consumer
    leaves. Scripts run by the tests import it too."""

    def __init__(self, blobs: Sequence[bytes], delay: float = 0.005) -> None:
        self.blobs = blobs
        self.delay = delay

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        time.sleep(self.delay)
        return self.blobs[index], index


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("threadloader-")]


def wait_for_no_reader_threads(timeout: float = 1.0) -> list[threading.Thread]:
    """Returns the reader threads still alive after ``timeout`` seconds (empty when all ended)."""
    deadline = time.monotonic() + timeout
    while reader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return reader_threads()


@pytest.fixture(autouse=True)
def nvimgcodec_started(request: pytest.FixtureRequest) -> None:
    """GPU tests run with nvImageCodec started on the first GPU, as every loader but a process's first.

    While it starts (seconds), a loader decodes its first batches with Pillow (``started_on_cpu``), so
    without this the first GPU test to build a loader would test Pillow instead of nvImageCodec.
    ``test_gpu.py`` tests that start in a process of its own.
    """
    if GPU_SKIP_REASON is None and request.node.get_closest_marker("gpu") is not None:
        from threadloader.decode.nvimgcodec import NvImageCodecDecoder

        decoder = NvImageCodecDecoder(torch.device("cuda", 0), decode_threads=2)
        if decoder.starting:
            assert decoder.engine in ("capi", "python")  # chooses the engine: nvImageCodec is started


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every test must leave no reader thread behind (the loader's shutdown contract)."""
    yield
    if reader_threads():  # a collection (about 0.2 s with torch loaded) only where threads are left
        gc.collect()
    leaked = wait_for_no_reader_threads(timeout=2.0)
    assert not leaked, f"reader threads still alive after the test: {[t.name for t in leaked]}"


class GatedDecoder(ImageDecoder):
    """Pillow behind a gate: a call blocks until the test opens it, so the queue's state is known.

    ``warms_up`` and ``starting`` are plain attributes: a test sets them to stand for nvImageCodec.
    """

    warms_up = False
    starting = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.sizes: list[int] = []
        self.threads: list[str] = []  # the thread of each call
        self._inner = PillowDecoder()

    def decode(
        self,
        encoded: Sequence[bytes | bytearray | memoryview],
        *,
        stream: None,
        stats: StageRecorder | None = None,
        region_of: RegionOf | None = None,
        pad: bool = False,
    ) -> DecodedBatch:
        self.sizes.append(len(encoded))
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return self._inner.decode(encoded, stream=stream, stats=stats)


class HashesInsideTheLock:
    """A key whose first hashing, which a registry or a pool does inside its lock, runs ``inside()``.

    It stands for the collector, which may run a finalizer at any allocation of any thread, a shared
    structure's own locked code included.
    """

    def __init__(self, inside: Callable[[], object]) -> None:
        self._inside: Callable[[], object] | None = inside

    def __hash__(self) -> int:
        inside, self._inside = self._inside, None
        if inside is not None:
            inside()
        return 0

    def __iter__(self) -> Iterator[object]:  # a stand-in Decoder factory takes a key's fields
        return iter(())


def crops_script(count: int) -> str:
    """Lines of a script (:func:`run_script`) that make ``samples``: ``count`` JPEGs of 200x160 crops
    of the bundled photo, each at its own offset, labelled by their index."""
    return f"""
import io
from importlib import resources

from PIL import Image

photo = Image.open(resources.files("threadloader") / "_sample" / "coffee.jpg").convert("RGB")
samples = []
for i in range({count}):
    out = io.BytesIO()
    photo.crop((i, i, i + 200, i + 160)).save(out, "JPEG", quality=90)
    samples.append((out.getvalue(), i))
"""


def script_process(tmp_path: Path, text: str, *args: str) -> tuple[list[str], dict[str, Any]]:
    """The command and ``subprocess`` keywords that run ``text`` as a script, from the repository root,
    with this checkout first on the path (the script is written to ``tmp_path``)."""
    script = tmp_path / "script.py"
    script.write_text(text)
    root = Path(__file__).parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    return [sys.executable, str(script), *args], {"text": True, "cwd": root, "env": env}


def run_script(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs ``text`` as a script (see :func:`script_process`) to its end."""
    command, options = script_process(tmp_path, text, *args)
    return subprocess.run(command, capture_output=True, timeout=120, **options)


def post_predict(port: int, body: bytes, *, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    """POSTs ``body`` to ``/predict`` on this machine's ``port`` (the example server): status, JSON body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/predict", body)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def run_benchmark(module: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """A benchmark module's smoke run in a subprocess, as CI runs it (its DataLoader workers and threads
    stay out of the test process), on the CPU, with its data cached under ``tmp_path``."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=Path(__file__).resolve().parent.parent,
        env=os.environ | {"THREADLOADER_BENCH_CACHE": str(tmp_path / "data"), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
