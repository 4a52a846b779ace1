"""The gpupool run <-> node-executor protocol: wire format, exact messages, exit codes, CLI args."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gpupool.events import PodRef
from gpupool.workload import (
    EXIT_EXECUTOR_UNAVAILABLE,
    EXIT_OUT_OF_MEMORY,
    EXIT_PREEMPTED,
    EXIT_REJECTED,
    ConsoleReporter,
    ExecutorMessage,
    Exited,
    Preempted,
    ProtocolError,
    Rejected,
    RunRequest,
    Started,
    UsageError,
    Waiting,
    decode_executor_message,
    decode_request,
    encode_line,
    exit_code_for,
    parse_run_arguments,
    run_main,
    waiting_message,
)

REQUEST = RunRequest(
    pod=PodRef(namespace="default", name="gpu-share-demo"),
    argv=["python", "train.py", "--epochs", "3"],
    cwd="/workspace",
    env={"HOME": "/root"},
    requeue=True,
)


def test_waiting_message_is_byte_exact() -> None:
    """SPEC: ``You have been waiting for ${1} seconds. Approximate position: ${2}``."""
    assert (
        waiting_message(125, 3).encode()
        == b"You have been waiting for 125 seconds. Approximate position: 3"
    )


def test_request_is_one_json_line_with_a_stable_tag() -> None:
    line = encode_line(REQUEST)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert line.startswith(b'{"type":"RunRequest",')
    assert decode_request(line) == REQUEST


@pytest.mark.parametrize(
    ("message", "wire"),
    [
        pytest.param(Waiting(seconds=10, position=2), b'{"type":"Waiting","seconds":10,"position":2}\n', id="waiting"),
        pytest.param(Started(gpu_index=5, gpu_uuid="GPU-x", pid=77), b'{"type":"Started","gpu_index":5,"gpu_uuid":"GPU-x","pid":77}\n', id="started"),
        pytest.param(Preempted(by="b", gpu_index=1), b'{"type":"Preempted","by":"b","gpu_index":1}\n', id="preempted"),
        pytest.param(Exited(exit_code=0, reason="completed"), b'{"type":"Exited","exit_code":0,"reason":"completed"}\n', id="exited"),
        pytest.param(Rejected(reason="unknown-pod", message="m"), b'{"type":"Rejected","reason":"unknown-pod","message":"m"}\n', id="rejected"),
    ],
)  # fmt: skip
def test_executor_messages_on_the_wire(message: ExecutorMessage, wire: bytes) -> None:
    assert encode_line(message) == wire
    assert decode_executor_message(wire) == message


def test_unknown_fields_are_ignored_for_evolution() -> None:
    assert decode_executor_message(
        b'{"type":"Waiting","seconds":1,"position":1,"eta_seconds":30}\n'
    ) == Waiting(seconds=1, position=1)


@pytest.mark.parametrize(
    "line",
    [
        b"garbage\n",
        b'{"type":"Nope"}\n',
        b'{"type":"Exited","exit_code":1,"reason":"bored"}\n',
        b'{"type":"Waiting","seconds":"ten","position":1}\n',
    ],
)
def test_bad_executor_lines_are_protocol_errors(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_executor_message(line)


def test_a_request_is_not_an_executor_message_and_vice_versa() -> None:
    with pytest.raises(ProtocolError):
        decode_executor_message(encode_line(REQUEST))
    with pytest.raises(ProtocolError):
        decode_request(encode_line(Waiting(seconds=1, position=1)))


@pytest.mark.parametrize(
    ("last", "code"),
    [
        pytest.param(Exited(exit_code=0, reason="completed"), 0, id="completed"),
        pytest.param(Exited(exit_code=3, reason="failed"), 3, id="failed-own-code"),
        pytest.param(Exited(exit_code=139, reason="failed"), 139, id="failed-by-signal"),
        pytest.param(Exited(exit_code=143, reason="preempted"), EXIT_PREEMPTED, id="preempted"),
        pytest.param(Exited(exit_code=137, reason="out-of-memory"), EXIT_OUT_OF_MEMORY, id="oom"),
        pytest.param(Exited(exit_code=143, reason="cancelled"), EXIT_EXECUTOR_UNAVAILABLE, id="cancelled"),
        pytest.param(Rejected(reason="unknown-pod", message=""), EXIT_REJECTED, id="rejected"),
    ],
)  # fmt: skip
def test_exit_codes(last: Exited | Rejected, code: int) -> None:
    assert exit_code_for(last) == code


def test_documented_exit_code_values() -> None:
    assert (EXIT_REJECTED, EXIT_EXECUTOR_UNAVAILABLE, EXIT_PREEMPTED, EXIT_OUT_OF_MEMORY) == (
        2,
        69,
        75,
        137,
    )


def test_console_reporter_writes_waiting_lines_to_stdout_and_the_rest_to_stderr() -> None:
    out, err = io.StringIO(), io.StringIO()
    report = ConsoleReporter(out, err)
    report(Waiting(seconds=0, position=4))
    report(Waiting(seconds=10, position=3))
    report(Started(gpu_index=2, gpu_uuid="GPU-1", pid=9))
    report(Preempted(by="pod-b", gpu_index=2))
    report(Exited(exit_code=143, reason="preempted"))
    assert out.getvalue() == (
        "You have been waiting for 0 seconds. Approximate position: 4\n"
        "You have been waiting for 10 seconds. Approximate position: 3\n"
    )
    assert err.getvalue() == (
        "gpupool: running on GPU 2 (GPU-1) as pid 9\nGPU is preempted by pod-b.\n"
    )


@pytest.mark.parametrize(
    ("args", "environ", "pod", "argv", "requeue", "socket"),
    [
        pytest.param(["--pod", "p", "--", "python", "-c", "x"], {}, PodRef(namespace="default", name="p"), ["python", "-c", "x"], False, "/run/gpupool/gpupool.sock", id="minimal"),
        pytest.param(["--pod=p", "--namespace=ns", "--requeue", "--socket", "/s", "--", "a", "--pod", "q"], {}, PodRef(namespace="ns", name="p"), ["a", "--pod", "q"], True, "/s", id="everything"),
        pytest.param(["--", "cmd"], {"POD_NAME": "from-env", "POD_NAMESPACE": "team", "GPUPOOL_SOCKET": "/e"}, PodRef(namespace="team", name="from-env"), ["cmd"], False, "/e", id="downward-api"),
        pytest.param(["--pod", "p", "cmd", "--flag"], {}, PodRef(namespace="default", name="p"), ["cmd", "--flag"], False, "/run/gpupool/gpupool.sock", id="no-double-dash"),
    ],
)  # fmt: skip
def test_parse_run_arguments(
    args: list[str],
    environ: dict[str, str],
    pod: PodRef,
    argv: list[str],
    requeue: bool,
    socket: str,
) -> None:
    invocation = parse_run_arguments(args, environ)
    assert (invocation.pod, invocation.argv, invocation.requeue, invocation.socket_path) == (
        pod,
        argv,
        requeue,
        socket,
    )


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--", "cmd"], "--pod NAME is required"),
        (["--pod", "p", "--"], "no command"),
        (["--pod", "p"], "no command"),
        (["--pod"], "--pod needs a value"),
        (["--pod", "p", "--gpus", "2", "--", "x"], "unknown option '--gpus'"),
    ],
)
def test_usage_errors(args: list[str], problem: str) -> None:
    with pytest.raises(UsageError, match=problem):
        parse_run_arguments(args, {})


def test_run_main_usage_error_exits_2() -> None:
    err = io.StringIO()
    assert run_main(["--", "cmd"], environ={}, out=io.StringIO(), err=err) == 2
    assert "--pod NAME is required" in err.getvalue()
    assert "usage: gpupool run" in err.getvalue()


def test_run_main_without_executor_exits_69_after_its_reconnect_window(tmp_path: Path) -> None:
    err = io.StringIO()
    code = run_main(
        [
            "--pod",
            "p",
            "--socket",
            f"{tmp_path}/absent.sock",
            "--reconnect-seconds",
            "0.3",
            "--",
            "true",
        ],
        environ={},
        out=io.StringIO(),
        err=err,
    )
    assert code == EXIT_EXECUTOR_UNAVAILABLE
    assert "cannot reach the node-executor" in err.getvalue()
    assert "gave up connecting after 0.3s" in err.getvalue()
    assert "trying again for up to 0.3s" in err.getvalue()  # said once, while it retried
    assert err.getvalue().count("trying again") == 1
