"""The examples run: the notebook (executed by nbclient) and the Lightning script, on the CPU.

CI installs the ``examples`` extra so neither is skipped there; elsewhere each test is skipped, with
the reason, when its packages are missing.
"""

from __future__ import annotations

import json
import multiprocessing
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
    assert "ThreadLoader" in text and "images/s" in text
    # The kernel is this interpreter: forked DataLoader workers (Linux before Python 3.14) inherit the
    # notebook's class; forkserver (3.14's default) or spawn workers cannot load it, and the row says so.
    method = multiprocessing.get_context().get_start_method()
    if method == "fork":
        assert "DataLoader, 2 workers, Pillow" in text
    else:
        assert f"DataLoader left out: workers started by {method!r} cannot load PilCrops" in text
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


def test_each_lightning_epoch_reads_its_own_epochs_order(tmp_path: Path) -> None:
    """Lightning calls iter() on the train loader once to check it and drops it: that pass counted as
    epoch 0, so Lightning's epoch 0 read epoch 1's order and crops (and epoch 1 again after it). The
    reference: a second loader with set_epoch(e) before each pass, as a plain loop writes it."""
    pytest.importorskip("lightning", reason="the Lightning example needs pip install -e '.[examples]'")
    script = tmp_path / "epochs.py"
    script.write_text(
        """
import io, json, sys, warnings
import lightning as L, numpy as np, torch
from PIL import Image
sys.path.insert(0, sys.argv[1])
from lightning_train import SetEpoch
from threadloader import ThreadLoader

warnings.simplefilter("ignore")
def jpeg(i):
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(out, "JPEG")
    return out.getvalue()
samples = [(jpeg(i), i) for i in range(12)]
make = lambda: ThreadLoader(samples, batch_size=4, shuffle=True, seed=0, device="cpu")
seen = {}
class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
    def training_step(self, batch, index):
        seen.setdefault(self.current_epoch, []).extend(batch[1].tolist())
        return (self.w - 1).pow(2).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
class Data(L.LightningDataModule):
    def train_dataloader(self):
        loader = make()
        loader.set_epoch(self.trainer.current_epoch)
        return loader
trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                    callbacks=[SetEpoch()])
trainer.fit(Module(), datamodule=Data())
reference = make()
expected = []
for epoch in range(3):
    reference.set_epoch(epoch)
    expected.append([t for _, targets in reference for t in targets.tolist()])
print(json.dumps({"seen": [seen[e] for e in range(3)], "expected": expected}))
"""
    )
    result = subprocess.run(
        [sys.executable, str(script), str(EXAMPLES)], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    orders = json.loads(result.stdout.strip().splitlines()[-1])
    assert orders["seen"] == orders["expected"]
    assert orders["expected"][0] != orders["expected"][1]  # the epochs' orders differ
