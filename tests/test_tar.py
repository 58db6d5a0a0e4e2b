"""Tar shards (WebDataset layout): reading, targets, brace patterns, shuffle, damage, missing members.

Shards are written here with the standard library's tarfile and read back through the loader; pixels are
checked against Pillow's decode of the same member bytes, targets against what was written.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import threadloader._shardfiles
from threadloader import SampleError, ShardError, TarMember, TarShards, ThreadLoader
from threadloader._tar import expand_braces

from .conftest import distinct_jpegs, encode, photo, pil_reference, run_script, wait_for_no_reader_threads

H, W = 16, 24
PER_SHARD = 6
SHARDS = 3
N = PER_SHARD * SHARDS

Members = dict[str, bytes]


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return distinct_jpegs(N, H, W, first_seed=300)


def write_shard(path: Path, samples: list[tuple[str, Members]]) -> Path:
    """A WebDataset shard: members ``key.ext`` in sample order, written by tarfile (the reference writer)."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return path


def sample(blobs: list[bytes], i: int) -> tuple[str, Members]:
    """Sample ``i``: its image, its class (= i), a caption and a JSON with the class under "label"."""
    return f"s{i:04d}", {
        "jpg": blobs[i],
        "cls": f"{i}\n".encode(),
        "txt": f"caption {i} é".encode(),
        "json": json.dumps({"label": i, "name": f"n{i}"}).encode(),
    }


@pytest.fixture
def shards(tmp_path: Path, blobs: list[bytes]) -> Path:
    """tmp/shards/000000.tar ... 000002.tar, PER_SHARD samples each, numbered across shards."""
    root = tmp_path / "shards"
    root.mkdir()
    for s in range(SHARDS):
        write_shard(root / f"{s:06d}.tar", [sample(blobs, s * PER_SHARD + k) for k in range(PER_SHARD)])
    return root


def pattern(root: Path) -> str:
    return str(root / "{000000..000002}.tar")


def member_offset(path: Path, name: str) -> tuple[int, int]:
    """(header offset, data offset) of a member, as tarfile reports them."""
    with tarfile.open(path) as archive:
        info = archive.getmember(name)
        return info.offset, info.offset_data


def check_pixels(images: list[torch.Tensor] | torch.Tensor, blobs: list[bytes], targets: list[int]) -> None:
    assert len(images) == len(targets)
    for image, target in zip(images, targets, strict=True):
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), pil_reference(blobs[target]))


# -------------------------------------------------------------------------------------------- reading


@pytest.mark.parametrize("num_threads", [1, 4])
def test_pattern_reads_every_sample_in_order_with_pillows_pixels(
    shards: Path, blobs: list[bytes], num_threads: int
) -> None:
    loader = ThreadLoader(pattern(shards), batch_size=4, num_threads=num_threads)
    assert isinstance(loader.source, TarShards)
    assert len(loader.source) == N and len(loader) == 5
    seen = []
    for images, targets in loader:
        check_pixels(images, blobs, targets.tolist())
        seen += targets.tolist()
    assert seen == list(range(N))  # shard by shard, members in tar order; targets from .cls


def test_items_are_members_read_by_one_positioned_read(shards: Path, blobs: list[bytes]) -> None:
    source = TarShards(pattern(shards))
    member, target = source[PER_SHARD + 2]
    assert isinstance(member, TarMember) and target == PER_SHARD + 2
    path = shards / "000001.tar"
    assert member.shard == str(path) and member.name == "s0008.jpg"
    assert member.offset == member_offset(path, "s0008.jpg")[1] and member.size == len(blobs[8])
    assert member.read() == blobs[8]
    assert member.origin == f"{path}:s0008.jpg"
    with pytest.raises(IndexError):
        source[N]


def test_list_of_shards_equals_the_pattern_and_pathlike_works(shards: Path) -> None:
    paths = [shards / f"{s:06d}.tar" for s in range(SHARDS)]
    by_list = ThreadLoader(paths, batch_size=5)
    by_str = ThreadLoader([str(p) for p in reversed(paths)], batch_size=5)
    assert isinstance(by_list.source, TarShards)
    assert [t.tolist() for _, t in by_list] == [
        list(range(0, 5)),
        list(range(5, 10)),
        list(range(10, 15)),
        [15, 16, 17],
    ]
    order = [t for _, ts in by_str for t in ts.tolist()]  # shards in the order given
    assert order == list(range(12, 18)) + list(range(6, 12)) + list(range(0, 6))


def test_single_shard_path(shards: Path) -> None:
    loader = ThreadLoader(str(shards / "000001.tar"), batch_size=PER_SHARD)
    assert [t.tolist() for _, t in loader] == [list(range(PER_SHARD, 2 * PER_SHARD))]


def test_a_glob_is_the_matching_shards_sorted_by_name(shards: Path, blobs: list[bytes]) -> None:
    (shards / "notes.txt").write_text("not a shard")
    expected = [str(shards / f"{s:06d}.tar") for s in range(SHARDS)]
    loader = ThreadLoader(str(shards / "*.tar"), batch_size=N)
    assert loader.source.shards == expected
    ((images, targets),) = list(loader)
    assert targets.tolist() == list(range(N))
    check_pixels(images, blobs, targets.tolist())
    # In a list, after braces, and as a Path: each glob expands where it stands.
    mixed = TarShards([shards / "00000[12].tar", str(shards / "{000000,00000?}.tar")])
    assert mixed.shards == [*expected[1:], expected[0], *expected]


