"""Loaders built in turn run on the same CUDA streams, and what torch keeps per stream stays bounded.

Torch keeps per stream the caching allocator's freed blocks and, per cuBLAS handle that ran a matrix
product on it, a 32 MiB workspace (Hopper) for the life of the process. Without Triton the resize runs
as matrix products, and before the readers' streams were leased, each loader built on two fresh
streams added 64 MiB of workspaces that no later loader used: one suite's process had 628-756 MiB of
them when the prefetch memory test cleared them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from threadloader import ThreadLoader, _handoff
from threadloader.transforms import Transform

from .conftest import crops_script, encode, photo, run_script

pytestmark = pytest.mark.gpu


class _NoteStream(Transform):
    """Identity that records the CUDA stream its kernels would be queued on."""

    def __init__(self) -> None:
        self.streams: set[int] = set()

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        self.streams.add(torch.cuda.current_stream(images.device).cuda_stream)
        return images


def test_a_loader_built_after_another_closed_runs_on_its_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pool of the test's own: a loader of an earlier test collected meanwhile gives streams back too.
    monkeypatch.setattr(_handoff, "STREAMS", _handoff.StreamPool())
    samples = [(encode(photo(96, 128, seed=i)), i) for i in range(16)]
    leased, seen = [], []
    for _ in range(3):
        note = _NoteStream()
        with ThreadLoader(
            samples, batch_size=4, size=(64, 64), device="cuda", num_threads=2, transform=note
        ) as loader:
            leased.append({reader.stream.cuda_stream for reader in loader._runtime.readers if reader.stream})
            for _batch in loader:
                pass
        seen.append(note.streams)
    assert len(leased[0]) == 2 and leased[1] == leased[0] == leased[2], leased
    # The kernels ran on those streams.
    assert all(streams and streams <= leased[0] for streams in seen), (seen, leased)


_SCRIPT = (
    r"""
import os, sys
sys.modules["triton"] = None  # the resize as matrix products: cuBLAS, its workspaces
# No warm-up: its threads would be more cuBLAS handles (a workspace per handle and stream).
os.environ["THREADLOADER_WARMUP"] = "0"
"""
    + crops_script(32)
    + r"""
import gc, json

import torch

from threadloader import ThreadLoader

MiB = 2**20
torch.zeros(1, device="cuda")
allocated, reserved = [], []
for _ in range(8):
    with ThreadLoader(samples, batch_size=8, size=(64, 64), device="cuda", num_threads=2) as loader:
        for _batch in loader:
            pass
    del loader, _batch
    gc.collect()
    torch.cuda.synchronize()
    allocated.append(torch.cuda.memory_allocated() / MiB)  # the workspaces are allocations
    reserved.append(torch.cuda.memory_reserved() / MiB)
print(json.dumps({"allocated": allocated, "reserved": reserved}))
"""
)


def test_loaders_built_in_turn_without_triton_leave_no_new_cublas_workspaces(tmp_path: Path) -> None:
    result = run_script(tmp_path, _SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(measured))  # the figures, for the record (pytest -s)
    allocated, reserved = measured["allocated"], measured["reserved"]
    # Two readers on two streams: which cuBLAS handle a reader thread gets varies (a third while an
    # ended thread has not yet let its own go), so a few (handle, stream) pairs, up to four more
    # workspaces than the first loader's. Fresh streams made two new workspaces (64 MiB) per loader,
    # to the last: 448 MiB over seven.
    assert allocated[-1] - allocated[0] < 4 * 32 + 16, measured
    assert reserved[-1] - reserved[0] < 4 * 32 + 16, measured
