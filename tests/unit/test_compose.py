"""docker-compose.yml validated offline against the Compose specification, and checked for
what the production stack needs; the image's health check and pinned dependencies."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from ruamel.yaml import YAML

from outbox.kinds import default_registry
from outbox.settings import Settings

ROOT = Path(__file__).parents[2]
COMPOSE = ROOT / "docker-compose.yml"


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


# --- secrets: from .env, never written in the file -----------------------------------------

ENV_EXAMPLE = ROOT / ".env.example"
#: ${NAME}, ${NAME:?message}, ${NAME?message}, ${NAME:-default}, ${NAME-default}
REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[?-])([^}]*))?\}")
SECRETS = ("POSTGRES_PASSWORD", "SETTLED_FINGERPRINT_KEYS", "SETTLED_IDEMPOTENCY_SECRET")


def env_example() -> dict[str, str]:
    """.env.example as compose reads it: NAME=value, a single-quoted value taken as written."""
    values: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]
        values[name.strip()] = value
    return values


def environments(compose: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(service, variable, value) of every service's environment."""
    return [
        (name, var, str(value))
        for name, service in compose["services"].items()
        for var, value in (service.get("environment") or {}).items()
    ]


def test_every_variable_is_required_with_a_message_or_has_a_default_and_is_listed() -> None:
    text = COMPOSE.read_text()
    listed = env_example()
    references = REFERENCE.findall(text)
    assert references, "the compose file reads nothing from .env"
    # Every "$" starts one of the references above (no bare $NAME, no unterminated ${).
    assert text.count("$") == len(references)
    for name, op, arg in references:
        assert name in listed, f"{name} is not in .env.example"
        if op in (":?", "?"):
            assert op == ":?", f"{name}: an empty value must be refused too (:?)"
            assert arg.strip(), f"{name}: the :? needs a message for the operator"
        else:
            assert op == ":-", f"{name} has neither :? nor a default"


def test_no_secret_is_written_in_the_compose_file(compose: dict[str, Any]) -> None:
    for service, var, value in environments(compose):
        if re.search(r"PASSWORD|SECRET|KEYS?$", var):
            assert REFERENCE.fullmatch(value), f"{service}: {var} is written in the file"
    for service, var, value in environments(compose):
        if var == "SETTLED_DATABASE_URL":
            assert "${POSTGRES_PASSWORD:?" in value, service
    for secret in SECRETS:
        assert f"${{{secret}:?" in COMPOSE.read_text(), secret


def test_the_env_example_holds_no_secret_but_the_simulators_test_key(
    compose: dict[str, Any],
) -> None:
    listed = env_example()
    for secret in SECRETS:
        assert listed[secret] == "", f"{secret} must be left for the operator to fill in"
    keys = json.loads(listed["SETTLED_DOWNSTREAM_API_KEYS"])
    # Exactly the simulator's test key, so that the stack works once the secrets are set.
    tenants = [
        arg.split("=", 1)[1]
        for arg in compose["services"]["simulator"]["command"]
        if arg.startswith("--tenant=")
    ]
    assert [f"{t}={k}" for t, k in keys.items()] == tenants
    assert all(k.startswith("sk_test_") for k in keys.values())


def test_the_simulator_gets_none_of_settleds_secrets(compose: dict[str, Any]) -> None:
    assert compose["services"]["simulator"]["environment"] == {}


def test_env_files_stay_out_of_the_image_and_the_repository() -> None:
    assert ".env" in (ROOT / ".dockerignore").read_text().split()
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_web_is_published_on_loopback_unless_told_otherwise(compose: dict[str, Any]) -> None:
    (port,) = compose["services"]["web"]["ports"]
    match = REFERENCE.fullmatch(port.rsplit(":", 1)[0])
    assert match, port
    name, op, default = match.groups()
    assert (op, default) == (":-", "127.0.0.1:8000")
    assert env_example()[name] == "127.0.0.1:8000"


# --- health checks ------------------------------------------------------------------------

HEALTHCHECK = ROOT / "docker" / "healthcheck.py"


