"""The app developers' guide's FakeGateway example (docs/app-developers.md), executed as written
against an SQLite file."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.test_readme import run_example


def test_readme_fake_gateway_example_runs_and_does_what_it_says(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'settled.sqlite3'}"
    result = run_example("fake-gateway", tmp_path, SETTLED_DATABASE_URL=url)
    assert result.stdout.splitlines() == ["unknown", "{'found': 1}"]
