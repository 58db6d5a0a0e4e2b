"""Benchmark results as markdown, JSON and charts: one run's, and the docs' from all committed runs.

``python -m benchmarks.report`` rewrites docs/benchmarks.md, its charts and the README's generated
blocks from ``docs/results/*.json``; ``--check`` fails where they differ from what the JSON gives.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BASELINE = "pil_dataloader"
"""Loader family every throughput is compared with: the common Pillow + DataLoader pipeline."""


@dataclass
class Row:
    """One measurement (one repeat, in one process) of a loader configuration, or why it did not run."""

    name: str
    loader: str
    batch_size: int
    status: str = "ok"  # "ok" | "skipped" | "failed"
    reason: str = ""
    images: int = 0
    batches: int = 0
    pid: int | None = None  # the process that measured it
    images_per_s: float | None = None
    ms_per_batch: float | None = None
    startup_s: float | None = None
    cpu_cores: float | None = None
    extra_gpu_mb: float | None = None
    torch_reserved_mb: float | None = None
    data_wait_frac: float | None = None


#: The measurements summarized over repeats: median, min and max of the repeats that ran.
MEASURES: tuple[str, ...] = ("images_per_s", "ms_per_batch", "startup_s", "cpu_cores", "extra_gpu_mb")
MEASURES += ("torch_reserved_mb", "data_wait_frac")


@dataclass(frozen=True)
class Spread:
    """A measure over a row's repeats."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread | None:
        return Spread(statistics.median(values), min(values), max(values)) if values else None


@dataclass
class Result:
    """One configuration measured ``len(repeats)`` times, each repeat in a fresh process."""

    name: str
    loader: str
    batch_size: int
    repeats: list[Row] = field(default_factory=list)

    @property
    def ok(self) -> list[Row]:
        return [r for r in self.repeats if r.status == "ok"]

    @property
    def status(self) -> str:
        """``ok`` when any repeat ran; else the first repeat's (``skipped`` or ``failed``)."""
        return "ok" if self.ok else (self.repeats[0].status if self.repeats else "failed")

    @property
    def reason(self) -> str:
        """Why repeats did not run: the first such reason, with a count when some others did."""
        bad = [r for r in self.repeats if r.status != "ok"]
        if not bad:
            return ""
        return (
            f"{len(bad)} of {len(self.repeats)} repeats {bad[0].status}: {bad[0].reason}"
            if self.ok
            else bad[0].reason
        )

    def spread(self, measure: str) -> Spread | None:
        """Median, min and max of ``measure`` over the repeats that ran and measured it."""
        return Spread.of([v for r in self.ok if (v := getattr(r, measure)) is not None])

    def median(self, measure: str) -> float | None:
        spread = self.spread(measure)
        return None if spread is None else spread.median


@dataclass
class Report:
    """Everything one run produced, with the context needed to compare runs."""

    hardware: dict[str, object]
    config: dict[str, object]
    rows: list[Result] = field(default_factory=list)
    command: str = ""  # the command line that made it

    @property
    def training(self) -> bool:
        return self.config.get("mode") == "training"

    def ratio(self, row: Result) -> float | None:
        """Median throughput relative to the first baseline row's median."""
        base = next((r.median("images_per_s") for r in self.rows if r.loader == BASELINE and r.ok), None)
        value = row.median("images_per_s")
        return None if base is None or value is None else value / base


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _cell(spread: Spread | None, spec: str) -> str:
    """The median, and the range over repeats where they differ."""
    if spread is None:
        return "—"
    if spread.low == spread.high:
        return format(spread.median, spec)
    return f"{spread.median:{spec}} ({spread.low:{spec}}-{spread.high:{spec}})"


