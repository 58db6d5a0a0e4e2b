"""nvImageCodec's allocators in C (``_alloc.c``): each forwards to the CUDA runtime call it stands for,
with the device's pool and the caller's stream, in structs of nvimgcodec.h's layout.

No GPU here: Python functions stand in for the CUDA runtime's, and the tests call the allocators
through the structs nvImageCodec would read, as it would. The GPU side (nvImageCodec allocating from the
pool, the pool trimmed after) is ``tests/test_gpu_capi.py``'s.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from collections.abc import Callable, Iterator
from ctypes import CFUNCTYPE, POINTER, Structure, c_int, c_size_t, c_uint, c_void_p

import pytest

from threadloader.decode.nvimgcodec import _allocators
from threadloader.decode.nvimgcodec._engines import decoder_options

_SPEC = importlib.util.find_spec("threadloader.decode.nvimgcodec._alloc")
if _SPEC is None or not _SPEC.origin:
    pytest.skip("the allocators' C library was not built (no C compiler at install)", allow_module_level=True)

_ALLOC = CFUNCTYPE(c_int, c_void_p, POINTER(c_void_p), c_size_t, c_void_p)
_FREE = CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, c_void_p)


class Allocator(Structure):
    """nvimgcodecDeviceAllocator_t (and nvimgcodecPinnedAllocator_t) of nvimgcodec.h 0.9, lines 287-316."""

    _fields_ = [
        ("struct_type", c_int),
        ("struct_size", c_size_t),
        ("struct_next", c_void_p),
        ("malloc", _ALLOC),
        ("free", _FREE),
        ("ctx", c_void_p),
        ("padding", c_size_t),
    ]


class Runtime:
    """Stand-ins for cudaMallocFromPoolAsync, cudaFreeAsync, cudaHostAlloc and cudaFreeHost."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.status = 0

        def pool_malloc(ptr: object, size: int, pool: int | None, stream: int | None) -> int:
            ptr[0] = 0x1000 + size  # type: ignore[index]
            self.calls.append(("cudaMallocFromPoolAsync", size, pool, stream))
            return self.status

        def stream_free(ptr: int | None, stream: int | None) -> int:
            self.calls.append(("cudaFreeAsync", ptr, stream))
            return self.status

        def host_malloc(ptr: object, size: int, flags: int) -> int:
            ptr[0] = 0x2000 + size  # type: ignore[index]
            self.calls.append(("cudaHostAlloc", size, flags))
            return self.status

        def host_free(ptr: int | None) -> int:
            self.calls.append(("cudaFreeHost", ptr))
            return self.status

        self.functions = [
            CFUNCTYPE(c_int, POINTER(c_void_p), c_size_t, c_void_p, c_void_p)(pool_malloc),
            CFUNCTYPE(c_int, c_void_p, c_void_p)(stream_free),
            CFUNCTYPE(c_int, POINTER(c_void_p), c_size_t, c_uint)(host_malloc),
            CFUNCTYPE(c_int, c_void_p)(host_free),
        ]


POOL, STREAM = 0xB00, 0x5EA


@pytest.fixture
def setup() -> Iterator[tuple[Runtime, Allocator, Allocator]]:
    shim = _allocators._shim()
    runtime = Runtime()
    context = _allocators._Context(*(ctypes.cast(f, c_void_p).value for f in runtime.functions), POOL)
    device, pinned = c_void_p(), c_void_p()
    made = shim.tl_setup(5, ctypes.byref(context), 3, 4, 64, 128, ctypes.byref(device), ctypes.byref(pinned))
    assert made == 0
    yield runtime, Allocator.from_address(device.value), Allocator.from_address(pinned.value)


Setup = tuple[Runtime, Allocator, Allocator]


def test_the_structs_have_nvimgcodecs_layout_and_type_codes(setup: Setup) -> None:
    _, device, pinned = setup
    # 24-byte header, two function pointers, the context and the padding: sizeof 56 in the header.
    assert (device.struct_type, device.struct_size, device.struct_next, device.padding) == (3, 56, None, 64)
    assert (pinned.struct_type, pinned.struct_size, pinned.struct_next, pinned.padding) == (4, 56, None, 128)
    assert device.ctx and device.ctx == pinned.ctx


