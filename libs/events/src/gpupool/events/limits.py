"""The ranges every decoded event is checked against (docs/events.md, "Limits").

An entry is believed only if every field is in range: the decoder refuses, with the
field's path, an entry whose number or text lies outside these bounds, so no fold,
decision or metric ever computes with a GPU index of 2**70, a share of infinity or a
duration past the calendar's end. The bounds are far beyond any real cluster and
well inside what every consumer (datetime arithmetic, int64 metrics, NATS subject
tokens) can represent.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_ENTRY_BYTES = 1024 * 1024
"""The largest log entry read (and the stream's ``max_msg_size``): NATS's default max payload."""

MAX_GPU_INDEX = 1023
MAX_GPUS_PER_NODE = MAX_GPU_INDEX + 1
MAX_GPU_MEMORY_MIB = 16 * 1024 * 1024
"""16 TiB of memory on one GPU."""
MAX_NODE_NAME = 253
"""A Kubernetes node name is a DNS subdomain: at most 253 characters."""
MAX_NAMESPACE = 63
MAX_POD_NAME = 253
MAX_ID = 256
MAX_TEXT = 256
"""uids, UUIDs, GPU model names, reasons."""
MAX_MESSAGE = 8192
"""Human messages and the payload a MessageRejected keeps."""
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 2**31 - 1
"""Kubernetes priorities are int32."""
MAX_DURATION_MINUTES = 10 * 366 * 24 * 60
"""``podMaxDurationMinutes``: at most ten years."""
MAX_SECONDS_SETTING = 24 * 60 * 60
"""``preemptGracePeriodSeconds`` and ``waitingMessagePeriodSeconds``: at most a day."""
MAX_SEQ = 2**63 - 1

Percent = Annotated[int, msgspec.Meta(ge=0, le=100)]
GpuIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_GPU_INDEX)]
GpuCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_GPUS_PER_NODE)]
MemoryMiB = Annotated[int, msgspec.Meta(ge=0, le=MAX_GPU_MEMORY_MIB)]
Priority = Annotated[int, msgspec.Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
ExitCode = Annotated[int, msgspec.Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
DurationMinutes = Annotated[int, msgspec.Meta(ge=1, le=MAX_DURATION_MINUTES)]
GraceSeconds = Annotated[int, msgspec.Meta(ge=0, le=MAX_SECONDS_SETTING)]
PeriodSeconds = Annotated[int, msgspec.Meta(ge=1, le=MAX_SECONDS_SETTING)]
Sequence = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]
NodeName = Annotated[str, msgspec.Meta(max_length=MAX_NODE_NAME)]
Namespace = Annotated[str, msgspec.Meta(max_length=MAX_NAMESPACE)]
PodName = Annotated[str, msgspec.Meta(max_length=MAX_POD_NAME)]
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Message = Annotated[str, msgspec.Meta(max_length=MAX_MESSAGE)]
Subject = Annotated[str, msgspec.Meta(max_length=MAX_MESSAGE)]
