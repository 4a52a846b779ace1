"""The Helm chart deploy/helm/gpupool: generated from the kustomize base, rendered offline.

Helm runs as a library (helm-python-sdk bundles it: no helm binary, no cluster).
The chart is one source with kustomize: its templates are what
scripts/generate_helm_chart.py writes from ``kubectl kustomize deploy/base``, and
with its default values it renders exactly the base's objects. Every rendered
object, for the default, production and existing-NATS values, passes
``kubernetes-validate --strict`` (the Prometheus Operator's kinds: our strict
schemas), and ``helm lint --strict`` finds nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpupool"
NAMESPACE = "gpupool-system"
SCHEMAS = ROOT / "deploy" / "schemas"
CUSTOM_SCHEMAS = {
    "ServiceMonitor": SCHEMAS / "servicemonitor-monitoring-v1.json",
    "PrometheusRule": SCHEMAS / "prometheusrule-monitoring-v1.json",
}
PRODUCTION = yaml.safe_load((CHART / "values-production.yaml").read_text())
EXISTING_NATS = {
    "nats": {
        "bundled": False,
        "existing": {"urlSecret": {"name": "gpupool-nats-url", "key": "url"}},
    }
}
Doc = dict[str, Any]


def render(values: dict[str, Any] | None = None) -> list[Doc]:
    chart = helm.Chart.load(str(CHART))
    files = chart.render(values or {}, name="gpupool", namespace=NAMESPACE, is_install=True)
    return [
        doc
        for name, text in sorted(files.items())
        if name.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


@cache
def kustomize_base() -> tuple[Doc, ...]:
    kubectl = Path(sys.executable).parent / "kubectl"
    output = subprocess.run(
        [str(kubectl), "kustomize", str(ROOT / "deploy" / "base")],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    return tuple(doc for doc in yaml.safe_load_all(output) if doc)


def normalized(docs: list[Doc] | tuple[Doc, ...]) -> dict[tuple[str, str], Doc]:
    """By (kind, name), with what differs by construction made equal: the managed-by label
    (kustomize / Helm) and the settings ConfigMap's content-hash suffix (both tools add one)."""
    text = json.dumps(list(docs))
    text = text.replace(
        '"app.kubernetes.io/managed-by": "Helm"', '"app.kubernetes.io/managed-by": "kustomize"'
    )
    text = re.sub(r'"gpupool-settings-[a-z0-9]{10}"', '"gpupool-settings-HASH"', text)
    return {(d["kind"], d["metadata"]["name"]): d for d in json.loads(text)}


def by_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def containers(doc: Doc) -> list[Doc]:
    spec = doc["spec"]["template"]["spec"]
    found: list[Doc] = spec.get("initContainers", []) + spec["containers"]
    return found


def test_the_chart_is_what_the_generator_writes_from_the_kustomize_base() -> None:
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate_helm_chart.py"), "--check"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def test_default_values_render_exactly_the_kustomize_base() -> None:
    chart = normalized(render())
    base = normalized(kustomize_base())
    assert set(chart) == set(base)
    for key, doc in base.items():
        assert chart[key] == doc, key


@pytest.mark.parametrize(
    "values", [None, PRODUCTION, EXISTING_NATS], ids=["default", "production", "existing-nats"]
)
def test_helm_lint_strict_finds_nothing(values: dict[str, Any] | None) -> None:
    report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [] and report["errors"] == [], report


@pytest.fixture(scope="module", autouse=True)
def _schemas_read_once() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            kubernetes_validate.utils,
            "schema_contents",
            cache(kubernetes_validate.utils.schema_contents),
        )
        yield


@pytest.mark.parametrize(
    "values", [None, PRODUCTION, EXISTING_NATS], ids=["default", "production", "existing-nats"]
)
@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.utils.latest_version()])
def test_every_rendered_manifest_passes_kubernetes_validate_strict(
    values: dict[str, Any] | None, version: str
) -> None:
    errors = []
    for doc in render(values):
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in CUSTOM_SCHEMAS:
            validator = jsonschema.Draft202012Validator(
                json.loads(CUSTOM_SCHEMAS[doc["kind"]].read_text())
            )
            errors += [f"{where}: {e.message}" for e in validator.iter_errors(doc)]
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{where}: {'.'.join(map(str, error.path))}: {error.message}")
    assert errors == []


