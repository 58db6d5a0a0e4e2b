"""python -m threadloader [SOURCE...]: load a folder, images or shards (or sample photos); print throughput.

The quickest check that an installation works and decodes where you expect: on the GPU when one and
nvImageCodec are usable, else on the CPU with Pillow. User errors (a missing or empty folder, bad
options, a bad image) print one line and exit with a non-zero status, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any, NoReturn, cast

import torch
from PIL import Image
from torch.utils.data import Dataset, Subset

from . import ImageFolder, TarShards, ThreadLoader, ThreadLoaderError
from . import _device as devices
from ._encoded import IMAGE_EXTENSIONS
from ._sources import Source, is_folder
from ._tar import is_shard_spec

PROG = "python -m threadloader"


class UsageError(Exception):
    """A mistake in how the command was called: reported in one line, exit status 2."""


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
        image = photo.crop((left, top, left + crop, top + crop))
        image = image.resize((side, side), Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out = io.BytesIO()
        image.save(out, "JPEG", quality=90)
        return out.getvalue(), label

    with ThreadPoolExecutor() as pool:
        return list(pool.map(make, range(count)))


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line (argparse prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {PROG} --help)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _device(text: str) -> str:
    """``--device``: the CPU or a CUDA device, refused here in the command's words (not the library's)."""
    try:
        kind = torch.device(text).type
    except (RuntimeError, TypeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _check_device(device: str | None) -> str | None:
    """The device to pass the library: ``--device``, or the CPU where leaving it out would warn.

    Raises:
        UsageError: For a CUDA device this machine lacks, or one without nvImageCodec; the library's
            errors say ``device='cpu'``, which the command spells ``--device cpu``.
    """
    if device is None:
        if torch.cuda.is_available() and not devices._nvimgcodec_installed():
            # The library would warn, naming device='cpu': one line in the command's words instead.
            print(
                f"{PROG}: note: a CUDA GPU is here, but nvImageCodec is not installed, so images are decoded "
                f"on the CPU: {devices.gpu_decoding_advice()}; --device cpu decodes "
                "on the CPU without this note",
                file=sys.stderr,
            )
            return "cpu"
        return None
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise UsageError(
            f"--device {device}, but no CUDA GPU is usable here; use --device cpu (or leave --device out: "
            "the GPU when one is usable, else the CPU)"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise UsageError(
            f"--device {device}, but this machine has {count} CUDA device(s): "
            + ("cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}")
        )
    if not devices._nvimgcodec_installed():
        raise UsageError(
            f"--device {device} decodes on the GPU, which needs nvImageCodec, not installed here: "
            f"{devices.gpu_decoding_advice()}; or use --device cpu"
        )
    return device


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=(
            "Load an image folder (one sub-folder per class), tar shards, or photos made from the bundled "
            "samples, and print the throughput: on the GPU when one and nvImageCodec are usable, else on "
            "the CPU."
        ),
    )
    parser.add_argument(
        "source",
        nargs="*",
        help="an image folder, a sub-folder per class (or the images alone: no targets); image files; or "
        "tar shards: a brace pattern "
        "'shards/{000000..000127}.tar', a glob 'shards/*.tar' (quoted, or expanded by the shell), or the "
        ".tar files (default: photos made from the bundled samples)",
    )
    parser.add_argument(
        "--count",
        type=_positive_int,
        default=None,
        help="images to load: the first N of the source in its order (a folder's: class by class, files "
        "sorted; shards: in order; default all), or N photos made from the samples (default 1024)",
    )
    parser.add_argument("--batch-size", type=_positive_int, default=64, help="images per batch (default 64)")
    parser.add_argument("--size", type=_positive_int, default=224, help="output side in pixels (default 224)")
    parser.add_argument("--epochs", type=_positive_int, default=3, help="passes over the data (default 3)")
    parser.add_argument(
        "--device", type=_device, default=None, help="cuda, cuda:N or cpu (default: the GPU if usable)"
    )
    parser.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="a bad image stops the run (raise, the default) or is left out and counted (skip)",
    )
    parser.add_argument(
        "--allow-empty",
        action="store_true",
        help="keep class folders with no images as classes without samples, as torchvision's "
        "ImageFolder(allow_empty=True) (default: such a folder is an error, since every later class's "
        "target would shift)",
    )
    return parser


def _source(sources: list[str], count: int | None, *, allow_empty: bool = False) -> Source:
    """What the command loads: the first ``count`` samples of a folder, image files or shards.

    Raises:
        UsageError: For a missing path, a file that is neither an image nor a shard, several sources
            that are not all images or all shards, or a folder with none of them.
    """
    missing = [path for path in sources if not is_shard_spec(path) and not os.path.exists(path)]
    if missing:
        raise UsageError(f"no such file or folder: {missing[0]!r}")
    # A directory is a folder whatever its name (imagenet.tar/cat/1.jpg), as the library's as_source has it.
    if all(is_shard_spec(source) and not os.path.isdir(source) for source in sources):
        source: Source = TarShards(sources)
    elif all(os.path.isfile(path) and path.lower().endswith(IMAGE_EXTENSIONS) for path in sources):
        source = list(sources)
    elif len(sources) > 1:
        raise UsageError(
            f"give one folder, image files, or tar shards (.tar), got {len(sources)} paths that are not all "
            "images or all shards: "
            + ", ".join(repr(source) for source in sources[:3])
            + (", ..." if len(sources) > 3 else "")
        )
    elif not os.path.isdir(sources[0]):
        raise UsageError(
            f"{sources[0]!r} is not an image ({', '.join(IMAGE_EXTENSIONS)}); give a folder, image files, "
            "or .tar shards"
        )
    else:
        source = _folder(sources[0], allow_empty=allow_empty)
    if count is None or count >= len(source):
        return source
    return Subset(cast("Dataset[Any]", source), range(count))  # indexes any map-style source


def _folder(path: str, *, allow_empty: bool = False) -> Source:
    """An :class:`ImageFolder` of class sub-folders, else the folder's images, else its tar shards.

    Sub-folders are classes only when one that is not hidden holds images, so a stray one without them
    (an empty ``.ipynb_checkpoints``) does not make a folder of images a folder of classes: its images
    load alone, without targets, as ``--help`` says. Images and shards are sorted by name.

    Raises:
        UsageError: For a folder with none of them, saying what it holds instead; for class folders
            without images, unless ``allow_empty``: the library's error names
            ``ImageFolder(root, allow_empty=True)``, which the command spells ``--allow-empty``.
    """
    with os.scandir(path) as entries:
        listed = sorted(entries, key=lambda entry: entry.name)
    folders = [entry.name for entry in listed if is_folder(entry)]
    folder: ImageFolder | None = None
    if folders:  # a flat folder is not listed twice
        with contextlib.suppress(FileNotFoundError):  # no sub-folder holds images (or each is a link loop)
            folder = ImageFolder(path, allow_empty=True)
    filled = {folder.classes[target] for _, target in folder.samples} if folder else set()
    if folder and any(not name.startswith(".") for name in filled):
        empty = [name for name in folder.classes if name not in filled]
        if empty and not allow_empty:
            raise UsageError(
                f"class folders with no images ({', '.join(IMAGE_EXTENSIONS)}) in {path!r}: "
                f"{', '.join(map(repr, empty))}; every class after one would get the wrong target: remove "
                "them, or pass --allow-empty to keep them as classes without samples"
            )
        return folder
    files = [entry for entry in listed if entry.is_file()]
    images = [entry.path for entry in files if entry.name.lower().endswith(IMAGE_EXTENSIONS)]
    if images:
        return images
    shards = [entry.path for entry in files if is_shard_spec(entry.name)]
    if shards:
        return TarShards(shards)
    found = [
        what.format(_names(names))
        for what, names in (
            ("sub-folders without images ({})", [name for name in folders if name not in filled]),
            ("hidden sub-folders with images ({}), not classes: give one as the folder", sorted(filled)),
            ("other files ({})", [entry.name for entry in files]),
        )
        if names
    ]
    raise UsageError(
        f"no images ({', '.join(IMAGE_EXTENSIONS)}), class folders or .tar shards in {path!r}: "
        + (f"it holds only {'; '.join(found)}" if found else "it is empty")
    )


def _names(names: list[str]) -> str:
    """The first few of ``names``, quoted: enough to recognise a folder by."""
    return ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def run(args: argparse.Namespace) -> str:
    """A few epochs over the data; returns the line of throughput to print."""
    # The sample photos are made before the clock starts: the first batch's time is the loader's.
    photos = None if args.source else sample_photos(args.count or 1024)
    start = time.perf_counter()
    try:
        source = (
            photos if photos is not None else _source(args.source, args.count, allow_empty=args.allow_empty)
        )
        loader = ThreadLoader(
            source,
            batch_size=args.batch_size,
            shuffle=True,
            seed=0,
            size=(args.size, args.size),
            dtype=torch.float32,
            device=_check_device(args.device),
            on_error=args.on_error,
        )
    except ImportError as exc:  # nvImageCodec there but not importable: its advice, in the command's words
        message = str(exc).replace("pass device='cpu'", "use --device cpu")
        raise UsageError(f"--device {args.device or 'cuda'}: {message}") from exc
    except (ValueError, TypeError, OSError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    with loader:
        device = loader.device
        sync = torch.cuda.current_stream(device).synchronize if device.type == "cuda" else (lambda: None)
        first: float | None = None
        counted = 0  # images after the first batch, which also pays for start-up
        for _ in range(args.epochs):
            for batch, _targets in loader:
                if first is None:
                    sync()
                    first, timed = time.perf_counter() - start, time.perf_counter()
                else:
                    counted += len(batch)
        sync()
        elapsed = time.perf_counter() - timed if first is not None else 0.0
        bad = loader.stats().skipped // args.epochs
    if first is None:
        raise ThreadLoaderError(f"no image could be loaded: every one of the {bad} was bad and skipped")
    where = (
        f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "the CPU (Pillow)"
    )
    rate = f"{counted / elapsed:,.0f} images/s" if counted else "too few images to time"
    skipped = f"; {bad} bad images skipped" if bad else ""
    return (
        f"threadloader: {rate} on {where}; {args.epochs} epoch(s) of {len(source):,} images at "
        f"{args.size}x{args.size} in batches of {args.batch_size}, {loader.num_threads} threads; first batch "
        f"after {first:.2f} s{skipped}"
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the demo and returns the exit status: 0, 1 for a failed run, 2 for a usage error."""
    try:
        args = _parser().parse_args(argv)
        print(run(args))
    except UsageError as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except ThreadLoaderError as exc:
        hint = "; --on-error skip leaves bad images out" if args.on_error == "raise" else ""
        print(f"{PROG}: error: {_one_line(exc)}{hint}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as exc:
        # torch.OutOfMemoryError is the GPU's; "can't allocate memory", its CPU allocator's.
        out_of_memory = not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError)
        if not (out_of_memory or "can't allocate memory" in str(exc)):
            raise
        print(
            f"{PROG}: error: out of memory ({_one_line(exc)}); try a smaller --size or --batch-size",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
