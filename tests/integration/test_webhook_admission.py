"""The mutating admission webhook as a real process over HTTPS: real AdmissionReview v1 requests
in, the JSONPatch applied with an independent RFC 6902 library (jsonpatch), the patched pod
validated with kubernetes-validate --strict; an invalid share spec is denied with the core's
reason; bad requests are answered 400 and the webhook keeps serving."""

from __future__ import annotations

import asyncio
import base64
import copy
import http.client
import json
import re
import ssl
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import kubernetes_validate.utils
import msgspec
import pytest
import trustme
import yaml

from gpupool.core import Rejection, validate_pod
from gpupool.kube.pod_directory import pod_manifest
from gpupool.kube.records import Pod

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = yaml.safe_load((ROOT / "deploy" / "examples" / "notebook-pod.yaml").read_text())
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
HOOK = "/opt/gpupool/cuda-hook/libgpupool-cuda-hook.so"


class Webhook:
    def __init__(self, port: int, context: ssl.SSLContext) -> None:
        self.port = port
        self.context = context

    def _post(self, body: bytes) -> tuple[int, bytes]:
        connection = http.client.HTTPSConnection(
            "localhost", self.port, context=self.context, timeout=10
        )
        try:
            connection.request("POST", "/mutate", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    async def post(self, body: bytes) -> tuple[int, bytes]:
        return await asyncio.to_thread(self._post, body)

    async def review(self, pod: dict[str, Any], namespace: str = "team-a") -> dict[str, Any]:
        request_uid = str(uuid.uuid4())
        status, body = await self.post(
            json.dumps(admission_review(pod, namespace, request_uid)).encode()
        )
        assert status == 200, body
        answer = json.loads(body)
        assert answer["apiVersion"] == "admission.k8s.io/v1"
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == request_uid
        response: dict[str, Any] = answer["response"]
        return response


def admission_review(pod: dict[str, Any], namespace: str, request_uid: str) -> dict[str, Any]:
    """What the API server sends for `kubectl apply` of a new pod."""
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": request_uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"].get("name", ""),
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


@pytest.fixture
async def webhook(tmp_path: Path) -> AsyncIterator[Webhook]:
    authority = trustme.CA()
    certificate = authority.issue_cert("localhost")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    certificate.cert_chain_pems[0].write_to_path(str(cert))
    for extra in certificate.cert_chain_pems[1:]:
        extra.write_to_path(str(cert), append=True)
    certificate.private_key_pem.write_to_path(str(key))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpupool.webhook",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "0",
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        async with asyncio.timeout(30):
            while True:
                line = (await process.stderr.readline()).decode()
                assert line, "the webhook exited before listening"
                found = re.search(r"listening on https://[^:]+:(\d+)", line)
                if found:
                    break
        context = ssl.create_default_context()
        authority.configure_trust(context)
        yield Webhook(int(found.group(1)), context)
    finally:
        process.terminate()
        await process.wait()


