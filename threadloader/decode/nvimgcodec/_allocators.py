"""nvImageCodec's device and pinned allocators over a CUDA memory pool of each device (``_alloc.c``).

Why: nvImageCodec makes its Decoders' device memory with ``cudaMalloc`` and frees it with
``cudaFree`` unless it is given allocators, and ``cudaFree`` waits for the whole GPU: beside a
training step, for the step's queued kernels, once or twice a step (docs/benchmarks.md, "Host calls
that wait for the GPU"). Given allocators, it also pads nvJPEG's device buffers and makes them up
front (:data:`DEVICE_MEMORY_PADDING`, as DALI does), so that they stop growing. These allocate from a
pool of the device's (``cudaMallocFromPoolAsync``) and give back to it in stream order
(``cudaFreeAsync``), which waits for nothing; the pool keeps what it holds until a Decoder is
destroyed (:func:`trim`).

Opt-in (:data:`ENV`): on an H100 beside a ResNet-50 step they took nvImageCodec's allocations to none
a step, but the step ran no faster (within a percent, either way), and nvImageCodec held hundreds of
MB more device memory (docs/benchmarks.md, "Host calls that wait for the GPU").

The allocators are C functions (``_alloc.c``, built with the package where a C compiler is found),
never Python callbacks: nvImageCodec calls them from its own threads. Without the built library, or
without :data:`ENV`, Decoders are made without allocators; :func:`unavailable` says why.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading
from ctypes import POINTER, Structure, c_int, c_size_t, c_ubyte, c_uint64, c_ushort, c_void_p
from typing import NamedTuple

import torch

from ..._checks import env_flag

__all__ = [
    "DEVICE_MEMORY_PADDING",
    "ENV",
    "Allocators",
    "Counts",
    "counts",
    "for_device",
    "reserved",
    "trim",
    "unavailable",
]

#: ``1`` gives Decoders the allocators, read when a Decoder is made; unset or ``0``, nvImageCodec
#: allocates with its own ``cudaMalloc`` and ``cudaFree``.
ENV = "THREADLOADER_NVIMGCODEC_ALLOCATORS"

#: Extra device memory (bytes) nvJPEG's CUDA decoder adds to a buffer when it grows: DALI's default.
DEVICE_MEMORY_PADDING = 16 << 20

#: nvImageCodec 0.9's struct type codes (``nvimgcodecStructureType_t``).
_DEVICE_ALLOCATOR, _PINNED_ALLOCATOR = 3, 4

#: CUDA runtime constants (driver_types.h): pinned allocation, device location, pool attributes.
_PINNED, _ON_DEVICE = 1, 1
_RELEASE_THRESHOLD, _RESERVED_MEM_CURRENT = 4, 5


class _Context(Structure):
    """``tl_context`` of ``_alloc.c``: the CUDA runtime's entry points and the device's pool."""

    _fields_ = [
        ("pool_malloc", c_void_p),
        ("stream_free", c_void_p),
        ("host_malloc", c_void_p),
        ("host_free", c_void_p),
        ("pool", c_void_p),
    ]


class _PoolProps(Structure):
    """``cudaMemPoolProps`` (driver_types.h), 88 bytes on x86-64."""

    _fields_ = [
        ("alloc_type", c_int),
        ("handle_types", c_int),
        ("location_type", c_int),
        ("location_id", c_int),
        ("win32_security_attributes", c_void_p),
        ("max_size", c_size_t),
        ("usage", c_ushort),
        ("reserved", c_ubyte * 54),
    ]


class Allocators(NamedTuple):
    """A device's allocators: addresses of the structs for nvImageCodec's ``ExecutionParams``."""

    device: int
    pinned: int
    pool: int


class Counts(NamedTuple):
    """Calls nvImageCodec made to the allocators so far, all devices together (frees of NULL aside)."""

    device_mallocs: int
    device_frees: int
    pinned_mallocs: int
    pinned_frees: int


class _Unavailable(Exception):
    pass


logger = logging.getLogger("threadloader")

_lock = threading.Lock()
_runtime: tuple[ctypes.CDLL, ctypes.CDLL] | str | None = None  # (the shim, libcudart) or why not
_devices: dict[int, Allocators | str] = {}


def _shim() -> ctypes.CDLL:
    spec = importlib.util.find_spec(f"{__package__}._alloc")
    if spec is None or not spec.origin:
        raise _Unavailable(
            "the allocators' C library (_alloc.c) was not built: reinstall threadloader where a C "
            "compiler is found (pip builds it when one is)"
        )
    shim = ctypes.CDLL(spec.origin)
    shim.tl_setup.argtypes = [
        c_int,
        POINTER(_Context),
        c_int,
        c_int,
        c_size_t,
        c_size_t,
        POINTER(c_void_p),
        POINTER(c_void_p),
    ]
    shim.tl_setup.restype = c_int
    shim.tl_counts.argtypes, shim.tl_counts.restype = [POINTER(c_uint64)], None
    return shim


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch uses, found among the process's mapped files (torch loaded it)."""
    major = (torch.version.cuda or "").split(".")[0]
    name = f"libcudart.so.{major}"
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if name in line}
    except OSError:
        paths = set()
    found = sorted(path for path in paths if os.path.basename(path).startswith(name))
    if not major or not found:
        raise _Unavailable(f"no shared CUDA runtime ({name or 'libcudart'}) is loaded by torch")
    cudart = ctypes.CDLL(found[0])
    for function in ("cudaMemPoolCreate", "cudaMemPoolSetAttribute", "cudaMemPoolGetAttribute"):
        getattr(cudart, function).restype = c_int
    cudart.cudaMemPoolTrimTo.argtypes = [c_void_p, c_size_t]
    return cudart


