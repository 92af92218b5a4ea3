"""An example's README followed word for word: every command of its "Run it" section, as a user
runs them from a checkout's root, the servers each in a terminal of its own, until its last
command (a ``curl`` of the refund's status) shows the refund ``succeeded``.

Shared by the examples' end-to-end tests (``tests/e2e/test_example_app.py``,
``tests/e2e/test_django_example.py``): the same commands, the same servers, on free ports
instead of the README's 8700 (the simulator) and 8080 (the app).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from tests.support.services import free_port
from tests.support.simtools import wait_until

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SIMULATOR_PORT, APP_PORT = "8700", "8080"


def readme_commands(example: Path) -> list[str]:
    """The shell commands of the README's "Run it" section, in order, continuation lines
    joined."""
    section = (example / "README.md").read_text().split("## Run it", 1)[1].split("\n## ", 1)[0]
    commands: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                commands.append(line.strip())
    return commands


class Terminals:
    """The user's terminals: one shell per server, each after the README's ``export`` lines."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env = folder, env
        self.exports: list[str] = []
        self.servers: dict[str, subprocess.Popen[bytes]] = {}

    def script(self, command: str) -> str:
        return "set -e\n" + "\n".join([*self.exports, command])

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["bash", "-c", self.script(command)], cwd=self.folder, env=self.env,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{command!r} failed:\n{done.stdout}{done.stderr}"
        return done

    def log(self, name: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9]+", "-", name) + ".err")

    def start(self, name: str, command: str) -> subprocess.Popen[bytes]:
        with self.log(name).open("wb") as err:
            proc = subprocess.Popen(
                ["bash", "-c", self.script(f"exec {command}")], cwd=self.folder, env=self.env,
                stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        self.servers[name] = proc
        return proc

    def stderr(self, name: str) -> str:
        return self.log(name).read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.servers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def exported(commands: list[str], name: str) -> str:
    """The value the README's ``export`` lines give variable ``name`` (unquoted)."""
    values = [
        word.split("=", 1)[1]
        for command in commands
        if command.startswith("export ")
        for word in shlex.split(command, comments=True)[1:]
        if word.startswith(f"{name}=")
    ]
    assert len(values) == 1, f"the README exports {name} {len(values)} times"
    return values[0]


def follow_readme(
    example: Path, tmp_path: Path, app: str, own: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run every command of ``example``'s "Run it" in a fresh folder holding ``examples/``
    (as a checkout's root), with no ``SETTLED_*`` variable but the README's; ``app`` is how
    the command that starts the app begins (``uvicorn``; no other command begins so).
    Each text of ``own`` (what is the user's own: a database, a broker) is replaced by the
    test's. Returns the last command's answer once it shows the refund ``succeeded``; fails the test
    if it never does.

    A README that starts the worker before any migration of Settled's tables leaves the refund
    ``planned``: the worker refuses the unmigrated database and nothing sends it."""
    (tmp_path / "examples").symlink_to(EXAMPLES, target_is_directory=True)
    sim_port, app_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SETTLED_", "OTEL_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    terminals = Terminals(tmp_path, env)
    ready: dict[str, Callable[[], bool]] = {
        "settled simulator": lambda: answers(f"http://127.0.0.1:{sim_port}/_control/faults"),
        "settled worker": lambda: " ready." in terminals.stderr("settled worker"),
        app: lambda: answers(f"http://127.0.0.1:{app_port}/refunds/none"),
    }
    commands = [
        c.replace(SIMULATOR_PORT, str(sim_port)).replace(APP_PORT, str(app_port))
        for c in readme_commands(example)
    ]
    for theirs, ours in (own or {}).items():  # after the ports: ours may hold any digits
        assert any(theirs in c for c in commands), f"the README never says {theirs!r}"
        commands = [c.replace(theirs, ours) for c in commands]
    *steps, status = commands
    assert status.startswith("curl ") and "/refunds/" in status
    try:
        for command in steps:
            if command.startswith("export "):
                terminals.exports.append(command)
                continue
            server = next((s for s in ready if command.startswith(s)), None)
            if server is None:
                terminals.run(command)
                continue
            proc = terminals.start(server, command)

            def up(server: str = server, proc: Any = proc) -> bool:
                assert proc.poll() is None, (
                    f"{server} exited ({proc.returncode}):\n{terminals.stderr(server)}"
                )
                return ready[server]()

            wait_until(up, 60, f"{server} to be ready")
        got: list[dict[str, Any]] = []

        def refunded() -> bool:
            got.append(json.loads(terminals.run(status).stdout))
            return bool(got[-1].get("operation", {}).get("state") == "succeeded")

        wait_until(refunded, 60, "the refund to succeed (as the README's last command shows)")
        return got[-1]
    finally:
        terminals.stop()
