"""The gpupool command's conventions: --version, --help on every subcommand (exit 0), and an
error in a subcommand's options answered with that subcommand's usage (exit 2)."""

from __future__ import annotations

import argparse

import pytest

from gpupool.cli.main import build_parser, gpupool_version, main


def subcommands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    found: list[tuple[str, ...]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((*prefix, name))
                found.extend(subcommands(sub, (*prefix, name)))
    return found


ALL = subcommands(build_parser())


def test_every_command_module_is_reachable() -> None:
    names = {words[0] for words in ALL}
    assert {"simulate", "log", "history", "state", "verify", "explain", "run", "up", "pod",
            "demo"} <= names  # fmt: skip
    assert ("pod", "add") in ALL


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"gpupool {gpupool_version()}"
    assert gpupool_version()[0].isdigit()


@pytest.mark.parametrize("words", ALL, ids=" ".join)
def test_help_on_every_subcommand_exits_zero(
    words: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main([*words, "--help"])
    except SystemExit as exited:
        code = exited.code  # type: ignore[assignment]
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: gpupool {' '.join(words)}"), out[:200]
    assert "SPEC.md" not in out and "source document" not in out


@pytest.mark.parametrize("words", [w for w in ALL if w != ("run",) and w != ("pod",)], ids=" ".join)
def test_an_unknown_option_shows_the_subcommands_usage(
    words: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*words, "--no-such-option"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: gpupool {' '.join(words)} "), err[:200]
    # the subcommand's own error: the unknown option, or first what it requires
    assert f"gpupool {' '.join(words)}: error: " in err
    assert "--no-such-option" in err or "required" in err


def test_run_refuses_an_unknown_option_with_its_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--no-such-option", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "unknown option '--no-such-option'" in err and "usage: gpupool run" in err


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for name in {words[0] for words in ALL}:
        assert f"    {name}" in out, name
