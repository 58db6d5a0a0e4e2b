"""The tables and charts of benchmark results: docs/benchmarks.md, its charts and the docs' figures.

``python -m benchmarks.report`` rewrites docs/benchmarks.md (the prose of ``report_page.md``, a
``{{name}}`` line where each section's table goes), its charts and the generated blocks of README.md
and docs/guide.md (between ``<!-- report:NAME -->`` markers) from ``docs/results/*.json``; ``--check``
fails where they differ from what the JSON gives. The entry points write a run's own ``.md`` and
``.png`` with the same functions, from the JSON they write.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
TEMPLATE = Path(__file__).with_name("report_page.md")
BLOCK = re.compile(r"(<!-- report:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /report -->)", re.DOTALL)
"""A generated block in README.md or docs/guide.md; its name is a key of :data:`SNIPPETS`."""

LOADER_LABELS = {
    "fixed_input": "fixed input",
    "threadloader": "ThreadLoader",
    "spawn_collate_nvimgcodec": "DataLoader, spawned nvImageCodec workers",
    "pil_dataloader": "DataLoader, Pillow in forked workers",
    "dali": "DALI",
}
KIND_LABELS = {"graphed": "whole step in a CUDA graph"}
SET_ORDER = ("fixed", "varied", "augment")
"""Throughput files in the order of their work: plain decoding, then resizing, then augmenting."""

Json = dict[str, Any]
Draw = Callable[[Path], None]


@dataclass(frozen=True)
class Spread:
    """A measure over repeats or windows: the median, min and max."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        return Spread(statistics.median(values), min(values), max(values)) if values else None

    def cell(self, spec: str) -> str:
        """The median, and the range where the values differ."""
        if self.low == self.high:
            return format(self.median, spec)
        return f"{self.median:{spec}} ({self.low:{spec}}-{self.high:{spec}})"


@dataclass(frozen=True)
class ResultFile:
    """One result's JSON file: where it is and what it holds."""

    path: Path
    data: Json

    @property
    def hardware(self) -> Json:
        return self.data.get("hardware") or {}

    @property
    def config(self) -> Json:
        return self.data.get("config") or {}

    @property
    def rows(self) -> list[Json]:
        return self.data.get("rows") or []

    @property
    def interpreter(self) -> str:
        """``Python 3.12.3``, or ``Python 3.13.5t, GIL off``: what tells runs on one machine apart."""
        off = self.hardware.get("gil") is False
        return f"Python {self.hardware.get('python', '?')}" + (", GIL off" if off else "")


def load(results: Path, pattern: str) -> list[ResultFile]:
    """The files matching ``pattern``: by set, then the plain name (``training.json``) first."""

    def order(path: Path) -> tuple[int, int, str]:
        rank = next((i for i, name in enumerate(SET_ORDER) if path.stem.endswith(name)), len(SET_ORDER))
        return rank, len(path.stem), path.name

    return [ResultFile(p, json.loads(p.read_text())) for p in sorted(results.glob(pattern), key=order)]


# --- cells, tables, charts --------------------------------------------------------------------------


def _link(path: Path) -> str:
    """``path`` as docs/benchmarks.md links it."""
    return path.relative_to(DOC.parent).as_posix() if path.is_relative_to(DOC.parent) else path.as_posix()


