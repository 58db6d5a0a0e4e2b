"""GPU transforms: region decoding for random crops against whole decode + crop and the CPU path.

Run on a machine with an NVIDIA GPU and nvImageCodec: ``python -m pytest -m gpu -q``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from threadloader import ThreadLoader
from threadloader._options import REGION_DECODE_ENV
from threadloader.decode import nvimgcodec as nv_module
from threadloader.transforms import (
    CenterCrop,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToDtype,
    functional,
)
from threadloader.transforms.functional import resample_many

from .conftest import gpu_mismatch, jpeg_corpus, photo
from .golden import make_golden as golden

pytestmark = pytest.mark.gpu

#: Every JPEG of the corpus (gray, CMYK, progressive, subsampling, 1x1, all EXIF orientations), twice.
SAMPLES = [(data, i) for i, (_, data) in enumerate(sorted(jpeg_corpus().items()) * 2)]


def _crops(
    device: str,
    *,
    num_threads: int = 2,
    seed: int = 5,
    region_decode: bool | None = None,
    decoder: nv_module.NvImageCodecDecoder | None = None,
) -> tuple[dict[int, torch.Tensor], object]:
    transform = [RandomResizedCrop(48), RandomHorizontalFlip()]
    with ThreadLoader(
        SAMPLES,
        batch_size=8,
        seed=seed,
        device=device,
        num_threads=num_threads,
        transform=transform,
        region_decode=region_decode,
        decoder=decoder,
    ) as loader:
        images = {
            target: image
            for batch, targets in loader
            for image, target in zip(batch.cpu(), targets.tolist(), strict=True)
        }
        return images, loader.stats()


def _far(ours: dict[int, torch.Tensor], reference: dict[int, torch.Tensor]) -> dict[int, str]:
    """The crops out of GPU_TOLERANCE of the reference's (nvJPEG against libjpeg, region edges)."""
    found = {i: gpu_mismatch(ours[i], reference[i]) for i in ours}
    return {i: problem for i, problem in found.items() if problem is not None}


def test_region_decoding_gives_the_cpu_paths_crops() -> None:
    gpu, stats = _crops("cuda")
    cpu, _ = _crops("cpu")
    assert stats.region_decodes >= len(SAMPLES) // 2  # type: ignore[attr-defined]
    assert sorted(gpu) == sorted(cpu) == list(range(len(SAMPLES)))
    assert _far(gpu, cpu) == {}


def test_region_decoding_equals_whole_decode_and_crop() -> None:
    regions, with_regions = _crops("cuda")
    whole, without = _crops("cuda", region_decode=False)
    assert with_regions.region_decodes > 0 and without.region_decodes == 0  # type: ignore[attr-defined]
    assert _far(regions, whole) == {}


def test_the_environment_turns_region_decoding_off_when_the_loader_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(REGION_DECODE_ENV, "0")
    loader = ThreadLoader(SAMPLES, batch_size=8, device="cuda", transform=[RandomResizedCrop(48)])
    monkeypatch.delenv(REGION_DECODE_ENV)  # read once, at construction
    with loader:
        assert sum(len(targets) for _, targets in loader) == len(SAMPLES)
        assert loader.stats().region_decodes == 0  # type: ignore[attr-defined]


class _Verdict(nv_module.DecoderRegistry):
    """A registry of its own whose region check gives ``works``, whatever the GPU does."""

    def __init__(self, works: bool, new_decoder=nv_module.new_decoder) -> None:  # type: ignore[no-untyped-def]
        super().__init__(new_decoder)
        self._works = works

    def verdict(self, subject, check) -> bool:  # type: ignore[no-untyped-def]
        return super().verdict(subject, (lambda: self._works) if subject[0] == "regions" else check)


def _decoder_with(registry: nv_module.DecoderRegistry) -> nv_module.NvImageCodecDecoder:
    return nv_module.NvImageCodecDecoder(torch.device("cuda", 0), decode_threads=2, registry=registry)


def test_a_gpu_failing_the_region_check_decodes_whole_images() -> None:
    images, stats = _crops("cuda", decoder=_decoder_with(_Verdict(False)))
    reference, _ = _crops("cpu")
    assert stats.region_decodes == 0  # type: ignore[attr-defined]
    assert _far(images, reference) == {}


def test_the_region_check_passes_on_this_gpu() -> None:
    decoder = nv_module.NvImageCodecDecoder(torch.device("cuda", 0), decode_threads=2)
    assert decoder._check_regions()


def test_crops_are_the_same_for_any_thread_count_on_the_gpu() -> None:
    one, _ = _crops("cuda", num_threads=1)
    four, _ = _crops("cuda", num_threads=4)
    assert all(torch.equal(one[i], four[i]) for i in one)
    other_seed, _ = _crops("cuda", seed=6)
    assert sum(not torch.equal(one[i], other_seed[i]) for i in one) > len(one) // 2


