"""ThreadLoader's API on the CPU path: sources, order, shuffle, samplers, collation, options, errors."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import multiprocessing
import os
import pickle
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
    SubsetRandomSampler,
    default_collate,
)

from threadloader import (
    BatchDecoder,
    CPUFallbackWarning,
    ImageFolder,
    SampleError,
    ThreadLoader,
    ThreadLoaderError,
    _workers,
)
from threadloader._pipeline import Batch
from threadloader.decode import PillowDecoder
from threadloader.transforms import RandomHorizontalFlip, RandomResizedCrop, Transform

from .conftest import (
    distinct_jpegs,
    encode,
    photo,
    pil_reference,
    resident_bytes,
    wait_for_no_reader_threads,
    write_files,
)

H, W = 32, 48
N = 24


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return distinct_jpegs(N, H, W, first_seed=100)


@pytest.fixture
def paths(tmp_path: Path, blobs: list[bytes]) -> list[str]:
    return write_files(tmp_path, blobs, "img_{:03d}.jpg")


def assert_pixels(images: torch.Tensor | list[torch.Tensor], refs: list[np.ndarray], indices: list[int]):
    """Every image equals the Pillow reference of its index, pixel for pixel."""
    assert len(images) == len(indices)
    for image, index in zip(images, indices, strict=True):
        assert image.dtype == torch.uint8
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), refs[index], err_msg=f"sample {index}")


def epoch(loader: ThreadLoader) -> list[list[int]]:
    """One pass, as the list of target batches (targets are the sample indices)."""
    return [targets.tolist() for _, targets in loader]


def checked_epoch(loader: ThreadLoader, refs: list[np.ndarray]) -> list[list[int]]:
    """One pass, as :func:`epoch`, every image checked against its Pillow reference on the way."""
    batches = []
    for images, targets in loader:
        assert_pixels(images, refs, targets.tolist())
        batches.append(targets.tolist())
    return batches


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


# --------------------------------------------------------------------------------------------- sources


@pytest.mark.parametrize("kind", ["str", "pathlib"])
def test_list_of_paths(paths: list[str], refs: list[np.ndarray], kind: str) -> None:
    source = paths if kind == "str" else [Path(p) for p in paths]
    loader = ThreadLoader(source, batch_size=5, num_threads=3)
    assert len(loader) == 5
    seen = []
    for images, targets in loader:
        assert targets is None
        assert isinstance(images, list)
        assert_pixels(images, refs, list(range(len(seen), len(seen) + len(images))))
        seen.extend(range(len(seen), len(seen) + len(images)))
    assert seen == list(range(N))


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_list_of_bytes(blobs: list[bytes], refs: list[np.ndarray], kind: type) -> None:
    loader = ThreadLoader([kind(b) for b in blobs], batch_size=7, num_threads=2, size=(H, W))
    offset = 0
    sizes = []
    for images, targets in loader:
        assert targets is None
        assert images.shape == (len(images), 3, H, W)
        assert_pixels(images, refs, list(range(offset, offset + len(images))))
        offset += len(images)
        sizes.append(len(images))
    assert sizes == [7, 7, 7, 3]


@pytest.mark.parametrize("data", ["path", "bytes"])
def test_list_of_pairs(paths: list[str], blobs: list[bytes], refs: list[np.ndarray], data: str) -> None:
    items = paths if data == "path" else blobs
    targets = [(7 * i) % 5 for i in range(N)]
    loader = ThreadLoader(list(zip(items, targets, strict=True)), batch_size=4, num_threads=3)
    got = []
    for b, (images, batch_targets) in enumerate(loader):
        indices = list(range(4 * b, 4 * b + 4))
        assert batch_targets.dtype == torch.int64
        assert batch_targets.tolist() == [targets[i] for i in indices]
        assert_pixels(images, refs, indices)
        got.extend(batch_targets.tolist())
    assert got == targets


@pytest.mark.parametrize("data", ["path", "bytes"])
def test_notebook_style_dataset(
    paths: list[str], blobs: list[bytes], refs: list[np.ndarray], data: str
) -> None:
    # Defined inside the test, like a notebook cell: nothing about it can be pickled by reference.
    class CellDataset(Dataset):
        def __init__(self, items: list) -> None:
            self.items = items
            self.labels = {i: 100 + i for i in range(len(items))}

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, index: int) -> tuple:
            return self.items[index], self.labels[index]

    items = paths if data == "path" else blobs
    loader = ThreadLoader(CellDataset(items), batch_size=6, num_threads=4, size=(H, W))
    assert len(loader) == 4
    for b, (images, targets) in enumerate(loader):
        indices = list(range(6 * b, 6 * b + 6))
        assert targets.tolist() == [100 + i for i in indices]
        assert_pixels(images, refs, indices)


def test_directory_in_imagefolder_order(image_folder: Path) -> None:
    loader = ThreadLoader(image_folder, batch_size=5, num_threads=3)
    assert isinstance(loader.source, ImageFolder)
    assert loader.source.classes == ["cat", "dog", "eel"]
    assert loader.source.class_to_idx == {"cat": 0, "dog": 1, "eel": 2}
    expected = [
        (image_folder / name / f"{i:03d}.jpg", c)
        for c, (name, count) in enumerate((("cat", 5), ("dog", 4), ("eel", 3)))
        for i in range(count)
    ]
    assert [(Path(p), t) for p, t in loader.source.samples] == expected  # notes.txt left out
    assert len(loader) == 3
    position = 0
    for images, targets in loader:
        assert targets.dtype == torch.int64
        for image, target in zip(images, targets.tolist(), strict=True):
            path, expected_target = expected[position]
            assert target == expected_target
            np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), pil_reference(path.read_bytes()))
            position += 1
    assert position == 12


def test_directory_as_str_and_nested_and_upper_case_extensions(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "b" / "sub").mkdir(parents=True)
    (root / "a").mkdir()
    data = {
        root / "b" / "z.JPG": encode(photo(8, 8, 1)),
        root / "b" / "sub" / "a.png": encode(photo(8, 8, 2), "PNG"),
        root / "a" / "y.jpeg": encode(photo(8, 8, 3)),
        root / "a" / "x.bmp": encode(photo(8, 8, 4), "BMP"),
    }
    for path, blob in data.items():
        path.write_bytes(blob)
    (root / "a" / "readme.txt").write_text("no")
    loader = ThreadLoader(str(root), batch_size=10)
    # torchvision's order: a folder's own files before its sub-folders'
    order = [root / "a" / "x.bmp", root / "a" / "y.jpeg", root / "b" / "z.JPG", root / "b" / "sub" / "a.png"]
    assert [Path(p) for p, _ in loader.source.samples] == order
    ((images, targets),) = list(loader)
    assert targets.tolist() == [0, 0, 1, 1]
    for image, path in zip(images, order, strict=True):
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), pil_reference(data[path]))


def test_empty_list_yields_nothing() -> None:
    loader = ThreadLoader([], batch_size=4, num_threads=2)
    assert len(loader) == 0
    assert list(loader) == []


def test_single_file_path_is_rejected(paths: list[str]) -> None:
    for source in (paths[0], Path(paths[0])):
        with pytest.raises(TypeError, match=r"must be a directory.*ThreadLoader\(\[path\]\)"):
            ThreadLoader(source)


def test_directory_without_classes_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "flat.jpg").write_bytes(encode(photo(8, 8)))
    with pytest.raises(FileNotFoundError, match="no class sub-folders"):
        ThreadLoader(tmp_path)


def test_bare_bytes_is_rejected(blobs: list[bytes]) -> None:
    with pytest.raises(TypeError, match=r"one bytes object.*ThreadLoader\(\[data\]\)"):
        ThreadLoader(blobs[0])


def test_iterable_only_sources_are_rejected(blobs: list[bytes]) -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(blobs)

    with pytest.raises(TypeError, match=r"map-style.*iterable-style dataset"):
        ThreadLoader(Stream())
    with pytest.raises(TypeError, match=r"map-style.*iterable-style dataset"):
        ThreadLoader(b for b in blobs)
    with pytest.raises(TypeError, match="map-style"):
        ThreadLoader(42)


def test_iterable_dataset_with_len_is_rejected(blobs: list[bytes]) -> None:
    class SizedStream(IterableDataset):
        def __iter__(self):
            return iter(blobs)

        def __len__(self) -> int:
            return len(blobs)

    with pytest.raises(TypeError, match="map-style"):
        ThreadLoader(SizedStream(), batch_size=4)


@pytest.mark.parametrize("with_target", [False, True])
def test_dataset_returning_pil_image_names_the_fix(blobs: list[bytes], with_target: bool) -> None:
    class DecodedDataset(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int):
            image = Image.fromarray(photo(8, 8, index))
            return (image, index) if with_target else image

    loader = ThreadLoader(DecodedDataset(), batch_size=2, num_threads=2)
    with pytest.raises(SampleError, match="return the file path or its bytes, not a decoded image") as info:
        next(iter(loader))
    assert info.value.stage == "fetch"
    assert info.value.index == 0
    assert info.value.origin == "DecodedDataset[0]"
    assert "path" in str(info.value) and "bytes" in str(info.value)
    assert ("tuple(Image, int)" if with_target else "PIL.Image") in str(info.value)
    loader.close()


@pytest.mark.parametrize("pair", [None, tuple, list])
def test_dataset_returning_read_file_tensors_is_told_to_return_bytes(
    blobs: list[bytes], pair: type | None
) -> None:
    """torchvision.io.read_file gives a file's bytes as a 1-D uint8 tensor: the advice to return bytes
    rather than "a decoded image" was wrong for it, and still was for a ``[data, target]`` list, a pair
    as much as a tuple is."""

    class ReadFileDataset(Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int):
            data = torch.frombuffer(bytearray(blobs[index]), dtype=torch.uint8)
            return data if pair is None else pair([data, index])

    advice = r"\(torchvision.io.read_file's\) goes as bytes: .*tobytes\(\)"
    with (
        ThreadLoader(ReadFileDataset(), batch_size=2, num_threads=1) as loader,
        pytest.raises(SampleError, match=advice) as info,
    ):
        next(iter(loader))
    if pair is not None:
        assert f"got {pair.__name__}(Tensor, int);" in info.value.reason


def test_dataset_returning_fromfile_arrays_is_told_to_return_bytes(blobs: list[bytes]) -> None:
    """``numpy.fromfile(path, dtype=numpy.uint8)`` gives a file's bytes as a 1-D uint8 array: it got the
    advice for "a decoded image", as read_file's tensor did."""

    class FromFileDataset(Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int):
            return np.frombuffer(blobs[index], dtype=np.uint8), index

    with (
        ThreadLoader(FromFileDataset(), batch_size=2, num_threads=1) as loader,
        pytest.raises(SampleError, match=r"\(numpy.fromfile's\) goes as bytes: .*array.tobytes\(\)"),
    ):
        next(iter(loader))


