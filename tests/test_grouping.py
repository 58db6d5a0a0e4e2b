"""Several output batches decoded in one call (``decode_batch_size`` > ``batch_size``): the consumer
must not be able to tell, in order, content, errors or skips."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from threadloader import SampleError, ThreadLoader
from threadloader._sampling import group_batches
from threadloader.decode import DecodedBatch, Encoded, PillowDecoder, Region
from threadloader.transforms import RandomHorizontalFlip, RandomResizedCrop, Transform
from threadloader.transforms.functional import Images

from .conftest import encode, mean_abs_diff, photo, pil_reference
from .test_transforms import RegionDecoder

N = 23


@pytest.fixture(scope="module")
def samples() -> list[tuple[bytes, int]]:
    return [(encode(photo(24, 32, seed=300 + i), quality=90), i) for i in range(N)]


@pytest.fixture(scope="module")
def sized() -> list[tuple[bytes, int]]:
    """Samples of several sizes (random crops then differ in size too)."""
    return [
        (encode(photo(20 + 3 * (i % 5), 28 + 2 * (i % 4), seed=400 + i), quality=90), i) for i in range(N)
    ]


@pytest.fixture(scope="module")
def references(samples: list[tuple[bytes, int]]) -> list[np.ndarray]:
    return [pil_reference(data) for data, _ in samples]


def test_group_batches_packs_consecutive_batches() -> None:
    batches = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]
    assert list(group_batches(batches, 6)) == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10]]]
    assert list(group_batches(batches, 7)) == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10]]]
    assert list(group_batches(batches, 2)) == [[b] for b in batches]  # a batch larger than the limit
    assert list(group_batches([], 8)) == []


def test_group_batches_yields_planned_batches_before_a_sampler_error() -> None:
    def failing():
        yield [0, 1]
        yield [2, 3]
        raise RuntimeError("sampler broke")

    groups = group_batches(failing(), 100)
    assert next(groups) == [[0, 1], [2, 3]]
    with pytest.raises(RuntimeError, match="sampler broke"):
        next(groups)


@pytest.mark.parametrize("decode_batch_size", [8, 12, 100])
@pytest.mark.parametrize("num_threads", [1, 3])
def test_order_and_pixels_match_ungrouped(
    samples: list[tuple[bytes, int]], references: list[np.ndarray], decode_batch_size: int, num_threads: int
) -> None:
    options = dict(batch_size=4, shuffle=True, seed=5, num_threads=num_threads, device="cpu")
    with ThreadLoader(samples, decode_batch_size=decode_batch_size, **options) as grouped:
        grouped_epoch = [(images, targets.tolist()) for images, targets in grouped]
    with ThreadLoader(samples, **options) as plain:
        plain_order = [targets.tolist() for _, targets in plain]
    assert [targets for _, targets in grouped_epoch] == plain_order
    assert len(grouped_epoch) == len(grouped) == -(-N // 4)
    for images, targets in grouped_epoch:
        for image, target in zip(images, targets, strict=True):
            assert mean_abs_diff(image, references[target]) == 0


def test_stacked_output_of_a_group_is_split_per_batch(samples: list[tuple[bytes, int]]) -> None:
    with ThreadLoader(samples, batch_size=5, decode_batch_size=15, size=(24, 32), device="cpu") as loader:
        shapes = [tuple(images.shape) for images, _ in loader]
    assert shapes == [(5, 3, 24, 32)] * 4 + [(3, 3, 24, 32)]


class _StackedDecoder(PillowDecoder):
    """Gives each call's images as one stacked tensor, as the GPU decoder does for images of one size."""

    def decode(self, encoded: Sequence[Encoded], **kwargs: Any) -> DecodedBatch:
        decoded = super().decode(encoded, **kwargs)
        images = [decoded.image(p) for p in range(len(encoded))]
        assert all(image is not None for image in images)
        batch = torch.stack(images)  # type: ignore[arg-type]
        size = (int(batch.shape[1]), int(batch.shape[2]))
        return DecodedBatch(extents=[size] * len(encoded), batch=batch, rows=set(range(len(encoded))))


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_batch_of_a_stacked_group_owns_its_memory(
    samples: list[tuple[bytes, int]], channels_last: bool
) -> None:
    """Rows of a group's stacked output already in the output's format are copied out: as views, each
    batch the consumer holds would keep the whole group's memory alive."""
    options = dict(batch_size=4, size=(24, 32), channels_last=channels_last, device="cpu")
    with ThreadLoader(samples, decode_batch_size=12, decoder=_StackedDecoder(), **options) as grouped:
        batches = [images for images, _ in grouped]
    with ThreadLoader(samples, **options) as plain:
        expected = [images for images, _ in plain]
    assert len(batches) == len(expected) == -(-N // 4)
    for images, reference in zip(batches, expected, strict=True):
        assert images.untyped_storage().nbytes() == images.nbytes
        assert images.is_contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format
        )
        assert torch.equal(images, reference)


