"""PyTorch Lightning with ThreadLoaders: a LightningDataModule whose train and val loaders are ThreadLoaders.

    python examples/lightning_train.py --max-steps 40 [--accelerator cpu|gpu|auto] [--batch-size 32]

A tiny CNN learns which bundled photograph a random crop came from (4 classes, JPEGs generated in
memory: no download). It prints one JSON line at the end: steps, losses, validation accuracy, images
per second and the device. Needs ``pip install lightning`` (or ``threadloader[examples]``).

What Lightning needs to know about a loader that is not a ``DataLoader``:

- ``use_distributed_sampler=False``: Lightning re-creates ``DataLoader``s with a ``DistributedSampler``
  under DDP. It leaves other iterables alone, and a ThreadLoader decides its own order (seeded shuffle
  per epoch); say so explicitly, so nothing is re-created behind your back.
- The epoch: Lightning calls ``set_epoch`` only on a ``DataLoader``'s sampler. :class:`SetEpoch` sets it
  on the ThreadLoader before each training epoch, and ``train_dataloader`` sets it when the loader is
  made (the trainer's epoch is already restored from a checkpoint then), so a resumed run shuffles as
  the original did.
- The device: batches arrive on the loader's device, already there; the loaders are built on the
  trainer's device (``trainer.strategy.root_device``), so Lightning's transfer is a no-op on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from threadloader import ThreadLoader
from threadloader.__main__ import sample_photos
from threadloader.transforms import RandomHorizontalFlip, RandomResizedCrop

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class PhotosDataModule(L.LightningDataModule):
    """Crops of the bundled photographs: ``(jpeg_bytes, photo_index)`` pairs, loaded by ThreadLoaders."""

    def __init__(self, *, batch_size: int, side: int, train_count: int, val_count: int, seed: int) -> None:
        super().__init__()
        self.batch_size, self.side, self.seed = batch_size, side, seed
        self.train_count, self.val_count = train_count, val_count
        self.train: list[tuple[bytes, int]] = []
        self.val: list[tuple[bytes, int]] = []

    def setup(self, stage: str) -> None:
        # Any map-style source works the same: a folder, tar shards ("shards/{000000..000127}.tar"), URLs.
        self.train = sample_photos(self.train_count, side=self.side * 3 // 2, seed=self.seed)
        self.val = sample_photos(self.val_count, side=self.side, seed=self.seed + 1)

    def _loader(self, source: list[tuple[bytes, int]], **options: Any) -> ThreadLoader:
        return ThreadLoader(
            source,
            batch_size=self.batch_size,
            seed=self.seed,
            device=self.trainer.strategy.root_device if self.trainer else None,
            dtype=torch.float32,
            mean=MEAN,
            std=STD,
            **options,
        )

    def train_dataloader(self) -> ThreadLoader:
        loader = self._loader(
            self.train,
            shuffle=True,
            drop_last=True,
            transform=[RandomResizedCrop(self.side, scale=(0.5, 1.0)), RandomHorizontalFlip()],
        )
        if self.trainer is not None:
            loader.set_epoch(self.trainer.current_epoch)
        return loader

    def val_dataloader(self) -> ThreadLoader:
        return self._loader(self.val, size=(self.side, self.side))


class SetEpoch(L.Callback):
    """Sets the training ThreadLoader's epoch (its shuffle order) before each epoch, as Lightning does
    for a DataLoader's sampler."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        if isinstance(loader, ThreadLoader):
            loader.set_epoch(trainer.current_epoch)


class TinyNet(L.LightningModule):
    """Three convolutions and a linear layer: enough to tell four photographs apart."""

    def __init__(self, classes: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, classes),
        )
        self.images = 0
        self.train_losses: list[float] = []
        self.val_correct = self.val_seen = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_index: int) -> torch.Tensor:
        images, targets = batch
        loss = nn.functional.cross_entropy(self(images), targets)
        self.images += len(images)
        self.train_losses.append(float(loss.detach()))
        return loss

    def on_validation_epoch_start(self) -> None:
        self.val_correct = self.val_seen = 0

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_index: int) -> None:
        images, targets = batch
        self.val_correct += int((self(images).argmax(1) == targets).sum())
        self.val_seen += len(targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains for ``--max-steps`` and prints the result as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--side", type=int, default=64, help="training image side (default 64)")
    parser.add_argument("--train-count", type=int, default=256)
    parser.add_argument("--val-count", type=int, default=64)
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    L.seed_everything(args.seed, verbose=False)
    data = PhotosDataModule(
        batch_size=args.batch_size,
        side=args.side,
        train_count=args.train_count,
        val_count=args.val_count,
        seed=args.seed,
    )
    model = TinyNet()
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator=args.accelerator,
        devices=1,
        use_distributed_sampler=False,  # a ThreadLoader orders its own samples; see the module docstring
        callbacks=[SetEpoch()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - started
    result = {
        "steps": trainer.global_step,
        "epochs": trainer.current_epoch,
        "first_loss": model.train_losses[0],
        "last_loss": model.train_losses[-1],
        "val_accuracy": model.val_correct / max(model.val_seen, 1),
        "val_samples": model.val_seen,
        "train_images_per_s": model.images / seconds,
        "device": str(trainer.strategy.root_device),
        "loaders": [type(trainer.train_dataloader).__name__, type(trainer.val_dataloaders).__name__],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