def test_a_decoded_image_returned_as_nested_lists_is_named_in_a_line() -> None:
    """A dataset that returns ``image.tolist()``: the error names the first element types, not 64."""

    class Listed(Dataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, index: int):
            return np.zeros((64, 48, 3), np.uint8).tolist()

    with (
        ThreadLoader(Listed(), batch_size=1, num_threads=1) as loader,
        pytest.raises(SampleError, match=re.escape("got list(list, list, list, list, ...);")) as info,
    ):
        next(iter(loader))
    assert len(info.value.reason) < 400, info.value.reason


# ---------------------------------------------------------------------------------------------- order


@pytest.mark.parametrize("num_threads", [1, 3, 8])
def test_order_is_the_samplers_under_random_delays(
    blobs: list[bytes], refs: list[np.ndarray], num_threads: int
) -> None:
    finished: list[int] = []

    class Jittery(Dataset):
        def __init__(self) -> None:
            # Early samples are slowest, so later batches tend to finish first.
            rng = np.random.default_rng(num_threads)
            self.delays = rng.uniform(0, 0.004, N) + np.linspace(0.004, 0, N)

        def __len__(self) -> int:
            return N

        def __getitem__(self, index: int) -> tuple[bytes, int]:
            time.sleep(float(self.delays[index]))
            finished.append(index)
            return blobs[index], index

    sampler = list(np.random.default_rng(5).permutation(N))  # numpy ints, in a fixed odd order
    loader = ThreadLoader(Jittery(), batch_size=3, sampler=sampler, num_threads=num_threads, prefetch=2)
    got = []
    for images, targets in loader:
        expected = [int(i) for i in sampler[len(flat(got)) : len(flat(got)) + 3]]
        assert targets.tolist() == expected
        assert_pixels(images, refs, expected)
        got.append(targets.tolist())
    assert flat(got) == [int(i) for i in sampler]
    assert sorted(finished) == list(range(N))


@settings(max_examples=25, deadline=None, database=None)
@given(
    n=st.integers(0, 13),
    batch_size=st.integers(1, 5),
    drop_last=st.booleans(),
    num_threads=st.integers(1, 4),
    prefetch=st.integers(1, 3),
)
def test_batches_match_dataloader(
    blobs: list[bytes], n: int, batch_size: int, drop_last: bool, num_threads: int, prefetch: int
) -> None:
    reference = DataLoader(range(n), batch_size=batch_size, drop_last=drop_last)
    loader = ThreadLoader(
        [(blobs[i], i) for i in range(n)],
        batch_size=batch_size,
        drop_last=drop_last,
        num_threads=num_threads,
        prefetch=prefetch,
    )
    assert len(loader) == len(reference)
    assert epoch(loader) == [b.tolist() for b in reference]


# -------------------------------------------------------------------------------------------- shuffle


@pytest.fixture(scope="module")
def indexed(blobs: list[bytes]) -> list[tuple[bytes, int]]:
    return [(b, i) for i, b in enumerate(blobs[:20])]


def test_shuffle_seed_is_reproducible_across_loaders_and_threads(
    indexed: list[tuple[bytes, int]], refs: list[np.ndarray]
) -> None:
    orders = []
    for num_threads in (1, 2, 5):
        loader = ThreadLoader(indexed, batch_size=4, shuffle=True, seed=1234, num_threads=num_threads)
        orders.append(checked_epoch(loader, refs))
    assert orders[0] == orders[1] == orders[2]
    assert sorted(flat(orders[0])) == list(range(20))  # every index exactly once
    assert flat(orders[0]) != list(range(20))
    other = ThreadLoader(indexed, batch_size=4, shuffle=True, seed=1235, num_threads=2)
    assert epoch(other) != orders[0]


def test_shuffle_differs_per_epoch_and_set_epoch_reproduces(indexed: list[tuple[bytes, int]]) -> None:
    loader = ThreadLoader(indexed, batch_size=4, shuffle=True, seed=7, num_threads=3)
    epochs = [epoch(loader) for _ in range(4)]  # iter() counts epochs 0, 1, 2, 3 on its own
    for e in epochs:
        assert sorted(flat(e)) == list(range(20))
    assert len({tuple(flat(e)) for e in epochs}) == 4

    replay = ThreadLoader(indexed, batch_size=4, shuffle=True, seed=7, num_threads=1)
    replay.set_epoch(2)
    assert epoch(replay) == epochs[2]
    assert epoch(replay) == epochs[3]  # counts on from the epoch that was set
    replay.set_epoch(0)
    assert epoch(replay) == epochs[0]
    loader.set_epoch(1)
    assert epoch(loader) == epochs[1]


