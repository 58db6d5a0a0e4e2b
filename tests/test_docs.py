"""What the README says about the suite stays true as tests are added: it names why tests are skipped,
never how many (counts that drifted from what the commands print)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
#: "103 tests", "the 64 GPU tests", "39 skipped": a number of tests, however it is worded.
COUNT = re.compile(r"\b\d[\d,]*\s+(?:[\w-]+\s+){0,2}(?:tests?|skipped)\b", re.IGNORECASE)


def test_the_readme_counts_no_tests() -> None:
    assert COUNT.findall(README.read_text()) == []


def test_the_count_pattern_finds_the_old_wording() -> None:
    old = "Without a GPU, 103 tests are skipped, each with its reason: the 64 GPU tests (`-m gpu`)"
    assert COUNT.findall(old) == ["103 tests are skipped", "64 GPU tests"]
