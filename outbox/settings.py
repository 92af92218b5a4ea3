"""Configuration, read once at the composition root (environment prefix ``SETTLED_``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox import settings_variables
from outbox.errors import InvalidSetting
from outbox.kinds import KindRegistry
from outbox.retry import DEFAULT_CAP_SECONDS, DEFAULT_MAX_TRIES
from outbox.settings_contracts import ContractSettings, apply_contracts
from outbox.settings_variables import OTHER_VARIABLES, TEST_VARIABLES
from outbox.settings_wechatpay import WechatPayMerchant

__all__ = [
    "DEV_FINGERPRINT_KEY",
    "DEV_IDEMPOTENCY_SECRET",
    "OTHER_VARIABLES",
    "TEST_VARIABLES",
    "ContractSettings",
    "LogFormat",
    "LogLevel",
    "Settings",
    "masked",
    "refuse_unknown_variables",
    "settings_error",
    "unknown_variables",
]


#: Development values: the demo and tests run on them; production must set its own.
DEV_FINGERPRINT_KEY = "settled-dev-fingerprint-key-change-me"
DEV_IDEMPOTENCY_SECRET = "settled-dev-idempotency-secret"  # noqa: S105 (a known, public value)


def unknown_variables(environ: Mapping[str, str]) -> dict[str, str | None]:
    """The ``SETTLED_*`` names in ``environ`` that no setting and nothing else reads (in any
    case, as the settings are read), each with the nearest valid name (None: none is near)."""
    return settings_variables.unknown_variables(environ, Settings.model_fields)


def refuse_unknown_variables(environ: Mapping[str, str]) -> None:
    """Raise InvalidSetting (``unknown_setting``) naming every ``SETTLED_*`` variable of
    ``environ`` that nothing reads, with the nearest valid name: a typo is never ignored."""
    settings_variables.refuse_unknown_variables(environ, Settings.model_fields)


#: A log level, in any case (``info`` is ``INFO``).
LogLevel = Annotated[
    Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
    BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v),
]
LogFormat = Literal["json", "text"]


class Settings(BaseSettings):
    """Every knob of a Settled process. Secrets are ``SecretStr`` and never printed."""

    model_config = SettingsConfigDict(env_prefix="SETTLED_", extra="ignore")

    #: SQLAlchemy URL of the operations database (PostgreSQL in production); libpq's
    #: multi-host form ``postgresql://u@h1:5432,h2:5433/db?target_session_attrs=read-write``
    #: is read as SQLAlchemy's ``?host=h1:5432&host=h2:5433``.
    database_url: str = "sqlite:///settled.sqlite3"
    #: Start without a WARNING on a primary whose standbys are all asynchronous (the start line
    #: says it was accepted): a failover can then lose whole committed operations.
    async_replication_accepted: bool = False
    #: Celery broker: ``redis://...`` in production, ``filesystem://`` for the embedded default.
    broker_url: str = "redis://127.0.0.1:6379/0"
    #: The master's name that the Sentinels of a ``sentinel://h1:26379;sentinel://h2:26379``
    #: broker watch (required with one, refused without: docs/production.md, Redis).
    redis_sentinel_master: str | None = Field(default=None, min_length=1)
    #: Folder of the filesystem broker (embedded default only).
    broker_folder: str = "var/broker"
    #: Fingerprint keys by version, e.g. ``{"v1": "..."}``; at least 16 bytes each.
    fingerprint_keys: dict[str, SecretStr] = Field(
        default_factory=lambda: {"v1": SecretStr(DEV_FINGERPRINT_KEY)}, min_length=1
    )
    fingerprint_key_version: str = "v1"
    #: Secret the downstream idempotency keys are derived from (at least 16 bytes).
    idempotency_secret: SecretStr = SecretStr(DEV_IDEMPOTENCY_SECRET)
    #: Allow the development key and secret against PostgreSQL (never in production).
    development: bool = False

    #: Base URL of the downstream payment service.
    downstream_url: str = "http://127.0.0.1:8700"
    #: Downstream API key per tenant, e.g. ``{"acme": "sk_test_..."}``.
    downstream_api_keys: dict[str, SecretStr] = Field(default_factory=dict)
    #: Longest a single HTTP attempt may take, before the operation's deadline bounds it further.
    downstream_timeout: float = Field(default=10.0, gt=0)
    #: Per kind, which downstream serves it: ``http`` (the wire protocol at
    #: ``downstream_url``, the default), ``stripe``, ``wechatpay`` or ``alipay`` (refunds
    #: only), e.g. ``{"refund": "stripe"}``.
    downstream_providers: dict[str, Literal["http", "stripe", "wechatpay", "alipay"]] = Field(
        default_factory=dict
    )
    #: Stripe secret key per tenant, e.g. ``{"acme": "sk_test_..."}`` (never logged).
    stripe_api_keys: dict[str, SecretStr] = Field(default_factory=dict)
    #: Stripe's API base URL (the simulator's Stripe mode: its URL + ``/stripe``).
    stripe_api_base: str = "https://api.stripe.com"
    #: WeChat Pay merchant per tenant (``outbox.settings_wechatpay``; keys never logged).
    wechatpay_merchants: dict[str, WechatPayMerchant] = Field(default_factory=dict)
    #: WeChat Pay's API base URL (the simulator's WeChat Pay mode: its URL + ``/wechatpay``).
    wechatpay_api_base: str = "https://api.mch.weixin.qq.com"
    #: ``module:function`` giving an order's total in fen, ``function(tenant, order_id)``
    #: (None where unknown): WeChat Pay's refunds name it, refund intents do not carry it.
    wechatpay_order_totals: str | None = None
    #: Alipay app per tenant: its app id, its RSA2 private key (PEM or Alipay's bare base64;
    #: never logged) and Alipay's public key for the app, e.g. ``{"acme": "2021000000000001"}``.
    alipay_app_ids: dict[str, str] = Field(default_factory=dict)
    alipay_private_keys: dict[str, SecretStr] = Field(default_factory=dict)
    alipay_public_keys: dict[str, str] = Field(default_factory=dict)
    #: Alipay's OpenAPI gateway (its sandbox: https://openapi-sandbox.dl.alipaydev.com/gateway.do;
    #: the simulator's Alipay mode: its URL + ``/alipay/gateway.do``).
    alipay_gateway_url: str = "https://openapi.alipay.com/gateway.do"

    #: Budget given to a new operation: its deadline, and how many of its attempts may reach
    #: the downstream (one whose request never left, a refused connection, costs none of them).
    #: A send that provably did not execute is tried again by time until one of the two is
    #: spent, waiting up to ``retry_cap_seconds`` between tries (a kind's contract may set its
    #: own), at most ``retry_max_tries`` tries in all (a sanity ceiling).
    max_attempts: int = Field(default=5, ge=1)
    deadline_seconds: float = Field(default=3600.0, gt=0)
    retry_cap_seconds: float = Field(default=DEFAULT_CAP_SECONDS, gt=0, le=86400)
    retry_max_tries: int = Field(default=DEFAULT_MAX_TRIES, ge=1, le=1_000_000)
    #: How long a claim lasts unless its holder renews it. A live worker renews the leases it
    #: is working on every third of a lease; a dead one's lapse this long after, and the
    #: sweeper and reconciler take its operations over. No send starts, or runs, past the lease
    #: it was claimed with (less the clock margin): keep it above the downstream timeout.
    lease_seconds: float = Field(default=15.0, gt=0)
    #: Largest difference assumed between the database's clock and the downstream's: a send
    #: must be over this long before its lease ends.
    clock_margin_seconds: float = Field(default=1.0, ge=0)
    #: After a step of the database's clock (its advance off the monotonic clock's by more than
    #: the clock margin), how long a "not found" is not trusted (the contract's processing time
    #: is added): every send in flight at the step must be over. None: the lease, the longest
    #: any send runs from its claim; set it to the longest lease of any worker if they differ.
    clock_step_distrust_seconds: float | None = Field(default=None, gt=0)
    #: Automatic resends stop this long before the downstream's key retention ends.
    key_retention_margin_seconds: float = Field(default=3600.0, ge=0)
    #: Period of the sweeper, which re-hints every due operation (beat).
    sweep_seconds: float = Field(default=1.0, gt=0)
    #: Due operations a worker claims beside the hinted ones, sent concurrently (only when
    #: its hint found work: a hint whose operations were taken claims nothing more). With one
    #: operation per hint, a backlog is then worked in batches, and most hints cost a single
    #: statement (docs/performance.md).
    claim_batch: int = Field(default=8, ge=0)
    #: Operation ids per hint message (the sweeper's; the app passes its own to the relay).
    hint_batch: int = Field(default=20, ge=1, le=500)
    #: The doorbell (``outbox.doorbell``, Redis brokers only): an app's transaction publishes
    #: a hint only while fewer than this many wait in the queue, and the waiting ones claim its
    #: operations, ``SETTLED_CLAIM_BATCH`` at a time. 0 (or ``SETTLED_CLAIM_BATCH`` 0): off, one
    #: hint per transaction.
    hint_doorbell: int = Field(default=4, ge=0, le=1000)
    #: The app's hint publish (``settled.celery_app.hint_publisher``): the longest it waits on
    #: the broker per round trip (the connect, each reply), tried once, never retried. A hint
    #: is a wake-up only: the sweeper sends the operations of one not published.
    hint_timeout: float = Field(default=0.05, gt=0, le=10)
    #: After a hint the broker did not take, how long the app skips hints (counted, never
    #: tried) before it tries one again (``outbox.breaker``).
    hint_cooldown_seconds: float = Field(default=5.0, gt=0, le=3600)
    #: Where beat keeps its schedule state.
    beat_schedule_file: str = "var/celerybeat-schedule"
    #: How often the reconciler runs, and how long "unknown" may last before review.
    reconcile_seconds: float = Field(default=10.0, gt=0)
    review_after_seconds: float = Field(default=600.0, gt=0)

    #: Port of the worker's Prometheus endpoint (None: not served).
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    #: Interface the worker's Prometheus endpoint listens on (0.0.0.0: every interface).
    metrics_host: str = "127.0.0.1"
    #: Level and line format of every process's log (``json``: one object per line).
    log_level: LogLevel = "INFO"
    log_format: LogFormat = "json"

    #: Per kind, what its downstream promises, e.g. ``{"refund": {"idempotent": false}}``
    #: (``ContractSettings``); kinds not named keep their declared contract.
    downstream_contracts: dict[str, ContractSettings] = Field(default_factory=dict)

    #: The support console's sign-in (``settled.console.auth``, ``support.signin``): a
    #: session ends after this long without a request, and this long after sign-in whatever.
    console_session_idle_minutes: float = Field(default=30.0, gt=0)
    console_session_max_hours: float = Field(default=12.0, gt=0)
    #: Mark the session cookie ``Secure`` even on a request that arrived as plain http (a TLS
    #: proxy in front that uvicorn is not told to trust with ``--proxy-headers``).
    console_secure_cookies: bool = False
    #: Sign-in throttling: after this many failures for one name, or from one client address,
    #: within the window, further attempts are refused until the oldest of them leaves it.
    console_login_max_failures: int = Field(default=5, ge=1, le=1000)
    console_login_max_failures_per_address: int = Field(default=20, ge=1, le=10000)
    console_login_window_minutes: float = Field(default=15.0, gt=0)
    #: The review queue and an item's status refresh by themselves this often (htmx polling).
    console_refresh_seconds: float = Field(default=10.0, ge=0.5, le=3600)

    #: The MCP server for AI agents (``settled mcp``): the one tenant a stdio server speaks
    #: for (the HTTP transport takes a tenant's API key instead); per tenant, the largest
    #: refund its policy approves without a person, in minor units, e.g. ``{"acme": 5000}``
    #: (a tenant not named: none); how long a repeated request answers with the earlier one;
    #: how long a proposal waits for a decision before it expires (database time; an expired
    #: one is never approved, and nothing is sent for it).
    agent_tenant: str | None = None
    agent_auto_approve_minor: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    agent_repeat_window_seconds: float = Field(default=86400.0, gt=0)
    agent_proposal_ttl_seconds: float = Field(default=86400.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_variables(cls, data: Any) -> Any:
        # Every reader of the settings refuses a typo, an app's Outbox included: a misspelt
        # SETTLED_DATABASE_URL would otherwise mean the default database.
        refuse_unknown_variables(os.environ)
        return data

    @field_validator("database_url")
    @classmethod
    def _hosts_in_query(cls, url: str) -> str:
        from outbox.db import hosts_in_query

        return hosts_in_query(url)

    @field_validator("fingerprint_keys")
    @classmethod
    def _long_enough_keys(cls, keys: dict[str, SecretStr]) -> dict[str, SecretStr]:
        short = sorted(v for v, k in keys.items() if len(k.get_secret_value().encode()) < 16)
        if short:
            raise ValueError(f"keys must be at least 16 bytes; too short: {short}")
        return keys

    @field_validator("idempotency_secret")
    @classmethod
    def _long_enough_secret(cls, secret: SecretStr) -> SecretStr:
        if len(secret.get_secret_value().encode()) < 16:
            raise ValueError("must be at least 16 bytes")
        return secret

    @model_validator(mode="after")
    def _current_key_exists(self) -> Settings:
        if self.fingerprint_key_version not in self.fingerprint_keys:
            raise ValueError(
                f"SETTLED_FINGERPRINT_KEY_VERSION {self.fingerprint_key_version!r} is not among "
                f"the versions of SETTLED_FINGERPRINT_KEYS {sorted(self.fingerprint_keys)}"
            )
        return self

    @model_validator(mode="after")
    def _lease_outlasts_margin(self) -> Settings:
        if self.lease_seconds <= self.clock_margin_seconds:
            raise ValueError(
                "SETTLED_LEASE_SECONDS must be longer than SETTLED_CLOCK_MARGIN_SECONDS: "
                "a send must end a clock margin before its lease does, so none could start"
            )
        return self

    @model_validator(mode="after")
    def _step_distrust_outlasts_a_send(self) -> Settings:
        window = self.clock_step_distrust_seconds
        if window is not None and window < self.lease_seconds:
            raise ValueError(
                "SETTLED_CLOCK_STEP_DISTRUST_SECONDS must be at least SETTLED_LEASE_SECONDS: "
                "after a step of the database's clock, every send in flight must be over"
            )
        return self

    @model_validator(mode="after")
    def _sentinel_master_with_sentinels(self) -> Settings:
        scheme = self.broker_url.partition("://")[0].lower()
        if "cluster" in scheme:  # kombu has no Redis Cluster transport
            raise ValueError("SETTLED_BROKER_URL: Redis Cluster is not supported as the broker")
        if scheme == "sentinel" and self.redis_sentinel_master is None:
            raise ValueError(
                "SETTLED_BROKER_URL is a sentinel:// URL: set SETTLED_REDIS_SENTINEL_MASTER "
                "to the name of the master its Sentinels watch"
            )
        if scheme != "sentinel" and self.redis_sentinel_master is not None:
            raise ValueError(
                "SETTLED_REDIS_SENTINEL_MASTER is set but SETTLED_BROKER_URL is not a "
                "sentinel:// URL"
            )
        return self

    @property
    def clock_step_window(self) -> float:
        """How long a "not found" is not trusted after a step of the database's clock."""
        if self.clock_step_distrust_seconds is None:
            return self.lease_seconds
        return self.clock_step_distrust_seconds

    def development_secrets(self) -> list[str]:
        """The settings still holding a development value where they must not: against
        PostgreSQL, unless ``development`` is set. Empty when all is well."""
        if self.development or not self.database_url.startswith("postgresql"):
            return []
        found = []
        if any(k.get_secret_value() == DEV_FINGERPRINT_KEY for k in self.fingerprint_keys.values()):
            found.append("SETTLED_FINGERPRINT_KEYS")
        if self.idempotency_secret.get_secret_value() == DEV_IDEMPOTENCY_SECRET:
            found.append("SETTLED_IDEMPOTENCY_SECRET")
        return found

    def refuse_development_secrets(self) -> None:
        """Raise InvalidSetting (``development_secrets``) when ``development_secrets`` finds
        any: fingerprints and keys made with them would not match a correctly configured
        worker's, and every operation would be refused."""
        found = self.development_secrets()
        if found:
            raise InvalidSetting(
                f"refusing to start against PostgreSQL with the development value of "
                f"{' and '.join(found)}: set your own (or SETTLED_DEVELOPMENT=1 on a development "
                "machine)",
                code="development_secrets",
                setting=found[0],
            )

    def apply_contracts(self, registry: KindRegistry) -> KindRegistry:
        """``registry`` with the configured contracts and the key retention margin applied.

        Raises InvalidInput (code ``invalid_setting``) naming the setting for a kind that is
        not registered, or a deadline fence promised for a kind Stripe serves
        (``outbox.settings_contracts.apply_contracts``; the contracts' own fields are checked
        when the settings are read).
        """
        return apply_contracts(
            registry,
            self.downstream_contracts,
            providers=self.downstream_providers,
            retention_margin=timedelta(seconds=self.key_retention_margin_seconds),
            retry_cap=timedelta(seconds=self.retry_cap_seconds),
        )

    def as_environment(self) -> dict[str, str]:
        """These settings as ``SETTLED_*`` variables, to configure a child process."""
        env: dict[str, str] = {}
        for name, value in self:
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, dict):
                value = json.dumps({k: _plain(v) for k, v in value.items()})
            env[f"SETTLED_{name.upper()}"] = str(value)
        return env

    def fingerprint_key_bytes(self) -> dict[str, bytes]:
        return {v: k.get_secret_value().encode() for v, k in self.fingerprint_keys.items()}