def test_shuffle_without_seed_follows_torch_manual_seed(indexed: list[tuple[bytes, int]]) -> None:
    def order(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        loader = ThreadLoader(indexed, batch_size=4, shuffle=True, num_threads=2)
        return [epoch(loader), epoch(loader)]

    first = order(99)
    assert order(99) == first
    assert first[0] != first[1]
    assert order(100)[0] != first[0]
    assert sorted(flat(first[0])) == list(range(20))


def test_no_shuffle_is_identity_every_epoch(indexed: list[tuple[bytes, int]]) -> None:
    loader = ThreadLoader(indexed, batch_size=6, num_threads=2)
    for _ in range(3):
        assert epoch(loader) == chunks(list(range(20)), 6)


# ------------------------------------------------------------------------------------------- samplers


@pytest.mark.parametrize(
    ("drop_last", "expected"), [(False, [[5, 3], [3, 0], [19]]), (True, [[5, 3], [3, 0]])]
)
def test_list_sampler(
    indexed: list[tuple[bytes, int]], refs: list[np.ndarray], drop_last: bool, expected
) -> None:
    loader = ThreadLoader(indexed, batch_size=2, sampler=[5, 3, 3, 0, 19], drop_last=drop_last, num_threads=3)
    assert len(loader) == len(expected)
    assert checked_epoch(loader, refs) == expected


def test_subset_random_sampler_with_generator(indexed: list[tuple[bytes, int]]) -> None:
    subset = [1, 4, 6, 9, 11, 12, 17]
    sampler = SubsetRandomSampler(subset, generator=torch.Generator().manual_seed(3))
    twin = SubsetRandomSampler(subset, generator=torch.Generator().manual_seed(3))
    loader = ThreadLoader(indexed, batch_size=3, sampler=sampler, num_threads=2)
    assert len(loader) == 3
    for _ in range(2):  # the generator advances per epoch, as with DataLoader
        expected = [int(i) for i in twin]
        assert sorted(expected) == subset
        assert epoch(loader) == chunks(expected, 3)


def test_set_epoch_is_forwarded_to_a_distributed_sampler(indexed: list[tuple[bytes, int]]) -> None:
    sampler = DistributedSampler(range(20), num_replicas=2, rank=1, shuffle=True, seed=5)
    twin = DistributedSampler(range(20), num_replicas=2, rank=1, shuffle=True, seed=5)
    loader = ThreadLoader(indexed, batch_size=3, sampler=sampler, num_threads=2)
    orders = []
    for number in (3, 0, 7):
        loader.set_epoch(number)
        twin.set_epoch(number)
        orders.append(epoch(loader))
        assert orders[-1] == chunks([int(i) for i in twin], 3), f"epoch {number}"
    assert len({tuple(flat(order)) for order in orders}) == 3  # the epoch changes the order
    twin.set_epoch(8)  # without set_epoch, the loader counts on from the last epoch
    assert epoch(loader) == chunks([int(i) for i in twin], 3)


def test_set_epoch_is_forwarded_to_a_batch_sampler(indexed: list[tuple[bytes, int]]) -> None:
    class EpochBatches:
        """Batches that depend on the epoch, as a user's distributed batch sampler's do."""

        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __len__(self) -> int:
            return 2

        def __iter__(self):
            yield [self.epoch % 20, (self.epoch + 1) % 20]
            yield [(self.epoch + 2) % 20]

    loader = ThreadLoader(indexed, batch_sampler=EpochBatches(), num_threads=2)
    loader.set_epoch(5)
    assert epoch(loader) == [[5, 6], [7]]
    assert epoch(loader) == [[6, 7], [8]]


@pytest.mark.parametrize("kind", ["list", "torch"])
def test_batch_sampler(indexed: list[tuple[bytes, int]], refs: list[np.ndarray], kind: str) -> None:
    if kind == "list":
        batch_sampler = [[3, 1], [0], [5, 4, 2], [19, 19]]
    else:
        batch_sampler = BatchSampler(SequentialSampler(range(10)), batch_size=4, drop_last=False)
    expected = [list(b) for b in batch_sampler]
    loader = ThreadLoader(indexed, batch_sampler=batch_sampler, num_threads=3)
    assert len(loader) == len(expected)
    assert checked_epoch(loader, refs) == expected


@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 4},
        {"batch_size": 32},  # the default's value, given: refused too, as DataLoader does
        {"shuffle": True},
        {"sampler": [0, 1]},
        {"drop_last": True},
    ],
)
def test_batch_sampler_is_mutually_exclusive(indexed: list[tuple[bytes, int]], options: dict) -> None:
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive"):
        ThreadLoader(indexed, batch_sampler=[[0, 1]], **options)
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive"):
        DataLoader(range(4), batch_sampler=[[0, 1]], **options)  # the same rule as DataLoader


def test_batch_size_left_unset_or_none_goes_with_a_batch_sampler(indexed: list[tuple[bytes, int]]) -> None:
    for options in ({}, {"batch_size": None}):
        with ThreadLoader(indexed, batch_sampler=[[3, 1], [0, 2, 4]], device="cpu", **options) as loader:
            assert [targets.tolist() for _, targets in loader] == [[3, 1], [0, 2, 4]]
    with ThreadLoader(indexed, device="cpu") as loader:  # and unset without one, it is 32
        assert [len(targets) for _, targets in loader] == [20]
        assert len(ThreadLoader(list(range(70)), device="cpu")) == 3


def test_a_decoder_passed_in_decodes_and_sets_the_device(
    indexed: list[tuple[bytes, int]], refs: list[np.ndarray]
) -> None:
    calls = []

    class Counting(PillowDecoder):
        def decode(self, encoded, *, stream, stats=None, region_of=None, pad=False):  # type: ignore[no-untyped-def]
            calls.append(len(encoded))
            return super().decode(encoded, stream=stream, stats=stats)

    with ThreadLoader(indexed[:6], batch_size=3, decoder=Counting(), num_threads=1) as loader:
        assert loader.device == torch.device("cpu")
        for images, targets in loader:
            for image, target in zip(images, targets.tolist(), strict=True):
                np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), refs[target])
    assert calls == [3, 3]


class _OnAGpu(PillowDecoder):
    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"backend": "hybrid"}, "backend configure the built-in decoder"),
        ({"decode_threads": 2, "max_pixels": None}, "decode_threads, max_pixels configure the built-in"),
        ({"region_decode": False}, "region_decode configure the built-in decoder"),
        ({"device": "cpu", "decoder": _OnAGpu()}, r"device='cpu' but decoder=.* decodes on cuda:0"),
    ],
)
def test_a_decoder_passed_in_refuses_the_options_it_would_ignore(
    indexed: list[tuple[bytes, int]], options: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ThreadLoader(indexed, **{"decoder": PillowDecoder(), **options})


def test_sampler_and_shuffle_are_mutually_exclusive(indexed: list[tuple[bytes, int]]) -> None:
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        ThreadLoader(indexed, sampler=[0, 1], shuffle=True)
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        DataLoader(range(4), sampler=[0, 1], shuffle=True)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (name, value)
        for name in ("shuffle", "drop_last", "pin_memory")
        for value in ("no", None, 2, [True])
        if (name, value) != ("shuffle", None)  # DataLoader's default: the test below
    ],
)
def test_a_switch_takes_true_or_false_only(
    indexed: list[tuple[bytes, int]], name: str, value: object
) -> None:
    """Any object is truthy: shuffle="no" shuffled and drop_last="no" dropped the last batch."""
    also = " or None" if name == "shuffle" else ""
    with pytest.raises(
        TypeError, match=rf"{name} must be True(,| or) False{also}, got {re.escape(repr(value))}"
    ):
        ThreadLoader(indexed, device="cpu", **{name: value})


def test_shuffle_none_is_dataloaders_default_no_shuffle(indexed: list[tuple[bytes, int]]) -> None:
    """DataLoader's ``shuffle`` defaults to None: code that passes its own default along was refused."""
    sampler = [5, 1, 3, 0]
    with ThreadLoader(indexed, device="cpu", batch_size=2, shuffle=None) as loader:
        assert [t.tolist() for _, t in loader] == [t.tolist() for t in DataLoader([t for _, t in indexed], 2)]
    with ThreadLoader(indexed, device="cpu", batch_size=2, shuffle=None, sampler=sampler) as loader:
        expected = DataLoader([t for _, t in indexed], 2, shuffle=None, sampler=sampler)
        assert [t.tolist() for _, t in loader] == [t.tolist() for t in expected]