def test_a_path_that_exists_is_not_taken_for_a_glob(shards: Path, blobs: list[bytes]) -> None:
    literal = shards / "[0].tar"
    write_shard(literal, [sample(blobs, 0)])
    assert TarShards(str(literal)).shards == [str(literal)]


@pytest.mark.parametrize(
    ("spec", "says"),
    [("nowhere/*.tar", "no file matches this glob"), ("s3://bucket/train-*.tar", "URLs are not globbed")],
    ids=["no-match", "url"],
)
def test_a_glob_that_cannot_be_expanded_names_the_brace_syntax(spec: str, says: str) -> None:
    with pytest.raises(ShardError, match=says) as raised:
        ThreadLoader(spec)
    assert raised.value.shard == spec and "{000000..000127}" in str(raised.value)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"index_threads": 0}, ValueError, "index_threads must be at least 1, got 0"),  # was accepted
        ({"index_threads": 2.5}, ValueError, r"index_threads must be an int, got 2\.5"),
        # was "'int' object is not iterable"
        ({"image": 5}, TypeError, r"image must be an extension or a list of them .*got 5"),
        ({"image": ["jpg", 5]}, TypeError, r"got \['jpg', 5\]"),
    ],
)
def test_bad_shard_arguments_are_named(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        TarShards("nowhere/{0..1}.tar", **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("a/{000..003}.tar", ["a/000.tar", "a/001.tar", "a/002.tar", "a/003.tar"]),
        ("{8..11}.tar", ["8.tar", "9.tar", "10.tar", "11.tar"]),
        ("{09..11}", ["09", "10", "11"]),
        ("{3..1}", ["3", "2", "1"]),
        ("{a,b}-{0..1}", ["a-0", "a-1", "b-0", "b-1"]),
        ("x{a,b{1..2}}y", ["xay", "xb1y", "xb2y"]),
        ("plain.tar", ["plain.tar"]),
        ("s3://bucket/train-{0000..0002}.tar", [f"s3://bucket/train-{i:04d}.tar" for i in range(3)]),
        # bash's (and WebDataset's braceexpand) steps and letters, which were kept as literal text
        ("s-{0..6..2}.tar", ["s-0.tar", "s-2.tar", "s-4.tar", "s-6.tar"]),
        ("{000..010..5}", ["000", "005", "010"]),
        ("{10..1..3}", ["10", "7", "4", "1"]),
        ("{1..5..-2}", ["1", "3", "5"]),  # bash ignores the step's sign
        ("s-{a..c}.tar", ["s-a.tar", "s-b.tar", "s-c.tar"]),
        ("{e..a..2}", ["e", "c", "a"]),
        ("s-{x}.tar", ["s-{x}.tar"]),  # no comma, no range: bash keeps the braces
        ("{{a,b}}", ["{a}", "{b}"]),
    ],
)
def test_brace_expansion(spec: str, expected: list[str]) -> None:
    assert expand_braces(spec) == expected


@pytest.mark.parametrize("spec", ["a{0..1.tar", "a}.tar", "{a,{b}.tar"])
def test_unbalanced_braces_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError, match="unbalanced"):
        expand_braces(spec)


# -------------------------------------------------------------------------------------------- targets


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, list(range(PER_SHARD))),  # auto: .cls is there
        ({"target": "cls"}, list(range(PER_SHARD))),
        ({"target": "txt"}, [f"caption {i} é" for i in range(PER_SHARD)]),
        ({"target": "json", "target_key": "label"}, list(range(PER_SHARD))),
        ({"target": "json"}, [{"label": i, "name": f"n{i}"} for i in range(PER_SHARD)]),
    ],
)
def test_targets(shards: Path, options: dict, expected: list) -> None:
    source = TarShards(shards / "000000.tar", **options)
    assert [source[i][1] for i in range(PER_SHARD)] == expected
    ((_, targets),) = list(ThreadLoader(source, batch_size=PER_SHARD, num_threads=2))
    if isinstance(expected[0], int):
        assert targets.tolist() == expected
    elif isinstance(expected[0], str):
        assert targets == expected  # collated as default_collate does: a list of strings
    else:
        assert targets["name"] == [e["name"] for e in expected]


def test_no_target_and_auto_without_cls(tmp_path: Path, blobs: list[bytes]) -> None:
    path = write_shard(tmp_path / "images.tar", [(f"k{i}", {"jpg": blobs[i]}) for i in range(4)])
    auto = TarShards(path)
    assert auto.target is None and isinstance(auto[0], TarMember)
    loader = ThreadLoader(str(path), batch_size=4)
    ((images, targets),) = list(loader)
    assert targets is None
    check_pixels(images, blobs, [0, 1, 2, 3])
    explicit = TarShards(write_shard(tmp_path / "b.tar", [sample(blobs, 0)]), target=None)
    assert isinstance(explicit[0], TarMember)


def test_image_extension_choice_first_match_wins(tmp_path: Path, blobs: list[bytes]) -> None:
    png = encode(photo(H, W, seed=999), "PNG")
    path = write_shard(tmp_path / "x.tar", [("a", {"jpg": blobs[0], "png": png, "cls": b"0"})])
    assert TarShards(path, image="png;jpg")[0][0].read() == png
    assert TarShards(path, image=("jpg", "png"))[0][0].read() == blobs[0]
    assert TarShards(path, image=".PNG")[0][0].read() == png
    upper = write_shard(tmp_path / "upper.tar", [("b", {"JPEG": blobs[1], "cls": b"1"})])
    assert TarShards(upper)[0][0].read() == blobs[1]  # default: every ImageFolder extension, any case


