"""Which sample indices go in which batch, epoch by epoch, and on which rank.

The plan is computed on the consumer's side of the pipeline and numbered, so the order of batches and
of samples within them is exactly the sampler's, whatever the reader threads' timing. Shuffling is a
pure function of ``(seed, epoch)``: the same seed gives the same order on every run and thread count,
and it is ``DistributedSampler``'s permutation, so every rank of a job draws the same one.
"""

from __future__ import annotations

import array
import numbers
import operator
from collections.abc import Iterable, Iterator, Sized
from itertools import chain, count, islice
from typing import Any

import torch

from ._checks import check_count, check_switch

__all__ = ["BatchPlan", "PlannedBatch", "group_batches", "resolve_shard", "resume_groups", "shard"]


class PlannedBatch(list[int]):
    """A batch's indices, and for each how many times its epoch gave that sample before (0: the first).

    A sample a sampler repeats in an epoch (``WeightedRandomSampler(replacement=True)`` oversampling a
    class) draws its random transform once per time it comes, not the same crop every time: the repeat
    is part of its parameters' key. The loader's own shards count their padding over every rank's
    part (the padded copy is on another rank than the first); a user's sampler is counted as this
    rank sees it.
    """

    __slots__ = ("repeats",)

    def __init__(self, indices: list[int], repeats: list[int]) -> None:
        super().__init__(indices)
        self.repeats = repeats


