"""``gpupool pod add``: declare a pod while ``gpupool up`` runs (local mode).

The pod is added to the cluster file (``--cluster``, default: the one the running
``gpupool up`` uses); the policy service reads the file again when it changes and
registers the pod. With a running ``gpupool up`` the command waits (``--wait``
seconds, default 30) until the log records the outcome, PodRegistered or
PodRejected, and says which, so that a ``gpupool run --pod NAME`` started after it
finds the pod registered. The pod is written into the file's ``pods`` list as one
line; the rest of the file, comments included, is kept as it was. Only where the list
cannot be edited in place (a ``pods`` list written inline with its items, say) is the
whole file written out again as YAML, without its comments, and the command says so.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import yaml

from gpupool.cli.exits import EXIT_OK, CommandFailed, InvalidInput
from gpupool.cli.stack_address import RunningStack, read_running_stack
from gpupool.core.simulation import ScenarioPod
from gpupool.eventlog.port import StoredEvent
from gpupool.eventlog.reader import ReadOnlyLog, StreamMissing
from gpupool.events import PodRef, PodRegistered, PodRejected

DEFAULT_WAIT_S = 30.0
"""How long ``pod add`` waits for a running ``gpupool up`` to record the pod's outcome."""


async def registration_outcome(
    log: ReadOnlyLog, pod: PodRef, *, after_seq: int
) -> PodRegistered | PodRejected:
    """The first PodRegistered or PodRejected of ``pod`` after ``after_seq``, as it arrives."""
    async for entry in log.entries(from_seq=after_seq + 1):
        if not isinstance(entry, StoredEvent):
            continue  # an undecodable entry says nothing about this pod
        event = entry.envelope.event
        if isinstance(event, PodRegistered | PodRejected) and event.pod == pod:
            return event
    raise CommandFailed("the log ended while waiting")  # a follow never ends by itself


async def last_seq(log: ReadOnlyLog) -> int:
    try:
        return await log.last_seq()
    except StreamMissing:
        return 0


def share(value: str) -> int:
    number = int(value)
    if not 0 < number <= 100:
        raise argparse.ArgumentTypeError(f"{value}: a percentage from 1 to 100")
    return number


async def add(args: argparse.Namespace) -> int:
    cluster_file: Path | None = args.cluster
    running = read_running_stack()
    if cluster_file is None:
        if running is None:
            raise InvalidInput("no cluster file: give --cluster FILE (or start `gpupool up`)")
        cluster_file = Path(running.cluster_file)
    node = args.node or (running.node if running is not None else None)
    if node is None:
        raise InvalidInput("no node: give --node NODE (or start `gpupool up`)")
    limits = {
        "core": args.limit_core if args.limit_core is not None else args.core,
        "memory": args.limit_memory if args.limit_memory is not None else args.memory,
    }
    pod: dict[str, Any] = {
        "name": args.name,
        "namespace": args.namespace,
        "node": node,
        "requests": {"core": args.core, "memory": args.memory},
        "limits": limits,
        "priority": args.priority,
        "owner_uid": os.getuid(),  # who may run it: the executor checks the caller's uid
    }
    try:
        msgspec.convert(pod, ScenarioPod)
    except msgspec.ValidationError as error:
        raise InvalidInput(f"pod {args.name}: {error}") from error
    try:
        text = cluster_file.read_bytes().decode("utf-8")  # line endings as they are (CRLF)
        document = yaml.safe_load(text) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise CommandFailed(f"{cluster_file}: cannot read the cluster file: {error}") from error
    if not isinstance(document, dict):
        raise InvalidInput(f"{cluster_file}: not a cluster file (a mapping with nodes and pods)")
    pods = document.setdefault("pods", []) or []
    document["pods"] = pods
    if any(
        isinstance(p, dict)
        and p.get("name") == args.name
        and p.get("namespace", "default") == args.namespace
        for p in pods
    ):
        raise InvalidInput(f"pod {args.namespace}/{args.name} is in {cluster_file} already")
    pods.append(pod)
    edited = text_with_pod_added(text, pod)
    new_text = edited if edited is not None else yaml.safe_dump(document, sort_keys=False)
    log = await connect_log(running) if running is not None and args.wait > 0 else None
    try:
        after_seq = await last_seq(log) if log is not None else 0
        temporary = cluster_file.with_name(cluster_file.name + ".tmp")
        temporary.write_text(new_text, encoding="utf-8", newline="")
        temporary.replace(cluster_file)
        if edited is None:
            print(
                f"{cluster_file}: its pods list could not be edited in place; the file was "
                "written out again as YAML, without its comments",
                file=sys.stderr,
                flush=True,
            )
        print(
            f"pod {args.namespace}/{args.name} added to {cluster_file} (node {node}, requests "
            f"{args.core}/{args.memory}, limits {limits['core']}/{limits['memory']})"
            + ("; the running gpupool up registers it" if running is not None else ""),
            file=sys.stdout,
            flush=True,
        )
        if log is None:
            return EXIT_OK
        ref = PodRef(namespace=args.namespace, name=args.name)
        try:
            async with asyncio.timeout(args.wait):
                outcome = await registration_outcome(log, ref, after_seq=after_seq)
        except TimeoutError:
            raise CommandFailed(
                f"pod {ref} is in the cluster file, but the running gpupool up recorded no "
                f"outcome for it within {args.wait:g}s (is its policy service running?)"
            ) from None
    finally:
        if log is not None:
            await log.close()
    if isinstance(outcome, PodRejected):
        raise CommandFailed(f"pod {ref} was rejected ({outcome.reason}): {outcome.message}")
    print(f"pod {ref} registered on node {outcome.node}", file=sys.stdout)
    return EXIT_OK


