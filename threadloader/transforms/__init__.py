"""Transforms of decoded images, with torchvision.transforms.v2's semantics and parameters.

Give them to a loader's or service's ``transform=``: they run in the reader threads, on the device that
holds the pixels, each step once per batch. :class:`Transform` is their base class and protocol (the
type ``transform=`` takes). The kernels they call, pure functions on tensors, are in
:mod:`threadloader.transforms.functional`.
"""

from ._geometry import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, Resize
from ._misc import Normalize, ToDtype
from ._transform import Compose, Transform

__all__ = [
    "CenterCrop",
    "Compose",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "ToDtype",
    "Transform",
]