def provenance(result: ResultFile) -> list[str]:
    """Which file, which machine, which command, and the file's note."""
    hw = result.hardware
    gpu = f"{hw['gpu']} ({hw.get('gpu_memory_gb')} GB), CUDA {hw.get('cuda')}" if hw.get("gpu") else "no GPU"
    versions = [("torch", "torch"), ("nvimgcodec", "nvImageCodec"), ("pillow", "Pillow")]
    machine = [gpu, f"{hw.get('cpus_usable', hw.get('cpus'))} CPUs", result.interpreter]
    machine += [f"{name} {hw[key]}" for key, name in versions if hw.get(key)]
    command = result.data.get("command", "(command not recorded)")
    lines = [f"[`{_link(result.path)}`]({_link(result.path)}): {', '.join(machine)}.", "", "```bash", command]
    return [*lines, "```", "", *([result.data["note"], ""] if result.data.get("note") else [])]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table; a ``|`` in a cell would split it, so it becomes ``/``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return [*lines, *("| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows), ""]


def number(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else format(value, spec) + suffix


def spread(row: Json, measure: str) -> Spread | None:
    """A row's measure: a ``benchmarks.run`` row's median and range over repeats, a training row's windows."""
    value = row.get(measure)
    if value is None or isinstance(value, list):
        return Spread.of(value or [])
    low, high = (row.get(end, {}).get(measure, value) for end in ("min", "max"))
    return Spread(value, low, high)


def cell(spread: Spread | None, spec: str) -> str:
    """The median, with the range where the values differ; "—" for nothing measured."""
    return "—" if spread is None else spread.cell(spec)


def note(row: Json) -> str:
    return row.get("reason", "") if row.get("status", "ok") == "ok" else f"{row['status']}: {row['reason']}"


def no_results(pattern: str) -> list[str]:
    return [f"No results yet (`docs/results/{pattern}`).", ""]


def figure(rows: int, panels: int) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(7 * panels, 10), 1.2 + 0.4 * max(rows, 1)), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def bars(ax: Any, labels: list[str], found: list[Spread | None], title: str, colors: list[str] | str) -> None:
    """Horizontal bars of medians with min-max whiskers, the first label on top."""
    spreads = [s or Spread(0.0, 0.0, 0.0) for s in found]
    medians = [s.median for s in spreads]
    whiskers = [[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]]
    drawn = ax.barh(labels, medians, xerr=whiskers, color=colors, capsize=3)
    ax.bar_label(drawn, fmt="{:,.0f}" if max(medians, default=0) >= 100 else "{:.1f}", padding=3, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.invert_yaxis()
    ax.margins(x=0.2)


def save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=100, metadata={"Software": None})


def image(results: Path, name: str, alt: str, draw: Draw | None) -> list[str]:
    """The chart's link; ``draw`` writes it first, unless None (``--check`` compares text only)."""
    path = results / f"{name}.png"
    if draw is not None:
        draw(path)
    return [f"![{alt}]({_link(path)})", ""]


# --- benchmarks.run: throughput, and memory and start-up --------------------------------------------


def set_title(result: ResultFile) -> str:
    """What a ``benchmarks.run`` result loaded, from its config."""
    config = result.config
    size = config.get("output_size", "?")
    if config.get("augment"):
        what = f"varied set, RandomResizedCrop({size.split('x')[0]}) + flip + normalize"
    elif config.get("set") == "fixed":
        what = f"fixed set, {size}"
    else:
        what = f"varied set resized to {size}" + (", normalized" if config.get("normalize") else "")
    return f"{what}, batch {next((r['batch_size'] for r in result.rows), '?')}"


def short_title(result: ResultFile) -> str:
    """``fixed``, ``varied`` or ``augment``: a chart's label for a ``benchmarks.run`` result."""
    return "augment" if result.config.get("augment") else str(result.config.get("set", "?"))


TAGS = {"busy": "one core busy"}
"""Words for a file's tag (``cpu-throughput-one-core-busy.json``), where its name alone says too little."""


def tag(result: ResultFile) -> str:
    """What sets a file apart from others of its kind: the last word of its name (``idle``, ``3.13t``)."""
    word = result.path.stem.rsplit("-", 1)[-1]
    return TAGS.get(word, word)


def file_labels(found: list[ResultFile], title: Callable[[ResultFile], str]) -> list[str]:
    """Each file's ``title``; where two share one, with its GPU if that tells them apart, else its tag."""
    names = [title(result) for result in found]
    if len(set(names)) == len(names):
        return names
    if len({gpu_name(result) for result in found}) > 1:
        on_gpus = [f"{name}, {gpu_name(result)}" for name, result in zip(names, found, strict=True)]
        if len(set(on_gpus)) == len(on_gpus):
            return on_gpus
    return [f"{name}, {tag(result)}" for name, result in zip(names, found, strict=True)]


def throughput_tables(
    found: list[ResultFile], *, page: bool = False, title: Callable[[ResultFile], str] = set_title
) -> list[str]:
    """One table of every file's rows: img/s, ms per batch, CPU cores (and CPU ms per image on a CPU), vs PIL.

    A column for the set (each file's ``title``) where there are several files. A run's own page: the set
    as the heading, the provenance above the table; ``page`` (a section of docs/benchmarks.md): the
    table, then each file's provenance.
    """
    if not found:
        return []
    several = len(found) > 1
    cpu_time = any(result.config.get("device") == "cpu" for result in found)
    ratio = any(r.get("ratio_vs_pil") is not None for result in found for r in result.rows)
    header = ["set"] * several + ["loader", "img/s, median (min-max)", "ms/batch", "CPU cores"]
    header += ["CPU ms/image"] * cpu_time + ["vs PIL"] * ratio + ["note"]
    body = []
    for result, label in zip(found, file_labels(found, title), strict=True):
        for r in result.rows:
            cells = [label] * several + [r["name"], cell(spread(r, "images_per_s"), ",.0f")]
            cells += [number(r.get("ms_per_batch"), ".1f"), number(r.get("cpu_cores"), ".1f")]
            if cpu_time:
                per_image = [
                    1000 * x["cpu_cores"] / x["images_per_s"]
                    for x in r.get("repeats", [])
                    if x.get("images_per_s") and x.get("cpu_cores") is not None
                ]
                cells.append(cell(Spread.of(per_image), ".1f"))
            cells += [number(r.get("ratio_vs_pil"), ".2f", "x")] * ratio + [note(r)]
            body.append(cells)
    sources = [line for result in found for line in provenance(result)]
    if page:
        return [*table(header, body), *sources]
    heading = [] if several else [f"### {set_title(found[0])}", ""]
    return [*heading, *sources, *table(header, body)]


def throughput_chart(found: list[ResultFile], title: str) -> Draw:
    def draw(path: Path) -> None:
        fig = figure(sum(len(r.rows) + 2 for r in found), 1)  # one panel above the other
        axes = fig.subplots(len(found), 1, squeeze=False, height_ratios=[len(r.rows) + 1 for r in found])
        titles = file_labels(found, set_title)
        for ax, result, panel in zip(axes[:, 0], found, titles, strict=True):
            ok = [r for r in result.rows if r.get("images_per_s") is not None]
            bars(ax, [r["name"] for r in ok], [spread(r, "images_per_s") for r in ok], panel, "tab:blue")
        fig.suptitle(f"{title}: median over processes, whiskers min to max")
        save(fig, path)

    return draw


#: Start-up measures other than ``startup*`` ones, in this order after them: building the loader, and its
#: first batch after the pause that ``benchmarks.training`` puts between the two, as a script's set-up.
_STARTUP_PARTS = ("build_s", "first_batch_s")


def startup_measures(rows: list[Json]) -> list[str]:
    """The start-up measures the rows have: ``startup_s``, any other ``startup*`` one, then the parts."""
    keys = {
        k
        for row in rows
        for k, v in row.items()
        if (k.startswith("startup") or k in _STARTUP_PARTS) and isinstance(v, int | float)
    }
    order = {part: i for i, part in enumerate(_STARTUP_PARTS, start=1)}
    return sorted(keys, key=lambda k: (k != "startup_s", order.get(k, 0), k))


def _startup_label(measure: str) -> str:
    if measure == "first_batch_s":
        return "first batch s, after the pause"
    return measure.removesuffix("_s").replace("_", " ") + " s"


def memory_tables(runs: list[ResultFile], trainings: list[ResultFile]) -> list[str]:
    """One table: extra GPU memory and start-up of every row that measured them, of either entry point."""
    entries: list[tuple[str, str, Json, bool]] = []  # run, loader, row, whether a benchmarks.run row
    for result, label in zip(runs, file_labels(runs, set_title), strict=True):
        entries += [(f"`benchmarks.run`: {label}", r["name"], r, True) for r in result.rows]
    for result, label in zip(trainings, labels(trainings), strict=True):
        for r in result.rows:
            if r["spec"]["loader"] == "fixed_input" or r["status"] != "ok":
                continue
            step, pipeline, loader = training_key(r)
            entries.append((f"`benchmarks.training`: {label}, {step} step, {pipeline}", loader, r, False))
    if not entries:
        return []
    starts = startup_measures([r for _, _, r, _ in entries])
    header = ["run", "loader", "extra GPU MB (device)", "torch MB (reserved; training: peak over the step's)"]
    body = []
    for run, loader, r, measured_by_run in entries:
        if measured_by_run:
            memory = [cell(spread(r, m), ",.0f") for m in ("extra_gpu_mb", "torch_reserved_mb")]
            times = [cell(spread(r, m), ".2f") for m in starts]
        else:
            memory = [number(r.get(m), ",.0f") for m in ("extra_device_mb", "extra_torch_peak_mb")]
            times = [number(r.get(m), ".2f") for m in starts]
        body.append([run, loader, *memory, *times])
    return table([*header, *map(_startup_label, starts)], body)


def memory_chart(runs: list[ResultFile]) -> Draw:
    def draw(path: Path) -> None:
        rows = [(f"{short_title(result)}: {r['name']}", r) for result in runs for r in result.rows]
        rows = [(name, r) for name, r in rows if r.get("images_per_s")]
        fig = figure(len(rows), 2)
        panels = (
            ("extra_gpu_mb", "extra GPU memory, device level (MB)", "tab:orange"),
            ("startup_s", "start-up to the first batch (s)", "tab:gray"),
        )
        for ax, (measure, title, color) in zip(fig.subplots(1, 2), panels, strict=True):
            got = [(name, r) for name, r in rows if r.get(measure) is not None]
            bars(ax, [name for name, _ in got], [spread(r, measure) for _, r in got], title, color)
        save(fig, path)

    return draw


# --- benchmarks.training ----------------------------------------------------------------------------


def training_key(row: Json) -> tuple[str, str, str]:
    """(step, pipeline, loader): what a training row is, the same in every file."""
    spec = row["spec"]
    engine = f", {spec['engine']}" if spec.get("engine") else ""
    options = "".join(f", {key}={value!r}" for key, value in spec.get("options", {}).items())
    return (
        spec["kind"],
        spec["pipeline"],
        LOADER_LABELS.get(spec["loader"], spec["loader"]) + engine + options,
    )


def gpu_name(result: ResultFile) -> str:
    """``H200``, ``H100``: the GPU's model without its maker and memory; "no GPU" on a CPU."""
    gpu = result.hardware.get("gpu")
    return str(gpu).removeprefix("NVIDIA ").split()[0] if gpu else "no GPU"


def labels(found: list[ResultFile]) -> list[str]:
    """Each file's interpreter, its GPU where the files ran on several; the file name where two share one."""
    several = len({gpu_name(result) for result in found}) > 1

    def title(result: ResultFile) -> str:
        return result.interpreter + (f", {gpu_name(result)}" if several else "")

    return file_labels(found, title)


def training_table(found: list[ResultFile], *, page: bool = False) -> list[str]:
    """One row per (step, pipeline, loader), a group of columns per file.

    Each file's provenance above the table, or under it (``page``).
    """
    keys = list(dict.fromkeys(training_key(row) for result in found for row in result.rows))
    by_file = [{training_key(row): row for row in result.rows} for result in found]
    header = ["step", "pipeline", "loader"]
    for label in labels(found):
        suffix = f", {label}" if len(found) > 1 else ""
        header += [f"img/s (min-max){suffix}", f"vs fixed input{suffix}", f"data wait{suffix}"]
    body = []
    for key in keys:
        cells = list(key)
        for rows in by_file:
            row = rows.get(key)
            if row is None or row["status"] != "ok":
                cells += [note(row) if row else "", "", ""]
                continue
            wait = Spread.of(row["data_wait_frac"])
            on_device = Spread.of(row.get("device_wait_frac") or [])
            cells += [cell(spread(row, "images_per_s"), ",.0f"), number(row.get("ratio"), ".2f", "x")]
            cells.append(
                number(100 * wait.median if wait else None, ".0f", "%")
                + (f" (GPU {100 * on_device.median:.0f}%)" if on_device else "")
            )
        body.append(cells)
    sources = [line for result in found for line in provenance(result)]
    return [*table(header, body), *sources] if page else [*sources, *table(header, body)]


def main_thread_table(found: list[ResultFile]) -> list[str]:
    """Where the step's thread went, per row that measured it: blocked, preempted, or on a core.

    Against the fixed-input row of the same file: more voluntary switches per step say the step waited
    (for the GIL, a lock), more involuntary ones that it was preempted (cores oversubscribed).
    """
    measures = (
        ("ms_per_step", ".1f"),
        ("main_cpu_ms_per_step", ".1f"),
        ("main_voluntary_per_step", ".1f"),
        ("main_involuntary_per_step", ".1f"),
        ("process_cores", ".1f"),
    )
    header = ["file", "step", "pipeline", "loader", "ms/step", "main thread CPU ms/step"]
    header += ["voluntary switches/step", "involuntary switches/step", "process cores"]
    body = []
    for label, result in zip(labels(found), found, strict=True):
        for row in result.rows:
            if row["status"] != "ok" or not row.get("main_cpu_ms_per_step"):
                continue
            cells = []
            for name, spec in measures:
                windows = Spread.of(row.get(name) or [])
                cells.append(number(windows.median if windows else None, spec))
            body.append([label, *training_key(row), *cells])
    return ["", *table(header, body)] if body else []


def stage_table(found: list[ResultFile]) -> list[str]:
    """ThreadLoader's host ms per batch in each stage beside the step, per row that recorded them.

    Summed over the reader threads, so a row's stages can add up to more than its step: against
    ``ms/step`` they say which stage would be the first to hold the step up.
    """
    entries = []
    for label, result in zip(labels(found), found, strict=True):
        for row in result.rows:
            if row["status"] != "ok" or not row.get("stage_ms_per_batch"):
                continue
            windows = row["stage_ms_per_batch"]
            stages = {
                stage: statistics.median(w[stage] for w in windows if stage in w)
                for stage in dict.fromkeys(stage for w in windows for stage in w)
            }
            step = number(statistics.median(row["ms_per_step"]), ".1f")
            entries.append(([label, *training_key(row), step], stages))
    return _stages_table(["file", "step", "pipeline", "loader", "ms/step"], entries)


def throughput_stage_table(found: list[ResultFile]) -> list[str]:
    """ThreadLoader's host ms per batch in each stage alone (each stage's median repeat), where recorded."""
    entries = [
        ([label, r["name"], number(r.get("ms_per_batch"), ".1f")], r["stage_ms_per_batch"])
        for result, label in zip(found, file_labels(found, set_title), strict=True)
        for r in result.rows
        if r["status"] == "ok" and r.get("stage_ms_per_batch")
    ]
    return _stages_table(["set", "loader", "ms/batch"], entries)


def _stages_table(header: list[str], entries: list[tuple[list[str], dict[str, float]]]) -> list[str]:
    """A column per stage that any entry recorded, after each entry's own cells."""
    stages = list(dict.fromkeys(stage for _, recorded in entries for stage in recorded))
    body = [[*cells, *(number(recorded.get(s), ".2f") for s in stages)] for cells, recorded in entries]
    return ["", *table([*header, *(f"{stage} ms" for stage in stages)], body)] if body else []


def training_chart(found: list[ResultFile]) -> Draw:
    """One panel per step kind; a bar per loader row and file, the fixed input as a dashed line."""

    def draw(path: Path) -> None:
        kinds = list(dict.fromkeys(row["spec"]["kind"] for result in found for row in result.rows))
        ok = [[r for r in result.rows if r["status"] == "ok"] for result in found]
        kinds = [k for k in kinds if any(r["spec"]["kind"] == k for rows in ok for r in rows)] or kinds[:1]
        fig = figure(sum(map(len, ok)) // max(len(kinds), 1), len(kinds))
        colors = ["tab:blue", "tab:green", "tab:purple", "tab:red"]
        for ax, kind in zip(fig.subplots(1, len(kinds), squeeze=False)[0], kinds, strict=True):
            names: list[str] = []
            spreads: list[Spread | None] = []
            shades: list[str] = []
            for i, (rows, label) in enumerate(zip(ok, labels(found), strict=True)):
                tag = f" ({label})" if len(found) > 1 else ""
                for row in (r for r in rows if r["spec"]["kind"] == kind):
                    if row["spec"]["loader"] == "fixed_input":
                        value = statistics.median(row["images_per_s"])
                        ax.axvline(
                            value,
                            color=colors[i % len(colors)],
                            linestyle="--",
                            label=f"fixed input{tag} {value:,.0f}",
                        )
                        continue
                    _, pipeline, loader = training_key(row)
                    names.append(f"{pipeline}: {loader}{tag}")
                    spreads.append(spread(row, "images_per_s"))
                    shades.append(colors[i % len(colors)])
            bars(ax, names, spreads, f"{kind} step: images/s (median window, min-max)", shades)
            ax.legend(loc="lower right", fontsize=8)
        save(fig, path)

    return draw


# --- benchmarks.gil ---------------------------------------------------------------------------------


def _rate(row: Json, window: str) -> str:
    """A load's images/s: "—" where it counts none, an empty window said as such, never a silent 0."""
    rate, images, seconds = (row.get(f"{k}_{window}") for k in ("images_per_s", "images", "seconds"))
    if rate is None:
        return "—"
    if images == 0 or (images is None and rate == 0):  # files from before the counts say only the rate
        return "none in the window" if seconds is None else f"none in {seconds:.2g} s"
    return f"{rate:,.0f}"


def gil_tables(found: list[ResultFile], *, page: bool = False) -> list[str]:
    """The main thread's delay per image loaded (``benchmarks.gil``), in one table.

    A column for the interpreter where there are several files; each file's provenance above the table,
    or under it (``page``).
    """
    if not found:
        return []
    several = len(found) > 1
    header = ["interpreter"] * several + ["switch interval ms", "background", "ops", "us/op alone"]
    header += ["us/op beside", "slowdown", "loader img/s alone", "delay us/image"]
    body = [
        [label] * several
        + [number(r["switch_interval_ms"], "g"), r["background"], r["ops"]]
        + [number(r[k], ".2f") for k in ("op_us_alone", "op_us_beside")]
        + [
            number(r.get("slowdown"), ".1f", "x"),
            _rate(r, "alone"),
            number(r.get("delay_us_per_image"), ",.0f"),
        ]
        for result, label in zip(found, labels(found), strict=True)
        for r in result.rows
    ]
    sources = [line for result in found for line in provenance(result)]
    if page:
        return [*table(header, body), *sources]
    return [*sources, *table(header, body)]


# --- docs/benchmarks.md -----------------------------------------------------------------------------


def throughput(results: Path, charts: bool) -> list[str]:
    found = load(results, "throughput-*.json")
    if not found:
        return no_results("throughput-*.json")
    draw = throughput_chart(found, "images/s") if charts else None
    chart = image(results, "throughput", "images/s per loader", draw)
    return [*throughput_tables(found, page=True), *throughput_stage_table(found), *chart]


def queued_title(result: ResultFile) -> str:
    """A queued file's set and switch (``.ci/gpu-results`` names the files ``queuedN-throughput-SET``)."""
    switch = result.path.stem.removeprefix("queued")[:1]
    return f"{set_title(result)}, THREADLOADER_QUEUED_DECODE={switch}"


def queued(results: Path, charts: bool) -> list[str]:
    """The same rows with and without queued decode calls, and the training rows with them: tables only."""
    runs, trainings = load(results, "queued*-throughput-*.json"), load(results, "queued*-training.json")
    if not runs and not trainings:
        return no_results("queued*-throughput-*.json, queued*-training.json")
    steps = ["", *training_table(trainings, page=True)] if trainings else []
    return [*throughput_tables(runs, page=True, title=queued_title), *steps]


def options(results: Path, charts: bool) -> list[str]:
    """nvJPEG's memory options and the pool's allocators against the defaults beside the step: tables."""
    found = [*load(results, "options-training-*.json"), *load(results, "allocators-training-*.json")]
    if not found:
        return no_results("options-training-*.json, allocators-training-*.json")
    return [*training_table(found, page=True), *main_thread_table(found)]


def _beside_step(found: list[ResultFile]) -> list[str]:
    """The training files' three tables: the step's speed, its main thread, the loader's stages."""
    return [*training_table(found, page=True), *main_thread_table(found), *stage_table(found)]


def _files_beside_step(results: Path, pattern: str) -> list[str]:
    found = load(results, pattern)
    return _beside_step(found) if found else no_results(pattern)


def session(results: Path, charts: bool) -> list[str]:
    """One machine session's training rows under each interpreter, kept apart from the main table."""
    return _files_beside_step(results, "session-training*.json")


def interpreters(results: Path, charts: bool) -> list[str]:
    """One call's training rows under 3.13t and 3.12, with and without Triton, apart from the sessions'."""
    return _files_beside_step(results, "interpreters-training*.json")


def ramp_table(found: list[ResultFile]) -> list[str]:
    """Each row's windows in order, from its first batch, a line per measure.

    img/s; the decode call and the wait for a free Decoder (host ms per batch); the samples Pillow
    decoded while nvImageCodec started.
    """
    windows = max(len(row.get("images_per_s") or []) for result in found for row in result.rows)
    header = ["file", "step", "pipeline", "loader", "per window", *(str(n + 1) for n in range(windows))]
    measures: list[tuple[str, Callable[[Json], list[float]], str]] = [
        ("img/s", lambda row: row["images_per_s"], ",.0f"),
        ("decode ms", lambda row: [s.get("decode", 0.0) for s in row.get("stage_ms_per_batch") or []], ".1f"),
        (
            "decode_lock ms",
            lambda row: [s.get("decode_lock", 0.0) for s in row.get("stage_ms_per_batch") or []],
            ".1f",
        ),
        ("Pillow start", lambda row: row.get("started_on_cpu") or [], ",.0f"),
    ]
    body = []
    for result in found:
        for row in result.rows:
            if row["status"] != "ok":
                continue
            for name, values, spec in measures:
                found_values = values(row)
                if found_values:
                    cells = [format(value, spec) for value in found_values]
                    cells += [""] * (windows - len(cells))
                    body.append([result.path.name, *training_key(row), name, *cells])
    sources = [line for result in found for line in provenance(result)]
    return [*table(header, body), *sources]


def ramp(results: Path, charts: bool) -> list[str]:
    """The loader's first windows beside the step, one column each: its start, window by window."""
    found = load(results, "ramp-training*.json")
    return ramp_table(found) if found else no_results("ramp-training*.json")


def training(results: Path, charts: bool) -> list[str]:
    found = load(results, "training*.json")
    if not found:
        return no_results("training*.json")
    draw = training_chart(found) if charts else None
    chart = image(results, "training", "training step beside each loader", draw)
    return [*_beside_step(found), *chart]


def gil(results: Path, charts: bool) -> list[str]:
    """A table only: a chart of a few numbers says less than the table."""
    return gil_tables(load(results, "gil-delay*.json"), page=True) or no_results("gil-delay*.json")


def memory(results: Path, charts: bool) -> list[str]:
    """Extra GPU memory and start-up of every row that measured them, from the other sections' files."""
    runs = load(results, "throughput-*.json")
    trainings = [
        *load(results, "training*.json"),
        *load(results, "session-training*.json"),
        *load(results, "interpreters-training*.json"),
    ]
    if not runs and not trainings:
        return no_results("throughput-*.json, training*.json")
    draw = memory_chart(runs) if charts else None
    chart = image(results, "memory", "extra GPU memory and start-up per loader", draw) if runs else []
    return [*memory_tables(runs, trainings), *chart]


def cpu(results: Path, charts: bool) -> list[str]:
    runs = load(results, "cpu-throughput*.json")
    if not runs:
        return no_results("cpu-throughput*.json")
    draw = throughput_chart(runs, "images/s on the CPU") if charts else None
    chart = image(results, "cpu", "images/s per loader on the CPU", draw)
    return [*throughput_tables(runs, page=True), *chart]


def cpu_training(results: Path, charts: bool) -> list[str]:
    found = load(results, "cpu-training*.json")
    return training_table(found, page=True) if found else no_results("cpu-training*.json")


SECTIONS: dict[str, Callable[[Path, bool], list[str]]] = {
    "throughput": throughput,
    "training": training,
    "session": session,
    "interpreters": interpreters,
    "ramp": ramp,
    "gil": gil,
    "queued": queued,
    "options": options,
    "memory": memory,
    "cpu": cpu,
    "cpu_training": cpu_training,
}
"""Each ``{{name}}`` line of the page's prose, and what replaces it."""


def page(results: Path = RESULTS, *, charts: bool = False) -> str:
    """docs/benchmarks.md as the files in ``results`` make it; ``charts`` also writes the PNGs."""

    def fill(match: re.Match[str]) -> str:
        return "\n".join(SECTIONS[match[1]](results, charts)).rstrip("\n")

    return re.sub(r"^\{\{(\w+)\}\}$", fill, TEMPLATE.read_text(), flags=re.MULTILINE)


# --- README ------------------------------------------------------------------------------------------


def _range(values: list[float], spec: str, suffix: str = "") -> str:
    low, high = (format(v, spec) for v in (min(values), max(values)))
    return low + suffix if low == high else f"{low}-{high}{suffix}"


def default_configuration(row: Json) -> bool:
    """A row that ran as a user's loader would: the C API, no variant's extra arguments."""
    return (
        row["status"] == "ok" and row["spec"].get("engine") in ("", "capi") and not row["spec"].get("options")
    )


def training_summary(results: Path) -> str:
    """docs/guide.md's table: each loader's step speed over the fixed input's, per step and interpreter."""
    found = load(results, "training*.json")
    if not found:
        return "No training results yet (benchmarks.md).\n"
    loaders = list(dict.fromkeys(
        r["spec"]["loader"] for f in found for r in f.rows if r["spec"]["loader"] != "fixed_input"
    ))  # fmt: skip
    workers = found[0].config.get("workers")
    header = [f"{LOADER_LABELS.get(x, x)}, vs the same step on a fixed tensor" for x in loaders]
    header = [
        h.replace("spawned", f"{workers} spawned").replace("forked", f"{workers} forked") for h in header
    ]
    body = []
    for result, label in zip(found, labels(found), strict=True):
        for kind in dict.fromkeys(r["spec"]["kind"] for r in result.rows):
            rows = [r for r in result.rows if r["spec"]["kind"] == kind and default_configuration(r)]
            if not any(r["spec"]["loader"] != "fixed_input" for r in rows):
                continue
            cells = [KIND_LABELS.get(kind, kind) + (f", {label}" if len(found) > 1 else "")]
            for loader in loaders:
                ours = [r for r in rows if r["spec"]["loader"] == loader]
                ratios = [r["ratio"] for r in ours if r.get("ratio") is not None]
                speeds = [statistics.median(r["images_per_s"]) / 1000 for r in ours]
                ratio = _range(ratios, ".2f", "x") if ratios else "—"
                cells.append(f"{ratio} ({_range(speeds, '.1f')}k img/s)" if ours else "")
            memory = [
                r["extra_device_mb"] * 2**20 / 1e9 for r in rows if r["spec"]["loader"] == "threadloader"
            ]
            body.append([*cells, f"{_range(memory, '.1f')} GB" if memory else ""])
    config = found[0].config
    model = {"resnet50": "ResNet-50"}.get(str(config.get("model")), config.get("model"))
    gpus = list(dict.fromkeys(str(f.hardware["gpu"]) for f in found if f.hardware.get("gpu")))
    where = "an " + " and an ".join(gpus) if gpus else "a CPU"
    lead = (
        f"Measured on {where} ({model}, batch {config.get('batch_size')}, bf16, varied "
        "photos resized or randomly cropped to 224; [benchmarks.md](benchmarks.md)):"
    )
    return "\n".join(
        [textwrap.fill(lead, 104), "", *table(["step", *header, "extra GPU memory, ThreadLoader"], body)]
    )


def _machine(result: ResultFile) -> str:
    hw = result.hardware
    return str(hw["gpu"]) if hw.get("gpu") else f"{hw.get('cpus_usable', hw.get('cpus'))} CPU cores, no GPU"


def short_set(result: ResultFile) -> str:
    """A ``benchmarks.run`` result's work in a few words: the README's rows."""
    config = result.config
    side = str(config.get("output_size", "?")).split("x")[0]
    if config.get("augment"):
        return f"photos, random crops to {side} + flip"
    if config.get("set") == "fixed":
        return f"{config.get('output_size', '?')} JPEGs"
    return f"photos resized to {side}"


def _default_row(result: ResultFile, loader: str) -> Json | None:
    """A ``benchmarks.run`` file's row of ``loader`` as a user's would run (ThreadLoader's default one)."""
    for row in result.rows:
        default = loader != "threadloader" or row["name"].startswith("threadloader default threads")
        if row.get("loader") == loader and default and row.get("status", "ok") == "ok":
            return row
    return None


SUMMARY_LOADERS = {"threadloader": "ThreadLoader", "pil_dataloader": "DataLoader", "dali": "DALI"}
"""The README's columns: the loaders a user compares, by their rows in the results."""


def _summary_throughput(found: list[ResultFile]) -> list[list[str]]:
    """The README's rows of ``benchmarks.run`` files: each loader's images/s alone."""
    rows = []
    batches = {next((r["batch_size"] for r in result.rows), None) for result in found}
    works = [
        short_set(result) + (f", batch {result.rows[0]['batch_size']}" if len(batches) > 1 else "")
        for result in found
    ]
    tagged = len(set(works)) < len(found)
    for result, work in zip(found, works, strict=True):
        cells = []
        for loader in SUMMARY_LOADERS:
            row = _default_row(result, loader)
            cells.append(cell(spread(row, "images_per_s"), ",.0f") if row else "—")
        machine = _machine(result) + (f" ({tag(result)})" if tagged else "")
        rows.append([f"{machine}, images/s: {work}", *cells])
    return rows


def results_summary(results: Path) -> str:
    """The README's one table: ThreadLoader against DataLoader and DALI, alone and beside a training step.

    A row per GPU throughput file (images/s alone), per step kind of the first training file (the step's
    speed beside each loader over its speed on a fixed tensor, over the pipelines), per CPU throughput file.
    """
    rows = _summary_throughput(load(results, "throughput-*.json"))
    for result in load(results, "training*.json")[:1]:
        model = {"resnet50": "ResNet-50"}.get(str(result.config.get("model")), result.config.get("model"))
        for kind in dict.fromkeys(r["spec"]["kind"] for r in result.rows):
            ours = [r for r in result.rows if r["spec"]["kind"] == kind and default_configuration(r)]
            cells = []
            for loader in SUMMARY_LOADERS:
                theirs = [r for r in ours if r["spec"]["loader"] == loader]
                ratios = [r["ratio"] for r in theirs if r.get("ratio") is not None]
                speeds = [statistics.median(r["images_per_s"]) / 1000 for r in theirs]
                text = f"{_range(ratios, '.2f', 'x')} ({_range(speeds, '.1f')}k img/s)" if ratios else "—"
                cells.append(text)
            step = {"graphed": "step as one CUDA graph"}.get(kind, f"{kind} step")
            rows.append([f"{_machine(result)}, {model} {step} beside the loader", *cells])
    rows += _summary_throughput(load(results, "cpu-throughput*.json"))
    if not rows:
        return "No results yet (docs/benchmarks.md).\n"
    lead = (
        "Images per second of each loader alone (the median of runs, min-max in brackets), and a training "
        "step's speed beside it as a share of the same step on a fixed tensor (over resized and cropped "
        "photos); —: not in that run. [docs/benchmarks.md](docs/benchmarks.md) has each number's command, "
        "machine and notes."
    )
    header = ["measured", *SUMMARY_LOADERS.values()]
    return "\n".join([textwrap.fill(lead, 104), "", *table(header, rows)])


SNIPPETS: dict[str, Callable[[Path], str]] = {
    "results": results_summary,
    "training-summary": training_summary,
}
"""Each generated block's name in README.md and docs/guide.md, and what fills it."""

PAGES_WITH_BLOCKS = (README, GUIDE)
"""The pages whose ``<!-- report:NAME -->`` blocks ``python -m benchmarks.report`` rewrites."""


def readme(text: str, results: Path = RESULTS, *, where: str = "README.md") -> str:
    """``text`` (README.md or another page), each ``<!-- report:NAME -->`` block made from the results."""

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in SNIPPETS:
            raise SystemExit(f"{where}: no report snippet named {name!r}; known: {sorted(SNIPPETS)}")
        return match[1] + SNIPPETS[name](results) + match[4]

    return BLOCK.sub(fill, text)


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite docs/benchmarks.md, its charts, the README's and guide's blocks; ``--check`` only compares."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=main.__doc__)
    p.add_argument(
        "--check", action="store_true", help="exit 1 where the committed docs differ from the JSON"
    )
    args = p.parse_args(argv)
    wanted = {DOC: page(charts=not args.check)}
    wanted |= {path: readme(path.read_text(), where=path.name) for path in PAGES_WITH_BLOCKS if path.exists()}
    stale = [path for path, text in wanted.items() if path.read_text() != text]
    for path in stale:
        if args.check:
            diff = difflib.unified_diff(
                path.read_text().splitlines(),
                wanted[path].splitlines(),
                str(path),
                "generated",
                lineterm="",
                n=1,
            )
            print("\n".join(list(diff)[:40]), file=sys.stderr)
        else:
            path.write_text(wanted[path])
            print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    if args.check and stale:
        print("stale: run `python -m benchmarks.report` and commit the result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
