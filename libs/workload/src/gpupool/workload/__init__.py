"""The local protocol between ``gpupool run`` (inside a pod) and the node-executor, and its client.

See docs/node-executor.md for the wire format, file-descriptor passing and exit codes.
"""

from gpupool.workload.client import (
    DEFAULT_SOCKET_PATH,
    SOCKET_PATH_VARIABLE,
    ExecutorUnavailable,
    RunInvocation,
    StdioFds,
    UsageError,
    parse_run_arguments,
    run_main,
    run_workload,
)
from gpupool.workload.messages import (
    EXIT_EXECUTOR_UNAVAILABLE,
    EXIT_OUT_OF_MEMORY,
    EXIT_PREEMPTED,
    EXIT_REJECTED,
    ConsoleReporter,
    exit_code_for,
    preempted_message,
    waiting_message,
)
from gpupool.workload.protocol import (
    MAX_REQUEST_BYTES,
    PASSED_FDS,
    ExecutorMessage,
    Exited,
    Preempted,
    ProtocolError,
    Rejected,
    RunRequest,
    Started,
    Waiting,
    decode_executor_message,
    decode_request,
    encode_line,
)

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "EXIT_EXECUTOR_UNAVAILABLE",
    "EXIT_OUT_OF_MEMORY",
    "EXIT_PREEMPTED",
    "EXIT_REJECTED",
    "MAX_REQUEST_BYTES",
    "PASSED_FDS",
    "SOCKET_PATH_VARIABLE",
    "ConsoleReporter",
    "ExecutorMessage",
    "ExecutorUnavailable",
    "Exited",
    "Preempted",
    "ProtocolError",
    "Rejected",
    "RunInvocation",
    "RunRequest",
    "Started",
    "StdioFds",
    "UsageError",
    "Waiting",
    "decode_executor_message",
    "decode_request",
    "encode_line",
    "exit_code_for",
    "parse_run_arguments",
    "preempted_message",
    "run_main",
    "run_workload",
    "waiting_message",
]