def _load() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    global _runtime
    if _runtime is None:
        try:
            _runtime = (_shim(), _cudart())
        except (_Unavailable, OSError, AttributeError) as exc:
            _runtime = str(exc)
    if isinstance(_runtime, str):
        raise _Unavailable(_runtime)
    return _runtime


def unavailable(index: int | None = None) -> str | None:
    """Why Decoders (on CUDA device ``index``, if given) are made without allocators, or ``None``."""
    if not env_flag(ENV, default=False):
        return f"{ENV} is not 1 (they are opt-in)"
    with _lock:
        made = _devices.get(index) if index is not None else None
        if isinstance(made, str):
            return made
        try:
            _load()
        except _Unavailable as exc:
            return str(exc)
    return None


def for_device(index: int) -> Allocators | None:
    """The allocators for Decoders on CUDA device ``index``, made on first call; ``None`` without.

    ``None`` where :func:`unavailable` names a reason (logged once a device, at INFO: decoding works
    without them, at a cost beside a busy GPU).
    """
    if not env_flag(ENV, default=False):
        return None
    with _lock:
        if index not in _devices:
            try:
                _devices[index] = _setup(index, *_load())
            except _Unavailable as exc:
                _devices[index] = str(exc)
                logger.info("nvImageCodec allocates with cudaMalloc and cudaFree on cuda:%d: %s", index, exc)
        made = _devices[index]
    return made if isinstance(made, Allocators) else None


def _setup(index: int, shim: ctypes.CDLL, cudart: ctypes.CDLL) -> Allocators:
    props = _PoolProps(alloc_type=_PINNED, location_type=_ON_DEVICE, location_id=index)
    pool = c_void_p()
    status = cudart.cudaMemPoolCreate(ctypes.byref(pool), ctypes.byref(props))
    if status != 0:
        raise _Unavailable(f"cudaMemPoolCreate failed on device {index} (CUDA error {status})")
    # Kept, not handed back to the driver at each synchronization: the point of the pool.
    status = cudart.cudaMemPoolSetAttribute(pool, _RELEASE_THRESHOLD, ctypes.byref(c_uint64(2**64 - 1)))
    if status != 0:
        raise _Unavailable(f"cudaMemPoolSetAttribute failed on device {index} (CUDA error {status})")
    context = _Context(
        *(
            ctypes.cast(getattr(cudart, name), c_void_p).value
            for name in ("cudaMallocFromPoolAsync", "cudaFreeAsync", "cudaHostAlloc", "cudaFreeHost")
        ),
        pool.value,
    )
    device, pinned = c_void_p(), c_void_p()
    padding = 0  # nvJPEG pads its own buffers (its options); the allocators round nothing up
    status = shim.tl_setup(
        index,
        ctypes.byref(context),
        _DEVICE_ALLOCATOR,
        _PINNED_ALLOCATOR,
        padding,
        padding,
        ctypes.byref(device),
        ctypes.byref(pinned),
    )
    if status != 0 or not device.value or not pinned.value:
        raise _Unavailable(f"device index {index} is beyond the allocators' table")
    return Allocators(device.value, pinned.value, int(pool.value or 0))


def _pool_call(index: int, call: str, *args: object) -> int:
    made = _devices.get(index)
    if not isinstance(made, Allocators) or not isinstance(_runtime, tuple):
        return 0
    return int(getattr(_runtime[1], call)(c_void_p(made.pool), *args))


def trim(index: int) -> None:
    """Hands the memory device ``index``'s pool holds but no Decoder uses back to the driver."""
    _pool_call(index, "cudaMemPoolTrimTo", 0)


def reserved(index: int) -> int:
    """Bytes device ``index``'s pool holds from the driver (0 where it has none)."""
    value = c_uint64()
    if _pool_call(index, "cudaMemPoolGetAttribute", _RESERVED_MEM_CURRENT, ctypes.byref(value)) != 0:
        return 0
    return value.value


def counts() -> Counts | None:
    """The allocators' calls so far (:class:`Counts`); ``None`` where no Decoder has been given them."""
    if not isinstance(_runtime, tuple):
        return None
    out = (c_uint64 * 4)()
    _runtime[0].tl_counts(out)
    return Counts(*out)
