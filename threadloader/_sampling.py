"""Which sample indices go in which batch, epoch by epoch.

The plan is computed on the consumer's side of the pipeline and numbered, so the order of batches and
of samples within them is exactly the sampler's, whatever the reader threads' timing. Shuffling is a
pure function of ``(seed, epoch)``: the same seed gives the same order on every run and thread count.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from itertools import islice
from typing import Any

import numpy as np

__all__ = ["BatchPlan", "group_batches"]


class BatchPlan:
    """Turns ``batch_size``/``shuffle``/``sampler``/``batch_sampler`` into lists of indices.

    Follows ``torch.utils.data.DataLoader``'s rules for which options combine, with the same errors.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        batch_size: int | None,
        shuffle: bool,
        seed: int,
        sampler: Iterable[int] | None,
        batch_sampler: Iterable[list[int]] | None,
        drop_last: bool,
    ) -> None:
        if batch_sampler is not None:
            if batch_size is not None or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler and "
                    "drop_last (leave those at their defaults: the batch_sampler decides them)"
                )
        else:
            if batch_size is None or batch_size < 1:
                raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
            if sampler is not None and shuffle:
                raise ValueError(
                    "sampler option is mutually exclusive with shuffle (the sampler decides order)"
                )
        self._num_samples = num_samples
        self._batch_size = batch_size or 1
        self._shuffle = shuffle
        self._seed = seed
        self._sampler = sampler
        self._batch_sampler = batch_sampler
        self._drop_last = drop_last

    def __len__(self) -> int:
        if self._batch_sampler is not None:
            return _length_of(self._batch_sampler, "batch_sampler")
        n = self._num_samples if self._sampler is None else _length_of(self._sampler, "sampler")
        return n // self._batch_size if self._drop_last else -(-n // self._batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Forwards the epoch to a sampler that wants it (``DistributedSampler`` and the like)."""
        for obj in (self._sampler, self._batch_sampler):
            if obj is not None and callable(getattr(obj, "set_epoch", None)):
                obj.set_epoch(epoch)  # type: ignore[union-attr]

    def batches(self, epoch: int) -> Iterator[list[int]]:
        """Yields the batches of one epoch, lazily (samplers may be long)."""
        if self._batch_sampler is not None:
            for batch in self._batch_sampler:
                yield [int(i) for i in batch]
            return
        indices = iter(self._indices(epoch))
        while batch := [int(i) for i in islice(indices, self._batch_size)]:
            if len(batch) < self._batch_size and self._drop_last:
                return
            yield batch

    def _indices(self, epoch: int) -> Iterable[Any]:
        if self._sampler is not None:
            return self._sampler
        if self._shuffle:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self._seed, epoch])))
            return rng.permutation(self._num_samples).tolist()
        return range(self._num_samples)


def _length_of(obj: object, name: str) -> int:
    if not isinstance(obj, Sized):
        raise TypeError(f"{name} {type(obj).__name__} has no __len__, so the loader's length is unknown")
    return len(obj)


def group_batches(batches: Iterable[list[int]], max_images: int) -> Iterator[list[list[int]]]:
    """Groups consecutive batches while their images add up to at most ``max_images`` (one at least).

    A group is what one reader thread decodes in one call; the batches in it keep their order. A full
    group is yielded without looking ahead, and batches planned before a sampler error are still
    yielded before the error, so the consumer gets every batch up to the failing one.
    """
    group: list[list[int]] = []
    size = 0
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            break
        except Exception:
            if group:
                yield group
            raise
        if group and size + len(batch) > max_images:
            yield group
            group, size = [], 0
        group.append(batch)
        size += len(batch)
        if size >= max_images:
            yield group
            group, size = [], 0
    if group:
        yield group