def _plain(value: Any) -> Any:
    """A setting's value as JSON can carry it (secrets unwrapped: for a child's environment)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, BaseModel):
        plain = value.model_dump(mode="json", exclude_none=True)
        for name in plain:  # a model's secrets too (a WeChat Pay merchant's inline key)
            inner = getattr(value, name)
            if isinstance(inner, SecretStr):
                plain[name] = inner.get_secret_value()
        return plain
    return value


def masked(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``; a relative SQLite path made
    absolute, so that the line says which file."""
    from sqlalchemy.exc import ArgumentError

    from outbox.db import sqlite_file

    try:
        path = sqlite_file(url)
    except (ArgumentError, ValueError):  # not a database URL (a broker's): masked below
        path = None
    if path is not None:
        return f"sqlite:///{path}"
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def settings_error(exc: ValidationError) -> str:
    """A settings error as one line naming each variable and what is wrong, never its value
    (it may be a secret)."""
    parts = []
    for err in exc.errors(include_input=False, include_url=False, include_context=False):
        loc = [str(p) for p in err["loc"]]
        message = err["msg"].removeprefix("Value error, ")
        if not loc:  # a rule across settings: its message names them
            parts.append(message)
            continue
        where = "".join(f"[{p}]" for p in loc[1:])
        parts.append(f"SETTLED_{loc[0].upper()}{where}: {message}")
    return "invalid configuration: " + "; ".join(parts) if parts else "invalid configuration"
