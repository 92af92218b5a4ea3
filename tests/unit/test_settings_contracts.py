"""The downstream's contract per kind is configuration: parsed, validated, applied."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from pydantic import ValidationError

from outbox.errors import InvalidInput
from outbox.kinds import DownstreamContract, default_registry
from outbox.settings import Settings, settings_error


def test_a_configured_contract_changes_only_the_fields_it_names() -> None:
    settings = Settings(
        downstream_contracts={  # type: ignore[arg-type]
            "refund": {"idempotent": False, "key_retention_seconds": 3600},
            "pickup": {"queryable": False, "not_executed_statuses": [429, 503]},
        },
        key_retention_margin_seconds=60,
    )
    registry = settings.apply_contracts(default_registry())
    margin = timedelta(seconds=60)
    assert registry.get("refund").contract == DownstreamContract(
        idempotent=False, key_retention=timedelta(hours=1), retention_margin=margin
    )
    assert registry.get("pickup").contract == DownstreamContract(
        queryable=False, not_executed_statuses=frozenset({429, 503}), retention_margin=margin
    )
    assert registry.get("after_sales_ticket").contract == DownstreamContract(
        retention_margin=margin
    )


def test_contracts_travel_to_child_processes_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(downstream_contracts={"refund": {"queryable": False}})  # type: ignore[arg-type]
    env = settings.as_environment()
    assert env["SETTLED_DOWNSTREAM_CONTRACTS"] == '{"refund": {"queryable": false}}'
    monkeypatch.setenv("SETTLED_DOWNSTREAM_CONTRACTS", env["SETTLED_DOWNSTREAM_CONTRACTS"])
    assert Settings().downstream_contracts == settings.downstream_contracts


@pytest.mark.parametrize(
    "contracts",
    [
        {"refund": {"idempotant": False}},  # misspelt: never silently ignored
        {"refund": {"idempotent": "sometimes"}},
        {"refund": {"key_retention_seconds": 0}},
        {"refund": {"processing_seconds": -1}},
        {"refund": {"not_executed_statuses": [200]}},
        {"refund": {"enforces_deadline": "sometimes"}},
        {"refund": {"max_request_delay_seconds": -1}},
        {"refund": {"max_request_delay_seconds": "soon"}},
        {"refund": {"max_request_delay_seconds": 86401}},  # past any key retention's use
    ],
)
def test_a_malformed_contract_is_refused_when_the_settings_are_read(
    contracts: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SETTLED_DOWNSTREAM_CONTRACTS", json.dumps(contracts))
    with pytest.raises(ValidationError) as info:
        Settings()
    assert "downstream_contracts" in str(info.value)


def test_the_deadline_fence_and_the_delay_bound_are_configured_per_kind() -> None:
    settings = Settings(
        downstream_contracts={  # type: ignore[arg-type]
            "refund": {"enforces_deadline": True},
            "pickup": {"max_request_delay_seconds": 2},
        },
    )
    registry = settings.apply_contracts(default_registry())
    refund, pickup = registry.get("refund").contract, registry.get("pickup").contract
    assert (refund.enforces_deadline, refund.rests_on) == (True, "deadline_fence")
    assert refund.max_request_delay == timedelta(minutes=5)  # the default, unused while fenced
    assert (pickup.enforces_deadline, pickup.max_request_delay) == (False, timedelta(seconds=2))
    assert registry.get("ticket_cancel").contract.rests_on == "delay_bound"  # the default


def test_a_deadline_fence_declared_for_a_kind_stripe_serves_is_refused() -> None:
    """Stripe ignores Settled-Deadline: declaring the fence there would trust a "not found"
    while a late refund could still land."""
    settings = Settings(
        downstream_contracts={"refund": {"enforces_deadline": True}},  # type: ignore[arg-type]
        downstream_providers={"refund": "stripe"},
    )
    with pytest.raises(InvalidInput) as info:
        settings.apply_contracts(default_registry())
    assert info.value.code == "invalid_setting"
    assert "SETTLED_DOWNSTREAM_CONTRACTS" in info.value.message and "refund" in info.value.message


def test_a_contract_for_a_kind_nobody_registered_is_refused_with_the_settings_name() -> None:
    settings = Settings(downstream_contracts={"refnud": {"idempotent": False}})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput) as info:
        settings.apply_contracts(default_registry())
    assert info.value.code == "invalid_setting"
    assert "SETTLED_DOWNSTREAM_CONTRACTS" in info.value.message
    assert "refnud" in info.value.message


# -- every misconfiguration is refused when the settings are read, naming the setting ------


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("SETTLED_FINGERPRINT_KEYS", '{"v1": "short"}', "fingerprint_keys"),
        ("SETTLED_FINGERPRINT_KEYS", "{}", "fingerprint_keys"),
        ("SETTLED_FINGERPRINT_KEY_VERSION", "v9", "fingerprint_key_version"),
        ("SETTLED_IDEMPOTENCY_SECRET", "tiny", "idempotency_secret"),
        ("SETTLED_MAX_ATTEMPTS", "-3", "max_attempts"),
        ("SETTLED_MAX_ATTEMPTS", "0", "max_attempts"),
        ("SETTLED_DEADLINE_SECONDS", "0", "deadline_seconds"),
        ("SETTLED_LEASE_SECONDS", "-1", "lease_seconds"),
        ("SETTLED_DOWNSTREAM_TIMEOUT", "0", "downstream_timeout"),
        ("SETTLED_METRICS_PORT", "70000", "metrics_port"),
        ("SETTLED_CLAIM_BATCH", "-1", "claim_batch"),
    ],
)
def test_a_misconfiguration_is_refused_naming_the_setting(
    variable: str, value: str, named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert named in str(info.value)
    line = settings_error(info.value)
    assert line.startswith("invalid configuration: SETTLED_") and named.upper() in line
    assert "\n" not in line
    if not value.lstrip("-").isdigit() and variable != "SETTLED_FINGERPRINT_KEY_VERSION":
        assert value not in line  # a value may be a secret: never echoed


def test_the_one_line_never_echoes_a_secrets_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SETTLED_IDEMPOTENCY_SECRET", "tiny-but-secret")
    monkeypatch.setenv("SETTLED_FINGERPRINT_KEYS", '{"v1": "short-secret"}')
    with pytest.raises(ValidationError) as info:
        Settings()
    line = settings_error(info.value)
    assert "tiny-but-secret" not in line and "short-secret" not in line
    assert "SETTLED_IDEMPOTENCY_SECRET" in line and "SETTLED_FINGERPRINT_KEYS" in line


def test_development_secrets_are_named_against_postgresql_only() -> None:
    pg = "postgresql+psycopg://db/settled"
    assert Settings(database_url=pg).development_secrets() == [
        "SETTLED_FINGERPRINT_KEYS",
        "SETTLED_IDEMPOTENCY_SECRET",
    ]
    assert Settings(database_url=pg, development=True).development_secrets() == []
    assert Settings(database_url="sqlite:///x.sqlite3").development_secrets() == []
    own = Settings(
        database_url=pg,
        fingerprint_keys={"v1": "a-production-key-0001"},  # type: ignore[dict-item]
        idempotency_secret="a-production-secret-01",  # type: ignore[arg-type]
    )
    assert own.development_secrets() == []


def test_a_lease_no_longer_than_the_clock_margin_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SETTLED_LEASE_SECONDS", "1")
    monkeypatch.setenv("SETTLED_CLOCK_MARGIN_SECONDS", "1")
    with pytest.raises(ValidationError) as info:
        Settings()
    line = settings_error(info.value)
    assert "SETTLED_LEASE_SECONDS" in line and "SETTLED_CLOCK_MARGIN_SECONDS" in line
    assert "\n" not in line
    monkeypatch.setenv("SETTLED_LEASE_SECONDS", "1.5")
    assert Settings().lease_seconds == 1.5


def test_the_default_lease_is_short_and_outlasts_a_send() -> None:
    s = Settings()
    assert s.lease_seconds == 15.0
    assert s.lease_seconds > s.downstream_timeout + s.clock_margin_seconds


def test_the_distrust_after_a_clock_step_lasts_a_lease_unless_set_longer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().clock_step_window == 15.0
    monkeypatch.setenv("SETTLED_LEASE_SECONDS", "20")
    assert Settings().clock_step_window == 20.0
    monkeypatch.setenv("SETTLED_CLOCK_STEP_DISTRUST_SECONDS", "60")
    assert Settings().clock_step_window == 60.0
    monkeypatch.setenv("SETTLED_CLOCK_STEP_DISTRUST_SECONDS", "10")  # shorter than a send
    with pytest.raises(ValidationError) as info:
        Settings()
    line = settings_error(info.value)
    assert "SETTLED_CLOCK_STEP_DISTRUST_SECONDS" in line and "SETTLED_LEASE_SECONDS" in line
