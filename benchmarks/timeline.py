"""What a torch.profiler trace says about loader and training kernels sharing the GPU.

Reads the chrome trace that ``torch.profiler`` exports (``prof.export_chrome_trace``): GPU activity
(``kernel``, ``gpu_memcpy``, ``gpu_memset``) carries its CUDA stream and a correlation id, and the
host call that queued it (``cuda_runtime``/``cuda_driver``) carries the same id and the launching
thread. A stream whose work was mostly queued by the training loop's thread is a training stream;
every other stream (reader threads, nvImageCodec's own) is a loader stream.

The host calls themselves are summed by name and by whose thread made them (the training loop's, the
loader's reader threads, or any other: nvImageCodec's, the driver's): a call that waits for the GPU
(``cudaFree``, ``cudaFreeHost``, a synchronize) made beside a busy step waits for the step's queued
kernels too, so its count and time per step say whether the loader's calls stall on the step.

CLI: ``python -m benchmarks.timeline TRACE.json --main-tid TID``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: Whose host calls are summed apart: the training loop's thread, the loader's readers, all others.
THREADS = ("main", "readers", "other")
THREAD_TITLES = {"main": "training thread", "readers": "reader threads", "other": "other threads"}
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")

Interval = tuple[float, float]


@dataclass
class StreamUse:
    """One CUDA stream's activity in the trace (times in microseconds)."""

    stream: int
    role: str = "loader"  # "training" | "loader"
    kernels: int = 0
    busy_us: float = 0.0
    intervals: list[Interval] = field(default_factory=list)
    queued_us: list[float] = field(default_factory=list)  # GPU start - host launch, per matched item
    by_name: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # name -> summed us
    counts: Counter[str] = field(default_factory=Counter)  # kernel (or copy) name -> items


@dataclass
class Summary:
    """The loader's GPU work against the training loop's in one profiled window."""

    streams: list[StreamUse]
    span_us: float
    busy_us: dict[str, float]  # role -> time with at least one item of that role running (union)
    overlap_us: float  # time with loader and training work both running
    queued_us: dict[str, list[float]]  # role -> launch-to-start delays
    #: (THREADS name of the calling thread, call name) -> [items, summed us]
    host_calls: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def loader_kernels(self) -> list[tuple[str, int, float]]:
        """The loader's kernels and copies by name: (name, items, summed microseconds), largest first."""
        durations: defaultdict[str, float] = defaultdict(float)
        counts: Counter[str] = Counter()
        for s in self.streams:
            if s.role == "loader":
                for name, us in s.by_name.items():
                    durations[name] += us
                counts.update(s.counts)
        return sorted(((name, counts[name], us) for name, us in durations.items()), key=lambda k: -k[2])

    def host_call_rows(self) -> list[tuple[str, list[tuple[int, float]]]]:
        """Host CUDA calls by name: (name, [(items, us) per :data:`THREADS`]), slowest first."""
        names = sorted({name for _, name in self.host_calls})
        rows = []
        for name in names:
            cells = [self.host_calls.get((threads, name), [0, 0.0]) for threads in THREADS]
            rows.append((name, [(int(items), us) for items, us in cells]))
        return sorted(rows, key=lambda row: -sum(us for _, us in row[1]))

    def text(self, *, steps: int | None = None, top: int = 12) -> str:
        """A short report: per stream, overlap and queueing per role, then the loader's kernels by name.

        Args:
            steps: Steps in the profiled window; with it, the kernels' time is also given per step.
            top: How many of the loader's kernel names to list.
        """
        lines = [f"GPU timeline over {self.span_us / 1000:.1f} ms of profiled steps"]
        lines.append("| stream | role | kernels+copies | busy ms | queued median us | queued p90 us |")
        lines.append("|---|---|---|---|---|---|")
        for s in sorted(self.streams, key=lambda s: -s.busy_us):
            median, p90 = _quantiles(s.queued_us)
            lines.append(
                f"| {s.stream} | {s.role} | {s.kernels} | {s.busy_us / 1000:.2f} | {median} | {p90} |"
            )
        loader, training = self.busy_us.get("loader", 0.0), self.busy_us.get("training", 0.0)
        share = f"{self.overlap_us / loader:.0%}" if loader else "—"
        lines += [
            "",
            f"training busy {training / 1000:.2f} ms, loader busy {loader / 1000:.2f} ms, both running "
            f"{self.overlap_us / 1000:.2f} ms ({share} of the loader's busy time)",
        ]
        for role in ("loader", "training"):
            delays = self.queued_us.get(role, [])
            median, p90 = _quantiles(delays)
            worst = f"{max(delays):,.0f}" if delays else "—"
            lines.append(
                f"{role}: queued before starting, median {median} us, p90 {p90} us, max {worst} us "
                f"({len(delays)} launches matched)"
            )
        kernels = self.loader_kernels()
        if kernels:
            per_step = f" | ms per step ({steps})" if steps else ""
            rule = "|---|---|---|" + "---|" * bool(steps)
            lines += ["", f"| loader kernel or copy | items | ms{per_step} |", rule]
            total = sum(us for _, _, us in kernels)
            for name, count, us in [*kernels[:top], ("all", sum(c for _, c, _ in kernels), total)]:
                cells = [_short(name), str(count), f"{us / 1000:.2f}"]
                if steps:
                    cells.append(f"{us / 1000 / steps:.3f}")
                lines.append("| " + " | ".join(cells) + " |")
        calls = self.host_call_rows()
        if calls:
            per = steps or 1
            unit = f"per step ({steps})" if steps else "in the window"
            header = " | ".join(f"{THREAD_TITLES[threads]}: items, ms {unit}" for threads in THREADS)
            lines += ["", f"| host CUDA call | {header} |", "|---|" + "---|" * len(THREADS)]
            for name, counted in calls[:top]:
                values = " | ".join(f"{items / per:.1f}, {us / 1000 / per:.3f}" for items, us in counted)
                lines.append(f"| {name} | {values} |")
        return "\n".join(lines)