def test_keys_with_dots_and_directories_follow_webdataset(tmp_path: Path, blobs: list[bytes]) -> None:
    path = write_shard(
        tmp_path / "x.tar",
        [
            ("dir/a", {"jpg": blobs[0], "cls": b"5"}),
            ("dir/b", {"seg.png": b"x", "jpg": blobs[1], "cls": b"6"}),  # key up to the first dot
            ("other/a", {"jpg": blobs[2], "cls": b"7"}),  # the directory is part of the key
        ],
    )
    source = TarShards(path)
    assert len(source) == 3
    assert [source[i][1] for i in range(3)] == [5, 6, 7]
    assert [source[i][0].name for i in range(3)] == ["dir/a.jpg", "dir/b.jpg", "other/a.jpg"]


def test_members_of_a_key_need_not_be_adjacent(tmp_path: Path, blobs: list[bytes]) -> None:
    path = write_shard(
        tmp_path / "x.tar",
        [("a", {"jpg": blobs[0]}), ("b", {"jpg": blobs[1]}), ("a", {"cls": b"0"}), ("b", {"cls": b"1"})],
    )
    source = TarShards(path)
    assert len(source) == 2
    assert [(source[i][0].read(), source[i][1]) for i in range(2)] == [(blobs[0], 0), (blobs[1], 1)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"target": "bogus"}, "target must be one of"),
        ({"target": "cls", "target_key": "label"}, "needs target='json'"),
        ({"image": ""}, "at least one extension"),
    ],
)
def test_bad_options(shards: Path, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TarShards(shards / "000000.tar", **options)


# -------------------------------------------------------------------------------------------- shuffle


def orders(loader: ThreadLoader, epochs: int) -> list[list[int]]:
    return [[t for _, targets in loader for t in targets.tolist()] for _ in range(epochs)]


def test_shuffle_is_exact_over_all_shards_and_reproducible_across_threads(
    shards: Path, blobs: list[bytes]
) -> None:
    runs = [
        orders(ThreadLoader(pattern(shards), batch_size=4, shuffle=True, seed=11, num_threads=t), 3)
        for t in (1, 2, 5)
    ]
    assert runs[0] == runs[1] == runs[2]
    for order in runs[0]:
        assert sorted(order) == list(range(N))
    assert len({tuple(order) for order in runs[0]}) == 3  # a new order each epoch
    # The same permutation as an in-memory list of the same samples: the shuffle is over the whole set,
    # not shard by shard (every shard appears in the first few samples).
    in_memory = [(blobs[i], i) for i in range(N)]
    assert orders(ThreadLoader(in_memory, batch_size=4, shuffle=True, seed=11), 3) == runs[0]
    assert len({i // PER_SHARD for i in runs[0][0][:6]}) == SHARDS
    replay = ThreadLoader(pattern(shards), batch_size=4, shuffle=True, seed=11)
    replay.set_epoch(2)
    assert orders(replay, 1)[0] == runs[0][2]
    other = ThreadLoader(pattern(shards), batch_size=4, shuffle=True, seed=12)
    assert orders(other, 1)[0] != runs[0][0]


# ---------------------------------------------------------------------------------- damaged and missing


def fail_at(loader: ThreadLoader) -> tuple[list[int], SampleError]:
    delivered = []
    with pytest.raises(SampleError) as info:
        for _, targets in loader:
            delivered += targets.tolist()
    return delivered, info.value


def test_truncated_shard_names_the_cut_member(tmp_path: Path, blobs: list[bytes]) -> None:
    # The image is the last member, so the cut leaves it with its target.
    samples = [(f"s{i:04d}", {"cls": str(i).encode(), "jpg": blobs[i]}) for i in range(4)]
    path = write_shard(tmp_path / "cut.tar", samples)
    _, data_offset = member_offset(path, "s0003.jpg")
    with open(path, "r+b") as f:
        f.truncate(data_offset + len(blobs[3]) // 2)
    source = TarShards(path, target="cls")
    assert len(source) == 4 and "truncated" in source.damaged[0]
    delivered, error = fail_at(ThreadLoader(source, batch_size=2))
    assert delivered == [0, 1]  # the batch [2, 3] fails at 3
    assert (error.index, error.stage, error.origin) == (3, "read", f"{path}:s0003.jpg")
    assert "truncated" in error.reason
    assert isinstance(error.__cause__, ShardError) and error.__cause__.member == "s0003.jpg"
    skipping = ThreadLoader(source, batch_size=2, on_error="skip")
    assert [t for _, ts in skipping for t in ts.tolist()] == [0, 1, 2]
    assert skipping.stats().skipped == 1


def test_truncated_target_member_is_that_samples_error(tmp_path: Path, blobs: list[bytes]) -> None:
    samples = [sample(blobs, 0), ("s0001", {"jpg": blobs[1], "cls": b"1" * 700})]
    path = write_shard(tmp_path / "cut.tar", samples)
    _, data_offset = member_offset(path, "s0001.cls")
    with open(path, "r+b") as f:
        f.truncate(data_offset + 100)
    delivered, error = fail_at(ThreadLoader(str(path), batch_size=1))
    assert delivered == [0]
    assert (error.index, error.stage) == (1, "fetch")
    assert str(path) in error.reason and "s0001.cls" in error.reason and "truncated" in error.reason


def test_damaged_header_mid_shard_loses_only_its_member(
    tmp_path: Path, blobs: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    path = write_shard(tmp_path / "bad.tar", [sample(blobs, i) for i in range(5)])
    header, _ = member_offset(path, "s0002.jpg")
    with open(path, "r+b") as f:  # garble the name and the checksum: tarfile rejects the header
        f.seek(header)
        f.write(b"\xff" * 20)
        f.seek(header + 148)
        f.write(b"garbage!")
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        source = TarShards(path)
    assert len(source.damaged) == 1 and str(path) in source.damaged[0]
    assert any("damaged" in r.getMessage() for r in caplog.records if r.name == "threadloader")
    assert len(source) == 5  # key s0002 survives through its other members
    loader = ThreadLoader(source, batch_size=1)
    delivered, error = fail_at(loader)
    assert delivered == [0, 1]
    assert (error.index, error.stage) == (2, "fetch")
    assert str(path) in error.reason and "'s0002' has no image member" in error.reason
    assert "the shard is damaged: bytes" in error.reason
    skipping = ThreadLoader(source, batch_size=2, on_error="skip")
    assert [t for _, ts in skipping for t in ts.tolist()] == [0, 1, 3, 4]  # the members after it are kept
    assert skipping.stats().skipped == 1


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])
def test_a_damaged_header_after_a_long_name_loses_only_its_member(
    tmp_path: Path, blobs: list[bytes], fmt: int
) -> None:
    """Names past 100 characters take a header of their own (PAX or GNU); a damaged header after one
    made tarfile stop, which the walk took for the shard's end: every later sample was lost, and the
    shard called truncated."""
    folder = "train/" + "x" * 110 + "/"
    path = tmp_path / "long.tar"
    with tarfile.open(path, "w", format=fmt) as archive:
        for i in range(5):
            for ext, data in sample(blobs, i)[1].items():
                info = tarfile.TarInfo(f"{folder}s{i:04d}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    _, data = member_offset(path, f"{folder}s0002.jpg")
    with open(path, "r+b") as f:  # the checksum of the header after the long name's
        f.seek(data - tarfile.BLOCKSIZE + 148)
        f.write(b"garbage!")
    source = TarShards(path)
    assert len(source) == 5 and len(source.damaged) == 1
    assert "not tar headers" in source.damaged[0] and "truncated" not in source.damaged[0]
    skipping = ThreadLoader(source, batch_size=2, on_error="skip")
    assert [t for _, ts in skipping for t in ts.tolist()] == [0, 1, 3, 4]


def test_a_pax_global_header_is_no_damage(tmp_path: Path, blobs: list[bytes]) -> None:
    """``git archive`` and tarfile's ``pax_headers`` write one before the members: tarfile reads it as
    no member, so its bytes lie between members without being damage."""
    path = tmp_path / "global.tar"
    with tarfile.open(
        path, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "made by hand"}
    ) as archive:
        for key, members in [sample(blobs, i) for i in range(3)]:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    source = TarShards(path)
    assert source.damaged == []
    assert [t for _, ts in ThreadLoader(source, batch_size=3) for t in ts.tolist()] == [0, 1, 2]


def test_archives_with_global_headers_concatenated_are_no_damage(tmp_path: Path, blobs: list[bytes]) -> None:
    """``cat a.tar b.tar`` of two ``git archive`` outputs: between them the first one's end-of-archive
    zeros, then the second one's global header. Either alone was no damage; together they were."""
    parts = []
    for name, indices in (("a.tar", range(2)), ("b.tar", range(2, 4))):
        path = tmp_path / name
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": name}) as archive:
            for key, members in [sample(blobs, i) for i in indices]:
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
        parts.append(path.read_bytes())
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join(parts))
    source = TarShards(joined)
    assert source.damaged == []
    assert [t for _, ts in ThreadLoader(source, batch_size=4) for t in ts.tolist()] == [0, 1, 2, 3]


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar writes sparse members; tarfile cannot")
def test_a_sparse_member_is_left_out_and_said_so(tmp_path: Path, blobs: list[bytes]) -> None:
    """A sparse member's bytes are not stored in one run from its data offset: read as one, they were
    the wrong bytes, without an error. The sample fails, naming why; the others read as written."""
    folder = tmp_path / "in"
    folder.mkdir()
    with open(folder / "s0000.jpg", "wb") as f:  # a file with a hole: stored sparse
        f.write(blobs[0])
        f.seek(64 * 1024)
        f.write(blobs[0])
    (folder / "s0000.cls").write_text("0")
    (folder / "s0001.jpg").write_bytes(blobs[1])
    (folder / "s0001.cls").write_text("1")
    path = tmp_path / "sparse.tar"
    names = ["s0000.jpg", "s0000.cls", "s0001.jpg", "s0001.cls"]
    done = subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(path), "-C", str(folder), *names])
    if done.returncode != 0:
        pytest.skip("this tar has no --sparse")
    with tarfile.open(path) as archive:
        if archive.getmember("s0000.jpg").sparse is None:
            pytest.skip("this file system keeps no holes: the member is not stored sparse")
    source = TarShards(path)
    assert len(source.damaged) == 1 and "sparse" in source.damaged[0]
    delivered, error = fail_at(ThreadLoader(source, batch_size=1))
    assert delivered == [] and error.index == 0 and "sparse" in error.reason
    member, target = source[1]
    assert member.read() == blobs[1] and target == 1


def test_a_shard_path_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO's open waits for a writer forever."""
    fifo = tmp_path / "000000.tar"
    os.mkfifo(fifo)
    raised: list[BaseException] = []

    def index() -> None:
        try:
            TarShards(fifo)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=index, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "indexing a FIFO waits for a writer"
    assert isinstance(raised[0], ShardError) and "not a regular file" in str(raised[0])


def test_a_forked_child_reads_shards_a_parents_thread_was_reading(tmp_path: Path, blobs: list[bytes]) -> None:
    """A fork while a reader held the storage's lock left the child's copy held: its first read
    waited forever (``multiprocessing``'s fork start method, a fork-based server)."""
    path = write_shard(tmp_path / "f.tar", [sample(blobs, i) for i in range(2)])
    script = f"""
import os, sys, threading
from threadloader import TarShards

source = TarShards({str(path)!r})
member, _ = source[1]
storage = source._index[0].storage
held, release = threading.Event(), threading.Event()

def reader():
    with storage._lock:  # as a read's bookkeeping holds it
        held.set()
        release.wait(10)

threading.Thread(target=reader, daemon=True).start()
held.wait(10)
pid = os.fork()
if pid == 0:
    os._exit(0 if member.read() == open(sys.argv[1], "rb").read() else 1)
release.set()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    (tmp_path / "expected.jpg").write_bytes(blobs[1])
    done = run_script(tmp_path, script, str(tmp_path / "expected.jpg"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]


def test_missing_members(tmp_path: Path, blobs: list[bytes]) -> None:
    path = write_shard(
        tmp_path / "holes.tar",
        [
            sample(blobs, 0),
            ("s0001", {"jpg": blobs[1]}),  # image, no target
            ("s0002", {"cls": b"2"}),  # target, no image
            ("s0003", {"jpg": blobs[3], "cls": b"three"}),  # a target that is not a class
            sample(blobs, 4),
        ],
    )
    source = TarShards(path, target="cls")
    assert len(source) == 5
    messages = {}
    for i in (1, 2, 3):
        with pytest.raises(ShardError) as info:
            source[i]
        messages[i] = str(info.value)
        assert pickle.loads(pickle.dumps(info.value)).shard == str(path)
    assert "'s0001' has no target member 's0001.cls'" in messages[1]
    assert "'s0002' has no image member" in messages[2]
    assert "s0003.cls: target does not parse" in messages[3]
    loader = ThreadLoader(source, batch_size=5, on_error="skip")
    ((images, targets),) = list(loader)
    assert targets.tolist() == [0, 4]
    check_pixels(images, blobs, [0, 4])
    assert loader.stats().skipped == 3
    with pytest.raises(SampleError) as info:
        list(ThreadLoader(source, batch_size=5))
    assert info.value.index == 1 and str(path) in info.value.reason and "s0001.cls" in info.value.reason


def test_json_target_without_the_key(tmp_path: Path, blobs: list[bytes]) -> None:
    path = write_shard(tmp_path / "j.tar", [("a", {"jpg": blobs[0], "json": b'{"other": 1}'})])
    with pytest.raises(ShardError, match=r"a\.json: target does not parse: KeyError: 'label'"):
        TarShards(path, target="json", target_key="label")[0]


def test_decode_errors_name_the_shard_and_member(tmp_path: Path, blobs: list[bytes]) -> None:
    path = write_shard(
        tmp_path / "x.tar", [sample(blobs, 0), ("bad", {"jpg": b"not a jpeg" * 20, "cls": b"1"})]
    )
    delivered, error = fail_at(ThreadLoader(str(path), batch_size=1))
    assert delivered == [0]
    assert (error.index, error.stage, error.origin) == (1, "decode", f"{path}:bad.jpg")


def test_unindexable_shards_raise_at_construction_naming_the_shard(
    tmp_path: Path, blobs: list[bytes]
) -> None:
    good = write_shard(tmp_path / "000000.tar", [sample(blobs, 0)])
    missing = tmp_path / "000001.tar"
    with pytest.raises(ShardError, match=r"000001\.tar: cannot index the shard: FileNotFoundError") as info:
        ThreadLoader(str(tmp_path / "{000000..000001}.tar"))
    assert info.value.shard == str(missing)

    not_tar = tmp_path / "notatar.tar"
    not_tar.write_bytes(blobs[0])
    with pytest.raises(ShardError, match=r"notatar\.tar: no files in it: .* not a tar archive"):
        TarShards([good, not_tar])

    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    with pytest.raises(ShardError, match=r"empty\.tar: the shard is empty \(0 bytes\)"):
        TarShards(empty)

    gz = tmp_path / "c.tar.gz"
    with tarfile.open(gz, "w:gz") as archive:
        archive.add(good, arcname="inner.tar")
    with pytest.raises(ShardError, match="gzip-compressed tar cannot be read by position"):
        ThreadLoader(str(gz))
    bz2 = tmp_path / "c.tar"  # named as a plain tar: the bytes say what it is
    with tarfile.open(bz2, "w:bz2") as archive:
        archive.add(good, arcname="inner.tar")
    with pytest.raises(ShardError, match="bzip2-compressed tar cannot be read by position"):
        ThreadLoader(str(bz2))


def test_a_plain_tar_whose_first_name_starts_as_bzip2s_is_read(tmp_path: Path, blobs: list[bytes]) -> None:
    """A tar starts with its first member's name: one named 'BZh91_0001.jpg' was refused as bzip2."""
    path = write_shard(tmp_path / "bzh.tar", [("BZh91_0001", {"jpg": blobs[0], "cls": b"7"})])
    assert path.read_bytes().startswith(b"BZh9")
    (images, targets), *_ = list(ThreadLoader(str(path), batch_size=1))
    assert targets.tolist() == [7]
    check_pixels(images, blobs, [0])


def test_single_non_shard_path_is_still_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tar shards"):  # a missing one says that it is missing
        ThreadLoader(str(tmp_path / "one.jpg"))
    (tmp_path / "one.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(TypeError, match="tar shards"):
        ThreadLoader(str(tmp_path / "one.jpg"))


def test_members_are_read_concurrently(tmp_path: Path) -> None:
    """Many threads reading members of one shard at once each get their own member's bytes."""
    payloads = [os.urandom(5000 + 37 * i) for i in range(64)]
    path = write_shard(tmp_path / "x.tar", [(f"k{i}", {"jpg": p}) for i, p in enumerate(payloads)])
    source = TarShards(path)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: source[i % 64].read(), range(64 * 20)))
    assert got == [payloads[i % 64] for i in range(64 * 20)]


# ------------------------------------------------------------------------------------------- open files

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")


def open_files(path: Path) -> int:
    """Descriptors of this process open on ``path``, as the kernel lists them."""
    target, count = str(path.resolve()), 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since the listing
            count += os.readlink(f"/proc/self/fd/{fd}") == target
    return count


def open_files_among(paths: list[Path]) -> int:
    """Descriptors open on any of ``paths``, from one listing: per-path listings taken one after the
    other could count a descriptor twice, once before it is closed and once after it is reopened."""
    targets, count = {str(path.resolve()) for path in paths}, 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}") in targets
    return count


