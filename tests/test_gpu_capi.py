"""The C API engine on the GPU: the default where its self-test passes, Pillow's pixels for every EXIF
orientation, nothing written outside an image's memory, and the Python API when the self-test fails.

Run on a machine with an NVIDIA GPU and nvImageCodec: ``python -m pytest -m gpu -q``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from threadloader._stats import StatsRecorder
from threadloader.decode import nvimgcodec as nv_module
from threadloader.decode.nvimgcodec import _allocators, _capi, _engines, _startup
from threadloader.decode.nvimgcodec import _decoder as _decoder_module

from .conftest import encode, gpu_mismatch, photo, pil_reference, with_orientation

pytestmark = pytest.mark.gpu

GUARD = 0xA5


def _decoder(**options: object) -> nv_module.NvImageCodecDecoder:
    """A decoder with a registry of its own: its engine is chosen, and checked, afresh."""
    registry = nv_module.DecoderRegistry(nv_module.new_decoder)
    return nv_module.NvImageCodecDecoder(
        torch.device("cuda", 0), decode_threads=2, registry=registry, **options
    )  # type: ignore[arg-type]


def test_the_c_api_is_the_default_where_its_self_test_passes(caplog: pytest.LogCaptureFixture) -> None:
    _decoder_module._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        assert _decoder().engine == "capi"
    assert not [r for r in caplog.records if "C API" in r.getMessage()]


def test_a_failed_self_test_decodes_through_the_python_api_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_decoder_module, "self_test", lambda *args: "its pixels differ from Pillow's by 80.0")
    _decoder_module._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        decoder = _decoder()
    assert decoder.engine == "python"
    (message,) = [r.getMessage() for r in caplog.records if "C API" in r.getMessage()]
    assert "failed its self-test on cuda:0: its pixels differ from Pillow's by 80.0" in message
    assert "Python API" in message and nv_module.CAPI_ENV in message
    blobs = [encode(photo(40, 60, i), quality=90) for i in range(3)]
    stream = torch.cuda.Stream()
    batch = decoder.decode(blobs, stream=stream, stats=StatsRecorder())
    stream.synchronize()
    for position, data in enumerate(blobs):
        assert gpu_mismatch(batch.image(position), pil_reference(data)) is None  # type: ignore[arg-type]


def test_the_environment_chooses_the_python_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nv_module.CAPI_ENV, "0")
    assert _decoder().engine == "python"
    assert _decoder(engine="capi").engine == "capi"  # an explicit engine wins


@pytest.mark.parametrize("sabotage", ["orientation dropped", "rows too far apart"])
def test_the_self_test_catches_a_broken_binding(monkeypatch: pytest.MonkeyPatch, sabotage: str) -> None:
    """The self-test must fail a binding that loses the EXIF orientation or writes out of bounds."""
    bind = _capi.Workspace.bind

    def broken(self, positions, addresses, shapes, row_strides, **kwargs):  # type: ignore[no-untyped-def]
        if sabotage == "orientation dropped":
            self.infos["rotated"] = 0
            self.infos["flip_x"] = self.infos["flip_y"] = 0
        else:
            row_strides = [stride + 3 * 8 for stride in row_strides]
        return bind(self, positions, addresses, shapes, row_strides, **kwargs)

    monkeypatch.setattr(_capi.Workspace, "bind", broken)
    engine = _engines.engine_named("capi")
    registry = nv_module.DecoderRegistry(nv_module.new_decoder)
    reason = _startup.self_test(engine, registry, ("capi", 0, "cuda", 2, True, 0), 1, torch.device("cuda", 0))
    expected = "pixels differ" if sabotage == "orientation dropped" else "outside the image's memory"
    assert reason is not None and expected in reason, reason


@pytest.mark.parametrize("engine", nv_module.ENGINES)
def test_every_exif_orientation_decodes_as_pillow_into_padded_rows_and_nowhere_else(
    monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """All eight orientations and other sizes in one padded batch: each image as Pillow shows it, at
    the top left of its row (the C API knows each turned shape from the header), the rest untouched."""

    def guarded(self, shape):  # type: ignore[no-untyped-def]
        memory = torch.full(shape, GUARD, dtype=torch.uint8, device=self.device)
        memory.record_stream(torch.cuda.current_stream(self.device))
        return memory

    monkeypatch.setattr(nv_module.NvImageCodecDecoder, "_output_memory", guarded)
    blobs = [with_orientation(photo(60, 90, 14), orientation) for orientation in range(1, 9)]
    blobs += [encode(photo(77, 41, 3), quality=90), encode(photo(33, 101, 4), mode="L", quality=90)]
    decoder = _decoder(engine=engine)
    stream = torch.cuda.Stream()
    batch = decoder.decode(blobs, stream=stream, stats=StatsRecorder(), pad=True)
    stream.synchronize()
    assert not batch.errors
    if engine == "capi":
        assert batch.batch is not None and batch.rows == set(range(len(blobs)))
    for position, data in enumerate(blobs):
        reference = pil_reference(data)
        assert batch.extents[position] == reference.shape[:2], position
        image = batch.image(position)
        assert image is not None and gpu_mismatch(image, reference) is None, position
    if batch.batch is not None:
        memory = batch.batch.cpu().numpy()
        for position in batch.rows:
            height, width = batch.extents[position]  # type: ignore[misc]
            outside = memory[position].copy()
            outside[:height, :width] = GUARD
            assert (outside == GUARD).all(), f"position {position} written outside its image"


@pytest.mark.parametrize("engine", nv_module.ENGINES)
def test_regions_of_turned_images_are_pillows_crops(engine: str) -> None:
    """A region is asked for in the displayed frame, EXIF applied, whatever the orientation."""
    blobs = [with_orientation(photo(60, 90, 15), orientation) for orientation in range(1, 9)]
    asked: dict[int, tuple[int, int]] = {}

    def region_of(position: int, size: tuple[int, int]) -> tuple[int, int, int, int]:
        asked[position] = size
        return (3, 5, size[0] // 2, size[1] // 3)

    decoder = _decoder(engine=engine)
    stream = torch.cuda.Stream()
    batch = decoder.decode(blobs, stream=stream, stats=StatsRecorder(), region_of=region_of)
    stream.synchronize()
    for position, data in enumerate(blobs):
        reference = pil_reference(data)
        assert asked[position] == reference.shape[:2]
        top, left, height, width = region_of(position, reference.shape[:2])
        # A region given up on is decoded whole (the caller crops it).
        expected = (
            reference[top : top + height, left : left + width] if position in batch.regions else reference
        )
        image = batch.image(position)
        assert image is not None
        diff = np.abs(image.cpu().numpy().astype(int) - expected.astype(int))
        assert diff.mean() <= 1.0 and diff.max() <= 24, (position, diff.mean(), diff.max())  # region edges
    assert len(batch.regions) >= 6


def test_nvimgcodec_decodes_from_the_pool_and_gives_it_back_when_its_decoders_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the allocators on (``_alloc.c``, carried or built here), nvImageCodec's device memory comes
    from the pool, pixels stay Pillow's, the same batch again allocates nothing (nvJPEG's buffers
    padded), and the memory its Decoders held goes back to the driver once they are destroyed."""
    monkeypatch.setenv(_allocators.ENV, "1")
    assert _allocators.unavailable(0) is None
    blobs = [encode(photo(300 + 40 * i, 420 - 30 * i, i), quality=90) for i in range(6)]
    registry = nv_module.DecoderRegistry(nv_module.new_decoder, _startup._destroy)
    decoder = nv_module.NvImageCodecDecoder(
        torch.device("cuda", 0), decode_threads=2, registry=registry, backend="cuda"
    )
    stream = torch.cuda.Stream()
    calls = []
    for _ in range(2):
        batch = decoder.decode(blobs, stream=stream, stats=StatsRecorder(), pad=True)
        stream.synchronize()
        calls.append(_allocators.counts())
        assert not batch.errors
        for position, data in enumerate(blobs):
            image = batch.image(position)
            assert image is not None and gpu_mismatch(image, pil_reference(data)) is None, position
    assert calls[0] is not None and calls[0].device_mallocs > 0, calls
    assert calls[1] == calls[0], calls
    held = _allocators.reserved(0)
    assert held >= _allocators.DEVICE_MEMORY_PADDING, held  # nvJPEG's padded buffers, at least
    decoder.close()  # destroys its Decoders, which free into the pool, and trims it
    torch.cuda.synchronize()
    _allocators.trim(0)  # again, once frees queued on nvImageCodec's streams have run
    assert _allocators.reserved(0) < held
