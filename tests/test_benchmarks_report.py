"""docs/benchmarks.md and the README's figures are what docs/results/*.json make: they cannot drift."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import report


def test_the_committed_docs_are_what_the_committed_json_makes() -> None:
    assert report.DOC.read_text() == report.page(), "run `python -m benchmarks.report` and commit"
    assert report.README.read_text() == report.readme(report.README.read_text())
    assert report.main(["--check"]) == 0


def test_check_fails_on_a_number_edited_by_hand(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    text = report.DOC.read_text()
    first = re.search(r"\| (\d{1,3},\d{3}) ", text)  # the first figure of a table, say "12,500"
    assert first is not None
    edited = str(int(first.group(1).replace(",", "")) + 1000)
    doc.write_text(text[: first.start(1)] + f"{int(edited):,}" + text[first.end(1) :])
    assert doc.read_text() != text
    monkeypatch.setattr(report, "DOC", doc)
    assert report.main(["--check"]) == 1


def test_every_section_says_when_it_has_no_results(tmp_path: Path) -> None:
    text = report.page(tmp_path)
    for pattern in ("throughput-*.json", "training*.json", "gil-delay*.json"):
        assert f"No results yet (`docs/results/{pattern}`)." in text
    assert "cpu-throughput*.json" in text and "cpu-training*.json" in text
    assert "queued*-throughput-*.json, queued*-training.json" in text
    assert "No results yet (`docs/results/options-training-*.json, allocators-training-*.json`)." in text
    assert "{{" not in text
    assert "No training results yet" in report.training_summary(tmp_path)


def test_the_options_section_reads_its_own_files_only(tmp_path: Path) -> None:
    """Its files are training files of one call each: not in the training section, and not it in theirs."""
    shutil.copy(report.RESULTS / "training.json", tmp_path / "training.json")
    data = json.loads((tmp_path / "training.json").read_text())
    data["rows"] = [row for row in data["rows"] if row["spec"]["loader"] == "fixed_input"]
    data["rows"][0]["spec"]["kind"] = "marked"
    (tmp_path / "options-training-h100-1.json").write_text(json.dumps(data))
    options = "\n".join(report.options(tmp_path, charts=False))
    assert "| marked |" in options and "options-training-h100-1.json" in options
    assert f"{tmp_path / 'training.json'}`" not in options
    assert "| marked |" not in "\n".join(report.training(tmp_path, charts=False))


@pytest.mark.parametrize("section", ["session", "interpreters"])
def test_a_section_of_one_session_reads_its_own_files_and_memory_reads_them_too(
    tmp_path: Path, section: str
) -> None:
    """One machine session's interpreters: apart from the main table, in the memory table."""
    shutil.copy(report.RESULTS / "training.json", tmp_path / "training.json")
    data = json.loads((tmp_path / "training.json").read_text())
    for row in data["rows"]:
        row["spec"]["kind"] = "marked"
    (tmp_path / f"{section}-training-h100.json").write_text(json.dumps(data))
    own = "\n".join(report.SECTIONS[section](tmp_path, False))
    assert "| marked |" in own and f"{section}-training-h100.json" in own
    assert f"{tmp_path / 'training.json'}`" not in own
    assert "| marked |" not in "\n".join(report.training(tmp_path, charts=False))
    assert "marked step" in "\n".join(report.memory(tmp_path, charts=False))
    assert f"No results yet (`docs/results/{section}-training*.json`)." in report.page(tmp_path / "none")


def test_training_files_stand_side_by_side_by_interpreter(tmp_path: Path) -> None:
    shutil.copy(report.RESULTS / "training.json", tmp_path / "training.json")
    data = json.loads((tmp_path / "training.json").read_text())
    data["hardware"] |= {"python": "3.13.5t", "gil": False}
    (tmp_path / "training-3.13t.json").write_text(json.dumps(data))
    (header,) = [
        line for line in report.training_table(report.load(tmp_path, "training*.json")) if "| step |" in line
    ]
    assert (
        "vs fixed input, Python 3.12.3 |" in header and "vs fixed input, Python 3.13.5t, GIL off |" in header
    )
    summary = report.training_summary(tmp_path)
    assert "| eager, Python 3.13.5t, GIL off |" in summary and "| eager, Python 3.12.3 |" in summary


