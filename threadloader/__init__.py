"""threadloader: GPU image loading for PyTorch with a pool of threads in one process.

Reader threads read bytes and decode whole batches through a small shared pool of nvImageCodec
decoders (each called by one thread at a time, each thread on its own CUDA stream) and hand them to
the consumer's stream with an event: one CUDA context, no worker processes, no pickling. Without a
GPU, Pillow decodes in the threads and the output is the same.
"""

from ._output import OutputFormat
from ._sources import IMAGE_EXTENSIONS, ImageFolder
from ._stats import STAGES, LoaderStats
from ._tar import ShardError, TarMember, TarShards
from .decode.base import DEFAULT_MAX_PIXELS
from .errors import CPUFallbackWarning, LoaderClosedError, SampleError, ThreadLoaderError
from .loader import ThreadLoader
from .service import BatchDecoder, BatcherStats, MicroBatcher, QueueFullError, ServiceStats

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "IMAGE_EXTENSIONS",
    "STAGES",
    "BatchDecoder",
    "BatcherStats",
    "CPUFallbackWarning",
    "ImageFolder",
    "LoaderClosedError",
    "LoaderStats",
    "MicroBatcher",
    "OutputFormat",
    "QueueFullError",
    "SampleError",
    "ServiceStats",
    "ShardError",
    "TarMember",
    "TarShards",
    "ThreadLoader",
    "ThreadLoaderError",
    "__version__",
]