def text_with_pod_added(text: str, pod: dict[str, Any]) -> str | None:
    """``text`` with ``pod`` appended to its top-level ``pods`` list, everything else kept.

    The pod goes in as one flow-style item after the list's last item, at the items'
    indentation (an empty ``pods`` becomes a block list of it; where there is no
    ``pods`` key, one is added at the end). The result
    is parsed again and must equal the old document with the pod appended; where it
    does not, or the list is not a block list this can extend, the answer is None (the
    caller writes the document out whole).
    """
    try:
        before = yaml.safe_load(text) or {}
        root = yaml.compose(text)
    except yaml.YAMLError:
        return None
    if not isinstance(before, dict):
        return None
    item = yaml.safe_dump(pod, default_flow_style=True, sort_keys=False, width=1 << 20).strip()
    eol = "\r\n" if "\r\n" in text else "\n"  # the file's own line ending
    pods_value = _top_level_value(root, "pods")
    if pods_value is None:
        if "pods" in before:
            return None
        edited = (
            text + ("" if text.endswith("\n") or not text else eol) + f"pods:{eol}  - {item}{eol}"
        )
    elif (
        isinstance(pods_value, yaml.SequenceNode) and pods_value.value and not pods_value.flow_style
    ):
        lines = text.splitlines(keepends=True)
        last = _last_token_end(pods_value.value[-1])
        # The new item starts on the line after the last item's last token (a comment
        # after it on that line stays there; a block scalar ends at a line's start).
        insert_at = last.line + 1 if last.column > 0 else last.line
        dash = " " * pods_value.start_mark.column
        if insert_at > len(lines):
            return None
        if insert_at == len(lines) and lines and not lines[-1].endswith("\n"):
            lines[-1] += eol
        lines.insert(insert_at, f"{dash}- {item}{eol}")
        edited = "".join(lines)
    elif (isinstance(pods_value, yaml.SequenceNode) and not pods_value.value) or (
        isinstance(pods_value, yaml.ScalarNode) and pods_value.tag.endswith(":null")
    ):
        # ``pods: []`` or an empty ``pods:``: the value becomes a block list of one item.
        start, end = pods_value.start_mark.index, pods_value.end_mark.index
        edited = f"{text[:start].rstrip(' ')}{eol}  - {item}{text[end:]}"
        if not edited.endswith("\n"):
            edited += eol
    else:
        return None
    expected = dict(before)
    expected["pods"] = [*(before.get("pods") or []), pod]
    try:
        after = yaml.safe_load(edited)
    except yaml.YAMLError:
        return None
    return edited if after == expected else None


def _last_token_end(node: yaml.Node) -> yaml.Mark:
    if isinstance(node, yaml.MappingNode) and node.value and not node.flow_style:
        return _last_token_end(node.value[-1][1])
    if isinstance(node, yaml.SequenceNode) and node.value and not node.flow_style:
        return _last_token_end(node.value[-1])
    return node.end_mark


def _top_level_value(root: yaml.Node | None, key: str) -> yaml.Node | None:
    if not isinstance(root, yaml.MappingNode):
        return None
    for key_node, value_node in root.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            found: yaml.Node = value_node
            return found
    return None


async def connect_log(running: RunningStack) -> ReadOnlyLog:
    try:
        return await ReadOnlyLog.connect(running.nats_url, name="gpupool-pod-add")
    except (ConnectionError, OSError) as error:
        raise CommandFailed(
            f"the running gpupool up's NATS at {running.nats_url} did not answer: {error}"
        ) from error


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "pod",
        help="add pods to the local cluster while gpupool up runs",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    adding = actions.add_parser(
        "add", help="declare a pod (it is registered at once by a running gpupool up)"
    )
    adding.add_argument("name", metavar="NAME", help="the pod's name")
    adding.add_argument("--namespace", default="default")
    adding.add_argument("--node", help="its node (default: the node of the running gpupool up)")
    adding.add_argument(
        "--core", type=share, required=True, help="requested GPU compute, percent of a GPU"
    )
    adding.add_argument(
        "--memory", type=share, required=True, help="requested GPU memory, percent of a GPU"
    )
    adding.add_argument("--limit-core", type=share, help="compute limit (default: --core)")
    adding.add_argument("--limit-memory", type=share, help="memory limit (default: --memory)")
    adding.add_argument("--priority", type=int, default=0)
    adding.add_argument(
        "--cluster", type=Path, help="the cluster file (default: the running gpupool up's)"
    )
    adding.add_argument(
        "--wait",
        type=float,
        default=DEFAULT_WAIT_S,
        metavar="SECONDS",
        help="with a running gpupool up, wait this long for the pod's registration to be "
        f"recorded (default {DEFAULT_WAIT_S:g}; 0: do not wait)",
    )
    adding.set_defaults(handler=add)
