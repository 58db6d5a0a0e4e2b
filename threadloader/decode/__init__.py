"""Decoders behind one small interface: nvImageCodec on the GPU, Pillow on the CPU.

A decoder of one's own (``decoder=`` of the front ends) subclasses :class:`ImageDecoder`; every type in
its signature is exported here.
"""

from .._regions import RegionOf
from .._stats import StatsRecorder
from .base import DecodedBatch, Encoded, ImageDecoder
from .nvimgcodec import BACKENDS, NvImageCodecDecoder
from .pillow import PillowDecoder

__all__ = [
    "BACKENDS",
    "DecodedBatch",
    "Encoded",
    "ImageDecoder",
    "NvImageCodecDecoder",
    "PillowDecoder",
    "RegionOf",
    "StatsRecorder",
]