@pytest.mark.parametrize(
    ("side", "size", "calls"),
    [
        (
            "device",
            4096,
            lambda ptr: [("cudaMallocFromPoolAsync", 4096, POOL, STREAM), ("cudaFreeAsync", ptr, STREAM)],
        ),
        ("pinned", 512, lambda ptr: [("cudaHostAlloc", 512, 0), ("cudaFreeHost", ptr)]),
    ],
)
def test_each_allocator_forwards_to_its_cuda_calls(
    setup: Setup, side: str, size: int, calls: Callable[[int], list[tuple[object, ...]]]
) -> None:
    """Device memory comes from the device's pool on the caller's stream and goes back on it; pinned
    memory is cudaHostAlloc's. The pointer CUDA wrote is the one the caller gets, and frees."""
    runtime, device, pinned = setup
    allocator = device if side == "device" else pinned
    ptr = c_void_p()
    assert allocator.malloc(allocator.ctx, ctypes.byref(ptr), size, STREAM) == 0
    assert ptr.value == (0x1000 if side == "device" else 0x2000) + size
    assert allocator.free(allocator.ctx, ptr.value, size, STREAM) == 0
    assert runtime.calls == calls(ptr.value)


def test_the_calls_are_counted(setup: Setup) -> None:
    _, device, pinned = setup
    before = _counts()
    ptr = c_void_p()
    for allocator in (device, device, pinned):
        allocator.malloc(allocator.ctx, ctypes.byref(ptr), 8, STREAM)
        allocator.free(allocator.ctx, ptr.value, 8, STREAM)
        allocator.free(allocator.ctx, None, 8, STREAM)  # not a call that reaches CUDA
    assert [after - was for after, was in zip(_counts(), before, strict=True)] == [2, 2, 1, 1]


def _counts() -> list[int]:
    out = (ctypes.c_uint64 * 4)()
    _allocators._shim().tl_counts(out)
    return list(out)


def test_freeing_null_does_nothing_and_succeeds(setup: Setup) -> None:
    runtime, device, pinned = setup
    assert device.free(device.ctx, None, 0, STREAM) == 0
    assert pinned.free(pinned.ctx, None, 0, STREAM) == 0
    assert runtime.calls == []


def test_a_cuda_error_reaches_nvimgcodec(setup: Setup) -> None:
    runtime, device, pinned = setup
    runtime.status = 2  # cudaErrorMemoryAllocation
    ptr = c_void_p()
    assert device.malloc(device.ctx, ctypes.byref(ptr), 1, STREAM) == 2
    assert pinned.malloc(pinned.ctx, ctypes.byref(ptr), 1, STREAM) == 2


@pytest.mark.parametrize("index", [-1, 64])
def test_a_device_beyond_the_table_is_refused(index: int) -> None:
    shim = _allocators._shim()
    context = _allocators._Context()
    out = c_void_p(), c_void_p()
    assert shim.tl_setup(index, ctypes.byref(context), 3, 4, 0, 0, *map(ctypes.byref, out)) == -1
    assert out[0].value is None and out[1].value is None


def test_the_pool_props_have_cudas_layout() -> None:
    # cudaMemPoolProps (driver_types.h): allocType, handleTypes, location {type, id},
    # win32SecurityAttributes, maxSize, usage, reserved[54]: 88 bytes.
    props = _allocators._PoolProps
    assert (props.location_id.offset, props.max_size.offset, props.usage.offset) == (12, 24, 32)
    assert ctypes.sizeof(props) == 88


def test_without_the_environments_consent_or_a_cuda_runtime_it_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for unset in ("", "0"):
        monkeypatch.setenv(_allocators.ENV, unset)
        assert _allocators.unavailable() == f"{_allocators.ENV} is not 1 (they are opt-in)"
        assert _allocators.for_device(0) is None
    monkeypatch.setenv(_allocators.ENV, "1")
    import torch

    if torch.version.cuda is None:  # a CPU build: no libcudart to forward to
        assert "CUDA runtime" in (_allocators.unavailable() or "")


def test_allocators_turn_on_nvjpegs_device_padding_and_preallocation() -> None:
    """nvImageCodec ignores both without allocators (its cuda_decoder.cpp), so they go with them."""
    given = decoder_options(fancy_upsampling=True, batch=64, allocators=True).split()
    assert "nvjpeg_cuda_decoder:device_memory_padding=16777216" in given
    assert "nvjpeg_cuda_decoder:preallocate_buffers=1" in given
    without = decoder_options(fancy_upsampling=True, batch=64)
    assert "device_memory_padding" not in without and "preallocate_buffers" not in without


def test_a_device_without_allocators_says_why_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(_allocators.ENV, "1")
    monkeypatch.setattr(_allocators, "_devices", {})
    monkeypatch.setattr(_allocators, "_runtime", "no CUDA runtime here (the test's)")
    with caplog.at_level(logging.INFO, logger="threadloader"):
        assert _allocators.for_device(7) is None
        assert _allocators.for_device(7) is None
    assert _allocators.unavailable(7) == "no CUDA runtime here (the test's)"
    assert _allocators.counts() is None
    assert [r.getMessage() for r in caplog.records] == [
        "nvImageCodec allocates with cudaMalloc and cudaFree on cuda:7: no CUDA runtime here (the test's)"
    ]
