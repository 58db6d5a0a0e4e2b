"""Per-sample randomness: a random transform's parameters as a function of (seed, epoch, sample index).

For a sample its epoch gives more than once, of which time it is too. Drawn this way, a sample's crop
does not depend on which thread made it, nor on the path (GPU region, GPU whole, CPU), so runs repeat
whatever the thread count.
"""

from __future__ import annotations

import random

import torch

__all__ = ["RandomSource", "draws", "sample_generator"]

#: Where random parameters come from: a ``random.Random`` (what a loader uses for each sample: a few
#: microseconds for all of a sample's draws), a ``torch.Generator`` (torchvision's own draws, so the same
#: seed gives torchvision's regions; tens of microseconds), or ``None``: torch's global generator.
RandomSource = random.Random | torch.Generator | None

_MASK64 = (1 << 64) - 1


def sample_generator(seed: int, epoch: int, index: int, repeat: int = 0) -> random.Random:
    """A generator for one sample's random parameters: a function of (seed, epoch, index, repeat) only.

    ``repeat``: how many times the epoch gave the sample before (a sampler's repeats); a first time's
    key is (seed, epoch, index), as before repeats counted. A ``random.Random``: a sample's draws cost a
    few microseconds, against tens with torch's.
    """
    mixed = 0x9E3779B97F4A7C15
    for value in (seed, epoch, index, repeat) if repeat else (seed, epoch, index):
        mixed = ((mixed ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        mixed ^= mixed >> 31
    return random.Random(mixed)


class _TorchDraws:
    """torchvision's draws from a torch generator, under ``random.Random``'s method names."""

    __slots__ = ("_generator",)

    def __init__(self, generator: torch.Generator | None) -> None:
        self._generator = generator

    def uniform(self, low: float, high: float) -> float:
        return torch.empty(1).uniform_(low, high, generator=self._generator).item()

    def randrange(self, start: int, stop: int) -> int:
        return int(torch.randint(start, stop, size=(1,), generator=self._generator).item())

    def random(self) -> float:
        return torch.rand(1, generator=self._generator).item()


def draws(generator: RandomSource) -> random.Random | _TorchDraws:
    """``generator`` with ``random.Random``'s methods, whichever kind it is."""
    return generator if isinstance(generator, random.Random) else _TorchDraws(generator)
