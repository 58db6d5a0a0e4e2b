"""The loaders under test, each an endless generator of ``(images, targets)`` batches on the device.

Every factory is a generator function: the first ``next()`` builds the loader (so the caller's
startup timer covers workers, decoders and preloading alike), later ones yield batches forever
(epochs are cycled), and ``close()`` on the generator releases the workers. All yield the same
output: float32 NCHW images in [0, 1] at the set's output size (normalized with ImageNet's mean and
std in the ``--augment`` rows and where ``normalize`` is set), int64 targets, on the device.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from threadloader._seeding import sample_generator
from threadloader.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop
from threadloader.transforms.functional import normalize as normalize_

if TYPE_CHECKING:
    from nvidia import nvimgcodec

Batch = tuple[torch.Tensor, torch.Tensor]
Files = Sequence[tuple[Path, int]]
Size = tuple[int, int]  # (height, width)

BACKENDS = ("default", "hw", "hybrid")


class SkipRow(Exception):
    """A loader cannot run here (no GPU, missing package); the row is reported, not failed."""


def _require_cuda(device: str) -> None:
    """Skip GPU-only loaders on CPU runs."""
    if device != "cuda" or not torch.cuda.is_available():
        raise SkipRow("needs a CUDA device")


def import_optional(module: str) -> Any:
    """Import ``module``, turning only its own absence into a skip (a broken install still fails)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise SkipRow(f"{e.name} is not installed") from e
        raise


def endless_batches(n: int, batch_size: int) -> Iterator[list[int]]:
    """Index lists of full batches, wrapping around the data set so no batch is short."""
    for start in itertools.count(0, batch_size):
        yield [(start + j) % n for j in range(batch_size)]


def to_batch(images: Sequence[torch.Tensor], size: Size) -> torch.Tensor:
    """Stack CHW uint8 images to NCHW float in [0, 1], resizing (bilinear, antialiased) if needed.

    Shared by every GPU-decoding loader so they all pay for the same post-processing.
    """
    if all(tuple(im.shape[-2:]) == size for im in images):
        batch = torch.stack(list(images)).float()
    else:
        batch = torch.cat(
            [
                torch.nn.functional.interpolate(
                    im[None].float(), size=size, mode="bilinear", antialias=True, align_corners=False
                )
                for im in images
            ]
        )
    return batch.div_(255)


# --- Pillow + DataLoader -------------------------------------------------------------------------


class PilDataset(Dataset[tuple[torch.Tensor, int]]):
    """Decodes with Pillow and resizes (or random-crops) on the CPU: the usual torchvision-style pipeline."""

    def __init__(self, files: Files, *, size: Size, augment: bool = False) -> None:
        self.files = list(files)
        self.size = size
        self.augment = _pil_augmentation(size) if augment else None

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


#: Normalization of the ``--augment`` and ``--normalize`` rows (ImageNet's), as a ResNet-50 training
#: pipeline does.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _augmentation(size: Size) -> Any:
    """Training augmentation for the ``--augment`` rows: RandomResizedCrop to ``size`` and a flip."""
    return Compose([RandomResizedCrop(size), RandomHorizontalFlip()])


def _pil_augmentation(size: Size) -> Any:
    """The same augmentation as users run it on Pillow images.

    torchvision's, whose resize on Pillow images is Pillow's (fast on the CPU); threadloader's own
    transforms on CPU tensors where torchvision is missing.
    """
    try:
        from torchvision.transforms import v2
    except ImportError:
        ours = _augmentation(size)
        return lambda image: ours(torch.from_numpy(np.array(image)).permute(2, 0, 1))
    return v2.Compose(
        [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()]
    )


def pil_dataloader(
    files: Files,
    *,
    size: Size,
    batch_size: int,
    workers: int,
    device: str,
    augment: bool = False,
    normalize: bool = False,
) -> Iterator[Batch]:
    """Pillow in ``workers`` forked DataLoader processes, pinned batches copied non-blocking.

    ``normalize``: ImageNet's mean and std, in this process after the copy (so workers send ``uint8``).
    """
    loader = DataLoader(
        PilDataset(files, size=size, augment=augment),
        batch_sampler=endless_batches(len(files), batch_size),
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
        pin_memory=device == "cuda",
    )
    for images, targets in loader:
        floats = images.to(device, non_blocking=True).float().div_(255)
        if augment or normalize:  # a training pipeline normalizes; here on the GPU, after the copy
            floats = normalize_(floats, IMAGENET_MEAN, IMAGENET_STD, inplace=True)
        yield floats, targets.to(device, non_blocking=True)