def in_thread(work: Callable[[], None]) -> None:
    """Runs ``work`` in a new thread to its end, re-raising what it raised."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failures:
        raise failures[0]


@needs_proc
def test_each_shard_is_opened_once_for_every_thread(shards: Path, blobs: list[bytes]) -> None:
    source = TarShards(pattern(shards))
    paths = [shards / f"{s:06d}.tar" for s in range(SHARDS)]
    seen: list[list[int]] = []

    def read_all() -> None:
        for i in range(N):
            assert source[i][0].read() == blobs[i]
            seen.append([open_files(path) for path in paths])

    in_thread(read_all)
    # One descriptor per shard read so far; the next thread reads on the same ones.
    assert seen[PER_SHARD - 1] == [1, 0, 0] and seen[-1] == [1, 1, 1]
    in_thread(read_all)
    assert seen[-1] == [1, 1, 1] and [open_files(path) for path in paths] == [1, 1, 1]


@needs_proc
def test_dropping_the_source_closes_its_files(shards: Path, blobs: list[bytes]) -> None:
    source = TarShards(pattern(shards))
    assert source[0][0].read() == blobs[0] and source[N - 1][0].read() == blobs[N - 1]
    first, last = shards / "000000.tar", shards / f"{SHARDS - 1:06d}.tar"
    assert (open_files(first), open_files(last)) == (1, 1)  # as long as the source lives
    del source
    gc.collect()
    assert (open_files(first), open_files(last)) == (0, 0)


@needs_proc
@pytest.mark.parametrize("threads", [1, 3])
def test_a_source_keeps_at_most_max_open_shards(
    shards: Path, blobs: list[bytes], monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """Past the bound, the least recently used file that no thread is reading is closed. Between its reads
    a thread sees at most the bound, plus one for each other thread (the file it is reading or opening)."""
    monkeypatch.setattr(threadloader._shardfiles, "MAX_OPEN_SHARDS", 2)
    source = TarShards(pattern(shards))
    paths = [shards / f"{s:06d}.tar" for s in range(SHARDS)]
    order = [s * PER_SHARD + k for k in range(PER_SHARD) for s in (0, 1, 2, 0, 2, 1)]  # shards in turn
    peak: list[int] = []

    def read_in_turn() -> None:
        for i in order:
            assert source[i][0].read() == blobs[i]
            peak.append(open_files_among(paths))

    workers = [threading.Thread(target=read_in_turn) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert max(peak) <= 2 + threads - 1 and open_files_among(paths) == 2


def test_evicted_files_are_never_read_by_mistake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight threads over 16 shards with room for 2 open files: files close and reopen all the time, and a
    descriptor closed under a read (its number reused by another shard) would return another's bytes."""
    monkeypatch.setattr(threadloader._shardfiles, "MAX_OPEN_SHARDS", 2)
    payloads = [os.urandom(3000 + 17 * i) for i in range(64)]
    samples = [(f"k{i}", {"jpg": payload}) for i, payload in enumerate(payloads)]
    paths = [write_shard(tmp_path / f"{s:02d}.tar", samples[4 * s : 4 * s + 4]) for s in range(16)]
    source = TarShards(paths)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: source[(i * 5) % 64].read(), range(64 * 10)))
    assert got == [payloads[(i * 5) % 64] for i in range(64 * 10)]


