"""Exact mid-epoch resume: ``state_dict`` / ``load_state_dict`` on the CPU path.

The reference is always the uninterrupted run of a loader built with the same arguments: a resumed
loader must yield exactly its next batches (targets and pixels, random crops and flips included) and
the epochs after them.
"""

from __future__ import annotations

import io
import itertools
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from threadloader import SampleError, ThreadLoader
from threadloader.transforms import RandomHorizontalFlip, RandomResizedCrop

from .conftest import encode, photo

N = 23
BATCH = 3  # 8 batches an epoch, the last of 2
Run = list[tuple[torch.Tensor, list[int]]]


@pytest.fixture(scope="module")
def samples() -> list[tuple[bytes, int]]:
    """N small JPEGs of different sizes (random crops depend on the size), target = index."""
    return [
        (encode(photo(20 + 3 * (i % 5), 24 + 2 * (i % 7), seed=300 + i), quality=90), i) for i in range(N)
    ]


def make(source: Any, **options: Any) -> ThreadLoader:
    """A shuffling, augmenting loader; ``options`` override (threads may differ: the result must not)."""
    defaults: dict[str, Any] = {
        "batch_size": BATCH,
        "shuffle": True,
        "seed": 11,
        "num_threads": 3,
        "prefetch": 2,
        "device": "cpu",
        "transform": [RandomResizedCrop(16), RandomHorizontalFlip()],
    }
    return ThreadLoader(source, **(defaults | options))


def take(iterator: Any, count: int | None = None) -> Run:
    """``count`` batches (all when None) as (images, targets) pairs."""
    out: Run = []
    for images, targets in iterator:
        out.append((images, targets.tolist()))
        if count is not None and len(out) == count:
            break
    return out


def assert_same(got: Run, expected: Run) -> None:
    """The same batches: targets, then every pixel."""
    assert [targets for _, targets in got] == [targets for _, targets in expected]
    for (images, targets), (reference, _) in zip(got, expected, strict=True):
        assert torch.equal(images, reference), f"pixels differ in the batch of samples {targets}"