@pytest.mark.parametrize("value", [True, False, 1, 0, np.True_, np.False_])
def test_a_switch_takes_bools_ints_and_numpys_bools(indexed: list[tuple[bytes, int]], value: object) -> None:
    with ThreadLoader(indexed, device="cpu", batch_size=3, shuffle=value, drop_last=value) as loader:
        assert len(loader) == (len(indexed) // 3 if value else -(-len(indexed) // 3))
        # Kept as plain bools: a state dict with numpy's True in it could not be saved as JSON.
        arguments = json.loads(json.dumps(loader.state_dict()))["arguments"]
        assert (arguments["shuffle"], arguments["drop_last"]) == (bool(value), bool(value))


@pytest.mark.parametrize("name", ["sampler", "batch_sampler"])
def test_a_sampler_that_is_not_iterable_is_refused_at_construction(
    indexed: list[tuple[bytes, int]], name: str
) -> None:
    """sampler=5 was taken, and failed at iter() with "'int' object is not iterable"."""
    options = {name: 5} if name == "sampler" else {name: 5, "batch_size": None}
    with pytest.raises(TypeError, match=rf"{name} must be an iterable of .*, got 5 \(int\)"):
        ThreadLoader(indexed, device="cpu", **options)


@pytest.mark.parametrize(
    ("batch_size", "drop_last", "sizes"),
    [
        (3, False, [3, 3, 3, 1]),
        (3, True, [3, 3, 3]),
        (4, False, [4, 4, 2]),
        (4, True, [4, 4]),
        (5, False, [5, 5]),
        (5, True, [5, 5]),
        (12, False, [10]),
        (12, True, []),
    ],
)
def test_drop_last_and_partial_last_batch(
    blobs: list[bytes], refs: list[np.ndarray], batch_size: int, drop_last: bool, sizes: list[int]
) -> None:
    loader = ThreadLoader(
        [(b, i) for i, b in enumerate(blobs[:10])],
        batch_size=batch_size,
        drop_last=drop_last,
        size=(H, W),
        num_threads=2,
    )
    assert len(loader) == len(sizes)
    got = []
    for images, targets in loader:
        assert images.shape == (len(targets), 3, H, W)
        assert_pixels(images, refs, targets.tolist())
        got.append(targets.tolist())
    assert [len(b) for b in got] == sizes
    assert flat(got) == list(range(sum(sizes)))


# ----------------------------------------------------------------------------------- random transforms


def _crops_by_sample(
    source: list, epoch_number: int = 2, seed: int = 3, **options
) -> dict[int, torch.Tensor]:
    transform = [RandomResizedCrop(16), RandomHorizontalFlip()]
    with ThreadLoader(source, transform=transform, seed=seed, device="cpu", **options) as loader:
        loader.set_epoch(epoch_number)
        return {
            t: image for images, targets in loader for image, t in zip(images, targets.tolist(), strict=True)
        }


def test_random_parameters_belong_to_the_sample_not_its_place(blobs: list[bytes]) -> None:
    """Random parameters are a function of (seed, epoch, sample index) only (docs/design.md): one
    picture under twelve indices gets twelve crops, and each index the same crop whatever batch,
    position, group or thread it lands in."""
    source = [(blobs[0], i) for i in range(12)]  # one picture, twelve samples
    plain = _crops_by_sample(source, batch_size=4, num_threads=1)
    placements = [
        {"batch_size": 5, "sampler": [11, 3, 7, 0, 5, 9, 1, 10, 2, 8, 4, 6], "num_threads": 3},
        {"batch_size": 3, "sampler": list(reversed(range(12))), "decode_batch_size": 12, "num_threads": 2},
        {"batch_size": 12, "num_threads": 1},
    ]
    for options in placements:
        placed = _crops_by_sample(source, **options)
        for index in range(12):
            # The same region and flip; resampled among other images, a value may round otherwise.
            assert (placed[index].int() - plain[index].int()).abs().max() <= 1, (options, index)
    distinct = {plain[i].numpy().tobytes() for i in range(12)}
    assert len(distinct) >= 10  # every sample of a batch draws its own parameters
    for other in (
        _crops_by_sample(source, epoch_number=3, batch_size=4),
        _crops_by_sample(source, seed=4, batch_size=4),
    ):
        changed = sum((other[i].int() - plain[i].int()).abs().max() > 1 for i in range(12))
        assert changed >= 10  # and they depend on the epoch and the seed


# ------------------------------------------------------------------------------------------ collation


class Box:
    def __init__(self, value: int) -> None:
        self.value = value


def _check_ints(targets, idx):
    assert isinstance(targets, torch.Tensor) and targets.dtype == torch.int64
    assert targets.tolist() == [i * 3 for i in idx]


def _check_floats(targets, idx):
    assert isinstance(targets, torch.Tensor) and targets.dtype == torch.float64
    assert targets.tolist() == [i / 4 for i in idx]


def _check_tensors(targets, idx):
    assert targets.shape == (len(idx), 2) and targets.dtype == torch.float32
    assert targets.tolist() == [[float(i), -float(i)] for i in idx]


def _check_strings(targets, idx):
    assert targets == [f"s{i}" for i in idx]


def _check_dicts(targets, idx):
    assert set(targets) == {"label", "name"}
    assert targets["label"].dtype == torch.int64
    assert targets["label"].tolist() == list(idx)
    assert targets["name"] == [f"n{i}" for i in idx]


def _check_none(targets, idx):
    assert targets is None


def _check_objects(targets, idx):
    assert isinstance(targets, list)
    assert [box.value for box in targets] == list(idx)


COLLATION = {
    "ints": (lambda i: i * 3, _check_ints),
    "floats": (lambda i: i / 4, _check_floats),
    "tensors": (lambda i: torch.tensor([float(i), -float(i)]), _check_tensors),
    "strings": (lambda i: f"s{i}", _check_strings),
    "dicts": (lambda i: {"label": i, "name": f"n{i}"}, _check_dicts),
    "none": (lambda i: None, _check_none),
    "objects": (Box, _check_objects),
}


@pytest.mark.parametrize("kind", list(COLLATION))
def test_targets_collation(blobs: list[bytes], refs: list[np.ndarray], kind: str) -> None:
    make, check = COLLATION[kind]
    source = [(blobs[i], make(i)) for i in range(7)]
    batches = list(ThreadLoader(source, batch_size=3, num_threads=2, size=(H, W)))
    assert len(batches) == 3
    for b, (images, targets) in enumerate(batches):
        idx = list(range(3 * b, min(3 * b + 3, 7)))
        assert_pixels(images, refs, idx)
        check(targets, idx)


def test_objects_are_passed_through_not_copied(blobs: list[bytes]) -> None:
    boxes = [Box(i) for i in range(4)]
    ((_, targets),) = list(ThreadLoader([(blobs[i], boxes[i]) for i in range(4)], batch_size=4))
    assert all(a is b for a, b in zip(targets, boxes, strict=True))


MIXED_TARGETS = {
    "dicts without the first one's keys": [{"label": 0, "difficult": True}, {"label": 1}],
    "an int too large for a tensor": [2**70, 1],
    "an int and a string": [0, "s"],
    "an int and None": [0, None],
    "tensors of different shapes": [torch.zeros(2), torch.zeros(3)],
    "dicts of tensors": [{"a": torch.ones(2), "b": 0}, {"a": torch.zeros(2), "b": 1}],
    "strings": ["a", "b"],
    "pairs": [(0, "a"), (1, "b")],
}


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, torch.Tensor):
        return (
            isinstance(actual, torch.Tensor)
            and actual.dtype == expected.dtype
            and torch.equal(actual, expected)
        )
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and actual.keys() == expected.keys()
            and all(_same(actual[k], expected[k]) for k in expected)
        )
    if isinstance(expected, (list, tuple)):
        return (
            type(actual) is type(expected)
            and len(actual) == len(expected)
            and all(map(_same, actual, expected))
        )
    return actual is expected or actual == expected


@pytest.mark.parametrize("kind", list(MIXED_TARGETS))
def test_targets_are_default_collates_or_the_list_where_it_cannot(blobs: list[bytes], kind: str) -> None:
    """Dicts without the first one's keys (KeyError) and huge ints (ValueError) failed the whole group
    with default_collate's bare exception instead of staying a list, as the docs promise."""
    targets = MIXED_TARGETS[kind]
    try:
        expected = default_collate(targets)
    except Exception:  # what default_collate cannot take: the targets as they are
        expected = list(targets)
    source = [(blobs[i], target) for i, target in enumerate(targets)]
    ((_, collated),) = list(ThreadLoader(source, batch_size=len(targets), device="cpu"))
    assert _same(collated, expected), (collated, expected)


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA and notes the streams it is recorded for."""

    is_cuda = True  # type: ignore[assignment]

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        self.__dict__.setdefault("recorded", []).append(stream)


def test_cuda_tensors_in_targets_are_handed_over_as_the_images_are(
    blobs: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collate_fn's CUDA targets (made on the reader's stream) were never record_stream'ed for the
    consumer's stream: freed there, their memory went back to the reader while the consumer still read it."""
    from threadloader._handoff import ReaderStream
    from threadloader._output import OutputFormat
    from threadloader._pipeline import BatchProducer
    from threadloader._stats import StatsRecorder

    class Event:
        def record(self, stream: object) -> None:
            self.stream = stream

    class Reader(ReaderStream):  # a stream without a GPU: seal records its event, nothing is made current
        @contextlib.contextmanager
        def active(self) -> Iterator[None]:
            yield None

    class Consumer:
        def __init__(self) -> None:
            self.waited: list[object] = []

        def wait_event(self, event: object) -> None:
            self.waited.append(event)

    def to_cuda(targets: list[int]) -> dict[str, Any]:
        return {
            "label": torch.tensor(targets).as_subclass(_FakeCuda),
            "boxes": [(torch.zeros(2).as_subclass(_FakeCuda), f"t{t}") for t in targets],
            "name": "batch",
        }

    monkeypatch.setattr(torch.cuda, "Event", Event)
    reader = Reader(torch.device("cpu"))
    reader.stream = "reader stream"  # type: ignore[assignment]
    producer = BatchProducer(
        source=[(blobs[i], i) for i in range(3)],
        decoder=PillowDecoder(),
        output=OutputFormat(size=(H, W)),
        on_error="raise",
        stats=StatsRecorder(),
        collate=to_cuda,
    )
    (batch,) = producer.produce([[0, 1, 2]], reader)
    consumer = Consumer()
    assert isinstance(batch, Batch)
    batch.ready.receive(stream=consumer)  # type: ignore[arg-type]
    assert consumer.waited == [batch.ready.event] and batch.ready.event.stream == "reader stream"
    tensors = [batch.targets["label"], *(box for box, _ in batch.targets["boxes"])]
    assert [tensor.__dict__.get("recorded") for tensor in tensors] == [[consumer]] * 4


def _detections(blobs: list[bytes], count: int) -> list[tuple[bytes, dict]]:
    """Detection-style targets: sample ``i`` has ``i % 3`` boxes, so a batch's boxes cannot be stacked."""
    return [
        (blobs[i], {"boxes": torch.arange(4.0 * (i % 3)).reshape(i % 3, 4) + i, "label": i})
        for i in range(count)
    ]


