"""``gpupool pod add`` writes the new pod into the cluster file and keeps the rest of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupool.cli.pod_command import text_with_pod_added

ROOT = Path(__file__).resolve().parents[2]

POD: dict[str, Any] = {
    "name": "pod-e",
    "namespace": "default",
    "node": "n",
    "requests": {"core": 50, "memory": 50},
    "limits": {"core": 50, "memory": 50},
    "priority": 0,
    "owner_uid": 1000,
}


def appended(text: str) -> dict[str, Any]:
    document = dict(yaml.safe_load(text) or {})
    document["pods"] = [*(document.get("pods") or []), POD]
    return document


@pytest.mark.parametrize(
    "path",
    ["scenarios/worked-example.yaml", "scenarios/backfill.yaml", "scenarios/static-node.yaml"],
)
def test_adding_a_pod_to_an_example_cluster_file_inserts_one_line_and_keeps_the_rest(
    path: str,
) -> None:
    text = (ROOT / path).read_text()
    edited = text_with_pod_added(text, POD)
    assert edited is not None
    assert yaml.safe_load(edited) == appended(text)
    lines = edited.splitlines()
    new_lines = [line for line in lines if "pod-e" in line]
    assert len(new_lines) == 1
    lines.remove(new_lines[0])
    assert lines == text.splitlines()  # comments, order and layout as they were


def test_the_starter_cluster_file_keeps_its_comments_when_its_first_pod_is_added() -> None:
    text = (ROOT / "scenarios" / "local-node.yaml").read_text()
    edited = text_with_pod_added(text, POD)
    assert edited is not None
    assert yaml.safe_load(edited) == appended(text)
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert comments and edited.startswith("\n".join(comments))


def test_the_new_pod_goes_after_the_last_block_item_and_before_what_follows() -> None:
    text = (
        "# the cluster\n"
        "nodes:\n"
        "  - name: n\n"
        "    gpus: 2\n"
        "pods:\n"
        "  - name: a   # the first pod\n"
        "    node: n\n"
        "    limits:\n"
        "      core: 1\n"
        "# what happens\n"
        "timeline: []\n"
    )
    edited = text_with_pod_added(text, POD)
    assert edited is not None
    lines = edited.splitlines()
    assert lines[:9] == text.splitlines()[:9]
    assert lines[9].startswith("  - {name: pod-e, ")
    assert lines[10:] == ["# what happens", "timeline: []"]
    assert yaml.safe_load(edited) == appended(text)


def test_items_at_the_keys_indentation_get_a_new_item_at_the_same_indentation() -> None:
    text = "nodes: []\npods:\n- name: a\n  node: n\n"
    edited = text_with_pod_added(text, POD)
    assert edited is not None
    assert edited.splitlines()[-1].startswith("- {name: pod-e, ")
    assert yaml.safe_load(edited) == appended(text)


def test_a_last_item_with_a_block_scalar_keeps_the_scalar_whole() -> None:
    text = "nodes: []\npods:\n  - name: a\n    note: |\n      one\n      two\n"
    edited = text_with_pod_added(text, POD)
    assert edited is not None
    assert yaml.safe_load(edited) == appended(text)


@pytest.mark.parametrize(
    "text",
    [
        "nodes: []\npods: []  # none yet\ntimeline: []\n",
        "nodes: []\npods:\ntimeline: []\n",
        "nodes: []\npods: ~\n",
        "nodes: []\n",
        "nodes: []",
    ],
    ids=["empty-flow-list", "empty-value", "null", "no-pods-key", "no-final-newline"],
)
def test_an_empty_or_missing_pods_list_becomes_a_list_of_the_new_pod(text: str) -> None:
    edited = text_with_pod_added(text, POD)
    assert edited is not None
    assert yaml.safe_load(edited) == appended(text)
    assert edited.startswith("nodes: []\n")


@pytest.mark.parametrize(
    "text",
    [
        "nodes: []\npods: [{name: a, node: n}]\n",  # an inline list with items
        "nodes: []\npods: {name: a}\n",  # not a list at all
        "- just a list\n",  # not a mapping
        "nodes: [\n",  # not YAML
    ],
    ids=["inline-list", "mapping", "top-level-list", "broken"],
)
def test_a_file_that_cannot_be_edited_in_place_is_left_to_a_whole_rewrite(text: str) -> None:
    assert text_with_pod_added(text, POD) is None


def test_a_file_with_crlf_line_endings_keeps_them_and_gets_them_on_the_new_line() -> None:
    text = "# notes\r\nnodes: []\r\npods:\r\n  - name: a\r\n    node: n\r\ntimeline: []\r\n"
    edited = text_with_pod_added(text, POD)
    assert edited is not None
    assert yaml.safe_load(edited) == appended(text)
    lines = edited.split("\r\n")
    assert "\n" not in "".join(lines)  # every line break is still CRLF
    assert lines[5].startswith("  - {name: pod-e, ")