def round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """Through a checkpoint file, loaded as untrusted data."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def uninterrupted(source: Any, epochs: int, **options: Any) -> list[Run]:
    with make(source, **options) as loader:
        return [take(loader) for _ in range(epochs)]


@pytest.mark.parametrize("consumed", [0, 1, 4, 7, 8])  # before the first, first, middle, last but one, last
def test_resume_mid_epoch_yields_the_uninterrupted_batches(
    samples: list[tuple[bytes, int]], consumed: int
) -> None:
    expected = uninterrupted(samples, 2)
    assert len(expected[0]) == 8 and len({t for _, ts in expected[0] for t in ts}) == N
    with make(samples) as first:
        iterator = iter(first)
        assert_same(take(iterator, consumed) if consumed else [], expected[0][:consumed])
        state = round_trip(first.state_dict())
        del iterator
    with make(samples, num_threads=1, prefetch=1) as resumed:
        resumed.load_state_dict(state)
        assert_same(take(resumed), expected[0][consumed:])
        assert_same(take(resumed), expected[1])  # the epoch after follows


def test_state_between_epochs_resumes_at_the_next_epoch(samples: list[tuple[bytes, int]]) -> None:
    expected = uninterrupted(samples, 3)
    with make(samples) as first:
        take(first)
        state = round_trip(first.state_dict())
    assert (state["epoch"], state["batches"]) == (1, 0)
    with make(samples, num_threads=2) as resumed:
        resumed.load_state_dict(state)
        assert_same(take(resumed), expected[1])
        assert_same(take(resumed), expected[2])


def test_a_state_taken_after_the_last_batch_resumes_with_an_empty_epoch(
    samples: list[tuple[bytes, int]],
) -> None:
    # The uninterrupted iterator's next step is StopIteration: so is the resumed one's, then epoch 1.
    expected = uninterrupted(samples, 2)
    with make(samples) as first:
        iterator = iter(first)
        take(iterator, 8)
        state = first.state_dict()
    assert (state["epoch"], state["batches"]) == (0, 8)
    with make(samples) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(0)  # a training loop's set_epoch of the epoch it resumes keeps the position
        assert take(resumed) == []
        assert_same(take(resumed), expected[1])


class _Watched:
    """A source that reports how many samples the reader threads have fetched."""

    def __init__(self, samples: list[tuple[bytes, int]]) -> None:
        self._samples = samples
        self._fetched = 0
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        with self._changed:
            self._fetched += 1
            self._changed.notify_all()
        return self._samples[index]

    def wait_fetched(self, count: int, timeout: float = 10.0) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._fetched >= count, timeout)


def test_state_counts_batches_received_not_prefetched(samples: list[tuple[bytes, int]]) -> None:
    expected = uninterrupted(samples, 1)
    source = _Watched(samples)
    with make(source, num_threads=3, prefetch=2) as first:
        iterator = iter(first)
        take(iterator, 2)
        # Readers run ahead of the consumer: wait until they fetched well past the second batch.
        assert source.wait_fetched(6 * BATCH), "readers did not prefetch"
        state = first.state_dict()
        del iterator
    assert state["batches"] == 2
    with make(samples) as resumed:
        resumed.load_state_dict(state)
        assert_same(take(resumed), expected[0][2:])


@pytest.fixture(scope="module")
def broken(samples: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
    """Samples 3, 4 and 5 (all of batch 1 in order) and 10 are not images: skipped with on_error="skip"."""
    return [(b"not an image", i) if i in (3, 4, 5, 10) else sample for i, sample in enumerate(samples)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("consumed", [1, 2, 3])
def test_resume_with_skipped_samples_and_a_skipped_batch(
    broken: list[tuple[bytes, int]], shuffle: bool, consumed: int
) -> None:
    options: dict[str, Any] = {"on_error": "skip", "shuffle": shuffle}
    logging.getLogger("threadloader").setLevel(logging.ERROR)  # the skip warnings are expected
    try:
        expected = uninterrupted(broken, 2, **options)
        if not shuffle:  # batch 1 was left empty and not yielded; batch 3 lost sample 10
            assert [t for _, t in expected[0][:3]] == [[0, 1, 2], [6, 7, 8], [9, 11]]
        with make(broken, **options) as first:
            iterator = iter(first)
            take(iterator, consumed)
            state = round_trip(first.state_dict())
            del iterator
        with make(broken, **options) as resumed:
            resumed.load_state_dict(state)
            assert_same(take(resumed), expected[0][consumed:])
            assert_same(take(resumed), expected[1])
    finally:
        logging.getLogger("threadloader").setLevel(logging.NOTSET)


def test_a_failed_batch_is_not_passed_resuming_raises_it_again(broken: list[tuple[bytes, int]]) -> None:
    options: dict[str, Any] = {"shuffle": False, "seed": None, "transform": None}
    with make(broken, **options) as first:
        iterator = iter(first)
        take(iterator, 1)
        with pytest.raises(SampleError) as raised:
            next(iterator)
        state = first.state_dict()
    assert raised.value.index == 3 and state["batches"] == 1
    with make(broken, **options) as resumed:
        resumed.load_state_dict(state)
        with pytest.raises(SampleError) as again:
            next(iter(resumed))
    assert again.value.index == 3


def test_a_sample_failing_in_a_batch_delivered_before_the_state_takes_nothing_after_it(
    samples: list[tuple[bytes, int]],
) -> None:
    """A group holds batches before the state's position (dropped on resume) and after it; a sample of
    a dropped batch that fails now (a flaky read) is not the resumed pass's to raise, and the group's
    later batches must still come, none lost without a word."""

    class Flaky:
        def __init__(self) -> None:
            self.failing: set[int] = set()

        def __len__(self) -> int:
            return len(samples)

        def __getitem__(self, index: int) -> tuple[bytes, int]:
            if index in self.failing:
                raise OSError(f"a transient read failure of sample {index}")
            return samples[index]

    source = Flaky()
    options: dict[str, Any] = {"decode_batch_size": 3 * BATCH, "shuffle": False, "on_error": "raise"}
    (expected,) = uninterrupted(source, 1, **options)
    with make(source, **options) as first:
        take(iter(first), 2)  # two of the first group's three batches
        state = first.state_dict()
    source.failing = {0}  # in the first batch, delivered before the state
    with make(source, **options) as resumed:
        resumed.load_state_dict(state)
        assert_same(take(resumed), expected[2:])


def test_a_sampler_epoch_the_user_sets_is_the_passs_epoch_unless_the_loader_is_told_after(
    samples: list[tuple[bytes, int]],
) -> None:
    """DataLoader's loop calls ``sampler.set_epoch(epoch)``; resumed at epoch 3 from a model-only
    checkpoint, the loader must not put its own count (0) back into the sampler."""
    from torch.utils.data import DistributedSampler

    def order(epoch: int) -> list[int]:  # the reference: the sampler alone, as DataLoader iterates it
        reference = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=5)
        reference.set_epoch(epoch)
        return list(reference)

    def indices(loader: ThreadLoader) -> list[int]:
        return [index for _, targets in take(loader) for index in targets]

    sampler = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=5)
    options: dict[str, Any] = {"shuffle": False, "sampler": sampler, "transform": None}
    with make(samples, **options) as loader:
        for epoch in (3, 4, 4):  # the same epoch again is that epoch again (it changes no value)
            sampler.set_epoch(epoch)
            assert indices(loader) == order(epoch)
        assert indices(loader) == order(4)  # no call: the sampler's epoch, as DataLoader iterates it
        sampler.set_epoch(9)
        loader.set_epoch(7)  # the loader's word since the last pass stands
        assert indices(loader) == order(7)
        assert indices(loader) == order(8)  # and the loader counts on until the next sampler.set_epoch
        sampler.set_epoch(2)
        assert indices(loader) == order(2)
    assert order(3) != order(0)


def test_a_sampler_set_epoch_that_repeats_the_loaders_count_looks_like_no_call(
    samples: list[tuple[bytes, int]],
) -> None:
    """docs/migrating.md said ``sampler.set_epoch(0)`` before the first two passes made only the second
    pass epoch 1: the loader cannot see a call that changes no value, so every later pass is one epoch
    ahead of DataLoader's while the calls follow the loader's count; ``loader.set_epoch`` is kept."""
    from torch.utils.data import DataLoader, DistributedSampler

    def sampler(epoch: int = 0) -> DistributedSampler:
        made = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=5)
        made.set_epoch(epoch)
        return made

    def order(epoch: int) -> list[int]:
        return list(sampler(epoch))

    ours, theirs = sampler(), sampler()
    reference = DataLoader(range(N), batch_size=4, sampler=theirs)
    got, expected = [], []
    with make(samples, shuffle=False, sampler=ours, transform=None) as loader:
        for call in (0, 0, 1, 2):
            ours.set_epoch(call)
            theirs.set_epoch(call)
            got.append([index for _, targets in take(loader) for index in targets])
            expected.append([index for batch in reference for index in batch.tolist()])
        assert expected == [order(0), order(0), order(1), order(2)]  # DataLoader: the calls' epochs
        assert got == [order(0), order(1), order(2), order(3)]  # one ahead, as the docs now say
        loader.set_epoch(3)
        theirs.set_epoch(3)
        assert [index for _, targets in take(loader) for index in targets] == list(theirs) == order(3)


def test_a_sampler_whose_epoch_is_unreadable_keeps_the_users_set_epoch(
    samples: list[tuple[bytes, int]],
) -> None:
    """A sampler that keeps its epoch under another name: the loader cannot see the user's
    ``set_epoch``, so it must not overwrite it with its own count (it gave epochs 0, 1, 2 for 5, 6, 7);
    the loader's own ``set_epoch`` is still forwarded."""

    class Private:
        def __init__(self) -> None:
            self._epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self._epoch = epoch

        def __iter__(self) -> Iterator[int]:
            return iter(order(self._epoch))

        def __len__(self) -> int:
            return N

    def order(epoch: int) -> list[int]:  # the reference: a seeded permutation per epoch, in the test
        return torch.randperm(N, generator=torch.Generator().manual_seed(epoch)).tolist()

    def indices(loader: ThreadLoader) -> list[int]:
        return [index for _, targets in take(loader) for index in targets]

    sampler = Private()
    with make(samples, shuffle=False, sampler=sampler, transform=None) as loader:
        for epoch in (5, 6, 7):
            sampler.set_epoch(epoch)
            assert indices(loader) == order(epoch)
        loader.set_epoch(2)
        assert indices(loader) == order(2)
    assert order(5) != order(0)