def test_error_is_raised_at_its_batch_inside_a_group(samples: list[tuple[bytes, int]]) -> None:
    broken = list(samples)
    broken[9] = (b"not an image at all", 9)  # third batch of four, inside the first group of 12
    seen = []
    with ThreadLoader(broken, batch_size=4, decode_batch_size=12, device="cpu") as loader:
        with pytest.raises(SampleError) as caught:
            for _, targets in loader:
                seen.append(targets.tolist())
        assert caught.value.index == 9 and caught.value.stage == "decode"
        assert seen == [[0, 1, 2, 3], [4, 5, 6, 7]]
        again = [targets.tolist() for _, (_, targets) in zip(range(2), loader, strict=False)]
        assert again == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a new pass starts over


def test_fetch_error_inside_a_group_delivers_the_batches_before_it(samples: list[tuple[bytes, int]]) -> None:
    class Flaky:
        def __len__(self) -> int:
            return len(samples)

        def __getitem__(self, index: int) -> tuple[bytes, int]:
            if index == 6:
                raise KeyError("lost")
            return samples[index]

    seen = []
    loader = ThreadLoader(Flaky(), batch_size=3, decode_batch_size=9, device="cpu")
    with loader, pytest.raises(SampleError, match="KeyError") as caught:
        for _, targets in loader:
            seen.append(targets.tolist())
    assert seen == [[0, 1, 2], [3, 4, 5]] and caught.value.stage == "fetch"


def test_errors_of_reading_and_decoding_come_in_the_batch_order(
    samples: list[tuple[bytes, int]], caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def __len__(self) -> int:
            return len(samples)

        def __getitem__(self, index: int) -> tuple[bytes, int]:
            if index in (6, 9):
                raise KeyError("lost")
            return (b"not an image", index) if index in (5, 8) else samples[index]

    options = dict(batch_size=4, decode_batch_size=12, device="cpu", num_threads=1)
    skipping = ThreadLoader(Broken(), on_error="skip", **options)  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="threadloader"), skipping as loader:
        batches = [targets.tolist() for _, targets in loader]
    found = [re.match(r"skipping sample (\d+) .*: (\w+) failed", r.getMessage()) for r in caplog.records]
    skipped = [(int(m[1]), m[2]) for m in found if m]
    assert skipped == [(5, "decode"), (6, "fetch"), (8, "decode"), (9, "fetch")]
    assert batches[1] == [4, 7] and batches[2] == [10, 11]
    with ThreadLoader(Broken(), **options) as loader, pytest.raises(SampleError) as caught:  # type: ignore[arg-type]
        list(loader)
    assert (caught.value.index, caught.value.stage) == (5, "decode")  # the batch's first bad sample


def test_skip_inside_a_group(samples: list[tuple[bytes, int]]) -> None:
    broken = list(samples)
    for index in (1, 4, 5, 6, 7):
        broken[index] = (b"garbage", index)
    with ThreadLoader(broken, batch_size=4, decode_batch_size=12, on_error="skip", device="cpu") as loader:
        batches = [targets.tolist() for _, targets in loader]
        stats = loader.stats()
    # Batch [4, 5, 6, 7] is left empty, so it is not yielded.
    assert batches[:2] == [[0, 2, 3], [8, 9, 10, 11]]
    assert sum(len(b) for b in batches) == N - 5
    assert stats.skipped == 5 and stats.errors == 5 and stats.samples == N - 5


def test_grouped_order_survives_random_delays(samples: list[tuple[bytes, int]]) -> None:
    class Slow:
        def __len__(self) -> int:
            return len(samples)

        def __getitem__(self, index: int) -> tuple[bytes, int]:
            time.sleep(random.random() * 0.003)
            return samples[index]

    with ThreadLoader(Slow(), batch_size=2, decode_batch_size=6, num_threads=4, device="cpu") as loader:
        order = [t for _, targets in loader for t in targets.tolist()]
    assert order == list(range(N))


def test_decode_batch_size_is_validated(samples: list[tuple[bytes, int]]) -> None:
    with pytest.raises(ValueError, match="decode_batch_size"):
        ThreadLoader(samples, decode_batch_size=0, device="cpu")
    assert ThreadLoader(samples, batch_size=4, device="cpu").decode_batch_size == 4


