"""The downstream's contract per kind is configuration: parsed, validated, applied."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from pydantic import ValidationError

from outbox.errors import InvalidInput
from outbox.kinds import DownstreamContract, default_registry
from outbox.settings import Settings


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
    ],
)
def test_a_malformed_contract_is_refused_when_the_settings_are_read(
    contracts: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SETTLED_DOWNSTREAM_CONTRACTS", json.dumps(contracts))
    with pytest.raises(ValidationError) as info:
        Settings()
    assert "downstream_contracts" in str(info.value)


def test_a_contract_for_a_kind_nobody_registered_is_refused_with_the_settings_name() -> None:
    settings = Settings(downstream_contracts={"refnud": {"idempotent": False}})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput) as info:
        settings.apply_contracts(default_registry())
    assert info.value.code == "invalid_setting"
    assert "SETTLED_DOWNSTREAM_CONTRACTS" in info.value.message
    assert "refnud" in info.value.message