@needs_proc
def test_a_loaders_files_close_with_its_source(shards: Path, blobs: list[bytes]) -> None:
    paths = [shards / f"{s:06d}.tar" for s in range(SHARDS)]
    loader = ThreadLoader(pattern(shards), batch_size=4, num_threads=2)
    for images, targets in loader:
        check_pixels(images, blobs, targets.tolist())
    assert wait_for_no_reader_threads(10) == []
    assert [open_files(path) for path in paths] == [1, 1, 1]  # kept for the next epoch
    del loader, images, targets
    gc.collect()
    assert [open_files(path) for path in paths] == [0, 0, 0]


def test_a_source_of_shards_pickles_without_its_open_files(shards: Path, blobs: list[bytes]) -> None:
    source = TarShards(pattern(shards))
    assert source[0][0].read() == blobs[0]  # a file open in this thread
    copy = pickle.loads(pickle.dumps(source))
    assert [copy[i][0].read() for i in range(N)] == blobs


# ------------------------------------------------------------------------- links, repeats and cuts


def write_members(
    path: Path, members: list[tuple[str, bytes | tuple[bytes, str]]], fmt: int = tarfile.USTAR_FORMAT
) -> Path:
    """Members in order: ``(name, data)`` a regular file, ``(name, (LNKTYPE or SYMTYPE, target))`` a link."""
    with tarfile.open(path, "w", format=fmt) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if isinstance(data, tuple):
                info.type, info.linkname = data
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return path


def test_links_that_name_no_sample_are_no_damage(tmp_path: Path, blobs: list[bytes]) -> None:
    """A link to a folder of the shard ('latest' -> 'train') was reported as damage, said to name a
    member 'the shard does not hold before it', and every failed sample of the shard carried that."""
    path = tmp_path / "folders.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        folder = tarfile.TarInfo("train")
        folder.type = tarfile.DIRTYPE
        archive.addfile(folder)
        for name, data in (("train/s0.jpg", blobs[0]), ("train/s0.cls", b"0"), ("train/s1.jpg", blobs[1])):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for name, target in (("latest", "train"), ("train/current.jpg", "s0.jpg.missing")):
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.SYMTYPE, target
            archive.addfile(link)
    source = TarShards(path)
    assert len(source.damaged) == 1  # the sample's link to nothing is still said
    assert "'train/current.jpg' is a link to 's0.jpg.missing'" in source.damaged[0]
    assert "latest" not in source.damaged[0]


def test_links_to_earlier_members_are_those_members(tmp_path: Path, blobs: list[bytes]) -> None:
    """GNU tar stores the second copy of a hard-linked file as a link: its sample was left without an
    image, and nothing said why."""
    path = write_members(
        tmp_path / "links.tar",
        [
            ("a/s0.jpg", blobs[0]),
            ("a/s0.cls", b"0"),
            ("a/s1.jpg", (tarfile.LNKTYPE, "a/s0.jpg")),  # a hard link names the member's path
            ("a/s1.cls", b"1"),
            ("a/s2.jpg", (tarfile.SYMTYPE, "s0.jpg")),  # a symbolic one, relative to its folder
            ("a/s2.cls", (tarfile.SYMTYPE, "../a/s1.cls")),
            ("a/s3.jpg", (tarfile.SYMTYPE, "/elsewhere/x.jpg")),  # not in the shard
            ("a/s3.cls", b"3"),
        ],
    )
    source = TarShards(path)
    assert len(source) == 4 and len(source.damaged) == 1
    assert "'a/s3.jpg' is a link to '/elsewhere/x.jpg'" in source.damaged[0]
    images, targets = [], []
    for item in ThreadLoader(source, batch_size=1, on_error="skip"):
        images += item[0]
        targets += item[1].tolist()
    assert targets == [0, 1, 1]
    check_pixels(images, blobs, [0, 0, 0])
    with pytest.raises(ShardError, match=r"'a/s3' has no image member .*'a/s3\.jpg' is a link"):
        source[3]


def test_links_in_a_shard_of_dot_slash_names_are_those_members(tmp_path: Path, blobs: list[bytes]) -> None:
    """``tar -cf shard.tar .`` names members ``./0.jpg``: a link's target, normalized to ``0.jpg``, was
    looked for among the names as stored, and the linked sample was left out as damaged."""
    path = write_members(
        tmp_path / "dot.tar",
        [
            ("./s0.jpg", blobs[0]),
            ("./s0.cls", b"0"),
            ("./s1.jpg", (tarfile.SYMTYPE, "s0.jpg")),
            ("./s1.cls", b"1"),
            ("./s2.jpg", (tarfile.LNKTYPE, "./s0.jpg")),
            ("./s2.cls", b"2"),
        ],
    )
    with tarfile.open(path) as archive:  # the reference: tarfile follows both links
        assert archive.extractfile("./s1.jpg").read() == archive.extractfile("./s2.jpg").read() == blobs[0]
    source = TarShards(path)
    assert len(source) == 3 and source.damaged == []
    images, targets = [], []
    for item in ThreadLoader(source, batch_size=1):
        images += item[0]
        targets += item[1].tolist()
    assert targets == [0, 1, 2]
    check_pixels(images, blobs, [0, 0, 0])


