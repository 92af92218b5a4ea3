"""The protocol model: the real rules hold in every reachable state of small configurations,
and every broken variant of them is caught with a readable counterexample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any

import httpx
import pytest

import tests.model.protocol as protocol
from outbox.downstream import Misuse, NotExecuted, Unknown
from outbox.kinds import Kind
from outbox.states import State
from outbox.storage.attempts import OperationFacts, facts_of
from reconciler.decide import Situation, situation_of
from tests.model.__main__ import CI, controls, jobs
from tests.model.engine import explore
from tests.model.protocol import (
    ANSWERS,
    ASSUMPTIONS,
    TICK,
    VARIANTS,
    Attempt,
    Config,
    Op,
    ProtocolModel,
    Rec,
    Request,
    Worker,
    World,
)

#: Smaller configurations than the CI set's, for the test run: the CI set itself runs once, in
#: ``python -m tests.model`` (``test_no_small_configuration_is_one_of_the_ci_set``).
SMALL = {
    "fenced": Config(name="fenced", lease=1, deadline=2),
    "delay-bound": Config(name="delay-bound", enforces_deadline=False, lease=1, deadline=2),
    "refusals": Config(name="refusals", refusals=True, lease=1, deadline=2, cancel=False),
    "fenced-downstream-behind": Config(
        name="fenced-downstream-behind",
        downstream_lag=11,
        lease=1,
        deadline=2,
        throttle=False,
        staff=False,
        cancel=False,
    ),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_real_rules_hold_in_every_reachable_state(name: str) -> None:
    result = explore(ProtocolModel(SMALL[name]))
    assert result.violation is None, result.violation.render()
    assert result.figures.exhaustive and result.figures.states > 1000


def test_no_small_configuration_is_one_of_the_ci_set() -> None:
    ci = {replace(c, name="") for c in CI}
    assert [n for n, c in SMALL.items() if replace(c, name="") in ci] == []


def test_a_counterexample_names_each_step_its_decision_and_the_ledger() -> None:
    broken = explore(ProtocolModel(replace(VARIANTS["not_found_before_quiescence"][1],
                                           variant="not_found_before_quiescence")))  # fmt: skip
    assert broken.violation is not None
    text = broken.violation.render()
    assert "VIOLATION in protocol[not_found_before_quiescence]" in text
    assert "reconciler: op0: decide(lookup=not_found)" in text
    assert "code=requeued" in text and "quiet_at=t3" in text
    assert "downstream: t0 succeeded" in text  # the ledger, in the state after each step


def test_the_run_explores_every_variant_its_control_and_every_assumption() -> None:
    # ``python -m tests.model`` is the one run of these explorations (scripts/test.sh): here,
    # that it leaves none out.
    listed = jobs(long=False)
    assert [n for what, n in listed if what == "variant"] == list(VARIANTS)
    assert [n for what, n in listed if what == "assumption"] == list(ASSUMPTIONS)
    assert [n for what, n in listed if what == "config"] == [c.name for c in CI]
    explored = {replace(c, name="") for c in CI} | {
        replace(c, name="", variant=None) for c in controls().values()
    }
    for name, (_, config) in VARIANTS.items():
        assert replace(config, name="") in explored, f"{name}'s configuration is not explored"
    assert set(controls()) == {n for what, n in listed if what == "control"}


def test_the_ci_set_has_two_workers_the_reconciler_staff_and_a_cancel() -> None:
    assert all(c.workers == 2 and c.reconciler and c.staff and c.cancel for c in CI)


def test_a_fenced_request_cannot_land_after_its_deadline_by_the_downstream_clock() -> None:
    m = ProtocolModel(Config())
    op = Op(State.UNKNOWN, attempts=(Attempt(0, 2),))
    # its Settled-Deadline: the lease's end (t2) less the clock margin, in seconds
    fence = int(m.when(2).timestamp()) - 1
    w = World(t=0, ops=(op,), workers=(), rec=Rec(), network=(Request(0, 0, fence),),
              ledger=((),))  # fmt: skip
    assert m._can_land(w, w.network[0], 2)  # t2 - 1 s: the downstream's clock may lag 1 s
    assert not m._can_land(w, w.network[0], 3)


def test_a_lookup_sees_a_landing_only_once_visible_and_while_the_key_is_kept() -> None:
    m = ProtocolModel(Config(retention=4))
    w = World(t=0, ops=(Op(),), workers=(), rec=Rec(),
              ledger=(((1, "succeeded"),),))  # fmt: skip
    assert [m.lookup(w, 0, t) for t in (1, 2, 4, 5)] == [
        "not_found",
        "found:succeeded",
        "found:succeeded",
        "not_found",  # forgotten: four points after it landed
    ]


def _only(monkeypatch: pytest.MonkeyPatch, variants: dict[str, Any]) -> None:
    """The runner with these variants and nothing else to explore."""
    import tests.model.__main__ as runner
    import tests.model.approvals as approvals

    monkeypatch.setattr(protocol, "VARIANTS", variants)
    monkeypatch.setattr(runner, "VARIANTS", variants)
    monkeypatch.setattr(runner, "CI", ())
    monkeypatch.setattr(runner, "ASSUMPTIONS", {})
    monkeypatch.setattr(approvals, "CONFIGURATIONS", {})
    monkeypatch.setattr(approvals, "VARIANTS", {})


def test_the_command_fails_on_a_variant_it_does_not_catch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tests.model.__main__ as runner

    # "broken" in name only: the real rules, which the checker cannot catch
    _only(
        monkeypatch,
        {
            "not_broken": (
                protocol.Rules(),
                Config(workers=1, staff=False, cancel=False, lease=1, deadline=1, throttle=False),
            )
        },
    )
    assert runner.main([]) == 1
    out = capsys.readouterr().out
    assert "variant not_broken NOT CAUGHT" in out and "model: FAILED" in out


def test_the_command_fails_when_the_real_rules_break_in_a_variants_configuration(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tests.model.__main__ as runner

    # a "variant" caught in a world where the real rules break too proves nothing: the
    # configuration without one of the contract's assumptions, where they must break
    world = ASSUMPTIONS["visible_later_than_the_processing_time"]
    _only(monkeypatch, {"in_a_broken_world": (protocol.Rules(), world)})
    assert runner.main(["--jobs", "2"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION in control of in_a_broken_world" in out
    assert "model: FAILED" in out


def test_a_step_of_the_database_clock_is_seen_by_the_real_detector_and_recorded() -> None:
    m = ProtocolModel(Config(clock_steps=(1, -1)))
    w = next(iter(m.initial()))
    stepped = {nxt.off: nxt for step, nxt in m._db_clock(w)}
    assert sorted(stepped) == [-1, 1]
    # seen at the reading after the step: distrust for the window (the lease, two points)
    assert stepped[1].doubt_until == m.when(1) + 2 * TICK
    assert stepped[-1].doubt_until == m.when(-1) + 2 * TICK
    assert not list(m._db_clock(stepped[1]))  # once at most
    unseen = ProtocolModel(Config(clock_steps=(1,), step_seen=False))
    assert [nxt.doubt_until for _, nxt in unseen._db_clock(w)] == [None]


def test_after_a_forward_step_a_sender_measures_its_lease_from_its_claim() -> None:
    m = ProtocolModel(Config(clock_steps=(1,), enforces_deadline=False))
    op = Op(State.SUBMITTED, lease_end=2, tries=1, first_sent=0, attempts=(Attempt(0, 2),))
    claimed = Worker("claimed", 0, True, 0, off=0)
    # true t1, the database's clock set forward to t2: the lease looks over in database time
    w = World(t=1, ops=(op,), workers=(claimed,), rec=Rec(), ledger=((),), off=1)
    assert m._lease_free(op, m.now(w)) is False and m._lease_free(op, m.now(w) + 1)
    step, sent = m._send(w, claimed)
    assert "the request leaves" in step.action  # its monotonic clock says t1: time left
    (request,) = sent.network
    assert request.until == 2  # its lease, in true time: it may land by t3 (delay bound)
    assert m._can_land(sent, request, 3) and not m._can_land(sent, request, 4)
    # the reconciler reads t4 at true t3: quiet by the attempt's times, not by the clock watch
    s = m.situation(replace(sent, doubt_until=m.when(2) + 2 * TICK), 0, State.UNKNOWN, 4, 4)
    assert s.quiet_at == m.when(4) and s.clock_trusted_at == m.when(6)


def test_the_reconciler_measures_the_downstreams_lag_as_the_product_does() -> None:
    """From its lookup's answer: the world's lag, through ``lag_of`` and ``DownstreamClocks``
    (a forward step of the database's clock, which the downstream follows, changes nothing);
    a downstream that says no time is not measured."""
    model = ProtocolModel(Config(downstream_lag=11, clock_steps=(1,)))
    world = next(iter(model.initial()))
    assert model.measured_lag(replace(world, t=2), 1) == 11
    assert model.measured_lag(replace(world, t=2, off=1), 2) == 11
    unmeasured = ProtocolModel(Config(world_slew=11))
    assert unmeasured.measured_lag(replace(world, t=2), 1) is None


def test_a_request_lands_at_the_last_instant_its_fence_allows_between_two_points() -> None:
    m = ProtocolModel(Config())
    op = Op(State.UNKNOWN, attempts=(Attempt(0, 1, 1, "unknown", "unknown"),))
    # a Settled-Deadline half a second past t1: the downstream (1 s behind) takes it until
    # t1 + 1.5 s, and it is visible a point and a half later
    fence = m.when(1).timestamp() + 0.5
    w = World(t=1, ops=(op,), workers=(), rec=Rec(), network=(Request(0, 0, fence),),
              ledger=((),))  # fmt: skip
    assert m._late(w, w.network[0], 1) == pytest.approx(0.15, abs=0.002)
    landings = [nxt.ledger[0] for step, nxt in m._network(w) if "executed" in step.action]
    assert [at for ((at, _),) in landings] == [1, pytest.approx(1.15, abs=0.002)]
    late = replace(w, ledger=(landings[1],))
    assert [m.lookup(late, 0, t) for t in (2, 3)] == ["not_found", "found:succeeded"]
    # the real rules' bound (the lease's end less the margin) lands on the point: no fraction
    real = replace(w, network=(Request(0, 0, m.when(1).timestamp() - 1),))
    assert m._late(real, real.network[0], 1) == 0.0


def test_the_downstreams_answers_are_read_by_the_real_classifier_as_they_prove() -> None:
    m = ProtocolModel(Config())
    outcomes = {code: m._outcome(0, code) for code in ANSWERS}
    assert {code: outcome.proof for code, outcome in outcomes.items()} == ANSWERS
    assert isinstance(outcomes["in_use"], Unknown) and outcomes["in_use"].status == 409
    assert isinstance(outcomes["not_executed"], NotExecuted)
    assert isinstance(outcomes["misuse"], Misuse) and outcomes["misuse"].status == 400
    mismatch = outcomes["mismatch"]
    assert isinstance(mismatch, Misuse) and mismatch.code == "receipt_mismatch"


def _no_margin(lease_until: datetime, deadline: datetime, clock_margin: float) -> datetime:
    return min(deadline, lease_until)


def _dated_now(**values: Any) -> Situation:
    return situation_of(**{**values, "claimed_at": values["now"]})


def _outcome_only(unknown_since: Any, lookups: int, in_review: bool, times: Any) -> OperationFacts:
    facts = facts_of(unknown_since, lookups, in_review, times)
    return replace(facts, sends=tuple((start, end) for start, _, end in times))


_classify_submit = protocol.classify_submit


def _misuse_unknown(response: httpx.Response, kind: Kind, params: Any, **kw: Any) -> Any:
    if response.status_code == 400:
        return Unknown("idempotency error", 400)
    return _classify_submit(response, kind, params, **kw)


@pytest.mark.parametrize(
    ("name", "broken", "variant"),
    [
        ("send_bound", _no_margin, "send_bound_without_the_clock_margin"),
        ("situation_of", _dated_now, "not_found_dated_when_answered"),
        ("facts_of", _outcome_only, "attempt_end_not_bounded_by_its_lease"),
        ("classify_submit", _misuse_unknown, "idempotency_error_read_as_unknown"),
    ],
)
def test_a_broken_product_builder_changes_what_the_checker_explores(
    monkeypatch: pytest.MonkeyPatch, name: str, broken: Callable[..., Any], variant: str
) -> None:
    # the real rules, with the product's function swapped where the model calls it; the
    # real rules with the real function hold in this configuration: the variant's control,
    # explored by ``python -m tests.model`` (``test_the_run_explores_every_variant...``)
    config = VARIANTS[variant][1]
    explored = {replace(c, name="", variant=None) for c in (*CI, *controls().values())}
    assert replace(config, name="", variant=None) in explored
    monkeypatch.setattr(protocol, name, broken)
    assert explore(ProtocolModel(config)).violation is not None
