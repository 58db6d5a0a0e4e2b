"""Several output batches decoded in one call (``decode_batch_size`` > ``batch_size``): the consumer
must not be able to tell, in order, content, errors or skips."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from threadloader import SampleError, ThreadLoader
from threadloader._sampling import group_batches

from .conftest import encode, mean_abs_diff, photo, pil_reference

N = 23


@pytest.fixture(scope="module")
def samples() -> list[tuple[bytes, int]]:
    return [(encode(photo(24, 32, seed=300 + i), quality=90), i) for i in range(N)]


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


@pytest.mark.parametrize("num_threads", [1, 3])
def test_a_group_of_regions_is_transformed_at_once_as_per_batch(
    monkeypatch: pytest.MonkeyPatch, num_threads: int
) -> None:
    # A group decoded into one padded tensor is cropped, flipped and resized in one call, then split:
    # the same order, crops and pixels as one call per output batch (within the resampling's rounding:
    # the padding differs between the two).
    from threadloader import _device as device_module
    from threadloader.transforms import RandomHorizontalFlip, RandomResizedCrop

    from .test_transforms import RegionDecoder

    monkeypatch.setattr(device_module, "make_decoder", lambda *args, **kwargs: RegionDecoder())
    sized = [
        (encode(photo(20 + 3 * (i % 5), 28 + 2 * (i % 4), seed=400 + i), quality=90), i) for i in range(N)
    ]
    calls: list[int] = []
    transform = [RandomResizedCrop(16), RandomHorizontalFlip()]
    original = transform[0].apply_many
    monkeypatch.setattr(
        transform[0],
        "apply_many",
        lambda images, params: calls.append(len(images)) or original(images, params),
    )
    options = dict(
        batch_size=4, shuffle=True, seed=9, num_threads=num_threads, device="cpu", transform=transform
    )
    with ThreadLoader(sized, decode_batch_size=12, **options) as grouped:
        grouped_epoch = [(images, targets.tolist()) for images, targets in grouped]
    assert sorted(calls) == [11, 12]  # one call per group of 3 batches (23 samples)
    with ThreadLoader(sized, decode_batch_size=4, **options) as plain:
        plain_epoch = [(images, targets.tolist()) for images, targets in plain]
    assert [t for _, t in grouped_epoch] == [t for _, t in plain_epoch]
    for (grouped_images, _), (plain_images, _) in zip(grouped_epoch, plain_epoch, strict=True):
        assert grouped_images.shape == plain_images.shape == (len(plain_images), 3, 16, 16)
        assert (grouped_images.int() - plain_images.int()).abs().max() <= 1
