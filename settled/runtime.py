"""The composition root of a worker, beat or web process: built once from settings.

Every service is built here and nowhere else (``build_runtime``; the web process, which needs
only the review queue of it, ``build_review``), so that the worker, beat, the console and the
command line ask the same downstream of each kind (``build_gateway``).
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.clock_steps import ClockWatch
from outbox.db import make_engine
from outbox.downstream import Gateway, as_gateway
from outbox.errors import InvalidSetting
from outbox.intake import Outbox
from outbox.kinds import KindRegistry, default_registry
from outbox.settings import Settings
from reconciler.reconcile import Reconciler
from support.review import ReviewQueue
from workers.coalesce import Coalescer
from workers.executor import Executor
from workers.http_client import HttpGateway
from workers.routing import GatewayByKind
from workers.stripe_gateway import StripeGateway


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    registry: KindRegistry
    outbox: Outbox
    gateway: Gateway
    executor: Executor
    reconciler: Reconciler
    review: ReviewQueue
    #: made on first use (``coalescer``): only a worker on the thread pool batches hints
    _coalescer: Coalescer | None = None
    _making: threading.Lock = field(default_factory=threading.Lock)

    def coalescer(self) -> Coalescer:
        """The executor behind a ``Coalescer``: concurrent tasks' hints worked in shared
        batches (``workers.coalesce``). One per runtime, whichever task asks first."""
        with self._making:
            if self._coalescer is None:
                self._coalescer = Coalescer(
                    self.executor.execute, runners=2, max_batch=self.executor.max_batch
                )
            return self._coalescer

    def close(self) -> None:
        if self._coalescer is not None:
            self._coalescer.close()
        self.executor.close()
        self.reconciler.close()
        close = getattr(self.gateway, "close", None)
        if close is not None:
            close()
        self.engine.dispose()


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


#: The kinds each provider other than ``http`` can serve.
PROVIDER_KINDS = {"stripe": frozenset({"refund"})}


def check_providers(settings: Settings, registry: KindRegistry) -> None:
    """Raise InvalidSetting for a kind not registered or one its provider cannot serve, and
    for Stripe with no keys (every refund would be refused for want of one)."""
    wrong = sorted(
        name
        for name, provider in settings.downstream_providers.items()
        if name not in registry.names()
        or (provider != "http" and name not in PROVIDER_KINDS[provider])
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


def build_gateway(settings: Settings, registry: KindRegistry) -> Gateway:
    """The downstream of each kind as configured (``SETTLED_DOWNSTREAM_PROVIDERS``): the wire
    protocol's ``HttpGateway`` unless a kind names ``stripe``.

    Raises InvalidSetting as ``check_providers`` does.
    """
    check_providers(settings, registry)
    http = HttpGateway(
        settings.downstream_url, settings.downstream_api_keys, timeout=settings.downstream_timeout
    )
    stripe_kinds = [k for k, p in settings.downstream_providers.items() if p == "stripe"]
    if not stripe_kinds:
        return http
    stripe = StripeGateway(
        settings.stripe_api_keys,
        api_base=settings.stripe_api_base,
        timeout=settings.downstream_timeout,
    )
    return GatewayByKind(http, dict.fromkeys(stripe_kinds, stripe))


def build_review(
    settings: Settings,
    sessions: sessionmaker[Session],
    *,
    registry: KindRegistry | None = None,
    gateway: Gateway | None = None,
    watch: ClockWatch | None = None,
) -> ReviewQueue:
    """The review queue staff work (the console, ``settled review``) over ``sessions``: its
    lookups go to each kind's downstream as the worker's do (``build_gateway``), or through
    ``gateway``. ``registry`` has the settings' contracts applied already (default: the
    default kinds with them). ``watch`` is the process's watch on the database's clock (default:
    one of its own, from the settings).

    Raises InvalidInput as ``build_gateway`` does.
    """
    if registry is None:
        registry = settings.apply_contracts(default_registry())
    if gateway is None:
        gateway = build_gateway(settings, registry)
    if watch is None:
        watch = ClockWatch(margin=settings.clock_margin_seconds, window=settings.clock_step_window)
    return ReviewQueue(
        sessions, gateway, registry, lookup_timeout=settings.downstream_timeout, clock_watch=watch
    )


def build_runtime(
    settings: Settings,
    *,
    registry: KindRegistry | None = None,
    gateway: Gateway | None = None,
    **engine_kwargs: Any,
) -> Runtime:
    registry = settings.apply_contracts(registry or default_registry())
    # No pre-ping: it costs a round trip and a commit per checkout (two per operation). The
    # executor runs a step again when its pooled connection turns out to be dead
    # (``outbox.storage.connection.run_twice``); other users of these sessions fail once and the
    # pool, invalidated by SQLAlchemy on the disconnect, hands out fresh connections after.
    engine_kwargs.setdefault("pool_pre_ping", False)
    engine = make_engine(settings.database_url, **engine_kwargs)
    sessions = sessionmaker(engine, expire_on_commit=False)
    outbox = Outbox.from_settings(settings, registry)
    if gateway is None:
        gateway = build_gateway(settings, registry)
    gateway = as_gateway(gateway, stacklevel=2)  # told once for every service: an old-style one
    # One watch on the database's clock for the process: a step any service sees is honoured
    # by all of them (and recorded for the other processes).
    watch = ClockWatch(margin=settings.clock_margin_seconds, window=settings.clock_step_window)
    executor = Executor(
        sessions=sessions,
        gateway=gateway,
        registry=registry,
        fingerprinter=outbox.fingerprinter,
        worker=worker_name(),
        lease_seconds=settings.lease_seconds,
        batch_extra=settings.claim_batch,
        clock_margin=settings.clock_margin_seconds,
        max_tries=settings.retry_max_tries,
        clock_watch=watch,
    )
    reconciler = Reconciler(
        sessions=sessions,
        gateway=gateway,
        registry=registry,
        worker=worker_name(),
        lease_seconds=settings.lease_seconds,
        client_timeout=settings.downstream_timeout,
        review_after=settings.review_after_seconds,
        clock_watch=watch,
    )
    review = build_review(settings, sessions, registry=registry, gateway=gateway, watch=watch)
    return Runtime(
        settings, engine, sessions, registry, outbox, gateway, executor, reconciler, review
    )
