"""``on_error="skip"`` logs a bad sample once per loader, and counts it every time it is skipped."""

from __future__ import annotations

import logging

import pytest

from threadloader import ThreadLoader

from .conftest import encode, photo

BAD = (1, 4)


@pytest.fixture(scope="module")
def samples() -> list[tuple[bytes, int]]:
    good = encode(photo(16, 24), quality=90)
    return [(b"not an image" if i in BAD else good, i) for i in range(6)]


def skip_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "threadloader" and "skipping" in r.getMessage()
    ]


@pytest.mark.parametrize("num_threads", [1, 3])
def test_a_bad_sample_is_logged_once_over_epochs_and_counted_each_time(
    samples: list[tuple[bytes, int]], caplog: pytest.LogCaptureFixture, num_threads: int
) -> None:
    epochs = 4
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        loader = ThreadLoader(samples, batch_size=2, shuffle=True, num_threads=num_threads, on_error="skip")
        for _ in range(epochs):
            kept = sorted(i for _, targets in loader for i in targets.tolist())
            assert kept == [i for i in range(len(samples)) if i not in BAD]
        loader.close()
    lines = skip_lines(caplog)
    assert sorted(int(line.split()[2]) for line in lines) == list(BAD), lines
    assert all("(<12 bytes in memory>): decode failed: " in line for line in lines), lines
    stats = loader.stats()
    assert (stats.skipped, stats.errors) == (epochs * len(BAD), epochs * len(BAD))


def test_after_load_state_dict_with_another_seed_it_is_still_once(
    samples: list[tuple[bytes, int]], caplog: pytest.LogCaptureFixture
) -> None:
    """A state with another seed makes the loader a new producer: the log is the loader's, not its."""
    state = ThreadLoader(samples, batch_size=2, shuffle=True, seed=7).state_dict()
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        loader = ThreadLoader(samples, batch_size=2, shuffle=True, on_error="skip")
        list(loader)
        loader.load_state_dict(state)
        list(loader)
        loader.close()
    assert len(skip_lines(caplog)) == len(BAD)
    assert loader.stats().skipped == 2 * len(BAD)


def test_each_loader_logs_its_own(samples: list[tuple[bytes, int]], caplog: pytest.LogCaptureFixture) -> None:
    """Two loaders over the same samples (a second run in a notebook) each say what they skip."""
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        for _ in range(2):
            with ThreadLoader(samples, batch_size=2, on_error="skip") as loader:
                list(loader)
    assert len(skip_lines(caplog)) == 2 * len(BAD)
