"""Logs for the observability tests: the worked example and a long random-ish simulated one."""

from __future__ import annotations

import random
import shutil
import subprocess
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from gpupool.core.simulation import (
    ActionKind,
    Scenario,
    ScenarioAction,
    ScenarioNode,
    ScenarioPod,
    ScenarioShare,
    simulate,
)
from gpupool.events import Envelope, MessageRejected
from gpupool.observability import Projection

WORKED_EXAMPLE = Path(__file__).resolve().parents[2] / "scenarios" / "worked-example.yaml"

LogEntry = tuple[int, Envelope | None, str | None]
"""(stream sequence, envelope or None for an entry that could not be decoded, its subject's node)."""


def worked_example_log() -> list[Envelope]:
    scenario = msgspec.convert(yaml.safe_load(WORKED_EXAMPLE.read_text()), Scenario)
    return simulate(scenario)


def numbered(log: Iterable[Envelope]) -> list[LogEntry]:
    """Each envelope with seq = index + 1."""
    return [(index, envelope, None) for index, envelope in enumerate(log, start=1)]


def fold(entries: Iterable[LogEntry], projection: Projection) -> Projection:
    for seq, envelope, node in entries:
        if envelope is None:
            projection.skip(seq, node)
        else:
            projection.apply(seq, envelope)
    return projection


def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def random_log(seed: int, *, pods_per_node: int = 10, actions_per_pod: int = 30) -> list[LogEntry]:
    """A long log with every kind of entry: preemption (both reasons), requeue, cancel, fail, oom,
    delete, policy changes, static pods, rejected requests, rejected messages and undecodable
    entries. Deterministic for a seed."""
    rng = random.Random(seed)
    nodes = [
        ScenarioNode(
            name="pool-a",
            gpus=4,
            qos='{"preemptEnabled": true, "podMaxDurationMinutes": 2}',
        ),
        ScenarioNode(name="pool-b", gpus=2, qos='{"backfill": true}'),
        ScenarioNode(name="static-c", gpus=2, policy="static"),
    ]
    spare = ScenarioNode(name="spare-d", gpus=1)
    pods: list[ScenarioPod] = []
    timeline: list[ScenarioAction] = []
    for node in nodes:
        for index in range(pods_per_node):
            name = f"{node.name}-p{index}"
            limit = rng.choice([25, 50, 75, 100])
            request = rng.choice([5, 10, min(limit, 20)])
            pods.append(
                ScenarioPod(
                    name=name,
                    node=node.name,
                    namespace=rng.choice(["default", "team-x"]),
                    requests=ScenarioShare(core=request, memory=request),
                    limits=ScenarioShare(core=limit, memory=limit),
                    priority=rng.choice([0, 0, 0, 10]),
                    policy=node.policy,
                    requeue=rng.random() < 0.3,
                )
            )
    for pod in pods:
        at = 0.0
        for _ in range(actions_per_pod):
            at += rng.expovariate(1 / 200)
            roll = rng.random()
            if roll < 0.70:
                action = ScenarioAction(
                    at=at,
                    action="ready",
                    pod=pod.name,
                    namespace=pod.namespace,
                    runs_for=rng.expovariate(1 / 120),
                )
            else:
                kind: ActionKind = rng.choice(["cancel", "complete", "fail", "oom", "cancel"])
                action = ScenarioAction(at=at, action=kind, pod=pod.name, namespace=pod.namespace)
            timeline.append(action)
        if rng.random() < 0.1:
            timeline.append(
                ScenarioAction(at=at + 1, action="delete", pod=pod.name, namespace=pod.namespace)
            )
    horizon = max(action.at for action in timeline)
    for fraction in (0.3, 0.6):
        for node_name in ("pool-b", "spare-d"):
            timeline.append(
                ScenarioAction(
                    at=horizon * fraction, action="set-policy", node=node_name, policy="none"
                )
            )
        timeline.append(
            ScenarioAction(
                at=horizon * fraction + 30, action="set-policy", node="spare-d", policy="share-pool"
            )
        )
    log = simulate(Scenario(nodes=[*nodes, spare], pods=pods, timeline=timeline))
    entries: list[LogEntry] = []
    seq = 0
    for index, envelope in enumerate(log):
        seq += 1
        entries.append((seq, envelope, None))
        if index % 401 == 400:
            seq += 1
            entries.append((seq, None, rng.choice(["pool-a", None])))
        if index % 293 == 292:
            seq += 1
            rejected = MessageRejected(
                subject="gpupool.events.pool-a", reason="not JSON", payload="{", node="pool-a"
            )
            entries.append(
                (
                    seq,
                    Envelope(
                        id=f"rejected-{seq}",
                        time=envelope.time + timedelta(microseconds=1),
                        event=rejected,
                    ),
                    None,
                )
            )
    return entries


def promtool_check(text: str) -> tuple[int, set[str]]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "promtool is not installed: apt-get install --no-install-recommends prometheus "
            "(or scripts/install-prometheus.sh)"
        )
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return result.returncode, {
        line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()
    }
