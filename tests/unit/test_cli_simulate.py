"""``gpupool simulate``: every example scenario runs, deterministically; bad scenarios name their line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpupool.cli.audit import verify
from gpupool.cli.log_source import file_entry
from gpupool.cli.main import main
from gpupool.eventlog.port import StoredEvent
from gpupool.events import (
    Assigned,
    NodeConfigured,
    PodReady,
    PodRejected,
    Released,
    decode_envelope,
)

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))
GPUPOOL = ROOT / ".venv" / "bin" / "gpupool"


def simulate_in_process(scenario: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["simulate", str(scenario)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def test_there_are_example_scenarios() -> None:
    names = {path.stem for path in SCENARIOS}
    assert {
        "worked-example",
        "preemption-priority",
        "fairness-max-duration",
        "backfill",
        "static-node",
        "invalid-pods",
    } <= names


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[path.stem for path in SCENARIOS])
def test_every_scenario_simulates_deterministically_and_verifies(
    scenario: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = simulate_in_process(scenario, capsys)
    second = simulate_in_process(scenario, capsys)
    assert first == second
    lines = first.splitlines()
    assert lines, "a scenario produces at least its node's events"
    entries = [
        file_entry(seq, line.encode(), subject_prefix="gpupool.log")
        for seq, line in enumerate(lines, start=1)
    ]
    assert all(isinstance(entry, StoredEvent) for entry in entries)
    report = verify(entries)
    assert report.violations == []


def test_output_is_identical_across_processes_and_hash_seeds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Another interpreter, with another hash seed, writes the same bytes for every scenario."""
    expected = {path.name: simulate_in_process(path, capsys) for path in SCENARIOS}
    program = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from gpupool.cli.main import main
        for path in sys.argv[1:]:
            assert main(["simulate", path, "--output", str(Path(OUT) / Path(path).name)]) == 0
        """
    ).replace("OUT", repr(str(tmp_path)))
    subprocess.run(
        [sys.executable, "-c", program, *map(str, SCENARIOS)],
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    for name, text in expected.items():
        assert (tmp_path / name).read_text(encoding="utf-8") == text, name


def test_the_console_script_prints_the_worked_example_log(
    capsys: pytest.CaptureFixture[str],
) -> None:
    expected = simulate_in_process(ROOT / "scenarios" / "worked-example.yaml", capsys)
    done = subprocess.run(
        [str(GPUPOOL), "simulate", "scenarios/worked-example.yaml"],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == expected


def test_output_file_holds_the_same_bytes_as_stdout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    scenario = ROOT / "scenarios" / "preemption-priority.yaml"
    printed = simulate_in_process(scenario, capsys)
    target = tmp_path / "log.jsonl"
    assert main(["simulate", str(scenario), "--output", str(target)]) == 0
    assert capsys.readouterr().out == ""
    assert target.read_bytes() == printed.encode()


def test_worked_example_log_is_the_spec_story(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/behaviour.md: T1 A on GPU 0, C on GPU 1, D then B wait; T2 C completes, D gets GPU 1, then B GPU 0."""
    out = simulate_in_process(ROOT / "scenarios" / "worked-example.yaml", capsys)
    story: list[tuple[int, str, str, int | None]] = []
    for line in out.splitlines():
        envelope = decode_envelope(line.encode())
        event = envelope.event
        at = int((envelope.time - envelope.time.replace(minute=0, second=0)).total_seconds())
        if isinstance(event, PodReady):
            story.append((at, "ready", event.pod.name, None))
        elif isinstance(event, Assigned):
            story.append((at, "assigned", event.pod.name, event.gpu_index))
        elif isinstance(event, Released):
            story.append((at, f"released {event.reason}", event.pod.name, event.gpu_index))
    assert story == [
        (0, "ready", "pod-a", None),
        (0, "assigned", "pod-a", 0),
        (1, "ready", "pod-c", None),
        (1, "assigned", "pod-c", 1),
        (2, "ready", "pod-d", None),  # T1: the head; GPU 0 has 50 idle, D's limit is 100
        (3, "ready", "pod-b", None),  # B waits behind D (served in order)
        (60, "released completed", "pod-c", 1),  # T2
        (60, "assigned", "pod-d", 1),  # phase 1
        (60, "assigned", "pod-b", 0),  # phase 2, beside A
    ]


