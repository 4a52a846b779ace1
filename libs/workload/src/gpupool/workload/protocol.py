"""The local protocol between workloads and the node-executor, over a Unix stream socket.

Each message is one JSON object on one line (newline-delimited JSON), tagged by ``type``.
A client sends exactly one request:

* ``gpupool run`` sends a :class:`RunRequest`, and with its first byte, as ``SCM_RIGHTS``
  ancillary data, its stdin, stdout and stderr file descriptors (in that order). The executor
  answers with :data:`ExecutorMessage` lines until it sends :class:`Exited` or
  :class:`Rejected` and closes the connection.
* the CUDA hook (libs/cuda_hook), inside a workload process's first ``cuInit``, sends an
  :class:`AttachRequest` with no file descriptors. The executor answers with
  :class:`Waiting` lines while the pod queues, then one :class:`Granted` (carrying the pod's
  memory counter as one ``SCM_RIGHTS`` fd), or :class:`Rejected`. The executor follows the
  process itself (by pidfd) from then on.
"""

from __future__ import annotations

import msgspec

from gpupool.events import PodRef, ReleaseReason

MAX_REQUEST_BYTES = 1024 * 1024
"""A request line longer than this is rejected (argv and environment included)."""

PASSED_FDS = 3
"""stdin, stdout, stderr."""


class ProtocolError(ValueError):
    """A line that is not a valid message of the protocol."""


class RunRequest(msgspec.Struct, frozen=True, kw_only=True, tag="RunRequest"):
    """Run ``argv`` (no shell) for ``pod`` once it is given a GPU."""

    pod: PodRef
    argv: list[str]
    cwd: str
    env: dict[str, str]
    requeue: bool = False
    """When preempted, queue again instead of exiting."""
    reattach: bool = False
    """Sent again after losing the executor: continue the run in progress, never start a new one."""
    sent_at: float = 0.0
    """When the client first sent this request (Unix seconds; 0: unknown). On a reattach with
    no run in progress, the executor reads this run's outcome from the log: the pod's last
    release after this time, if any."""


class AttachRequest(msgspec.Struct, frozen=True, kw_only=True, tag="AttachRequest"):
    """The calling process wants its pod's GPU (sent by the CUDA hook from ``cuInit``).

    The process is the peer of the connection (``SO_PEERCRED``); ``pid`` is only what it sees
    of itself (its own PID namespace). ``pod`` may be left out where the kernel names the pod
    (``--identity kernel``); it must match the kernel's answer where given.
    """

    pid: int
    pod: PodRef | None = None


class Granted(msgspec.Struct, frozen=True, kw_only=True, tag="Granted"):
    """The process may use the pod's GPU: set ``CUDA_VISIBLE_DEVICES`` to ``gpu_uuid``.

    Sent with one fd: a shared memory counter (8 bytes, the pod's device memory in bytes held
    through the hook) that every process of the pod adds to and subtracts from.
    """

    gpu_index: int
    gpu_uuid: str
    memory_limit_bytes: int
    """The pod's limit on this GPU: allocations past it fail with CUDA_ERROR_OUT_OF_MEMORY."""
    core_percentage: int
    mps_pinned_device_mem_limit: str
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, set by the hook only where an MPS daemon runs."""


class Waiting(msgspec.Struct, frozen=True, kw_only=True, tag="Waiting"):
    """The pod is in the ready queue: true seconds waited so far and its position (1 = head)."""

    seconds: int
    position: int


class Started(msgspec.Struct, frozen=True, kw_only=True, tag="Started"):
    """The command runs on the GPU with this (node) index and UUID as process ``pid``."""

    gpu_index: int
    gpu_uuid: str
    pid: int


class Preempted(msgspec.Struct, frozen=True, kw_only=True, tag="Preempted"):
    """The GPU was given to the pod named ``by``; the command is being ended."""

    by: str
    gpu_index: int


class Exited(msgspec.Struct, frozen=True, kw_only=True, tag="Exited"):
    """The command is gone and its GPU released; ``exit_code`` uses the shell's 128+signal form."""

    exit_code: int
    reason: ReleaseReason


class Rejected(msgspec.Struct, frozen=True, kw_only=True, tag="Rejected"):
    """The request was refused before anything ran; ``reason`` is machine-readable."""

    reason: str
    message: str


ExecutorMessage = Waiting | Started | Preempted | Exited | Rejected | Granted
WorkloadRequest = RunRequest | AttachRequest

_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(RunRequest)
_workload_request_decoder = msgspec.json.Decoder(WorkloadRequest)
_executor_decoder = msgspec.json.Decoder(ExecutorMessage)


def encode_line(message: WorkloadRequest | ExecutorMessage) -> bytes:
    """One message as a JSON line, newline included."""
    return _encoder.encode(message) + b"\n"


def decode_request(line: bytes) -> RunRequest:
    try:
        return _request_decoder.decode(line)
    except msgspec.DecodeError as error:
        raise ProtocolError(f"not a RunRequest: {error}") from error
    except RecursionError as error:  # msgspec's own limit on nesting
        raise ProtocolError("not a RunRequest: nested too deeply") from error


def decode_workload_request(line: bytes) -> WorkloadRequest:
    """A RunRequest (``gpupool run``) or an AttachRequest (the CUDA hook)."""
    try:
        return _workload_request_decoder.decode(line)
    except msgspec.DecodeError as error:
        raise ProtocolError(f"not a RunRequest or AttachRequest: {error}") from error
    except RecursionError as error:  # msgspec's own limit on nesting
        raise ProtocolError("not a RunRequest or AttachRequest: nested too deeply") from error


def decode_executor_message(line: bytes) -> ExecutorMessage:
    try:
        return _executor_decoder.decode(line)
    except msgspec.DecodeError as error:
        raise ProtocolError(f"not an executor message: {error}") from error
    except RecursionError as error:  # msgspec's own limit on nesting
        raise ProtocolError("not an executor message: nested too deeply") from error
