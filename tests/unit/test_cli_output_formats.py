"""The read commands' kubectl-like conventions: ``-o json|yaml`` is the read model and parses;
``state`` is at now by default; colour only on a terminal, off with NO_COLOR; ``--watch``
prints again as the log grows, with waits measured against the clock."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupool.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
NODE = "cn-wulanchabu-c.cr-xxx"
GPUPOOL = [sys.executable, "-m", "gpupool.cli.main"]


@pytest.fixture(scope="module")
def we(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("logs") / "we.jsonl"
    assert (
        main(["simulate", str(ROOT / "scenarios" / "worked-example.yaml"), "-o", str(target)]) == 0
    )
    return target


def run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_log_json_is_one_document_of_entries(we: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "log", "--log", str(we), "--pod", "pod-b", "-o", "json")
    entries = json.loads(out)
    assert [(e["seq"], e["envelope"]["event"]["type"]) for e in entries] == [
        (4, "PodRegistered"),
        (12, "PodReady"),
        (15, "Assigned"),
    ]
    assert entries[2]["envelope"]["event"]["gpu_index"] == 0


def test_log_yaml_parses_to_the_same_entries(we: Path, capsys: pytest.CaptureFixture[str]) -> None:
    as_json = json.loads(run(capsys, "log", "--log", str(we), "-o", "json"))
    as_yaml = yaml.safe_load(run(capsys, "log", "--log", str(we), "-o", "yaml"))
    assert as_yaml == as_json


def test_log_wide_adds_the_id_and_subject(we: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "log", "--log", str(we), "--type", "Assigned", "-o", "wide")
    header, first, *_ = out.splitlines()
    assert header.split() == [
        "SEQ",
        "TIME",
        "OFFSET",
        "TYPE",
        "NODE",
        "POD",
        "ID",
        "SUBJECT",
        "DETAILS",
    ]
    assert first.split()[6:8] == ["sim-00000008", "gpupool.log.cn-wulanchabu-c_cr-xxx.simulator"]


def test_history_json(we: Path, capsys: pytest.CaptureFixture[str]) -> None:
    history = json.loads(run(capsys, "history", "pod-b", "--log", str(we), "-o", "json"))
    assert history["pod"] == {"namespace": "default", "name": "pod-b"}
    assert [(s["kind"], s.get("position"), s.get("gpu_index")) for s in history["steps"]] == [
        ("registered", None, None),
        ("ready", 2, None),
        ("moved", 1, None),
        ("assigned", None, 0),
    ]
    assert history["steps"][3]["waited"] == "PT57S"


def test_state_json_at_t1(we: Path, capsys: pytest.CaptureFixture[str]) -> None:
    view = json.loads(run(capsys, "state", "--at", "+5s", "--log", str(we), "-o", "json"))
    (node,) = view["nodes"]
    assert [(q["position"], q["pod"]["name"], q["waited"]) for q in node["queue"]] == [
        (1, "pod-d", "PT3S"),
        (2, "pod-b", "PT2S"),
    ]
    assert [[p["pod"]["name"] for p in g["pods"]] for g in node["gpus"]] == [["pod-a"], ["pod-c"]]


def test_state_yaml_at_t1(we: Path, capsys: pytest.CaptureFixture[str]) -> None:
    view = yaml.safe_load(run(capsys, "state", "--at", "+5s", "--log", str(we), "-o", "yaml"))
    assert [q["pod"]["name"] for q in view["nodes"][0]["queue"]] == ["pod-d", "pod-b"]


def test_state_is_at_now_by_default(we: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = datetime.now(UTC)
    view = json.loads(run(capsys, "state", "--log", str(we), "-o", "json"))
    after = datetime.now(UTC)
    at = datetime.fromisoformat(view["at"])
    assert before <= at <= after
    assert view["entries"] == 15


def test_explain_json_carries_the_verdict_and_reasons(
    we: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run(capsys, "explain", "pod-b", "--at", "+5s", "--log", str(we), "-o", "json")
    explanation = json.loads(out)
    assert (explanation["phase"], explanation["position"], explanation["verdict"]) == (
        "waiting",
        2,
        "head-of-line",
    )
    kinds = [r["kind"] for r in explanation["reasons"]]
    assert kinds[:4] == ["gpu-fits", "gpu-too-full", "head-of-line", "backfill-off"]


def test_explain_wide_names_each_reason_kind(we: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "explain", "pod-d", "--at", "+5s", "--log", str(we), "-o", "wide")
    assert "[victim-protected]" in out


def test_watch_with_at_is_refused(we: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["state", "--watch", "--at", "+5s", "--log", str(we)]) == 2
    assert "cannot be combined with --at" in capsys.readouterr().err


# --------------------------------------------------------------------------- colour


def on_a_terminal(args: list[str], env: dict[str, str]) -> str:
    """Run the command with its stdout on a pseudo-terminal; return what it wrote."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [*GPUPOOL, *args], stdout=secondary, stderr=subprocess.DEVNULL, env=env, cwd=ROOT
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the terminal's other side is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    assert process.wait(timeout=60) == 0
    return b"".join(chunks).decode()


