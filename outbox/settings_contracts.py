"""What each kind's downstream promises, as configured (``SETTLED_DOWNSTREAM_CONTRACTS``), and
applying it to the registry of kinds (``Settings.apply_contracts``)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from outbox.errors import InvalidInput
from outbox.kinds import KindRegistry
from outbox.provider_contracts import PROVIDER_CONTRACTS, UNFENCED


class ContractSettings(BaseModel):
    """What one kind's downstream promises, as configured (unset fields keep the kind's own).

    ``idempotent``: replays with the same key return the first result; ``queryable``: a lookup
    by idempotency key exists; ``key_retention_seconds``: how long it remembers a key;
    ``processing_seconds``: longest from a request leaving Settled to its result being visible
    to lookups; ``not_executed_statuses``: HTTP statuses it documents as "refused before
    processing"; ``enforces_deadline``: it refuses a request that arrives after its
    ``Settled-Deadline``, before any effect (``408 deadline_exceeded``);
    ``max_request_delay_seconds``: without that, the longest a request may take to land after
    its attempt ended; ``retry_cap_seconds``: the longest wait between two tries of a send that
    did not execute (default ``SETTLED_RETRY_CAP_SECONDS``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    idempotent: bool | None = None
    queryable: bool | None = None
    key_retention_seconds: float | None = Field(default=None, gt=0)
    processing_seconds: float | None = Field(default=None, ge=0)
    not_executed_statuses: frozenset[int] | None = None
    enforces_deadline: bool | None = None
    max_request_delay_seconds: float | None = Field(default=None, ge=0, le=86400)
    retry_cap_seconds: float | None = Field(default=None, gt=0, le=86400)

    @field_validator("not_executed_statuses")
    @classmethod
    def _error_statuses(cls, value: frozenset[int] | None) -> frozenset[int] | None:
        bad = sorted(s for s in value or () if not 400 <= s <= 599)
        if bad:
            raise ValueError(f"must be HTTP error statuses (400-599), not {bad}")
        return value

    def changes(self) -> dict[str, Any]:
        """The ``DownstreamContract`` fields these settings change."""
        changes: dict[str, Any] = {}
        if self.idempotent is not None:
            changes["idempotent"] = self.idempotent
        if self.queryable is not None:
            changes["queryable"] = self.queryable
        if self.key_retention_seconds is not None:
            changes["key_retention"] = timedelta(seconds=self.key_retention_seconds)
        if self.processing_seconds is not None:
            changes["processing_time"] = timedelta(seconds=self.processing_seconds)
        if self.not_executed_statuses is not None:
            changes["not_executed_statuses"] = self.not_executed_statuses
        if self.enforces_deadline is not None:
            changes["enforces_deadline"] = self.enforces_deadline
        if self.max_request_delay_seconds is not None:
            changes["max_request_delay"] = timedelta(seconds=self.max_request_delay_seconds)
        if self.retry_cap_seconds is not None:
            changes["retry_cap"] = timedelta(seconds=self.retry_cap_seconds)
        return changes


def apply_contracts(
    registry: KindRegistry,
    contracts: Mapping[str, ContractSettings],
    *,
    providers: Mapping[str, str],
    retention_margin: timedelta,
    retry_cap: timedelta,
) -> KindRegistry:
    """``registry`` with ``contracts`` (by kind) and the defaults (the key retention margin,
    the retry cap) applied; ``providers``: which downstream serves a kind.

    Raises InvalidInput (code ``invalid_setting``) naming the setting for a kind that is not
    registered, or a contract promising a deadline fence of a kind Stripe, WeChat Pay or
    Alipay serves. A kind served by a provider of ``outbox.provider_contracts`` starts from
    its contract.
    """
    unknown = sorted(set(contracts) - set(registry.names()))
    if unknown:
        raise InvalidInput(
            f"SETTLED_DOWNSTREAM_CONTRACTS names unknown kinds {unknown}; "
            f"known: {registry.names()}",
            code="invalid_setting",
            setting="SETTLED_DOWNSTREAM_CONTRACTS",
        )
    # Stripe, WeChat Pay and Alipay ignore the Settled-Deadline header: a contract saying otherwise
    # would let a "not found" be trusted before a late request could still land.
    fenced = sorted(
        name
        for name, contract in contracts.items()
        if contract.enforces_deadline and providers.get(name) in UNFENCED
    )
    if fenced:
        names = sorted({UNFENCED[providers[name]] for name in fenced})
        raise InvalidInput(
            f"SETTLED_DOWNSTREAM_CONTRACTS declares enforces_deadline for {fenced}, "
            f"served by {' and '.join(names)} (SETTLED_DOWNSTREAM_PROVIDERS), which ignores "
            "the deadline",
            code="invalid_setting",
            setting="SETTLED_DOWNSTREAM_CONTRACTS",
        )
    defaults = {"retention_margin": retention_margin, "retry_cap": retry_cap}
    for name in registry.names():
        changes = contracts.get(name, ContractSettings()).changes()
        provider = PROVIDER_CONTRACTS.get(providers.get(name, ""), {})
        registry = registry.with_contract(name, **{**defaults, **provider, **changes})
    return registry