def _short(name: str, width: int = 90) -> str:
    """A kernel's name without its return type, template arguments and parameters, for a table cell."""
    name = name.removeprefix("void ")
    for bracket in ("<", "("):
        name = name.split(bracket, 1)[0] or name
    return (name[: width - 1] + "…" if len(name) > width else name).replace("|", "/")


def _quantiles(values: Sequence[float]) -> tuple[str, str]:
    if not values:
        return "—", "—"
    ordered = sorted(values)
    return f"{statistics.median(ordered):,.0f}", f"{ordered[int(0.9 * (len(ordered) - 1))]:,.0f}"


def union_length(intervals: Iterable[Interval]) -> float:
    """Total length covered by the intervals, overlaps counted once."""
    return sum(end - start for start, end in merge(intervals))


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersection_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of the time covered by both sets of intervals."""
    first, second = merge(a), merge(b)
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        start, end = max(first[i][0], second[j][0]), min(first[i][1], second[j][1])
        total += max(0.0, end - start)
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: Sequence[dict[str, Any]], *, main_tid: int, reader_tids: Iterable[int] = ()) -> Summary:
    """Per-stream use, overlap and queueing of the GPU items in a chrome trace's ``traceEvents``.

    Args:
        events: The trace's events.
        main_tid: Native id of the training loop's thread (``threading.get_native_id()``).
        reader_tids: Native ids of the loader's reader threads (their host calls are summed apart).
    """
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    readers = set(reader_tids)
    host_calls: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES:
            tid = e.get("tid")
            threads = "main" if tid == main_tid else "readers" if tid in readers else "other"
            key = (threads, str(e.get("name")))
            totals = host_calls.setdefault(key, [0, 0.0])
            totals[0] += 1
            totals[1] += float(e.get("dur", 0.0))
    streams: dict[int, StreamUse] = {}
    by_main: Counter[int] = Counter()
    matched: Counter[int] = Counter()
    for e in events:
        if e.get("cat") not in GPU_CATEGORIES or "stream" not in e.get("args", {}):
            continue
        stream = int(e["args"]["stream"])
        use = streams.setdefault(stream, StreamUse(stream))
        start, duration = float(e["ts"]), float(e.get("dur", 0.0))
        use.kernels += 1
        use.intervals.append((start, start + duration))
        name = str(e.get("name") or e["cat"])
        use.by_name[name] += duration
        use.counts[name] += 1
        launch = launches.get(e["args"].get("correlation"))
        if launch is not None:
            matched[stream] += 1
            by_main[stream] += launch.get("tid") == main_tid
            use.queued_us.append(max(0.0, start - float(launch["ts"])))
    spans: list[Interval] = []
    by_role: dict[str, list[Interval]] = defaultdict(list)
    queued: dict[str, list[float]] = defaultdict(list)
    for stream, use in streams.items():
        use.role = "training" if matched[stream] and by_main[stream] * 2 > matched[stream] else "loader"
        use.busy_us = union_length(use.intervals)
        by_role[use.role] += use.intervals
        queued[use.role] += use.queued_us
        spans += use.intervals
    span = max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0
    return Summary(
        streams=list(streams.values()),
        span_us=span,
        busy_us={role: union_length(intervals) for role, intervals in by_role.items()},
        overlap_us=intersection_length(by_role["loader"], by_role["training"]),
        queued_us=dict(queued),
        host_calls=host_calls,
    )


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a chrome trace file."""
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def main(argv: Sequence[str] | None = None) -> None:
    """Print the summary of a trace file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--main-tid", type=int, required=True, help="native id of the training thread")
    args = parser.parse_args(argv)
    print(summarize(read_trace(args.trace), main_tid=args.main_tid).text())


if __name__ == "__main__":
    main()
