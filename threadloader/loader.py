"""ThreadLoader: a drop-in for ``torch.utils.data.DataLoader`` over images, with threads, not processes.

One process, one CUDA context, one shared decoder: reader threads fetch and read samples, decode whole
batches (on the GPU through nvImageCodec, serialized; on the CPU with Pillow, in parallel), format them
on their own CUDA stream and hand them over with an event. Nothing is pickled, so datasets and
functions defined in a notebook work as they are.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import numbers
import operator
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler

from ._checks import check_count, check_switch
from ._options import DEFAULTS, Options
from ._pipeline import Batch, BatchProducer, OnError, Outcome
from ._runtime import Runtime
from ._sampling import BatchPlan, resolve_shard, resume_groups
from ._sources import as_source
from ._stats import LoaderStats, StatsRecorder
from ._workers import OrderedPool, WeakRegistry, close_deadline, park_outside, uninterrupted
from .decode.base import ImageDecoder
from .errors import LoaderClosedError
from .transforms import Transform

__all__ = ["ThreadLoader"]

Images = torch.Tensor | list[torch.Tensor]
logger = logging.getLogger("threadloader")

#: The ``format`` of :meth:`ThreadLoader.state_dict`: bumped when its meaning changes.
STATE_FORMAT = "threadloader.ThreadLoader/1"


class _DefaultBatchSize(int):
    """The default ``batch_size``, told apart from an explicit one by identity.

    Next to a ``batch_sampler``, which decides batch sizes, the default means "unset" and any explicit
    ``batch_size`` is refused (``DataLoader`` refuses any but its default, 1); as an int it shows as 32
    in the signature.
    """


_DEFAULT_BATCH_SIZE = _DefaultBatchSize(32)


class ThreadLoader:
    """Loads batches of decoded images from a pool of threads in this process.

    Iterating yields ``(images, targets)``: ``images`` is a ``(B, 3, H, W)`` tensor on ``device`` when
    ``size`` is set (else a list of ``(3, H, W)`` tensors); ``targets`` is collated like
    ``default_collate`` (ints become a ``LongTensor``), or ``None`` for a source without targets, unless
    ``collate_fn`` collates them.
    Batches come in exactly the sampler's order, whatever the threads' timing.

    Args:
        source: A sequence of paths or encoded bytes; a sequence of ``(path | bytes, target)``; a
            map-style dataset whose ``__getitem__`` returns either; or a directory with one sub-folder
            per class (:class:`ImageFolder` order).
        batch_size: Samples per batch (default 32); leave it unset with ``batch_sampler``.
        shuffle: Reshuffle every epoch; the order is a function of ``(seed, epoch)`` only. ``None``, as
            DataLoader takes it, is ``False``.
        seed: Seed of the shuffle; ``None`` draws one from torch's global generator at construction, so
            ``torch.manual_seed`` makes it reproducible. The permutation is ``DistributedSampler``'s
            for the same seed. With ``world_size > 1`` and ``shuffle``, pass it (the same on every rank).
        sampler: Yields sample indices (exclusive with ``shuffle``); ``set_epoch`` is forwarded to it.
            Taken as it is: not sharded across ranks (pass a ``DistributedSampler`` to shard it).
        batch_sampler: Yields lists of indices (exclusive with ``batch_size``, ``shuffle``, ``sampler`` and
            ``drop_last``); not sharded.
        drop_last: Drop the last batch when it is smaller than ``batch_size``; with ``world_size > 1``
            also cut each rank's shard to ``len // world_size`` samples instead of padding it by
            repeating samples (both of ``DistributedSampler``'s and ``DataLoader``'s ``drop_last``).
        rank: This process's rank: it loads shard ``rank`` of ``world_size`` (the data set's order,
            padded or cut to a multiple of ``world_size``, then every ``world_size``-th sample from
            ``rank``: ``DistributedSampler``'s rules). Default: ``torch.distributed``'s rank when it is
            initialized, else 0 with ``world_size`` 1; a ``world_size`` above 1 without it needs it.
        world_size: Number of shards; default: ``torch.distributed``'s world size when it is
            initialized, else 1.
        num_threads: Reader threads; default 2 on a GPU (decoding is serialized there and more threads
            only contend for the GIL; see docs/benchmarks.md), the CPU count (at
            most 32) on the CPU.
        prefetch: Decode groups in flight per thread, decoded or being decoded: the memory knob. At most
            ``num_threads * prefetch`` groups of up to ``decode_batch_size`` images are held at once.
        device: ``None`` picks ``"cuda"`` when a GPU and nvImageCodec are usable (``cuda:LOCAL_RANK``
            under torchrun), else ``"cpu"``; also ``"cuda:1"`` or a ``torch.device``.
        size: ``(H, W)``: every image resized to it (bilinear, antialiased) and stacked.
        dtype: ``torch.uint8``, or a float type scaled to [0, 1] (float32, float16, bfloat16, float64).
        mean: Per-channel mean to subtract (float dtypes, with ``std``), on the [0, 1] scale.
        std: Per-channel standard deviation to divide by.
        channels_last: Stacked batches in ``torch.channels_last`` memory format (free on the GPU path,
            whose decoder writes HWC).
        on_error: ``"raise"``: a bad sample raises :class:`SampleError` in the consumer at its batch.
            ``"skip"``: it is logged, counted in :meth:`stats` and left out of its batch (a batch left
            empty is not yielded).
        backend: GPU decoding backend: ``"auto"`` (each decoder call on ``"all"`` or ``"cuda"``,
            whichever has been decoding faster lately, and on ``"cuda"`` while the training step is
            the slower side: beside a busy GPU the JPEG engine takes more from the step), ``"all"``
            (nvImageCodec's choice per image, the JPEG engine first), ``"cuda"`` (every nvImageCodec
            decoder but the JPEG engine: JPEGs on nvJPEG's CUDA decoder), ``"split"`` (the JPEG engine
            takes a fixed share of each batch, the CUDA decoder the rest, at once, as DALI's decoder
            does), ``"hardware"`` (the JPEG engine), ``"hybrid"`` (nvJPEG's CUDA decoder alone) or
            ``"cpu"`` (nvImageCodec's CPU decoder). Refused with ``device="cpu"``; ignored where
            ``device=None`` finds no usable GPU.
        decode_threads: nvImageCodec's own CPU threads per Decoder; default: the cores the readers leave
            free, shared by the Decoders they decode on at once (``gpu_decoders``, at most one per
            reader).
        gpu_decoders: Most nvImageCodec Decoders decoding at once for this configuration (device,
            backend, ``decode_threads``, whose default follows ``num_threads`` and ``gpu_decoders``),
            each called by one reader thread at a time; made only when the others are busy. Pools are
            process-wide, shared by loaders of one configuration, and random-crop regions have a pool
            of their own; a pool's Decoders are destroyed when the last loader using it is closed.
            Default: 2, the fastest measured (docs/design.md). Ignored on the CPU.
        jpeg_fancy_upsampling: Upsample JPEG chroma smoothly, as Pillow and libjpeg do (the default), so
            GPU and CPU outputs agree. ``False`` (DALI's default) repeats each chroma sample instead:
            pixels at colour edges differ from Pillow's by a few levels, and the GPU's JPEG engine
            (``backend="split"``, ``"all"`` or ``"hardware"``) decodes batches that mix chroma
            subsamplings, as photo collections do, about twice as fast, in one call instead of image by
            image. Ignored on the CPU and for images Pillow decodes instead, which stay smooth.
        decode_batch_size: Images per decoder call: consecutive batches are decoded together up to this
            many images, then split (the GPU decoder is faster on large batches, and each image of a
            call is in device memory at once). Default 64 on a GPU (or ``batch_size``, if larger),
            ``batch_size`` on the CPU (each Pillow thread decodes one batch). A call holds at least one
            batch: a value below ``batch_size`` is ``batch_size``. With a ``batch_sampler``, a torch
            ``BatchSampler``'s ``batch_size`` stands for ``batch_size``; another's batch sizes are
            known only as they come: the bound is then 64 on a GPU or the value given (a larger batch
            is one call), and the CPU's default, one batch a call, has no number
            (``loader.decode_batch_size`` is ``None``).
        transform: A transform or a list of them (``threadloader.transforms``: Resize, CenterCrop,
            RandomResizedCrop, RandomHorizontalFlip, Normalize, ToDtype), applied to each image after
            decoding, on the reader's stream. Random parameters are a function of (seed, epoch, sample
            index, and which time in the epoch the sampler gives it): the same on every run and thread
            count. With a fixed output size (a crop, a resize to (H, W)) and ``size=None``, batches
            are stacked at that size. What a transform raises is no sample error (``on_error`` does
            not apply): it is raised in the loop at its batch, as ``collate_fn``'s is, after the
            batches before it, decoded in the same call or not.
        max_pixels: Decompression-bomb guard: an image whose header declares more pixels is a sample
            error, decoded by nobody. Default: Pillow's limit (about 89.5 million); ``None``: no limit.
        region_decode: On a GPU, decode only the region a leading random crop keeps (checked once
            per device; whole images where it fails). ``None``: on, unless the environment variable
            ``THREADLOADER_REGION_DECODE`` is ``0`` when the loader is built.
        decoder: An :class:`~threadloader.decode.ImageDecoder` to decode with instead of the one
            ``device`` and ``backend`` choose; ``device`` is then its device, and ``backend``,
            ``decode_threads``, ``gpu_decoders``, ``jpeg_fancy_upsampling``, ``max_pixels`` and
            ``region_decode`` (which configure the built-in decoders) must be left unset.
        collate_fn: Makes a batch's ``targets`` from the list of its samples' targets, in batch order
            (``None`` each, for a source without targets), in a reader thread: ``list`` keeps detection
            boxes of different counts as they are. Unlike DataLoader's, it sees only the targets: the
            loader decodes and stacks the images. Default: like ``default_collate``, and ``None`` for
            a source without targets. What it raises is raised in the loop, at its batch.
        pin_memory: Copy each batch's CPU tensors (the images on the CPU path; tensor targets, also in
            dicts, lists and tuples) into pinned memory, in the reader thread, so that
            ``.cuda(non_blocking=True)`` copies them asynchronously. Needs CUDA: without it, a warning,
            and batches stay in ordinary memory (as DataLoader does).

    Attributes:
        rank: The shard this process loads (see ``rank``).
        world_size: The number of shards.
        decode_batch_size: Most images per decoder call (a batch larger than it is one call), as
            ``decode_batch_size`` says; ``None`` on the CPU by default under a ``batch_sampler`` that is
            not a ``BatchSampler``: each call decodes one of its batches, whatever its size.

    Example:
        >>> with ThreadLoader("train/", batch_size=64, shuffle=True, size=(224, 224),
        ...                   dtype=torch.float32) as loader:  # doctest: +SKIP
        ...     for images, targets in loader:
        ...         loss = model(images).loss(targets.cuda())
    """

    def __init__(
        self,
        source: Any,
        *,
        batch_size: int | None = _DEFAULT_BATCH_SIZE,
        shuffle: bool | None = False,
        seed: int | None = None,
        sampler: Iterable[int] | None = None,
        batch_sampler: Iterable[list[int]] | None = None,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        num_threads: int | None = None,
        prefetch: int = 2,
        device: str | torch.device | int | None = DEFAULTS.device,
        size: tuple[int, int] | None = DEFAULTS.size,
        dtype: torch.dtype = DEFAULTS.dtype,
        mean: Sequence[float] | None = DEFAULTS.mean,
        std: Sequence[float] | None = DEFAULTS.std,
        channels_last: bool = DEFAULTS.channels_last,
        on_error: OnError = "raise",
        backend: str = DEFAULTS.backend,
        decode_threads: int | None = DEFAULTS.decode_threads,
        gpu_decoders: int = DEFAULTS.gpu_decoders,
        jpeg_fancy_upsampling: bool = DEFAULTS.jpeg_fancy_upsampling,
        decode_batch_size: int | None = None,
        max_pixels: int | None = DEFAULTS.max_pixels,
        transform: Transform | Sequence[Transform] | None = DEFAULTS.transform,
        region_decode: bool | None = DEFAULTS.region_decode,
        decoder: ImageDecoder | None = DEFAULTS.decoder,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
    ) -> None:
        if collate_fn is not None and not callable(collate_fn):
            got = type(collate_fn).__name__
            raise TypeError(f"collate_fn must be a function of the list of a batch's targets, got {got}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        check_count("prefetch", prefetch, optional=False)
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**64
        ):
            # Random draws use the seed's low 64 bits: seed=2**64 would repeat seed=0's crops and flips.
            raise ValueError(
                "seed must be an int from 0 to 2**64 - 1 (a torch generator's seeds, where a negative "
                f"seed, as DistributedSampler takes, is 2**64 plus it), or None, got {seed!r}"
            )
        seed = None if seed is None else int(seed)
        options = Options.of(locals())  # the options both front ends take, checked
        self._source = as_source(source)
        own_order = sampler is None and batch_sampler is None
        if not own_order and world_size is not None and world_size != 1:  # before it asks for rank=
            raise ValueError(
                f"rank={rank} and world_size={world_size} shard the loader's own order, but a sampler or "
                "batch_sampler is taken as it is: shard it yourself (DistributedSampler) and leave rank "
                "and world_size unset"
            )
        self.rank, self.world_size = resolve_shard(rank, world_size)
        if own_order and shuffle and self.world_size > 1 and seed is None:
            raise ValueError(
                f"shuffle=True with world_size={self.world_size} needs seed= (the same int on every rank, "
                "as DistributedSampler's seed=0): with seed=None each rank would draw its own order and "
                "the shards would overlap"
            )
        self._seed_given = seed is not None
        seed = seed if seed is not None else int(torch.randint(0, 2**62, ()).item())
        plan_batch_size = _plan_batch_size(batch_size, batch_sampler)
        self._plan = BatchPlan(
            num_samples=len(self._source),
            batch_size=plan_batch_size,
            shuffle=shuffle,
            seed=seed,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=drop_last,
            rank=self.rank,
            world_size=self.world_size,
        )
        pin_memory = check_switch("pin_memory", pin_memory)
        self.prefetch = prefetch
        self._stats = StatsRecorder()
        self._runtime = runtime = Runtime(
            options,
            batch_size=_batch_size_of(batch_sampler) if batch_sampler is not None else plan_batch_size,
            decode_batch_size=decode_batch_size,
        )
        try:
            self.device, self.num_threads = runtime.device, runtime.num_threads
            self.decode_batch_size = runtime.decode_batch_size
            self.pin_memory = pin_memory and _can_pin()
            # A partial, to remake the producer with the seed a loaded state brings (see load_state_dict).
            self._new_producer = functools.partial(
                runtime.producer,
                source=self._source,
                on_error=on_error,
                stats=self._stats,
                collate=collate_fn,
            )
            self._producer = self._new_producer(seed=seed)
        except BaseException:  # a warning made an error, a Ctrl-C: no loader, so no close() would
            runtime.close()  # stop the warm-up and free the decoder built for it
            raise
        self._next_epoch = 0
        # Whether set_epoch or load_state_dict chose _next_epoch since the last pass: then a sampler's
        # epoch that the user set directly does not override it.
        self._epoch_given = False
        self._resume = 0  # batches of epoch _next_epoch to skip, from load_state_dict
        self._progress: _Progress | None = None  # the latest iteration's
        self._iterators: WeakRegistry[_EpochIterator] = WeakRegistry()
        self._closed = False
        # close() and __iter__ (a pass that starts is closed, or sees _closed), and the epoch state that
        # __iter__, set_epoch, state_dict and load_state_dict read and write, from any thread.
        self._lock = threading.RLock()
        # One pass starts at a time (the sampler is the user's, and stateful); not _lock, since a start
        # waits in the sampler for its first batches, which close() and state_dict() must not wait for.
        self._starting = threading.Lock()

    @property
    def source(self) -> Any:
        """The source being loaded (an :class:`ImageFolder` when a directory was given)."""
        return self._source

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._plan)

    def __iter__(self) -> Iterator[tuple[Images, Any]]:
        """Starts an epoch: the one given by :meth:`set_epoch` or a loaded state, else the last one + 1.

        A ``sampler.set_epoch(e)`` of the user's (as DataLoader's users write) gives the epoch too,
        unless :meth:`set_epoch` was called since the last pass. A pass that handed out no batch (a
        framework's ``iter()`` to check the loader, then dropped: Lightning's) was no epoch: unless an
        epoch was given since, the next pass starts where it would have, as ``state_dict()`` says.
        """
        # A daemon thread that starts a pass once the exit hook has run parks for good (in the pool's
        # thread group): past both locks, or a later exit hook's close() or state_dict() waited forever.
        with park_outside(), self._starting:
            epoch, progress = self._begin_pass()
            # Outside the lock: the first group (and, resuming, the groups before ``start``) comes from
            # the user's sampler, which may block (a streaming sampler waiting for work).
            try:
                groups, drop = resume_groups(
                    progress.count(self._plan.batches(epoch)),
                    self.decode_batch_size or 1,  # None: one batch a call, whatever its size
                    progress.start,
                )
            except Exception:  # the sampler failed at its start: a pass that raised, as in next()
                progress.raised = True
                raise
            with self._lock:
                if self._closed:  # by another thread meanwhile
                    raise LoaderClosedError("this ThreadLoader was closed while its pass started")
                # Threads see only the producer and the streams, never the loader: dropping the loader
                # and its iterators closes the pool.
                work = functools.partial(_produce_on, self._runtime, self._producer, epoch, self.pin_memory)
                pool: OrderedPool[list[Outcome]] = OrderedPool(
                    tasks=groups,
                    work=work,
                    num_threads=self.num_threads,
                    window=self.num_threads * self.prefetch,
                    name=f"threadloader-e{epoch}",
                    on_ahead=functools.partial(self._stats.add_time, "ahead"),
                )
                try:
                    iterator = _EpochIterator(self, pool, epoch, progress, drop=drop)
                    self._iterators.add(iterator)
                except BaseException:  # a Ctrl-C here left the pool's threads running, owned by nobody
                    pool.close()
                    raise
        return iterator

    def _begin_pass(self) -> tuple[int, _Progress]:
        """The epoch a pass starts and its progress, recorded; the sampler told the epoch."""
        with self._lock:
            if self._closed:
                raise LoaderClosedError("this ThreadLoader was closed; create a new one to iterate again")
            epoch, start, given = self._next_epoch, self._resume, self._epoch_given
            latest = self._progress
            if not given and latest is not None and self._dropped_unrun(latest):
                epoch, start = latest.epoch, latest.start
            on_sampler = self._plan.epoch_set_on_the_sampler(overridden=given)
            if on_sampler is not None:
                epoch = on_sampler  # the user's sampler.set_epoch(e), as DataLoader leaves it
            # The new progress first: a signal handler's state_dict() (this lock is re-entrant) reads
            # either it, or the old epoch and start it was made from; never "the next epoch from 0".
            self._progress = progress = _Progress(epoch, start)
            self._next_epoch, self._epoch_given = epoch + 1, False
            self._resume = 0
            self._plan.set_epoch(epoch, given=given)
        return epoch, progress

    def _dropped_unrun(self, progress: _Progress) -> bool:
        """Whether ``progress``'s pass handed out no batch and has stopped: a framework's ``iter()``.

        One still running is a pass of its own (``zip(loader, loader)``, another thread's loop that
        waits for its first batch): taken for a dropped one, the next pass ran its epoch again.
        """
        return progress.handed_none() and not any(
            iterator._progress is progress and not iterator._pool.closed
            for iterator in self._iterators.live()
        )

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of the next iteration (its shuffle order); later ones count on from it.

        After :meth:`load_state_dict`, setting the state's own epoch keeps its position (the usual
        ``set_epoch`` at the top of an epoch loop); another epoch starts from its first batch.

        Raises:
            ValueError: For an epoch that is not a non-negative int (numpy's and 0-d tensors' included).
        """
        try:
            number = operator.index(epoch)
        except TypeError:
            number = -1
        if number < 0:
            raise ValueError(f"set_epoch takes an epoch, an int from 0 up, got {epoch!r}")
        epoch = number
        with self._lock:
            latest = self._progress
            if not self._epoch_given and latest is not None and self._dropped_unrun(latest):
                # A pass dropped before its first batch (a framework's check) was no epoch: where it
                # would have started is where the next one starts, a loaded position included.
                self._next_epoch, self._resume = latest.epoch, latest.start
            if self._resume and epoch != self._next_epoch:
                logger.warning(
                    "set_epoch(%d) replaces the position loaded by load_state_dict (epoch %d after %d "
                    "batches): epoch %d starts from its first batch",
                    epoch,
                    self._next_epoch,
                    self._resume,
                    epoch,
                )
                self._resume = 0
            self._next_epoch, self._epoch_given = epoch, True

    def state_dict(self) -> dict[str, Any]:
        """Where the latest iteration is, as plain data that ``torch.save`` and ``torch.load`` keep.

        As ``torchdata``'s ``StatefulDataLoader``: after ``k`` batches of an epoch it says "epoch ``e``
        after ``k`` batches"; once an epoch has ended, "the next epoch, from its start". Batches are
        counted as the consumer received them (not as reader threads prefetched them), and a batch
        left empty by ``on_error="skip"`` counts as passed. A batch that raised (its
        :class:`SampleError`, or the transform's or ``collate_fn``'s error) is not passed: resuming
        makes it again. A :meth:`set_epoch` after a pass that stopped early (``break``, an error)
        decides the next pass, so it is what this says.
        """
        with self._lock:
            progress = self._progress
            # A stopped pass's position is kept for a loop that goes on with it, unless set_epoch
            # chose the next pass since: reporting the old one made the resumed run take its tail.
            running = progress is not None and any(
                iterator._progress is progress and not iterator._pool.closed
                for iterator in self._iterators.live()
            )
            if progress is None or progress.finished or (self._epoch_given and not running):
                epoch, batches = self._next_epoch, self._resume
            else:
                epoch, batches = progress.epoch, progress.consumed
            seed = self._plan.seed
        return {
            "format": STATE_FORMAT,
            "epoch": epoch,
            "batches": batches,
            "seed": seed,
            "arguments": self._plan.arguments(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration continue where the loader that saved ``state`` was.

        The next ``iter`` yields exactly the batches the saving loader would have yielded next (the
        same samples, order and random transform parameters), and the epochs after it follow. A loader
        built with ``seed=None`` takes the state's seed; one built with another seed refuses it.
        A user's sampler is replayed from its start and the batches already passed are dropped, so
        that is exact only for a sampler whose order depends on its arguments and ``set_epoch`` alone
        (``SequentialSampler``, ``DistributedSampler``).

        Raises:
            ValueError: ``state`` is not a ThreadLoader state, or came from a loader with other
                arguments (data set length, batch size, shuffle, drop_last, rank, world size,
                sampler, seed); the message names each difference.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a ThreadLoader state: format {got!r}, expected {STATE_FORMAT!r}; pass what "
                "ThreadLoader.state_dict() returned"
            )
        saved, ours = state.get("arguments"), self._plan.arguments()
        saved = saved if isinstance(saved, dict) else {}
        mismatches = [
            f"{name}: the state's {saved.get(name)!r}, this loader's {value!r}"
            for name, value in ours.items()
            if saved.get(name) != value
        ]
        seed, epoch, batches = (_count_in(state, key) for key in ("seed", "epoch", "batches"))
        if seed >= 2**64:  # the constructor's bound: the draws use its low 64 bits (seed=0's, for 2**64)
            raise ValueError(f"a ThreadLoader state's seed is below 2**64, got {seed} (damaged state)")
        if self._seed_given and seed != self._plan.seed:
            mismatches.append(
                f"seed: the state's {seed}, this loader's {self._plan.seed} (pass seed={seed}, or seed=None "
                "to take the state's)"
            )
        if batches > _known_length(self._plan, default=batches):
            mismatches.append(f"batches: the state's {batches}, more than this loader's {len(self)} an epoch")
        if mismatches:
            raise ValueError(
                "this state was saved by a loader built with other arguments; build it with the saving "
                "run's arguments. " + "; ".join(mismatches)
            )
        with self._lock:
            if seed != self._plan.seed:
                self._plan.seed = seed
                self._producer = self._new_producer(seed=seed)
            self._next_epoch, self._resume, self._progress = epoch, batches, None
            self._epoch_given = True

    def stats(self) -> LoaderStats:
        """Counters and per-stage host time since construction: samples, skipped, errors, fallbacks."""
        return self._stats.snapshot()

    def close(self) -> None:
        """Stops every iteration of this loader, from any thread. Idempotent.

        Reader threads stop at their next step (a sample, an image, a batch); this waits up to a second
        for them. While the GPU decoder is still starting in the background (nvImageCodec's load:
        seconds), it also waits for that start to end, up to 15 s, so that the decoder's device memory
        is back when this returns. An iteration's next ``next()``, and one already waiting in another
        thread, raises :class:`LoaderClosedError` rather than ending the loop as if the epoch were
        complete.
        """
        with self._lock:
            self._closed = True
            iterators = self._iterators.live()
        until = close_deadline()  # one wait for all: each iterator's took a second in turn
        # Each step to its end through a Ctrl-C (which then comes after the last): raised from the
        # first iterator's close, it left the others' threads running and the runtime open.
        uninterrupted(
            *(functools.partial(iterator.close, error=_closed_error, until=until) for iterator in iterators),
            functools.partial(self._runtime.close, until=until),
        )

    def __enter__(self) -> ThreadLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # Not at interpreter exit: the exit hook (_workers) has stopped every thread by then, and close()
        # would find the module globals it needs cleared (a free-threaded build frees objects that late).
        # Nor for a loader whose constructor raised.
        if not _finalizing() and getattr(self, "_iterators", None) is not None:
            # A second Ctrl-C during close() is raised after the threads have ended: from a finalizer it
            # would only be printed ("Exception ignored"), the first one being on its way already.
            with contextlib.suppress(KeyboardInterrupt):
                self.close()

    def __repr__(self) -> str:
        try:
            batches: int | str = len(self)
        except TypeError:  # a sampler without __len__: the loader iterates it all the same
            batches = "unknown"
        return (
            f"ThreadLoader(samples={len(self._source)}, batches={batches}, device={self.device}, "
            f"num_threads={self.num_threads}, prefetch={self.prefetch}, output={self._runtime.output})"
        )


def _produce_on(
    runtime: Runtime, producer: BatchProducer, epoch: int, pin: bool, batches: list[list[int]], thread: int
) -> list[Outcome]:
    # No local holds the outcomes: a batch's error among them holds this frame (its traceback's frames
    # keep their callers' frames, f_back), and held by it in turn, it would outlive the consumer's drop
    # of it, in a cycle, until the garbage collector ran (tests/test_shutdown.py).
    if pin:
        return _pin_batches(runtime.produce(producer, batches, thread, epoch=epoch))
    return runtime.produce(producer, batches, thread, epoch=epoch)


def _pin_batches(outcomes: list[Outcome]) -> list[Outcome]:
    """``outcomes``, each batch's CPU tensors copied to pinned memory (see ``pin_memory``)."""
    for outcome in outcomes:
        if isinstance(outcome, Batch):
            outcome.images, outcome.targets = _pinned(outcome.images), _pinned(outcome.targets)
    return outcomes


def _can_pin() -> bool:
    """Whether pinned memory can be had here; else says so, once per loader, as DataLoader does."""
    if torch.cuda.is_available():
        return True
    warnings.warn(
        "pin_memory=True, but CUDA is not available here, and pinned memory needs it: batches stay in "
        "ordinary memory; leave pin_memory unset on machines without a GPU",
        UserWarning,
        stacklevel=3,
    )
    return False


def _pinned(data: Any) -> Any:
    """``data`` with its CPU tensors copied to pinned memory, in dicts, lists and tuples too."""
    if isinstance(data, torch.Tensor):
        return data.pin_memory() if data.device.type == "cpu" else data
    if isinstance(data, dict):
        return {key: _pinned(value) for key, value in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple takes its fields one by one
        return type(data)(*(_pinned(value) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_pinned(value) for value in data)
    return data


class _EpochIterator:
    """One pass over the loader; hands batches out in order and closes its pool when done or dropped."""

    def __init__(
        self,
        loader: ThreadLoader,
        pool: OrderedPool[list[Outcome]],
        epoch: int,
        progress: _Progress,
        *,
        drop: int = 0,
    ) -> None:
        self._loader = loader  # keeps a loader used only through its iterator alive
        self._pool = pool
        self._progress = progress
        self._drop = drop  # batches of a resumed first group that were consumed before the state
        self._stats = loader._stats
        self._runtime = loader._runtime
        self._pending: collections.deque[Outcome] = collections.deque()
        self.epoch = epoch

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> tuple[Images, Any]:
        try:
            batch = self._next_batch()
        except StopIteration:
            self._progress.finish()
            self.close()
            raise
        except Exception:  # a batch's error (its sample's, its transform's): a loop that goes on
            self._progress.raised = True  # runs the next epoch
            self._close_after_error()
            raise
        except BaseException:  # a Ctrl-C while waiting: no batch, no epoch
            self._close_after_error()
            raise
        batch.ready.receive()
        self._stats.count_many(batches=1, samples=len(batch.indices))
        # Counted once the batch is the consumer's: a checkpoint taken before (another thread's, a
        # signal handler's that then raises) must not count a batch the loop never got.
        self._progress.consumed += 1
        return batch.images, batch.targets

    def _next_batch(self) -> Batch:
        while True:
            # A closed pool raises what it was closed with, even with batches of its last group left.
            if self._pool.closed or not self._pending:
                started = time.perf_counter()
                try:
                    self._pending.extend(self._pool.next())
                finally:
                    waited = time.perf_counter() - started
                    self._stats.add_time("wait", waited)
                self._runtime.consumer_waited(waited)
                for _ in range(self._drop):
                    try:
                        self._pending.popleft()
                    except IndexError:  # fewer batches, or emptied by close() in another thread
                        break
                self._drop = 0
                continue
            try:
                outcome = self._pending.popleft()
            except IndexError:  # emptied by close() in another thread
                continue
            if isinstance(outcome, Exception):  # a bad sample's, or the transform's or collate_fn's
                try:
                    raise outcome
                finally:  # the traceback holds this frame, which holds the iterator and its loader
                    del outcome
            if outcome is not None:
                return outcome  # counted by __next__ once handed over
            self._progress.consumed += 1  # a batch whose every sample was skipped: passed

    def _close_after_error(self) -> None:
        """Closes the pass that ``next()`` raised from; at once where another thread's close woke it.

        That close waits for the readers (one stuck in a read, up to its deadline): the loop need not.
        """
        if self._pool.closed:
            self._pending.clear()
        else:
            self.close()

    def close(
        self, *, error: Callable[[], BaseException] = StopIteration, until: float | None = None
    ) -> None:
        """Stops this pass; ``next()`` then raises ``error()`` (the first close decides).

        The default ends the pass as a closed generator does; reader threads stop at their next step,
        waited for until ``until`` (see :meth:`OrderedPool.close`).
        """
        self._pending.clear()
        self._pool.close(error, until=until)

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        if not _finalizing() and getattr(self, "_pool", None) is not None:  # see ThreadLoader.__del__
            with contextlib.suppress(KeyboardInterrupt):
                self.close()


class _Progress:
    """How far the consumer is in one epoch, in the plan's batches (a batch left empty counts too).

    Written by the consumer's thread, except ``total``, which the reader thread that exhausts the plan
    writes before it records the end under the pool's lock: the consumer reads it only after.
    """

    def __init__(self, epoch: int, start: int) -> None:
        self.epoch = epoch
        self.start = start
        self.consumed = start
        self.total: int | None = None
        self.finished = False
        self.raised = False  # a next() raised an error: the pass ran, as DataLoader's would have

    def count(self, batches: Iterator[list[int]]) -> Iterator[list[int]]:
        """Passes the epoch's batches (from its first) through, noting how many it has once they run out."""
        total = 0
        for batch in batches:
            total += 1
            yield batch
        self.total = total

    def handed_none(self) -> bool:
        """Whether the pass handed out no batch, raised nothing and has not ended: an unrun ``iter()``."""
        return not self.finished and not self.raised and self.consumed == self.start

    def finish(self) -> None:
        """Called when the iterator stops: the epoch ended if every planned batch was consumed."""
        self.finished = self.total is not None and self.consumed >= self.total


def _plan_batch_size(batch_size: int | None, batch_sampler: object) -> int | None:
    """The batch size for the plan: the default is unset next to a batch_sampler, and a plain int."""
    if batch_size is not _DEFAULT_BATCH_SIZE:
        return batch_size
    return None if batch_sampler is not None else int(batch_size)


def _batch_size_of(batch_sampler: object) -> int | None:
    """The size of a ``batch_sampler``'s batches where it says it (torch's ``BatchSampler``), else ``None``.

    Only a ``BatchSampler``'s ``batch_size`` is known to count images per batch (all of them but a
    short last one); another sampler's attribute of that name may count something else (tokens).
    """
    size = getattr(batch_sampler, "batch_size", None) if isinstance(batch_sampler, BatchSampler) else None
    if not isinstance(size, numbers.Integral) or isinstance(size, bool):
        return None
    return int(size) if int(size) > 0 else None


def _count_in(state: dict[str, Any], key: str) -> int:
    """A non-negative int of a state, or the error saying the state is damaged."""
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a ThreadLoader state's {key} is a non-negative int, got {value!r} (damaged state)")
    return value


def _known_length(plan: BatchPlan, *, default: int) -> int:
    """Batches per epoch, or ``default`` for a sampler without a length."""
    try:
        return len(plan)
    except TypeError:
        return default


def _closed_error() -> LoaderClosedError:
    return LoaderClosedError(
        "this ThreadLoader was closed while this pass was running (close(), or its with block ended); "
        "create a new one to iterate again"
    )
