"""``outbox.FakeGateway`` on its own: the default behaviour (Stripe-like idempotency and a
lookup), scripting, what is remembered downstream, deadlines and the call record."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from outbox import FakeGateway
from outbox.clock import Deadline
from outbox.downstream import (
    MAX_REFERENCE,
    Accepted,
    DownstreamRequest,
    Found,
    Gateway,
    LookupMisuse,
    LookupNotFound,
    Misuse,
    NotExecuted,
    NotSent,
    Receipt,
    Refused,
    SendPhase,
    Unavailable,
    Unknown,
)
from outbox.kinds import default_registry
from outbox.states import RejectReason

REFUND = default_registry().get("refund")
PARAMS = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
LATER = datetime.now(UTC) + timedelta(days=365)


def request(key: str = "k1", **kw: Any) -> DownstreamRequest:
    fields: dict[str, Any] = {"tenant": "acme", "op_id": "op-1", "params": PARAMS, **kw}
    return DownstreamRequest(kind=REFUND, idempotency_key=key, **fields)


def submit(fake: Gateway, key: str = "k1", deadline: Any = LATER, **kw: Any) -> Any:
    return fake.submit(request(key, **kw), deadline=deadline)


def lookup(fake: Gateway, key: str = "k1", deadline: Any = LATER, **kw: Any) -> Any:
    return fake.lookup(request(key, **kw), deadline=deadline)


def test_a_submit_is_accepted_with_a_receipt_of_the_params_sent() -> None:
    fake = FakeGateway()
    outcome = submit(fake)
    assert isinstance(outcome, Accepted)
    assert (outcome.receipt.status, dict(outcome.receipt.params)) == ("succeeded", PARAMS)
    assert outcome.receipt.raw == {"idempotency_key": "k1"}
    assert fake.effects("acme", "k1") == 1


def test_the_same_key_again_answers_the_first_answer_and_does_nothing_again() -> None:
    fake = FakeGateway()
    first = submit(fake)
    assert submit(fake) == first
    assert fake.effects("acme", "k1") == 1
    assert isinstance(submit(fake, "k2"), Accepted)  # another key is another request
    assert submit(fake, "k2") != first


def test_the_same_key_with_other_params_is_an_idempotency_error_and_does_nothing() -> None:
    fake = FakeGateway()
    first = submit(fake)
    other = submit(fake, params={**PARAMS, "amount_minor": 1})
    assert isinstance(other, Misuse) and other.code == "idempotency_error"
    assert submit(fake) == first  # the params it was first sent with: a replay
    assert fake.effects("acme", "k1") == 1


def test_a_scripted_receipt_with_a_reference_settled_cannot_store_is_no_proof() -> None:
    fake = FakeGateway()
    fake.script_submit(Accepted(Receipt("r" * (MAX_REFERENCE + 1), "succeeded", PARAMS)))
    outcome = submit(fake)
    assert isinstance(outcome, Misuse) and outcome.code == "receipt_unreadable"
    assert fake.effects("acme", "k1") == 1  # the downstream did it all the same


def test_an_unreachable_fake_sends_nothing_and_answers_no_lookup() -> None:
    fake = FakeGateway()
    fake.unreachable = True
    outcome = submit(fake)
    assert isinstance(outcome, NotSent) and outcome.phase is SendPhase.CONNECT
    assert isinstance(lookup(fake), Unavailable)
    fake.unreachable = False
    assert isinstance(submit(fake), Accepted) and fake.effects("acme", "k1") == 1


def test_keys_are_per_tenant() -> None:
    fake = FakeGateway()
    submit(fake)
    assert lookup(fake, tenant="other") == LookupNotFound()
    assert fake.effects("other", "k1") == 0


def test_a_lookup_finds_what_a_key_did_and_nothing_else() -> None:
    fake = FakeGateway()
    assert lookup(fake) == LookupNotFound()
    accepted = submit(fake)
    assert lookup(fake) == Found(accepted.receipt)
    assert fake.record("acme", "k1") == Found(accepted.receipt)


def test_a_record_that_differs_from_the_intent_is_a_lookup_mismatch() -> None:
    fake = FakeGateway()
    accepted = submit(fake)
    other = {**PARAMS, "amount_minor": 1}
    mismatch = lookup(fake, params=other)
    assert isinstance(mismatch, LookupMisuse)
    assert (mismatch.code, mismatch.record) == ("receipt_mismatch", accepted.receipt)


def test_scripted_answers_come_in_order_a_keys_own_first_then_the_default() -> None:
    fake = FakeGateway()
    busy = NotExecuted(429, retry_after=2.0)
    fake.script_submit(busy, NotSent("refused"))
    fake.script_submit(Unknown("cut"), key="k2")
    assert submit(fake, "k2") == Unknown("cut")  # its own script first
    assert submit(fake, "k2") == busy  # then the script for every key
    assert submit(fake, "k1") == NotSent("refused")
    assert isinstance(submit(fake, "k1"), Accepted)  # then the default
    fake.script_lookup(Unavailable("down"))
    assert lookup(fake) == Unavailable("down")
    assert isinstance(lookup(fake), Found)


def test_a_refusal_is_on_record_and_replayed_but_has_no_effect() -> None:
    fake = FakeGateway()
    refused = Refused(RejectReason.BUSINESS_REJECTED, "order_closed", 402)
    fake.script_submit(refused)
    assert submit(fake) == refused
    assert submit(fake) == refused  # the same key: the first answer again
    found = lookup(fake)
    assert isinstance(found, Found) and found.receipt.status == "rejected"
    assert (found.reason, found.code) == (RejectReason.BUSINESS_REJECTED, "order_closed")
    assert fake.effects("acme", "k1") == 0


def test_a_refusal_not_executed_leaves_nothing_on_record() -> None:
    fake = FakeGateway()
    fake.script_submit(Refused(RejectReason.PERMISSION_DENIED, "no_api_key", 0), executed=False)
    submit(fake)
    assert lookup(fake) == LookupNotFound()


def test_an_unknown_answer_does_nothing_unless_executed() -> None:
    fake = FakeGateway()
    fake.script_submit(Unknown("reset before processing"))
    fake.script_submit(Unknown("read timeout"), key="k2", executed=True)
    assert submit(fake, "k1") == Unknown("reset before processing")
    assert submit(fake, "k2") == Unknown("read timeout")
    assert lookup(fake, "k1") == LookupNotFound()
    found = lookup(fake, "k2")
    assert isinstance(found, Found) and found.receipt.status == "succeeded"
    assert submit(fake, "k2") == Accepted(found.receipt)  # replayed as the stored success
    assert (fake.effects("acme", "k1"), fake.effects("acme", "k2")) == (0, 1)


def test_nothing_leaves_after_the_deadline() -> None:
    fake = FakeGateway()
    passed = Deadline(datetime.now(UTC), expires=5.0, monotonic=lambda: 10.0)
    assert isinstance(submit(fake, deadline=passed), NotSent)
    assert isinstance(submit(fake, deadline=datetime.now(UTC) - timedelta(seconds=1)), NotSent)
    assert isinstance(lookup(fake, deadline=passed), Unavailable)
    assert fake.effects("acme", "k1") == 0
    assert len(fake.calls) == 3  # still recorded, as calls the code made


def test_every_call_is_recorded_with_what_it_answered() -> None:
    fake = FakeGateway()
    deadline = Deadline(datetime.now(UTC), expires=20.0, monotonic=lambda: 10.0)
    accepted = submit(fake, deadline=deadline)
    lookup(fake, "k9")
    first, second = fake.calls
    assert (first.method, first.tenant, first.kind, first.idempotency_key) == (
        "submit",
        "acme",
        "refund",
        "k1",
    )
    assert (dict(first.params), first.deadline, first.outcome) == (PARAMS, deadline, accepted)
    assert (second.method, second.idempotency_key, second.outcome) == (
        "lookup",
        "k9",
        LookupNotFound(),
    )
    assert fake.submits == [first] and fake.lookups == [second]


def test_one_key_sent_from_many_threads_has_one_effect() -> None:
    fake = FakeGateway()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: submit(fake), range(64)))
    assert len({a.receipt.reference for a in answers}) == 1
    assert fake.effects("acme", "k1") == 1
    assert len(fake.submits) == 64


def test_a_scripted_receipt_is_what_a_lookup_finds() -> None:
    fake = FakeGateway()
    receipt = Receipt("re_42", "succeeded", PARAMS)
    fake.script_submit(Accepted(receipt))
    submit(fake)
    assert lookup(fake) == Found(receipt)


def test_receipts_are_named_by_the_prefix_in_the_order_things_were_done() -> None:
    fake = FakeGateway(reference_prefix="sim")
    first, second = submit(fake, "k1"), submit(fake, "k2")
    assert (first.receipt.reference, second.receipt.reference) == ("sim_1", "sim_2")
    assert submit(fake, "k1").receipt.reference == "sim_1"  # a replay makes no new receipt
    assert fake.record("acme", "k3") is None  # never sent: nothing on record


def test_a_call_past_its_deadline_leaves_the_scripts_for_the_next_call() -> None:
    fake = FakeGateway()
    passed = datetime.now(UTC) - timedelta(seconds=1)
    fake.script_submit(Unknown("cut"))
    fake.script_lookup(Unavailable("down"))
    assert isinstance(submit(fake, deadline=passed), NotSent)
    assert isinstance(lookup(fake, deadline=passed), Unavailable)
    assert submit(fake) == Unknown("cut")  # the call that was made gets the scripted answer
    assert lookup(fake) == Unavailable("down")
    assert lookup(fake) == LookupNotFound()


def test_a_scripted_answer_wins_over_a_replay_and_undoes_nothing() -> None:
    fake = FakeGateway()
    accepted = submit(fake)
    fake.script_submit(Unknown("reset"))
    assert submit(fake) == Unknown("reset")  # the answer was lost this time
    assert lookup(fake) == Found(accepted.receipt)  # what was done stays done, once
    assert fake.effects("acme", "k1") == 1
    assert submit(fake) == accepted  # then the replay again


# -- for simulations: the ledger, requests on the wire, visibility, the fake's own clock -----


class Clock:
    """The fake's clock and the deadlines' monotonic clock, moved by hand."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def within(clock: Clock, seconds: float) -> Deadline:
    return Deadline(LATER, clock.t + seconds, clock)