def test_a_key_repeated_with_its_extension_starts_another_sample(tmp_path: Path, blobs: list[bytes]) -> None:
    """Two archives concatenated, each numbered from 0: the second's members replaced the first's."""
    first = write_shard(
        tmp_path / "a.tar", [(f"s{i}", {"jpg": blobs[i], "cls": f"{i}".encode()}) for i in range(3)]
    )
    second = write_shard(
        tmp_path / "b.tar", [(f"s{i}", {"jpg": blobs[3 + i], "cls": f"{3 + i}".encode()}) for i in range(3)]
    )
    both = tmp_path / "both.tar"
    both.write_bytes(first.read_bytes() + second.read_bytes())
    source = TarShards(both)
    assert len(source) == 6 and source.damaged == []
    images, targets = [], []
    for batch, batch_targets in ThreadLoader(source, batch_size=4):
        images += batch
        targets += batch_targets.tolist()
    assert targets == [0, 1, 2, 3, 4, 5]
    check_pixels(images, blobs, targets)


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])
def test_a_damaged_first_header_after_a_long_name_loses_only_its_member(
    tmp_path: Path, blobs: list[bytes], fmt: int
) -> None:
    """tarfile reads the first header in its constructor, where the walk did not step over damage: the
    whole shard failed to index."""
    folder = "train/" + "x" * 110 + "/"
    members = [(f"{folder}s{i}.{ext}", data) for i in range(3) for ext, data in sample(blobs, i)[1].items()]
    path = write_members(tmp_path / "long.tar", members, fmt)
    _, data = member_offset(path, f"{folder}s0.jpg")
    with open(path, "r+b") as f:  # the checksum of the header after the long name's
        f.seek(data - tarfile.BLOCKSIZE + 148)
        f.write(b"garbage!")
    source = TarShards(path)
    assert len(source) == 3 and len(source.damaged) == 1 and "not tar headers" in source.damaged[0]
    skipping = ThreadLoader(source, batch_size=3, on_error="skip")
    assert [t for _, ts in skipping for t in ts.tolist()] == [1, 2]


def test_a_shard_cut_between_members_says_it_may_be_cut(tmp_path: Path, blobs: list[bytes]) -> None:
    """A cut at a member's header looks like the archive's end to tarfile: the members after it were
    lost and nothing said so."""
    path = write_shard(
        tmp_path / "cut.tar", [(f"s{i}", {"jpg": blobs[i], "cls": f"{i}".encode()}) for i in range(4)]
    )
    header, _ = member_offset(path, "s1.cls")
    with open(path, "r+b") as f:
        f.truncate(header)
    source = TarShards(path)
    assert len(source) == 2
    assert len(source.damaged) == 1 and f"no end-of-archive blocks after byte {header}" in source.damaged[0]
    with pytest.raises(
        ShardError, match=r"'s1' has no target member .*the shard is damaged: no end-of-archive"
    ):
        source[1]


def test_a_shard_missing_only_its_end_blocks_reads_whole(tmp_path: Path, blobs: list[bytes]) -> None:
    path = write_shard(
        tmp_path / "end.tar", [(f"s{i}", {"cls": f"{i}".encode(), "jpg": blobs[i]}) for i in range(2)]
    )
    _, data = member_offset(path, "s1.jpg")
    with open(path, "r+b") as f:  # the last member's data whole; its padding and the end blocks gone
        f.truncate(data + len(blobs[1]))
    source = TarShards(path)
    assert len(source.damaged) == 1 and "truncated" not in source.damaged[0]
    assert "no end-of-archive blocks" in source.damaged[0]
    images, targets = next(iter(ThreadLoader(source, batch_size=2)))
    assert targets.tolist() == [0, 1]
    check_pixels(images, blobs, [0, 1])


def test_auto_target_counts_a_cut_cls_member(tmp_path: Path, blobs: list[bytes]) -> None:
    """The only .cls member, cut by a truncation: "auto" resolved to no target, yet the sample still
    failed for its target."""
    path = write_shard(
        tmp_path / "cut.tar", [("s0", {"jpg": blobs[0]}), ("s1", {"jpg": blobs[1], "cls": b"1" * 700})]
    )
    _, data = member_offset(path, "s1.cls")
    with open(path, "r+b") as f:
        f.truncate(data + 100)
    source = TarShards(path)
    assert source.target == "cls"
    with pytest.raises(ShardError, match=r"target member 's1\.cls' is truncated") as info:
        source[1]
    assert info.value.member == "s1.cls"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes came in Python 3.11")
def test_a_shard_error_pickles_with_its_fields_and_notes() -> None:
    """Its notes (a traceback kept as text) were dropped by pickle and copy."""
    error = ShardError("a.tar: damaged", shard="a.tar", member="a.tar:s0.jpg")
    error.add_note("Traceback (as text; its frames released):\n  File x")
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.shard, copy.member) == (str(error), "a.tar", "a.tar:s0.jpg")
    assert copy.__notes__ == error.__notes__


def test_a_sample_without_an_image_names_the_members_it_has(tmp_path: Path, blobs: list[bytes]) -> None:
    """``a.b.jpg`` is sample ``a``'s extension ``b.jpg`` (WebDataset's key is the name up to the first
    dot, as ``tarfile`` lists it here): the error said only "no image member", naming none it found."""
    path = write_shard(tmp_path / "dotted.tar", [("a", {"b.jpg": blobs[0], "cls": b"1"}), sample(blobs, 1)])
    with tarfile.open(path) as archive:
        assert archive.getnames()[:2] == ["a.b.jpg", "a.cls"]
    source = TarShards(path)
    with pytest.raises(
        ShardError,
        match=r"'a' has no image member \(.*\); its members: a\.b\.jpg, a\.cls \(the key is the name up to",
    ):
        source[0]
    assert source[1][1] == 1