def test_a_sampler_epoch_set_before_the_loader_is_built_is_the_first_passs(
    samples: list[tuple[bytes, int]],
) -> None:
    """A loop that builds a loader per epoch after ``sampler.set_epoch(epoch)`` got epoch 0's order
    every time: the epoch was there before the loader, so it did not look set by the user."""
    from torch.utils.data import DistributedSampler

    def order(epoch: int) -> list[int]:
        reference = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=5)
        reference.set_epoch(epoch)
        return list(reference)

    sampler = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=5)
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        with make(samples, shuffle=False, sampler=sampler, transform=None) as loader:
            assert [index for _, targets in take(loader) for index in targets] == order(epoch)
    assert order(1) != order(0)


def test_a_shuffle_seed_near_two_to_the_64_wraps_as_epochs_go_on(samples: list[tuple[bytes, int]]) -> None:
    """Seeds go up to 2**64 - 1; epoch 1 of that one raised (its generator seed overflowed)."""

    def order(seed: int) -> list[int]:
        return torch.randperm(N, generator=torch.Generator().manual_seed(seed)).tolist()

    with make(samples, shuffle=True, seed=2**64 - 1, transform=None) as loader:
        epochs = [[index for _, targets in take(loader) for index in targets] for _ in range(2)]
    assert epochs == [order(2**64 - 1), order(0)]


