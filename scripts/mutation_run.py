"""A small mutation run over the core's placement and preemption modules.

    uv run python scripts/mutation_run.py [--module placement|preemption] [--limit N]

Each mutant is one change to the module's syntax tree, written into a copy of
``libs/core/src`` in a temporary directory that comes first on ``PYTHONPATH`` (the
working tree is never touched): a comparison flipped or
loosened (``<`` / ``<=``, ``==`` / ``!=``), ``+`` / ``-`` swapped, ``and`` / ``or``
swapped, ``min`` / ``max`` swapped, a small integer constant moved by one, ``not``
dropped, and named mutants for rules that matter (the greedy victim search in place
of the smallest-set search). For each mutant the core's unit tests run (``pytest -x``,
the first failure kills it); a mutant no test kills *survives*. Prints one line per
mutant and the survivors; docs/testing.md lists them with what kills or explains
each. Deterministic (mutants in source order); not part of every CI run (``just
mutation``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "libs" / "core" / "src" / "gpupool" / "core"
MODULES = {"placement": CORE / "placement.py", "preemption": CORE / "preemption.py"}
TESTS = [
    "tests/unit/test_core_placement.py",
    "tests/unit/test_core_reservation.py",
    "tests/unit/test_core_preemption.py",
    "tests/unit/test_core_worked_example.py",
    "tests/unit/test_core_static.py",
    "tests/unit/test_core_releasing.py",
    "tests/unit/test_core_verification.py",
    "tests/unit/test_core_validation.py",
    "tests/unit/test_core_properties.py",
]

SWAPS: dict[type, type] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.And: ast.Or,
    ast.Or: ast.And,
}


@dataclass(frozen=True)
class Mutant:
    line: int
    what: str
    source: str


def _mutations(tree: ast.Module) -> Iterator[tuple[int, str, ast.Module]]:
    nodes = list(ast.walk(tree))
    for index, node in enumerate(nodes):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Compare):
            for position, op in enumerate(node.ops):
                if type(op) in SWAPS:
                    yield (
                        _edited(tree, index, lambda n, p=position: _swap_compare(n, p)),
                        line,
                        (f"{type(op).__name__} -> {SWAPS[type(op)].__name__}"),
                    )
        elif isinstance(node, ast.BinOp) and type(node.op) in SWAPS:
            yield (
                _edited(tree, index, _swap_binop),
                line,
                (f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}"),
            )
        elif isinstance(node, ast.BoolOp) and type(node.op) in SWAPS:
            yield (
                _edited(tree, index, _swap_boolop),
                line,
                (f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}"),
            )
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield _edited(tree, index, _drop_not), line, "drop not"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("min", "max"):
                other = "max" if node.func.id == "min" else "min"
                yield (
                    _edited(tree, index, lambda n, o=other: _rename_call(n, o)),
                    line,
                    (f"{node.func.id} -> {other}"),
                )
            if node.func.id == "_smallest_set":
                yield (
                    _edited(tree, index, lambda n: _rename_call(n, "_greedy_set")),
                    line,
                    ("smallest-set victim search -> greedy"),
                )
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int)
            and not isinstance(node.value, bool)
            and 0 <= node.value <= 2
        ):
            yield _edited(tree, index, _plus_one), line, f"{node.value} -> {node.value + 1}"


def _edited(tree: ast.Module, index: int, change: object) -> ast.Module:
    mutated = copy.deepcopy(tree)
    target = list(ast.walk(mutated))[index]
    change(target)  # type: ignore[operator]
    return mutated


def _swap_compare(node: ast.Compare, position: int) -> None:
    node.ops[position] = SWAPS[type(node.ops[position])]()


def _swap_binop(node: ast.BinOp) -> None:
    node.op = SWAPS[type(node.op)]()


def _swap_boolop(node: ast.BoolOp) -> None:
    node.op = SWAPS[type(node.op)]()


def _drop_not(node: ast.UnaryOp) -> None:
    node.op = ast.UAdd()  # +bool(x) is x's truth as an int: the negation is gone


def _rename_call(node: ast.Call, name: str) -> None:
    assert isinstance(node.func, ast.Name)
    node.func.id = name


def _plus_one(node: ast.Constant) -> None:
    node.value = node.value + 1


def mutants(path: Path) -> list[Mutant]:
    tree = ast.parse(path.read_text())
    found = []
    for mutated, line, what in _mutations(tree):
        if _in_docstring_or_annotation(tree, line):
            continue
        found.append(Mutant(line=line, what=what, source=ast.unparse(mutated)))
    return found


def _in_docstring_or_annotation(tree: ast.Module, line: int) -> bool:
    return line == 0


def killed(copy_root: Path, path: Path, mutant: Mutant) -> bool:
    target = copy_root / path.relative_to(CORE.parents[1])
    original = path.read_text()
    try:
        target.write_text(mutant.source + "\n")
        env = {**os.environ, "PYTHONPATH": str(copy_root)}
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        return result.returncode != 0
    finally:
        target.write_text(original)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", choices=sorted(MODULES), action="append")
    parser.add_argument("--limit", type=int, default=0, help="at most this many mutants per module")
    parser.add_argument(
        "--line", type=int, action="append", help="only mutants on this source line (repeatable)"
    )
    args = parser.parse_args()
    survivors: list[str] = []
    workdir = tempfile.TemporaryDirectory(prefix="gpupool-mutants-")
    copy_root = Path(workdir.name)
    shutil.copytree(CORE.parents[1], copy_root, dirs_exist_ok=True)  # libs/core/src
    try:
        run_all(args.module or sorted(MODULES), args.limit, args.line, copy_root, survivors)
    finally:
        workdir.cleanup()
    print()
    print(f"survivors: {len(survivors)}")
    for label in survivors:
        print(f"  {label}")
    return 1 if survivors else 0


def run_all(
    names: list[str], limit: int, lines: list[int] | None, copy_root: Path, survivors: list[str]
) -> None:
    for name in names:
        path = MODULES[name]
        todo = [m for m in mutants(path) if not lines or m.line in lines]
        if limit:
            todo = todo[:limit]
        for number, mutant in enumerate(todo, start=1):
            start = time.perf_counter()
            dead = killed(copy_root, path, mutant)
            label = f"{name}.py:{mutant.line} {mutant.what}"
            print(
                f"[{number}/{len(todo)}] {label}: {'killed' if dead else 'SURVIVED'} "
                f"({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
            if not dead:
                survivors.append(label)


if __name__ == "__main__":
    sys.exit(main())
