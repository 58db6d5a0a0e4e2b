"""Checks of transform values shared by the torch ops and the GPU kernel, so both refuse the same."""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["check_std"]


@lru_cache(maxsize=64)
def check_std(std: tuple[float, ...], dtype: torch.dtype) -> None:
    """Refuses a ``std`` with a value that is zero in ``dtype``, the type the division is computed in.

    A std nonzero as a Python float can still underflow there (1e-46 in float32, 1e-8 in float16) and
    turn every pixel into inf or NaN; torchvision's ``functional.normalize`` refuses it, with this
    message (v2's ``Normalize`` checks the Python floats only). The check is made on the host, once per
    values and dtype: never a sync with the GPU.

    Raises:
        ValueError: Naming the std and the dtype.
    """
    if bool((torch.tensor(std, dtype=dtype) == 0).any()):
        raise ValueError(
            f"std evaluated to zero after conversion to {dtype}, leading to division by zero: got "
            f"std={std!r}; use values that are not zero in {dtype}"
        )