def test_collate_fn_makes_each_batchs_targets_from_their_list(blobs: list[bytes]) -> None:
    source = _detections(blobs, 7)
    kept = list(ThreadLoader(source, batch_size=3, num_threads=2, size=(H, W), collate_fn=list))
    assert [
        [target is source[3 * b + k][1] for k, target in enumerate(ts)] for b, (_, ts) in enumerate(kept)
    ] == [
        [True] * 3,
        [True] * 3,
        [True],
    ]

    def boxes_and_labels(targets: list[dict]) -> dict:
        return {"boxes": [t["boxes"] for t in targets], "labels": torch.tensor([t["label"] for t in targets])}

    ((_, targets),) = list(ThreadLoader(source, batch_size=7, collate_fn=boxes_and_labels))
    assert targets["labels"].tolist() == list(range(7))
    assert all(torch.equal(b, source[i][1]["boxes"]) for i, b in enumerate(targets["boxes"]))
    # Without targets, the function still makes the batch's targets, from its Nones.
    ((_, none),) = list(ThreadLoader(blobs[:4], batch_size=4, collate_fn=len))
    assert none == 4


def test_collate_fn_errors_are_raised_in_the_loop_at_their_batch(blobs: list[bytes]) -> None:
    def refuse_sample_4(targets: list[int]) -> torch.Tensor:
        if 4 in targets:
            raise ValueError("no sample 4 here")
        return torch.tensor(targets)

    source = [(blobs[i], i) for i in range(8)]
    # A batch_sampler's loader decodes a batch at a time on the CPU too: it took the default batch
    # size's 32 images a call, so the error came at the group's first batch, before [0, 1] and [2, 3].
    for order in ({"batch_size": 2}, {"batch_sampler": [[0, 1], [2, 3], [4, 5], [6, 7]]}):
        loader = ThreadLoader(source, num_threads=2, collate_fn=refuse_sample_4, device="cpu", **order)
        received = []
        with pytest.raises(ValueError, match="no sample 4 here"):
            for _, targets in loader:
                received.append(targets.tolist())
        assert received == [[0, 1], [2, 3]]
        loader.close()


def test_collate_fn_must_be_callable(blobs: list[bytes]) -> None:
    with pytest.raises(
        TypeError, match="collate_fn must be a function of the list of a batch's targets, got str"
    ):
        ThreadLoader(blobs, collate_fn="list")  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens on a machine without CUDA")
def test_pin_memory_without_cuda_warns_and_keeps_ordinary_memory(
    blobs: list[bytes], refs: list[np.ndarray]
) -> None:
    with pytest.warns(UserWarning, match="pin_memory=True, but CUDA is not available here") as warned:
        loader = ThreadLoader(
            [(b, i) for i, b in enumerate(blobs[:4])], batch_size=4, size=(H, W), pin_memory=True
        )
    assert warned[0].filename == __file__ and loader.pin_memory is False
    ((images, targets),) = list(loader)
    assert_pixels(images, refs, [0, 1, 2, 3])
    assert not images.is_pinned() and targets.tolist() == [0, 1, 2, 3]


Pair = collections.namedtuple("Pair", ["label", "weight"])


@pytest.mark.parametrize("pin_memory", [True, False])
def test_pin_memory_pins_every_cpu_tensor_of_a_batch(
    blobs: list[bytes], refs: list[np.ndarray], monkeypatch: pytest.MonkeyPatch, pin_memory: bool
) -> None:
    """With CUDA (faked here: ``pin_memory`` records what it copies), the images and each tensor target,
    inside dicts, lists and namedtuples too, are the pinned copies; nothing else is touched."""
    pinned: list[torch.Tensor] = []

    def fake_pin(tensor: torch.Tensor) -> torch.Tensor:
        pinned.append(tensor.clone())
        return pinned[-1]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    source = [(blobs[i], {"label": i, "pair": Pair(i, float(i)), "name": f"n{i}"}) for i in range(4)]
    loader = ThreadLoader(source, batch_size=4, size=(H, W), device="cpu", pin_memory=pin_memory)
    ((images, targets),) = list(loader)
    assert_pixels(images, refs, [0, 1, 2, 3])
    assert targets["label"].tolist() == [0, 1, 2, 3] and targets["name"] == ["n0", "n1", "n2", "n3"]
    assert isinstance(targets["pair"], Pair) and targets["pair"].weight.tolist() == [0.0, 1.0, 2.0, 3.0]
    tensors = [images, targets["label"], targets["pair"].label, targets["pair"].weight]
    assert [any(t is p for p in pinned) for t in tensors] == [pin_memory] * 4
    assert len(pinned) == (4 if pin_memory else 0)


@pytest.mark.parametrize("front", ["ThreadLoader", "BatchDecoder"])
def test_a_gpu_without_nvimagecodec_warns_loudly_and_decodes_on_the_cpu(
    blobs: list[bytes], monkeypatch: pytest.MonkeyPatch, front: str
) -> None:
    from threadloader import _device as device_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(device_module, "_nvimgcodec_installed", lambda: False)
    make = ThreadLoader if front == "ThreadLoader" else BatchDecoder
    with pytest.warns(
        CPUFallbackWarning, match=r"nvImageCodec is not installed, so images are decoded"
    ) as warned:
        made = make(blobs) if front == "ThreadLoader" else make()
    assert made.device == torch.device("cpu")
    (warning,) = warned
    assert warning.filename == __file__  # pointing at the user's line, not the library's
    assert "pip install 'nvidia-nvimgcodec-cu13[nvjpeg]'" in str(warning.message) and "device='cpu'" in str(
        warning.message
    )
    made.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(blobs, device="cpu").close() if front == "ThreadLoader" else make(device="cpu").close()


# -------------------------------------------------------------------------------------------- options


