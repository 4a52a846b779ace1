"""Prometheus configuration, alert rules and the Grafana dashboard of deploy/.

promtool (Debian package "prometheus"; scripts/install-prometheus.sh) checks the
scrape configs and the rules and runs the rules' unit tests, which feed real
series to every alert and expect it to fire, or not. Each alert's firing
expectation is then removed in turn and promtool must notice: the tests can fail.
Every PromQL expression, of the rules and of the dashboard, may only name the
metrics the services export.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.prometheus

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "rules" / "gpupool-alerts.yml"
RULE_TESTS = PROMETHEUS / "rules" / "gpupool-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gpupool-dashboard.json"

SERVICE_PORTS = {
    "gpupool-policy": 9101,
    "gpupool-admission-queue": 9102,
    "gpupool-preemption": 9103,
    "gpupool-node-executor": 9104,
    "gpupool-extender": 9105,
}

KNOWN_METRICS = frozenset(
    {
        # admission-queue
        "DCGM_FI_POOLING_STATUS",
        "DCGM_FI_POOLING_POSITION",
        "gpupool_queue_length",
        "gpupool_wait_seconds_bucket",
        "gpupool_wait_seconds_sum",
        "gpupool_wait_seconds_count",
        "gpupool_assignments_total",
        "gpupool_preemptions_total",
        "gpupool_releases_total",
        "gpupool_gpu_allocated_limit_percent",
        "gpupool_rejected_messages_total",
        "gpupool_log_last_sequence",
        "gpupool_pod_gpu_info",
        # node-executor
        "gpupool_inventory_simulated",
        "gpupool_gpu_memory_used_bytes",
        "gpupool_gpu_utilization_ratio",
        "gpupool_pod_gpu_memory_used_bytes",
        "gpupool_pod_compute_utilization_of_limit_ratio",
        # every scrape
        "up",
    }
)

ALERTS = (
    "GpupoolPodWaitingTooLong",
    "GpupoolPreemptionStorm",
    "GpupoolNodeExecutorDown",
    "GpupoolSimulatedInventory",
    "GpupoolQueueStuck",
    "GpupoolRejectedMessages",
)


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail(
            "promtool not found: run scripts/install-prometheus.sh (installs the Debian "
            "package 'prometheus'; the project's setup runs it)"
        )
    return found


def run_promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=60, check=False
    )


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# ------------------------------------------------------------------ metric names

_PROMQL_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}
    | {"offset", "bool", "inf", "nan", "atan2"}
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not functions, labels, keywords)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery windows
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\boffset\s+-?\w+", "", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before == ".":
            continue  # the exponent or unit of a number: 1e3, 5m
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group() in _PROMQL_KEYWORDS:
            continue
        names.add(match.group())
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        pytest.param("up", {"up"}, id="bare"),
        pytest.param(
            'sum by (le) (rate(foo_bucket{node=~"$node", le!="+Inf"}[$__rate_interval]))',
            {"foo_bucket"},
            id="aggregation-labels-range",
        ),
        pytest.param(
            "a > 0 and on (node) max by (node) (b offset 15m) unless on (node) c > 1e3",
            {"a", "b", "c"},
            id="set-operators-offset-exponent",
        ),
        pytest.param(
            'histogram_quantile(0.9, sum(rate(x[5m])) by (le)) / 60 or vector(0) * y{a="sum(z)"}',
            {"x", "y"},
            id="functions-strings",
        ),
    ],
)
def test_metric_names_are_read_from_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


# ------------------------------------------------------------------ configs


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-compose.yml"])
def test_promtool_accepts_the_scrape_config(promtool: str, config: str) -> None:
    result = run_promtool(promtool, "check", "config", str(PROMETHEUS / config))
    assert result.returncode == 0, result.stdout + result.stderr


def promtool_knows_kubernetes_sd(promtool: str, tmp_path: Path) -> bool:
    probe = tmp_path / "probe.yml"
    probe.write_text(
        "scrape_configs:\n  - job_name: probe\n    kubernetes_sd_configs:\n      - role: pod\n"
    )
    return run_promtool(promtool, "check", "config", str(probe)).returncode == 0


def test_promtool_accepts_the_kubernetes_scrape_config(promtool: str, tmp_path: Path) -> None:
    """As it is where promtool has Kubernetes discovery; Debian builds promtool without it,
    so there the discovery block is replaced by a static target and everything else (the
    relabelling regexes, honor_labels, the rule files) is still checked by promtool.
    tests/unit/test_deploy_manifests.py runs the relabelling over the real pods."""
    source = PROMETHEUS / "prometheus-kubernetes.yml"
    config = load_yaml(source)
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [
        {"role": "pod", "namespaces": {"names": ["gpupool-system"]}}
    ]
    if promtool_knows_kubernetes_sd(promtool, tmp_path):
        checked = source
    else:
        del job["kubernetes_sd_configs"]
        job["static_configs"] = [{"targets": ["10.0.0.1:9101"]}]
        config["rule_files"] = [str(PROMETHEUS / rule) for rule in config["rule_files"]]
        checked = tmp_path / "prometheus-kubernetes.yml"
        checked.write_text(yaml.safe_dump(config))
    result = run_promtool(promtool, "check", "config", str(checked))
    assert result.returncode == 0, result.stdout + result.stderr


def test_local_targets_are_the_service_ports() -> None:
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    targets = {
        job["job_name"]: [t for static in job["static_configs"] for t in static["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets == {job: [f"127.0.0.1:{port}"] for job, port in SERVICE_PORTS.items()}


@pytest.mark.parametrize(
    "config", ["prometheus.yml", "prometheus-compose.yml", "prometheus-kubernetes.yml"]
)
def test_every_config_loads_the_alert_rules(config: str) -> None:
    rule_files = [PROMETHEUS / path for path in load_yaml(PROMETHEUS / config)["rule_files"]]
    assert rule_files == [RULES]


# ------------------------------------------------------------------ rules


def test_promtool_accepts_the_rules(promtool: str) -> None:
    result = run_promtool(promtool, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_tests_pass(promtool: str) -> None:
    result = run_promtool(promtool, "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(RULES)["groups"] for rule in group["rules"]]


def test_the_alerts_are_the_agreed_ones() -> None:
    assert tuple(rule["alert"] for rule in alert_rules()) == ALERTS
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_rules_read_only_known_metrics(rule: dict[str, Any]) -> None:
    names = metric_names(rule["expr"])
    assert names
    assert names <= KNOWN_METRICS


def rule_test_cases() -> list[dict[str, Any]]:
    return [case for test in load_yaml(RULE_TESTS)["tests"] for case in test["alert_rule_test"]]


@pytest.mark.parametrize("alert", ALERTS)
def test_each_alert_is_tested_firing_and_quiet(alert: str) -> None:
    cases = [case for case in rule_test_cases() if case["alertname"] == alert]
    assert any(case["exp_alerts"] for case in cases), f"{alert}: no case where it fires"
    assert any(not case["exp_alerts"] for case in cases), f"{alert}: no case where it is quiet"


@pytest.mark.parametrize("alert", ALERTS)
def test_rule_tests_fail_when_an_alert_would_not_fire(
    promtool: str, tmp_path: Path, alert: str
) -> None:
    """Expect silence where the alert fires: promtool must report the difference."""
    tests = load_yaml(RULE_TESTS)
    tests["rule_files"] = [str(RULES)]
    changed = 0
    for test in tests["tests"]:
        for case in test["alert_rule_test"]:
            if case["alertname"] == alert and case["exp_alerts"]:
                case["exp_alerts"] = []
                changed += 1
    assert changed
    mutated = tmp_path / "mutated.test.yml"
    mutated.write_text(yaml.safe_dump(tests))
    result = run_promtool(promtool, "test", "rules", str(mutated))
    assert result.returncode != 0
    assert alert in result.stdout + result.stderr


# ------------------------------------------------------------------ dashboard


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> list[dict[str, Any]]:
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard."""
    return [(panel["title"], target["expr"]) for panel in panels() for target in panel["targets"]]


