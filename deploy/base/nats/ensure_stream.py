"""Give the gpupool event log stream the replicas the cluster wants (an init container).

The services create the stream ``GPUPOOL`` themselves when it is missing, with one
replica (:mod:`gpupool.eventlog.jetstream`), and use an existing stream as it is.
In a NATS cluster the log must survive the loss of a server, so before a service
starts this script:

1. creates the stream exactly as the services would, if it is missing;
2. sets its replicas to ``GPUPOOL_STREAM_REPLICAS`` (an existing stream is scaled
   up or down in place) and its bounds to ``GPUPOOL_STREAM_MAX_BYTES`` with the
   entry size limit and ``discard: new`` (gpupool.eventlog.stream_limits); nothing
   else of its configuration changes;
3. waits until every follower is current, so the service starts on a log that is
   already replicated.

Idempotent: a second run changes nothing. Failures are retried until
``GPUPOOL_STREAM_DEADLINE_S``: NATS not up yet, JetStream electing its meta leader,
and "no suitable peers for placement" too, which is what a cluster answers both
while some of its servers are still starting and when it has fewer servers than
replicas asked for (the last answer is printed when the deadline passes).

Settings (environment): ``GPUPOOL_NATS_URL``, ``GPUPOOL_STREAM`` (default GPUPOOL),
``GPUPOOL_STREAM_REPLICAS`` (default 1), ``GPUPOOL_STREAM_MAX_BYTES`` (default 1GiB),
``GPUPOOL_STREAM_DEADLINE_S`` (default 120),
``GPUPOOL_SUBJECT_PREFIX`` (default: the production prefix; tests use their own),
``GPUPOOL_NATS_CREDENTIALS`` (the ``stream-admin`` nkey seed file, where NATS
authenticates) and ``GPUPOOL_NATS_CA`` (the CA of the server's TLS certificate).
Exit status: 0 done, 1 deadline passed, 2 bad settings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from gpupool.eventlog import JetStreamEventLog
from gpupool.eventlog.credentials import connect_options
from gpupool.eventlog.jetstream import DEFAULT_STREAM
from gpupool.eventlog.stream_limits import StreamLimits
from gpupool.eventlog.subjects import DEFAULT_SUBJECT_PREFIX

RETRY_PAUSE_S = (0.5, 1.0, 2.0, 5.0)
REPLICATION_POLL_S = 0.25
MAX_REPLICAS = 5
"""JetStream's limit on the replicas of a stream."""


def say(message: str) -> None:
    print(f"ensure-stream: {message}", file=sys.stderr, flush=True)


def describe(exc: BaseException) -> str:
    if isinstance(exc, nats.js.errors.APIError):
        return f"JetStream error {exc.err_code}: {exc.description}"
    return repr(exc)


async def wait_until_replicated(
    js: JetStreamContext, stream: str, replicas: int, give_up_at: float
) -> None:
    """Until the stream has ``replicas - 1`` followers and all of them are current."""
    while True:
        info = await js.stream_info(stream)
        followers = (info.cluster.replicas or []) if info.cluster else []
        current = [peer for peer in followers if peer.current]
        if len(current) >= replicas - 1:
            return
        if time.monotonic() >= give_up_at:
            raise TimeoutError(
                f"stream {stream}: {len(current)} of {replicas - 1} followers are current"
            )
        await asyncio.sleep(REPLICATION_POLL_S)


async def ensure_once(
    url: str, stream: str, subject_prefix: str, replicas: int, give_up_at: float
) -> str:
    """One attempt: create if missing, set the replicas, wait for them. Returns what was done."""
    env = os.environ.get
    credentials = (
        Path(env("GPUPOOL_NATS_CREDENTIALS", "")) if env("GPUPOOL_NATS_CREDENTIALS") else None
    )
    tls_ca = Path(env("GPUPOOL_NATS_CA", "")) if env("GPUPOOL_NATS_CA") else None
    log = await JetStreamEventLog.connect(
        url,
        stream=stream,
        subject_prefix=subject_prefix,
        connect_timeout=5.0,
        name="gpupool-ensure-stream",
        credentials=credentials,
        tls_ca=tls_ca,
    )
    await log.close()
    nc = await nats.connect(
        url,
        name="gpupool-ensure-stream",
        connect_timeout=5,
        max_reconnect_attempts=0,
        **connect_options(credentials, tls_ca),
    )
    try:
        js = nc.jetstream(timeout=10.0)
        info = await js.stream_info(stream)
        current = info.config.num_replicas or 1
        limits = StreamLimits.from_environment()
        changes: list[str] = []
        if current != replicas:
            changes.append(f"replicas {current} -> {replicas}")
        if limits.differs_from(info.config):
            changes.append(
                f"max_bytes {info.config.max_bytes} -> {limits.max_bytes}, max_msg_size "
                f"{info.config.max_msg_size} -> {limits.max_msg_size}, discard "
                f"{info.config.discard} -> {limits.discard}"
            )
        if not changes:
            done = f"stream {stream} has {replicas} replica(s) and its bounds; nothing to do"
        else:
            await js.update_stream(
                dataclasses.replace(
                    info.config,
                    num_replicas=replicas,
                    max_bytes=limits.max_bytes,
                    max_msg_size=limits.max_msg_size,
                    discard=limits.discard,
                )
            )
            done = f"stream {stream}: " + "; ".join(changes)
        await wait_until_replicated(js, stream, replicas, give_up_at)
        return done
    finally:
        await nc.close()


async def ensure(
    url: str, stream: str, subject_prefix: str, replicas: int, deadline_s: float
) -> int:
    give_up_at = time.monotonic() + deadline_s
    attempt = 0
    while True:
        try:
            say(await ensure_once(url, stream, subject_prefix, replicas, give_up_at))
            return 0
        except (nats.errors.Error, ConnectionError, OSError, TimeoutError) as exc:
            # NATS not reachable yet, JetStream still electing its leaders, a timeout.
            left = give_up_at - time.monotonic()
            if left <= 0:
                say(f"giving up after {deadline_s:.0f}s: {describe(exc)}")
                return 1
            pause = min(RETRY_PAUSE_S[min(attempt, len(RETRY_PAUSE_S) - 1)], left)
            say(f"not yet ({describe(exc)}); retrying in {pause:.1f}s")
            attempt += 1
            await asyncio.sleep(pause)


def main() -> int:
    env = os.environ.get
    replicas = int(env("GPUPOOL_STREAM_REPLICAS", "1"))
    if not 1 <= replicas <= MAX_REPLICAS:
        say(
            f"GPUPOOL_STREAM_REPLICAS must be 1..{MAX_REPLICAS} (JetStream's limit), not {replicas}"
        )
        return 2
    return asyncio.run(
        ensure(
            url=env("GPUPOOL_NATS_URL", "nats://127.0.0.1:4222"),
            stream=env("GPUPOOL_STREAM", DEFAULT_STREAM),
            subject_prefix=env("GPUPOOL_SUBJECT_PREFIX", DEFAULT_SUBJECT_PREFIX),
            replicas=replicas,
            deadline_s=float(env("GPUPOOL_STREAM_DEADLINE_S", "120")),
        )
    )


if __name__ == "__main__":
    sys.exit(main())
