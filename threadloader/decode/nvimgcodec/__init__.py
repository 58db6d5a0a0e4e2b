"""GPU decoding with nvImageCodec, one module a job.

From the bottom: ``_capi`` (the C API through ctypes: structs, constants, status names),
``_allocators`` (nvImageCodec's allocators in C, ``_alloc.c``, over a CUDA pool; opt-in), ``_jpeg``
(JPEG header reading and rewriting), ``_engines`` (the C API and the Python API behind one batch
interface; the Decoder configurations), ``_registry`` (Decoder pools, claimed by the decoders that use
them and destroyed after), ``_memory`` (decode memory, one allocation a batch), ``_pace`` (which
configuration ``backend="auto"`` decodes the next call on), ``_startup`` (making Decoders; the
self-test, the region check, the CUDA version check), ``_parse`` (the header pass), ``_fallback``
(Pillow for what the GPU gives up on) and ``_decoder`` (:class:`NvImageCodecDecoder`, the phases).
"""

from ._decoder import (
    CAPI_ENV,
    DEFAULT_BACKEND,
    DEFAULT_BATCH_SIZE,
    DEFAULT_GPU_DECODERS,
    QUEUE_ENV,
    REGION_BACKEND,
    NvImageCodecDecoder,
    check_options,
)
from ._engines import BACKENDS, ENGINES, HARDWARE_SHARE, import_nvimgcodec
from ._registry import DecoderRegistry
from ._startup import SHARED, check_cuda_versions, new_decoder

__all__ = [
    "BACKENDS",
    "CAPI_ENV",
    "DEFAULT_BACKEND",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_GPU_DECODERS",
    "ENGINES",
    "HARDWARE_SHARE",
    "QUEUE_ENV",
    "REGION_BACKEND",
    "SHARED",
    "DecoderRegistry",
    "NvImageCodecDecoder",
    "check_cuda_versions",
    "check_options",
    "import_nvimgcodec",
    "new_decoder",
]