def test_default_options_on_cpu(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    loader = ThreadLoader(blobs)
    assert loader.device == torch.device("cpu")
    assert loader.num_threads >= 1
    assert loader.prefetch == 2
    assert len(loader) == 1  # batch_size 32 by default
    ((images, targets),) = list(loader)
    assert targets is None
    assert [tuple(image.shape) for image in images] == [(3, H, W)] * N
    assert all(image.device.type == "cpu" for image in images)
    assert_pixels(images, refs, list(range(N)))


class _RecordTorchThreads(Transform):
    """Notes torch's intra-op thread count in the thread that applies it (a reader thread)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def apply(self, images: torch.Tensor, params: object) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return images


@pytest.mark.parametrize("front", ["ThreadLoader", "BatchDecoder"])
def test_readers_run_torch_on_one_thread_and_leave_everyone_elses(blobs: list[bytes], front: str) -> None:
    """The readers are the parallelism (as DataLoader's workers, each runs torch's ops alone); the main
    thread, and threads started after them, keep torch's count: nothing process-wide changed."""
    if _workers._omp_set_num_threads() is None:
        pytest.skip("torch's OpenMP runtime cannot be reached here: readers keep torch's default")
    before = torch.get_num_threads()
    # Set explicitly (to what it is): a thread's first torch call then sets its count from it, and
    # would undo a count set before that call.
    torch.set_num_threads(before)
    record = _RecordTorchThreads()
    if front == "ThreadLoader":
        list(ThreadLoader(blobs, batch_size=4, num_threads=2, transform=record))
    else:
        with BatchDecoder(device="cpu", num_threads=2, transform=record) as decoder:
            decoder.decode(blobs[0])
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert record.seen and set(record.seen) == {1}
    assert torch.get_num_threads() == before and later == [before]


def test_size_none_keeps_each_original_size() -> None:
    shapes = [(8, 8), (17, 5), (1, 1), (40, 23), (32, 48)]
    data = [encode(photo(h, w, i), quality=95) for i, (h, w) in enumerate(shapes)]
    for dtype in (torch.uint8, torch.float32):
        ((images, _),) = list(ThreadLoader(data, batch_size=5, dtype=dtype, num_threads=2))
        assert isinstance(images, list)
        assert [tuple(image.shape) for image in images] == [(3, h, w) for h, w in shapes]
        for image, blob in zip(images, data, strict=True):
            assert image.dtype == dtype and image.is_contiguous()
            expected = torch.from_numpy(pil_reference(blob)).permute(2, 0, 1)
            assert torch.equal(
                (image * 255).round().to(torch.uint8) if dtype != torch.uint8 else image, expected
            )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mean": (0.5, 0.5, 0.5), "dtype": torch.float32}, "give mean and std together"),
        ({"std": (0.5, 0.5, 0.5), "dtype": torch.float32}, "give mean and std together"),
        (
            {"mean": (0.5,) * 3, "std": (0.5,) * 3},
            r"mean/std need a float dtype \(e\.g\. dtype=torch\.float32\)",
        ),
        ({"mean": (0.5,) * 2, "std": (0.5,) * 2, "dtype": torch.float32}, "one value per RGB channel"),
        ({"mean": (0.5,) * 3, "std": (0.5, 0.0, 0.5), "dtype": torch.float32}, "std must not contain zeros"),
        (  # nonzero as a Python float, zero in float32 (torch.tensor(1e-46) == 0): every pixel inf
            {"mean": (0.5,) * 3, "std": (0.5, 1e-46, 0.5), "dtype": torch.float32},
            r"std evaluated to zero after conversion to torch\.float32",
        ),
        # "object of type 'float' has no len()", "could not convert string to float: 'a'", all-NaN outputs.
        (
            {"mean": 0.5, "std": (0.5,) * 3, "dtype": torch.float32},
            "mean must be a sequence of finite numbers",
        ),
        ({"mean": "abc", "std": (0.5,) * 3, "dtype": torch.float32}, "mean must be a sequence of finite"),
        ({"mean": (0.5,) * 3, "std": (float("nan"),) * 3, "dtype": torch.float32}, "std must be a sequence"),
        ({"channels_last": True}, r"channels_last needs size=\(H, W\)"),
        ({"on_error": "ignore"}, "on_error must be 'raise' or 'skip', got 'ignore'"),
        ({"prefetch": 0}, "prefetch must be at least 1"),
        ({"num_threads": 0}, "num_threads must be at least 1"),
        ({"seed": -1}, r"seed must be an int from 0 to 2\*\*64 - 1 .*, or None, got -1"),
        ({"seed": 1.5}, "seed must be an int from 0"),
        ({"seed": 2**64}, f"seed must be an int from 0 .*got {2**64}"),  # its draws were seed=0's
        ({"seed": True}, "seed must be an int from 0 .*got True"),
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
        ({"batch_size": None}, "batch_size must be a positive integer"),
        ({"size": (0, 10)}, "size must be \\(height, width\\), two ints of at least 1, got \\(0, 10\\)"),
        ({"size": (10,)}, "size must be \\(height, width\\)"),
        ({"size": 224}, r"got 224; for a square output pass \(224, 224\), .* transform=Resize\(224\)"),
        ({"size": (224.7, 100.2)}, r"two ints of at least 1, got \(224\.7, 100\.2\)"),  # was truncated
        ({"size": (True, True)}, r"two ints of at least 1, got \(True, True\)"),
        ({"max_pixels": "1e6"}, "max_pixels must be an int of at least 1 \\(pixels\\), or None .*got '1e6'"),
        ({"max_pixels": 0}, "max_pixels must be an int of at least 1"),
        ({"max_pixels": True}, "max_pixels must be an int of at least 1"),
        ({"num_threads": 2.0}, r"num_threads must be an int or None, got 2\.0 \(float\)"),
        ({"dtype": torch.int32}, r"dtype must be torch\.uint8, torch\.float32, .*got torch\.int32"),
        ({"backend": "hardware", "device": "cpu"}, "backend='hardware' selects an nvImageCodec backend"),
        ({"backend": "cuda", "device": "cpu"}, "with device='cpu' Pillow decodes"),
        ({"backend": "bogus", "device": "cpu"}, "backend must be one of"),
        ({"device": "meta"}, "device must be 'cpu' or a CUDA device"),
        # Each was torch's or Python's own error, naming nothing (or accepted: prefetch=1.5, True).
        ({"prefetch": "2"}, r"prefetch must be an int, got '2' \(str\)"),
        ({"prefetch": 1.5}, r"prefetch must be an int, got 1\.5"),
        ({"prefetch": True}, r"prefetch must be an int, got True"),
        ({"batch_size": "4"}, r"batch_size must be an int, got '4'"),
        ({"batch_size": 2.5}, r"batch_size must be an int, got 2\.5"),
        ({"device": "bogus"}, r"device must be 'cpu', 'cuda', 'cuda:N' or None, got 'bogus'"),
        ({"device": 1.5}, r"device must be 'cpu', 'cuda', 'cuda:N' or None, got 1\.5"),
        # A sampler with world_size asked for rank=, then refused it.
        ({"sampler": [0, 1], "world_size": 2}, r"a sampler or batch_sampler is taken as it is"),
    ],
)
def test_invalid_options_raise_value_error(blobs: list[bytes], options: dict, message: str) -> None:
    if torch.cuda.is_available() and "backend" in options and "device" not in options:
        options = {**options, "device": "cpu"}
    with pytest.raises(ValueError, match=message):
        ThreadLoader(blobs, **options)


def test_numpy_integers_are_counts(blobs: list[bytes]) -> None:
    counts = {
        "prefetch": np.int64(2),
        "seed": np.int64(3),
        "rank": np.int64(0),
        "world_size": np.int64(1),
        "num_threads": np.int64(2),
        "decode_batch_size": np.int64(4),
        "max_pixels": np.int64(10**6),
        "gpu_decoders": np.int64(2),
        "decode_threads": np.int64(3),
    }
    loader = ThreadLoader(blobs, batch_size=2, size=(8, 8), device="cpu", **counts)
    assert sum(len(images) for images, _ in loader) == len(blobs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_device_without_gpu_is_explained(blobs: list[bytes]) -> None:
    with pytest.raises(RuntimeError, match="no CUDA GPU is usable here; pass device='cpu'"):
        ThreadLoader(blobs, device="cuda")


@pytest.mark.parametrize(
    ("codec_cuda", "torch_cuda", "warned"),
    [(12080, "13.0", True), (13000, "12.8", True), (12080, "12.4", False), (13000, "13.0", False)],
)
@pytest.mark.parametrize("device", [None, "cuda"])
def test_cuda_major_mismatch_between_codec_and_torch_is_named(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    codec_cuda: int,
    torch_cuda: str,
    warned: bool,
    device: str | None,
) -> None:
    """A cu12 codec beside a CUDA 13 torch (pip's default) is said at start-up, with the fix."""
    import sys
    import types

    from threadloader import _device as device_module
    from threadloader.decode.nvimgcodec import _capi, _startup

    nvidia = types.ModuleType("nvidia")
    codec = types.ModuleType("nvidia.nvimgcodec")
    codec.__cuda_version__ = codec_cuda  # type: ignore[attr-defined]  # as nvImageCodec: CUDART_VERSION
    nvidia.nvimgcodec = codec  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", codec)

    def no_capi() -> None:
        raise _capi.Unsupported("not here")

    monkeypatch.setattr(_capi, "library", no_capi)  # the version from the Python API
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    _startup.check_cuda_versions.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="threadloader"):
            assert device_module.resolve_device(device) == torch.device("cuda", 0)
            device_module.resolve_device(device)  # said once, not per loader
    finally:
        _startup.check_cuda_versions.cache_clear()
    messages = [r.getMessage() for r in caplog.records if r.name == "threadloader"]
    if not warned:
        assert messages == []
        return
    (message,) = messages
    ours, theirs = int(torch_cuda.split(".")[0]), codec_cuda // 1000
    assert f"nvImageCodec is built for CUDA {theirs} but torch for CUDA {ours}" in message
    assert f"nvidia-nvimgcodec-cu{ours}[nvjpeg]" in message and f"nvidia-nvimgcodec-cu{theirs}" in message


# --------------------------------------------------------------------------------------------- errors


def _random_bytes(n: int = 600) -> bytes:
    return np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes()


BAD = 5  # the bad sample: batch 2 with batch_size 2