def test_production_values_scale_the_services_select_gpu_nodes_and_monitor() -> None:
    docs = render(PRODUCTION)
    replicas = {
        d["metadata"]["name"]: d["spec"]["replicas"]
        for d in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet")
        if d["metadata"]["name"] != "gpupool-nats"
    }
    assert replicas == {"gpupool-policy": 2, "gpupool-admission-queue": 3,
                        "gpupool-preemption": 2, "gpupool-extender": 3}  # fmt: skip
    (executor,) = by_kind(docs, "DaemonSet")
    assert executor["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.present": "true"
    }
    assert by_kind(docs, "Namespace") == []
    (rule,) = by_kind(docs, "PrometheusRule")
    component = yaml.safe_load(
        (ROOT / "deploy/components/monitoring/prometheusrule.yaml").read_text()
    )
    assert rule["spec"] == component["spec"]  # Prometheus' own {{ $labels }} survive Helm
    assert len(by_kind(docs, "ServiceMonitor")) == 1


def test_an_existing_nats_replaces_the_bundled_one_and_its_url_comes_from_a_secret() -> None:
    docs = render(EXISTING_NATS)
    assert not [d for d in docs if d["metadata"]["name"].startswith("gpupool-nats")]
    workloads = (
        by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet") + by_kind(docs, "DaemonSet")
    )
    assert {w["metadata"]["name"] for w in by_kind(docs, "StatefulSet")} == {
        "gpupool-policy", "gpupool-admission-queue", "gpupool-preemption"}  # fmt: skip
    for workload in workloads:
        for container in containers(workload):
            (url,) = [e for e in container.get("env", []) if e["name"] == "GPUPOOL_NATS_URL"]
            assert url["valueFrom"]["secretKeyRef"] == {"name": "gpupool-nats-url", "key": "url"}
    with pytest.raises(helm.HelmError, match=r"nats\.existing\.url"):
        render({"nats": {"bundled": False}})


def test_images_by_digest_and_node_selection_come_from_the_values() -> None:
    digest = "sha256:" + "a" * 64
    values = {
        "image": {"digest": digest},
        "nats": {"image": {"tag": "2.12.1-alpine"}},
        "nodeExecutor": {"nodeSelector": {"pool": "gpu"}, "tolerations": []},
    }
    docs = render(values)
    images = {
        c["image"]
        for d in by_kind(docs, "Deployment")
        + by_kind(docs, "StatefulSet")
        + by_kind(docs, "DaemonSet")
        if d["metadata"]["name"] != "gpupool-nats"
        for c in containers(d)
    }
    assert images == {f"ghcr.io/gpupool/gpupool@{digest}"}
    (nats,) = [d for d in by_kind(docs, "StatefulSet") if d["metadata"]["name"] == "gpupool-nats"]
    assert {c["image"] for c in containers(nats)} == {"nats:2.12.1-alpine"}
    (executor,) = by_kind(docs, "DaemonSet")
    spec = executor["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"pool": "gpu"} and "tolerations" not in spec

    # the settings ConfigMap's name changes with its content: a changed setting rolls the pods
    def settings_name(docs: list[Doc]) -> str:
        (name,) = [
            d["metadata"]["name"]
            for d in by_kind(docs, "ConfigMap")
            if "settings" in d["metadata"]["name"]
        ]
        return name

    assert settings_name(render({"nats": {"streamReplicas": 1}})) != settings_name(render())


def test_the_qos_default_of_nodes_without_the_annotation_is_a_value() -> None:
    qos = '{"preemptEnabled": true, "podMaxDurationMinutes": 120}'

    def settings(docs: list[Doc]) -> Doc:
        (found,) = [d for d in by_kind(docs, "ConfigMap") if "settings" in d["metadata"]["name"]]
        return found

    default, chosen = settings(render()), settings(render({"policy": {"defaultQosConfig": qos}}))
    assert default["data"]["GPUPOOL_DEFAULT_QOS_CONFIG"] == ""  # none: as the kustomize base
    assert chosen["data"]["GPUPOOL_DEFAULT_QOS_CONFIG"] == qos
    assert chosen["metadata"]["name"] != default["metadata"]["name"]  # the pods roll