def test_files_of_one_interpreter_on_two_gpus_are_told_apart_by_the_gpu(tmp_path: Path) -> None:
    shutil.copy(report.RESULTS / "training.json", tmp_path / "training.json")
    data = json.loads((tmp_path / "training.json").read_text())
    data["hardware"] |= {"python": "3.12.3", "gil": True, "gpu": "NVIDIA H100 80GB HBM3"}
    (tmp_path / "training-h100.json").write_text(json.dumps(data))
    (header,) = [
        line for line in report.training_table(report.load(tmp_path, "training*.json")) if "| step |" in line
    ]
    assert "vs fixed input, Python 3.12.3, H100 |" in header
    assert "vs fixed input, Python 3.12.3, H200 |" in header
    summary = report.training_summary(tmp_path)
    assert "| eager, Python 3.12.3, H100 |" in summary and "| eager, Python 3.12.3, H200 |" in summary
    assert "Measured on an NVIDIA H200 and an NVIDIA H100 80GB HBM3 (" in summary


def test_throughput_files_of_one_set_on_two_gpus_are_told_apart_by_the_gpu(tmp_path: Path) -> None:
    shutil.copy(report.RESULTS / "throughput-fixed.json", tmp_path / "throughput-fixed.json")
    data = json.loads((tmp_path / "throughput-fixed.json").read_text())
    data["hardware"] |= {"gpu": "NVIDIA H100 80GB HBM3"}
    (tmp_path / "throughput-fixed-h100.json").write_text(json.dumps(data))
    runs = report.load(tmp_path, "throughput-*.json")
    text = "\n".join(report.throughput_tables(runs, page=True) + report.memory_tables(runs, []))
    for gpu in ("H100", "H200"):
        assert f"| fixed set, 256x256, batch 64, {gpu} | dali" in text
        assert f"| `benchmarks.run`: fixed set, 256x256, batch 64, {gpu} | dali" in text


def test_queued_files_are_labelled_by_their_switch(tmp_path: Path) -> None:
    for switch in (0, 1):
        data = json.loads((report.RESULTS / "throughput-fixed.json").read_text())
        data["rows"] = data["rows"][:1]
        (tmp_path / f"queued{switch}-throughput-fixed.json").write_text(json.dumps(data))
    text = "\n".join(report.queued(tmp_path, charts=False))
    rows = [line for line in text.splitlines() if line.startswith("| fixed set")]
    assert [row.split(" | ")[0].rsplit(", ", 1)[-1] for row in rows] == [
        "THREADLOADER_QUEUED_DECODE=0",
        "THREADLOADER_QUEUED_DECODE=1",
    ]


def test_startup_columns_follow_the_rows(tmp_path: Path) -> None:
    data = json.loads((report.RESULTS / "throughput-fixed.json").read_text())
    data["rows"][0] |= {"startup_after_pause_s": 0.25}
    (tmp_path / "throughput-fixed.json").write_text(json.dumps(data))
    text = "\n".join(report.memory(tmp_path, charts=False))
    assert "| startup s | startup after pause s |" in text and "| 0.25 |" in text


def test_the_pages_name_no_issues() -> None:
    """Results are current, not a lab notebook: git's history keeps which run answered which issue."""
    for path in (report.DOC, report.README, report.DOC.with_name("design.md")):
        assert re.findall(r"\bissues?\b|#\d", path.read_text(), re.IGNORECASE) == [], path


