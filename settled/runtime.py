"""The composition root of a worker, beat or web process: built once from settings.

Every service is built here and nowhere else (``build_runtime``, each service on first use),
so that the worker, beat, the console, the MCP server and the command line ask the same
downstream of each kind (``build_gateway``) with the same rules.
"""

from __future__ import annotations

import functools
import importlib
import os
import socket
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.clock_steps import ClockWatch
from outbox.db import make_engine
from outbox.downstream import Gateway
from outbox.errors import InvalidSetting
from outbox.intake import Outbox
from outbox.kinds import KindRegistry, default_registry
from outbox.leases import LONGEST_IN_LEASES
from outbox.outage import DatabaseOutage
from outbox.port_shim import as_gateway
from outbox.proposals import Proposals
from outbox.settings import Settings
from outbox.verdict_due import Cadence
from reconciler.reconcile import Reconciler
from settled.observe import Observed
from support.approvals import Approvals
from support.find import Finder
from support.overview import Overview
from support.review import ReviewQueue
from workers.alipay_gateway import AlipayApp, AlipayGateway, load_private_key, load_public_key
from workers.coalesce import Coalescer
from workers.downstream_time import LagSeen, TimeSeen
from workers.downstreams import Downstreams
from workers.executor import Executor
from workers.http_classify import FenceProbe
from workers.http_client import HttpGateway
from workers.recovery_probe import RecoveryProbe
from workers.routing import GatewayByKind
from workers.stripe_gateway import StripeGateway
from workers.wechatpay_gateway import OrderTotals, WechatPayGateway
from workers.wechatpay_signing import MerchantKeys, UnreadableKey, merchant_keys

if TYPE_CHECKING:
    from settled.mcp_server import AgentDesk
    from settled.wechatpay_notify import WechatPayNotifications

T = TypeVar("T")


