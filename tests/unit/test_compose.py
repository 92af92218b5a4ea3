"""docker-compose.yml validated offline against the Compose specification, and checked for
what the production stack needs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

COMPOSE = Path(__file__).parents[2] / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = YAML(typ="safe").load(COMPOSE.read_text())
    return loaded


def test_compose_file_validates_against_the_compose_spec() -> None:
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_process_of_the_design_is_a_service(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {
        "postgres",
        "redis",
        "migrate",
        "simulator",
        "worker",
        "beat",
        "web",
    }


def test_long_running_services_have_health_checks(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if name != "migrate":
            assert "healthcheck" in service, name


def test_startup_order_waits_for_health_and_the_migration(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("worker", "beat", "web"):
        deps = services[name]["depends_on"]
        assert deps["migrate"] == {"condition": "service_completed_successfully"}, name
    assert services["worker"]["depends_on"]["redis"] == {"condition": "service_healthy"}
    assert services["worker"]["depends_on"]["simulator"] == {"condition": "service_healthy"}


def test_redis_keeps_messages(compose: dict[str, Any]) -> None:
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"


def test_services_run_the_settled_commands(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["command"] == ["settled", "db", "upgrade"]
    assert services["worker"]["command"][:2] == ["settled", "worker"]
    assert services["beat"]["command"] == ["settled", "beat"]
    assert services["web"]["command"][:2] == ["settled", "web"]
    assert services["simulator"]["command"][:2] == ["settled", "simulator"]
