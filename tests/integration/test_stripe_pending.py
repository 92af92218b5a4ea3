"""A Stripe refund that is ``pending`` when created settles later: the real executor and
reconciler on a real database (PostgreSQL and SQLite), through the Stripe gateway, against an
in-memory Stripe whose refund the test moves from ``pending`` to where Stripe takes it.

``pending`` proves the refund was taken on, not made (it may still fail): the operation stays
uncertain and is looked up, never sent again, until the refund is ``succeeded`` (done) or
``failed`` / ``canceled`` (not done: rejected). The simulator's Stripe mode makes every refund
at once, so this in-memory Stripe stands in for the refund's later life.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import ReviewConflict
from outbox.intake import Outbox
from outbox.models import Operation, OperationEvent, ReviewItem
from outbox.states import State
from reconciler.reconcile import Reconciler
from support.review import ReviewQueue
from support.staff import Staff
from workers.executor import Executor
from workers.stripe_gateway import StripeGateway

BOSS = Staff.parse("bob", "supervisor")
PARAMS = {"order_id": "pi_3Nx", "amount_minor": 1500, "currency": "EUR", "payee": "P-7"}


class PendingStripe:
    """Stripe's refunds API in memory: one refund per idempotency key, created ``pending``."""

    def __init__(self) -> None:
        self.refunds: dict[str, dict[str, Any]] = {}  # by idempotency key
        self.creates = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.creates += 1
            key = request.headers["Idempotency-Key"]
            form = dict(httpx.QueryParams(request.content.decode()))
            metadata = {k[9:-1]: v for k, v in form.items() if k.startswith("metadata[")}
            refund = self.refunds.setdefault(
                key,
                {
                    "id": f"re_{len(self.refunds) + 1}",
                    "object": "refund",
                    "amount": int(form["amount"]),
                    "currency": "eur",
                    "payment_intent": form["payment_intent"],
                    "metadata": metadata,
                    "status": "pending",
                },
            )
            return httpx.Response(200, json=refund)
        if request.url.path.startswith("/v1/payment_intents/"):  # read before each create
            intent = request.url.path.rsplit("/", 1)[-1]
            return httpx.Response(
                200, json={"id": intent, "object": "payment_intent", "currency": "eur"}
            )
        listed = list(self.refunds.values())
        return httpx.Response(200, json={"object": "list", "has_more": False, "data": listed})

    def settle(self, status: str) -> None:
        for refund in self.refunds.values():
            refund["status"] = status


@pytest.fixture
def stripe() -> PendingStripe:
    return PendingStripe()


@pytest.fixture
def gateway(stripe: PendingStripe) -> Iterator[StripeGateway]:
    gateway = StripeGateway(
        {"acme": SecretStr("sk_test_abc")},
        api_base="http://stripe.test",
        transport=httpx.MockTransport(stripe),
    )
    yield gateway
    gateway.close()


@pytest.mark.parametrize(
    ("settled_as", "state", "reason"),
    [
        ("succeeded", State.SUCCEEDED, None),
        ("failed", State.REJECTED, "business_rejected"),
        ("canceled", State.REJECTED, "business_rejected"),
    ],
)
def test_a_pending_refund_stays_uncertain_until_stripe_settles_it(
    engine: Engine,
    outbox: Outbox,
    stripe: PendingStripe,
    gateway: StripeGateway,
    settled_as: str,
    state: State,
    reason: str | None,
) -> None:
    sessions = sessionmaker(engine, expire_on_commit=False)
    with sessions.begin() as s:
        op = outbox.enqueue(s, tenant="acme", op_id="op-1", kind="refund", params=PARAMS)
        op_id = op.operation.id
    executor = Executor(
        sessions=sessions,
        gateway=gateway,
        registry=outbox.registry,
        fingerprinter=outbox.fingerprinter,
        worker="w1",
        rand=lambda: 0.0,
    )
    reconciler = Reconciler(
        sessions=sessions, gateway=gateway, registry=outbox.registry, worker="r1"
    )
    assert executor.execute([op_id]) == {op_id: State.UNKNOWN}  # taken on, not made
    assert executor.execute([op_id]) == {}  # uncertain blocks every new send
    _make_due(sessions, op_id)
    assert reconciler.run_once().outcomes == {"lookup_unavailable": 1}  # still pending
    assert _row(sessions, op_id).state == "unknown"
    stripe.settle(settled_as)
    _make_due(sessions, op_id)
    assert reconciler.run_once().outcomes == {"found": 1}
    row = _row(sessions, op_id)
    assert (row.state, row.reason) == (state.value, reason)
    assert row.receipt is not None and row.receipt["reference"] == "re_1"
    assert stripe.creates == 1  # looked up, never sent again
    with sessions() as s:
        path = s.execute(
            select(OperationEvent.from_state, OperationEvent.to_state)
            .where(OperationEvent.operation_id == op_id)
            .order_by(OperationEvent.id)
        ).all()
        assert s.scalars(select(ReviewItem)).all() == []
    assert [tuple(step) for step in path][-2:] == [
        ("unknown", "unknown"),
        ("unknown", state.value),
    ]


def _make_due(sessions: sessionmaker[Session], op_id: int) -> None:
    with sessions.begin() as s:
        s.execute(
            update(Operation)
            .where(Operation.id == op_id)
            .values(next_attempt_at=datetime.now(UTC) - timedelta(seconds=1))
        )


def _row(sessions: sessionmaker[Session], op_id: int) -> Operation:
    with sessions() as s:
        row = s.get(Operation, op_id)
        assert row is not None
        return row


def test_a_refund_pending_past_the_review_time_cannot_be_resolved_by_anyone_until_it_settles(
    engine: Engine, outbox: Outbox, stripe: PendingStripe, gateway: StripeGateway
) -> None:
    """Staff who marked a pending refund rejected would let the app refund again, and then
    Stripe completes the first: review offers nothing, and refuses even a supervisor's
    override, until Stripe has settled it; then requery settles it by its record."""
    sessions = sessionmaker(engine, expire_on_commit=False)
    with sessions.begin() as s:
        op_id = outbox.enqueue(s, tenant="acme", op_id="op-1", kind="refund", params=PARAMS)
        op_id = op_id.operation.id
    executor = Executor(
        sessions=sessions, gateway=gateway, registry=outbox.registry,
        fingerprinter=outbox.fingerprinter, worker="w1", rand=lambda: 0.0,
    )  # fmt: skip
    reconciler = Reconciler(
        sessions=sessions, gateway=gateway, registry=outbox.registry, worker="r1",
        review_after=0.001,
    )  # fmt: skip
    assert executor.execute([op_id]) == {op_id: State.UNKNOWN}
    _make_due(sessions, op_id)
    reconciler.run_once()
    with sessions() as s:
        (item,) = s.scalars(select(ReviewItem)).all()
    queue = ReviewQueue(sessions, gateway, outbox.registry)
    shown = queue.show(BOSS, item.id)
    assert (shown["last_lookup"], shown["choices"]) == ("pending", [])
    for outcome in ("rejected", "succeeded"):
        with pytest.raises(ReviewConflict) as refused:
            queue.resolve(
                BOSS, item.id, outcome=outcome, version=shown["item"]["version"],
                reference="re_1", justification="the customer says it never arrived",
                override=True,
            )  # fmt: skip
        assert refused.value.code == "downstream_pending"
    assert _row(sessions, op_id).state == "unknown"
    stripe.settle("failed")
    assert queue.requery(BOSS, item.id)["lookup"] == "found"
    row = _row(sessions, op_id)
    assert (row.state, row.reason) == ("rejected", "business_rejected")
    assert stripe.creates == 1
