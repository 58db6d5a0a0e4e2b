"""The loaders under test, each an endless generator of ``(images, targets)`` batches on the device.

Every factory is a generator function: the first ``next()`` builds the loader (so the caller's
startup timer covers workers, decoders and preloading alike), later ones yield batches forever
(epochs are cycled), and ``close()`` on the generator releases the workers. All do the :class:`Work`
they are given and yield the same output: float32 NCHW images in [0, 1] at its size (normalized with
ImageNet's mean and std in the augmented and normalized rows), int64 targets, on the device.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import random
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from unittest import mock

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import IMAGENET_MEAN, IMAGENET_STD, Batch, SkipRow, endless, import_optional
from threadloader.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop
from threadloader.transforms.functional import Images, resize, resize_many
from threadloader.transforms.functional import normalize as normalize_

if TYPE_CHECKING:
    from nvidia import nvimgcodec

Files = Sequence[tuple[Path, int]]
Size = tuple[int, int]  # (height, width)
Batches = Generator[Batch, None, None]
T = TypeVar("T")

BACKENDS = ("default", "hw", "hybrid")
"""The ceiling rows' Decoders: nvImageCodec's own choice, the hardware JPEG engine, the hybrid decoder."""


@dataclass(frozen=True)
class Work:
    """What a row delivers: ``batch_size`` images at ``size`` on ``device``, the same in every row.

    ``augment``: RandomResizedCrop + flip + normalize (training augmentation) instead of a resize;
    ``normalize``: ImageNet's mean and std. ``on_built`` is called once the loader is built, before its
    first batch is asked for (where a training row pauses, as a script's own set-up would).
    ``on_stats`` gets a ThreadLoader row's ``loader.stats`` once it is built, for the rows that record
    its host time per stage; other loaders never call it.
    """

    size: Size
    batch_size: int
    device: str
    augment: bool = False
    normalize: bool = False
    on_built: Callable[[], None] = lambda: None
    on_stats: Callable[[Callable[[], Any]], None] = lambda stats: None

    @property
    def normalized(self) -> bool:
        return self.augment or self.normalize


#: The packages each row imports when it builds its loader. A row's process imports them before its
#: start-up is timed (preload): ThreadLoader's are imported with this module, so without it DALI's and
#: nvImageCodec's rows alone counted their imports as start-up.
IMPORTS: dict[str, tuple[str, ...]] = {
    "dali": ("nvidia.dali", "nvidia.dali.fn", "nvidia.dali.plugin.pytorch"),
    "torchvision_gpu": ("torchvision.io",),
    "spawn_collate_nvimgcodec": ("nvidia.nvimgcodec",),
    "single_decoder_ceiling": ("nvidia.nvimgcodec",),
    "pil_dataloader": ("torchvision.transforms.v2",),
}


def preload(loader: str) -> None:
    """Imports what ``loader``'s row imports when it builds (those installed), before it is timed."""
    for name in IMPORTS.get(loader, ()):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _require_cuda(device: str) -> None:
    """Skip GPU-only loaders on CPU runs."""
    if device != "cuda" or not torch.cuda.is_available():
        raise SkipRow("needs a CUDA device")


def endless_batches(n: int, batch_size: int) -> Iterator[list[int]]:
    """Index lists of full batches, wrapping around the data set so no batch is short."""
    for start in itertools.count(0, batch_size):
        yield [(start + j) % n for j in range(batch_size)]


class Wrapping:
    """Indices ``0..n-1`` again and again, ``passes`` times: :func:`endless_batches`'s order as a sampler.

    Sized (a loader counts its batches), and lazy: a loader takes its indices as it goes.
    """

    def __init__(self, n: int, passes: int = 100_000) -> None:
        self.n, self.passes = n, passes

    def __len__(self) -> int:
        return self.n * self.passes

    def __iter__(self) -> Iterator[int]:
        return (i % self.n for i in range(len(self)))


def augmentation(size: Size) -> Compose:
    """Training augmentation: RandomResizedCrop to ``size`` and a flip, threadloader's transforms."""
    return Compose([RandomResizedCrop(size), RandomHorizontalFlip()])


def to_batch(images: Images, size: Size, *, normalize: bool = False) -> torch.Tensor:
    """Stack CHW ``uint8`` images into an NCHW float32 batch in [0, 1] at ``size``, as ThreadLoader does.

    Every GPU-decoding row finishes here with the kernels of ThreadLoader's own output step, so rows
    differ only in how they decode: images of one size are resized together (one ``interpolate``),
    images of different sizes are resampled as one batch (``resize_many``: two batched matrix products,
    not a chain of kernels per image), in float32 (nothing rounded to integers), then scaled and, with
    ``normalize``, normalized with ImageNet's mean and std.
    """
    if not isinstance(images, torch.Tensor) and any(im.shape != images[0].shape for im in images):
        batch = resize_many(images, size, dtype=torch.float32)
    else:
        stacked = images if isinstance(images, torch.Tensor) else torch.stack(list(images))
        batch = resize(stacked.to(torch.float32, copy=True), size)
    batch = batch.div_(255)
    return normalize_(batch, IMAGENET_MEAN, IMAGENET_STD, inplace=True) if normalize else batch


class Finish:
    """What every GPU-decoding row does after decoding: the augmentation, then :func:`to_batch`.

    With ``work.augment``: ThreadLoader's RandomResizedCrop + flip (each step once for the whole batch,
    as ThreadLoader runs them) on the decoded images, with parameters the caller draws (``sample``), so
    that it can also decode only each crop's region.
    """

    def __init__(self, work: Work) -> None:
        self.size, self.normalize = work.size, work.normalized
        self.augment = augmentation(work.size) if work.augment else None

    def sample(self, size: Size, generator: random.Random) -> Any:
        """One image's augmentation parameters (``None`` without augmentation)."""
        return None if self.augment is None else self.augment.sample(size, generator)

    def __call__(self, images: Images, params: Sequence[Any]) -> torch.Tensor:
        if self.augment is not None:
            images = self.augment.apply_many(list(images), params)
        return to_batch(images, self.size, normalize=self.normalize)


# --- DataLoader: Pillow in forked workers, nvImageCodec in spawned ones (the seed notebook's design) --


class PilDataset(Dataset[tuple[torch.Tensor, int]]):
    """Decodes with Pillow and resizes (or random-crops) on the CPU: the usual torchvision-style pipeline.

    The augmentation is torchvision's, whose resize on Pillow images is Pillow's (fast on the CPU);
    threadloader's own transforms on CPU tensors where torchvision is missing.
    """

    def __init__(self, files: Files, work: Work) -> None:
        self.files, self.size = list(files), work.size
        self.augment: Callable[[Image.Image], torch.Tensor] | None = None
        if work.augment:
            try:
                from torchvision.transforms import v2
            except ImportError:
                ours = augmentation(work.size)
                self.augment = lambda image: ours(torch.from_numpy(np.array(image)).permute(2, 0, 1))
            else:
                flip = v2.RandomHorizontalFlip()
                self.augment = v2.Compose(
                    [v2.RandomResizedCrop(work.size, antialias=True), flip, v2.PILToTensor()]
                )

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[index]
        with Image.open(path) as im:
            rgb = im.convert("RGB")
        if self.augment is not None:
            return self.augment(rgb), label
        wh = (self.size[1], self.size[0])
        if rgb.size != wh:
            rgb = rgb.resize(wh, Image.Resampling.BILINEAR)
        return torch.from_numpy(np.array(rgb)).permute(2, 0, 1), label


def pil_dataloader(files: Files, work: Work, *, workers: int) -> Batches:
    """Pillow in ``workers`` forked DataLoader processes, pinned batches copied non-blocking.

    Normalized in this process after the copy, so that workers send ``uint8``.
    """
    loader = DataLoader(
        PilDataset(files, work),
        batch_sampler=endless_batches(len(files), work.batch_size),
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
        pin_memory=work.device == "cuda",
    )
    work.on_built()
    for images, targets in loader:
        floats = images.to(work.device, non_blocking=True).float().div_(255)
        if work.normalized:  # a training pipeline normalizes; here on the GPU, after the copy
            floats = normalize_(floats, IMAGENET_MEAN, IMAGENET_STD, inplace=True)
        yield floats, targets.to(work.device, non_blocking=True)


class BytesDataset(Dataset[tuple[bytes, int]]):
    """Returns the encoded file, leaving decoding to the collate function."""

    def __init__(self, files: Files) -> None:
        self.files = list(files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        path, label = self.files[index]
        return path.read_bytes(), label


def nv_decode(decoder: nvimgcodec.Decoder, data: Sequence[Any]) -> list[torch.Tensor]:
    """Batch-decode bytes or CodeStreams on torch's current stream, as CHW uint8 CUDA tensors.

    sRGB interleaved RGB, so grayscale JPEGs also come out with three channels.
    """
    from nvidia import nvimgcodec as nv

    decoded = decoder.decode(
        [nv.CodeStream(d) if isinstance(d, bytes) else d for d in data],
        params=nv.DecodeParams(color_spec=nv.SRGB, sample_format=nv.I_RGB),
        cuda_stream=torch.cuda.current_stream().cuda_stream,
    )
    failed = sum(im is None for im in decoded)
    if failed:
        raise RuntimeError(f"nvImageCodec could not decode {failed} of {len(data)} images")
    return [torch.as_tensor(im, device="cuda").permute(2, 0, 1) for im in decoded]


class NvImgCodecCollate:
    """Decodes a batch of bytes with one lazily created Decoder per (spawned) worker process.

    Lives at module level because spawn pickles it into each worker; the rest is :class:`Finish`, on
    whole decoded images.
    """

    def __init__(self, work: Work) -> None:
        self.finish = Finish(work)
        self._random = random.Random()
        self._decoder: nvimgcodec.Decoder | None = None

    def __call__(self, samples: list[tuple[bytes, int]]) -> Batch:
        if self._decoder is None:
            from nvidia import nvimgcodec as nv

            self._decoder = nv.Decoder()
            self._random.seed()  # each worker its own crops, not the pickled copy's
        data, labels = zip(*samples, strict=True)
        images = nv_decode(self._decoder, data)
        params = [self.finish.sample((im.shape[-2], im.shape[-1]), self._random) for im in images]
        return self.finish(images, params), torch.tensor(labels)


def spawn_collate_nvimgcodec(files: Files, work: Work, *, workers: int) -> Batches:
    """Spawned workers decode on the GPU; CUDA batches reach this process through CUDA IPC."""
    _require_cuda(work.device)
    import_optional("nvidia.nvimgcodec")
    loader = DataLoader(
        BytesDataset(files),
        batch_sampler=endless_batches(len(files), work.batch_size),
        num_workers=workers,
        multiprocessing_context="spawn",
        collate_fn=NvImgCodecCollate(work),
    )
    work.on_built()
    for images, targets in loader:
        yield images, targets.to(work.device, non_blocking=True)


# --- one thread decoding preloaded bytes: nvImageCodec's single Decoder, torchvision's nvJPEG ---------


Decode = Callable[[list[int], list[bytes], "Finish"], tuple[Any, list[Any]]]
"""A batch's images and their augmentation parameters, from the indices, the preloaded bytes, the finish."""


def _one_thread(files: Files, work: Work, decode: Decode) -> Batches:
    """All encoded files in memory and all targets on the device: these rows measure decoding only.

    The augmentation parameters are drawn from each image's own ``random.Random(index)``: comparable
    work, not ThreadLoader's very crops.
    """
    data = [p.read_bytes() for p, _ in files]
    targets = torch.tensor([t for _, t in files], device=work.device)
    finish = Finish(work)
    for idx in endless_batches(len(data), work.batch_size):
        images, params = decode(idx, data, finish)
        yield finish(images, params), targets[idx]


def single_decoder_ceiling(files: Files, work: Work, *, backend: str, crop: str | None = None) -> Batches:
    """One thread, one Decoder, no file I/O: what a single serialized Decoder can deliver.

    ``crop`` (the augmented rows): ``"region"`` decodes only each crop's region (drawn from the
    header); ``"whole"`` decodes the whole image and crops the same region.
    """
    _require_cuda(work.device)
    nv = import_optional("nvidia.nvimgcodec")
    kinds = {"hw": nv.BackendKind.HW_GPU_ONLY, "hybrid": nv.BackendKind.HYBRID_CPU_GPU}
    try:
        decoder = nv.Decoder(backends=[nv.Backend(kinds[backend])]) if backend in kinds else nv.Decoder()
    except Exception as e:  # nvImageCodec reports a missing GPU or backend as various errors
        raise SkipRow(f"no nvImageCodec Decoder: {e}") from e

    def decode(idx: list[int], data: list[bytes], finish: Finish) -> tuple[list[torch.Tensor], list[Any]]:
        streams = [nv.CodeStream(data[i]) for i in idx]
        params = [
            finish.sample((s.height, s.width), random.Random(i)) for s, i in zip(streams, idx, strict=True)
        ]
        for k, p in enumerate(params if crop == "region" else ()):
            split = finish.augment.split_region(p) if finish.augment is not None else None
            assert split is not None  # augmented, RandomResizedCrop first: every crop has its region
            (t, left, h, w), params[k] = split
            streams[k] = streams[k].get_sub_code_stream(region=nv.Region(t, left, t + h, left + w))
        return nv_decode(decoder, streams), params

    yield from _one_thread(files, work, decode)


def torchvision_gpu(files: Files, work: Work) -> Batches:
    """torchvision's batched nvJPEG decode from one thread, over preloaded bytes; whole images only."""
    _require_cuda(work.device)
    io = import_optional("torchvision.io")

    def decode(idx: list[int], data: list[bytes], finish: Finish) -> tuple[list[torch.Tensor], list[Any]]:
        encoded = [torch.frombuffer(bytearray(data[i]), dtype=torch.uint8) for i in idx]
        images = io.decode_jpeg(encoded, device=work.device, mode=io.ImageReadMode.RGB)
        return images, [
            finish.sample(im.shape[1:], random.Random(i)) for im, i in zip(images, idx, strict=True)
        ]

    yield from _one_thread(files, work, decode)


# --- NVIDIA DALI --------------------------------------------------------------------------------


def dali(root: Path, work: Work, *, workers: int) -> Batches:
    """DALI's own pipeline over the directory, as its ResNet-50 examples build it.

    ``fn.readers.file`` (the class folders in sorted order, as ImageFolder), then on a GPU the
    ``mixed`` decoder, which splits each batch between the hardware JPEG engine and the CUDA decoder
    (``hw_decoder_load``, DALI's default 0.65). Augmented, it decodes only a RandomResizedCrop region
    (``fn.decoders.image_random_crop``, the same scale and ratio ranges: DALI's counterpart of
    ThreadLoader's region decoding), resizes it and flips half the images; otherwise it decodes whole
    images and resizes them (``fn.resize``, bilinear with antialias). ``fn.crop_mirror_normalize``
    makes float32 NCHW in [0, 1], normalized as the other rows. ``workers``: DALI's CPU threads.
    Without a GPU every operator runs on the CPU.
    """
    import_optional("nvidia.dali")
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    gpu = work.device == "cuda"
    scale = IMAGENET_STD if work.normalized else (1.0, 1.0, 1.0)
    shift = IMAGENET_MEAN if work.normalized else (0.0, 0.0, 0.0)
    decoded = {"device": "mixed", "hw_decoder_load": 0.65} if gpu else {"device": "cpu"}

    @pipeline_def(batch_size=work.batch_size, num_threads=workers, device_id=0 if gpu else None)
    def pipeline() -> tuple[Any, Any]:
        jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=False)
        if work.augment:
            area, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
            images = fn.decoders.image_random_crop(
                jpegs, output_type=types.RGB, random_area=area, random_aspect_ratio=ratio, **decoded
            )
            mirror = fn.random.coin_flip(probability=0.5)
        else:
            images, mirror = fn.decoders.image(jpegs, output_type=types.RGB, **decoded), 0
        height, width = work.size
        images = fn.resize(
            images, resize_x=width, resize_y=height, interp_type=types.INTERP_LINEAR, antialias=True
        )
        mean, std = [255 * m for m in shift], [255 * s for s in scale]
        images = fn.crop_mirror_normalize(
            images, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std, mirror=mirror
        )
        return images, labels

    pipe = pipeline()
    pipe.build()
    # Built before the pause, as a script builds it in its set-up: the iterator's constructor runs the
    # first batch and starts prefetching, as ThreadLoader's constructor starts its warm-up.
    # No reader_name: the file reader wraps around, so the iterator is endless like the other rows'.
    iterator = DALIGenericIterator([pipe], ["images", "labels"])
    work.on_built()
    for (outputs,) in iterator:
        yield outputs["images"], outputs["labels"].reshape(-1).long().to(work.device, non_blocking=True)


# --- threadloader --------------------------------------------------------------------------------


def past_the_cpu_start(loader: Any, batches: Iterator[T], *, batch_size: int) -> Generator[T, None, None]:
    """``batches``, those a fresh process's GPU loader decodes with Pillow dropped after the first.

    While nvImageCodec starts (seconds, once per process), a GPU ThreadLoader's readers decode with
    Pillow (docs/design.md, "Starting on the CPU"), so a row's warm-up batches would end inside that
    start and its timed batches begin there, measuring Pillow. The first batch is kept (it is the
    start-up's); after it, batches are taken and dropped until ``stats().started_on_cpu`` has stayed
    the same for as many batches as the loader holds in flight, the Pillow ones among them consumed.
    """
    yield next(batches)
    last = loader.stats().started_on_cpu
    if last:
        in_flight = loader.num_threads * loader.prefetch * -(-loader.decode_batch_size // batch_size)
        unchanged = 0
        while unchanged <= in_flight:
            next(batches)
            count = loader.stats().started_on_cpu
            unchanged, last = (unchanged + 1 if count == last else 0), count
    yield from batches


def with_engine(engine: str | None) -> contextlib.AbstractContextManager[Any]:
    """``THREADLOADER_CAPI`` set for ``engine`` while a loader is built (it is read then), then restored."""
    if engine is None:
        return contextlib.nullcontext()
    return mock.patch.dict(os.environ, {"THREADLOADER_CAPI": "1" if engine == "capi" else "0"})


def threadloader(
    root: Path,
    work: Work,
    *,
    num_threads: int | None,
    region_decode: bool = True,
    channels_last: bool = False,
    options: Mapping[str, Any] | None = None,
    engine: str | None = None,
) -> Batches:
    """threadloader over the directory; ``num_threads=None`` keeps its default.

    Augmented, the crop is decoded as its region unless ``region_decode`` is off (then whole images are
    decoded and cropped: the comparison row). ``options``: more keyword arguments for ``ThreadLoader``
    (``--threadloader-options``), none of ``benchmarks.common.ROW_ARGUMENTS``. ``engine``: ``"capi"`` or
    ``"python"``, nvImageCodec's C API or its Python API (``THREADLOADER_CAPI``, as a user chooses it);
    ``None``: the default.
    """
    module = import_optional("threadloader")
    folder = module.ImageFolder(root)
    with (
        with_engine(engine),
        module.ThreadLoader(
            folder,
            **(options or {}),
            # One long epoch over the set again and again, in the other rows' order: a new epoch drains
            # and refills the readers, which the other rows, endless, never do (the small sets here
            # would put one to six such restarts in every timed window).
            sampler=Wrapping(len(folder)),
            batch_size=work.batch_size,
            drop_last=True,  # full batches only, as the other rows' endless batch samplers give
            num_threads=num_threads,
            size=work.size,
            dtype=torch.float32,
            mean=IMAGENET_MEAN if work.normalized else None,
            std=IMAGENET_STD if work.normalized else None,
            device=work.device,
            transform=augmentation(work.size) if work.augment else None,
            channels_last=channels_last,
            region_decode=region_decode,
        ) as loader,
    ):
        work.on_stats(loader.stats)
        work.on_built()
        for images, targets in past_the_cpu_start(loader, endless(loader), batch_size=work.batch_size):
            yield images, targets.to(work.device, non_blocking=True)  # targets come back on the CPU