class Runtime:
    """Every service of a process, each built once from the settings on first use: the worker
    asks for the executor, the web process for the review queue and the console's services,
    the MCP server for the agent desk, and all of them get the same downstream of each kind,
    the same watch on the database's clock and the same sessions. Thread-safe."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        sessions: sessionmaker[Session],
        registry: KindRegistry,
        *,
        gateway: Gateway | None = None,
        owns_engine: bool = True,
    ) -> None:
        self.settings, self.engine, self.sessions, self.registry = (
            settings,
            engine,
            sessions,
            registry,
        )
        self._built: dict[str, Any] = {}
        if gateway is not None:  # told once for every service: an old-style adapter
            self._built["gateway"] = as_gateway(gateway, stacklevel=3)
        self._owns_engine = owns_engine
        self._making = threading.RLock()

    def _once(self, name: str, build: Callable[[], T]) -> T:
        with self._making:
            if name not in self._built:
                self._built[name] = build()
            built: T = self._built[name]
            return built

    @property
    def observer(self) -> Observed:
        """What every service reports its steps to: identities in log lines, spans while
        tracing is on (``settled.observe``)."""
        return self._once("observer", lambda: Observed(self.sessions))

    @property
    def outbox(self) -> Outbox:
        return self._once(
            "outbox",
            lambda: Outbox.from_settings(self.settings, self.registry, observer=self.observer),
        )

    @property
    def gateway(self) -> Gateway:
        """The downstream of each kind as configured (``build_gateway``); the time each answer
        says is measured by the process's clock watch (``ClockWatch.downstream_answered``)."""
        return self._once(
            "gateway",
            lambda: build_gateway(
                self.settings,
                self.registry,
                time_seen=functools.partial(
                    _downstream_answered, self.clock_watch, self.sessions, worker_name()
                ),
                lag_seen=self.clock_watch.downstreams.latest,
            ),
        )

    @property
    def cadence(self) -> Cadence:
        """The numbers this deployment's reconciler runs with and each kind's contract: what
        the answers (report, status API, console, MCP) say an uncertain verdict's time from
        (``outbox.verdict_due``)."""
        return self._once("cadence", lambda: cadence_of(self.settings, self.registry))

    @property
    def clock_watch(self) -> ClockWatch:
        """One watch on the database's clock for the process: a step any service sees is
        honoured by all of them (and recorded for the other processes)."""
        settings = self.settings
        return self._once(
            "clock_watch",
            lambda: ClockWatch(
                margin=settings.clock_margin_seconds, window=settings.clock_step_window
            ),
        )

    @property
    def outage(self) -> DatabaseOutage:
        """One view of a database outage for the process: its services' failures while the
        database is away are said in one line when it starts and one when it ends."""
        return self._once("outage", DatabaseOutage)

    @property
    def executor(self) -> Executor:
        def build() -> Executor:
            settings = self.settings
            return Executor(
                sessions=self.sessions,
                gateway=self.gateway,
                registry=self.registry,
                fingerprinter=self.outbox.fingerprinter,
                worker=worker_name(),
                lease_seconds=settings.lease_seconds,
                batch_extra=settings.claim_batch,
                clock_margin=settings.clock_margin_seconds,
                max_tries=settings.retry_max_tries,
                clock_watch=self.clock_watch,
                observer=self.observer,
                downstreams=self.downstreams,
                outage=self.outage,
                # outcomes wait for an unreachable database as long as their leases are kept
                outcome_patience=LONGEST_IN_LEASES * settings.lease_seconds,
            )

        return self._once("executor", build)

    @property
    def downstreams(self) -> Downstreams:
        """The downstream serving each kind (``SETTLED_DOWNSTREAM_PROVIDERS``, as
        ``build_gateway`` reads it): one's answer wakes what waits for it."""
        return self._once(
            "downstreams", lambda: Downstreams(dict(self.settings.downstream_providers))
        )

    @property
    def recovery_probe(self) -> RecoveryProbe:
        """Beat's probe of each downstream operations wait for after refusals; a success
        wakes up to one worker batch of them (``workers.recovery_probe``)."""
        return self._once(
            "recovery_probe",
            lambda: RecoveryProbe(
                sessions=self.sessions,
                gateway=self.gateway,
                registry=self.registry,
                downstreams=self.downstreams,
                limit=self.executor.max_batch,
            ),
        )

    @property
    def reconciler(self) -> Reconciler:
        def build() -> Reconciler:
            settings = self.settings
            return Reconciler(
                sessions=self.sessions,
                gateway=self.gateway,
                registry=self.registry,
                worker=worker_name(),
                lease_seconds=settings.lease_seconds,
                client_timeout=settings.downstream_timeout,
                review_after=settings.review_after_seconds,
                clock_watch=self.clock_watch,
                observer=self.observer,
                # what a "not found" cannot settle yet is sent again, same key, by the executor
                resender=self.executor,
                outage=self.outage,
            )

        return self._once("reconciler", build)

    @property
    def review(self) -> ReviewQueue:
        """The review queue staff work (the console, ``settled review``): its lookups go to
        each kind's downstream as the worker's sends do."""
        return self._once(
            "review",
            lambda: ReviewQueue(
                self.sessions,
                self.gateway,
                self.registry,
                lookup_timeout=self.settings.downstream_timeout,
                clock_watch=self.clock_watch,
            ),
        )

    @property
    def proposals(self) -> Proposals:
        """What AI agents propose, with the configured contracts, repeat window and time to
        live, fingerprinted with the process's own outbox."""
        settings = self.settings
        return self._once(
            "proposals",
            lambda: Proposals(
                self.outbox,
                timedelta(seconds=settings.agent_repeat_window_seconds),
                timedelta(seconds=settings.agent_proposal_ttl_seconds),
            ),
        )

    @property
    def approvals(self) -> Approvals:
        """Staff deciding what agents proposed (the console's proposals page)."""
        return self._once("approvals", lambda: Approvals(self.sessions, self.proposals))

    def approvals_over(self, proposals: Proposals) -> Approvals:
        """Staff deciding over ``proposals`` instead of the runtime's (a caller's own rules)."""
        return Approvals(self.sessions, proposals)

    @property
    def finder(self) -> Finder:
        return self._once("finder", lambda: Finder(self.sessions, self.cadence, self.registry))

    @property
    def overview(self) -> Overview:
        return self._once("overview", lambda: Overview(self.sessions))

    def agent_desk(self, *, tenant: str | None) -> AgentDesk:
        """What the MCP server's tools work with: these sessions, the proposals service and
        each tenant's policy limit; ``tenant`` is the one a stdio server speaks for (None: the
        HTTP transport's API key says)."""
        from settled.mcp_server import AgentDesk  # the MCP SDK: only where agents are served

        return AgentDesk(
            self.sessions,
            self.proposals,
            dict(self.settings.agent_auto_approve_minor),
            tenant=tenant,
            cadence=self.cadence,
        )

    @property
    def wechatpay_notifications(self) -> WechatPayNotifications:
        """What takes WeChat Pay's refund-result notifications (the status API's
        ``/notify/wechatpay/{tenant}``): the settings' merchants, these sessions."""
        from settled.wechatpay_notify import WechatPayNotifications  # FastAPI: web only

        return self._once(
            "wechatpay_notifications",
            lambda: WechatPayNotifications(self.settings, self.sessions),
        )

    def coalescer(self) -> Coalescer:
        """The executor behind a ``Coalescer``: concurrent tasks' hints worked in shared
        batches (``workers.coalesce``). One per runtime, whichever task asks first."""
        return self._once(
            "coalescer",
            lambda: Coalescer(self.executor.execute, runners=2, max_batch=self.executor.max_batch),
        )

    def close(self) -> None:
        """Stop what was built (the coalescer's runners, the executor's and reconciler's
        threads, the gateway's connections) and dispose of the engine when the runtime made
        it."""
        with self._making:
            built = dict(self._built)
        if "coalescer" in built:
            built["coalescer"].close()
        for name in ("executor", "reconciler"):
            if name in built:
                built[name].close()
        close = getattr(built.get("gateway"), "close", None)
        if close is not None:
            close()
        if self._owns_engine:
            self.engine.dispose()


