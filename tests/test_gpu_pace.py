"""The GPU decoder's CPU cost after its start, and backend="auto"'s choice, on a real GPU.

A fresh process each (the Decoder pools and nvImageCodec's start are process-wide): what the start-up
leaves behind must not cost the rest of the run. nvImageCodec 0.9 sizes the JPEG engine's share of a
call from a Decoder's first call; when that was the warm-up's four photos, every later batch of 64 went
mostly to nvJPEG's CUDA decoder, whose CPU threads then kept about four cores busy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .conftest import run_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread CPU times from /proc"),
]

_SCRIPT = r'''
import io, json, os, sys, time
from importlib import resources

import torch
from PIL import Image

from threadloader import ThreadLoader


def thread_cpu():
    """CPU seconds of each of this process's threads, by name, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            stat = open(f"/proc/self/task/{tid}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return seconds


def nvimgcodec_seconds(before, after):
    """CPU seconds nvImageCodec's own threads used between two readings."""
    return sum(
        cpu - before.get(tid, (name, 0.0))[1]
        for tid, (name, cpu) in after.items()
        if name.startswith("[NVIMGCODEC]")
    )


photo = Image.open(resources.files("threadloader") / "_sample" / "astronaut.jpg").convert("RGB")
samples = []
for i in range(256):  # 256x256 crops, baseline 4:2:0, as the JPEG engine takes them
    left, top = (i * 7) % 256, (i * 11) % 256
    out = io.BytesIO()
    photo.crop((left, top, left + 256, top + 256)).save(out, "JPEG", quality=90)
    samples.append((out.getvalue(), i))

loader = ThreadLoader(samples, batch_size=64, backend=sys.argv[1], size=(256, 256), shuffle=True, seed=0)
def epochs():
    while True:
        yield from loader


stream = epochs()
next(stream)
while True:  # past the start: nvImageCodec started, the batches Pillow decoded meanwhile consumed
    started = loader.stats().started_on_cpu
    for _ in range(4 * 4):
        next(stream)
    torch.cuda.synchronize()
    if loader.stats().started_on_cpu == started:
        break
time.sleep(0.3)  # the readers fill the window, then wait
idle_before, cpu_before = thread_cpu(), time.process_time()
time.sleep(1.0)
idle_seconds = time.process_time() - cpu_before
before = thread_cpu()
images = 0
for _ in range(32):
    batch, _ = next(stream)
    images += batch.shape[0]
torch.cuda.synchronize()
after = thread_cpu()
print(json.dumps({
    "idle_seconds": idle_seconds,
    "nvimgcodec_us_per_image": 1e6 * nvimgcodec_seconds(before, after) / images,
    "pace": loader._producer._decoder.pace(),
}))
loader.close()
'''


def _run(tmp_path: Path, backend: str) -> dict[str, object]:
    result = run_script(tmp_path, _SCRIPT, backend)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_jpeg_engine_decodes_whole_batches_after_the_start_and_nothing_burns(tmp_path: Path) -> None:
    """With ``backend="all"`` the JPEG engine takes every image of a 64-image call: nvImageCodec's CPU
    threads stay nearly idle (the warm-up's small first call left them decoding most images: 350 us of
    their CPU an image, measured), and an idle second after the start costs the process nothing."""
    measured = _run(tmp_path, "all")
    assert measured["nvimgcodec_us_per_image"] < 50, measured
    assert measured["idle_seconds"] < 0.1, measured


def test_auto_measures_both_configurations_and_keeps_choosing(tmp_path: Path) -> None:
    """``backend="auto"`` has timed calls of both the JPEG engine's configuration and the CUDA
    decoder's by the end of the run (each tried at least once, then again once its figure is old)."""
    measured = _run(tmp_path, "auto")
    pace = measured["pace"]
    assert isinstance(pace, dict) and set(pace) == {"all", "cuda"}, measured
    assert all(0 < seconds < 0.01 for seconds in pace.values()), measured