# --- nvImageCodec in spawned DataLoader workers (the seed notebook's design) -------------------------


class BytesDataset(Dataset[tuple[bytes, int]]):
    """Returns the encoded file, leaving decoding to the collate function."""

    def __init__(self, files: Files) -> None:
        self.files = list(files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        path, label = self.files[index]
        return path.read_bytes(), label


def _decode_params() -> nvimgcodec.DecodeParams:
    """sRGB interleaved RGB, so grayscale JPEGs also come out with three channels."""
    from nvidia import nvimgcodec as nv

    return nv.DecodeParams(color_spec=nv.SRGB, sample_format=nv.I_RGB)


def nv_decode(decoder: nvimgcodec.Decoder, data: Sequence[Any]) -> list[torch.Tensor]:
    """Batch-decode bytes or CodeStreams on torch's current stream, as CHW uint8 CUDA tensors."""
    from nvidia import nvimgcodec as nv

    decoded = decoder.decode(
        [nv.CodeStream(d) if isinstance(d, bytes) else d for d in data],
        params=_decode_params(),
        cuda_stream=torch.cuda.current_stream().cuda_stream,
    )
    failed = sum(im is None for im in decoded)
    if failed:
        raise RuntimeError(f"nvImageCodec could not decode {failed} of {len(data)} images")
    return [torch.as_tensor(im, device="cuda").permute(2, 0, 1) for im in decoded]


class NvImgCodecCollate:
    """Decodes a batch of bytes with one lazily created Decoder per (spawned) worker process.

    Lives at module level because spawn pickles it into each worker. ``augment``: the ``--augment``
    rows' crop and flip, with threadloader's batched transforms (one resampling for the whole batch,
    as ThreadLoader runs them), on whole decoded images; ``normalize`` (implied by ``augment``):
    ImageNet's mean and std.
    """

    def __init__(self, *, size: Size, augment: bool = False, normalize: bool = False) -> None:
        self.size = size
        self.augment = _augmentation(size) if augment else None
        self.normalize = augment or normalize
        self._random = random.Random()
        self._decoder: nvimgcodec.Decoder | None = None

    def __call__(self, samples: list[tuple[bytes, int]]) -> Batch:
        if self._decoder is None:
            from nvidia import nvimgcodec as nv

            self._decoder = nv.Decoder()
            self._random.seed()  # each worker its own crops, not the pickled copy's
        data, labels = zip(*samples, strict=True)
        images: Sequence[torch.Tensor] = nv_decode(self._decoder, data)
        if self.augment is not None:
            params = [self.augment.sample((im.shape[-2], im.shape[-1]), self._random) for im in images]
            images = self.augment.apply_many(list(images), params)
        batch = to_batch(images, self.size)
        if self.normalize:
            batch = normalize_(batch, IMAGENET_MEAN, IMAGENET_STD, inplace=True)
        return batch, torch.tensor(labels)


def spawn_collate_nvimgcodec(
    files: Files,
    *,
    size: Size,
    batch_size: int,
    workers: int,
    device: str,
    augment: bool = False,
    normalize: bool = False,
) -> Iterator[Batch]:
    """Spawned workers decode on the GPU; CUDA batches reach this process through CUDA IPC."""
    _require_cuda(device)
    import_optional("nvidia.nvimgcodec")
    loader = DataLoader(
        BytesDataset(files),
        batch_sampler=endless_batches(len(files), batch_size),
        num_workers=workers,
        multiprocessing_context="spawn",
        collate_fn=NvImgCodecCollate(size=size, augment=augment, normalize=normalize),
    )
    for images, targets in loader:
        yield images, targets.to(device, non_blocking=True)


# --- single-threaded decode ceilings over preloaded bytes ----------------------------------------


def _preload(files: Files, device: str) -> tuple[list[bytes], torch.Tensor]:
    """All encoded files in memory plus all targets on the device: these rows measure decode only."""
    return [p.read_bytes() for p, _ in files], torch.tensor([t for _, t in files], device=device)


def single_decoder_ceiling(
    files: Files, *, size: Size, batch_size: int, backend: str, device: str, crop: str | None = None
) -> Iterator[Batch]:
    """One thread, one Decoder, no file I/O: what a single serialized Decoder can deliver.

    ``crop``: ``None`` decodes whole images; ``"region"`` decodes only a RandomResizedCrop region of
    each (drawn from the header); ``"whole"`` decodes the whole image and crops the same region.
    """
    _require_cuda(device)
    nv = import_optional("nvidia.nvimgcodec")
    kinds = {"hw": nv.BackendKind.HW_GPU_ONLY, "hybrid": nv.BackendKind.HYBRID_CPU_GPU}
    try:
        decoder = nv.Decoder(backends=[nv.Backend(kinds[backend])]) if backend in kinds else nv.Decoder()
    except Exception as e:  # nvImageCodec reports a missing GPU or backend as various errors
        raise SkipRow(f"no nvImageCodec Decoder: {e}") from e
    data, targets = _preload(files, device)
    crops = RandomResizedCrop(size)
    for idx in endless_batches(len(data), batch_size):
        if crop is None:
            images = nv_decode(decoder, [data[i] for i in idx])
        else:
            streams = [nv.CodeStream(data[i]) for i in idx]
            regions = [
                crops.sample((cs.height, cs.width), sample_generator(0, 0, i))
                for cs, i in zip(streams, idx, strict=True)
            ]
            if crop == "region":
                parts = [
                    cs.get_sub_code_stream(region=nv.Region(t, left, t + h, left + w))
                    for cs, (t, left, h, w) in zip(streams, regions, strict=True)
                ]
                images = nv_decode(decoder, parts)
            else:
                images = [
                    image[:, t : t + h, left : left + w]
                    for image, (t, left, h, w) in zip(nv_decode(decoder, streams), regions, strict=True)
                ]
        yield to_batch(images, size), targets[idx]


def torchvision_gpu(files: Files, *, size: Size, batch_size: int, device: str) -> Iterator[Batch]:
    """torchvision's batched nvJPEG decode from one thread, over preloaded bytes."""
    _require_cuda(device)
    io = import_optional("torchvision.io")
    data, targets = _preload(files, device)
    encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    for idx in endless_batches(len(encoded), batch_size):
        images = io.decode_jpeg([encoded[i] for i in idx], device=device, mode=io.ImageReadMode.RGB)
        yield to_batch(images, size), targets[idx]


# --- threadloader --------------------------------------------------------------------------------


def _epochs(loader: Iterable[Batch]) -> Iterator[Batch]:
    """Cycle an epoch-at-a-time iterable forever, refusing to spin on an empty one."""
    while True:
        count = 0
        for batch in loader:
            count += 1
            yield batch
        if not count:
            raise RuntimeError("loader produced an empty epoch")


def threadloader(
    root: Path,
    *,
    size: Size,
    batch_size: int,
    num_threads: int | None,
    device: str,
    augment: bool = False,
    region_decode: bool = True,
    normalize: bool = False,
    channels_last: bool = False,
) -> Iterator[Batch]:
    """threadloader over the directory; ``num_threads=None`` keeps its default.

    With ``augment``: RandomResizedCrop + flip, the crop decoded as its region unless ``region_decode``
    is off (then whole images are decoded and cropped: the comparison row). ``normalize``: ImageNet's
    mean and std.
    """
    module = import_optional("threadloader")
    with module.ThreadLoader(
        root,
        batch_size=batch_size,
        drop_last=True,  # full batches only, as the other rows' endless batch samplers give
        num_threads=num_threads,
        size=size,
        dtype=torch.float32,
        mean=IMAGENET_MEAN if augment or normalize else None,
        std=IMAGENET_STD if augment or normalize else None,
        device=device,
        transform=_augmentation(size) if augment else None,
        channels_last=channels_last,
        region_decode=region_decode,
    ) as loader:
        for images, targets in _epochs(loader):  # targets come back on the CPU, like a DataLoader's
            yield images, targets.to(device, non_blocking=True)
