"""How sends that did not execute are tried again is configuration: the cap of the wait
between tries (for every kind, and per kind in its contract) and the ceiling on tries."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from outbox.kinds import default_registry
from outbox.retry import DEFAULT_CAP_SECONDS, DEFAULT_MAX_TRIES
from outbox.settings import Settings, settings_error
from settled.runtime import build_runtime
from workers.verdicts import retry_policy


def test_the_cap_is_minutes_by_default_settable_for_all_and_per_kind() -> None:
    default = Settings().apply_contracts(default_registry())
    assert default.get("refund").contract.retry_cap == timedelta(seconds=DEFAULT_CAP_SECONDS)
    settings = Settings(
        retry_cap_seconds=120,
        downstream_contracts={"refund": {"retry_cap_seconds": 15}},  # type: ignore[arg-type]
    )
    registry = settings.apply_contracts(default_registry())
    assert registry.get("refund").contract.retry_cap == timedelta(seconds=15)
    assert registry.get("pickup").contract.retry_cap == timedelta(minutes=2)
    policy = retry_policy(registry.get("refund").contract, max_tries=50)
    assert (policy.cap, policy.max_tries) == (15.0, 50)


def test_the_ceiling_on_tries_reaches_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SETTLED_DATABASE_URL", f"sqlite:///{tmp_path / 'settled.sqlite3'}")
    assert build_runtime_max_tries() == DEFAULT_MAX_TRIES
    monkeypatch.setenv("SETTLED_RETRY_MAX_TRIES", "40")
    assert build_runtime_max_tries() == 40


def build_runtime_max_tries() -> int:
    runtime = build_runtime(Settings())
    try:
        return runtime.executor.max_tries
    finally:
        runtime.close()


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("SETTLED_RETRY_CAP_SECONDS", "0", "retry_cap_seconds"),
        ("SETTLED_RETRY_CAP_SECONDS", "-5", "retry_cap_seconds"),
        ("SETTLED_RETRY_CAP_SECONDS", "soon", "retry_cap_seconds"),
        ("SETTLED_RETRY_CAP_SECONDS", "86401", "retry_cap_seconds"),
        ("SETTLED_RETRY_MAX_TRIES", "0", "retry_max_tries"),
        ("SETTLED_RETRY_MAX_TRIES", "many", "retry_max_tries"),
        (
            "SETTLED_DOWNSTREAM_CONTRACTS",
            json.dumps({"refund": {"retry_cap_seconds": 0}}),
            "downstream_contracts",
        ),
        (
            "SETTLED_DOWNSTREAM_CONTRACTS",
            json.dumps({"refund": {"retry_cap_second": 5}}),  # misspelt: never ignored
            "downstream_contracts",
        ),
    ],
)
def test_a_bad_retry_setting_is_refused_naming_it(
    variable: str, value: str, named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    line = settings_error(info.value)
    assert named.upper() in line and "\n" not in line