def markdown(report: Report) -> str:
    """Hardware and config lines followed by one table row per loader configuration.

    Each cell is the median over the row's repeats; throughput, memory and start-up add their range.
    """
    hw = report.hardware
    lines = [
        f"# threadloader benchmark ({report.config.get('mode')})",
        "",
        "Hardware: " + ", ".join(f"{k} {v}" for k, v in hw.items()),
        "",
        "Config: " + ", ".join(f"{k}={v}" for k, v in report.config.items()),
        "",
    ]
    per_batch = "ms/step" if report.training else "ms/batch"
    header = [
        "loader",
        "img/s (min-max)",
        per_batch,
        f"vs {BASELINE}",
        "extra GPU MB (device)",
        "torch reserved MB",
        "startup s",
        "CPU cores",
    ]
    if report.training:
        header.append("data wait")
    header.append("note")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in report.rows:
        ratio = report.ratio(row)
        cells = [
            row.name,
            _cell(row.spread("images_per_s"), ",.0f"),
            _fmt(row.median("ms_per_batch"), ".1f"),
            "—" if ratio is None else f"{ratio:.2f}x",
            _cell(row.spread("extra_gpu_mb"), ",.0f"),
            _fmt(row.median("torch_reserved_mb"), ",.0f"),
            _cell(row.spread("startup_s"), ".2f"),
            _fmt(row.median("cpu_cores"), ".1f"),
        ]
        if report.training:
            wait = row.median("data_wait_frac")
            cells.append("—" if wait is None else f"{wait:.0%}")
        note = row.reason if row.status == "ok" else f"{row.status}: {row.reason}"
        cells.append(note.replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_json(report: Report) -> str:
    """Machine-readable dump with every repeat as measured.

    Per row: each measure's median under its own name, its ``min`` and ``max``, and the ratio of
    medians to the baseline.
    """
    rows = []
    for row in report.rows:
        spreads = {m: row.spread(m) for m in MEASURES}
        rows.append(
            {"name": row.name, "loader": row.loader, "batch_size": row.batch_size}
            | {"status": row.status, "reason": row.reason}
            | {m: s and s.median for m, s in spreads.items()}
            | {"min": {m: s and s.low for m, s in spreads.items()}}
            | {"max": {m: s and s.high for m, s in spreads.items()}}
            | {"ratio_vs_pil": report.ratio(row), "repeats": [asdict(r) for r in row.repeats]}
        )
    dump = {"command": report.command, "hardware": report.hardware, "config": report.config, "rows": rows}
    return json.dumps(dump, indent=2)


def chart(report: Report, path: Path) -> None:
    """Two horizontal bar panels side by side: throughput and extra device memory per loader.

    Bars are medians over the repeats; the whiskers span min to max.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in report.rows if r.status == "ok"]
    names = [r.name for r in rows]
    fig = Figure(figsize=(14, 1.5 + 0.35 * max(len(rows), 1)), layout="constrained")
    FigureCanvasAgg(fig)
    speed, memory = fig.subplots(1, 2, sharey=True)
    panels = (
        (speed, "images_per_s", "throughput (images/s)", "tab:blue"),
        (memory, "extra_gpu_mb", "extra GPU memory, device level (MB)", "tab:orange"),
    )
    for ax, measure, title, color in panels:
        ax.set_title(title)
        spreads = [r.spread(measure) or Spread(0.0, 0.0, 0.0) for r in rows]
        if not any(r.spread(measure) for r in rows):  # CPU runs measure no device memory
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center")
            continue
        medians = [s.median for s in spreads]
        whiskers = [[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]]
        bars = ax.barh(names, medians, xerr=whiskers, color=color, capsize=3)
        ax.bar_label(bars, fmt="{:,.0f}", padding=3, fontsize=8)
        ax.margins(x=0.15)
    speed.invert_yaxis()  # shared y axis: first row on top for both panels
    fig.suptitle(
        f"{report.config.get('set')} set on {report.hardware.get('gpu', 'cpu')}: median of "
        f"{report.config.get('repeats', 1)} processes, whiskers min to max"
    )
    fig.savefig(path, dpi=120)


def can_chart() -> bool:
    """Whether matplotlib imports, saying so when not: a free-threaded Python may have no build of it.

    The numbers are the run's result; a missing chart should not lose them.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        print(f"no chart: matplotlib does not import ({exc})", file=sys.stderr)
        return False
    return True


def write(report: Report, out: Path) -> list[Path]:
    """Write ``report.md``, ``report.json`` and, where matplotlib imports, ``report.png`` into ``out``.

    Returns the paths written.
    """
    out.mkdir(parents=True, exist_ok=True)
    md, js, png = out / "report.md", out / "report.json", out / "report.png"
    md.write_text(markdown(report))
    js.write_text(to_json(report) + "\n")
    if not can_chart():
        return [md, js]
    chart(report, png)
    return [md, js, png]


# --- docs/benchmarks.md, its charts and the README's figures, from docs/results/*.json --------------

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- report:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /report -->)", re.DOTALL)
"""A generated block in README.md; its name is a key of :data:`SNIPPETS`."""

