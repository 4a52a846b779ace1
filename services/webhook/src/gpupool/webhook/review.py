"""AdmissionReview v1 in, AdmissionReview v1 out: the webhook's whole decision, without I/O.

A pod is a GPU-sharing pod when it carries the compute class ``gpu-hpn`` and a share policy
label. Such a pod is validated by the core exactly as the policy service will validate it
(``validate_pod``); a rejection denies the pod with the core's reason and message, so a bad
spec fails at ``kubectl apply``. A valid ``share-pool`` pod is mutated with a JSONPatch
(RFC 6902) that gives every container the CUDA hook:

* the hook library's host file (put there by the node-executor DaemonSet), read-only, with
  ``type: File`` so that the pod does not start on a node that lacks it;
* the node-executor's socket directory, read-only (enough to connect);
* ``LD_PRELOAD`` (the hook, in front of any preload the container already had),
  ``GPUPOOL_SOCKET`` and the pod's namespace and name from the downward API;
* the socket's group in ``supplementalGroups``.

Anything else (not a pod, not GPU-sharing, a static pod, a pod already injected) is allowed
unchanged. The patch is idempotent: a pod that already has the hook's volume gets none.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec

from gpupool.core.validation import (
    COMPUTE_CLASS,
    COMPUTE_CLASS_LABEL,
    POLICY_LABEL,
    Rejection,
    validate_pod,
)
from gpupool.kube.pod_directory import pod_manifest
from gpupool.kube.records import Pod

HOOK_VOLUME = "gpupool-cuda-hook"
SOCKET_VOLUME = "gpupool-run"
INJECTED_ANNOTATION = "gpupool.io/cuda-hook"


class HookSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Where the hook and the socket are on the node and in the pod."""

    hook_host_dir: str = "/var/lib/gpupool/cuda-hook"
    hook_mount_dir: str = "/opt/gpupool/cuda-hook"
    hook_file: str = "libgpupool-cuda-hook.so"
    socket_host_dir: str = "/run/gpupool"
    socket_mount_dir: str = "/run/gpupool"
    socket_file: str = "gpupool.sock"
    socket_group: int = 10001

    @property
    def hook_host_path(self) -> str:
        return f"{self.hook_host_dir}/{self.hook_file}"

    @property
    def hook_path(self) -> str:
        return f"{self.hook_mount_dir}/{self.hook_file}"

    @property
    def socket_path(self) -> str:
        return f"{self.socket_mount_dir}/{self.socket_file}"


class BadReview(ValueError):
    """The body is not an AdmissionReview v1 with a request (answered with HTTP 400)."""