def patched(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(pod, patch)
    return result


def strictly_valid(pod: dict[str, Any]) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


async def test_a_share_pool_pod_gets_the_cuda_hook_and_stays_a_valid_pod(webhook: Webhook) -> None:
    pod = copy.deepcopy(NOTEBOOK)
    response = await webhook.review(pod)
    result = patched(pod, response)
    strictly_valid(result)
    container = result["spec"]["containers"][0]
    assert env_of(container) == {
        "LD_PRELOAD": HOOK,
        "GPUPOOL_SOCKET": "/run/gpupool/gpupool.sock",
        "GPUPOOL_POD_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        "GPUPOOL_POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
    }
    assert {m["mountPath"]: m["readOnly"] for m in container["volumeMounts"]} == {
        HOOK: True,
        "/run/gpupool": True,
    }
    assert {v["name"]: v["hostPath"] for v in result["spec"]["volumes"]} == {
        "gpupool-cuda-hook": {
            "path": "/var/lib/gpupool/cuda-hook/libgpupool-cuda-hook.so",
            "type": "File",  # no hook on the node: the pod does not start (fail closed)
        },
        "gpupool-run": {"path": "/run/gpupool", "type": "Directory"},
    }
    assert result["spec"]["securityContext"]["supplementalGroups"] == [10001]
    assert result["metadata"]["annotations"] == {"gpupool.io/cuda-hook": "v1"}
    # everything the user wrote is untouched
    assert container["image"] == NOTEBOOK["spec"]["containers"][0]["image"]
    assert container["resources"] == NOTEBOOK["spec"]["containers"][0]["resources"]
    # reviewed again (reinvocation): nothing more to add
    again = await webhook.review(result)
    assert again == {"uid": again["uid"], "allowed": True}


async def test_existing_env_volumes_and_preload_are_kept(webhook: Webhook) -> None:
    pod = copy.deepcopy(NOTEBOOK)
    spec = pod["spec"]
    spec["volumes"] = [{"name": "data", "emptyDir": {}}]
    spec["securityContext"] = {"runAsUser": 1000, "supplementalGroups": [100]}
    spec["containers"][0]["env"] = [
        {"name": "LD_PRELOAD", "value": "/usr/lib/libjemalloc.so"},
        {"name": "GPUPOOL_SOCKET", "value": "/elsewhere.sock"},
        {"name": "TZ", "value": "UTC"},
    ]
    spec["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    spec["containers"].append({"name": "sidecar", "image": "busybox:1.36"})
    result = patched(pod, await webhook.review(pod))
    strictly_valid(result)
    main, sidecar = result["spec"]["containers"]
    assert env_of(main) == {
        "LD_PRELOAD": f"{HOOK}:/usr/lib/libjemalloc.so",
        "GPUPOOL_SOCKET": "/run/gpupool/gpupool.sock",
        "TZ": "UTC",
        "GPUPOOL_POD_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        "GPUPOOL_POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
    }
    assert env_of(sidecar)["LD_PRELOAD"] == HOOK  # every container's processes are gated
    assert [m["name"] for m in main["volumeMounts"]] == ["data", "gpupool-cuda-hook", "gpupool-run"]
    assert [v["name"] for v in result["spec"]["volumes"]] == [
        "data",
        "gpupool-cuda-hook",
        "gpupool-run",
    ]
    assert result["spec"]["securityContext"] == {
        "runAsUser": 1000,
        "supplementalGroups": [100, 10001],
    }


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            lambda pod: pod["spec"]["containers"][0]["resources"]["limits"].update(
                {"alibabacloud.com/gpu-core.percentage": "10"}
            ),
            "LimitBelowRequest",
        ),
        (
            lambda pod: pod["metadata"]["labels"].update(
                {"alibabacloud.com/gpu-share-policy": "sometimes"}
            ),
            "InvalidSharePolicy",
        ),
        (
            lambda pod: pod["spec"]["containers"][0]["resources"]["requests"].update(
                {"alibabacloud.com/gpu-memory.percentage": "150"}
            ),
            "InvalidPercentage",
        ),
    ],
)
async def test_an_invalid_share_spec_is_denied_with_the_cores_reason(
    webhook: Webhook, change: Any, reason: str
) -> None:
    pod = copy.deepcopy(NOTEBOOK)
    change(pod)
    response = await webhook.review(pod)
    expected = validate_pod(pod_manifest(msgspec.convert(pod, Pod)))
    assert isinstance(expected, Rejection)
    assert expected.reason == reason
    assert response["allowed"] is False
    assert response["status"] == {"code": 403, "message": f"{reason}: {expected.message}"}
    assert "patch" not in response


async def test_pods_that_do_not_share_gpus_pass_unchanged(webhook: Webhook) -> None:
    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web"},
        "spec": {"containers": [{"name": "web", "image": "nginx:1.27"}]},
    }
    static = copy.deepcopy(NOTEBOOK)
    static["metadata"]["labels"]["alibabacloud.com/gpu-share-policy"] = "static"
    for pod in (plain, static):
        response = await webhook.review(pod)
        assert response == {"uid": response["uid"], "allowed": True}


async def test_a_bad_request_is_refused_and_the_webhook_keeps_serving(webhook: Webhook) -> None:
    for body in (
        b"{not json",
        b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1beta1"}',
        b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"}',
        b"\xff\xfe",
    ):
        status, answer = await webhook.post(body)
        assert status == 400, answer
    assert (await webhook.review(copy.deepcopy(NOTEBOOK)))["allowed"] is True