LOADER_LABELS = {
    "fixed_input": "fixed input",
    "threadloader": "ThreadLoader",
    "spawn_collate_nvimgcodec": "DataLoader, spawned nvImageCodec workers",
    "pil_dataloader": "DataLoader, Pillow in forked workers",
    "dali": "DALI",
}

KIND_LABELS = {"graphed": "whole step in a CUDA graph"}

Json = dict[str, Any]


@dataclass(frozen=True)
class ResultFile:
    """One JSON file of ``docs/results``: where it is and what it holds."""

    path: Path
    data: Json

    @property
    def hardware(self) -> Json:
        return self.data.get("hardware") or {}

    @property
    def rows(self) -> list[Json]:
        return self.data.get("rows") or []

    @property
    def interpreter(self) -> str:
        """``Python 3.12.3``, or ``Python 3.13.5t, GIL off``: what tells runs on one machine apart."""
        off = self.hardware.get("gil") is False
        return f"Python {self.hardware.get('python', '?')}" + (", GIL off" if off else "")


SET_ORDER = ("fixed", "varied", "augment")
"""Throughput files in the order of their work: plain decoding, then resizing, then augmenting."""


def load(results: Path, pattern: str) -> list[ResultFile]:
    """The files matching ``pattern``: by set, then the plain name (``training.json``) first."""

    def order(path: Path) -> tuple[int, int, str]:
        rank = next((i for i, name in enumerate(SET_ORDER) if path.stem.endswith(name)), len(SET_ORDER))
        return rank, len(path.stem), path.name

    return [ResultFile(p, json.loads(p.read_text())) for p in sorted(results.glob(pattern), key=order)]


def _link(path: Path) -> str:
    """``path`` as docs/benchmarks.md links it."""
    return path.relative_to(DOC.parent).as_posix() if path.is_relative_to(DOC.parent) else path.as_posix()


def provenance(result: ResultFile) -> list[str]:
    """Which file, which machine, which command."""
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


def measured(row: Json, measure: str, spec: str) -> str:
    """A ``benchmarks.run`` row's median, with its min-max over repeats where they differ."""
    if row.get(measure) is None:
        return "—"
    low, high = (row.get(end, {}).get(measure, row[measure]) for end in ("min", "max"))
    return _cell(Spread(row[measure], low, high), spec)


def windows(values: list[float], spec: str) -> str:
    """A ``benchmarks.training`` row's median window, with the min-max."""
    return _cell(Spread.of(values), spec)


def note(row: Json) -> str:
    return row.get("reason", "") if row.get("status", "ok") == "ok" else f"{row['status']}: {row['reason']}"


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


def no_results(pattern: str) -> list[str]:
    return [f"No results yet (`docs/results/{pattern}`).", ""]


# --- charts -----------------------------------------------------------------------------------------


def _figure(rows: int, panels: int) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(7 * panels, 10), 1.2 + 0.4 * max(rows, 1)), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _bars(ax: Any, labels: list[str], spreads: list[Spread], title: str, colors: list[str] | str) -> None:
    """Horizontal bars of medians with min-max whiskers, the first label on top."""
    medians = [s.median for s in spreads]
    whiskers = [[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]]
    drawn = ax.barh(labels, medians, xerr=whiskers, color=colors, capsize=3)
    ax.bar_label(drawn, fmt="{:,.0f}" if max(medians, default=0) >= 100 else "{:.1f}", padding=3, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.invert_yaxis()
    ax.margins(x=0.2)


def image(results: Path, name: str, alt: str, draw: Callable[[Path], None] | None) -> list[str]:
    """The chart's link; ``draw`` writes it first, unless None (``--check`` compares text only)."""
    path = results / f"{name}.png"
    if draw is not None:
        draw(path)
    return [f"![{alt}]({_link(path)})", ""]


def _save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=100, metadata={"Software": None})


# --- throughput -------------------------------------------------------------------------------------


def set_title(result: ResultFile) -> str:
    """What a ``benchmarks.run`` result loaded, from its config."""
    config = result.data.get("config", {})
    size = config.get("output_size", "?")
    if config.get("augment"):
        what = f"varied set, RandomResizedCrop({size.split('x')[0]}) + flip + normalize"
    elif config.get("set") == "fixed":
        what = f"fixed set, {size}"
    else:
        what = f"varied set resized to {size}" + (", normalized" if config.get("normalize") else "")
    batch = next((r["batch_size"] for r in result.rows), "?")
    return f"{what}, batch {batch}"


def short_title(result: ResultFile) -> str:
    """``fixed``, ``varied`` or ``augment``: a chart's label for a ``benchmarks.run`` result."""
    config = result.data.get("config", {})
    return "augment" if config.get("augment") else str(config.get("set", "?"))


def throughput_tables(found: list[ResultFile], *, cpu_time: bool = False) -> list[str]:
    """A table per result: img/s, ms per batch, CPU cores (and CPU ms per image), the ratio to PIL."""
    lines = []
    for result in found:
        rows = result.rows
        ratio = any(r.get("ratio_vs_pil") is not None for r in rows)
        header = ["loader", "img/s, median (min-max)", "ms/batch", "CPU cores"]
        header += ["CPU ms/image"] * cpu_time + ["vs PIL"] * ratio + ["note"]
        body = []
        for r in rows:
            cells = [r["name"], measured(r, "images_per_s", ",.0f"), number(r.get("ms_per_batch"), ".1f")]
            cells.append(number(r.get("cpu_cores"), ".1f"))
            if cpu_time:
                per_image = [
                    1000 * x["cpu_cores"] / x["images_per_s"] for x in r["repeats"] if x["images_per_s"]
                ]
                cells.append(_cell(Spread.of(per_image), ".1f"))
            if ratio:
                cells.append(number(r.get("ratio_vs_pil"), ".2f", "x"))
            body.append([*cells, note(r)])
        lines += [f"### {set_title(result)}", "", *provenance(result), *table(header, body)]
    return lines


def _throughput_chart(found: list[ResultFile], measure: str, title: str) -> Callable[[Path], None]:
    def draw(path: Path) -> None:
        fig = _figure(sum(len(r.rows) + 2 for r in found), 1)  # one panel above the other
        axes = fig.subplots(len(found), 1, squeeze=False, height_ratios=[len(r.rows) + 1 for r in found])
        for ax, result in zip(axes[:, 0], found, strict=True):
            ok = [r for r in result.rows if r.get(measure) is not None]
            spreads = [Spread(r[measure], r["min"][measure], r["max"][measure]) for r in ok]
            _bars(ax, [r["name"] for r in ok], spreads, set_title(result), "tab:blue")
        fig.suptitle(f"{title}: median over processes, whiskers min to max")
        _save(fig, path)

    return draw


def throughput(results: Path, charts: bool) -> list[str]:
    found = load(results, "throughput-*.json")
    if not found:
        return no_results("throughput-*.json")
    draw = _throughput_chart(found, "images_per_s", "images/s") if charts else None
    return [*throughput_tables(found), *image(results, "throughput", "images/s per loader", draw)]


# --- training ---------------------------------------------------------------------------------------


def training_key(row: Json) -> tuple[str, str, str]:
    """(step, pipeline, loader): what a training row is, the same in every file."""
    spec = row["spec"]
    engine = f", {spec['engine']}" if spec.get("engine") else ""
    priority = ", default stream priority" if spec.get("priority") == "default" else ""
    options = "".join(f", {key}={value!r}" for key, value in spec.get("options", {}).items())
    return (
        spec["kind"],
        spec["pipeline"],
        LOADER_LABELS.get(spec["loader"], spec["loader"]) + engine + priority + options,
    )


def labels(found: list[ResultFile]) -> list[str]:
    """Each file's interpreter; with the file name where two share one."""
    names = [r.interpreter for r in found]
    if len(set(names)) == len(names):
        return names
    return [f"{name}, {result.path.name}" for name, result in zip(names, found, strict=True)]


def training_table(found: list[ResultFile]) -> list[str]:
    """One row per (step, pipeline, loader); a group of columns per file, side by side."""
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
            cells += [windows(row["images_per_s"], ",.0f"), number(row.get("ratio"), ".2f", "x")]
            cells.append(number(100 * wait.median if wait else None, ".0f", "%"))
        body.append(cells)
    return table(header, body)


