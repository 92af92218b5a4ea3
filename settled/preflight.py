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
    the database: answers (each host of a     SETTLED_DATABASE_URL
      multi-host URL named with its role when
      none gave the session asked for), is no
      standby, at the newest migration
    the broker answers (processes that publish or consume hints)
    each declared deadline fence is kept:    SETTLED_DOWNSTREAM_CONTRACTS (enforces_deadline)
      the kind's downstream refuses the      (``probe``: the processes that send or settle by
      fence's probe with 408                 themselves, and ``check``)

``Started.line`` is the one line a start says: the database and the broker (passwords
masked), the schema version and the primary's replication (``synchronous_commit``,
``synchronous_standby_names``, each standby with its mode); ``Started.fences`` what each
fence's probe found. A primary whose standbys are all asynchronous starts with a WARNING
after the line (``Started.replication_warning``), every start, unless
``SETTLED_ASYNC_REPLICATION_ACCEPTED`` says it was accepted (the line then says so).

A fence is probed rather than believed because believing it is what makes a "not found"
proof at the lease end: a downstream that does not refuse a late request could still execute
one after the operation was called not done. A downstream that cannot be reached at start
cannot show its fence either, and the start stops too (docs/configuration.md, "Checks at
start", says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from outbox.errors import FenceNotVerified, InvalidSetting, SettledError
from outbox.kinds import KindRegistry, default_registry
from outbox.settings import Settings, masked
from settled.runtime import FenceCheck, check_providers, probe_fences, wechatpay_parts

if TYPE_CHECKING:
    from outbox.storage.replication import Replication


@dataclass(frozen=True)
class Started:
    """What a start runs against, as its start line says it."""

    database: str
    schema: str
    broker: str | None
    #: each declared deadline fence, probed and verified (none when not probed)
    fences: tuple[FenceCheck, ...] = ()
    #: the primary's replication (None: not PostgreSQL)
    replication: Replication | None = None
    #: ``SETTLED_ASYNC_REPLICATION_ACCEPTED``
    async_accepted: bool = False

    def line(self, command: str) -> str:
        broker = f", broker {self.broker}" if self.broker else ""
        fences = ""
        if self.fences:
            fences = f", deadline fence verified for {', '.join(c.kind for c in self.fences)}"
        replication = ""
        if self.replication is not None:
            replication = f", replication ({self.replication.describe()})"
            if self.replication.asynchronous and self.async_accepted:
                replication += (
                    ": asynchronous, accepted (SETTLED_ASYNC_REPLICATION_ACCEPTED): a failover "
                    "can lose committed operations"
                )
        return (
            f"settled {command}: database {self.database} at schema {self.schema}"
            f"{replication}{broker}{fences}"
        )

    def replication_warning(self) -> str | None:
        """The WARNING a start says after its line when the primary's standbys are all
        asynchronous (None: they are not, or it was accepted)."""
        r = self.replication
        if r is None or not r.asynchronous or self.async_accepted:
            return None
        why = (
            f"synchronous_commit is {r.synchronous_commit}: no commit waits for a standby"
            if r.synchronous_commit in ("local", "off")
            else "no standby is synchronous (synchronous_standby_names "
            f"{r.synchronous_standby_names!r})"
        )
        return (
            f"asynchronous replication: {why}; a failover to a standby can lose whole "
            "operations the app committed, refunds the downstream already carried out among "
            "them (the promoted database never saw them, and hands their integer ids to other "
            "operations): set synchronous_standby_names on the primary, or "
            "SETTLED_ASYNC_REPLICATION_ACCEPTED=true to accept it (docs/production.md, "
            "PostgreSQL: failover)"
        )

    def fence_lines(self, command: str) -> list[str]:
        """One line per probed fence, what ``settled check`` prints after its line."""
        return [
            f"settled {command}: kind {check.kind}: deadline fence verified at {check.url} "
            f"({check.probe.detail})"
            for check in self.fences
        ]


def host_lines(command: str, roles: list[HostRole]) -> list[str]:
    """One line per host of a multi-host database URL, with its role (``settled check``)."""
    return [f"settled {command}: database host {role.describe()}" for role in roles]


def announce(started: Started, command: str) -> None:
    """Log the start line (logger ``settled.start``, JSON like every line), whatever the log
    level: every start says what it runs against."""
    import logging

    log = logging.getLogger("settled.start")
    log.setLevel(logging.INFO)  # shown at a person's command's WARNING too
    fields: dict[str, object] = {
        "command": command,
        "database": started.database,
        "schema": started.schema,
    }
    if started.broker is not None:
        fields["broker"] = started.broker
    if started.fences:
        fields["fences_verified"] = ",".join(check.kind for check in started.fences)
    replication = started.replication
    if replication is not None:
        fields["synchronous_commit"] = replication.synchronous_commit
        fields["synchronous_standby_names"] = replication.synchronous_standby_names
        fields["standbys"] = ",".join(
            f"{s.name}:{s.sync_state or 'unknown'}" for s in replication.standbys
        )
        fields["async_replication_accepted"] = started.async_accepted
    log.info(started.line(command), extra=fields)
    warning = started.replication_warning()
    if warning is not None:
        log.warning(warning, extra={"command": command})


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
    registry = check_configuration(settings, registry)
    schema, replication = check_database(settings.database_url)
    shown_broker = None
    if broker:
        from settled.celery_app import check_broker

        check_broker(settings)
        shown_broker = masked(settings.broker_url)
    fences = check_fences(settings, registry) if probe else ()
    return Started(
        masked(settings.database_url),
        schema,
        shown_broker,
        fences,
        replication,
        settings.async_replication_accepted,
    )


def check_database(url: str) -> tuple[str, Replication | None]:
    """The schema the database is at (``outbox.db.check_schema``) and its replication; raise
    SettledError when it is a standby (``database_is_standby``: every process writes), and,
    for a multi-host URL none of whose hosts gave the session asked for, one naming each
    host with its role or error (``database_unreachable``), not only the last host's."""
    from sqlalchemy.exc import DBAPIError

    from outbox.db import check_schema, database_hosts

    try:
        schema = check_schema(url)
        replication = replication_of(url)
    except DBAPIError as exc:
        if len(database_hosts(url)) < 2:
            raise
        roles = "; ".join(role.describe() for role in host_roles(url))
        raise SettledError(
            f"no host of SETTLED_DATABASE_URL gave the session it asks for ({roles})",
            code="database_unreachable",
        ) from exc
    if replication is not None and replication.standby:
        raise SettledError(
            "SETTLED_DATABASE_URL leads to a standby (read-only): point it at the primary "
            "(a multi-host URL with target_session_attrs=read-write, or the name your "
            "failover moves)",
            code="database_is_standby",
        )
    return schema, replication


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


@dataclass(frozen=True)
class HostRole:
    """One host of a (multi-host) database URL as a connection of its own found it."""

    host: str
    port: int | None
    #: ``primary``, ``standby`` or ``unreachable``
    role: str
    #: the driver's first line, when unreachable (never a password: libpq does not echo it)
    error: str | None = None

    def describe(self) -> str:
        where = self.host if self.port is None else f"{self.host}:{self.port}"
        return f"{where} {self.role}" + (f" ({self.error})" if self.error else "")


def host_roles(url: str, timeout: float = 3.0) -> list[HostRole]:
    """Each host of ``url`` (``database_hosts``) asked alone, with a connection of its own
    (``target_session_attrs`` left out): primary, standby, or unreachable with its error."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import DBAPIError

    from outbox.db import database_hosts, hosts_in_query, make_engine
    from outbox.storage.replication import in_recovery

    base = make_url(hosts_in_query(url)).difference_update_query(
        ["host", "port", "target_session_attrs"]
    )
    roles = []
    for host, port in database_hosts(url):
        one = base.set(host=host, port=port).render_as_string(hide_password=False)
        engine = make_engine(one, connect_args={"connect_timeout": timeout})
        try:
            with engine.connect() as conn:
                role = "standby" if in_recovery(conn) else "primary"
            roles.append(HostRole(host, port, role))
        except DBAPIError as exc:
            first = (str(exc.orig).strip().splitlines() or [""])[0][:200]
            roles.append(HostRole(host, port, "unreachable", first))
        finally:
            engine.dispose()
    return roles


def replication_of(url: str) -> Replication | None:
    """The replication of the server ``url`` connects to, as its sessions see it
    (``Storage.replication``; None: the database has none)."""

    from outbox.db import make_engine
    from outbox.storage import storage_for

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return storage_for(engine).replication(conn)
    finally:
        engine.dispose()
