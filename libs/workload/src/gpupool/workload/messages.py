"""What ``gpupool run`` prints for each executor message, and the exit codes it returns."""

from __future__ import annotations

from typing import TextIO

from gpupool.core import waiting_message as waiting_message
from gpupool.workload.protocol import ExecutorMessage, Exited, Preempted, Rejected, Started, Waiting

EXIT_REJECTED = 2
"""The request was refused (unknown pod, bad usage)."""
EXIT_EXECUTOR_UNAVAILABLE = 69
"""EX_UNAVAILABLE: no executor to talk to, it went away, or it cancelled the run."""
EXIT_PREEMPTED = 75
"""EX_TEMPFAIL: the command was preempted and not re-queued; running it again may succeed."""
EXIT_OUT_OF_MEMORY = 137
"""128 + SIGKILL: the command exceeded the pod's GPU memory limit and was killed."""


def preempted_message(by: str) -> str:
    """Same words as the pod event ``GPUSharePreempted``."""
    return f"GPU is preempted by {by}."


def exit_code_for(message: Exited | Rejected) -> int:
    """The exit code of ``gpupool run`` once the executor has said its last word."""
    if isinstance(message, Rejected):
        return EXIT_REJECTED
    match message.reason:
        case "preempted":
            return EXIT_PREEMPTED
        case "out-of-memory":
            return EXIT_OUT_OF_MEMORY
        case "cancelled" | "gpu-vanished":
            return EXIT_EXECUTOR_UNAVAILABLE
        case "completed" | "failed":
            return message.exit_code


class ConsoleReporter:
    """Prints messages for people: the waiting line on ``out`` (the pod's log), the rest on ``err``."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self._out = out
        self._err = err

    def __call__(self, message: ExecutorMessage) -> None:
        match message:
            case Waiting(seconds=seconds, position=position):
                self._line(self._out, waiting_message(seconds, position))
            case Started(gpu_index=index, gpu_uuid=uuid, pid=pid):
                self._line(self._err, f"gpupool: running on GPU {index} ({uuid}) as pid {pid}")
            case Preempted(by=by):
                self._line(self._err, preempted_message(by))
            case Exited(reason="out-of-memory", exit_code=code):
                self._line(
                    self._err,
                    f"gpupool: killed for exceeding the pod's GPU memory limit (exit code {code})",
                )
            case Exited():
                pass
            case Rejected(reason=reason, message=text):
                self._line(self._err, f"gpupool: rejected ({reason}): {text}")

    @staticmethod
    def _line(stream: TextIO, text: str) -> None:
        stream.write(text + "\n")
        stream.flush()
