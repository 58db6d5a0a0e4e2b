"""What the notebook and the library's messages tell a user to install exists: threadloader is not on
PyPI, so ``pip install 'threadloader[cu12]'`` finds nothing. They name a checkout's extras
(``pip install -e ".[cu13]"``), or the packages an extra declares, as pyproject.toml spells them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from threadloader import _remote

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parent.parent
#: An install by the package's own name, with an extra: what PyPI cannot serve.
BY_NAME = re.compile(r"threadloader\[(cu|remote|examples|test|bench)")


def extras() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return dict(tomllib.load(file)["project"]["optional-dependencies"])


def requirement(extra: str) -> str:
    """The extra's one requirement without its version: ``fsspec[http]>=2023.6`` -> ``fsspec[http]``."""
    (declared,) = extras()[extra]
    return re.split(r"[<>=!~; ]", declared, maxsplit=1)[0]


def notebook_markdown() -> str:
    cells = json.loads((ROOT / "examples" / "notebook.ipynb").read_text())["cells"]
    return "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")


def test_the_notebook_installs_from_a_checkout_with_extras_that_exist() -> None:
    text = notebook_markdown()
    assert not BY_NAME.search(text), BY_NAME.search(text)
    named = re.findall(r'"\.\[([a-z0-9,]+)\]"', text)
    assert named, "the notebook says how to install threadloader"
    assert {extra for group in named for extra in group.split(",")} <= set(extras()), named
    # The README's words for the GPU: both CUDA majors, and how to tell which torch has.
    assert {"cu12", "cu13"} <= {extra for group in named for extra in group.split(",")}
    assert "torch.version.cuda" in text


def test_the_missing_fsspec_message_names_the_remote_extras_package(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "fsspec" or m.startswith("fsspec.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now raises ImportError
    with pytest.raises(ImportError) as raised:
        _remote.require_fsspec("s3://bucket/a.jpg")
    message = str(raised.value)
    assert f"pip install '{requirement('remote')}'" in message and "pip install -e '.[remote]'" in message
    assert not BY_NAME.search(message), message


def test_no_library_message_installs_threadloader_by_name() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "threadloader").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if BY_NAME.search(line)
    ]
    assert found == []