def test_the_readme_rows_name_the_batch_where_files_differ_by_it(tmp_path: Path) -> None:
    data = json.loads((report.RESULTS / "throughput-fixed.json").read_text())
    (tmp_path / "throughput-fixed.json").write_text(json.dumps(data))
    for row in data["rows"]:
        row["batch_size"] = 32
    (tmp_path / "throughput-b32-fixed.json").write_text(json.dumps(data))
    summary = report.results_summary(tmp_path)
    assert "256x256 JPEGs, batch 64 |" in summary and "256x256 JPEGs, batch 32 |" in summary
    (tmp_path / "throughput-b32-fixed.json").unlink()
    assert "batch" not in report.results_summary(tmp_path)  # one batch size: the rows say none


def test_five_training_files_draw_and_memory_reads_in_gigabytes(tmp_path: Path) -> None:
    """The chart's fixed-input line took the file's colour without wrapping: a fifth file raised
    IndexError. The summary divided MiB by 1000 and called it GB (5% low)."""
    data = json.loads((report.RESULTS / "training.json").read_text())
    for i in range(5):
        data["hardware"] |= {"python": f"3.1{i}.0"}
        (tmp_path / f"training-{i}.json").write_text(json.dumps(data))
    found = report.load(tmp_path, "training*.json")
    report.training_chart(found)(tmp_path / "training.png")
    assert (tmp_path / "training.png").stat().st_size > 0
    eager = [
        r["extra_device_mb"]
        for r in data["rows"]
        if r["spec"]["loader"] == "threadloader"
        and r["spec"]["kind"] == "eager"
        and report.default_configuration(r)
    ]
    summary = report.training_summary(tmp_path)
    low, high = (f"{mib * 2**20 / 1e9:.1f}" for mib in (min(eager), max(eager)))
    assert f"| {low}-{high} GB |" in summary or f"| {low} GB |" in summary


def test_the_gpus_data_wait_stands_beside_the_hosts(tmp_path: Path) -> None:
    data = json.loads((report.RESULTS / "training.json").read_text())
    row = next(r for r in data["rows"] if r["spec"]["loader"] == "threadloader" and r["status"] == "ok")
    row["data_wait_frac"], row["device_wait_frac"] = [0.01, 0.02, 0.03], [0.10, 0.12, 0.50]
    (tmp_path / "training.json").write_text(json.dumps(data))
    text = "\n".join(report.training_table(report.load(tmp_path, "training*.json")))
    assert "| 2% (GPU 12%) |" in text


#: The training rows' measures that older files lack: each table below shows only the rows that have them.
DIAGNOSTICS = (
    "main_cpu_ms_per_step",
    "main_voluntary_per_step",
    "main_involuntary_per_step",
    "process_cores",
    "stage_ms_per_batch",
)


def _training_without_diagnostics() -> dict:
    """The committed training.json with no row's diagnostics, as a file from before they were measured."""
    data = json.loads((report.RESULTS / "training.json").read_text())
    for row in data["rows"]:
        for name in DIAGNOSTICS:
            row.pop(name, None)
    return data


def test_main_thread_table_shows_each_measuring_rows_median_window(tmp_path: Path) -> None:
    data = _training_without_diagnostics()
    measured = next(r for r in data["rows"] if r["status"] == "ok" and r["spec"]["loader"] == "threadloader")
    measured |= {
        "ms_per_step": [30.0, 50.0, 35.0],
        "main_cpu_ms_per_step": [20.0, 29.0, 21.0],
        "main_voluntary_per_step": [50.0, 90.0, 60.0],
        "main_involuntary_per_step": [1.0, 9.0, 3.0],
        "process_cores": [4.0, 9.0, 5.0],
    }
    (tmp_path / "training.json").write_text(json.dumps(data))
    lines = report.main_thread_table(report.load(tmp_path, "training*.json"))
    spec = measured["spec"]
    body = [line for line in lines if line.startswith("| Python")]
    # Only the row that measured them, each value its median over the windows.
    expected = f"| Python 3.12.3 | {spec['kind']} | {spec['pipeline']} | ThreadLoader, capi "
    assert body == [expected + "| 35.0 | 21.0 | 60.0 | 3.0 | 5.0 |"]


