"""benchmarks.ddp_train as the README gives it, without ``--out``: it prints its results, writes no file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_two_ranks_without_out_print_the_results_and_write_nothing(tmp_path: Path) -> None:
    pytest.importorskip("skimage", reason="the script's data set is cut from scikit-image's photos")
    work = tmp_path / "work"
    work.mkdir()
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("-m", "benchmarks.ddp_train", "--device", "cpu", "--model", "tiny", "--set", "fixed"),
        *("--count", "32", "--batch-size", "4", "--steps", "2", "--warmup", "1", "--size", "32"),
        *("--resume-steps", "2", "--data", str(tmp_path / "data")),
    ]
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        command,
        cwd=work,  # where a default output file would land
        env=os.environ | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert sorted(line.split(" on ")[0] for line in lines if line.startswith("rank ")) == [
        "rank 0/2",
        "rank 1/2",
    ]
    assert "resume check: PASS" in lines and any(line.startswith("total: ") for line in lines)
    assert list(work.iterdir()) == []
