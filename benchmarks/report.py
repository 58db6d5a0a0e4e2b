"""Benchmark results as a markdown table, a JSON dump and a two-panel PNG chart."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

BASELINE = "pil_dataloader"
"""Loader family every throughput is compared with: the common Pillow + DataLoader pipeline."""


@dataclass
class Row:
    """One measured (or skipped) loader configuration."""

    name: str
    loader: str
    batch_size: int
    status: str = "ok"  # "ok" | "skipped" | "failed"
    reason: str = ""
    images: int = 0
    batches: int = 0
    images_per_s: float | None = None
    ms_per_batch: float | None = None
    startup_s: float | None = None
    cpu_cores: float | None = None
    extra_gpu_mb: float | None = None
    torch_reserved_mb: float | None = None
    data_wait_frac: float | None = None


@dataclass
class Report:
    """Everything one run produced, with the context needed to compare runs."""

    hardware: dict[str, object]
    config: dict[str, object]
    rows: list[Row] = field(default_factory=list)

    @property
    def training(self) -> bool:
        return self.config.get("mode") == "training"

    def ratio(self, row: Row) -> float | None:
        """Throughput relative to the first successful baseline row."""
        base = next((r for r in self.rows if r.loader == BASELINE and r.images_per_s), None)
        if base is None or row.images_per_s is None or base.images_per_s is None:
            return None
        return row.images_per_s / base.images_per_s


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(report: Report) -> str:
    """Hardware and config lines followed by one table row per loader configuration."""
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
        "img/s",
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
            _fmt(row.images_per_s, ",.0f"),
            _fmt(row.ms_per_batch, ".1f"),
            "—" if ratio is None else f"{ratio:.2f}x",
            _fmt(row.extra_gpu_mb, ",.0f"),
            _fmt(row.torch_reserved_mb, ",.0f"),
            _fmt(row.startup_s, ".2f"),
            _fmt(row.cpu_cores, ".1f"),
        ]
        if report.training:
            cells.append("—" if row.data_wait_frac is None else f"{row.data_wait_frac:.0%}")
        cells.append("" if row.status == "ok" else f"{row.status}: {row.reason}".replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_json(report: Report) -> str:
    """Machine-readable dump; each row carries its ratio to the baseline."""
    rows = [asdict(row) | {"ratio_vs_pil": report.ratio(row)} for row in report.rows]
    return json.dumps({"hardware": report.hardware, "config": report.config, "rows": rows}, indent=2)


def chart(report: Report, path: Path) -> None:
    """Two horizontal bar panels side by side: throughput and extra device memory per loader."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in report.rows if r.status == "ok"]
    names = [r.name for r in rows]
    fig = Figure(figsize=(14, 1.5 + 0.35 * max(len(rows), 1)), layout="constrained")
    FigureCanvasAgg(fig)
    speed, memory = fig.subplots(1, 2, sharey=True)
    panels = (
        (speed, [r.images_per_s for r in rows], "throughput (images/s)", "tab:blue"),
        (memory, [r.extra_gpu_mb for r in rows], "extra GPU memory, device level (MB)", "tab:orange"),
    )
    for ax, values, title, color in panels:
        ax.set_title(title)
        if all(v is None for v in values):  # CPU runs measure no device memory
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center")
            continue
        bars = ax.barh(names, [v or 0.0 for v in values], color=color)
        ax.bar_label(bars, fmt="{:,.0f}", padding=3, fontsize=8)
        ax.margins(x=0.15)
    speed.invert_yaxis()  # shared y axis: first row on top for both panels
    fig.suptitle(f"{report.config.get('set')} set on {report.hardware.get('gpu', 'cpu')}")
    fig.savefig(path, dpi=120)


def write(report: Report, out: Path) -> list[Path]:
    """Write ``report.md``, ``report.json`` and ``report.png`` into ``out`` and return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    md, js, png = out / "report.md", out / "report.json", out / "report.png"
    md.write_text(markdown(report))
    js.write_text(to_json(report) + "\n")
    chart(report, png)
    return [md, js, png]