def test_seed_none_takes_the_state_seed(samples: list[tuple[bytes, int]]) -> None:
    torch.manual_seed(1)
    with make(samples, seed=None) as first:
        expected = [take(first), take(first)]
        state = first.state_dict()  # between epochs 1 and 2: the seed is what matters here
        iterator = iter(first)
        take(iterator, 3)
        mid = round_trip(first.state_dict())
        del iterator
    torch.manual_seed(2)  # another drawn seed: without taking the state's, the order would differ
    with make(samples, seed=None) as resumed:
        resumed.load_state_dict(mid)
        rest = take(resumed)
    torch.manual_seed(1)
    with make(samples, seed=None) as replay:
        replay.set_epoch(2)
        assert_same(rest, take(replay)[3:])
    with make(samples, seed=mid["seed"]) as explicit:  # the same seed given explicitly: accepted
        explicit.load_state_dict(state)
        assert state["epoch"] == 2 and len(take(explicit)) == 8
    assert [t for _, t in expected[0]] != [t for _, t in expected[1]]


def test_set_epoch_after_load_keeps_the_position_for_its_epoch_only(
    samples: list[tuple[bytes, int]], caplog: pytest.LogCaptureFixture
) -> None:
    expected = uninterrupted(samples, 3)
    with make(samples) as first:
        take(first)
        iterator = iter(first)
        take(iterator, 5)
        state = first.state_dict()
        del iterator
    assert (state["epoch"], state["batches"]) == (1, 5)
    with make(samples) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(1)
        assert_same(take(resumed), expected[1][5:])
    with make(samples) as other, caplog.at_level(logging.WARNING, logger="threadloader"):
        other.load_state_dict(state)
        other.set_epoch(2)
        assert_same(take(other), expected[2])
    assert (
        "set_epoch(2) replaces the position loaded by load_state_dict (epoch 1 after 5 batches)"
        in caplog.text
    )


def test_state_before_iterating_and_after_loading(samples: list[tuple[bytes, int]]) -> None:
    with make(samples) as loader:
        state = loader.state_dict()
        assert (state["epoch"], state["batches"], state["seed"]) == (0, 0, 11)
        loader.load_state_dict({**state, "epoch": 4, "batches": 6})
        assert loader.state_dict() == {**state, "epoch": 4, "batches": 6}


def test_state_is_plain_data_that_round_trips(samples: list[tuple[bytes, int]]) -> None:
    with make(samples) as loader:
        iterator = iter(loader)
        take(iterator, 2)
        state = loader.state_dict()
        del iterator

    def plain(value: object) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (bool, int, str))

    assert plain(state)
    assert round_trip(state) == state
    assert state["arguments"] == {
        "num_samples": N,
        "batch_size": BATCH,
        "shuffle": True,
        "drop_last": False,
        "rank": 0,
        "world_size": 1,
        "sampler": None,
        "batch_sampler": None,
    }