def _region_epoch(
    monkeypatch: pytest.MonkeyPatch, source: list, *, decode_batch_size: int, num_threads: int
) -> tuple[list[tuple[torch.Tensor, list[int]]], list[int]]:
    """An epoch through a fake region decoder (regions in a padded tensor, as on the GPU); also the
    number of images of each ``RandomResizedCrop.apply_many`` call."""
    crop = RandomResizedCrop(16)
    calls: list[int] = []
    resample = crop.apply_many

    def counting(images: Images, params: Sequence[Region]) -> Images:
        calls.append(len(images))
        return resample(images, params)

    monkeypatch.setattr(crop, "apply_many", counting)
    options = dict(
        batch_size=4, shuffle=True, seed=0, num_threads=num_threads, on_error="skip", decoder=RegionDecoder()
    )
    transform = [crop, RandomHorizontalFlip()]
    with ThreadLoader(source, decode_batch_size=decode_batch_size, transform=transform, **options) as loader:
        return [(images, targets.tolist()) for images, targets in loader], calls


def _assert_same_epochs(
    a: list[tuple[torch.Tensor, list[int]]], b: list[tuple[torch.Tensor, list[int]]]
) -> None:
    assert [targets for _, targets in a] == [targets for _, targets in b]
    for (images_a, targets), (images_b, _) in zip(a, b, strict=True):
        assert images_a.shape == images_b.shape == (len(targets), 3, 16, 16)
        assert images_a.is_contiguous() and images_a.untyped_storage().nbytes() == images_a.nbytes
        assert (images_a.int() - images_b.int()).abs().max() <= 1  # rounding: the padding differs


@pytest.mark.parametrize("num_threads", [1, 3])
def test_a_group_of_regions_is_transformed_at_once_as_per_batch(
    monkeypatch: pytest.MonkeyPatch, sized: list[tuple[bytes, int]], num_threads: int
) -> None:
    # Cropped, flipped and resized in one call per group of 3 batches, then split into batches that
    # own their memory: the same order, crops and pixels as one call per batch.
    grouped, calls = _region_epoch(monkeypatch, sized, decode_batch_size=12, num_threads=num_threads)
    assert sorted(calls) == [11, 12]  # 23 samples: groups of 12 and 11
    plain, calls = _region_epoch(monkeypatch, sized, decode_batch_size=4, num_threads=num_threads)
    assert sorted(calls) == [3] + [4] * 5
    _assert_same_epochs(grouped, plain)


def test_a_group_with_a_skipped_sample_is_transformed_per_batch(
    monkeypatch: pytest.MonkeyPatch, sized: list[tuple[bytes, int]]
) -> None:
    broken = [*sized[:5], (12345, 5), *sized[6:]]  # not encoded data: a fetch error, skipped
    grouped, calls = _region_epoch(monkeypatch, broken, decode_batch_size=12, num_threads=2)
    # With seed 0 the bad sample falls in the second group (batches of 4, 4 and 3): that group is
    # transformed per batch, its batch with the bad sample has 3; the first group at once.
    assert sorted(calls) == [3, 3, 4, 12]
    plain, _ = _region_epoch(monkeypatch, broken, decode_batch_size=4, num_threads=2)
    _assert_same_epochs(grouped, plain)
    assert sorted(t for _, targets in grouped for t in targets) == [t for t in range(N) if t != 5]


class _SizeUnknown(Transform):
    """Changes nothing but does not declare its output size, so batches stay lists of images."""

    def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        return None

    def apply(self, images: torch.Tensor, params: object) -> torch.Tensor:
        return images


def test_a_group_formatted_at_once_into_lists_gives_images_of_their_own(
    sized: list[tuple[bytes, int]],
) -> None:
    transform = [RandomResizedCrop(16), _SizeUnknown()]
    options = dict(batch_size=4, decode_batch_size=12, transform=transform, decoder=RegionDecoder())
    with ThreadLoader(sized, **options) as loader:  # type: ignore[arg-type]
        batches = [images for images, _ in loader]
    assert [len(images) for images in batches] == [4] * 5 + [3]
    for images in batches:
        assert isinstance(images, list)
        for image in images:
            assert image.shape == (3, 16, 16) and image.untyped_storage().nbytes() == image.nbytes


class _RecordingRegionDecoder(RegionDecoder):
    """Notes the samples of each decoder call (by their bytes), in call order."""

    def __init__(self, names: dict[bytes, int]) -> None:
        super().__init__()
        self.names, self.calls = names, []  # type: ignore[var-annotated]

    def decode(self, encoded, *, stream, stats=None, region_of=None, pad=False):  # type: ignore[no-untyped-def]
        self.calls.append(sorted(self.names[bytes(data)] for data in encoded))
        return super().decode(encoded, stream=stream, stats=stats, region_of=region_of)


