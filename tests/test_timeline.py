"""The GPU timeline summary of benchmarks.timeline, on a hand-written trace with known answers."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.timeline import intersection_length, summarize, union_length

MAIN, READER = 100, 200


def _launched(
    correlation: int, *, by: int, at: float, start: float, dur: float, stream: int, name: str = "k"
) -> list[dict[str, Any]]:
    """A launch by thread ``by`` at ``at`` and its kernel on ``stream`` from ``start`` for ``dur``."""
    launch = {
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": at,
        "dur": 2,
        "tid": by,
        "args": {"correlation": correlation},
    }
    kernel = {
        "cat": "kernel",
        "name": name,
        "ts": start,
        "dur": dur,
        "tid": stream,
        "args": {"correlation": correlation, "stream": stream},
    }
    return [launch, kernel]


def test_union_and_intersection() -> None:
    assert union_length([(0, 10), (5, 15), (20, 25)]) == 20
    assert union_length([(0, 10), (2, 5)]) == 10  # one inside another
    assert intersection_length([(0, 10), (20, 30)], [(5, 25)]) == 10
    assert intersection_length([(0, 1)], []) == 0


def test_streams_roles_overlap_and_queueing() -> None:
    events = [
        # training stream 7: kernels 0-100 and 100-200, launched by the main thread at 0 and 10
        *_launched(1, by=MAIN, at=0, start=0, dur=100, stream=7),
        *_launched(2, by=MAIN, at=10, start=100, dur=100, stream=7),
        # reader stream 20: launched at 50 and 60, started at 150 (queued 100) and 250 (queued 190)
        *_launched(3, by=READER, at=50, start=150, dur=100, stream=20),
        *_launched(4, by=READER, at=60, start=250, dur=50, stream=20),
        # a decoder's own stream with no launch in the trace: loader, not matched
        {"cat": "gpu_memcpy", "ts": 400, "dur": 10, "args": {"stream": 30}},
        {"cat": "cpu_op", "ts": 0, "dur": 500, "tid": MAIN, "args": {}},
    ]
    summary = summarize(events, main_tid=MAIN)
    roles = {s.stream: s.role for s in summary.streams}
    assert roles == {7: "training", 20: "loader", 30: "loader"}
    assert summary.busy_us == {"training": 200, "loader": 160}
    assert summary.overlap_us == 50  # loader 150-300 against training 0-200
    assert summary.span_us == 410
    assert sorted(summary.queued_us["loader"]) == [100, 190]
    assert sorted(summary.queued_us["training"]) == [0, 90]
    text = summary.text()
    assert "both running 0.05 ms (31% of the loader's busy time)" in text
    assert "| 20 | loader | 2 | 0.15 |" in text


def test_a_stream_launched_mostly_by_readers_is_the_loaders() -> None:
    events = [
        *_launched(1, by=MAIN, at=0, start=0, dur=1, stream=9),
        *_launched(2, by=READER, at=0, start=1, dur=1, stream=9),
        *_launched(3, by=READER, at=0, start=2, dur=1, stream=9),
    ]
    assert [s.role for s in summarize(events, main_tid=MAIN).streams] == ["loader"]


def test_the_loaders_kernels_by_name_per_step() -> None:
    resize = "void resize<float, 3>(Params, int)"
    events = [
        *_launched(1, by=MAIN, at=0, start=0, dur=500, stream=7, name="gemm"),  # training: not listed
        *_launched(2, by=READER, at=0, start=10, dur=100, stream=20, name=resize),
        *_launched(3, by=READER, at=0, start=200, dur=50, stream=21, name=resize),
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 300, "dur": 10, "args": {"stream": 30}},
    ]
    summary = summarize(events, main_tid=MAIN)
    assert summary.loader_kernels() == [(resize, 2, 150), ("Memcpy HtoD", 1, 10)]
    text = summary.text(steps=2)
    assert "| resize | 2 | 0.15 | 0.075 |" in text
    assert "| Memcpy HtoD | 1 | 0.01 | 0.005 |" in text
    assert "| all | 3 | 0.16 | 0.080 |" in text
    assert "gemm" not in text
    assert "| resize | 2 | 0.15 |" in summary.text()  # without steps, no per-step column


@pytest.mark.parametrize("events", [[], [{"cat": "cpu_op", "ts": 0, "dur": 1, "args": {}}]])
def test_no_gpu_activity(events: list[dict[str, Any]]) -> None:
    summary = summarize(events, main_tid=MAIN)
    assert summary.streams == [] and summary.span_us == 0 and summary.overlap_us == 0


def test_host_calls_by_name_and_thread_per_step() -> None:
    def call(name: str, by: int, dur: float) -> dict[str, Any]:
        return {"cat": "cuda_runtime", "name": name, "ts": 0, "dur": dur, "tid": by, "args": {}}

    other = 300  # one of nvImageCodec's threads
    events = [
        *_launched(1, by=MAIN, at=0, start=0, dur=10, stream=7),  # a cudaLaunchKernel of 2 us
        call("cudaFree", other, 3000),
        call("cudaFree", other, 1000),
        call("cudaHostAlloc", READER, 700),
        call("cudaStreamSynchronize", MAIN, 500),
        call("cudaStreamSynchronize", other, 100),
        {"cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 9000, "tid": READER, "args": {}},
    ]
    summary = summarize(events, main_tid=MAIN, reader_tids=[READER])
    assert summary.host_call_rows() == [
        ("cudaFree", [(0, 0.0), (0, 0.0), (2, 4000.0)]),
        ("cudaHostAlloc", [(0, 0.0), (1, 700.0), (0, 0.0)]),
        ("cudaStreamSynchronize", [(1, 500.0), (0, 0.0), (1, 100.0)]),
        ("cudaLaunchKernel", [(1, 2.0), (0, 0.0), (0, 0.0)]),
    ]
    text = summary.text(steps=2)
    assert "| cudaFree | 0.0, 0.000 | 0.0, 0.000 | 1.0, 2.000 |" in text
    assert "| cudaHostAlloc | 0.0, 0.000 | 0.5, 0.350 | 0.0, 0.000 |" in text
    assert "| cudaStreamSynchronize | 0.5, 0.250 | 0.0, 0.000 | 0.5, 0.050 |" in text
    assert "aten::add" not in text
    # without the readers' ids, their calls count as other threads'
    assert summarize(events, main_tid=MAIN).host_call_rows()[1] == (
        "cudaHostAlloc",
        [(0, 0.0), (0, 0.0), (1, 700.0)],
    )
