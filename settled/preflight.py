"""The checks before a start: one preflight for every command that fingerprints, approves,
sends or serves (``worker``, ``beat``, ``web``, ``run``, ``mcp``, ``review``, ``proposals``,
``reconcile``, and ``check``, which runs it alone).

Each refusal is one ``InvalidSetting`` or ``SettledError`` naming what to fix, raised before
anything is written, sent or published (and before an SQLite file is created). What reading
the settings refuses already (an unknown ``SETTLED_*`` variable, a value out of range) is
refused before this runs; an app's ``Outbox.from_settings`` refuses the development secrets
against PostgreSQL itself. In order:

    development secrets against PostgreSQL  SETTLED_FINGERPRINT_KEYS, SETTLED_IDEMPOTENCY_SECRET
    contracts for unknown kinds              SETTLED_DOWNSTREAM_CONTRACTS
    providers, Stripe without keys           SETTLED_DOWNSTREAM_PROVIDERS, SETTLED_STRIPE_API_KEYS
    WeChat Pay without merchants, unreadable SETTLED_WECHATPAY_MERCHANTS,
      keys, no order totals function         SETTLED_WECHATPAY_ORDER_TOTALS
    Alipay without a whole app per tenant    SETTLED_ALIPAY_APP_IDS, SETTLED_ALIPAY_*_KEYS
    downstream URLs without http(s), host    SETTLED_DOWNSTREAM_URL, SETTLED_STRIPE_API_BASE,
                                             SETTLED_WECHATPAY_API_BASE,
                                             SETTLED_ALIPAY_GATEWAY_URL
    a lease a send does not fit in           SETTLED_LEASE_SECONDS
    a broker URL of no known transport       SETTLED_BROKER_URL
    the database: answers, at the newest migration
    the broker answers (processes that publish or consume hints)
    each declared deadline fence is kept:    SETTLED_DOWNSTREAM_CONTRACTS (enforces_deadline)
      the kind's downstream refuses the      (``probe``: the processes that send or settle by
      fence's probe with 408                 themselves, and ``check``)

``Started.line`` is the one line a start says: the database and the broker (passwords
masked) and the schema version; ``Started.fences`` what each fence's probe found.

A fence is probed rather than believed because believing it is what makes a "not found"
proof at the lease end: a downstream that does not refuse a late request could still execute
one after the operation was called not done. A downstream that cannot be reached at start
cannot show its fence either, and the start stops too (docs/configuration.md, "Checks at
start", says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from outbox.errors import FenceNotVerified, InvalidSetting
from outbox.kinds import KindRegistry, default_registry
from outbox.settings import Settings, masked
from settled.runtime import FenceCheck, check_providers, probe_fences, wechatpay_parts


@dataclass(frozen=True)
class Started:
    """What a start runs against, as its start line says it."""

    database: str
    schema: str
    broker: str | None
    #: each declared deadline fence, probed and verified (none when not probed)
    fences: tuple[FenceCheck, ...] = ()

    def line(self, command: str) -> str:
        broker = f", broker {self.broker}" if self.broker else ""
        fences = ""
        if self.fences:
            fences = f", deadline fence verified for {', '.join(c.kind for c in self.fences)}"
        return (
            f"settled {command}: database {self.database} at schema {self.schema}{broker}{fences}"
        )

    def fence_lines(self, command: str) -> list[str]:
        """One line per probed fence, what ``settled check`` prints after its line."""
        return [
            f"settled {command}: kind {check.kind}: deadline fence verified at {check.url} "
            f"({check.probe.detail})"
            for check in self.fences
        ]


def announce(started: Started, command: str) -> None:
    """Log the start line (logger ``settled.start``, JSON like every line), whatever the log
    level: every start says what it runs against."""
    import logging

    log = logging.getLogger("settled.start")
    log.setLevel(logging.INFO)  # shown at a person's command's WARNING too
    fields = {"command": command, "database": started.database, "schema": started.schema}
    if started.broker is not None:
        fields["broker"] = started.broker
    if started.fences:
        fields["fences_verified"] = ",".join(check.kind for check in started.fences)
    log.info(started.line(command), extra=fields)


def preflight(
    settings: Settings,
    *,
    broker: bool,
    registry: KindRegistry | None = None,
    probe: bool = False,
) -> Started:
    """Refuse a misconfiguration before anything runs (module docstring), then check that the
    database answers and is migrated, (``broker``: a process that publishes or consumes
    hints) that the broker answers, and (``probe``: a process that sends or settles by itself)
    that each declared deadline fence is kept (``check_fences``). Returns what the start line
    says."""
    from outbox.db import check_schema

    registry = check_configuration(settings, registry)
    schema = check_schema(settings.database_url)
    shown_broker = None
    if broker:
        from settled.celery_app import check_broker

        check_broker(settings)
        shown_broker = masked(settings.broker_url)
    fences = check_fences(settings, registry) if probe else ()
    return Started(masked(settings.database_url), schema, shown_broker, fences)


def check_fences(settings: Settings, registry: KindRegistry) -> tuple[FenceCheck, ...]:
    """Probe each kind whose contract declares ``enforces_deadline`` on the wire protocol
    (``settled.runtime.probe_fences``); raise FenceNotVerified naming every kind whose
    downstream did not refuse the probe with ``408 deadline_exceeded``, with its URL (never a
    key) and what came back. Returns the verified checks."""
    checks = probe_fences(settings, registry)
    failed = [check for check in checks if not check.probe.verified]
    if failed:
        told = "; ".join(
            f"kind {check.kind!r} at {check.url}: {check.probe.detail}" for check in failed
        )
        raise FenceNotVerified(
            "SETTLED_DOWNSTREAM_CONTRACTS declares enforces_deadline, but the downstream did "
            f"not refuse the deadline fence's probe with 408 deadline_exceeded ({told}); "
            'a "not found" would be trusted before a late request could no longer land: '
            "make the downstream enforce the deadline (and reachable), or remove the declaration "
            'for the kind (its "not found" then waits out max_request_delay_seconds)',
            setting="SETTLED_DOWNSTREAM_CONTRACTS",
            kinds=[check.kind for check in failed],
            urls=[check.url for check in failed],
        )
    return tuple(checks)


def check_configuration(settings: Settings, registry: KindRegistry | None = None) -> KindRegistry:
    """The checks that need no server; returns ``registry`` (default: the default kinds)
    with the configured contracts applied."""
    settings.refuse_development_secrets()
    registry = settings.apply_contracts(registry or default_registry())
    check_providers(settings, registry)
    _check_url(settings.downstream_url, "SETTLED_DOWNSTREAM_URL")
    if "stripe" in settings.downstream_providers.values():
        _check_url(settings.stripe_api_base, "SETTLED_STRIPE_API_BASE")
    if "wechatpay" in settings.downstream_providers.values():
        wechatpay_parts(settings)  # every key readable, the totals function importable
        _check_url(settings.wechatpay_api_base, "SETTLED_WECHATPAY_API_BASE")
    if "alipay" in settings.downstream_providers.values():
        _check_url(settings.alipay_gateway_url, "SETTLED_ALIPAY_GATEWAY_URL")
    _check_lease(settings)
    _check_broker_url(settings.broker_url)
    return registry


def _check_url(url: str, setting: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidSetting(
            f"{setting} must be an http:// or https:// URL with a host, e.g. "
            "https://payments.example.com",
            setting=setting,
        )


def _check_lease(settings: Settings) -> None:
    fits = settings.downstream_timeout + settings.clock_margin_seconds
    if settings.lease_seconds < fits:
        raise InvalidSetting(
            f"SETTLED_LEASE_SECONDS ({settings.lease_seconds:g} s) is shorter than "
            f"SETTLED_DOWNSTREAM_TIMEOUT ({settings.downstream_timeout:g} s) plus "
            f"SETTLED_CLOCK_MARGIN_SECONDS ({settings.clock_margin_seconds:g} s): every send "
            "would be cut at its lease; make the lease longer or the timeout shorter",
            setting="SETTLED_LEASE_SECONDS",
        )


def _check_broker_url(url: str) -> None:
    from kombu.transport import TRANSPORT_ALIASES

    # ``redis+socket://``: kombu's transport is the part before the ``+``.
    scheme = url.partition(":")[0].partition("+")[0]
    if scheme not in TRANSPORT_ALIASES:
        import difflib

        near = difflib.get_close_matches(scheme, sorted(TRANSPORT_ALIASES), n=1)
        hint = f"; did you mean {near[0]}://?" if near else ""
        raise InvalidSetting(
            f"SETTLED_BROKER_URL has no known transport {scheme + '://'!r}{hint}",
            setting="SETTLED_BROKER_URL",
        )
