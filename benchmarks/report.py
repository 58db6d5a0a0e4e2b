"""Benchmark results as a markdown table, a JSON dump and a two-panel PNG chart."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
MEASURES = ("images_per_s", "ms_per_batch", "startup_s", "cpu_cores", "extra_gpu_mb", "torch_reserved_mb")
MEASURES += ("data_wait_frac",)


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


def write(report: Report, out: Path) -> list[Path]:
    """Write ``report.md``, ``report.json`` and ``report.png`` into ``out`` and return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    md, js, png = out / "report.md", out / "report.json", out / "report.png"
    md.write_text(markdown(report))
    js.write_text(to_json(report) + "\n")
    chart(report, png)
    return [md, js, png]