def test_transforms_on_cuda_tensors_match_the_cpu() -> None:
    image = torch.from_numpy(photo(75, 101, 3)).permute(2, 0, 1).contiguous()
    others = [torch.from_numpy(photo(h, w, 4)).permute(2, 0, 1) for h, w in ((40, 60), (90, 33), (75, 101))]
    regions = [(0, 0, 40, 60), (10, 3, 50, 20), (5, 7, 60, 80)]
    cases = {
        "resize": lambda x: Resize(50)(x),
        "resize_exact": lambda x: Resize((33, 47))(x),
        "center_crop": lambda x: CenterCrop(40)(x),
        "random_resized_crop": lambda x: RandomResizedCrop(32).apply(x, (5, 9, 50, 61)),
        "flip": lambda x: RandomHorizontalFlip(1.0)(x),
        "normalize": lambda x: Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))(
            ToDtype(torch.float32, scale=True)(x)
        ),
    }
    for name, transform in cases.items():
        on_cpu, on_gpu = transform(image), transform(image.cuda()).cpu()
        if on_cpu.is_floating_point():
            torch.testing.assert_close(on_gpu, on_cpu, rtol=0, atol=1e-5, msg=name)
        else:
            assert (on_gpu.int() - on_cpu.int()).abs().max() <= 1, name
    batched_cpu = resample_many(others, regions, (24, 24))
    batched_gpu = resample_many([o.cuda() for o in others], regions, (24, 24)).cpu()
    assert (batched_gpu.int() - batched_cpu.int()).abs().max() <= 1


def test_batched_resampling_in_chunks_matches_each_image_resized_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Large batches are resampled in chunks of bounded memory, each chunk with its own weights:
    each image's rows must still get its own weights. The reference is torch's resize of each crop
    on the CPU (``resample_many``'s CPU path), in uint8 and in float."""
    sizes = ((40, 60), (90, 33), (75, 101), (64, 64), (33, 90))
    others = [torch.from_numpy(photo(h, w, 10 + i)).permute(2, 0, 1) for i, (h, w) in enumerate(sizes)]
    regions = [(0, 0, 40, 60), (10, 3, 50, 20), (5, 7, 60, 80), (0, 0, 64, 64), (3, 10, 30, 70)]
    expected = resample_many(others, regions, (24, 28))
    expected_float = resample_many(others, regions, (24, 28), dtype=torch.float32)
    padded = functional._elements_per_image(3, (90, 101), (24, 28))  # one image of the padded size
    for per_chunk in (1, 2, 5):
        monkeypatch.setattr(functional, "_RESAMPLE_ELEMENTS", per_chunk * padded)
        on_gpu = resample_many([o.cuda() for o in others], regions, (24, 28)).cpu()
        assert (on_gpu.int() - expected.int()).abs().max() <= 1, per_chunk
        as_float = resample_many([o.cuda() for o in others], regions, (24, 28), dtype=torch.float32).cpu()
        torch.testing.assert_close(as_float, expected_float, rtol=0, atol=1e-3, msg=str(per_chunk))


def test_regions_the_gpu_gives_up_on_are_decoded_whole_on_the_gpu(caplog: pytest.LogCaptureFixture) -> None:
    """Region decodes that return nothing (as nvImageCodec issue #55 reports) are retried whole on
    the GPU and cropped; when most of a call fails, the device stops decoding regions, with a warning."""

    class NoRegions:  # a Python API Decoder that gives up on everything
        def decode(self, sources, **kwargs):  # type: ignore[no-untyped-def]
            return [None] * len(sources)

    def failing_regions(engine: str, index: int, backend: str, threads: int, fancy: bool, batch: int):  # type: ignore[no-untyped-def]
        if backend != nv_module.REGION_BACKEND:
            return nv_module.new_decoder(engine, index, backend, threads, fancy, batch)
        if engine == "python":
            return NoRegions()
        # A C API Decoder of kind GPU_ONLY: nvImageCodec 0.9 has no JPEG decoder of that kind.
        instance = nv_module._capi.load()
        return nv_module._capi.Decoder(
            instance, device_id=index, backends=[(nv_module._capi.GPU_ONLY, 1.0)], cpu_threads=threads
        )

    _, whole = _crops("cuda", region_decode=False)
    with caplog.at_level("WARNING", logger="threadloader"):
        images, stats = _crops("cuda", decoder=_decoder_with(_Verdict(True, failing_regions)))
    reference, _ = _crops("cpu")
    assert stats.region_decodes == 0  # type: ignore[attr-defined]
    assert stats.cpu_fallbacks == whole.cpu_fallbacks  # type: ignore[attr-defined]  # retried on the GPU
    assert any("region decoding failed" in record.getMessage() for record in caplog.records)
    assert _far(images, reference) == {}


def test_transforms_on_cuda_tensors_match_torchvision() -> None:
    """The transforms on CUDA tensors against torchvision's outputs (tests/golden; test_golden.py runs
    the same cases on the CPU)."""
    with np.load(golden.PATH) as saved:
        reference = {key: saved[key] for key in saved.files}
    image = golden.chw(reference["input/image"]).cuda()

    def within_one(ours: torch.Tensor, key: str) -> None:
        diff = (ours.cpu().int() - torch.from_numpy(reference[key]).int()).abs()
        assert int(diff.max()) <= 1 and float(diff.float().mean()) <= 0.3, key

    for key, size in golden.RESIZE_SIZES.items():
        within_one(Resize(size)(image), f"resize/{key}/uint8")
        expected = torch.from_numpy(reference[f"resize/{key}/float32"])
        torch.testing.assert_close(Resize(size)(image.float() / 255).cpu(), expected, rtol=0, atol=1e-5)
    for key, size in golden.CENTER_CROP_SIZES.items():
        assert np.array_equal(CenterCrop(size)(image).cpu().numpy(), reference[f"center_crop/{key}"]), key
    for seed in golden.CROP_SEEDS:
        crop = RandomResizedCrop(golden.CROP_SIZE)(image, generator=torch.Generator().manual_seed(seed))
        within_one(crop, f"random_resized_crop/{seed}")
    normalized = Normalize(golden.MEAN, golden.STD)(ToDtype(torch.float32, scale=True)(image)).cpu()
    torch.testing.assert_close(normalized, torch.from_numpy(reference["normalize"]), rtol=0, atol=1e-5)
