"""No test module imports a conftest by name.

pytest loads tests/conftest.py and tests/compose/conftest.py as modules both named
``conftest``; ``from conftest import …`` then finds whichever was loaded first, and the
whole suite stopped at collection once tests/compose had a conftest of its own.
Fixtures come from conftests by name; plain helpers live in the test module."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
IMPORTS_A_CONFTEST = re.compile(r"^\s*(from\s+conftest\s+import|import\s+conftest\b)", re.M)


def test_no_test_module_imports_a_conftest_by_name() -> None:
    offenders = [
        str(path.relative_to(TESTS))
        for path in sorted(TESTS.rglob("*.py"))
        if IMPORTS_A_CONFTEST.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []
