"""The world a deterministic simulation drives: the real services over a real database and the
shipped ``FakeGateway``, with time the simulation moves (``tests/integration/test_simulation``).

Time. The database's clock cannot be set, so the simulation moves everything else instead:
``World.advance(s)`` moves every timestamp stored in the database ``s`` seconds into the past
(leases end, due times come, attempts grow old: as if the database's clock had run ``s``
seconds) and moves the downstream's clock (the fake's ``clock``) ``s`` seconds on. No service is
in the middle of a call when time moves, except a worker paused at a failpoint, which sees the
pause on its own monotonic clock (``pause``). A step of the database's clock (``skew_to``) moves
the stored timestamps only, the downstream's clock staying where it was, the two clocks
always within the clock margin of each other (the contract's assumption): a step no watch can
see, and which the protocol must survive.

What this abstracts: a paused worker's clock runs on by the whole pause while the database's
stored times were moved back instead, so the times it writes after resuming (an outcome's,
a retry's due time) come out up to the pause later than a real one's: later quiescence and
later retries, the cautious side. Lookups take no time, so a "not found" is answered when it
is asked (the model checker explores answers that come back later).

The judge is the fake's ledger (``FakeGateway.ledger``): what the downstream really did.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, literal_column, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from outbox import runs
from outbox.downstream import NotExecuted, NotSent, Refused, Unavailable, Unknown
from outbox.intake import Outbox
from outbox.models import Base, Operation, Proposal, ReviewItem, Run, UTCDateTime
from outbox.proposals import Proposals, auto_approvable
from outbox.report_lines import Group
from outbox.states import RejectReason, State
from outbox.storage.operations import find_operation
from outbox.storage.search import operations_on_orders
from outbox.testing import FakeGateway, InFlight
from reconciler.reconcile import Reconciler
from support.review import ReviewQueue
from workers.executor import Executor

TENANT = "acme"
PARAMS = {"amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
#: the orders refunds are made on: the app's and an agent's can meet on one
ORDERS = ("A1000", "A1001")
#: the tenant's policy approves an agent's refund up to this amount by itself
POLICY_LIMIT = 20000
POLICY = "policy:auto_approve"

#: what the next submit meets downstream (``World.script``)
SUBMIT_FATES = (
    "answered",  # carried out, answered
    "held",  # on the wire: the sender hears nothing; lands later, or never
    "answer_lost",  # carried out, the answer lost (a reset after commit)
    "refused",  # a definite refusal
    "throttled",  # 429: not executed
    "not_sent",  # connection refused
    "unknown_not_done",  # a 502 from a proxy: nothing done, the sender cannot tell
)


def empty(engine: Engine) -> None:
    """Every table emptied (a fresh database for each example)."""
    tables = [t.name for t in Base.metadata.sorted_tables]
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
        else:
            for name in reversed(tables):
                conn.execute(text(f"DELETE FROM {name}"))


def shift(engine: Engine, seconds: float) -> None:
    """Move every stored timestamp ``seconds`` into the past (negative: into the future)."""
    delta = timedelta(seconds=seconds)
    with engine.begin() as conn:
        for table in Base.metadata.sorted_tables:
            columns = [c for c in table.columns if isinstance(c.type, UTCDateTime)]
            if not columns:
                continue
            if engine.dialect.name == "postgresql":
                moved = f"interval '{seconds:.6f} seconds'"  # a float of ours: no injection
                conn.execute(
                    update(table).values(
                        {c.name: literal_column(f"{c.name} - {moved}") for c in columns}
                    )
                )
                continue
            keys = list(table.primary_key.columns)
            for row in conn.execute(select(*keys, *columns)).mappings():
                moved = {c.name: row[c.name] - delta for c in columns if row[c.name] is not None}
                if moved:
                    where = [k == row[k.name] for k in keys]
                    conn.execute(update(table).where(*where).values(moved))


@dataclass
class Figures:
    """What the simulation covered, per database."""

    examples: int = 0
    steps: int = 0
    effects: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    states: Counter[str] = field(default_factory=Counter)

    def line(self, database: str) -> str:
        top = ", ".join(f"{k} {v}" for k, v in self.rules.most_common())
        ends = ", ".join(f"{k} {v}" for k, v in sorted(self.states.items()))
        return (
            f"simulation [{database}]: {self.examples} examples, {self.steps} steps, "
            f"{self.effects} effects; ended: {ends}; rules: {top}"
        )


class SimClock:
    """The downstream's clock, in seconds, moved by the simulation only."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class World:
    """A database, the outbox, the fake downstream and the services, for one example."""

    engine: Engine
    outbox: Outbox
    visibility_delay: float = 0.0
    lease_seconds: float = 15.0
    #: unknown for this long, an operation goes to review (short: staff get to work on it)
    review_after: float = 30.0
    clock: SimClock = field(default_factory=SimClock)
    #: how far the database's clock runs ahead of the downstream's (``skew_to``)
    skew: float = 0.0
    #: operation ids (rows) by op_id, in enqueue order
    ops: dict[str, int] = field(default_factory=dict)
    #: run handles
    handles: list[str] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        empty(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.contract = self.outbox.registry.get("refund").contract
        self.fake = FakeGateway(
            clock=self.clock,
            visibility_delay=self.visibility_delay,
            enforces_deadline=self.contract.enforces_deadline,
        )

    # -- services, built afresh for each pass (a process with no memory of the last) --------

    def executor(self, worker: str, monotonic: Callable[[], float] = time.monotonic) -> Executor:
        return Executor(
            sessions=self.sessions,
            gateway=self.fake,
            registry=self.outbox.registry,
            fingerprinter=self.outbox.fingerprinter,
            worker=worker,
            lease_seconds=self.lease_seconds,
            rand=lambda: 0.0,
            monotonic=monotonic,
        )

    def reconciler(self) -> Reconciler:
        return Reconciler(
            sessions=self.sessions,
            gateway=self.fake,
            registry=self.outbox.registry,
            worker="r1",
            lease_seconds=self.lease_seconds,
            client_timeout=1.0,
            review_after=self.review_after,
            # as the runtime builds it: what a "not found" cannot settle yet is sent again
            # with the same key, by an executor under the reconciler's claim
            resender=self.executor("r1-resend"),
        )

    def review(self) -> ReviewQueue:
        return ReviewQueue(self.sessions, self.fake, self.outbox.registry, lookup_timeout=1.0)

    # -- the app -----------------------------------------------------------------------------

    def open_run(self) -> str:
        with self.sessions.begin() as s:
            handle = runs.open_run(s, tenant=TENANT).handle
        self.handles.append(handle)
        return handle

    def enqueue(self, handle: str | None, order: str) -> str:
        op_id = f"op-{len(self.ops) + 1}"
        with self.sessions.begin() as s:
            run = runs.find_run(s, TENANT, handle) if handle is not None else None
            params = {**PARAMS, "order_id": order}
            got = self.outbox.enqueue(
                s, tenant=TENANT, op_id=op_id, kind="refund", params=params, run=run
            )
            self.ops[op_id] = got.operation.id
        return op_id

    def cancel(self, handle: str) -> None:
        with self.sessions.begin() as s:
            runs.cancel_run(s, TENANT, handle, actor="app")
        self.cancelled.add(handle)

    @property
    def live_runs(self) -> list[str]:
        """The runs not cancelled."""
        return [h for h in self.handles if h not in self.cancelled]

    # -- an agent's proposals ----------------------------------------------------------------

    def propose(self, order: str, amount: int) -> bool:
        """An agent asks for a refund on ``order``; the tenant's policy approves it by itself
        where it may (as the MCP server does, in the same transaction). Returns whether the
        policy approved it; raises AssertionError where it approved a second refund."""
        proposals = Proposals(self.outbox)
        params = {**PARAMS, "order_id": order, "amount_minor": amount}
        with self.sessions.begin() as s:
            live_before = self.live_on_order(s, order)
            got = proposals.propose(s, tenant=TENANT, kind="refund", params=params, reason="r")
            p = got.proposal
            proposal_id = p.id
            auto = got.created and auto_approvable(
                POLICY_LIMIT, p.params.get("amount_minor"), got.earlier, got.others
            )
            if auto:
                proposals.approve(s, TENANT, p.handle, by=POLICY)
                assert not live_before, (
                    f"the policy alone approved a second refund on {order}: {live_before}"
                )
        if auto:
            self.adopt(proposal_id)
        return auto

    def approve(self, proposal_id: int) -> None:
        """A person (the agent's human, or staff) approves a waiting proposal."""
        with self.sessions.begin() as s:
            p = s.get(Proposal, proposal_id)
            assert p is not None
            Proposals(self.outbox).approve(s, TENANT, p.handle, by="human:alice")
        self.adopt(proposal_id)

    def waiting(self) -> list[int]:
        with self.sessions() as s:
            stmt = select(Proposal.id).where(Proposal.status == "proposed")
            return list(s.scalars(stmt.order_by(Proposal.id)))

    def adopt(self, proposal_id: int) -> None:
        """An approved proposal's operation and run, watched like the app's."""
        with self.sessions() as s:
            p = s.get(Proposal, proposal_id)
            assert p is not None and p.op_id is not None and p.run_id is not None
            op = find_operation(s, TENANT, p.op_id)
            run = s.get(Run, p.run_id)
            assert op is not None and run is not None
            self.ops[p.op_id] = op.id
            self.handles.append(run.handle)

    @staticmethod
    def live_on_order(s: Session, order: str) -> list[str]:
        """What on ``order`` did something or may: operations not rejected or cancelled, and
        proposals waiting or approved."""
        dead = (State.REJECTED.value, State.CANCELLED.value)
        ops = [
            op.op_id
            for op in operations_on_orders(s, [(TENANT, order)])
            if op.state not in dead and op.kind == "refund"
        ]
        stmt = select(Proposal.handle).where(
            Proposal.order_ref == order, Proposal.status.in_(["proposed", "approved"])
        )
        return ops + list(s.scalars(stmt))

    # -- the downstream and the network ------------------------------------------------------

    def script(self, fate: str) -> None:
        """What the next submit meets (one of ``SUBMIT_FATES``)."""
        fake = self.fake
        if fate == "held":
            fake.hold_submits(1)
        elif fate == "answer_lost":
            fake.script_submit(Unknown("connection reset after commit"), executed=True)
        elif fate == "refused":
            fake.script_submit(Refused(RejectReason.BUSINESS_REJECTED, "order_closed", 402))
        elif fate == "throttled":
            fake.script_submit(NotExecuted(429, retry_after=1.0))
        elif fate == "not_sent":
            fake.script_submit(NotSent("connection refused"))
        elif fate == "unknown_not_done":
            fake.script_submit(Unknown("502 from a proxy", status=502), executed=False)

    def lookups_down(self, n: int) -> None:
        """The next ``n`` lookups are not answered."""
        self.fake.script_lookup(*[Unavailable("lookup API down")] * n)

    def advance(self, seconds: float) -> None:
        """Time passes: stored timestamps move into the past, the downstream's clock on.
        Requests on the wire longer than the contract's delay bound are lost."""
        bound = self.contract.max_request_delay.total_seconds()
        later = self.clock.t + seconds
        for request in self.fake.in_flight:
            if later - request.sent_at > bound:
                self.fake.drop(request.id)
        shift(self.engine, seconds)
        self.clock.t = later

    def skew_to(self, seconds: float) -> None:
        """The database's clock is set so that it runs ``seconds`` ahead of the downstream's
        (behind: negative): stored timestamps move, the downstream's clock does not. The
        contract's assumption is that the two stay within the clock margin of each other."""
        shift(self.engine, seconds - self.skew)
        self.skew = seconds

    def landable(self, op_id: str) -> list[InFlight]:
        """The operation's requests on the wire that could still be carried out."""
        now, fenced = self.clock.t, self.fake.enforces_deadline
        return [
            r for r in self.fake.in_flight if r.op_id == op_id and (r.in_time(now) or not fenced)
        ]

    # -- reading -----------------------------------------------------------------------------

    def rows(self) -> dict[str, Operation]:
        with self.sessions() as s:
            found = s.scalars(select(Operation).where(Operation.id.in_(self.ops.values())))
            return {op.op_id: op for op in found}

    def open_items(self) -> list[ReviewItem]:
        with self.sessions() as s:
            stmt = select(ReviewItem).where(ReviewItem.resolved_at.is_(None))
            return list(s.scalars(stmt.order_by(ReviewItem.id)))

    def in_review(self) -> set[str]:
        ids = {item.operation_id for item in self.open_items()}
        return {op_id for op_id, row in self.ops.items() if row in ids}

    # -- the invariants ----------------------------------------------------------------------

    def check(self) -> None:
        """The invariants of the protocol, against the ledger (what the downstream did)."""
        rows = self.rows()
        ledger = self.fake.ledger
        for op_id, row in rows.items():
            effects = [e for e in ledger if (e.tenant, e.op_id) == (TENANT, op_id)]
            state = State(row.state)
            assert len(effects) <= 1, f"{op_id}: {len(effects)} effects downstream"
            if state in (State.REJECTED, State.CANCELLED):
                assert not effects, f"{op_id} is {state.value}, but the downstream did it"
                assert not self.landable(op_id), (
                    f"{op_id} is {state.value}, but a request of it can still land"
                )
            if state is State.SUCCEEDED:
                assert len(effects) == 1, f"{op_id} is succeeded with no effect downstream"
                assert row.downstream_ref == effects[0].reference, (
                    f"{op_id}: succeeded as {row.downstream_ref}, the downstream did "
                    f"{effects[0].reference}"
                )
        for handle in self.handles:
            with self.sessions() as s:
                report = runs.run_report(s, TENANT, handle)
            for line in report.lines:
                row = rows[line.op_id]
                effects = self.fake.effects_of(TENANT, line.op_id)
                assert line.state.value == row.state, f"{line.op_id}: the report says otherwise"
                if line.group is Group.DONE:
                    assert effects == 1, f"{line.op_id}: reported done, {effects} effects"
                if line.group is Group.NOT_DONE:
                    assert effects == 0, f"{line.op_id}: reported not done, but it was done"
                    assert not self.landable(line.op_id), (
                        f"{line.op_id}: reported not done, but a request of it can still land"
                    )

    def unsettled(self) -> list[str]:
        """Operations neither terminal nor in review."""
        review = self.in_review()
        return sorted(
            op_id
            for op_id, row in self.rows().items()
            if not State(row.state).terminal and op_id not in review
        )

    def describe(self) -> dict[str, Any]:
        """The state of the world, for a failure's message."""
        return {
            "clock": self.clock.t,
            "ops": {k: (r.state, r.reason, r.downstream_ref) for k, r in self.rows().items()},
            "ledger": [(e.op_id, e.reference, e.at) for e in self.fake.ledger],
            "in_flight": [(r.op_id, r.sent_at, r.time_left) for r in self.fake.in_flight],
            "review": sorted(self.in_review()),
        }


__all__ = ["ORDERS", "SUBMIT_FATES", "Figures", "World", "empty", "shift"]