def test_a_held_request_answers_unknown_and_does_nothing_until_it_lands() -> None:
    clock = Clock()
    fake = FakeGateway(clock=clock)
    fake.hold_submits()
    assert isinstance(submit(fake, deadline=within(clock, 10)), Unknown)
    assert fake.effects_of("acme", "op-1") == 0
    assert isinstance(lookup(fake), LookupNotFound)
    (request,) = fake.in_flight
    assert (request.op_id, request.idempotency_key, request.time_left) == ("op-1", "k1", 10)
    clock.t += 9
    landed = fake.land(request.id)
    assert isinstance(landed, Accepted)
    assert fake.in_flight == []
    (effect,) = fake.ledger
    assert (effect.op_id, effect.idempotency_key, effect.reference, effect.at) == (
        "op-1",
        "k1",
        landed.receipt.reference,
        109.0,
    )
    assert isinstance(lookup(fake), Found)


def test_a_held_request_landing_past_its_deadline_is_refused_where_the_fence_is_kept() -> None:
    clock = Clock()
    fenced, unfenced = FakeGateway(clock=clock), FakeGateway(clock=clock, enforces_deadline=False)
    for fake in (fenced, unfenced):
        fake.hold_submits()
        submit(fake, deadline=within(clock, 10))
    clock.t += 10
    assert isinstance(fenced.land(fenced.in_flight[0].id), NotSent)
    assert fenced.ledger == [] and fenced.record("acme", "k1") is None
    assert isinstance(unfenced.land(unfenced.in_flight[0].id), Accepted)
    assert unfenced.effects_of("acme", "op-1") == 1