def test_user_sampler_is_replayed_and_skipped(samples: list[tuple[bytes, int]]) -> None:
    order = [5, 3, 17, 0, 22, 9, 1, 12, 8, 20, 2, 14]
    options: dict[str, Any] = {"shuffle": False, "sampler": order}
    with make(samples, **options) as first:
        iterator = iter(first)
        take(iterator, 2)
        state = round_trip(first.state_dict())
        del iterator
    assert state["arguments"]["sampler"] == "list of 12"
    with make(samples, **options) as resumed:
        resumed.load_state_dict(state)
        assert [t for _, t in take(resumed)] == [order[6:9], order[9:12]]
    batches = [order[i : i + 4] for i in range(0, 12, 4)]
    with make(samples, batch_size=None, shuffle=False, batch_sampler=batches) as first:
        iterator = iter(first)
        take(iterator, 1)
        state = first.state_dict()
        del iterator
    with make(samples, batch_size=None, shuffle=False, batch_sampler=batches) as resumed:
        resumed.load_state_dict(state)
        assert [t for _, t in take(resumed)] == batches[1:]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"source": "shorter"}, "num_samples: the state's 23, this loader's 22"),
        ({"batch_size": 4}, "batch_size: the state's 3, this loader's 4"),
        ({"shuffle": False}, "shuffle: the state's True, this loader's False"),
        ({"drop_last": True}, "drop_last: the state's False, this loader's True"),
        ({"seed": 12}, "seed: the state's 11, this loader's 12 (pass seed=11, or seed=None"),
        ({"world_size": 2, "rank": 0}, "world_size: the state's 1, this loader's 2"),
        ({"world_size": 2, "rank": 1}, "rank: the state's 0, this loader's 1"),
        (
            {"shuffle": False, "sampler": list(range(N))},
            "sampler: the state's None, this loader's 'list of 23'",
        ),
    ],
)
def test_a_state_from_other_arguments_is_refused(
    samples: list[tuple[bytes, int]], change: dict[str, Any], message: str
) -> None:
    with make(samples) as first:
        state = first.state_dict()
    source = samples[:-1] if change.pop("source", None) else samples
    with make(source, **change) as other, pytest.raises(ValueError) as refused:
        other.load_state_dict(state)
    assert "saved by a loader built with other arguments" in str(refused.value)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"format": "torchdata"}, "not a ThreadLoader state: format 'torchdata'"),
        ({"epoch": -1}, "epoch is a non-negative int, got -1"),
        ({"batches": "3"}, "batches is a non-negative int, got '3'"),
        ({"batches": 9}, "batches: the state's 9, more than this loader's 8 an epoch"),
        ({"seed": 2**64}, f"seed is below 2**64, got {2**64}"),  # seed=0's draws: the constructor refuses it
    ],
)
def test_a_damaged_state_is_refused(
    samples: list[tuple[bytes, int]], damage: dict[str, Any], message: str
) -> None:
    with make(samples) as loader:
        with pytest.raises(ValueError, match=re.escape(message)):
            loader.load_state_dict({**loader.state_dict(), **damage})
        with pytest.raises(ValueError, match="not a ThreadLoader state: format 'list'"):
            loader.load_state_dict([])  # type: ignore[arg-type]


def test_a_resumed_pass_whose_first_group_close_empties_goes_on_without_index_error(
    samples: list[tuple[bytes, int]],
) -> None:
    """close() from another thread emptied the first group while a resumed pass dropped its head: the
    consumer got IndexError: pop from an empty deque."""
    import collections

    class EmptiedByClose(collections.deque):  # type: ignore[type-arg]
        def popleft(self) -> Any:
            value = super().popleft()
            self.clear()  # what close() in another thread does between two pops
            return value

    with make(samples, decode_batch_size=4 * BATCH) as first:
        iterator = iter(first)
        take(iterator, 3)
        state = round_trip(first.state_dict())
        del iterator
    with make(samples, decode_batch_size=4 * BATCH) as resumed:
        resumed.load_state_dict(state)
        iterator = iter(resumed)
        iterator._pending = EmptiedByClose()  # type: ignore[attr-defined]
        _, targets = next(iterator)  # the next group's first batch: no IndexError
        assert len(targets) == BATCH


