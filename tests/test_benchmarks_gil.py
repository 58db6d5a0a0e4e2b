"""benchmarks.gil's windows: they start past a loader's start and its ramp, and an empty one says so."""

from __future__ import annotations

import argparse
import time
from collections.abc import Generator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gil, report

from .conftest import encode, photo

BATCH = 4
#: How long the fake loader's start holds its second batch back: longer than a window.
START_S = 1.5
WINDOW_S = 0.3


def _args(root: Path, background: str, *, settle: float) -> argparse.Namespace:
    return argparse.Namespace(
        root=root,
        backgrounds=[background],
        device="cpu",
        batch_size=BATCH,
        engines=["capi"],
        switch_intervals=[0.005],
        ops=["cpu"],
        seconds=WINDOW_S,
        workers=2,
        settle=settle,
    )


def _one_image(root: Path) -> Path:
    (root / "a").mkdir()
    (root / "a" / "0.jpg").write_bytes(encode(photo(8, 8)))
    return root


def slow_start(root: Path, *_: Any, **__: Any) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
    """A stream like a fresh GPU loader's: the first batch, then nothing while the CPU start drains
    (``loaders.past_the_cpu_start``), then steady batches."""
    batch = torch.zeros(BATCH, 3, 8, 8), torch.zeros(BATCH, dtype=torch.long)
    yield batch
    time.sleep(START_S)
    while True:
        time.sleep(0.005)
        yield batch


@pytest.mark.parametrize("background", ["threadloader", "dali"])
def test_the_alone_window_starts_after_the_loaders_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: str
) -> None:
    monkeypatch.setattr(gil.loaders, background, slow_start)
    (row,) = gil.measure(_args(_one_image(tmp_path), background, settle=0.0))
    assert row.background == background
    assert row.images_per_s_alone is not None
    assert row.images_per_s_alone > 0.3 * BATCH / 0.005, row  # steady batches, none of the start's stall
    assert row.images_per_s_alone == pytest.approx(row.images_alone / WINDOW_S)


#: How long the ramping loader's batches come slowly after its first: longer than a window.
RAMP_S = 1.0


def ramping(root: Path, *_: Any, **__: Any) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
    """A stream like a GPU loader's first seconds past its start: slow batches, then steady ones."""
    batch = torch.zeros(BATCH, 3, 8, 8), torch.zeros(BATCH, dtype=torch.long)
    yield batch
    ramp_ends = time.monotonic() + RAMP_S
    while True:
        time.sleep(0.1 if time.monotonic() < ramp_ends else 0.005)
        yield batch


def test_the_windows_wait_for_the_settle_past_the_loaders_ramp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gil.loaders, "threadloader", ramping)
    (row,) = gil.measure(_args(_one_image(tmp_path), "threadloader", settle=RAMP_S + 0.2))
    assert row.images_per_s_alone is not None
    # Steady batches come at up to BATCH / 0.005 a second; the ramp's at BATCH / 0.1.
    assert row.images_per_s_alone > 0.3 * BATCH / 0.005, row


def test_an_empty_window_is_said_not_reported_as_zero() -> None:
    row = gil.GilRow(
        switch_interval_ms=5,
        background="threadloader[capi]",
        ops="cuda",
        op_us_alone=1.0,
        op_us_beside=2.0,
        images_per_s_alone=0.0,
        images_per_s_beside=500.0,
        delay_us_per_image=10.0,
        images_alone=0,
        images_beside=500,
        seconds_alone=1.0,
        seconds_beside=1.0,
    )
    table = "\n".join(
        report.gil_tables(
            [report.ResultFile(Path("gil.json"), {"rows": [asdict(row) | {"slowdown": row.slowdown}]})]
        )
    )
    assert "| 2.0x | none in 1 s | 10 |" in table, table
    assert "no image loaded in its alone window" in gil._line(row)
