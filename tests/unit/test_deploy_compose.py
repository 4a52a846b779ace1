"""compose.yaml, checked structurally (no Docker engine is needed).

Every service has a locally built image and a command, and every gpupool service
a health check; every container is on the host's network, listening on 127.0.0.1;
the gpupool services run their module on their port and reach NATS; ports never
collide in any set of services that runs together; the simulated GPUs exist only
in the "simulated" profile; Prometheus scrapes exactly the ports the services
listen on; the policy's local cluster file is one the policy service can read.
``docker-compose config`` validates the file too. The stack itself runs in
tests/compose/test_compose_stack.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupool.eventlog.credentials import write_credentials
from gpupool.eventlog.nats_server import find_nats_server
from gpupool.policy.local_config import load_local_cluster

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
IMAGE = "gpupool/gpupool:0.1.0"
LOCAL_IMAGES = {IMAGE, "gpupool/nats:local", "gpupool/prometheus:local"}
"""The tags scripts/build-images.sh gives the images it builds."""

GPUPOOL_SERVICES = {
    # compose service: (python module, HTTP port)
    "policy": ("policy", 9101),
    "admission-queue": ("admission_queue", 9102),
    "preemption": ("preemption", 9103),
    "node-executor-simulated": ("node_executor", 9104),
    "node-executor": ("node_executor", 9104),
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


def flag_value(command: list[str], *flags: str) -> str:
    for flag in flags:
        if flag in command:
            return command[command.index(flag) + 1]
        for word in command:
            if word.startswith(flag + "="):
                return word.split("=", 1)[1]
    raise AssertionError(f"none of {flags} in {command}")


def listening(name: str, service: dict[str, Any]) -> list[tuple[str, int]]:
    """(address, port) pairs a service listens on (all on the host's network)."""
    command = service["command"]
    if name == "nats":
        host = flag_value(command, "-a", "--addr")
        return [(host, int(flag_value(command, "-p", "--port"))),
                (host, int(flag_value(command, "--http_port", "-m")))]  # fmt: skip
    if name == "prometheus":
        host, port = flag_value(command, "--web.listen-address").rsplit(":", 1)
        return [(host, int(port))]
    environment = service["environment"]
    return [(environment["GPUPOOL_HTTP_HOST"], int(environment["GPUPOOL_HTTP_PORT"]))]


def healthcheck_test(service: dict[str, Any]) -> list[str]:
    test: list[str] = service["healthcheck"]["test"]
    return test


def test_every_service_has_a_locally_built_image_and_a_command() -> None:
    for name, service in services().items():
        assert service.get("image") in LOCAL_IMAGES, name
        assert service.get("command"), name
        assert isinstance(service["command"], list), name
    built = (ROOT / "scripts" / "build-images.sh").read_text()
    for image in LOCAL_IMAGES - {IMAGE}:
        assert f"-t {image}" in built, image
    assert '-t "gpupool/gpupool:$version"' in built


def test_every_container_is_on_the_host_network_on_loopback() -> None:
    for name, service in services().items():
        assert service["network_mode"] == "host", name
        assert "ports" not in service, f"{name}: host networking publishes nothing"
        for host, _ in listening(name, service):
            assert host == "127.0.0.1", name


def test_gpupool_services_and_prometheus_have_health_checks() -> None:
    # nats-server runs on scratch: nothing to probe it with; the services' /readyz stays
    # 503 until they are connected to it, and they wait for it (restart: unless-stopped).
    for name, service in services().items():
        if name == "nats":
            continue
        test = healthcheck_test(service)
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name


@pytest.mark.parametrize("name", sorted(GPUPOOL_SERVICES))
def test_each_gpupool_service_runs_its_module_on_its_port(name: str) -> None:
    module, port = GPUPOOL_SERVICES[name]
    service = services()[name]
    assert service["image"] == IMAGE
    assert service["command"][:3] == ["python", "-m", f"gpupool.{module}"]
    environment = service["environment"]
    nats_port = listening("nats", services()["nats"])[0][1]
    assert environment["GPUPOOL_NATS_URL"] == f"nats://127.0.0.1:{nats_port}"
    assert environment["GPUPOOL_HTTP_PORT"] == str(port)
    assert f"http://127.0.0.1:{port}/healthz" in " ".join(healthcheck_test(service))
    assert service["depends_on"] == {"nats": {"condition": "service_started"}}


def test_nats_runs_jetstream_on_a_volume() -> None:
    nats = services()["nats"]
    command = nats["command"]
    assert "--jetstream" in command or "-js" in command
    store = command[command.index("--store_dir") + 1]
    volumes = {entry.split(":")[1]: entry.split(":")[0] for entry in nats["volumes"]}
    assert volumes[store] in compose()["volumes"]
    assert nats["image"] == "gpupool/nats:local"


@pytest.mark.parametrize("profile", [None, "simulated", "gpu"])
def test_host_ports_are_unique_among_services_that_run_together(profile: str | None) -> None:
    seen: dict[int, str] = {}
    for name, service in running_together(profile).items():
        for _, port in listening(name, service):
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


@pytest.mark.parametrize(
    "name", ["policy", "admission-queue", "preemption", "node-executor-simulated", "node-executor"]
)
def test_each_log_reading_service_keeps_its_snapshot_on_a_volume_of_its_own(name: str) -> None:
    """Without a snapshot, every purge of the log is refused (docs/eventlog.md, "Retention")."""
    document = yaml.safe_load(COMPOSE.read_text())
    service = document["services"][name]
    directory = Path(service["environment"]["GPUPOOL_SNAPSHOT_DIR"])
    mounts = {target: source for source, target in (v.split(":")[:2] for v in service["volumes"])}
    (mounted,) = [Path(t) for t in mounts if directory.is_relative_to(t)]
    # the image's /var/lib/gpupool belongs to its user 10001 (a new named volume takes that
    # over): the service makes the directory below it, under a read-only root filesystem
    assert mounted == Path("/var/lib/gpupool")
    source = mounts[str(mounted)]
    if name != "node-executor":  # that one is the host's /var/lib/gpupool, as in Kubernetes
        assert source in document["volumes"], name
    named = [
        v.split(":")[0] for other in document["services"].values() for v in other.get("volumes", [])
    ]
    assert named.count(source) == 1 or name.startswith("node-executor"), source  # not shared


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
    assert services()["prometheus"]["image"] == "gpupool/prometheus:local"


@pytest.mark.parametrize("profile", ["simulated", "gpu"])
def test_prometheus_targets_are_the_service_ports(profile: str) -> None:
    _, config = prometheus_config()
    up = running_together(profile)
    modules = {
        listening(name, service)[0]: module
        for name, service in up.items()
        if name in GPUPOOL_SERVICES
        for module in [GPUPOOL_SERVICES[name][0]]
    }
    scraped = set()
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                assert (host, int(port)) in modules, f"{job['job_name']}: {target}"
                # The job is named after the service everywhere (alerts use it).
                module = modules[(host, int(port))]
                assert job["job_name"] == "gpupool-" + module.replace("_", "-")
                scraped.add(int(port))
    assert scraped == {port for _, port in GPUPOOL_SERVICES.values()}


def test_policy_cluster_file_is_readable_and_matches_the_executor() -> None:
    policy = services()["policy"]
    flag = policy["command"].index("--cluster")
    in_container = policy["command"][flag + 1]
    (source,) = [
        volume.rsplit(":", 2)[0]
        for volume in policy["volumes"]
        if volume.rsplit(":", 2)[1] == in_container
    ]
    default = re.fullmatch(r"\$\{GPUPOOL_CLUSTER_FILE:-(.+)\}", source)
    assert default is not None, source
    cluster = load_local_cluster(ROOT / default[1])
    simulated = services()["node-executor-simulated"]
    gpus = int(simulated["command"][simulated["command"].index("--simulate-gpus") + 1])
    (node,) = cluster.nodes
    assert node.gpus == gpus
    for executor in ("node-executor-simulated", "node-executor"):
        node_name = services()[executor]["environment"]["GPUPOOL_NODE_NAME"]
        assert re.fullmatch(r"\$\{GPUPOOL_NODE_NAME:-(.+)\}", node_name)[1] == node.name  # type: ignore[index]


# ------------------------------------------------------------------ docker-compose


def test_docker_compose_accepts_the_file() -> None:
    compose_cli = shutil.which("docker-compose", path="/usr/bin:" + os.environ.get("PATH", ""))
    if compose_cli is None:
        if os.environ.get("GPUPOOL_REQUIRE_DOCKER") == "1":
            pytest.fail("docker-compose is missing (bash scripts/install-docker.sh)")
        pytest.skip("docker-compose is not installed (bash scripts/install-docker.sh)")
    for profile_args in ([], ["--profile", "simulated"], ["--profile", "gpu"]):
        result = subprocess.run(
            [compose_cli, "-f", str(COMPOSE), *profile_args, "config", "--quiet"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------ authenticated NATS

SECURE = ROOT / "deploy" / "compose" / "secure.yaml"


def test_the_secure_override_gives_every_nats_client_its_own_generated_user(
    tmp_path: Path,
) -> None:
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    secure = yaml.safe_load(SECURE.read_text())["services"]
    node = "gpu-node-1"
    generated = write_credentials(tmp_path, nodes=[node], tls_names=("127.0.0.1",))
    for name in GPUPOOL_SERVICES:
        assert name in base
        env = secure[name]["environment"]
        assert env["GPUPOOL_NATS_URL"] == "tls://127.0.0.1:4222"
        (mount,) = secure[name]["volumes"]
        _source, target, mode = mount.rsplit(":", 2)
        assert mode == "ro" and env["GPUPOOL_NATS_CA"] == f"{target}/ca.pem"
        # the executor's file: GPUPOOL_NODE_CREDENTIALS, by default gpu-node-1's
        seed_file = env["GPUPOOL_NATS_CREDENTIALS"].replace(
            "${GPUPOOL_NODE_CREDENTIALS:-node-executor-gpu-node-1.nk}", f"node-executor-{node}.nk"
        )
        assert seed_file.startswith(f"{target}/")
        user = seed_file.removeprefix(f"{target}/").removesuffix(".nk")
        expected = f"node-executor-{node}" if name.startswith("node-executor") else name
        assert user == expected and user in generated.seeds
    # the NATS server reads the generated authorization block and TLS files
    nats_mounts = dict(m.rsplit(":", 2)[:2] for m in secure["nats"]["volumes"])
    config_source = ROOT / next(s for s, t in nats_mounts.items() if t == "/etc/nats/nats.conf")
    text = config_source.read_text()
    assert 'include "credentials/nats-auth.conf"' in text
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "credentials").symlink_to(tmp_path)
    config = tmp_path / "etc" / "nats.conf"
    config.write_text(text.replace("/etc/nats/", f"{tmp_path}/etc/"))
    result = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_docker_compose_accepts_the_secure_override() -> None:
    compose_cli = shutil.which("docker-compose", path="/usr/bin:" + os.environ.get("PATH", ""))
    if compose_cli is None:
        if os.environ.get("GPUPOOL_REQUIRE_DOCKER") == "1":
            pytest.fail("docker-compose is missing (bash scripts/install-docker.sh)")
        pytest.skip("docker-compose is not installed (bash scripts/install-docker.sh)")
    for profile_args in ([], ["--profile", "simulated"], ["--profile", "gpu"]):
        result = subprocess.run(
            [
                compose_cli,
                "-f",
                str(COMPOSE),
                "-f",
                str(SECURE),
                *profile_args,
                "config",
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