@pytest.fixture
def plain_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    env["TERM"] = "xterm-256color"
    return env


def test_colour_on_a_terminal(we: Path, plain_env: dict[str, str]) -> None:
    out = on_a_terminal(["history", "pod-b", "--log", str(we)], plain_env)
    assert "\x1b[32m" in out  # the assignment in green
    assert "assigned GPU 0" in out


def test_no_colour_with_no_color(we: Path, plain_env: dict[str, str]) -> None:
    out = on_a_terminal(["history", "pod-b", "--log", str(we)], plain_env | {"NO_COLOR": "1"})
    assert "assigned GPU 0" in out
    assert "\x1b[32m" not in out and "\x1b[33m" not in out


def test_no_colour_into_a_pipe(we: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "history", "pod-b", "--log", str(we))
    assert "\x1b[" not in out


# --------------------------------------------------------------------------- --watch


Document = dict[str, Any]


def read_until(
    process: subprocess.Popen[bytes], done: Callable[[Document], bool], within: float
) -> list[Document]:
    """The JSON documents the watch printed ('---' lines between them), up to the first that
    ``done`` accepts."""
    assert process.stdout is not None
    buffer = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(process.stdout.fileno(), 65536)
        if not chunk:
            break
        buffer += chunk
        parts = buffer.decode().split("---\n")
        complete = [json.loads(p) for p in parts[:-1] if p.strip()]
        for index, document in enumerate(complete):
            if done(document):
                return complete[: index + 1]
    raise AssertionError(f"the watch printed {buffer.decode()!r}")


def test_state_watch_follows_the_log_and_measures_waits_by_the_clock(
    we: Path, tmp_path: Path
) -> None:
    lines = we.read_bytes().splitlines(keepends=True)
    growing = tmp_path / "growing.jsonl"
    growing.write_bytes(b"".join(lines[:12]))  # up to #12: D and B wait
    process = subprocess.Popen(
        [*GPUPOOL, "state", "--watch", "--log", str(growing), "-o", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        (first,) = read_until(process, lambda _document: True, within=60)
        started = datetime.now(UTC)
        queue = first["nodes"][0]["queue"]
        assert [q["pod"]["name"] for q in queue] == ["pod-d", "pod-b"]
        # the log's times are in 2025: waits measured by the clock are far longer than 3s
        ready_since = datetime.fromisoformat(queue[0]["ready_since"])
        assert datetime.fromisoformat(first["at"]) - ready_since > timedelta(days=1)
        with growing.open("ab") as handle:
            handle.write(b"".join(lines[12:]))  # C completes, D and B get GPUs
        documents = read_until(process, lambda document: document["entries"] == 15, within=60)
        emptied = documents[-1]
        assert emptied["nodes"][0]["queue"] == []
        assert datetime.fromisoformat(emptied["at"]) >= started
    finally:
        process.kill()
        process.wait()


def test_explain_watch_explains_by_the_clock(we: Path) -> None:
    """Without --at, a watch explains the pod as of the clock's now, not the log's last entry."""
    process = subprocess.Popen(
        [*GPUPOOL, "explain", "pod-b", "--watch", "--log", str(we), "-o", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        before = datetime.now(UTC)
        (first,) = read_until(process, lambda _document: True, within=60)
        assert first["phase"] == "running"  # the whole log is folded: B runs on GPU 0
        assert datetime.fromisoformat(first["at"]) >= before - timedelta(seconds=5)
    finally:
        process.kill()
        process.wait()