def cadence_of(settings: Settings, registry: KindRegistry) -> Cadence:
    """The reconciler's numbers as ``Runtime.reconciler`` and beat use them."""
    return Cadence(
        review_after=timedelta(seconds=settings.review_after_seconds),
        client_timeout=timedelta(seconds=settings.downstream_timeout),
        reconcile_every=timedelta(seconds=settings.reconcile_seconds),
        contracts={name: registry.get(name).contract for name in registry.names()},
    )


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def check_providers(settings: Settings, registry: KindRegistry) -> None:
    """Raise InvalidSetting for a kind not registered or one its provider cannot serve (the
    kind's ``providers``), and
    for Stripe with no keys (every refund would be refused for want of one), and for Alipay
    without an app, or with a tenant's app id, private key or Alipay public key missing."""
    wrong = sorted(
        name
        for name, provider in settings.downstream_providers.items()
        if name not in registry.names() or provider not in registry.get(name).providers
    )
    if wrong:
        raise InvalidSetting(
            f"SETTLED_DOWNSTREAM_PROVIDERS names kinds its providers cannot serve: {wrong}",
            setting="SETTLED_DOWNSTREAM_PROVIDERS",
        )
    stripe_kinds = sorted(k for k, p in settings.downstream_providers.items() if p == "stripe")
    if stripe_kinds and not settings.stripe_api_keys:
        raise InvalidSetting(
            f"SETTLED_DOWNSTREAM_PROVIDERS sends {stripe_kinds} to Stripe, but "
            "SETTLED_STRIPE_API_KEYS is empty: set each tenant's Stripe secret key",
            setting="SETTLED_STRIPE_API_KEYS",
        )
    wechat_kinds = sorted(k for k, p in settings.downstream_providers.items() if p == "wechatpay")
    if wechat_kinds and not settings.wechatpay_merchants:
        raise InvalidSetting(
            f"SETTLED_DOWNSTREAM_PROVIDERS sends {wechat_kinds} to WeChat Pay, but "
            "SETTLED_WECHATPAY_MERCHANTS is empty: set each tenant's merchant and keys",
            setting="SETTLED_WECHATPAY_MERCHANTS",
        )
    if wechat_kinds and not settings.wechatpay_order_totals:
        raise InvalidSetting(
            f"SETTLED_DOWNSTREAM_PROVIDERS sends {wechat_kinds} to WeChat Pay, but "
            "SETTLED_WECHATPAY_ORDER_TOTALS is not set: name the function (module:function) "
            "that gives an order's total in fen",
            setting="SETTLED_WECHATPAY_ORDER_TOTALS",
        )
    alipay_kinds = sorted(k for k, p in settings.downstream_providers.items() if p == "alipay")
    if alipay_kinds:
        _check_alipay_apps(settings, alipay_kinds)