@pytest.mark.parametrize("consumed", [1, 4, 5])  # inside the first group, inside the second, its last batch
def test_a_resumed_epoch_decodes_the_uninterrupted_groups(
    sized: list[tuple[bytes, int]], consumed: int
) -> None:
    # On the GPU, the regions of a group are resampled in one padded tensor, so a float pixel depends on
    # its group: resuming must decode the groups the uninterrupted epoch decoded (the first one whole,
    # its batches before the state dropped), not new groups counted from the resume point.
    names = {data: target for data, target in sized}
    options = dict(
        batch_size=4, shuffle=True, seed=3, num_threads=1, decode_batch_size=12,
        transform=[RandomResizedCrop(16), RandomHorizontalFlip()], dtype=torch.float32,
        mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3),
    )  # fmt: skip
    first = _RecordingRegionDecoder(names)
    with ThreadLoader(sized, decoder=first, **options) as loader:
        expected = [(images, targets.tolist()) for images, targets in loader]
        loader.set_epoch(0)
        iterator = iter(loader)
        for _ in range(consumed):
            next(iterator)
        state = loader.state_dict()
        del iterator
    groups = first.calls[:2]  # the uninterrupted epoch's (one reader thread: its calls come first)
    assert [len(g) for g in groups] == [12, 11]
    second = _RecordingRegionDecoder(names)
    with ThreadLoader(sized, decoder=second, **options) as resumed:
        resumed.load_state_dict(state)
        got = [(images, targets.tolist()) for images, targets in resumed]
    assert second.calls == groups[consumed // 3 :]
    assert [targets for _, targets in got] == [targets for _, targets in expected[consumed:]]
    for (images, targets), (reference, _) in zip(got, expected[consumed:], strict=True):
        assert torch.equal(images, reference), f"pixels differ in the batch of samples {targets}"


# -- a transform's or collate_fn's error inside a group: raised at its batch ----------------------


class _RefuseSmall(Transform):
    """Leaves images as they are, but refuses a 16x16 one (the sample that tests mark)."""

    def apply(self, images: torch.Tensor, params: object) -> torch.Tensor:
        if tuple(images.shape[-2:]) == (16, 16):
            raise ValueError("refusing a 16x16 image: give it 24x32")
        return images


@pytest.fixture(scope="module")
def marked(samples: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
    """The samples with sample 9 (third batch of four, in the first group of 12) made 16x16."""
    changed = list(samples)
    changed[9] = (encode(photo(16, 16, seed=309), quality=90), 9)
    return changed


@pytest.mark.parametrize("num_threads", [1, 3])
def test_a_transform_error_inside_a_group_is_raised_at_its_batch(
    marked: list[tuple[bytes, int]], num_threads: int
) -> None:
    # It escaped the group's making: raised at the group's first batch, it took [0..3] and [4..7].
    options = dict(batch_size=4, decode_batch_size=12, num_threads=num_threads, device="cpu")
    received = []
    with ThreadLoader(marked, transform=_RefuseSmall(), **options) as loader:  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="refusing a 16x16 image: give it 24x32") as caught:
            for images, targets in loader:
                received.append((images, targets.tolist()))
        assert [targets for _, targets in received] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        for images, targets in received:
            for image, target in zip(images, targets, strict=True):
                assert mean_abs_diff(image, pil_reference(marked[target][0])) == 0
        # The user's exception itself: its type, and a traceback down to the line that raised it.
        assert type(caught.value) is ValueError
        assert caught.traceback[-1].name == "apply" and caught.traceback[-1].path == Path(__file__)
        again = [targets.tolist() for _, (_, targets) in zip(range(2), loader, strict=False)]
        assert again == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a new pass starts over


class _RefuseBlack(Transform):
    """Leaves images as they are, but refuses a batch holding an all-black one."""

    def apply(self, images: torch.Tensor, params: object) -> torch.Tensor:
        if bool((images.flatten(-3).amax(-1) == 0).any()):
            raise ValueError("refusing a black image")
        return images


def test_a_transform_error_in_a_group_of_regions_transformed_at_once_is_raised_at_its_batch(
    sized: list[tuple[bytes, int]],
) -> None:
    # A padded group of regions is transformed in one call: which batch failed is unknown there, so
    # the batches are made one by one instead, with the crops they get in groups of one batch.
    black = [*sized[:9], (encode(np.zeros((20, 28, 3), np.uint8), "PNG"), 9), *sized[10:]]
    refuse = _RefuseBlack()
    sizes: list[int] = []
    apply_many = refuse.apply_many

    def counting(images: Images, params: Sequence[object]) -> Images:
        sizes.append(len(images))
        return apply_many(images, params)

    refuse.apply_many = counting  # type: ignore[method-assign]
    epochs = []
    for group in (12, 4):
        options = dict(batch_size=4, decode_batch_size=group, num_threads=1, seed=0, decoder=RegionDecoder())
        transform = [RandomResizedCrop(16), RandomHorizontalFlip(), refuse]
        received = []
        loader = ThreadLoader(black, transform=transform, **options)  # type: ignore[arg-type]
        with loader, pytest.raises(ValueError, match="refusing a black image"):
            for images, targets in loader:
                received.append((images, targets.tolist()))
        assert [targets for _, targets in received] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        epochs.append(received)
        if group == 12:  # tried at once (raised), then per batch: the third raised again
            assert sizes[:4] == [12, 4, 4, 4]
    _assert_same_epochs(*epochs)


def test_batches_after_a_transform_error_in_a_group_are_still_made(samples: list[tuple[bytes, int]]) -> None:
    # A resumed pass makes its first group again and drops the batches before the state: an error in
    # one of those (a transform that failed this time only) must not take the batches after it.
    calls = 0

    class FailsOnItsSecondCall(Transform):
        def apply(self, images: torch.Tensor, params: object) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise OSError("the transform's file server was away")
            return images

    options = dict(batch_size=4, decode_batch_size=12, num_threads=1, device="cpu")
    with ThreadLoader(samples, **options) as first:  # type: ignore[arg-type]
        iterator = iter(first)
        assert [next(iterator)[1].tolist() for _ in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        state = first.state_dict()
        del iterator
    with ThreadLoader(samples, transform=FailsOnItsSecondCall(), **options) as resumed:  # type: ignore[arg-type]
        resumed.load_state_dict(state)
        order = [t for _, targets in resumed for t in targets.tolist()]
    assert calls > 2 and order == list(range(8, N))  # the second call was batch [4..7], dropped


def test_a_collate_fn_error_inside_a_group_is_raised_at_its_batch(samples: list[tuple[bytes, int]]) -> None:
    def refuse_9(targets: list[int]) -> torch.Tensor:
        if 9 in targets:
            raise KeyError("no label for sample 9")
        return torch.tensor(targets)

    received = []
    options = dict(batch_size=4, decode_batch_size=12, num_threads=2, device="cpu")
    loader = ThreadLoader(samples, collate_fn=refuse_9, **options)  # type: ignore[arg-type]
    with loader, pytest.raises(KeyError, match="no label for sample 9"):
        for _, targets in loader:
            received.append(targets.tolist())
    assert received == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_stop_iteration_from_a_transform_inside_a_group_is_raised_at_its_batch(
    marked: list[tuple[bytes, int]],
) -> None:
    # Raised on by next() as it was, it would end the pass there, as if the epoch were complete.
    class RunsDry(Transform):
        def apply(self, images: torch.Tensor, params: object) -> torch.Tensor:
            if tuple(images.shape[-2:]) == (16, 16):
                next(iter([]))
            return images

    received = []
    options = dict(batch_size=4, decode_batch_size=12, device="cpu", transform=RunsDry())
    loader = ThreadLoader(marked, **options)  # type: ignore[arg-type]
    with loader, pytest.raises(RuntimeError, match="a reader's work raised StopIteration") as caught:
        for _, targets in loader:
            received.append(targets.tolist())
    assert received == [[0, 1, 2, 3], [4, 5, 6, 7]] and isinstance(caught.value.__cause__, StopIteration)


class _Abort(BaseException):
    """Not an ``Exception``: as ``KeyboardInterrupt`` or ``SystemExit``, it stops, it is no batch's error."""


def test_a_base_exception_from_a_transform_fails_its_whole_group(marked: list[tuple[bytes, int]]) -> None:
    class Aborts(Transform):
        def apply(self, images: torch.Tensor, params: object) -> torch.Tensor:
            if tuple(images.shape[-2:]) == (16, 16):
                raise _Abort("stop")
            return images

    received = []
    options = dict(batch_size=4, decode_batch_size=12, device="cpu", transform=Aborts())
    loader = ThreadLoader(marked, **options)  # type: ignore[arg-type]
    with loader, pytest.raises(_Abort, match="stop"):
        for _, targets in loader:
            received.append(targets.tolist())
    assert received == []  # at the group's first batch: no batch of it is handed out