def as_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced by values Prometheus accepts."""
    text = expr.replace("$__rate_interval", "5m").replace("$__range", "1h")
    return re.sub(r"\$\{?(node|namespace|pod)\}?", ".*", text)


def test_dashboard_is_a_grafana_dashboard() -> None:
    board = dashboard()
    assert board["uid"] == "gpupool-overview"
    assert board["schemaVersion"] >= 36
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    node_values = re.fullmatch(r"label_values\((\w+), node\)", variables["node"]["definition"])
    assert node_values is not None and node_values[1] in KNOWN_METRICS
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]


def test_dashboard_has_namespace_and_pod_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert re.fullmatch(
        r"label_values\(DCGM_FI_POOLING_STATUS\{.*\}, namespace\)",
        variables["namespace"]["definition"],
    )
    assert re.fullmatch(
        r"label_values\(DCGM_FI_POOLING_STATUS\{.*\}, pod\)", variables["pod"]["definition"]
    )
    for panel in panels_reading("DCGM_FI_POOLING_STATUS") + panels_reading(
        "DCGM_FI_POOLING_POSITION"
    ):
        for target in panel["targets"]:
            assert 'namespace=~"$namespace"' in target["expr"], panel["title"]
            assert 'pod=~"$pod"' in target["expr"], panel["title"]


def test_pooling_status_timeline_is_one_panel_per_node() -> None:
    (panel,) = [
        p for p in panels_reading("DCGM_FI_POOLING_STATUS") if p["type"] == "state-timeline"
    ]
    assert panel["repeat"] == "node"
    assert "$node" in panel["title"]


def panels_reading(metric: str) -> list[dict[str, Any]]:
    return [
        panel
        for panel in panels()
        if any(metric in metric_names(target["expr"]) for target in panel["targets"])
    ]


@pytest.mark.parametrize(
    ("metric", "kinds", "must_contain"),
    [
        pytest.param("gpupool_queue_length", {"timeseries"}, "by (node)", id="queue-per-node"),
        pytest.param("DCGM_FI_POOLING_POSITION", {"table"}, "pod", id="positions-table"),
        pytest.param("DCGM_FI_POOLING_STATUS", {"state-timeline"}, "pod", id="status-per-pod"),
        pytest.param(
            "gpupool_gpu_allocated_limit_percent",
            {"bargauge", "heatmap"},
            "gpu",
            id="allocated-limit-per-gpu",
        ),
        pytest.param("gpupool_preemptions_total", {"timeseries"}, "by (reason)", id="preemptions"),
        pytest.param(
            "gpupool_wait_seconds_bucket", {"timeseries"}, "histogram_quantile", id="wait-quantiles"
        ),
        pytest.param("gpupool_inventory_simulated", {"stat"}, "by (node)", id="simulated-flag"),
        pytest.param(
            "DCGM_FI_POOLING_POSITION", {"timeseries"}, "pod", id="queue-position-over-time"
        ),
        pytest.param("gpupool_pod_gpu_info", {"state-timeline"}, "gpu", id="who-holds-which-gpu"),
    ],
)
def test_dashboard_has_the_required_panel(metric: str, kinds: set[str], must_contain: str) -> None:
    found = [
        panel
        for panel in panels_reading(metric)
        if panel["type"] in kinds
        and any(must_contain in target["expr"] for target in panel["targets"])
    ]
    assert found, f"no {kinds} panel over {metric} with {must_contain!r}"


def test_wait_time_panel_shows_several_quantiles() -> None:
    (panel,) = panels_reading("gpupool_wait_seconds_bucket")
    quantiles = {
        float(match)
        for target in panel["targets"]
        for match in re.findall(r"histogram_quantile\(([0-9.]+)", target["expr"])
    }
    assert {0.5, 0.9, 0.99} <= quantiles


@pytest.mark.parametrize(("title", "expr"), expressions(), ids=lambda value: str(value)[:60])
def test_dashboard_queries_read_only_known_metrics(title: str, expr: str) -> None:
    names = metric_names(expr)
    assert names, title
    assert names <= KNOWN_METRICS, title


def test_promtool_accepts_every_dashboard_query(promtool: str, tmp_path: Path) -> None:
    """Each query becomes a recording rule: promtool parses every expression."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"gpupool_dashboard:query_{index}", "expr": as_promql(expr)}
                    for index, (_, expr) in enumerate(expressions())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run_promtool(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions())} rules found" in result.stdout + result.stderr


def test_promtool_check_rejects_a_broken_query(promtool: str, tmp_path: Path) -> None:
    path = tmp_path / "broken.yml"
    broken = {"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum by (node"}]}]}
    path.write_text(yaml.safe_dump(broken))
    assert run_promtool(promtool, "check", "rules", str(path)).returncode != 0
