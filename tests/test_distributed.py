"""Sharding across ranks: ``rank``/``world_size`` against ``DataLoader`` + ``DistributedSampler``.

The reference for every shard is what a DataLoader user gets: ``torch.utils.data.DistributedSampler``
with the same seed, batched by ``BatchSampler`` with the same ``drop_last``. Two real processes with
the gloo backend check that the defaults come from ``torch.distributed``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import BatchSampler, DistributedSampler

from threadloader import ThreadLoader
from threadloader import _device as device_module

from .conftest import GPU_SKIP_REASON, encode, mean_abs_diff, photo, pil_reference

N = 23
BATCH = 3
SEED = 5


@pytest.fixture(scope="module")
def samples() -> list[tuple[bytes, int]]:
    """N tiny JPEGs, target = index: the targets say which samples a rank loaded."""
    image = encode(photo(8, 8, seed=1), quality=90)
    return [(image, i) for i in range(N)]


def reference(world_size: int, rank: int, *, shuffle: bool, drop_last: bool, epoch: int) -> list[list[int]]:
    """A DataLoader user's batches of sample indices on ``rank``."""
    sampler = DistributedSampler(
        range(N), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=SEED, drop_last=drop_last
    )
    sampler.set_epoch(epoch)
    return [list(batch) for batch in BatchSampler(sampler, BATCH, drop_last)]


def epoch_targets(loader: ThreadLoader) -> list[list[int]]:
    return [targets.tolist() for _, targets in loader]


