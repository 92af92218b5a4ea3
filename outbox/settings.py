"""Configuration, read once at the composition root (environment prefix ``SETTLED_``)."""

from __future__ import annotations

import json

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every knob of a Settled process. Secrets are ``SecretStr`` and never printed."""

    model_config = SettingsConfigDict(env_prefix="SETTLED_", extra="ignore")

    #: SQLAlchemy URL of the operations database (PostgreSQL in production).
    database_url: str = "sqlite:///settled.sqlite3"
    #: Celery broker: ``redis://...`` in production, ``filesystem://`` for the embedded default.
    broker_url: str = "redis://127.0.0.1:6379/0"
    #: Folder of the filesystem broker (embedded default only).
    broker_folder: str = "var/broker"
    #: Fingerprint keys by version, e.g. ``{"v1": "..."}``; at least 16 bytes each.
    fingerprint_keys: dict[str, SecretStr] = Field(
        default_factory=lambda: {"v1": SecretStr("settled-dev-fingerprint-key-change-me")}
    )
    fingerprint_key_version: str = "v1"
    #: Secret the downstream idempotency keys are derived from.
    idempotency_secret: SecretStr = SecretStr("settled-dev-idempotency-secret")

    #: Base URL of the downstream payment service.
    downstream_url: str = "http://127.0.0.1:8700"
    #: Downstream API key per tenant, e.g. ``{"acme": "sk_test_..."}``.
    downstream_api_keys: dict[str, SecretStr] = Field(default_factory=dict)
    #: Longest a single HTTP attempt may take, before the operation's deadline bounds it further.
    downstream_timeout: float = 10.0

    #: Budget given to a new operation.
    max_attempts: int = 5
    deadline_seconds: float = 3600.0
    #: How long a claim is held before another worker or the reconciler may take over. No send
    #: starts, or runs, past its lease (less the clock margin).
    lease_seconds: float = 60.0
    #: Largest difference assumed between the database's clock and the downstream's: a send
    #: must be over this long before its lease ends.
    clock_margin_seconds: float = Field(default=1.0, ge=0)
    #: Automatic resends stop this long before the downstream's key retention ends.
    key_retention_margin_seconds: float = Field(default=3600.0, ge=0)
    #: Period of the sweeper, which re-hints every due operation (beat).
    sweep_seconds: float = 1.0
    #: Due operations a worker claims beside the hinted ones, sent concurrently.
    claim_batch: int = 0
    #: Operation ids per hint message (the sweeper's; the app passes its own to the relay).
    hint_batch: int = Field(default=20, ge=1, le=500)
    #: Where beat keeps its schedule state.
    beat_schedule_file: str = "var/celerybeat-schedule"
    #: How often the reconciler runs, and how long "unknown" may last before review.
    reconcile_seconds: float = 10.0
    review_after_seconds: float = 600.0

    #: Port of the worker's Prometheus endpoint (None: not served).
    metrics_port: int | None = None

    def as_environment(self) -> dict[str, str]:
        """These settings as ``SETTLED_*`` variables, to configure a child process."""
        env: dict[str, str] = {}
        for name, value in self:
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, dict):
                value = json.dumps(
                    {
                        k: v.get_secret_value() if isinstance(v, SecretStr) else v
                        for k, v in value.items()
                    }
                )
            env[f"SETTLED_{name.upper()}"] = str(value)
        return env

    def fingerprint_key_bytes(self) -> dict[str, bytes]:
        return {v: k.get_secret_value().encode() for v, k in self.fingerprint_keys.items()}
