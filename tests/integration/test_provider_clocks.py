"""The clock of each provider the simulator plays (Stripe's, WeChat Pay's, Alipay's), measured
through that provider's gateway as the wire protocol's is (``test_downstream_clock``): its
answers say their time in whole seconds only (``Date``; WeChat Pay's signed
``Wechatpay-Timestamp``), set ``BEHIND`` seconds back; the lag is detected, logged once,
recorded and counted, and read by the reconciler's process. A provider set right shows no
episode, though each of its answers rounds its time down by up to a second. (How an episode
ends on whole seconds, at the first answer that shows the lag certainly within the margin:
``tests/unit/test_provider_clocks.py``.)

What a lag changes for a provider's "not found": nothing, by design. None of them enforces
``Settled-Deadline`` (their contracts cannot declare it: ``outbox.settings_contracts``), so a
"not found" waits out their delay bound, a duration no clock of theirs enters
(``reconciler.decide.Situation.quiet_at``); the last test shows the reconciler's own lookup
measuring the lag and trusting the "not found" at the delay bound all the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select

from outbox.clock_steps import ClockWatch
from outbox.models import DownstreamClockLag
from outbox.settings import Settings
from outbox.states import State
from outbox.wire import DATE_RESOLUTION
from reconciler.reconcile import Reconciler
from settled.metrics import registry
from settled.runtime import build_runtime, worker_name
from settled.simulator.stripe import PREFIX as STRIPE_PREFIX
from settled.simulator.wechatpay import PREFIX as WECHATPAY_PREFIX
from tests.integration.test_metrics import scrape
from tests.support.alipay import gateway_url
from tests.support.rig import Rig

#: The provider's clock behind the database's, and the clock margin: a lag beyond the margin by
#: more than a whole second's rounding plus any round trip, so one answer shows it.
BEHIND, MARGIN = 6.0, 1.0
#: A margin a whole second's rounding alone would exceed (a time read as exact, any answer
#: written in the second half of its second would start an episode), for the test that it
#: never does; still above what the database time's estimate may run ahead by (a claim's
#: latency). Sends enough for their answers to span about a second, so some are written there.
SMALL_MARGIN, ANSWERS = 0.5, 20
PROVIDERS = ["stripe", "wechatpay", "alipay"]

pytestmark = [
    pytest.mark.parametrize("engine", ["postgresql"], indirect=True),
    pytest.mark.parametrize("provider_rig", PROVIDERS, indirect=True),
]


def lag_rows(rig: Rig) -> list[tuple[str, float, bool, str]]:
    with rig.sessions() as s:
        rows = s.execute(
            select(
                DownstreamClockLag.downstream,
                DownstreamClockLag.lag_seconds,
                DownstreamClockLag.begins,
                DownstreamClockLag.detected_by,
            ).order_by(DownstreamClockLag.id)
        )
        return [tuple(row) for row in rows]  # type: ignore[misc]


def behind(rig: Rig) -> Callable[[], None]:
    """Set the provider's clock ``BEHIND`` seconds back; what puts it right again."""
    rig.control.advance_clock(-BEHIND)
    return lambda: rig.control.advance_clock(BEHIND)


def test_a_providers_clock_behind_is_detected_logged_recorded_and_counted(
    provider_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig = provider_rig
    reg = registry(rig.sessions)
    assert scrape(reg)[("settled_downstream_clock_lag_episodes_total", ())] == 0
    watch = ClockWatch(margin=MARGIN)
    executor = rig.executor(clock_watch=watch)
    executor.gateway = rig.gateway(time_seen=rig.measured_by(watch, "w1"))
    put_right = behind(rig)
    try:
        with caplog.at_level(logging.INFO, logger="outbox.clock_steps"):
            first = rig.enqueue_on_its_own_order("op-1")
            second = rig.enqueue_on_its_own_order("op-2")
            started = time.monotonic()
            assert executor.execute([first]) == {first: State.SUCCEEDED}
            assert executor.execute([second]) == {second: State.SUCCEEDED}
            # each answer's round trip lies within this; the bound rounds up to a tenth
            slack = time.monotonic() - started + 0.1
    finally:
        put_right()
    # Once per episode: one warning, one row beginning it, one count, over several answers
    # (Stripe's intent read and create are two a send).
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(":")[0] for r in warned] == [
        "downstream clock behind the database's beyond the clock margin"
    ]
    assert warned[0].downstream == "refund"  # type: ignore[attr-defined]
    rows = lag_rows(rig)
    # the episode's beginning, then any growth of its worst bound as answers' rounding varies
    begun = [("refund", n == 0, "w1") for n in range(len(rows))]
    assert [(d, b, by) for d, _, b, by in rows] == begun
    # The bound: the lag, plus the whole second the time was rounded down by and the round trip.
    worst = max(lag for _, lag, _, _ in rows)
    assert BEHIND <= worst <= BEHIND + DATE_RESOLUTION + slack
    assert scrape(reg)[("settled_downstream_clock_lag_episodes_total", ())] == 1
    # The reconciler's process reads what the worker recorded (a watch of its own, fresh).
    with rig.sessions() as s:
        assert ClockWatch(margin=MARGIN).downstream_lag(s, "refund", datetime.now(UTC)) == worst


