"""Every test the docs cite exists: ``tests/….py`` files and their ``::test_name``s.

The docs (README.md, docs/*.md) prove their claims by naming tests. A reference is
``tests/<path>.py`` or ``tests/<path>.py::<name>``; ``…::<name>`` names a test of the last
file cited before it in the same document, ``…<suffix>.py::<name>`` one of the last cited
file whose path ends with ``<suffix>.py``. A name is a function (``def``/``async def``) or a
class of that file, at its top level or in a class; a ``[param]`` id is ignored.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("**/*.md")])
REFERENCE = re.compile(
    r"(?P<path>tests/[A-Za-z0-9_/.-]+\.py|…(?P<suffix>[A-Za-z0-9_/.-]*\.py)?)"
    r"(?:::(?P<name>[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*))?"
)


@cache
def names_in(path: Path) -> frozenset[str]:
    """The functions and classes of a test file, top level and one class deep (``C::m``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(member.name)
                    names.add(f"{node.name}::{member.name}")
    return frozenset(names)


def references(text: str) -> list[tuple[str, str | None, str]]:
    """(file, name or None, as written) for each reference in a document, ``…`` resolved;
    a ``…`` that cannot be resolved yields the file ``?``."""
    found: list[tuple[str, str | None, str]] = []
    cited: list[str] = []
    for match in REFERENCE.finditer(text):
        path, name = match["path"], match["name"]
        if path.startswith("tests/"):
            cited.append(path)
            found.append((path, name, match[0]))
        elif name is not None:  # a bare "…" (an ellipsis in prose) is no reference
            suffix = match["suffix"] or ""
            earlier = [p for p in cited if p.endswith(suffix)]
            found.append((earlier[-1] if earlier else "?", name, match[0]))
    return found


def test_an_ellipsis_reference_names_a_test_of_the_last_file_cited_before_it() -> None:
    text = (
        "`tests/a/test_x.py::test_one`, `…::test_two`; then `tests/b/test_y.py`, "
        "`…::test_three`, `…x.py::test_four`, and an ellipsis … in prose; `…z.py::test_five`"
    )
    assert references(text) == [
        ("tests/a/test_x.py", "test_one", "tests/a/test_x.py::test_one"),
        ("tests/a/test_x.py", "test_two", "…::test_two"),
        ("tests/b/test_y.py", None, "tests/b/test_y.py"),
        ("tests/b/test_y.py", "test_three", "…::test_three"),
        ("tests/a/test_x.py", "test_four", "…x.py::test_four"),
        ("?", "test_five", "…z.py::test_five"),
    ]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_test_a_document_cites_exists(document: Path) -> None:
    missing = []
    for path, name, written in references(document.read_text()):
        file = ROOT / path
        if path == "?" or not file.is_file():
            missing.append(f"{written}: no file {path}")
        elif name is not None and name not in names_in(file):
            missing.append(f"{written}: no {name} in {path}")
    assert missing == [], "\n".join(missing)