def shard_loader(samples: list[tuple[bytes, int]], **options: Any) -> ThreadLoader:
    return ThreadLoader(samples, seed=SEED, num_threads=2, device="cpu", **options)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_shards_are_distributed_samplers(
    samples: list[tuple[bytes, int]], world_size: int, drop_last: bool, shuffle: bool
) -> None:
    options = {"shuffle": shuffle, "drop_last": drop_last, "world_size": world_size}
    for rank in range(world_size):
        with shard_loader(samples, batch_size=BATCH, rank=rank, **options) as loader:
            for epoch in (0, 1):  # set_epoch reshuffles, as DistributedSampler.set_epoch
                loader.set_epoch(epoch)
                expected = reference(world_size, rank, shuffle=shuffle, drop_last=drop_last, epoch=epoch)
                assert epoch_targets(loader) == expected, f"rank {rank} of {world_size}, epoch {epoch}"
                assert len(loader) == len(expected)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_shards_are_disjoint_and_cover_the_data_set(
    samples: list[tuple[bytes, int]], world_size: int, drop_last: bool
) -> None:
    shards = []
    for rank in range(world_size):
        options = {"shuffle": True, "drop_last": drop_last, "world_size": world_size, "rank": rank}
        with shard_loader(samples, batch_size=1, **options) as loader:
            shards.append([i for batch in epoch_targets(loader) for i in batch])
    everything = [i for shard in shards for i in shard]
    if drop_last:  # cut to a multiple of world_size: disjoint, fewer than world_size left out
        assert {len(shard) for shard in shards} == {N // world_size}
        assert len(set(everything)) == len(everything) > N - world_size
    else:  # padded to a multiple of world_size: covering, only the padding repeats
        assert {len(shard) for shard in shards} == {-(-N // world_size)}
        assert set(everything) == set(range(N))
        assert len(everything) - N == -N % world_size


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank": 2, "world_size": 2}, r"rank must be in \[0, world_size\) = \[0, 2\), got rank=2"),
        ({"rank": -1, "world_size": 2}, r"rank must be in \[0, world_size\) = \[0, 2\), got rank=-1"),
        # world_size defaulted to 1 here: a range error named a world_size that was never given
        ({"rank": 1}, r"rank=1 needs world_size= too \(torch.distributed is not initialized"),
        ({"rank": 0}, None),  # rank 0 of one process: what the default means
        ({"rank": 0, "world_size": 0}, "world_size must be at least 1, got 0"),
        ({"rank": 0, "world_size": 2.0}, "world_size must be an int, got 2.0"),
        # a float world_size without rank= first got the advice to pass rank=; a str, a TypeError
        ({"world_size": 2.0}, "world_size must be an int, got 2.0"),
        ({"world_size": "2"}, "world_size must be an int, got '2'"),
        ({"rank": 1.0, "world_size": 2}, "rank must be an int, got 1.0"),
        ({"world_size": 2}, "world_size=2 needs rank= too"),
        ({"world_size": 2, "rank": 0, "shuffle": True}, "shuffle=True with world_size=2 needs seed="),
        ({"world_size": 2, "rank": 0, "sampler": [0, 1]}, "a sampler or batch_sampler is taken as it is"),
    ],
)
def test_bad_rank_or_world_size_is_refused(
    samples: list[tuple[bytes, int]], options: dict[str, Any], message: str | None
) -> None:
    if message is None:
        assert len(ThreadLoader(samples, device="cpu", batch_size=1, **options)) == len(samples)
        return
    with pytest.raises(ValueError, match=message):
        ThreadLoader(samples, device="cpu", **options)


@pytest.fixture
def fake_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two CUDA GPUs and nvImageCodec, as resolve_device sees them (none is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device_module, "_nvimgcodec_installed", lambda: True)


def test_device_none_under_torchrun_is_the_local_rank_gpu(
    monkeypatch: pytest.MonkeyPatch, fake_two_gpus: None
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device_module.resolve_device(None) == torch.device("cuda", 1)
    assert device_module.resolve_device("cuda") == torch.device("cuda", 0)  # explicit: the current one
    monkeypatch.setenv("LOCAL_RANK", "3")  # one GPU visible per process: the current one
    assert device_module.resolve_device(None) == torch.device("cuda", 0)
    monkeypatch.delenv("LOCAL_RANK")
    assert device_module.resolve_device(None) == torch.device("cuda", 0)


@pytest.mark.parametrize("local_rank", [" 1", "1\n", "01"])
def test_a_local_rank_is_read_as_the_integer_it_spells(
    monkeypatch: pytest.MonkeyPatch, fake_two_gpus: None, local_rank: str
) -> None:
    """A space or newline around it put every rank on GPU 0; "01" raised about 'cuda:01', never passed."""
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert device_module.resolve_device(None) == torch.device("cuda", 1)


@pytest.mark.parametrize("local_rank", ["abc", "-1", "1.0", "\u00b2"])
def test_a_local_rank_that_is_not_one_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, fake_two_gpus: None, local_rank: str
) -> None:
    """They were the current GPU (GPU 0 for every rank), or for a superscript two int()'s error."""
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(ValueError, match=rf"^LOCAL_RANK must be .* got {re.escape(repr(local_rank))}; "):
        device_module.resolve_device(None)


def _rank_main(rank: int, world_size: int, init: str, samples: list[tuple[bytes, int]], out: str) -> None:
    """One process of the job: defaults from torch.distributed, its own shard, a state of its own."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        with ThreadLoader(
            samples, batch_size=BATCH, shuffle=True, seed=SEED, num_threads=2, device="cpu"
        ) as loader:
            batches = epoch_targets(loader)
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, batches)
            states: list[Any] = [None] * world_size
            dist.all_gather_object(states, loader.state_dict())
            try:
                loader.load_state_dict(states[1 - rank])
                refused = ""
            except ValueError as exc:
                refused = str(exc)
            result = {
                "rank": loader.rank,
                "world_size": loader.world_size,
                "all": gathered,
                "refused": refused,
            }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_world_size_one_loads_everything_on_any_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under an initialized process group, world_size=1 (a validation loader that every rank runs over
    # the whole set) must not take this process's rank, which is out of range for one process.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    with ThreadLoader(list(range(10)), batch_size=5, world_size=1, device="cpu") as loader:
        assert (loader.state_dict()["arguments"]["rank"], len(loader)) == (0, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        ThreadLoader(list(range(10)), batch_size=5, world_size=1, rank=1, device="cpu")


def test_two_processes_take_rank_and_world_size_from_gloo(
    samples: list[tuple[bytes, int]], tmp_path: Path
) -> None:
    context = mp.start_processes(
        _rank_main,
        args=(2, f"file://{tmp_path / 'rendezvous'}", samples, str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 60
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the two ranks did not finish within 60 s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (result["rank"], result["world_size"]) == (rank, 2)
        assert result["all"] == [reference(2, r, shuffle=True, drop_last=False, epoch=0) for r in (0, 1)]
        assert f"rank: the state's {1 - rank}, this loader's {rank}" in result["refused"]
    gathered = json.loads((tmp_path / "rank0.json").read_text())["all"]
    shards = [{i for batch in gathered[r] for i in batch} for r in (0, 1)]
    assert shards[0] | shards[1] == set(range(N)) and len(shards[0] & shards[1]) == 1  # one padded sample


def test_ddp_training_script_runs_two_cpu_ranks_and_its_resume_check_passes(tmp_path: Path) -> None:
    pytest.importorskip("skimage", reason="the script's data set is cut from scikit-image's photos")
    out = tmp_path / "ddp.json"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("-m", "benchmarks.ddp_train", "--device", "cpu", "--model", "tiny", "--set", "fixed"),
        *("--count", "48", "--batch-size", "4", "--steps", "3", "--warmup", "1", "--size", "32"),
        *("--data", str(tmp_path / "data"), "--out", str(out)),
    ]
    result = subprocess.run(
        command,
        cwd=Path(__file__).resolve().parent.parent,
        env=os.environ | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["resume_check"] == "PASS"
    assert [rank["rank"] for rank in report["ranks"]] == [0, 1]
    assert all(rank["images_per_s"] > 0 and rank["resume"]["steps_compared"] == 5 for rank in report["ranks"])
    assert [rank["batches_per_epoch"] for rank in report["ranks"]] == [6, 6]  # 48 images, 2 ranks of 4
    assert "resume check: PASS" in result.stdout


def _second_gpu_reason() -> str | None:
    if GPU_SKIP_REASON is not None:
        return GPU_SKIP_REASON
    return None if torch.cuda.device_count() >= 2 else f"needs 2 GPUs, {torch.cuda.device_count()} here"


two_gpus = pytest.mark.skipif(_second_gpu_reason() is not None, reason=str(_second_gpu_reason()))


@pytest.mark.gpu
@two_gpus
def test_batch_decoder_and_loader_on_the_last_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from threadloader import BatchDecoder

    last = torch.device("cuda", torch.cuda.device_count() - 1)
    blobs = [encode(photo(96 + 8 * i, 128, seed=400 + i), quality=90) for i in range(6)]
    references = [pil_reference(data) for data in blobs]
    torch.cuda.synchronize(0)
    on_first = torch.cuda.memory_allocated(0)
    with BatchDecoder(device=f"cuda:{last.index}", max_batch=4, max_delay_ms=1) as decoder:
        decoded = decoder.decode_many(blobs)
    with ThreadLoader(list(zip(blobs, range(6), strict=True)), batch_size=4, device=last) as loader:
        batches = [(images, targets.tolist()) for images, targets in loader]
    assert torch.cuda.memory_allocated(0) == on_first  # nothing of either was put on the first GPU
    for image, reference in zip(decoded, references, strict=True):
        assert image.device == last and mean_abs_diff(image, reference) <= 1.0
    assert [targets for _, targets in batches] == [[0, 1, 2, 3], [4, 5]]
    for batch, targets in batches:
        for image, index in zip(batch, targets, strict=True):
            assert image.device == last and mean_abs_diff(image, references[index]) <= 1.0
    monkeypatch.setenv("LOCAL_RANK", str(last.index))
    with ThreadLoader(blobs, batch_size=4) as loader:
        assert loader.device == last
        assert all(image.device == last for batch, _ in loader for image in batch)


@pytest.mark.gpu
@two_gpus
def test_random_crops_are_the_same_on_every_gpu() -> None:
    from threadloader.transforms import RandomHorizontalFlip, RandomResizedCrop

    blobs = [(encode(photo(200, 240 + 8 * i, seed=500 + i), quality=90), i) for i in range(12)]
    runs = []
    for index in (0, torch.cuda.device_count() - 1):
        options = {"batch_size": 4, "shuffle": True, "seed": 3, "device": f"cuda:{index}"}
        with ThreadLoader(
            blobs, transform=[RandomResizedCrop(64), RandomHorizontalFlip()], **options
        ) as loader:
            runs.append([(images.cpu(), targets.tolist()) for images, targets in loader])
    assert [targets for _, targets in runs[0]] == [targets for _, targets in runs[1]]
    for (a, _), (b, _) in zip(runs[0], runs[1], strict=True):
        assert (a.int() - b.int()).abs().max() <= 1
