"""The app developers' guide's FakeGateway example (docs/app-developers.md), executed as written
against an SQLite file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_readme import example


def test_readme_fake_gateway_example_runs_and_does_what_it_says(tmp_path: Path) -> None:
    code = tmp_path / "example.py"
    code.write_text(example("fake-gateway"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    env["SETTLED_DATABASE_URL"] = f"sqlite:///{tmp_path / 'settled.sqlite3'}"
    result = subprocess.run(
        [sys.executable, str(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["unknown", "{'found': 1}"]