def order_totals_of(path: str) -> OrderTotals:
    """The function ``SETTLED_WECHATPAY_ORDER_TOTALS`` names (``module:function``)."""
    module, _, name = path.partition(":")
    try:
        found = getattr(importlib.import_module(module), name) if module and name else None
    except (ImportError, AttributeError):
        found = None
    if not callable(found):
        raise InvalidSetting(
            f"SETTLED_WECHATPAY_ORDER_TOTALS={path!r} names no function (module:function)",
            setting="SETTLED_WECHATPAY_ORDER_TOTALS",
        )
    return found  # type: ignore[no-any-return]


def wechatpay_parts(settings: Settings) -> tuple[dict[str, MerchantKeys], OrderTotals]:
    """Each tenant's WeChat Pay keys, read, and the order totals function, imported:
    InvalidSetting naming the setting (and the tenant, never the key) where one cannot be."""
    try:
        keys = {
            tenant: merchant_keys(tenant, merchant)
            for tenant, merchant in settings.wechatpay_merchants.items()
        }
    except UnreadableKey as exc:
        raise InvalidSetting(str(exc), setting="SETTLED_WECHATPAY_MERCHANTS") from None
    return keys, order_totals_of(settings.wechatpay_order_totals or "")


def build_wechatpay_gateway(
    settings: Settings, *, time_seen: TimeSeen | None = None
) -> WechatPayGateway:
    """The WeChat Pay gateway of the settings (``wechatpay_parts``); each verified answer's
    time told to ``time_seen``."""
    keys, totals = wechatpay_parts(settings)
    return WechatPayGateway(
        keys,
        order_totals=totals,
        api_base=settings.wechatpay_api_base,
        timeout=settings.downstream_timeout,
        time_seen=time_seen,
    )


def _check_alipay_apps(settings: Settings, kinds: list[str]) -> None:
    """Every tenant with an Alipay app id has its private key and Alipay's public key, and
    there is at least one (every refund would be refused for want of one)."""
    ids, private, public = (
        settings.alipay_app_ids,
        settings.alipay_private_keys,
        settings.alipay_public_keys,
    )
    if not ids:
        raise InvalidSetting(
            f"SETTLED_DOWNSTREAM_PROVIDERS sends {kinds} to Alipay, but SETTLED_ALIPAY_APP_IDS "
            "is empty: set each tenant's app id, private key and Alipay public key",
            setting="SETTLED_ALIPAY_APP_IDS",
        )
    for name, keys in (
        ("SETTLED_ALIPAY_PRIVATE_KEYS", set(private)),
        ("SETTLED_ALIPAY_PUBLIC_KEYS", set(public)),
    ):
        if keys != set(ids):
            raise InvalidSetting(
                f"{name} must name the tenants of SETTLED_ALIPAY_APP_IDS, "
                f"{sorted(ids)}, not {sorted(keys)}",
                setting=name,
            )
    for tenant in sorted(ids):
        for name, load, text in (
            ("SETTLED_ALIPAY_PRIVATE_KEYS", load_private_key, private[tenant].get_secret_value()),
            ("SETTLED_ALIPAY_PUBLIC_KEYS", load_public_key, public[tenant]),
        ):
            try:
                load(text)
            except ValueError as exc:  # its text names no part of the key
                raise InvalidSetting(f"{name}: tenant {tenant!r}: {exc}", setting=name) from None


def alipay_apps(settings: Settings) -> dict[str, AlipayApp]:
    """Each tenant's Alipay app, from the three settings ``check_providers`` checked."""
    return {
        tenant: AlipayApp(
            app_id, settings.alipay_private_keys[tenant], settings.alipay_public_keys[tenant]
        )
        for tenant, app_id in settings.alipay_app_ids.items()
    }


def _downstream_answered(
    watch: ClockWatch,
    sessions: sessionmaker[Session],
    by: str,
    downstream: str,
    said: datetime,
    resolution: float,
    db_before: datetime,
    db_after: datetime,
) -> None:
    watch.downstream_answered(
        downstream,
        said,
        resolution,
        db_before=db_before,
        db_after=db_after,
        by=by,
        sessions=sessions,
    )