def test_a_dropped_request_never_lands_and_a_late_one_replays_its_key() -> None:
    clock = Clock()
    fake = FakeGateway(clock=clock)
    fake.hold_submits(2)
    submit(fake, deadline=within(clock, 10))
    submit(fake, deadline=within(clock, 10))
    first, second = fake.in_flight
    fake.drop(first.id)
    assert [r.id for r in fake.in_flight] == [second.id]
    done = submit(fake, deadline=within(clock, 10))  # the retry, answered
    assert isinstance(done, Accepted)
    assert fake.land(second.id) == done  # the late one: a replay, nothing done again
    assert fake.effects_of("acme", "op-1") == 1 and len(fake.ledger) == 1


def test_a_hold_for_one_key_leaves_the_others_answered() -> None:
    fake = FakeGateway(clock=Clock())
    fake.hold_submits(key="k2")
    assert isinstance(submit(fake, "k1"), Accepted)
    assert isinstance(submit(fake, "k2"), Unknown)
    assert [r.idempotency_key for r in fake.in_flight] == ["k2"]


def test_a_lookup_sees_what_was_done_only_after_the_visibility_delay() -> None:
    clock = Clock()
    fake = FakeGateway(clock=clock, visibility_delay=2.0)
    first = submit(fake)
    assert isinstance(lookup(fake), LookupNotFound)
    assert submit(fake) == first  # a replay of the key sees it at once
    clock.t += 1.9
    assert isinstance(lookup(fake), LookupNotFound)
    clock.t += 0.1
    assert isinstance(lookup(fake), Found)


def test_the_ledger_counts_effects_per_operation_whatever_the_key() -> None:
    fake = FakeGateway()
    submit(fake, "k1")
    submit(fake, "k2")  # the same operation under another key: a second effect
    fake.script_submit(Unknown("reset after commit"), executed=True)
    submit(fake, "k3", op_id="op-2")
    assert fake.effects_of("acme", "op-1") == 2
    assert fake.effects_of("acme", "op-2") == 1
    assert [(e.op_id, e.idempotency_key) for e in fake.ledger] == [
        ("op-1", "k1"),
        ("op-1", "k2"),
        ("op-2", "k3"),
    ]