def review(body: bytes, settings: HookSettings) -> bytes:
    """The AdmissionReview v1 response to ``body``."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadReview(f"not JSON: {error}") from error
    if not isinstance(document, dict) or document.get("kind") != "AdmissionReview":
        raise BadReview("not an AdmissionReview")
    if document.get("apiVersion") != "admission.k8s.io/v1":
        raise BadReview(f"apiVersion {document.get('apiVersion')!r}; only admission.k8s.io/v1")
    request = document.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        raise BadReview("the AdmissionReview has no request with a uid")
    response = _decide(request, settings)
    response["uid"] = request["uid"]
    return json.dumps(
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
    ).encode()


def _allow() -> dict[str, Any]:
    return {"allowed": True}


def _deny(message: str, code: int = 403) -> dict[str, Any]:
    return {"allowed": False, "status": {"code": code, "message": message}}


def _decide(request: dict[str, Any], settings: HookSettings) -> dict[str, Any]:
    kind = request.get("kind") or {}
    if kind.get("kind") != "Pod" or request.get("operation") != "CREATE":
        return _allow()
    pod = request.get("object")
    if not isinstance(pod, dict):
        return _deny("the request carries no pod object", 400)
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(COMPUTE_CLASS_LABEL) != COMPUTE_CLASS or POLICY_LABEL not in labels:
        return _allow()  # not a GPU-sharing pod: none of gpupool's business
    try:
        typed = msgspec.convert(pod, Pod)
    except msgspec.ValidationError as error:
        return _deny(f"gpupool cannot read this pod: {error}", 400)
    manifest = pod_manifest(typed)
    if not manifest.namespace:
        manifest = msgspec.structs.replace(manifest, namespace=str(request.get("namespace", "")))
    spec = validate_pod(manifest)
    if isinstance(spec, Rejection):
        return _deny(f"{spec.reason}: {spec.message}")
    if spec.policy != "share-pool":
        return _allow()  # a static pod holds its GPU whole: it needs no hook
    patch = hook_patch(pod, settings)
    if not patch:
        return _allow()
    response = _allow()
    response["patchType"] = "JSONPatch"
    response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return response


def _escape(key: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def hook_patch(pod: dict[str, Any], settings: HookSettings) -> list[dict[str, Any]]:
    """The JSONPatch operations that give every container of ``pod`` the CUDA hook."""
    spec = pod.get("spec") or {}
    volumes = spec.get("volumes")
    if any(v.get("name") == HOOK_VOLUME for v in volumes or []):
        return []  # already injected (reinvocation, or applied twice)
    ops: list[dict[str, Any]] = []
    new_volumes = [
        {
            "name": HOOK_VOLUME,
            # the file itself, type File: on a node without the hook the pod does not start
            # (a missing preload would be skipped by the loader and the process run unhooked)
            "hostPath": {"path": settings.hook_host_path, "type": "File"},
        },
        {
            "name": SOCKET_VOLUME,
            "hostPath": {"path": settings.socket_host_dir, "type": "Directory"},
        },
    ]
    _append(ops, "/spec/volumes", volumes, new_volumes)
    for kind in ("initContainers", "containers"):
        for index, container in enumerate(spec.get(kind) or []):
            base = f"/spec/{kind}/{index}"
            _append(
                ops,
                f"{base}/volumeMounts",
                container.get("volumeMounts"),
                [
                    {"name": HOOK_VOLUME, "mountPath": settings.hook_path, "readOnly": True},
                    {
                        "name": SOCKET_VOLUME,
                        "mountPath": settings.socket_mount_dir,
                        "readOnly": True,
                    },
                ],
            )
            _environment(ops, f"{base}/env", container.get("env"), settings)
    security = spec.get("securityContext")
    if security is None:
        ops.append(
            {
                "op": "add",
                "path": "/spec/securityContext",
                "value": {"supplementalGroups": [settings.socket_group]},
            }
        )
    elif settings.socket_group not in (security.get("supplementalGroups") or []):
        _append(
            ops,
            "/spec/securityContext/supplementalGroups",
            security.get("supplementalGroups"),
            [settings.socket_group],
        )
    annotations = (pod.get("metadata") or {}).get("annotations")
    if annotations is None:
        ops.append(
            {"op": "add", "path": "/metadata/annotations", "value": {INJECTED_ANNOTATION: "v1"}}
        )
    else:
        ops.append(
            {
                "op": "add",
                "path": f"/metadata/annotations/{_escape(INJECTED_ANNOTATION)}",
                "value": "v1",
            }
        )
    return ops


def _append(ops: list[dict[str, Any]], path: str, existing: Any, values: list[Any]) -> None:
    if existing is None:
        ops.append({"op": "add", "path": path, "value": values})
    else:
        ops.extend({"op": "add", "path": f"{path}/-", "value": value} for value in values)


def _environment(
    ops: list[dict[str, Any]], path: str, env: list[dict[str, Any]] | None, settings: HookSettings
) -> None:
    """Our variables set (replacing any of the same name); LD_PRELOAD keeps what it had."""
    wanted: list[dict[str, Any]] = [
        {"name": "LD_PRELOAD", "value": settings.hook_path},
        {"name": "GPUPOOL_SOCKET", "value": settings.socket_path},
        {
            "name": "GPUPOOL_POD_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
        {"name": "GPUPOOL_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    if env is None:
        ops.append({"op": "add", "path": path, "value": wanted})
        return
    positions = {entry.get("name"): index for index, entry in enumerate(env)}
    for entry in wanted:
        index = positions.get(entry["name"])
        if index is None:
            ops.append({"op": "add", "path": f"{path}/-", "value": entry})
            continue
        value = dict(entry)
        previous = env[index].get("value")
        if entry["name"] == "LD_PRELOAD" and previous:
            value["value"] = f"{settings.hook_path}:{previous}"
        ops.append({"op": "replace", "path": f"{path}/{index}", "value": value})
