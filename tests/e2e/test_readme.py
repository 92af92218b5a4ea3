"""The app developers' guide's enqueue example (docs/app-developers.md), executed as written against
PostgreSQL and Redis."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
import redis

from tests.support import services

GUIDE = Path(__file__).parents[2] / "docs" / "app-developers.md"

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def example(name: str) -> str:
    text = GUIDE.read_text()
    m = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", text, re.S)
    assert m, f"docs/app-developers.md has no example {name!r}"
    return m.group(1)


def run_example(name: str, tmp_path: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    """Example ``name`` of the guide, run as a script of its own from the project's folder, with
    these ``SETTLED_*`` variables only; it must exit 0."""
    code = tmp_path / f"{name}.py"
    code.write_text(example(name))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    env.update(settings)
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
    return result


#: What an operator sets: the development keys are refused against PostgreSQL.
KEYS = {
    "SETTLED_FINGERPRINT_KEYS": json.dumps({"v1": "readme-fingerprint-key-0001"}),
    "SETTLED_IDEMPOTENCY_SECRET": "readme-idempotency-secret-0001",
}


def test_readme_enqueue_example_runs_and_does_what_it_says(
    pg_server: str, redis_url: str, tmp_path: Path
) -> None:
    broker = redis_url  # a Redis server of this test's own: empty at the start
    client = redis.Redis.from_url(broker)
    name = f"settled_readme_{uuid.uuid4().hex[:8]}"
    with services.throwaway_database(pg_server, name) as url:
        env = {"SETTLED_DATABASE_URL": url, "SETTLED_BROKER_URL": broker, **KEYS}
        result = run_example("enqueue", tmp_path, **env)
        assert result.stdout.strip() == "refused: idempotency_conflict"
        with psycopg.connect(url.replace("+psycopg", "")) as conn:
            ops = conn.execute(
                "SELECT tenant, state, params->>'amount_minor', correlation_id FROM operations"
            ).fetchall()
            assert ops == [("acme", "planned", "10000", "call_02")]
            assert conn.execute("SELECT order_id FROM refund_requests").fetchall() == [("A1042",)]
    assert client.llen("settled") == 1  # one hint, published after the commit
    client.close()


@pytest.mark.parametrize(
    ("example", "says"),
    [
        ("enqueue-async", ["planned not_done"]),
        # A1043's transaction is rolled back; the enqueue in autocommit is refused
        ("enqueue-psycopg", ["planned", "refused: no_transaction"]),
    ],
)
def test_the_async_and_connection_examples_run_and_do_what_they_say(
    example: str, says: list[str], pg_server: str, redis_url: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_url)
    name = f"settled_readme_{uuid.uuid4().hex[:8]}"
    with services.throwaway_database(pg_server, name) as url:
        env = {"SETTLED_DATABASE_URL": url, "SETTLED_BROKER_URL": redis_url, **KEYS}
        result = run_example(example, tmp_path, **env)
        assert result.stdout.splitlines() == says
        with psycopg.connect(url.replace("+psycopg", "")) as conn:
            ops = conn.execute("SELECT tenant, state, params->>'order_id' FROM operations")
            assert ops.fetchall() == [("acme", "planned", "A1042")]
            assert conn.execute("SELECT order_id FROM refund_requests").fetchall() == [("A1042",)]
    assert client.llen("settled") == 1  # one hint, published after the commit
    client.close()