def _bad_source(kind: str, tmp_path: Path, blobs: list[bytes]):
    """A source of 10 samples (targets = indices) whose sample BAD fails in the way ``kind`` says.

    Returns the source, the expected origin, stage, and a fragment of the reason.
    """
    items: list = [(blobs[i], i) for i in range(10)]
    if kind == "missing":
        for i in range(10):
            path = tmp_path / f"{i}.jpg"
            if i != BAD:
                path.write_bytes(blobs[i])
            items[i] = (str(path), i)
        return items, str(tmp_path / f"{BAD}.jpg"), "read", "FileNotFoundError"
    if kind == "corrupt_file":
        path = tmp_path / "corrupt.jpg"
        path.write_bytes(_random_bytes())
        items[BAD] = (str(path), BAD)
        return items, str(path), "decode", "cannot identify image file"
    if kind == "corrupt_bytes":
        items[BAD] = (_random_bytes(), BAD)
        return items, "<600 bytes in memory>", "decode", "cannot identify image file"
    if kind == "truncated":
        items[BAD] = (blobs[BAD][: len(blobs[BAD]) // 2], BAD)
        return items, f"<{len(blobs[BAD]) // 2} bytes in memory>", "decode", "OSError"
    assert kind == "getitem_raises"

    class Flaky(Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: int):
            if index == BAD:
                raise KeyError("label table has no row 5")
            return items[index]

    return Flaky(), f"Flaky[{BAD}]", "fetch", "KeyError: 'label table has no row 5'"


ERROR_KINDS = ["missing", "corrupt_file", "corrupt_bytes", "truncated", "getitem_raises"]


@pytest.mark.parametrize("kind", ERROR_KINDS)
@pytest.mark.parametrize("num_threads", [1, 4])
def test_raise_at_the_bad_batch(
    tmp_path: Path, blobs: list[bytes], refs: list[np.ndarray], kind: str, num_threads: int
) -> None:
    source, origin, stage, reason = _bad_source(kind, tmp_path, blobs)
    loader = ThreadLoader(source, batch_size=2, num_threads=num_threads, size=(H, W))
    delivered = []
    with pytest.raises(SampleError) as info:
        for images, targets in loader:
            assert_pixels(images, refs, targets.tolist())
            delivered.append(targets.tolist())
    assert delivered == [[0, 1], [2, 3]]  # every earlier batch, intact; the error at batch 2
    error = info.value
    assert isinstance(error, ThreadLoaderError)
    assert (error.index, error.origin, error.stage) == (BAD, origin, stage)
    assert reason in error.reason
    message = str(error)
    assert message.startswith(f"sample {BAD} ({origin}): {stage} failed: ")
    assert reason in message
    if kind == "getitem_raises":
        assert isinstance(error.__cause__, KeyError)
    if kind == "missing":
        assert isinstance(error.__cause__, FileNotFoundError)
    assert pickle.loads(pickle.dumps(error)).args == error.args
    assert wait_for_no_reader_threads(1.0) == []
    stats = loader.stats()
    assert stats.errors == 1 and stats.skipped == 0
    assert stats.samples == 4 and stats.batches == 2

    # The loader still works: a new pass starts from the beginning and fails at the same place.
    again = iter(loader)
    images, targets = next(again)
    assert targets.tolist() == [0, 1]
    assert_pixels(images, refs, [0, 1])
    assert next(again)[1].tolist() == [2, 3]
    with pytest.raises(SampleError, match=f"sample {BAD} "):
        next(again)
    loader.close()
    assert loader.stats().errors == 2


@pytest.mark.parametrize(
    ("raised", "reason"),
    [
        (ValueError("bad record\n  label: missing\n"), "ValueError: bad record label: missing"),
        (IndexError(), "IndexError"),
    ],
)
def test_a_sample_errors_reason_is_one_line_naming_the_exception(
    blobs: list[bytes], caplog: pytest.LogCaptureFixture, raised: Exception, reason: str
) -> None:
    """A multi-line message spread the reason (documented as one line) and the skip log over several
    lines; one without a message gave ``"IndexError: "``."""

    class Failing(Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int):
            if index == 1:
                raise raised
            return blobs[0], 0

    with pytest.raises(SampleError) as info:
        list(ThreadLoader(Failing(), batch_size=2, device="cpu"))
    assert info.value.reason == reason
    assert str(info.value) == f"sample 1 (Failing[1]): fetch failed: {reason}"
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        list(ThreadLoader(Failing(), batch_size=2, device="cpu", on_error="skip"))
    lines = [r.getMessage() for r in caplog.records if r.name == "threadloader"]
    assert lines == [f"skipping sample 1 (Failing[1]): fetch failed: {reason}"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are Python 3.11's")
def test_a_sample_error_holds_no_reader_frame_through_an_exception_group(blobs: list[bytes]) -> None:
    """A source that raises a group (fetches in a task group): its members' tracebacks kept the reader
    thread's stack alive, with the group's bytes, as long as the user kept the error."""

    class Held:
        pass

    held: list[weakref.ref[Held]] = []

    class Grouped(Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int):
            if index == 0:
                return blobs[0], 0
            local = Held()  # lives as long as this frame does
            held.append(weakref.ref(local))
            failed = []
            try:
                raise ConnectionError("shard 3 is down")
            except ConnectionError as exc:
                failed.append(exc)  # as a task group gathers its tasks' errors
            raise ExceptionGroup("fetching the record", failed)  # noqa: F821  # Python 3.11's

    with pytest.raises(SampleError) as info:
        list(ThreadLoader(Grouped(), batch_size=2, device="cpu"))
    member = info.value.__cause__.exceptions[0]  # type: ignore[union-attr]
    assert member.__traceback__ is None
    assert held[0]() is None, "the error kept the reader's frames alive"
    notes = "\n".join(getattr(member, "__notes__", []))
    assert 'raise ConnectionError("shard 3 is down")' in notes  # its traceback, as text


@pytest.mark.parametrize("size", [None, (H, W)])
@pytest.mark.parametrize("num_threads", [1, 3])
def test_skip_leaves_bad_samples_out(
    tmp_path: Path,
    blobs: list[bytes],
    refs: list[np.ndarray],
    caplog: pytest.LogCaptureFixture,
    size,
    num_threads: int,
) -> None:
    missing = str(tmp_path / "missing.jpg")
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(_random_bytes())
    items: list = [(blobs[i], i) for i in range(8)]
    items[1] = (missing, 1)
    items[3] = (str(corrupt), 3)
    items[4] = (_random_bytes(), 4)

    class Holes(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int):
            if index == 5:
                raise IndexError("hole at 5")
            return items[index]

    loader = ThreadLoader(Holes(), batch_size=3, num_threads=num_threads, size=size, on_error="skip")
    assert len(loader) == 3
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        batches = checked_epoch(loader, refs)
    # Batch [3, 4, 5] is all bad: it is not yielded at all.
    assert batches == [[0, 2], [6, 7]]
    records = [r for r in caplog.records if r.name == "threadloader"]
    assert len(records) == 4
    assert all(r.levelno == logging.WARNING for r in records)
    messages = sorted(r.getMessage() for r in records)
    assert messages[0].startswith(f"skipping sample 1 ({missing}): read failed: FileNotFoundError")
    assert messages[1].startswith(f"skipping sample 3 ({corrupt}): decode failed:")
    assert messages[2].startswith("skipping sample 4 (<600 bytes in memory>): decode failed:")
    assert messages[3] == "skipping sample 5 (Holes[5]): fetch failed: IndexError: hole at 5"
    stats = loader.stats()
    assert (stats.skipped, stats.errors, stats.samples, stats.batches) == (4, 4, 4, 2)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        assert epoch(loader) == [[0, 2], [6, 7]]
    assert [r for r in caplog.records if r.name == "threadloader"] == []  # logged once per sample
    assert loader.stats().skipped == 8


def test_skip_when_every_sample_is_bad_yields_nothing(tmp_path: Path) -> None:
    loader = ThreadLoader([str(tmp_path / f"{i}.jpg") for i in range(5)], batch_size=2, on_error="skip")
    assert list(loader) == []
    stats = loader.stats()
    assert (stats.skipped, stats.errors, stats.samples, stats.batches) == (5, 5, 0, 0)


# ---------------------------------------------------------------------------------- no multiprocessing


def test_no_processes_and_unpicklable_sources_work(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    class LambdaDataset(Dataset):
        def __init__(self) -> None:
            self.get = lambda i: (blobs[i], i * 2)
            self.pid = os.getpid()

        def __len__(self) -> int:
            return 12

        def __getitem__(self, index: int):
            assert os.getpid() == self.pid  # read in this very process
            return self.get(index)

    dataset = LambdaDataset()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(dataset)
    children_before = multiprocessing.active_children()
    assert children_before == []
    loader = ThreadLoader(dataset, batch_size=4, num_threads=3, size=(H, W))
    got = []
    for images, targets in loader:
        assert multiprocessing.active_children() == []
        indices = [t // 2 for t in targets.tolist()]
        assert_pixels(images, refs, indices)
        got.extend(targets.tolist())
    assert got == [2 * i for i in range(12)]


# --------------------------------------------------------------------------------------------- memory


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc (Linux)")
def test_fifty_epochs_without_growth_in_resident_memory(blobs: list[bytes]) -> None:
    """Batches of 2.3 MiB each, 135 of them after the warm-up: keeping any of them would show."""
    import threading

    samples = [(blobs[i % N], i) for i in range(12)]
    threads_before = threading.active_count()
    options = {"batch_size": 4, "size": (224, 224), "dtype": torch.float32, "num_threads": 3}
    with ThreadLoader(samples, device="cpu", **options) as loader:  # type: ignore[arg-type]
        for _ in range(5):  # warm-up: allocator pools, imports, caches
            list(loader)
        start = resident_bytes()
        for _ in range(45):
            for _images, _targets in loader:
                pass
            assert threading.active_count() == threads_before
        del _images, _targets
        grown = resident_bytes() - start
        stats = loader.stats()
    assert stats.samples == 50 * 12 and stats.batches == 50 * 3 and stats.errors == 0
    assert grown < 48 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB over 45 epochs"


def test_ahead_counts_the_readers_held_back_by_a_slow_consumer() -> None:
    """Readers idle with the prefetch window full show as ``ahead``; a consumer that never keeps them
    waiting leaves it near zero. The slow consumer sleeps 50 ms a batch, far longer than a tiny batch
    takes to make, so its one reader spends most of that time ahead."""
    from .conftest import encode, photo

    samples = [(encode(photo(8, 8, seed=i)), i) for i in range(24)]
    pause, batches = 0.05, 12
    with ThreadLoader(samples, batch_size=2, num_threads=1, prefetch=1, device="cpu") as loader:
        for _ in loader:
            time.sleep(pause)
        slow = loader.stats().stage_seconds["ahead"]
    assert slow > 0.5 * pause * (batches - 2), slow
    with ThreadLoader(samples, batch_size=2, num_threads=1, prefetch=64, device="cpu") as loader:
        for _ in loader:
            pass
        fast = loader.stats().stage_seconds["ahead"]
    assert fast < 0.05, fast  # a window of 64 batches is never full over 12


def test_stage_cpu_seconds_tell_a_stages_work_from_its_waits() -> None:
    """A fetch that sleeps and a transform that spins: both take their time, only the spin is CPU."""
    from threadloader.transforms import Transform

    from .conftest import encode, photo

    pause = 0.01

    class SlowSamples(list):  # type: ignore[type-arg]
        def __getitem__(self, index: Any) -> Any:
            time.sleep(pause)  # a fetch from a slow store: the thread waits
            return super().__getitem__(index)

    class Spin(Transform):
        def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
            until = time.thread_time() + pause  # work: the thread's own CPU
            while time.thread_time() < until:
                pass
            return images

    samples = SlowSamples((encode(photo(8, 8, seed=i)), i) for i in range(8))
    with ThreadLoader(samples, batch_size=2, num_threads=1, device="cpu", transform=Spin()) as loader:
        assert len(list(loader)) == 4
        stats = loader.stats()
    wall, cpu = stats.stage_seconds, stats.stage_cpu_seconds
    assert wall["fetch"] >= 8 * pause and cpu["fetch"] < 0.5 * wall["fetch"], (wall, cpu)
    assert cpu["transform"] >= 4 * pause, (wall, cpu)  # its wall time on a loaded machine: more
    assert cpu["decode"] > 0 and cpu["ahead"] == cpu["wait"] == 0, cpu  # waits: not measured


def test_a_stop_iteration_from_a_collate_fn_is_raised_at_its_batch_not_taken_for_the_epochs_end(
    blobs: list[bytes],
) -> None:
    """A reader's StopIteration (say, a helper's next() that runs dry) was raised on by the pool's next():
    the loop ended without an error, batches short."""

    def dry(targets: list[int]) -> torch.Tensor:
        if 4 in targets:
            next(iter([]))
        return torch.tensor(targets)

    source = [(blobs[i % len(blobs)], i) for i in range(8)]
    loader = ThreadLoader(source, batch_size=2, num_threads=2, collate_fn=dry, device="cpu", size=(8, 8))
    received = []
    with pytest.raises(RuntimeError, match="a reader's work raised StopIteration") as info:
        for _, targets in loader:
            received.append(targets.tolist())
    assert received == [[0, 1], [2, 3]] and isinstance(info.value.__cause__, StopIteration)
    loader.close()


def test_cpu_0_is_the_cpu(blobs: list[bytes]) -> None:
    """A decoder's "cpu" did not match device="cpu:0", and loader.device said cpu:0."""
    from threadloader.decode import PillowDecoder

    loader = ThreadLoader(blobs[:2], batch_size=2, device="cpu:0", decoder=PillowDecoder())
    assert loader.device == torch.device("cpu")
    loader.close()


class _CountingCalls(PillowDecoder):
    """Pillow, recording how many images each decoder call got."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def decode(self, encoded: Any, **options: Any) -> Any:
        self.calls.append(len(encoded))
        return super().decode(encoded, **options)


def test_decode_batch_size_below_the_batch_says_what_the_calls_get(blobs: list[bytes]) -> None:
    """A call holds whole batches: decode_batch_size=2 at batch 4 decoded 4 a call, and said 2."""
    decoder = _CountingCalls()
    loader = ThreadLoader(blobs[:8], batch_size=4, decode_batch_size=2, decoder=decoder, size=(8, 8))
    assert loader.decode_batch_size == 4
    assert sum(len(images) for images, _ in loader) == 8
    assert decoder.calls == [4, 4]
    loader.close()


def test_decode_batch_size_under_a_batch_sampler_says_what_the_calls_get(blobs: list[bytes]) -> None:
    """On the CPU a batch_sampler's loader decodes one batch a call, and said decode_batch_size 1."""
    decoder = _CountingCalls()
    calls = decoder.calls
    options: dict[str, Any] = {"decoder": decoder, "size": (8, 8), "num_threads": 1}
    sampler = BatchSampler(SequentialSampler(range(8)), batch_size=3, drop_last=False)
    with ThreadLoader(blobs[:8], batch_sampler=sampler, **options) as loader:
        assert loader.decode_batch_size == 3
        assert [len(images) for images, _ in loader] == [3, 3, 2]
    assert calls == [3, 3, 2]
    # Batches of sizes only known as they come: one a call, a number no call has, so none.
    calls.clear()
    with ThreadLoader(blobs[:8], batch_sampler=[[0, 1, 2, 3, 4], [5], [6, 7]], **options) as loader:
        assert loader.decode_batch_size is None
        assert [len(images) for images, _ in loader] == [5, 1, 2]
    assert calls == [5, 1, 2]
    # A bound given is kept, and a larger batch is still one call.
    calls.clear()
    uneven = [[0, 1], [2], [3, 4, 5, 6, 7]]
    with ThreadLoader(blobs[:8], batch_sampler=uneven, decode_batch_size=3, **options) as loader:
        assert loader.decode_batch_size == 3
        assert [len(images) for images, _ in loader] == [2, 1, 5]
    assert calls == [3, 5]


@pytest.mark.skipif(torch.cuda.is_available(), reason="device=None on a machine without a usable GPU")
def test_a_gpu_backend_is_ignored_where_device_none_finds_no_gpu(blobs: list[bytes]) -> None:
    """A script written for a GPU (backend="cuda") failed on a machine without one, where the other GPU
    options (gpu_decoders, jpeg_fancy_upsampling) are ignored."""
    loader = ThreadLoader(blobs[:2], batch_size=2, backend="cuda", gpu_decoders=3)
    assert loader.device == torch.device("cpu")
    assert sum(len(images) for images, _ in loader) == 2
    loader.close()


def test_a_sampler_of_float_indices_is_refused_as_dataloader_refuses_it(
    indexed: list[tuple[bytes, int]],
) -> None:
    """int() made 1.7 sample 1; a list (DataLoader's dataset here) refuses a float index."""
    with pytest.raises(TypeError):
        next(iter(DataLoader(list(range(20)), batch_size=2, sampler=[0.0, 1.7])))
    loader = ThreadLoader(indexed, batch_size=2, sampler=[0.0, 1.7], num_threads=1)
    with pytest.raises(TypeError, match=r"sampler yielded 0\.0 \(float\): sample indices must be integers"):
        epoch(loader)
    batches = ThreadLoader(indexed, batch_sampler=[[np.int64(3), torch.tensor(4)]], num_threads=1)
    assert epoch(batches) == [[3, 4]]  # integers of any kind


def test_an_empty_batch_from_a_batch_sampler_is_refused_at_its_place(
    indexed: list[tuple[bytes, int]],
) -> None:
    """It was left out: the epoch gave fewer batches than ``len(loader)``, and the batches after it moved
    one place, against the saved position. DataLoader fails on it too (its collate's IndexError); here
    the batches before it come first, as before any sampler error."""
    with pytest.raises(IndexError):
        list(DataLoader(list(range(20)), batch_sampler=[[0, 1], [], [2, 3]]))
    loader = ThreadLoader(indexed, batch_sampler=[[0, 1], [], [2, 3]], num_threads=1)
    batches = iter(loader)
    assert next(batches)[1].tolist() == [0, 1]
    with pytest.raises(
        ValueError, match=r"batch_sampler yielded an empty batch \(its batch 1, counting from 0\)"
    ):
        next(batches)
    loader.close()


def test_repr_of_a_loader_over_a_sampler_without_a_length(indexed: list[tuple[bytes, int]]) -> None:
    loader = ThreadLoader(indexed, batch_size=2, sampler=(i for i in range(4)), num_threads=1)
    assert "batches=unknown" in repr(loader)  # it raised TypeError: the sampler has no __len__
    assert epoch(loader) == [[0, 1], [2, 3]]
