"""The audit commands on simulated logs, with exact expected output derived from the scenarios.

Two logs: ``scenarios/worked-example.yaml`` (docs/behaviour.md) and
``scenarios/preemption-priority.yaml``. The entry numbers below follow from the
scenarios: the simulator first reports the inventory and configures the node
(#1, #2), registers the pods in file order, then plays the timeline, each
command's events in the order the services would append them.

Worked example: #3..#6 register A, B, C, D; #7/#8 A ready and on GPU 0 (+0s);
#9/#10 C ready and on GPU 1 (+1s); #11 D ready (+2s, head); #12 B ready (+3s,
position 2); #13 C completes (+60s); #14 D gets GPU 1; #15 B gets GPU 0.

Preemption: #3..#6 register train-1, train-2, train-3, serving/infer (priority
1000); #7/#8 train-1 on GPU 0 (+0s); #9/#10 train-2 on GPU 1 (+5s); #11 infer
ready (+60s) and fits nowhere; #12 Preempted train-1 (lower priority, longest
hold) on GPU 0; #13 its Released(preempted); #14 train-1 ready again (requeue),
behind infer; #15 infer gets GPU 0; #16 train-3 ready (+65s); #17 train-2
completes (+75s); #18 train-1 gets GPU 1; #19 infer completes (+90s); #20
train-3 gets GPU 0; #21, #22 the trainings complete.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from gpupool.cli.main import main
from gpupool.events import Assigned, Envelope, PodRef, encode_envelope
from gpupool.events.codec import decode_envelope

ROOT = Path(__file__).resolve().parents[2]
NODE = "cn-wulanchabu-c.cr-xxx"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("logs")
    made = {}
    for name in ("worked-example", "preemption-priority"):
        target = directory / f"{name}.jsonl"
        assert main(["simulate", str(ROOT / "scenarios" / f"{name}.yaml"), "-o", str(target)]) == 0
        made[name] = target
    return made


def gpupool(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def lines(text: str) -> str:
    """Expected output: the block without its common indentation, ending in a newline."""
    return textwrap.dedent(text).lstrip("\n")


# --------------------------------------------------------------------------- history


def test_history_of_b_in_the_worked_example(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = gpupool(capsys, "history", "pod-b", "--log", str(logs["worked-example"]))
    assert code == 0
    assert out == lines(
        f"""
        history of default/pod-b on {NODE} (offsets from the first entry, 2025-01-01T00:00:00Z)
           +0s  2025-01-01T00:00:00Z  #4   registered on {NODE}: share-pool, requests core 50% memory 50%, limits core 50% memory 50%, priority 0
           +3s  2025-01-01T00:00:03Z  #12  ready: joins the queue at position 2 of 2
        +1m00s  2025-01-01T00:01:00Z  #14  position 1 of 1 (was 2): default/pod-d left the queue (assigned GPU 1)
        +1m00s  2025-01-01T00:01:00Z  #15  assigned GPU 0 (GPU-SIMULATED-{NODE}-0) after waiting 57s at positions 2, 1
        """
    )


def test_history_of_d_in_the_worked_example(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = gpupool(capsys, "history", "default/pod-d", "--log", str(logs["worked-example"]))
    assert code == 0
    assert out == lines(
        f"""
        history of default/pod-d on {NODE} (offsets from the first entry, 2025-01-01T00:00:00Z)
           +0s  2025-01-01T00:00:00Z  #6   registered on {NODE}: share-pool, requests core 50% memory 50%, limits core 100% memory 100%, priority 0
           +2s  2025-01-01T00:00:02Z  #11  ready: joins the queue at position 1 of 1
        +1m00s  2025-01-01T00:01:00Z  #14  assigned GPU 1 (GPU-SIMULATED-{NODE}-1) after waiting 58s at position 1
        """
    )


def test_history_of_the_preempted_pod(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = gpupool(capsys, "history", "train-1", "--log", str(logs["preemption-priority"]))
    assert code == 0
    assert out == lines(
        """
        history of default/train-1 on gpu-node-1 (offsets from the first entry, 2025-01-01T00:00:00Z)
           +0s  2025-01-01T00:00:00Z  #3   registered on gpu-node-1: share-pool, requests core 50% memory 50%, limits core 100% memory 100%, priority 0
           +0s  2025-01-01T00:00:00Z  #7   ready: joins the queue at position 1 of 1
           +0s  2025-01-01T00:00:00Z  #8   assigned GPU 0 (GPU-SIMULATED-gpu-node-1-0) after waiting 0s at position 1
        +1m00s  2025-01-01T00:01:00Z  #12  preempted by serving/infer on GPU 0 (reason priority) after holding it 1m00s
        +1m00s  2025-01-01T00:01:00Z  #13  released GPU 0: preempted after holding it 1m00s
        +1m00s  2025-01-01T00:01:00Z  #14  ready: joins the queue at position 2 of 2
        +1m00s  2025-01-01T00:01:00Z  #15  position 1 of 1 (was 2): serving/infer left the queue (assigned GPU 0)
        +1m15s  2025-01-01T00:01:15Z  #18  assigned GPU 1 (GPU-SIMULATED-gpu-node-1-1) after waiting 15s at positions 2, 1
        +3m20s  2025-01-01T00:03:20Z  #21  released GPU 1: completed (exit code 0) after holding it 2m05s
        """
    )


def test_history_of_the_preemptor(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = gpupool(
        capsys, "history", "serving/infer", "--log", str(logs["preemption-priority"])
    )
    assert code == 0
    assert out == lines(
        """
        history of serving/infer on gpu-node-1 (offsets from the first entry, 2025-01-01T00:00:00Z)
           +0s  2025-01-01T00:00:00Z  #6   registered on gpu-node-1: share-pool, requests core 50% memory 50%, limits core 100% memory 100%, priority 1000
        +1m00s  2025-01-01T00:01:00Z  #11  ready: joins the queue at position 1 of 1
        +1m00s  2025-01-01T00:01:00Z  #12  preempts default/train-1 on GPU 0 (reason priority)
        +1m00s  2025-01-01T00:01:00Z  #15  assigned GPU 0 (GPU-SIMULATED-gpu-node-1-0) after waiting 0s at position 1
        +1m30s  2025-01-01T00:01:30Z  #19  released GPU 0: completed (exit code 0) after holding it 30s
        """
    )


def test_history_of_an_unknown_pod_exits_2(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = gpupool(capsys, "history", "nobody", "--log", str(logs["worked-example"]))
    assert (code, out) == (2, "")
    assert err == "gpupool history: pod default/nobody does not appear in the log\n"


# --------------------------------------------------------------------------- state --at


def test_state_at_t1_of_the_worked_example(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = gpupool(capsys, "state", "--at", "+5s", "--log", str(logs["worked-example"]))
    assert code == 0
    assert out == lines(
        f"""
        state at +5s (2025-01-01T00:00:05Z): 12 entries folded, the last #12 PodReady at +3s
        node {NODE}: share-pool, 2 GPUs (simulated), preemption on (podMaxDurationMinutes 120, grace 10s), backfill off
          requests: core 200% memory 200% of 200% allocatable each
          GPU 0 GPU-SIMULATED-{NODE}-0: core 50% memory 50% used by limits
            default/pod-a  limits core 50% memory 50%, priority 0, running since +0s
          GPU 1 GPU-SIMULATED-{NODE}-1: core 100% memory 100% used by limits
            default/pod-c  limits core 100% memory 100%, priority 0, running since +1s
          ready queue (2):
            1  default/pod-d  priority 0, limits core 100% memory 100%, waiting 3s (since +2s)
            2  default/pod-b  priority 0, limits core 50% memory 50%, waiting 2s (since +3s)
          dormant: none
        """
    )


def test_state_at_t2_by_rfc3339_time(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = gpupool(
        capsys,
        "state",
        "--at",
        "2025-01-01T00:01:05Z",
        "--node",
        NODE,
        "--log",
        str(logs["worked-example"]),
    )
    assert code == 0
    assert out == lines(
        f"""
        state at +1m05s (2025-01-01T00:01:05Z): 15 entries folded, the last #15 Assigned at +1m00s
        node {NODE}: share-pool, 2 GPUs (simulated), preemption on (podMaxDurationMinutes 120, grace 10s), backfill off
          requests: core 200% memory 200% of 200% allocatable each
          GPU 0 GPU-SIMULATED-{NODE}-0: core 100% memory 100% used by limits
            default/pod-a  limits core 50% memory 50%, priority 0, running since +0s
            default/pod-b  limits core 50% memory 50%, priority 0, running since +1m00s
          GPU 1 GPU-SIMULATED-{NODE}-1: core 100% memory 100% used by limits
            default/pod-d  limits core 100% memory 100%, priority 0, running since +1m00s
          ready queue: empty
          dormant: default/pod-c
        """
    )


def test_state_after_the_preemption(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = gpupool(
        capsys, "state", "--at", "+1m10s", "--log", str(logs["preemption-priority"])
    )
    assert code == 0
    assert out == lines(
        """
        state at +1m10s (2025-01-01T00:01:10Z): 16 entries folded, the last #16 PodReady at +1m05s
        node gpu-node-1: share-pool, 2 GPUs (simulated), preemption on (no podMaxDurationMinutes, grace 10s), backfill off
          requests: core 200% memory 200% of 200% allocatable each
          GPU 0 GPU-SIMULATED-gpu-node-1-0: core 100% memory 100% used by limits
            serving/infer  limits core 100% memory 100%, priority 1000, running since +1m00s
          GPU 1 GPU-SIMULATED-gpu-node-1-1: core 100% memory 100% used by limits
            default/train-2  limits core 100% memory 100%, priority 0, running since +5s
          ready queue (2):
            1  default/train-1  priority 0, limits core 100% memory 100%, waiting 10s (since +1m00s)
            2  default/train-3  priority 0, limits core 100% memory 100%, waiting 5s (since +1m05s)
          dormant: none
        """
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        pytest.param(
            ["--at", "yesterday"],
            "'yesterday' is neither an RFC3339 time (2025-01-01T00:01:05Z) nor an offset (+65s)",
            id="bad-time",
        ),
        pytest.param(
            ["--at", "2025-01-01T00:00:05"],
            "'2025-01-01T00:00:05' needs a time zone (e.g. a trailing Z for UTC)",
            id="naive-time",
        ),
        pytest.param(
            ["--at", "+5s", "--node", "elsewhere"],
            f"node 'elsewhere' is not in the log at that time (nodes: {NODE})",
            id="unknown-node",
        ),
    ],
)
def test_state_rejects_bad_input_with_exit_2(
    arguments: list[str],
    message: str,
    logs: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = gpupool(capsys, "state", *arguments, "--log", str(logs["worked-example"]))
    assert (code, out) == (2, "")
    assert err == f"gpupool state: {message}\n"


# --------------------------------------------------------------------------- explain


def test_explain_b_at_t1_head_of_line(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = gpupool(
        capsys, "explain", "pod-b", "--at", "+5s", "--log", str(logs["worked-example"])
    )
    assert code == 0
    assert out == lines(
        f"""
        default/pod-b waits on {NODE}: position 2 of 2, ready since +3s (2s so far)
        as of +5s (2025-01-01T00:00:05Z)
        ahead of it:
          1  default/pod-d  priority 0, limits core 100% memory 100%, ready since +2s
        it needs core 50% memory 50% free on one GPU (its limits)
        what decides (verdict head-of-line):
          - GPU 0: it fits (core 50% memory 50% free)
          - GPU 1: it does not fit: core and memory short (used core 100% memory 100%, free core 0% memory 0%)
          - head-of-line: the queue is served in order and the head is default/pod-d (priority 0)
          - it would fit GPU 0 now, but backfill is off on this node
          - the head, default/pod-d, fits on no GPU: it needs core 100% memory 100%
          - default/pod-a on GPU 0 may not be preempted: its priority 0 is not below the head's 0, and it has held its GPU for less than podMaxDurationMinutes (120 min)
          - default/pod-c on GPU 1 may not be preempted: its priority 0 is not below the head's 0, and it has held its GPU for less than podMaxDurationMinutes (120 min)
          - default/pod-a reaches podMaxDurationMinutes (120 min) at +2h00m00s; preemption is considered again then
        estimate: no estimate: no assignment on {NODE} has completed yet
        """
    )


def test_explain_d_at_t1_no_eligible_victim(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = gpupool(
        capsys, "explain", "pod-d", "--at", "+5s", "--log", str(logs["worked-example"])
    )
    assert code == 0
    assert out == lines(
        f"""
        default/pod-d waits on {NODE}: position 1 of 2, ready since +2s (3s so far)
        as of +5s (2025-01-01T00:00:05Z)
        ahead of it: nobody (it is the head of the queue)
        it needs core 100% memory 100% free on one GPU (its limits)
        what decides (verdict no-eligible-victim):
          - GPU 0: it does not fit: core and memory short (used core 50% memory 50%, free core 50% memory 50%)
          - GPU 1: it does not fit: core and memory short (used core 100% memory 100%, free core 0% memory 0%)
          - the head, default/pod-d, fits on no GPU: it needs core 100% memory 100%
          - default/pod-a on GPU 0 may not be preempted: its priority 0 is not below the head's 0, and it has held its GPU for less than podMaxDurationMinutes (120 min)
          - default/pod-c on GPU 1 may not be preempted: its priority 0 is not below the head's 0, and it has held its GPU for less than podMaxDurationMinutes (120 min)
          - default/pod-a reaches podMaxDurationMinutes (120 min) at +2h00m00s; preemption is considered again then
        estimate: no estimate: no assignment on {NODE} has completed yet
        """
    )


def test_explain_with_an_estimate_from_recent_history(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """At +80s train-2 has completed after holding GPU 1 for 70s: 70s × 1 pod / 2 GPUs = 35s."""
    code, out, _ = gpupool(
        capsys, "explain", "train-3", "--at", "+1m20s", "--log", str(logs["preemption-priority"])
    )
    assert code == 0
    assert out == lines(
        """
        default/train-3 waits on gpu-node-1: position 1 of 1, ready since +1m05s (15s so far)
        as of +1m20s (2025-01-01T00:01:20Z)
        ahead of it: nobody (it is the head of the queue)
        it needs core 100% memory 100% free on one GPU (its limits)
        what decides (verdict no-eligible-victim):
          - GPU 0: it does not fit: core and memory short (used core 100% memory 100%, free core 0% memory 0%)
          - GPU 1: it does not fit: core and memory short (used core 100% memory 100%, free core 0% memory 0%)
          - the head, default/train-3, fits on no GPU: it needs core 100% memory 100%
          - serving/infer on GPU 0 may not be preempted: its priority 1000 is above the head's 0
          - default/train-1 on GPU 1 may not be preempted: its priority 0 is not below the head's 0, and podMaxDurationMinutes is not set
        estimate: about 35s more = median hold 1m10s (the 1 most recent completed assignment on gpu-node-1) × 1 (pods ahead 0 + itself) / 2 GPUs; an estimate from recent history, not a promise
        """
    )


def test_explain_a_running_pod(logs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = gpupool(capsys, "explain", "pod-d", "--log", str(logs["worked-example"]))
    assert code == 0
    assert out == lines(
        f"""
        default/pod-d is not waiting: it runs on GPU 1 of {NODE} since +1m00s
        as of +1m00s (2025-01-01T00:01:00Z)
        """
    )


# --------------------------------------------------------------------------- verify


@pytest.mark.parametrize("name", ["worked-example", "preemption-priority"])
def test_verify_passes_on_simulated_logs(
    name: str, logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = gpupool(capsys, "verify", "--log", str(logs[name]))
    assert code == 0
    summary = {
        "worked-example": "verify: OK, 15 entries (0 unreadable), 1 node, 4 pods, "
        "4 assignments, 0 preemptions, 1 release",
        "preemption-priority": "verify: OK, 22 entries (0 unreadable), 1 node, 4 pods, "
        "5 assignments, 1 preemption, 5 releases",
    }[name]
    assert out.splitlines()[0] == summary


def write_log(path: Path, envelopes: list[Envelope]) -> None:
    path.write_bytes(b"".join(encode_envelope(envelope) + b"\n" for envelope in envelopes))


def read_log_file(path: Path) -> list[Envelope]:
    return [decode_envelope(line) for line in path.read_bytes().splitlines()]


def conflicting_assignment_log(logs: dict[str, Path], tmp_path: Path) -> Path:
    """The worked example with an Assigned injected at T1 (as #13): D on GPU 0 beside A."""
    envelopes = read_log_file(logs["worked-example"])
    injected = Envelope(
        id="injected-1",
        time=envelopes[11].time,
        event=Assigned(
            pod=PodRef(namespace="default", name="pod-d"),
            node=NODE,
            gpu_index=0,
            gpu_uuid=f"GPU-SIMULATED-{NODE}-0",
        ),
    )
    tampered = tmp_path / "tampered.jsonl"
    write_log(tampered, [*envelopes[:12], injected, *envelopes[12:]])
    return tampered


def test_verify_fails_on_a_conflicting_assignment(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At T1 (after #12) an Assigned puts D (limit 100) on GPU 0, where A holds 50."""
    tampered = conflicting_assignment_log(logs, tmp_path)
    code, out, _ = gpupool(capsys, "verify", "--log", str(tampered))
    assert code == 1
    # #13 is the injected entry. The fold drops a claim that does not fit (assignment_holds),
    # so #15 (the simulator's own Assigned of D) finds D still waiting and is no violation.
    assert out == lines(
        f"""
        violation at #13 (id injected-1, Assigned, pod default/pod-d): GPU 0 of {NODE} would hold core 150% memory 150% by limits, over 100%: default/pod-a core 50% memory 50% + default/pod-d core 100% memory 100%
        verify: FAILED, 1 violation; 16 entries (0 unreadable), 1 node, 4 pods, 5 assignments, 0 preemptions, 1 release
        """
    )


def test_verify_flags_a_preemption_never_released(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The log keeps #1..#12 (up to the Preempted) and train-3's ready (+65s), nothing else."""
    envelopes = read_log_file(logs["preemption-priority"])
    tampered = tmp_path / "tampered.jsonl"
    write_log(tampered, [*envelopes[:12], envelopes[15]])
    code, out, _ = gpupool(capsys, "verify", "--log", str(tampered))
    assert code == 1
    assert out == lines(
        """
        violation at #12 (id sim-00000012, Preempted, pod default/train-1): default/train-1 was preempted for serving/infer but never released; the log ends 5s later
        verify: FAILED, 1 violation; 13 entries (0 unreadable), 1 node, 4 pods, 2 assignments, 1 preemption, 0 releases
        """
    )


def test_verify_flags_a_release_as_preempted_without_a_preemption(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without #12 (the Preempted), train-1's Released(preempted) has no preemption behind it."""
    envelopes = read_log_file(logs["preemption-priority"])
    tampered = tmp_path / "tampered.jsonl"
    write_log(tampered, [*envelopes[:11], *envelopes[12:]])
    code, out, _ = gpupool(capsys, "verify", "--log", str(tampered))
    assert code == 1
    assert out == lines(
        """
        violation at #12 (id sim-00000013, Released, pod default/train-1): default/train-1 released as preempted, but no Preempted names it
        verify: FAILED, 1 violation; 21 entries (0 unreadable), 1 node, 4 pods, 5 assignments, 0 preemptions, 5 releases
        """
    )


def test_verify_counts_unreadable_entries_and_reports_progress(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with_garbage = tmp_path / "garbage.jsonl"
    with_garbage.write_bytes(logs["worked-example"].read_bytes() + b"not json at all\n")
    code, out, err = gpupool(
        capsys, "verify", "--log", str(with_garbage), "--progress", "--progress-every", "5"
    )
    assert code == 0
    assert out.splitlines()[0] == (
        "verify: OK, 16 entries (1 unreadable), 1 node, 4 pods, 4 assignments, "
        "0 preemptions, 1 release"
    )
    reading = f"reading {with_garbage}"
    assert err == (
        f"{reading}: 5 entries\n{reading}: 10 entries\n{reading}: 15 entries\n"
        f"{reading}: 16 entries, done\n"
    )


# --------------------------------------------------------------------------- log


def test_log_filters_by_pod_and_type(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--pod matches the preemptor of a Preempted too (its POD column names the victim)."""
    code, out, _ = gpupool(
        capsys,
        "log",
        "--pod",
        "serving/infer",
        "--type",
        "Preempted",
        "Assigned",
        "--log",
        str(logs["preemption-priority"]),
    )
    assert code == 0
    assert out == lines(
        """
        SEQ  TIME                  OFFSET  TYPE       NODE        POD              DETAILS
        12   2025-01-01T00:01:00Z  +1m00s  Preempted  gpu-node-1  default/train-1  for serving/infer on GPU 0, reason priority
        15   2025-01-01T00:01:00Z  +1m00s  Assigned   gpu-node-1  serving/infer    GPU 0 (GPU-SIMULATED-gpu-node-1-0)
        """
    )


def test_log_json_lines_are_the_logged_envelopes(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--since/--until pick #11..#18 (+60s..+75s); --json prints them as they are in the file."""
    path = logs["preemption-priority"]
    code, out, _ = gpupool(
        capsys, "log", "--json", "--since", "+1m", "--until", "+1m15s", "--log", str(path)
    )
    assert code == 0
    assert out.splitlines() == path.read_text(encoding="utf-8").splitlines()[10:18]


def test_log_shows_unreadable_entries(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with_garbage = tmp_path / "garbage.jsonl"
    with_garbage.write_bytes(logs["worked-example"].read_bytes() + b"not json at all\n")
    code, out, _ = gpupool(capsys, "log", "--type", "Undecodable", "--log", str(with_garbage))
    assert code == 0
    assert out == lines(
        """
        SEQ  TIME  OFFSET  TYPE         NODE  POD  DETAILS
        16   -     -       Undecodable  -     -    not a gpupool envelope: JSON is malformed: invalid character (byte 4)
        """
    )


def test_a_missing_log_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.jsonl"
    code, out, err = gpupool(capsys, "verify", "--log", str(missing))
    assert (code, out) == (2, "")
    assert err == f"gpupool verify: {missing}: no such log file\n"


def test_a_log_source_is_required(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # no --log, no --nats, no GPUPOOL_NATS_URL, no running `gpupool up`
    monkeypatch.delenv("GPUPOOL_NATS_URL", raising=False)
    monkeypatch.setenv("GPUPOOL_STATE_DIR", str(tmp_path))
    assert main(["verify"]) == 2
    assert "no log to read: give --log FILE or --nats URL" in capsys.readouterr().err


def test_verify_json_and_yaml_are_the_report_with_each_violation(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tampered = conflicting_assignment_log(logs, tmp_path)
    code, out, _ = gpupool(capsys, "verify", "--log", str(tampered), "-o", "json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    assert (report["entries"], report["assignments"]) == (16, 5)
    assert [(v["seq"], v["id"], v["type"], v["pod"]) for v in report["violations"]] == [
        (13, "injected-1", "Assigned", "default/pod-d"),
    ]
    assert report["invariants"] and all(isinstance(i, str) for i in report["invariants"])
    code, out, _ = gpupool(capsys, "verify", "--log", str(tampered), "-o", "yaml")
    assert code == 1
    assert yaml.safe_load(out) == report
    code, out, _ = gpupool(capsys, "verify", "--log", str(logs["worked-example"]), "-o", "json")
    assert code == 0
    assert json.loads(out)["ok"] is True and json.loads(out)["violations"] == []


def test_verify_wide_puts_the_violations_in_a_table(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tampered = conflicting_assignment_log(logs, tmp_path)
    code, out, _ = gpupool(capsys, "verify", "--log", str(tampered), "-o", "wide")
    assert code == 1
    header, first, verdict = out.splitlines()
    assert header.split() == ["SEQ", "ID", "TYPE", "POD", "VIOLATION"]
    assert first.split()[:4] == ["13", "injected-1", "Assigned", "default/pod-d"]
    assert verdict.startswith("verify: FAILED, 1 violation;")
