"""The examples run: the notebook (executed by nbclient) and the Lightning script, on the CPU.

CI installs the ``examples`` extra so neither is skipped there; elsewhere each test is skipped, with
the reason, when its packages are missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
# The examples import this checkout's threadloader, whatever else is installed.
ENV = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def test_notebook_executes_on_the_cpu(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat", reason="the notebook test needs pip install -e '.[examples]'")
    nbclient = pytest.importorskip("nbclient", reason="the notebook test needs pip install -e '.[examples]'")
    pytest.importorskip("ipykernel", reason="the notebook test needs pip install -e '.[examples]'")
    pytest.importorskip("matplotlib", reason="the notebook test needs pip install -e '.[examples]'")
    notebook = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute(env=ENV | {"CUDA_VISIBLE_DEVICES": ""})  # raises on a failing cell
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    text = "".join(output.get("text", "") for output in outputs)
    assert "device: cpu" in text
    assert "ThreadLoader" in text and "DataLoader, 2 workers, Pillow" in text and "images/s" in text
    assert "pixel difference: 0.00" in text
    assert "TarShards(4 shards, samples=512" in text
    assert any("image/png" in output.get("data", {}) for output in outputs)  # the grid of a batch


def test_lightning_example_trains_a_few_steps_on_the_cpu() -> None:
    pytest.importorskip("lightning", reason="the Lightning example needs pip install -e '.[examples]'")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_train.py"), "--max-steps", "12", "--accelerator", "cpu"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 12 and summary["device"] == "cpu"
    assert summary["loaders"] == ["ThreadLoader", "ThreadLoader"]
    assert summary["val_samples"] == 64  # validation ran over the whole val loader
    # It learns: 4 classes, so chance is 0.25 (seeded: the same numbers every run on the CPU).
    assert summary["val_accuracy"] > 0.5 and summary["last_loss"] < summary["first_loss"]
