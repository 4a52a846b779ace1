"""The local protocol between ``gpupool run`` and the node-executor, over a Unix stream socket.

Each message is one JSON object on one line (newline-delimited JSON), tagged by ``type``.
The client sends exactly one :class:`RunRequest`, and with its first byte, as ``SCM_RIGHTS``
ancillary data, its stdin, stdout and stderr file descriptors (in that order). The executor
answers with :data:`ExecutorMessage` lines until it sends :class:`Exited` or :class:`Rejected`
and closes the connection.
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


ExecutorMessage = Waiting | Started | Preempted | Exited | Rejected

_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(RunRequest)
_executor_decoder = msgspec.json.Decoder(ExecutorMessage)


def encode_line(message: RunRequest | ExecutorMessage) -> bytes:
    """One message as a JSON line, newline included."""
    return _encoder.encode(message) + b"\n"


def decode_request(line: bytes) -> RunRequest:
    try:
        return _request_decoder.decode(line)
    except msgspec.DecodeError as error:
        raise ProtocolError(f"not a RunRequest: {error}") from error


def decode_executor_message(line: bytes) -> ExecutorMessage:
    try:
        return _executor_decoder.decode(line)
    except msgspec.DecodeError as error:
        raise ProtocolError(f"not an executor message: {error}") from error