def _training_chart(found: list[ResultFile]) -> Callable[[Path], None]:
    """One panel per step kind; a bar per loader row and file, the fixed input as a dashed line."""

    def draw(path: Path) -> None:
        kinds = list(dict.fromkeys(row["spec"]["kind"] for result in found for row in result.rows))
        ok = [[r for r in result.rows if r["status"] == "ok"] for result in found]
        kinds = [k for k in kinds if any(r["spec"]["kind"] == k for rows in ok for r in rows)] or kinds[:1]
        fig = _figure(sum(map(len, ok)) // max(len(kinds), 1), len(kinds))
        colors = ["tab:blue", "tab:green", "tab:purple", "tab:red"]
        for ax, kind in zip(fig.subplots(1, len(kinds), squeeze=False)[0], kinds, strict=True):
            names, spreads, shades = [], [], []
            for i, (rows, label) in enumerate(zip(ok, labels(found), strict=True)):
                tag = f" ({label})" if len(found) > 1 else ""
                for row in rows:
                    if row["spec"]["kind"] != kind:
                        continue
                    if row["spec"]["loader"] == "fixed_input":
                        value = statistics.median(row["images_per_s"])
                        ax.axvline(
                            value, color=colors[i], linestyle="--", label=f"fixed input{tag} {value:,.0f}"
                        )
                        continue
                    _, pipeline, loader = training_key(row)
                    names.append(f"{pipeline}: {loader}{tag}")
                    spreads.append(Spread.of(row["images_per_s"]) or Spread(0.0, 0.0, 0.0))
                    shades.append(colors[i % len(colors)])
            _bars(ax, names, spreads, f"{kind} step: images/s (median window, min-max)", shades)
            ax.legend(loc="lower right", fontsize=8)
        _save(fig, path)

    return draw


def training(results: Path, charts: bool) -> list[str]:
    found = load(results, "training*.json")
    if not found:
        return no_results("training*.json")
    lines = [line for result in found for line in provenance(result)]
    draw = _training_chart(found) if charts else None
    return [
        *lines,
        *training_table(found),
        *image(results, "training", "training step beside each loader", draw),
    ]


def gil_cells(row: Json) -> list[str]:
    """A ``benchmarks.gil`` row: the loop alone and beside the load, and the delay per image."""
    loop = [number(row[k], ".2f") for k in ("op_us_alone", "op_us_beside")]
    load = [number(row.get("images_per_s_alone"), ",.0f"), number(row.get("delay_us_per_image"), ",.0f")]
    where = [number(row["switch_interval_ms"], "g"), row["background"], row["ops"]]
    return [*where, *loop, number(row.get("slowdown"), ".1f", "x"), *load]


def gil(results: Path, charts: bool) -> list[str]:
    """The main thread's delay per image (``benchmarks.gil``) and the GIL releases per image."""
    del charts  # tables only: a chart of a few numbers says less than the table
    lines = ["### Main-thread delay per image loaded", ""]
    found = load(results, "gil-delay*.json")
    header = ["switch interval ms", "background", "ops", "us/op alone", "us/op beside", "slowdown"]
    header += ["loader img/s alone", "delay us/image"]
    for result, label in zip(found, labels(found), strict=True):
        body = [gil_cells(r) for r in result.rows]
        lines += [f"#### {label}", "", *provenance(result), *table(header, body)]
    lines += no_results("gil-delay*.json") if not found else []
    lines += ["### GIL releases per image", ""]
    found = load(results, "gil-releases*.json")
    for result in found:
        stages = list(dict.fromkeys(stage for row in result.rows for stage in row["stages"]))
        header = ["stage", *(row["pipeline"] for row in result.rows)]
        body = [["**whole process**", *(f"**{row['per_image']:.1f}**" for row in result.rows)]]
        body += [
            [stage, *(number(row["stages"].get(stage), ".2f") for row in result.rows)] for stage in stages
        ]
        lines += [*provenance(result), *table(header, body)]
    return lines + (no_results("gil-releases*.json") if not found else [])


# --- memory and start-up ----------------------------------------------------------------------------


def memory(results: Path, charts: bool) -> list[str]:
    """Extra GPU memory and start-up of every row that measured them, from the other sections' files."""
    runs, trainings = load(results, "throughput-*.json"), load(results, "training*.json")
    if not runs and not trainings:
        return no_results("throughput-*.json, training*.json")
    lines: list[str] = []
    if runs:
        rows = [r for result in runs for r in result.rows]
        starts = startup_measures(rows)
        header = ["set", "loader", "extra GPU MB (device)", "torch reserved MB", *map(_startup_label, starts)]
        body = [
            [
                set_title(result),
                r["name"],
                *(measured(r, m, ",.0f") for m in ("extra_gpu_mb", "torch_reserved_mb")),
            ]
            + [measured(r, s, ".2f") for s in starts]
            for result in runs
            for r in result.rows
        ]
        lines += ["`benchmarks.run` (files in the throughput section):", "", *table(header, body)]
    if trainings:
        rows = [r for result in trainings for r in result.rows if r["spec"]["loader"] != "fixed_input"]
        starts = startup_measures(rows)
        header = [
            "interpreter",
            "step",
            "pipeline",
            "loader",
            "extra GPU MB (device)",
            "extra GPU MB (torch peak)",
        ]
        header += list(map(_startup_label, starts))
        body = [
            [
                label,
                *training_key(r),
                *(number(r.get(m), ",.0f") for m in ("extra_device_mb", "extra_torch_peak_mb")),
            ]
            + [number(r.get(s), ".2f") for s in starts]
            for result, label in zip(trainings, labels(trainings), strict=True)
            for r in result.rows
            if r["spec"]["loader"] != "fixed_input" and r["status"] == "ok"
        ]
        lines += ["`benchmarks.training` (files in the training section):", "", *table(header, body)]
    if runs:
        draw = _memory_chart(runs) if charts else None
        lines += image(results, "memory", "extra GPU memory and start-up per loader", draw)
    return lines


def _memory_chart(runs: list[ResultFile]) -> Callable[[Path], None]:
    def draw(path: Path) -> None:
        rows = [(short_title(result), r) for result in runs for r in result.rows if r.get("images_per_s")]
        fig = _figure(len(rows), 2)
        for ax, measure, title, color in zip(
            fig.subplots(1, 2),
            ("extra_gpu_mb", "startup_s"),
            ("extra GPU memory, device level (MB)", "start-up to the first batch (s)"),
            ("tab:orange", "tab:gray"),
            strict=True,
        ):
            got = [(f"{where}: {r['name']}", r) for where, r in rows if r.get(measure) is not None]
            spreads = [Spread(r[measure], r["min"][measure], r["max"][measure]) for _, r in got]
            _bars(ax, [name for name, _ in got], spreads, title, color)
        _save(fig, path)

    return draw


# --- CPU --------------------------------------------------------------------------------------------


def cpu(results: Path, charts: bool) -> list[str]:
    runs, trainings = load(results, "cpu-throughput*.json"), load(results, "cpu-training*.json")
    lines = throughput_tables(runs, cpu_time=True) if runs else no_results("cpu-throughput*.json")
    if runs:
        draw = _throughput_chart(runs, "images_per_s", "images/s on the CPU") if charts else None
        lines += image(results, "cpu", "images/s per loader on the CPU", draw)
    lines += ["### Beside a training loop, on the CPU", ""]
    if not trainings:
        return lines + no_results("cpu-training*.json")
    return lines + [line for result in trainings for line in provenance(result)] + training_table(trainings)


# --- the page ---------------------------------------------------------------------------------------

TEMPLATE = Path(__file__).with_name("report_page.md")
"""The page's prose, with a ``{{name}}`` line where each of :data:`SECTIONS` puts its tables."""

SECTIONS: dict[str, Callable[[Path, bool], list[str]]] = {
    "throughput": throughput,
    "training": training,
    "gil": gil,
    "memory": memory,
    "cpu": cpu,
}


def page(results: Path = RESULTS, *, charts: bool = False) -> str:
    """docs/benchmarks.md as the files in ``results`` make it; ``charts`` also writes the PNGs."""

    def fill(match: re.Match[str]) -> str:
        return "\n".join(SECTIONS[match[1]](results, charts)).rstrip("\n")

    return re.sub(r"^\{\{(\w+)\}\}$", fill, TEMPLATE.read_text(), flags=re.MULTILINE)


# --- README ------------------------------------------------------------------------------------------


def _ratio_range(rows: list[Json], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return "—"
    low, high = min(values), max(values)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def _range(values: list[float], scale: float, spec: str) -> str:
    low, high = (format(v / scale, spec) for v in (min(values), max(values)))
    return low if low == high else f"{low}-{high}"


def default_configuration(row: Json) -> bool:
    """A row that ran as a user's loader would: C API, streams as built, no variant's extra arguments."""
    spec = row["spec"]
    return (
        row["status"] == "ok"
        and spec.get("engine") in ("", "capi")
        and spec.get("priority") != "default"
        and not spec.get("options")
    )


def training_summary(results: Path) -> str:
    """The README's table: each loader's step speed against the fixed input, per step kind."""
    found = load(results, "training*.json")
    if not found:
        return "No training results yet (docs/benchmarks.md).\n"
    loaders = list(dict.fromkeys(
        r["spec"]["loader"] for f in found for r in f.rows if r["spec"]["loader"] != "fixed_input"
    ))  # fmt: skip
    header = ["step", *(LOADER_LABELS.get(x, x) + ", vs the same step on a fixed tensor" for x in loaders)]
    header.append("extra GPU memory, ThreadLoader")
    body = []
    for result, label in zip(found, labels(found), strict=True):
        workers = result.data.get("config", {}).get("workers")
        for kind in dict.fromkeys(r["spec"]["kind"] for r in result.rows):
            rows = [r for r in result.rows if r["spec"]["kind"] == kind and default_configuration(r)]
            if not any(r["spec"]["loader"] != "fixed_input" for r in rows):
                continue
            cells = [KIND_LABELS.get(kind, kind) + (f", {label}" if len(found) > 1 else "")]
            for loader in loaders:
                ours = [r for r in rows if r["spec"]["loader"] == loader]
                speeds = [statistics.median(r["images_per_s"]) for r in ours]
                cells.append(
                    f"{_ratio_range(ours, 'ratio')} ({_range(speeds, 1000, '.1f')}k img/s)" if ours else ""
                )
            memory = [r["extra_device_mb"] for r in rows if r["spec"]["loader"] == "threadloader"]
            cells.append(f"{_range(memory, 1000, '.1f')} GB" if memory else "")
            body.append(cells)
        header = [
            h.replace("spawned", f"{workers} spawned").replace("forked", f"{workers} forked") for h in header
        ]
    hw, config = found[0].hardware, found[0].data.get("config", {})
    model = {"resnet50": "ResNet-50"}.get(str(config.get("model")), config.get("model"))
    where = f"an {hw['gpu']}" if hw.get("gpu") else "a CPU"
    lead = (
        f"Measured on {where} ({model}, batch {config.get('batch_size')}, bf16, varied "
        "photos resized or randomly cropped to 224; [docs/benchmarks.md](docs/benchmarks.md)):"
    )
    return "\n".join([textwrap.fill(lead, 104), "", *table(header, body)])


SNIPPETS: dict[str, Callable[[Path], str]] = {"training-summary": training_summary}


def readme(text: str, results: Path = RESULTS) -> str:
    """``text`` with each ``<!-- report:NAME -->`` block rewritten from the results."""

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in SNIPPETS:
            raise SystemExit(f"README.md: no report snippet named {name!r}; known: {sorted(SNIPPETS)}")
        return match[1] + SNIPPETS[name](results) + match[4]

    return BLOCK.sub(fill, text)


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite docs/benchmarks.md, its charts and README.md's blocks; ``--check`` only compares."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=main.__doc__)
    p.add_argument(
        "--check", action="store_true", help="exit 1 where the committed docs differ from the JSON"
    )
    args = p.parse_args(argv)
    wanted = {DOC: page(charts=not args.check), README: readme(README.read_text())}
    stale = [path for path, text in wanted.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            diff = difflib.unified_diff(
                path.read_text().splitlines(),
                wanted[path].splitlines(),
                str(path),
                "generated",
                lineterm="",
                n=1,
            )
            print("\n".join(list(diff)[:40]), file=sys.stderr)
        if stale:
            print("stale: run `python -m benchmarks.report` and commit the result", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