def run_healthcheck(test: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A compose healthcheck ``["CMD", "python", "/app/healthcheck.py", ...]`` run here."""
    assert test[:3] == ["CMD", "python", "/app/healthcheck.py"], test
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *test[3:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def healthcheck() -> Any:
    spec = importlib.util.spec_from_file_location("healthcheck", HEALTHCHECK)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_beats_health_check_checks_beat_not_redis(compose: dict[str, Any], tmp_path: Path) -> None:
    test = compose["services"]["beat"]["healthcheck"]["test"]
    assert "redis" not in " ".join(test).lower()
    assert "broker" not in " ".join(test).lower()
    schedule = tmp_path / "var" / "celerybeat-schedule"
    env = {
        "PATH": os.environ.get("PATH", ""),
        "SETTLED_BEAT_SCHEDULE_FILE": str(schedule),
        # A broker nobody answers on: the check must not care.
        "SETTLED_BROKER_URL": "redis://127.0.0.1:1/0",
    }

    missing = run_healthcheck(test, env)
    assert missing.returncode == 1
    assert "no beat schedule file" in missing.stdout

    schedule.parent.mkdir()
    (tmp_path / "var" / "celerybeat-schedule.dat").write_bytes(b"")  # dbm.dumb's names
    (tmp_path / "var" / "celerybeat-schedule.dir").write_bytes(b"")
    fresh = run_healthcheck(test, env)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr

    # Beat writes the file at least every sync_every (180 s) + one sweep period; older: stuck.
    stale = time.time() - 180 - 1 - 60 - 5
    for path in schedule.parent.iterdir():
        os.utime(path, (stale, stale))
    assert run_healthcheck(test, env).returncode == 1
    os.utime(schedule.parent / "celerybeat-schedule.dat")  # one of its files written now
    assert run_healthcheck(test, env).returncode == 0


def test_beats_allowed_age_follows_its_periods(healthcheck: Any, tmp_path: Path) -> None:
    schedule = tmp_path / "celerybeat-schedule"
    schedule.write_bytes(b"")
    age = 180 + 600 + 30  # beyond the default limit, inside the one of a 10-minute sweep
    written = schedule.stat().st_mtime
    env = {"SETTLED_BEAT_SCHEDULE_FILE": str(schedule)}
    assert healthcheck.beat_fresh(env, written + age) is not None
    slow = {**env, "SETTLED_SWEEP_SECONDS": "600", "SETTLED_RECONCILE_SECONDS": "900"}
    assert healthcheck.beat_fresh(slow, written + age) is None


class _Healthz(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path in ("/healthz", "/metrics") else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_web_worker_and_simulator_checks_ask_their_own_port(healthcheck: Any) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert healthcheck.check(["web", f"--port={port}"], {}) is None
        assert healthcheck.check(["run", "--web-port", str(port)], {}) is None
        assert healthcheck.check(["simulator", f"--port={port}"], {}) is None
        assert healthcheck.check(["worker"], {"SETTLED_METRICS_PORT": str(port)}) is None
    finally:
        server.shutdown()
        server.server_close()
    # The same port, closed now: every check says so.
    assert "healthz" in healthcheck.check(["web", f"--port={port}"], {})
    assert healthcheck.check(["simulator", f"--port={port}"], {}) is not None
    assert healthcheck.check(["worker"], {"SETTLED_METRICS_PORT": str(port)}) is not None


def test_the_images_health_check_reads_the_role_from_the_main_command(healthcheck: Any) -> None:
    cmdline = b"/usr/local/bin/python\0/usr/local/bin/settled\0web\0--host=0.0.0.0\0--port=8000\0"
    assert healthcheck.role_args(cmdline) == ["web", "--host=0.0.0.0", "--port=8000"]
    assert healthcheck.role_args(b"settled\0beat\0") == ["beat"]
    assert healthcheck.role_args(b"/bin/sh\0-c\0sleep 1\0") == []
    # One-shot commands (the migration, --help) are healthy while they run.
    assert healthcheck.check(["db", "upgrade"], {}) is None
    assert healthcheck.check([], {}) is None


def test_compose_services_use_the_images_health_check_script(compose: dict[str, Any]) -> None:
    for name in ("simulator", "worker", "beat", "web"):
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "/app/healthcheck.py", name], name
    web = compose["services"]["web"]
    assert "--port=8000" in web["command"]
    assert "--port=8000" in web["healthcheck"]["test"]


# --- the image: pinned dependencies and a HEALTHCHECK --------------------------------------

DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS = ROOT / "constraints.txt"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in joined.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def pins() -> dict[str, Version]:
    """constraints.txt as {normalised name: pinned version}; every line must be a pin."""
    found: dict[str, Version] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", line
        found[canonicalize_name(req.name)] = Version(spec.version)
    return found


def test_the_image_has_a_health_check_that_it_ships() -> None:
    instructions = dockerfile_instructions()
    (healthcheck,) = [args for op, args in instructions if op == "HEALTHCHECK"]
    assert healthcheck.endswith('CMD ["python", "/app/healthcheck.py"]')
    copies = [args for op, args in instructions if op == "COPY"]
    assert "docker/healthcheck.py ./healthcheck.py" in copies
    final_workdir = [args for op, args in instructions if op == "WORKDIR"][-1]
    assert final_workdir == "/app"


def test_every_pip_install_in_the_image_uses_the_constraints() -> None:
    runs = [args for op, args in dockerfile_instructions() if op == "RUN"]
    installs = [
        step.strip()
        for run in runs
        for step in run.split("&&")
        if re.match(r"\s*(python -m )?pip (install|wheel)\b", step)
    ]
    assert installs, "the Dockerfile installs nothing"
    for step in installs:
        if step.startswith("pip wheel"):
            assert "--no-deps" in step and "--no-build-isolation" in step, step
        else:
            assert "--constraint constraints.txt" in step, step
    copied = " ".join(args for op, args in dockerfile_instructions() if op == "COPY")
    assert copied.count("constraints.txt") == 2  # in the build stage and in the final one


def test_constraints_pin_every_dependency_of_the_project_and_its_build() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pinned = pins()
    wanted = [Requirement(r) for r in project["project"]["dependencies"]]
    wanted += [Requirement(r) for r in project["build-system"]["requires"]]
    wanted += [Requirement("psycopg-binary"), Requirement("kombu")]  # the extras' packages
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not pinned: regenerate constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"{name}=={pinned[name]} does not satisfy {req}: regenerate constraints.txt"
        )


def test_constraints_say_how_they_were_generated() -> None:
    header = CONSTRAINTS.read_text().splitlines()[:2]
    assert "uv pip compile pyproject.toml" in header[1]
    assert "-o constraints.txt" in header[1]


def test_the_compose_simulators_deadline_fence_is_declared_for_every_kind() -> None:
    """The compose simulator refuses late requests: the stack's contracts say so, for every
    kind, so its time to a verdict on "not found" is the lease, not the delay bound."""
    contracts = json.loads(env_example()["SETTLED_DOWNSTREAM_CONTRACTS"])
    registry = Settings(downstream_contracts=contracts).apply_contracts(default_registry())
    assert all(registry.get(name).contract.enforces_deadline for name in registry.names())
