"""compose.yaml, checked structurally (no Docker engine is needed).

Every service has an image, a command and a health check; the gpupool services
run their module on their port and reach NATS; host ports never collide in any
set of services that runs together; the simulated GPUs exist only in the
"simulated" profile; Prometheus scrapes exactly the ports the services listen
on; the policy's local cluster file is one the policy service can read. Where a
Docker engine is reachable, ``docker compose config`` validates the file too.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupool.policy.local_config import load_local_cluster

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
IMAGE = "ghcr.io/gpupool/gpupool:0.1.0"

GPUPOOL_SERVICES = {
    # compose service: (python module, HTTP port)
    "policy": ("policy", 9101),
    "admission-queue": ("admission_queue", 9102),
    "preemption": ("preemption", 9103),
    "node-executor-simulated": ("node_executor", 9104),
    "node-executor": ("node_executor", 9104),
    "extender": ("extender", 9105),
}
SIMULATED_PROFILE = "simulated"


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def profiles() -> set[str]:
    return {profile for service in services().values() for profile in service.get("profiles", [])}


def running_together(profile: str | None) -> dict[str, dict[str, Any]]:
    """The services `docker compose [--profile P] up` starts."""
    return {
        name: service
        for name, service in services().items()
        if not service.get("profiles") or profile in service["profiles"]
    }


def host_ports(service: dict[str, Any]) -> list[int]:
    """Published host ports of "[ip:]host:container" entries."""
    ports = []
    for entry in service.get("ports", []):
        parts = str(entry).split(":")
        assert len(parts) in (2, 3), f"{entry}: publish an explicit host port"
        ports.append(int(parts[-2]))
    return ports


def healthcheck_test(service: dict[str, Any]) -> list[str]:
    test: list[str] = service["healthcheck"]["test"]
    return test


def test_every_service_has_image_command_and_healthcheck() -> None:
    for name, service in services().items():
        assert service.get("image"), name
        assert service.get("command"), name
        assert isinstance(service["command"], list), name
        test = healthcheck_test(service)
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name


@pytest.mark.parametrize("name", sorted(GPUPOOL_SERVICES))
def test_each_gpupool_service_runs_its_module_on_its_port(name: str) -> None:
    module, port = GPUPOOL_SERVICES[name]
    service = services()[name]
    assert service["image"] == IMAGE
    assert service["command"][:3] == ["python", "-m", f"gpupool.{module}"]
    environment = service["environment"]
    assert environment["GPUPOOL_NATS_URL"] == "nats://nats:4222"
    assert environment["GPUPOOL_HTTP_PORT"] == str(port)
    # The health check and Prometheus reach the service from outside its loopback.
    assert environment["GPUPOOL_HTTP_HOST"] == "0.0.0.0"
    assert service["ports"] == [f"{port}:{port}"]
    assert f"http://127.0.0.1:{port}/healthz" in " ".join(healthcheck_test(service))
    assert service["depends_on"] == {"nats": {"condition": "service_healthy"}}


def test_nats_runs_jetstream_on_a_volume() -> None:
    nats = services()["nats"]
    command = nats["command"]
    assert "--jetstream" in command or "-js" in command
    store = command[command.index("--store_dir") + 1]
    volumes = {entry.split(":")[1]: entry.split(":")[0] for entry in nats["volumes"]}
    assert volumes[store] in compose()["volumes"]
    assert "4222:4222" in nats["ports"]


@pytest.mark.parametrize("profile", [None, "simulated", "gpu"])
def test_host_ports_are_unique_among_services_that_run_together(profile: str | None) -> None:
    seen: dict[int, str] = {}
    for name, service in running_together(profile).items():
        for port in host_ports(service):
            assert port not in seen, f"port {port}: {seen.get(port)} and {name}"
            seen[port] = name


def test_the_profiles_are_the_documented_ones() -> None:
    assert profiles() == {SIMULATED_PROFILE, "gpu"}


def test_simulated_gpus_only_in_the_simulated_profile() -> None:
    simulating = {
        name
        for name, service in services().items()
        if any("simulate" in str(word) for word in service["command"])
    }
    assert simulating == {"node-executor-simulated"}
    assert services()["node-executor-simulated"]["profiles"] == [SIMULATED_PROFILE]
    assert "node-executor-simulated" not in running_together(None)
    assert "node-executor" not in running_together(SIMULATED_PROFILE)


def test_real_gpu_node_executor_has_the_runtime_and_privileges_it_needs() -> None:
    executor = services()["node-executor"]
    assert executor["profiles"] == ["gpu"]
    assert executor["pid"] == "host"
    assert executor["cap_drop"] == ["ALL"]
    assert executor["cap_add"] == [
        "KILL",
        "SYS_PTRACE",
        "SYS_ADMIN",
        "SYS_CHROOT",
        "SETUID",
        "SETGID",
    ]
    (device,) = executor["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == "all"
    assert executor["environment"]["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "--simulate-gpus" not in executor["command"]


def network_names(name: str, service: dict[str, Any]) -> set[str]:
    """The names a service answers to on the default network: its own and its aliases."""
    aliases = service.get("networks", {}).get("default", {}).get("aliases", [])
    return {name, *aliases}


def prometheus_config() -> tuple[Path, dict[str, Any]]:
    prometheus = services()["prometheus"]
    (config_flag,) = [arg for arg in prometheus["command"] if arg.startswith("--config.file=")]
    in_container = config_flag.split("=", 1)[1]
    for volume in prometheus["volumes"]:
        source, target = volume.split(":")[:2]
        if in_container.startswith(target + "/"):
            path = ROOT / source / in_container[len(target) + 1 :]
            loaded: dict[str, Any] = yaml.safe_load(path.read_text())
            return path, loaded
    raise AssertionError(f"{in_container} is not on a volume of the prometheus service")


def test_prometheus_mounts_the_compose_scrape_config() -> None:
    path, _ = prometheus_config()
    assert path == ROOT / "deploy" / "prometheus" / "prometheus-compose.yml"
    assert services()["prometheus"]["image"].startswith("prom/prometheus:")


@pytest.mark.parametrize("profile", ["simulated", "gpu"])
def test_prometheus_targets_are_the_service_ports(profile: str) -> None:
    _, config = prometheus_config()
    up = running_together(profile)
    listening = {
        (host, int(service["environment"]["GPUPOOL_HTTP_PORT"]))
        for name, service in up.items()
        if "GPUPOOL_HTTP_PORT" in service.get("environment", {})
        for host in network_names(name, service)
    }
    scraped = set()
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                assert (host, int(port)) in listening, f"{job['job_name']}: {target}"
                # The job is named after the service everywhere (alerts use it).
                module = GPUPOOL_SERVICES[host][0]
                assert job["job_name"] == "gpupool-" + module.replace("_", "-")
                scraped.add(int(port))
    assert scraped == {port for _, port in GPUPOOL_SERVICES.values()}


def test_policy_cluster_file_is_readable_and_matches_the_executor() -> None:
    policy = services()["policy"]
    flag = policy["command"].index("--cluster")
    in_container = policy["command"][flag + 1]
    (source,) = [
        volume.split(":")[0] for volume in policy["volumes"] if volume.split(":")[1] == in_container
    ]
    cluster = load_local_cluster(ROOT / source)
    simulated = services()["node-executor-simulated"]
    gpus = int(simulated["command"][simulated["command"].index("--simulate-gpus") + 1])
    (node,) = cluster.nodes
    assert node.name == simulated["environment"]["GPUPOOL_NODE_NAME"]
    assert node.gpus == gpus
    real_node_name = services()["node-executor"]["environment"]["GPUPOOL_NODE_NAME"]
    assert re.fullmatch(r"\$\{GPUPOOL_NODE_NAME:-(.+)\}", real_node_name)[1] == node.name  # type: ignore[index]


# ------------------------------------------------------------------ with a Docker engine


@cache
def docker_engine_reachable() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def test_docker_compose_accepts_the_file() -> None:
    if not docker_engine_reachable():
        pytest.skip("no Docker engine")
    docker_cli = shutil.which("docker")
    if docker_cli is None:
        pytest.skip("a Docker engine answers but there is no docker CLI for `docker compose`")
    for profile_args in ([], ["--profile", "simulated"], ["--profile", "gpu"]):
        result = subprocess.run(
            [docker_cli, "compose", "-f", str(COMPOSE), *profile_args, "config", "--quiet"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
