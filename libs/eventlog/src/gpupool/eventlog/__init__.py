"""gpupool.eventlog: the append-only event log of gpupool, in memory or on NATS JetStream.

One stream (``GPUPOOL``) holds every envelope on ``gpupool.log.<node>.<tag>``;
see docs/eventlog.md. Services depend on the :class:`EventLog` port only.
"""

from gpupool.eventlog.jetstream import (
    ACK_WAIT_S,
    DEFAULT_STREAM,
    DUPLICATE_WINDOW_S,
    MAX_DELIVER,
    JetStreamDelivery,
    JetStreamEventLog,
    JetStreamSubscription,
)
from gpupool.eventlog.memory import InMemoryEventLog, MemoryDelivery, MemorySubscription
from gpupool.eventlog.port import (
    ConcurrencyConflict,
    DecisionAppend,
    Delivery,
    Entry,
    EventLog,
    EventLogClosed,
    StoredEvent,
    Subscription,
    Undecodable,
    read_entries,
    read_entry,
    rejection_envelope,
    rejection_id,
)
from gpupool.eventlog.subjects import (
    DEFAULT_SUBJECT_PREFIX,
    DEFAULT_WRITER,
    WRITERS,
    node_entry_subject,
    node_of_subject,
    node_subject_filter,
    node_token,
    subject_for,
    writer_of_subject,
    writer_subject_filter,
)

__all__ = [
    "ACK_WAIT_S",
    "DEFAULT_STREAM",
    "DEFAULT_SUBJECT_PREFIX",
    "DEFAULT_WRITER",
    "DUPLICATE_WINDOW_S",
    "MAX_DELIVER",
    "WRITERS",
    "ConcurrencyConflict",
    "DecisionAppend",
    "Delivery",
    "Entry",
    "EventLog",
    "EventLogClosed",
    "InMemoryEventLog",
    "JetStreamDelivery",
    "JetStreamEventLog",
    "JetStreamSubscription",
    "MemoryDelivery",
    "MemorySubscription",
    "StoredEvent",
    "Subscription",
    "Undecodable",
    "node_entry_subject",
    "node_of_subject",
    "node_subject_filter",
    "node_token",
    "read_entries",
    "read_entry",
    "rejection_envelope",
    "rejection_id",
    "subject_for",
    "writer_of_subject",
    "writer_subject_filter",
]