def build_gateway(
    settings: Settings,
    registry: KindRegistry,
    *,
    time_seen: TimeSeen | None = None,
    lag_seen: LagSeen | None = None,
) -> Gateway:
    """The downstream of each kind as configured (``SETTLED_DOWNSTREAM_PROVIDERS``): the wire
    protocol's ``HttpGateway`` unless a kind names ``stripe``, ``wechatpay`` or ``alipay``.
    Every gateway tells ``time_seen`` the time its answers say; the wire protocol's corrects
    each ``Settled-Deadline`` by the lag ``lag_seen`` says (the other providers have no fence).

    Raises InvalidSetting as ``check_providers`` does.
    """
    check_providers(settings, registry)
    http = HttpGateway(
        settings.downstream_url,
        settings.downstream_api_keys,
        timeout=settings.downstream_timeout,
        time_seen=time_seen,
        lag_seen=lag_seen,
    )
    stripe_kinds = [k for k, p in settings.downstream_providers.items() if p == "stripe"]
    wechat_kinds = [k for k, p in settings.downstream_providers.items() if p == "wechatpay"]
    alipay_kinds = [k for k, p in settings.downstream_providers.items() if p == "alipay"]
    if not stripe_kinds and not wechat_kinds and not alipay_kinds:
        return http
    by_kind: dict[str, Gateway] = {}
    if stripe_kinds:
        stripe = StripeGateway(
            settings.stripe_api_keys,
            api_base=settings.stripe_api_base,
            timeout=settings.downstream_timeout,
            time_seen=time_seen,
        )
        by_kind.update(dict.fromkeys(stripe_kinds, stripe))
    if wechat_kinds:
        wechatpay = build_wechatpay_gateway(settings, time_seen=time_seen)
        by_kind.update(dict.fromkeys(wechat_kinds, wechatpay))
    if alipay_kinds:
        alipay = AlipayGateway(
            alipay_apps(settings),
            gateway_url=settings.alipay_gateway_url,
            timeout=settings.downstream_timeout,
            time_seen=time_seen,
        )
        by_kind.update(dict.fromkeys(alipay_kinds, alipay))
    return GatewayByKind(http, by_kind)


class FenceCheck(NamedTuple):
    """One kind's declared deadline fence, probed: where, and what the probe found."""

    kind: str
    url: str
    probe: FenceProbe


def probe_fences(settings: Settings, registry: KindRegistry) -> list[FenceCheck]:
    """Probe the deadline fence of each kind whose contract declares ``enforces_deadline`` and
    which the wire protocol serves (the other providers refuse the declaration:
    ``outbox.settings_contracts``), one kind after the other, through the gateway the kind's
    sends take; the kinds by name."""
    fenced = [
        name
        for name in registry.names()
        if registry.get(name).contract.enforces_deadline
        and settings.downstream_providers.get(name, "http") == "http"
    ]
    if not fenced:
        return []
    with HttpGateway(
        settings.downstream_url, settings.downstream_api_keys, timeout=settings.downstream_timeout
    ) as http:
        return [
            FenceCheck(name, http.endpoint_shown(kind), http.probe_fence(kind))
            for name in sorted(fenced)
            for kind in (registry.get(name),)
        ]


def build_runtime(
    settings: Settings,
    *,
    registry: KindRegistry | None = None,
    gateway: Gateway | None = None,
    sessions: sessionmaker[Session] | None = None,
    **engine_kwargs: Any,
) -> Runtime:
    """The process's runtime from ``settings``: its engine (``engine_kwargs`` for
    ``make_engine``), or the caller's ``sessions`` (their engine stays the caller's); the
    default kinds, or ``registry``, with the settings' contracts applied; each kind's downstream
    as configured, or ``gateway``.

    Raises InvalidSetting as ``check_providers`` does (before anything is built).
    """
    registry = settings.apply_contracts(registry or default_registry())
    if gateway is None:
        check_providers(settings, registry)
    if sessions is not None:
        engine = sessions.kw.get("bind")
        if not isinstance(engine, Engine):
            raise TypeError("build_runtime(sessions=...) takes a sessionmaker bound to an Engine")
        return Runtime(settings, engine, sessions, registry, gateway=gateway, owns_engine=False)
    # No pre-ping: it costs a round trip and a commit per checkout (two per operation). The
    # executor runs a step again when its pooled connection turns out to be dead
    # (``outbox.storage.connection.run_twice``); other users of these sessions fail once and the
    # pool, invalidated by SQLAlchemy on the disconnect, hands out fresh connections after.
    engine_kwargs.setdefault("pool_pre_ping", False)
    engine = make_engine(settings.database_url, **engine_kwargs)
    sessions = sessionmaker(engine, expire_on_commit=False)
    return Runtime(settings, engine, sessions, registry, gateway=gateway)