class BatchPlan:
    """Turns ``batch_size``/``shuffle``/``sampler``/``batch_sampler`` into lists of indices.

    Follows ``torch.utils.data.DataLoader``'s rules for which options combine, with the same errors.
    With ``world_size > 1`` the data set's order is split as ``DistributedSampler`` splits it (see
    :func:`shard`); a user's sampler or batch sampler is taken as it is, never split.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        batch_size: int | None,
        shuffle: bool | None,
        seed: int,
        sampler: Iterable[int] | None,
        batch_sampler: Iterable[list[int]] | None,
        drop_last: bool,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        # None is DataLoader's default, "no shuffle": code that passes its own default along passes it.
        shuffle = False if shuffle is None else check_switch("shuffle", shuffle, also="or None")
        drop_last = check_switch("drop_last", drop_last)
        for name, given, of in (
            ("sampler", sampler, "indices (a torch.utils.data.Sampler)"),
            ("batch_sampler", batch_sampler, "lists of indices (a torch.utils.data.BatchSampler)"),
        ):
            if given is not None and not hasattr(type(given), "__iter__"):
                raise TypeError(f"{name} must be an iterable of {of}, got {given!r} ({type(given).__name__})")
        if batch_sampler is not None:
            if batch_size is not None or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler and "
                    "drop_last (leave those at their defaults: the batch_sampler decides them)"
                )
        else:
            if batch_size is None:
                raise ValueError("batch_size must be a positive integer, got None (None is not supported)")
            check_count("batch_size", batch_size, optional=False)
            if sampler is not None and shuffle:
                raise ValueError(
                    "sampler option is mutually exclusive with shuffle (the sampler decides order)"
                )
        self._num_samples = num_samples
        self._batch_size = batch_size or 1
        self._shuffle = shuffle
        self.seed = seed
        self._sampler = sampler
        self._batch_sampler = batch_sampler
        self._drop_last = drop_last
        self._rank = rank
        self._world_size = world_size
        # The samplers' epochs as the plan last left them: another value is the user's set_epoch. A
        # sampler's own 0 is no call of the user's; any other epoch it comes with is one.
        self._given_epochs: tuple[int | None, int | None] = (0, 0)
        # Whether the user sets the samplers' epochs: from then on each pass is the sampler's epoch, as
        # DataLoader leaves it (a call that repeats the last epoch changes no value).
        self._epochs_by_user = False

    def __len__(self) -> int:
        if self._batch_sampler is not None:
            return _length_of(self._batch_sampler, "batch_sampler")
        if self._sampler is not None:
            n = _length_of(self._sampler, "sampler")
        else:
            n = shard_length(self._num_samples, self._world_size, drop_last=self._drop_last)
        return n // self._batch_size if self._drop_last else -(-n // self._batch_size)

    def arguments(self) -> dict[str, Any]:
        """What decides the plan besides the seed, as plain data: a resumed loader must match it."""
        return {
            "num_samples": self._num_samples,
            "batch_size": None if self._batch_sampler is not None else self._batch_size,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "rank": self._rank,
            "world_size": self._world_size,
            "sampler": _describe(self._sampler),
            "batch_sampler": _describe(self._batch_sampler),
        }

    def set_epoch(self, epoch: int, *, given: bool = True) -> None:
        """Forwards the epoch to a sampler that wants it (``DistributedSampler`` and the like).

        Args:
            epoch: The pass's epoch.
            given: Whether the loader was given it (its ``set_epoch``, a loaded state), not counted it.
                A counted epoch goes only to samplers whose epoch the plan can read: on another, a
                ``set_epoch`` of the user's could not be told apart from the count and would be lost.
        """
        readable = self._sampler_epochs()
        for obj, current in zip((self._sampler, self._batch_sampler), readable, strict=True):
            wants = obj is not None and callable(getattr(obj, "set_epoch", None))
            if wants and (given or current is not None):
                obj.set_epoch(epoch)  # type: ignore[union-attr]
        self._given_epochs = self._sampler_epochs()

    def epoch_set_on_the_sampler(self, *, overridden: bool = False) -> int | None:
        """The epoch the user gives a sampler directly (``sampler.set_epoch(e)``), else ``None``.

        DataLoader leaves a sampler's epoch to the user's ``sampler.set_epoch(e)``; a loop written for
        it, resumed from a checkpoint of the model only, would otherwise get the loader's own count.
        Seen once (a sampler's epoch that the plan did not set, or other than 0 when the plan was
        made), every later pass takes the sampler's epoch, the same one again included, until a pass
        whose epoch the loader was given (``overridden``: its ``set_epoch``, a loaded state).
        """
        if overridden:
            self._epochs_by_user = False
            return None
        now = self._sampler_epochs()
        by_user = [
            epoch
            for epoch, given in zip(now, self._given_epochs, strict=True)
            if epoch is not None and (self._epochs_by_user or epoch != given)
        ]
        self._epochs_by_user = self._epochs_by_user or bool(by_user)
        return by_user[0] if by_user else None

    def _sampler_epochs(self) -> tuple[int | None, int | None]:
        """The ``epoch`` attribute of each sampler that has an integer one (``DistributedSampler``'s)."""
        epochs = (getattr(obj, "epoch", None) for obj in (self._sampler, self._batch_sampler))
        first, second = (e if isinstance(e, int) and not isinstance(e, bool) else None for e in epochs)
        return first, second

    def batches(self, epoch: int) -> Iterator[list[int]]:
        """Yields the batches of one epoch, lazily (samplers may be long).

        :class:`PlannedBatch` where the epoch may give a sample more than once: a sampler's, or a shard
        padded by repeating its start.
        """
        if self._batch_sampler is not None:
            planned = (_sampled_batch(batch, number) for number, batch in enumerate(self._batch_sampler))
            yield from _with_repeats(planned, self._num_samples)
        elif self._sampler is not None:
            indices = (_index(i, "sampler") for i in self._sampler)
            chunks = _chunked(indices, self._batch_size, drop_last=self._drop_last)
            yield from _with_repeats(chunks, self._num_samples)
        else:
            batches = _chunked(self._indices(epoch), self._batch_size, drop_last=self._drop_last)
            if self._world_size > 1 and not self._drop_last:
                # The padding repeats the order from its start, and a padded copy lands on another
                # rank than its first time (counted on this rank alone, it never repeats): the sample
                # at position q of the padded order comes for the (q // num_samples + 1)-th time.
                positions = count(self._rank, self._world_size)
                batches = (
                    PlannedBatch(batch, [next(positions) // self._num_samples for _ in batch])
                    for batch in batches
                )
            yield from batches

    def _indices(self, epoch: int) -> list[int]:
        if self._shuffle:
            # DistributedSampler's permutation for the same seed: every rank draws the same one.
            generator = torch.Generator().manual_seed((self.seed + epoch) % 2**64)  # seeds go up to 2**64 - 1
            order = torch.randperm(self._num_samples, generator=generator).tolist()
        else:
            order = list(range(self._num_samples))
        return shard(order, self._rank, self._world_size, drop_last=self._drop_last)


def shard_length(num_samples: int, world_size: int, *, drop_last: bool) -> int:
    """Samples per rank: ``DistributedSampler.num_samples``."""
    if drop_last:
        return num_samples // world_size
    return -(-num_samples // world_size)


def shard(indices: list[int], rank: int, world_size: int, *, drop_last: bool) -> list[int]:
    """Rank ``rank``'s part of ``indices``, by ``DistributedSampler``'s rules.

    Every rank gets the same number of samples, so ranks stay in step: without ``drop_last`` the order
    is padded by repeating it from its start, with it the tail is cut; then rank ``r`` takes every
    ``world_size``-th index from position ``r``.
    """
    if world_size == 1:
        return indices
    total = shard_length(len(indices), world_size, drop_last=drop_last) * world_size
    if total > len(indices) and indices:
        indices = (indices * -(-total // len(indices)))[:total]
    return indices[rank:total:world_size]


def resolve_shard(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank``/``world_size`` as given, else ``torch.distributed``'s if initialized, else one process.

    Raises:
        ValueError: For values that are not a rank of the world, naming them and where they came from.
    """
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise ValueError(f"{name} must be an int, got {value!r}")
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    defaulted = world_size is None and not initialized
    if world_size is None:
        world_size = torch.distributed.get_world_size() if initialized else 1
    if rank is None:
        if world_size == 1:  # every rank loads the whole set (validation, say), whatever its own rank
            rank = 0
        elif initialized:
            rank = torch.distributed.get_rank()
        elif world_size > 1:
            raise ValueError(
                f"world_size={world_size} needs rank= too (torch.distributed is not initialized here to "
                "take it from): pass rank=, or call torch.distributed.init_process_group() first"
            )
        else:
            rank = 0
    elif defaulted and rank != 0:
        raise ValueError(
            f"rank={rank} needs world_size= too (torch.distributed is not initialized here to take it "
            "from, so it would be 1): pass world_size=, or call torch.distributed.init_process_group() first"
        )
    rank, world_size = int(rank), int(world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size) = [0, {world_size}), got rank={rank}: ranks count from 0"
        )
    return rank, world_size


def _describe(obj: object) -> str | None:
    """A sampler's class and length, to tell a resumed loader's sampler from another.

    A ``__len__`` may raise ``TypeError`` (``BatchSampler`` over an endless sampler): then the class
    alone, since ``state_dict()`` raised that error for a loader that iterates the sampler fine.
    """
    if obj is None:
        return None
    try:
        length = f" of {len(obj)}" if isinstance(obj, Sized) else ""
    except TypeError:
        length = ""
    return f"{type(obj).__name__}{length}"


def _with_repeats(batches: Iterable[list[int]], num_samples: int) -> Iterator[PlannedBatch]:
    """``batches`` as :class:`PlannedBatch`, counting each sample's times from the epoch's first batch.

    Counted where the plan is consumed (by one reader at a time), in the plan's order, so a resumed
    epoch counts the batches it skips too. An array of counts (4 bytes a sample) rather than a dict,
    which would hold every index of a long epoch as an object; indices outside it (which fail when
    read) are counted apart.
    """
    counts = array.array("I", bytes(4 * num_samples))
    others: dict[int, int] = {}
    for batch in batches:
        repeats = []
        for index in batch:
            if 0 <= index < num_samples:
                repeats.append(counts[index])
                counts[index] = min(counts[index] + 1, 2**32 - 1)
            else:
                repeats.append(others.get(index, 0))
                others[index] = repeats[-1] + 1
        yield PlannedBatch(batch, repeats)


def _chunked(indices: Iterable[int], size: int, *, drop_last: bool) -> Iterator[list[int]]:
    """Consecutive batches of ``size`` indices; a short last one unless ``drop_last``."""
    it = iter(indices)
    while batch := list(islice(it, size)):
        if len(batch) < size and drop_last:
            return
        yield batch


def _index(value: Any, name: str) -> int:
    """A sampler's index as an ``int``: integers of any kind; a float is refused, as lists refuse it."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} yielded {value!r} ({type(value).__name__}): sample indices must be integers"
        ) from None


def _sampled_batch(batch: Iterable[Any], number: int) -> list[int]:
    """A batch sampler's batch as indices; an empty one is refused, as DataLoader's collate refuses it.

    Left empty, it was no batch: the epoch gave fewer batches than the sampler's length said, and a saved
    position counted past the batches after it.
    """
    indices = [_index(i, "batch_sampler") for i in batch]
    if not indices:
        raise ValueError(
            f"batch_sampler yielded an empty batch (its batch {number}, counting from 0): "
            "leave empty batches out of the batch sampler"
        )
    return indices


def _length_of(obj: object, name: str) -> int:
    if not isinstance(obj, Sized):
        raise TypeError(f"{name} {type(obj).__name__} has no __len__, so the loader's length is unknown")
    return len(obj)


def resume_groups(
    batches: Iterable[list[int]], max_images: int, start: int
) -> tuple[Iterator[list[list[int]]], int]:
    """The groups of an epoch from batch ``start`` on, formed as the uninterrupted epoch forms them.

    Groups are formed from the epoch's first batch, and the whole groups before ``start`` are left out
    (planning only: nothing is read). The group holding batch ``start`` is kept whole, because a group
    is decoded and, for random crops, resampled together: the same group gives the uninterrupted run's
    pixels. Returns the groups and how many batches at the head of the first one the consumer drops.
    """
    groups = group_batches(batches, max_images)
    passed = 0
    for group in groups:
        if passed + len(group) > start:
            return chain([group], groups), start - passed
        passed += len(group)
    return iter(()), 0


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