def test_invalid_pods_are_rejected_with_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    out = simulate_in_process(ROOT / "scenarios" / "invalid-pods.yaml", capsys)
    rejected: dict[str, str] = {}
    for line in out.splitlines():
        event = decode_envelope(line.encode()).event
        if isinstance(event, PodRejected):
            rejected.setdefault(event.pod.name, event.reason)
    assert rejected == {
        "limit-below-request": "LimitBelowRequest",
        "no-memory": "MissingShareResource",
        "more-than-one-gpu": "InvalidPercentage",
        "not-a-number": "InvalidPercentage",
        "wrong-class": "UnsupportedComputeClass",
        "wrong-policy": "PolicyMismatch",
        "unknown-policy": "InvalidSharePolicy",
        "too-much": "InsufficientAllocatable",
        "on-busy-node": "NodeNotEnabled",
    }


# --------------------------------------------------------------------------- invalid scenarios

NODE = "nodes:\n  - {name: n1, gpus: 1}\n"
POD = "pods:\n  - {name: p, node: n1, requests: {core: 10, memory: 10}}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            NODE + POD + "timeline:\n  - {at: 0, action: ready, pod: p}\n"
            "  - {at: 1, action: redy, pod: p}\n",
            "7: timeline[1].action: 'redy' is not one of ready, complete, fail, oom, cancel, "
            "delete, set-policy",
            id="unknown-action",
        ),
        pytest.param(
            "nodes:\n  - name: n1\n    gpus: 1\n    gpu_mem: 10\n",
            "4: nodes[0].gpu_mem: unknown field (known fields: name, gpus, gpu_memory_mib, "
            "policy, qos, exclusive_gpu_pods)",
            id="unknown-field",
        ),
        pytest.param(
            "nodes:\n  - name: n1\n    gpus: two\n",
            "3: nodes[0].gpus: expected int, got str ('two')",
            id="wrong-type",
        ),
        pytest.param(
            "nodes:\n  - gpus: 2\n", "2: nodes[0]: missing required field 'name'", id="missing"
        ),
        pytest.param(
            "nodes:\n  - name: n1\n    gpus: [1, 2\npods: []\n",
            "4: invalid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence "
            "started at line 3)",
            id="bad-yaml",
        ),
        pytest.param(
            "nodes:\n  - name: n1\n    gpus: 1\n    gpus: 2\n",
            "4: nodes[0].gpus: duplicate key",
            id="duplicate-key",
        ),
        pytest.param(
            NODE + POD + "timeline:\n  - {at: 0, action: ready, pod: p}\n"
            "  - {at: 3, action: complete, pod: q}\n",
            "7: timeline[1].pod: pod default/q is not in pods (known: default/p)",
            id="unknown-pod",
        ),
        pytest.param(
            NODE + "pods:\n  - {name: p, node: n2, requests: {core: 10, memory: 10}}\n",
            "4: pods[0].node: node 'n2' is not in nodes (known: n1)",
            id="unknown-node",
        ),
        pytest.param(
            NODE + "timeline:\n  - {at: 0, action: set-policy, policy: none}\n",
            "4: timeline[0]: set-policy needs a node",
            id="set-policy-without-node",
        ),
        pytest.param(
            NODE + "start: 2025-04-22 08:00:00\n",
            "3: start: needs a time zone, e.g. 2025-01-01T00:00:00Z",
            id="naive-start",
        ),
        pytest.param(
            "- a\n- b\n", "1: a scenario is a mapping with nodes, pods and timeline", id="list"
        ),
        pytest.param("", "1: the file is empty; a scenario needs at least nodes", id="empty"),
    ],
)
def test_invalid_scenarios_name_line_and_field(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text(text, encoding="utf-8")
    assert main(["simulate", str(scenario)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"gpupool simulate: {scenario}:{message}\n"


def test_a_qos_mapping_is_accepted_as_the_annotation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "qos.yaml"
    scenario.write_text(
        "nodes:\n  - name: n1\n    gpus: 1\n    qos: {preemptEnabled: true, podMaxDurationMinutes: 5}\n",
        encoding="utf-8",
    )
    out = simulate_in_process(scenario, capsys)
    configured = decode_envelope(out.splitlines()[1].encode()).event
    assert isinstance(configured, NodeConfigured)
    assert configured.qos.preempt_enabled is True
    assert configured.qos.pod_max_duration_minutes == 5


def test_the_console_script_exits_2_on_a_bad_scenario(tmp_path: Path) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text(NODE + "timeline:\n  - {at: x, action: ready, pod: p}\n", encoding="utf-8")
    done = subprocess.run(
        [str(GPUPOOL), "simulate", str(scenario)],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == b""
    assert done.stderr.decode() == (
        f"gpupool simulate: {scenario}:4: timeline[0].at: expected float, got str ('x')\n"
    )


def test_a_missing_scenario_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.yaml"
    assert main(["simulate", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"gpupool simulate: {missing}: cannot read: No such file or directory\n"
    )