def test_a_provider_set_right_shows_no_episode_though_its_time_is_rounded_to_the_second(
    provider_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Every answer's time is up to a second earlier than the provider's clock read: its bound
    reaches past the margin, but what is certain of it never does, so no episode begins (even
    with a margin under a second: read as exact, an answer written late in its second would)."""
    rig = provider_rig
    watch = ClockWatch(margin=SMALL_MARGIN)
    executor = rig.executor(clock_watch=watch)
    executor.gateway = rig.gateway(time_seen=rig.measured_by(watch, "w1"))
    ops = [rig.enqueue_on_its_own_order(f"op-{n}") for n in range(ANSWERS)]
    with caplog.at_level(logging.INFO, logger="outbox.clock_steps"):
        started = time.monotonic()
        for op in ops:
            assert executor.execute([op]) == {op: State.SUCCEEDED}
        slack = time.monotonic() - started
    measured = watch.downstreams.worst("refund", since=datetime.fromtimestamp(0, UTC))
    assert measured is not None  # every answer said its time
    assert measured <= DATE_RESOLUTION + slack
    assert not watch.downstreams.beyond("refund")
    assert lag_rows(rig) == []
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_providers_not_found_is_trusted_at_its_delay_bound_though_its_clock_is_behind(
    provider_rig: Rig,
) -> None:
    """The reconciler's own lookup measures the lag; the provider's contract rests on a delay
    bound, not on a fence by its clock, so the "not found" is trusted once that bound passed
    and the operation is sent again with its key."""
    rig = provider_rig
    rig.control.add_rule("reset_before", times=1)  # never executed downstream
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == State.UNKNOWN
    rig.make_quiet(op)
    watch = ClockWatch(margin=MARGIN)
    reconciler = Reconciler(
        sessions=rig.sessions,
        gateway=rig.gateway(time_seen=rig.measured_by(watch, "r1")),
        registry=rig.outbox.registry,
        worker="r1",
        client_timeout=1.0,
        clock_watch=watch,
    )
    put_right = behind(rig)
    try:
        assert reconciler.run_once().outcomes == {"requeued": 1}
    finally:
        put_right()
    assert watch.downstreams.beyond("refund")  # its lookup's answer showed the lag
    assert [(d, b, by) for d, _, b, by in lag_rows(rig)] == [("refund", True, "r1")]
    assert rig.executor().execute([op]) == {op: State.SUCCEEDED}
    assert rig.effects(op) == 1


def test_the_runtimes_provider_gateway_measures_every_answer_for_the_process(
    provider_rig: Rig,
    settings: Settings,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As every process builds it (``build_runtime``, the provider's settings): the worker's
    sends through the provider's gateway are measured by the process's clock watch, and the
    episode recorded under the process's name."""
    rig, mode = provider_rig, request.node.callspec.params["provider_rig"]
    fields: dict[str, Any] = {"downstream_providers": {"refund": mode}}
    tenant = rig.tenant.name
    if mode == "stripe":
        fields.update(
            stripe_api_keys={tenant: rig.tenant.api_key}, stripe_api_base=rig.url + STRIPE_PREFIX
        )
    elif mode == "wechatpay":
        assert rig.wechatpay is not None
        monkeypatch.setenv("SETTLED_WECHATPAY_API_BASE", rig.url + WECHATPAY_PREFIX)
        fields.update(
            wechatpay_merchants={tenant: rig.wechatpay},
            wechatpay_api_base=rig.url + WECHATPAY_PREFIX,
            wechatpay_order_totals="settled.simulator.control:order_total",
        )
    else:
        assert rig.alipay is not None
        fields.update(
            alipay_app_ids={tenant: rig.alipay.app_id},
            alipay_private_keys={tenant: rig.alipay.private_key},
            alipay_public_keys={tenant: rig.alipay.alipay_public_key},
            alipay_gateway_url=gateway_url(rig.url),
        )
    configured = settings.model_copy(
        update={
            "database_url": rig.engine.url.render_as_string(hide_password=False),
            "downstream_timeout": 1.0,
            **fields,
        }
    )
    runtime = build_runtime(configured)
    put_right = behind(rig)
    try:
        op = rig.enqueue_on_its_own_order("op-1")
        started = time.monotonic()
        assert runtime.executor.execute([op]) == {op: State.SUCCEEDED}
        took = time.monotonic() - started  # every answer's round trip lies within it
        assert runtime.clock_watch.downstreams.beyond("refund")
    finally:
        put_right()
        runtime.close()
    rows = lag_rows(rig)
    assert [(d, b, by) for d, _, b, by in rows][:1] == [("refund", True, worker_name())]
    assert BEHIND <= max(lag for _, lag, _, _ in rows) <= BEHIND + DATE_RESOLUTION + took + 0.1