def test_a_checkpoint_taken_as_a_batch_is_handed_over_counts_only_what_the_loop_got(
    samples: list[tuple[bytes, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The count went up before the batch was handed over: a signal handler that saved the state there
    and raised (Ctrl-C, SIGTERM "save and exit") made the resumed run skip a batch."""
    from threadloader import _handoff

    (expected,) = uninterrupted(samples, 1)
    saved: list[dict[str, Any]] = []
    handed = _handoff.Ready.receive

    def interrupted(ready: Any, *args: Any, **kwargs: Any) -> None:
        handed(ready, *args, **kwargs)
        if len(received) == 3:  # the fourth batch, as it is handed over
            saved.append(loader.state_dict())
            raise KeyboardInterrupt

    received: Run = []
    monkeypatch.setattr(_handoff.Ready, "receive", interrupted)
    with make(samples) as loader, pytest.raises(KeyboardInterrupt):
        for images, targets in loader:
            received.append((images, targets.tolist()))
    monkeypatch.setattr(_handoff.Ready, "receive", handed)
    assert saved[0]["batches"] == 3
    with make(samples) as resumed:
        resumed.load_state_dict(saved[0])
        assert_same(received + take(resumed), expected)


def test_a_checkpoint_taken_as_an_epoch_starts_is_that_epoch(
    samples: list[tuple[bytes, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal handler's state_dict() while iter() set up the epoch read "the next epoch from its
    start" (the lock is re-entrant), so the resumed run skipped the whole epoch."""
    from threadloader import loader as loader_module

    saved: list[dict[str, Any]] = []
    original = loader_module.BatchPlan.set_epoch

    def set_epoch(plan: Any, epoch: int, **options: Any) -> None:  # inside iter(), with the lock held
        saved.append(built.state_dict())
        original(plan, epoch, **options)

    with make(samples) as built:
        built.set_epoch(5)
        monkeypatch.setattr(loader_module.BatchPlan, "set_epoch", set_epoch)
        iter(built)
    assert (saved[0]["epoch"], saved[0]["batches"]) == (5, 0)


@pytest.mark.parametrize("epoch", [-1, 1.7, "x", None])
def test_set_epoch_names_what_is_not_an_epoch(samples: list[tuple[bytes, int]], epoch: object) -> None:
    """-1 was taken, and its state_dict() then refused by load_state_dict as damaged; 1.7 read as 1;
    'x' and None raised int()'s errors, which named no argument."""
    loader = ThreadLoader(samples, batch_size=2, device="cpu")
    with pytest.raises(ValueError, match=rf"set_epoch takes an epoch, an int from 0 up, got {epoch!r}"):
        loader.set_epoch(epoch)  # type: ignore[arg-type]
    loader.set_epoch(torch.tensor(3))  # numpy's and 0-d tensors' integers are epochs
    assert loader.state_dict()["epoch"] == 3
    loader.close()


def _oversampled() -> list[int]:
    """A sampler's epoch that gives samples 0 and 5 several times, as WeightedRandomSampler's do."""
    return [0, 5, 0, 1, 0, 5, 2, 0, 3, 0, 5, 0]


def test_a_sample_given_again_in_an_epoch_draws_another_crop(samples: list[tuple[bytes, int]]) -> None:
    """Every copy of an oversampled sample got the same crop and flip: (seed, epoch, index) keyed them
    all alike, where DataLoader's transforms draw anew each time. The sample's own first time keeps its
    key, so samples given once crop as before."""
    order = _oversampled()
    with make(samples, shuffle=False, sampler=order, batch_size=4) as loader:
        (run,) = [take(loader)]
    images = torch.cat([batch for batch, _ in run])
    copies = [images[p] for p, index in enumerate(order) if index == 0]
    assert len({c.numpy().tobytes() for c in copies}) == len(copies)  # six copies, six crops
    # The first time keeps the key a sample given once has: the same crop as in a plain epoch.
    with make(samples, shuffle=False, sampler=[0, 5, 1], batch_size=3) as loader:
        (once,) = [take(loader)]
    assert torch.equal(once[0][0][0], images[0]) and torch.equal(once[0][0][1], images[1])
    assert torch.equal(once[0][0][2], images[3])  # sample 1, given once in both


@pytest.mark.parametrize(("threads", "group"), [(1, None), (3, 5), (2, 12)])
def test_repeats_crop_alike_for_any_threads_grouping_and_resume(
    samples: list[tuple[bytes, int]], threads: int, group: int | None
) -> None:
    """The repeat is counted in the plan's order from the epoch's first batch: readers, groups and a
    resume (which skips whole groups unread) all see the same count."""
    options = {"shuffle": False, "sampler": _oversampled(), "batch_size": 2}
    (expected,) = uninterrupted(samples, 1, **options)
    with make(samples, num_threads=threads, decode_batch_size=group, **options) as loader:
        iterator = iter(loader)
        head = take(iterator, 3)
        state = round_trip(loader.state_dict())
    with make(samples, num_threads=threads, decode_batch_size=group, **options) as resumed:
        resumed.load_state_dict(state)
        tail = take(resumed)
    assert_same(head + tail, expected)


def test_a_pass_that_handed_out_no_batch_is_no_epoch(samples: list[tuple[bytes, int]]) -> None:
    """An iter() dropped before its first batch (a framework checking the loader) counted as an epoch:
    the next pass ran the epoch after, where state_dict() said the dropped one would run."""
    expected = uninterrupted(samples, 3)
    with make(samples) as loader:
        dropped = iter(loader)
        assert loader.state_dict()["epoch"] == 0
        del dropped
        assert_same(take(loader), expected[0])  # epoch 0, not 1
        partly = iter(loader)
        take(partly, 1)  # a pass that handed out a batch is an epoch: the next one is the one after
        del partly
        assert_same(take(loader), expected[2])
    with make(samples) as loader:  # a loaded position survives a dropped pass too
        loader.load_state_dict(round_trip({**loader.state_dict(), "epoch": 1, "batches": 3}))
        dropped = iter(loader)
        del dropped
        assert_same(take(loader), expected[1][3:])


def test_passes_running_at_once_are_epochs_one_after_the_other(samples: list[tuple[bytes, int]]) -> None:
    """A pass started while another has handed out nothing yet (``zip(loader, loader)``, two threads'
    loops) was taken for a dropped one and ran the same epoch: both passes gave the very same batches,
    where DataLoader's iterators each draw their own order."""
    with make(samples, transform=None) as loader:
        pairs = list(zip(loader, loader, strict=True))
        assert [first.tolist() for (_, first), _ in pairs] == _distributed_batches(0)
        assert [second.tolist() for _, (_, second) in pairs] == _distributed_batches(1)
        assert loader.state_dict()["epoch"] == 2
    with make(samples, transform=None) as loader:  # a loaded position goes to the first pass alone
        loader.load_state_dict(round_trip({**loader.state_dict(), "epoch": 1, "batches": 3}))
        first, second = iter(loader), iter(loader)
        assert [targets for _, targets in take(second)] == _distributed_batches(2)
        assert [targets for _, targets in take(first)] == _distributed_batches(1)[3:]


def test_set_epoch_after_a_dropped_pass_keeps_a_loaded_position(samples: list[tuple[bytes, int]]) -> None:
    """Load a position, a framework's dropped iter(), then the loop's set_epoch(e) of that epoch: the
    epoch restarted from its first batch, though state_dict() still said the position."""
    expected = uninterrupted(samples, 1)
    with make(samples) as loader:
        loader.load_state_dict(round_trip({**loader.state_dict(), "epoch": 0, "batches": 3}))
        dropped = iter(loader)
        del dropped
        loader.set_epoch(0)
        assert_same(take(loader), expected[0][3:])


def test_a_pass_whose_first_batch_raises_is_an_epoch(samples: list[tuple[bytes, int]]) -> None:
    """A SampleError in a pass's first batch made it no epoch: a loop that catches the error and goes on
    ran that epoch again and again (its order, its failure), where DataLoader's next pass is the next
    epoch, as it is here when the error comes in a later batch."""
    broken = [(b"not an image", 0), *samples[1:]]
    with make(broken, shuffle=False) as loader:
        for epoch in range(3):
            iterator = iter(loader)
            with pytest.raises(SampleError):  # sample 0 is in every epoch's first batch
                next(iterator)
            assert loader.state_dict()["epoch"] == epoch  # the pass that raised: epoch 0, then 1, 2
            assert take(iterator) == []  # it ended there


def test_a_pass_whose_sampler_fails_at_its_start_is_an_epoch(samples: list[tuple[bytes, int]]) -> None:
    """A sampler that raises before its first index makes iter() raise (the pass draws its first batches
    there): that pass was no epoch, so a loop going on after the error ran the same epoch again."""

    class FailsOnEpochOne:
        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            if self.epoch == 1:
                raise RuntimeError("the sampler's source is down")
            return iter(range(len(samples)))

        def __len__(self) -> int:
            return len(samples)

    sampler = FailsOnEpochOne()
    with make(samples, sampler=sampler, shuffle=False) as loader:
        assert len(take(loader)) == len(loader)
        with pytest.raises(RuntimeError, match="source is down"):
            iter(loader)
        assert loader.state_dict()["epoch"] == 1
        assert len(take(loader)) == len(loader)
        assert sampler.epoch == 2  # the pass after the one that raised, as DataLoader's would be


def test_a_padded_shards_repeated_sample_draws_another_crop_than_on_its_first_rank(
    samples: list[tuple[bytes, int]],
) -> None:
    """Padding a shard repeats the order's start on another rank: counted on each rank alone, the copy
    was every sample's first time, so both ranks trained on the very same crop of it."""
    options: dict[str, Any] = {"shuffle": False, "batch_size": 12, "world_size": 2}
    with make(samples, rank=0, **options) as rank0, make(samples, rank=1, **options) as rank1:
        first, padded = take(rank0)[0], take(rank1)[-1]
    assert first[1][0] == 0 and padded[1][-1] == 0  # N = 23: sample 0 pads rank 1's shard
    # The reference: one loader given sample 0 twice (its second time), and once.
    with make(samples, shuffle=False, sampler=[0, 0], batch_size=2) as twice:
        ((copies, _),) = take(twice)
    assert torch.equal(first[0][0], copies[0])  # its first time keeps its crop
    assert torch.equal(padded[0][-1], copies[1])  # the padding is its second time
    assert not torch.equal(padded[0][-1], first[0][0])


def _distributed_batches(epoch: int) -> list[list[int]]:
    """The reference order: ``make``'s shuffle is ``DistributedSampler``'s for seed 11, one rank."""
    from torch.utils.data import BatchSampler, DistributedSampler

    sampler = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=11)
    sampler.set_epoch(epoch)
    return [list(batch) for batch in BatchSampler(sampler, BATCH, drop_last=False)]


def test_set_epoch_after_a_pass_stopped_early_is_what_the_state_says(
    samples: list[tuple[bytes, int]],
) -> None:
    """A loop that breaks out of epoch 0, calls set_epoch(1) and checkpoints: the state said "epoch 0
    after 2 batches", so the resumed run took epoch 0's tail where the saving loader runs epoch 1."""
    with make(samples) as first:
        iterator = iter(first)
        take(iterator, 2)
        del iterator  # break: the pass has stopped
        first.set_epoch(1)
        state = round_trip(first.state_dict())
    assert (state["epoch"], state["batches"]) == (1, 0)
    with make(samples) as resumed:
        resumed.load_state_dict(state)
        assert [targets for _, targets in take(resumed)] == _distributed_batches(1)
    with make(samples) as running:  # a pass still running keeps its position: the loop may go on
        iterator = iter(running)
        take(iterator, 2)
        running.set_epoch(1)
        state = running.state_dict()
        assert (state["epoch"], state["batches"]) == (0, 2)
        assert [targets for _, targets in take(iterator)] == _distributed_batches(0)[2:]


def test_a_batch_sampler_over_an_endless_sampler_has_a_state(samples: list[tuple[bytes, int]]) -> None:
    """BatchSampler's __len__ raises TypeError over a sampler without one: state_dict() raised it too,
    where DataLoader iterates that batch sampler, and so does the loader."""
    from torch.utils.data import BatchSampler, DataLoader, Sampler

    class Endless(Sampler[int]):
        def __init__(self) -> None:
            pass

        def __iter__(self) -> Iterator[int]:
            return itertools.cycle(range(N))

    batch_sampler = BatchSampler(Endless(), 4, drop_last=False)
    reference = [
        batch.tolist() for batch in itertools.islice(DataLoader(range(N), batch_sampler=batch_sampler), 5)
    ]
    options: dict[str, Any] = {"batch_size": None, "shuffle": False, "batch_sampler": batch_sampler}
    with make(samples, **options) as first:
        iterator = iter(first)
        assert [targets for _, targets in take(iterator, 2)] == reference[:2]
        state = round_trip(first.state_dict())
        del iterator
    assert (state["epoch"], state["batches"], state["arguments"]["batch_sampler"]) == (0, 2, "BatchSampler")
    with make(samples, **options) as resumed:
        resumed.load_state_dict(state)
        iterator = iter(resumed)
        assert [targets for _, targets in take(iterator, 3)] == reference[2:5]
        del iterator