def test_no_main_thread_table_for_files_without_the_measures(tmp_path: Path) -> None:
    (tmp_path / "training.json").write_text(json.dumps(_training_without_diagnostics()))
    found = report.load(tmp_path, "training*.json")
    assert report.main_thread_table(found) == [] and report.stage_table(found) == []


def test_stage_table_shows_each_stages_median_window_beside_the_step(tmp_path: Path) -> None:
    data = _training_without_diagnostics()
    measured = next(r for r in data["rows"] if r["status"] == "ok" and r["spec"]["loader"] == "threadloader")
    measured |= {
        "ms_per_step": [30.0, 50.0, 35.0],
        "stage_ms_per_batch": [
            {"read": 1.0, "decode": 9.0, "wait": 0.5},
            {"read": 3.0, "decode": 5.0, "wait": 0.1},
            {"read": 2.0, "decode": 7.0, "wait": 0.3},
        ],
    }
    (tmp_path / "training.json").write_text(json.dumps(data))
    lines = report.stage_table(report.load(tmp_path, "training*.json"))
    assert "| file | step | pipeline | loader | ms/step | read ms | decode ms | wait ms |" in lines
    spec = measured["spec"]
    body = [line for line in lines if line.startswith("| Python")]
    expected = f"| Python 3.12.3 | {spec['kind']} | {spec['pipeline']} | ThreadLoader, capi "
    assert body == [expected + "| 35.0 | 2.00 | 7.00 | 0.30 |"]


def test_throughput_stage_table_shows_the_rows_that_recorded_stages(tmp_path: Path) -> None:
    data = json.loads((report.RESULTS / "throughput-fixed.json").read_text())
    for row in data["rows"]:
        row.pop("stage_ms_per_batch", None)
    (tmp_path / "throughput-fixed.json").write_text(json.dumps(data))
    assert report.throughput_stage_table(report.load(tmp_path, "throughput-*.json")) == []
    ours = next(r for r in data["rows"] if r["loader"] == "threadloader")
    ours |= {"ms_per_batch": 4.5, "stage_ms_per_batch": {"read": 1.25, "decode": 3.0}}
    (tmp_path / "throughput-fixed.json").write_text(json.dumps(data))
    lines = report.throughput_stage_table(report.load(tmp_path, "throughput-*.json"))
    assert "| set | loader | ms/batch | read ms | decode ms |" in lines
    assert [line for line in lines if ours["name"] in line] == [
        f"| fixed set, 256x256, batch 64 | {ours['name']} | 4.5 | 1.25 | 3.00 |"
    ]


def test_the_ramp_section_shows_each_window_in_order(tmp_path: Path) -> None:
    """A row's windows one column each, in the order they ran: the start shows as it went."""
    shutil.copy(report.RESULTS / "training.json", tmp_path / "training.json")
    data = json.loads((tmp_path / "training.json").read_text())
    (row,) = [r for r in data["rows"] if r["status"] == "ok" and r["spec"]["loader"] == "threadloader"][:1]
    row["images_per_s"] = [250.0, 2015.0, 3422.0, 3384.0]
    row["stage_ms_per_batch"] = [{"decode": 53.6, "decode_lock": 12.9}, {"decode": 27.9, "decode_lock": 13.0}]
    row["started_on_cpu"] = [1600, 0]
    data["rows"] = [row]
    (tmp_path / "ramp-training-h100.json").write_text(json.dumps(data))
    lines = report.ramp(tmp_path, charts=False)
    header = next(line for line in lines if line.startswith("| file |"))
    assert header.endswith("| per window | 1 | 2 | 3 | 4 |")
    rates = next(line for line in lines if "| img/s |" in line)
    assert rates.endswith("| img/s | 250 | 2,015 | 3,422 | 3,384 |")
    waits = next(line for line in lines if "| decode_lock ms |" in line)
    assert waits.endswith("| decode_lock ms | 12.9 | 13.0 |  |  |")
    assert next(line for line in lines if "| Pillow start |" in line).endswith("| 1,600 | 0 |  |  |")
    assert "No results yet (`docs/results/ramp-training*.json`)." in report.page(tmp_path / "none")
