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

The wire. The fake decides what the downstream does; what it answers goes over the wire
protocol (docs/wire-protocol.md) as an HTTP response and is read back by the product's own
classifier (``workers.http_classify.classify_submit``), as ``HttpGateway`` reads it
(``WireGateway``): a misread in-use key or idempotency error is the product's misreading.
Besides the fake's own faults, the wire adds the ones only a downstream's idempotency layer
gives: ``409 idempotency_key_in_use`` to a same-key request while the first is still on its
way (nothing done), and ``idempotency_error / idempotency_key_reused`` (the downstream reading
the parameters otherwise: nothing done, a person must look). A kind may have a short key
retention (``World(key_retention=...)``): the fake forgets a key that long after its record
was made, and a late request with it is carried out again.

Hung senders. A held request's sender hears ``Unknown`` at once (its client gave up), so the
request may land up to the delay bound after it was sent. A *hung* one's sender waits until
its send bound and its worker dies there (``HUNG``, with a crash after the send): no outcome
is written, and the request may land up to the delay bound after the send bound.

The judge is the fake's ledger (``FakeGateway.ledger``): what the downstream really did; and
the answers the wire gave, by the attempts that recorded them: what each proves.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import Engine, event, literal_column, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from outbox import runs, wire
from outbox.clock import Deadline
from outbox.db import make_engine
from outbox.downstream import (
    Accepted,
    DownstreamRequest,
    LookupOutcome,
    Misuse,
    NotExecuted,
    NotSent,
    Proof,
    Refused,
    SubmitOutcome,
    Unavailable,
    Unknown,
)
from outbox.intake import Outbox
from outbox.kinds import default_registry
from outbox.models import Attempt, Base, Operation, Proposal, ReviewItem, Run, UTCDateTime
from outbox.proposals import Proposals, auto_approvable
from outbox.report_lines import Group
from outbox.states import RejectReason, State
from outbox.storage.operations import db_time, find_operation
from outbox.storage.search import operations_on_orders
from outbox.testing import FakeGateway, InFlight
from reconciler.reconcile import Reconciler
from support.review import ReviewQueue
from workers.executor import Executor
from workers.http_classify import classify_submit

TENANT = "acme"
PARAMS = {"amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
#: the orders refunds are made on: the app's and an agent's can meet on one
ORDERS = ("A1000", "A1001")
#: the reconciler's client timeout (seconds): a lookup takes at most this long
CLIENT_TIMEOUT = 5.0
#: a short key retention's margin (seconds): resends stop this long before it ends
RETENTION_MARGIN = 10.0
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
    "in_use",  # 409 idempotency_key_in_use: a request with the key is still on its way
    "processing",  # held, at the downstream already: same-key requests meanwhile answer 409
    "misuse",  # idempotency_error / idempotency_key_reused: nothing done, a person must look
)
#: a sender that waits until its send bound, its worker dying there (with a crash after the
#: send only: ``Simulation.work``)
HUNG = "hung"

#: what each wire answer the simulation gives proves (docs/wire-protocol.md, "How the client
#: classifies responses"), by its status: the judge's table, not the classifier's
PROVES = {
    200: Proof.DONE,
    402: Proof.NOT_DONE,
    429: Proof.NOT_EXECUTED,
    502: Proof.UNKNOWN,
    400: Proof.MISUSE,  # idempotency_error / idempotency_key_reused
    409: Proof.UNKNOWN,  # idempotency_error / idempotency_key_in_use
}


def _error(status: int, kind: str, code: str, **headers: str) -> httpx.Response:
    body = {"error": {"type": kind, "code": code, "message": code}}
    return httpx.Response(status, json=body, headers=headers)


def on_the_wire(outcome: SubmitOutcome) -> httpx.Response | None:
    """The HTTP response a wire-protocol downstream gives for what the fake did (None: no
    response came back, the adapter's to classify by phase: passed on as it is)."""
    if isinstance(outcome, Accepted):
        receipt = outcome.receipt
        body = {**receipt.raw, "id": receipt.reference, "status": receipt.status}
        return httpx.Response(200, json={**body, "params": dict(receipt.params)})
    if isinstance(outcome, Refused):
        return _error(402, wire.BUSINESS_ERROR, outcome.code)
    if isinstance(outcome, NotExecuted):
        after = {} if outcome.retry_after is None else {"Retry-After": f"{outcome.retry_after:g}"}
        return _error(429, "rate_limit_error", "rate_limited", **after)
    if isinstance(outcome, Misuse) and outcome.code == "idempotency_error":
        return _error(400, wire.IDEMPOTENCY_ERROR, "idempotency_key_reused")
    if isinstance(outcome, Unknown) and outcome.status is not None:
        return httpx.Response(outcome.status, text="Bad Gateway")
    return None


def _left(deadline: Deadline | datetime) -> float:
    if isinstance(deadline, Deadline):
        return deadline.left()
    return (deadline - datetime.now(UTC)).total_seconds()


class WireGateway:
    """The fake downstream behind the wire protocol: each submit meets the next scripted fate
    (``script``), the fake does what it does, and its answer is put on the wire and read back
    by ``classify_submit``. Lookups are the fake's."""

    def __init__(self, fake: FakeGateway) -> None:
        self.fake = fake
        #: called with a lookup's deadline once the downstream has read what it answers,
        #: before the answer comes back (``World.slow_lookup``)
        self.answering: Callable[[Deadline | datetime], None] = lambda _deadline: None
        #: requests whose sender waited until its send bound (``HUNG``)
        self.hung: set[int] = set()
        #: requests held at the downstream, running: their key answers 409 in use meanwhile
        self.processing: set[int] = set()
        #: the answers only the wire gives, as given (``in_use``, ``misuse``)
        self.given: Counter[str] = Counter()
        self._fates: deque[str] = deque()
        self._lock = threading.Lock()

    def script(self, fate: str) -> None:
        with self._lock:
            self._fates.append(fate)

    def submit(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> SubmitOutcome:
        fake, key = self.fake, request.idempotency_key
        with self._lock:
            fate = self._fates.popleft() if self._fates else "answered"
            on_wire = {r.id for r in fake.in_flight}
            response: httpx.Response | None
            running = {r.idempotency_key for r in fake.in_flight if r.id in self.processing}
            on_its_way = {r.idempotency_key for r in fake.in_flight}
            if key in running or (fate == "in_use" and key in on_its_way):
                response = _error(409, wire.IDEMPOTENCY_ERROR, wire.KEY_IN_USE)
                self.given["in_use"] += 1
            elif fate == "misuse" and _left(deadline) > 0:
                response = _error(400, wire.IDEMPOTENCY_ERROR, "idempotency_key_reused")
                self.given["misuse"] += 1
            else:
                self._meets(fate)
                answer = fake.submit(request, deadline=deadline)
                new = {r.id for r in fake.in_flight} - on_wire
                if fate == HUNG:
                    self.hung |= new
                if fate == "processing":
                    self.processing |= new
                response = on_the_wire(answer)
                if response is None:
                    return answer
        return classify_submit(
            response, request.kind, request.params, now=datetime.now(UTC), idempotency_key=key
        )

    def lookup(
        self, request: DownstreamRequest, /, *, deadline: Deadline | datetime
    ) -> LookupOutcome:
        answer = self.fake.lookup(request, deadline=deadline)
        self.answering(deadline)
        return answer

    def _meets(self, fate: str) -> None:
        """Script the fake for what the next submit meets there."""
        fake = self.fake
        if fate in ("held", "processing", HUNG):
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


#: the schema of the movable clock's functions on PostgreSQL (``TimedEngine``)
CLOCK_SCHEMA = "sim_clock"
_PG_CLOCK = f"""
CREATE SCHEMA IF NOT EXISTS {CLOCK_SCHEMA};
CREATE TABLE IF NOT EXISTS {CLOCK_SCHEMA}.offset_seconds (s float8 NOT NULL);
INSERT INTO {CLOCK_SCHEMA}.offset_seconds
    SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM {CLOCK_SCHEMA}.offset_seconds);
CREATE OR REPLACE FUNCTION {CLOCK_SCHEMA}.clock_timestamp() RETURNS timestamptz
    LANGUAGE sql VOLATILE AS $$ SELECT pg_catalog.clock_timestamp()
        + make_interval(secs => (SELECT s FROM {CLOCK_SCHEMA}.offset_seconds)) $$;
CREATE OR REPLACE FUNCTION {CLOCK_SCHEMA}.statement_timestamp() RETURNS timestamptz
    LANGUAGE sql STABLE AS $$ SELECT pg_catalog.statement_timestamp()
        + make_interval(secs => (SELECT s FROM {CLOCK_SCHEMA}.offset_seconds)) $$;
"""
_SQLITE_NOW = "%Y-%m-%d %H:%M:%f"


class TimedEngine:
    """An engine on ``base``'s database whose clock (``db_now``, ``db_statement_now``) reads
    ``offset`` seconds ahead of the real one: the database's clock moving while a service is
    in the middle of a call (a lookup whose answer comes back later), which moving stored
    timestamps cannot show, since the service holds what it read before.

    On PostgreSQL, functions of the same names in a schema of its own, ahead of
    ``pg_catalog`` on the search path; on SQLite, ``strftime`` (which ``db_now`` compiles to)
    defined on each connection, with ``'now'`` moved. Timestamps written by column defaults
    (``CURRENT_TIMESTAMP``: when an event or a row was created) are not moved."""

    def __init__(self, base: Engine) -> None:
        self.offset = 0.0
        url = base.url.render_as_string(hide_password=False)
        self.engine = make_engine(url)
        if self.engine.dialect.name == "postgresql":
            path = f"{CLOCK_SCHEMA}, public, pg_catalog"
            event.listen(self.engine, "connect", lambda c, _r: _set_path(c, path))
            with self.engine.begin() as conn:
                conn.exec_driver_sql(_PG_CLOCK)
        else:
            builtin = sqlite3.connect(":memory:", check_same_thread=False)
            lock = threading.Lock()

            def strftime(fmt: str, when: str, modifier: str) -> str | None:
                if when == "now":
                    moved = datetime.now(UTC) + timedelta(seconds=self.offset)
                    when = moved.strftime("%Y-%m-%d %H:%M:%S.") + f"{moved.microsecond:06d}"
                with lock:
                    row = builtin.execute("SELECT strftime(?, ?, ?)", (fmt, when, modifier))
                    value: str | None = row.fetchone()[0]
                return value

            event.listen(
                self.engine,
                "connect",
                lambda c, _r: c.create_function("strftime", 3, strftime),
            )

    def move(self, seconds: float) -> None:
        """The database's clock runs ``seconds`` on (no stored timestamp moves)."""
        self.offset += seconds
        if self.engine.dialect.name == "postgresql":
            with self.engine.begin() as conn:
                conn.exec_driver_sql(
                    f"UPDATE {CLOCK_SCHEMA}.offset_seconds SET s = %(s)s", {"s": self.offset}
                )

    def settle(self) -> None:
        """Back to the real clock, every stored timestamp moved back by the offset: the same
        world, for the next step (no service is in a call)."""
        if self.offset:
            moved = self.offset
            self.move(-moved)
            shift(self.engine, moved)

    def close(self) -> None:
        self.engine.dispose()


def _set_path(dbapi_conn: Any, path: str) -> None:
    cur = dbapi_conn.cursor()
    cur.execute(f"SET search_path = {path}")  # our constant: no injection
    cur.close()
    dbapi_conn.commit()


class SimClock:
    """The downstream's clock, in seconds, moved by the simulation only."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class World:
    """A database, the outbox, the fake downstream and the services, for one example."""

    db: TimedEngine
    outbox: Outbox
    visibility_delay: float = 0.0
    lease_seconds: float = 15.0
    #: unknown for this long, an operation goes to review (short: staff get to work on it)
    review_after: float = 30.0
    clock: SimClock = field(default_factory=SimClock)
    #: how far the database's clock runs ahead of the downstream's (``skew_to``)
    skew: float = 0.0
    #: a short key retention for the kind (seconds; None: the contract's 24 h): the fake
    #: forgets a key that long after its record was made
    key_retention: float | None = None
    #: operation ids (rows) by op_id, in enqueue order
    ops: dict[str, int] = field(default_factory=dict)
    #: run handles
    handles: list[str] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    #: how far the services' monotonic clocks run ahead of the real one (moved with the
    #: database's clock while a lookup is answered: ``slow_lookup``)
    ahead: float = 0.0

    def __post_init__(self) -> None:
        self.engine = self.db.engine
        self._slow: tuple[float, list[int]] | None = None
        empty(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        if self.key_retention is not None:
            registry = self.outbox.registry.with_contract(
                "refund",
                key_retention=timedelta(seconds=self.key_retention),
                retention_margin=timedelta(seconds=RETENTION_MARGIN),
            )
            self.outbox = replace(self.outbox, registry=registry)
        self.contract = self.outbox.registry.get("refund").contract
        self.fake = FakeGateway(
            clock=self.clock,
            visibility_delay=self.visibility_delay,
            enforces_deadline=self.contract.enforces_deadline,
            key_retention=self.key_retention,
        )
        self.wire = WireGateway(self.fake)
        self.wire.answering = self._answering

    # -- services, built afresh for each pass (a process with no memory of the last) --------

    def executor(self, worker: str, monotonic: Callable[[], float] = time.monotonic) -> Executor:
        return Executor(
            sessions=self.sessions,
            gateway=self.wire,
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
            gateway=self.wire,
            registry=self.outbox.registry,
            worker="r1",
            lease_seconds=self.lease_seconds,
            client_timeout=CLIENT_TIMEOUT,
            review_after=self.review_after,
            # as the runtime builds it: what a "not found" cannot settle yet is sent again
            # with the same key, by an executor under the reconciler's claim
            resender=self.executor("r1-resend", self.monotonic),
            monotonic=self.monotonic,
        )

    def monotonic(self) -> float:
        """The reconciler's monotonic clock: on with the database's while it waits for a
        lookup's answer."""
        return time.monotonic() + self.ahead

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
            for op in operations_on_orders(s, [(TENANT, order)], kinds=default_registry())
            if op.state not in dead and op.kind == "refund"
        ]
        stmt = select(Proposal.handle).where(
            Proposal.order_ref == order, Proposal.status.in_(["proposed", "approved"])
        )
        return ops + list(s.scalars(stmt))

    # -- the downstream and the network ------------------------------------------------------

    def script(self, fate: str) -> None:
        """What the next submit meets (one of ``SUBMIT_FATES``, or ``HUNG``)."""
        self.wire.script(fate)

    def lookups_down(self, n: int) -> None:
        """The next ``n`` lookups are not answered."""
        self.fake.script_lookup(*[Unavailable("lookup API down")] * n)

    def advance(self, seconds: float) -> None:
        """Time passes: stored timestamps move into the past, the downstream's clock on."""
        shift(self.engine, seconds)
        self._downstream_on(seconds)

    def _downstream_on(self, seconds: float) -> None:
        """The downstream's clock runs on. Requests on the wire longer than the contract's
        delay bound after their sender was done (at once; a hung one's at its send bound)
        are lost."""
        bound = self.contract.max_request_delay.total_seconds()
        later = self.clock.t + seconds
        for request in self.fake.in_flight:
            if later - self.sender_done(request) > bound:
                self.fake.drop(request.id)
        self.clock.t = later

    def slow_lookup(self, fraction: float, landing: list[int]) -> None:
        """The next lookup's answer comes back ``fraction`` of its time left after the
        downstream read what it answers (the reconciler's clocks, the database's and the
        downstream's run on meanwhile), and the requests ``landing`` land in between."""
        self._slow = (fraction, landing)

    def _answering(self, deadline: Deadline | datetime) -> None:
        if self._slow is None:
            return
        fraction, landing = self._slow
        self._slow = None
        seconds = max(0.0, _left(deadline)) * fraction
        self.db.move(seconds)
        self.ahead += seconds
        self._downstream_on(seconds)
        on_wire = {r.id for r in self.fake.in_flight}
        for request_id in landing:
            if request_id in on_wire:
                self.fake.land(request_id)

    def settle_clock(self) -> None:
        """After a pass: the database's clock moved within it becomes stored timestamps moved
        (``TimedEngine.settle``), and any slow lookup not asked is forgotten."""
        self._slow = None
        self.db.settle()

    def skew_to(self, seconds: float) -> None:
        """The database's clock is set so that it runs ``seconds`` ahead of the downstream's
        (behind: negative): stored timestamps move, the downstream's clock does not. The
        contract's assumption is that the two stay within the clock margin of each other.
        The downstream reads each request's deadline (an instant) on its own clock: one sent
        while the database's runs ahead has that much longer (``FakeGateway.clock_behind``)."""
        shift(self.engine, seconds - self.skew)
        self.skew = seconds
        self.fake.clock_behind = seconds

    def sender_done(self, request: InFlight) -> float:
        """When the request's sender stopped waiting for it, on the downstream's clock."""
        hung = request.id in self.wire.hung
        return request.sent_at + (request.time_left if hung else 0.0)

    def instants(self) -> list[tuple[str, float]]:
        """The instants the protocol's rules turn on for the operations' sends, named (by the
        operation, the attempt and the rule: what a step draws, so that a replay draws the
        same whatever the milliseconds) with the seconds from now to each by the database's
        clock (each of them may be past): per attempt, its lease's end,
        that plus the processing time (a fenced "not found" trusted), its end plus the delay
        bound and processing (an unfenced one), its start plus the client timeout, delay
        bound and processing; per operation, its first send plus the key retention less its
        margin (resends stop), and plus the key retention (the downstream forgets)."""
        contract = self.contract
        processing = contract.processing_time.total_seconds()
        delay = contract.max_request_delay.total_seconds()
        retention = contract.key_retention.total_seconds()
        margin = contract.retention_margin.total_seconds()
        names = {row: op_id for op_id, row in self.ops.items()}
        with self.sessions() as s:
            now = db_time(s)
            attempts = s.scalars(
                select(Attempt).where(Attempt.operation_id.in_(self.ops.values()))
            ).all()
            firsts = s.execute(
                select(Operation.id, Operation.first_sent_at).where(
                    Operation.id.in_(self.ops.values()), Operation.first_sent_at.is_not(None)
                )
            ).all()
        found: list[tuple[str, float]] = []
        for a in attempts:
            name = f"{names[a.operation_id]}#{a.number}"
            start = (a.started_at - now).total_seconds()
            found.append((f"{name} timeout+delay", start + CLIENT_TIMEOUT + delay + processing))
            if a.not_after is not None:
                lease = (a.not_after - now).total_seconds()
                found += [(f"{name} lease_end", lease), (f"{name} fenced", lease + processing)]
                end = lease if a.finished_at is None else (a.finished_at - now).total_seconds()
                found.append((f"{name} end+delay", min(end, lease) + delay + processing))
        for row, first in firsts:
            at = (first - now).total_seconds()
            found += [
                (f"{names[row]} resend_until", at + retention - margin),
                (f"{names[row]} forgotten", at + retention),
            ]
        return sorted(found)

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

        self.check_answers()

    def check_answers(self) -> None:
        """Each answer is read as what it proves (``PROVES``: a 409 in-use key proves nothing
        either way, an idempotency error is misuse), and a misuse answer, once written, leaves
        the operation in review (DESIGN.md, "What an outcome proves")."""
        names = {row: op_id for op_id, row in self.ops.items()}
        with self.sessions() as s:
            attempts = s.scalars(select(Attempt).where(Attempt.proof.is_not(None))).all()
            reviewed = set(s.scalars(select(ReviewItem.operation_id)))
        for a in attempts:
            op_id = names.get(a.operation_id, str(a.operation_id))
            expected = PROVES.get(a.status_code) if a.status_code is not None else None
            if expected is not None:
                assert a.proof == expected.value, (
                    f"{op_id}: attempt {a.number}, answered HTTP {a.status_code}, recorded "
                    f"as {a.proof}; it proves {expected.value}"
                )
            if a.status_code == 400:
                assert a.operation_id in reviewed, (
                    f"{op_id}: a misuse answer (attempt {a.number}) and no review"
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


__all__ = [
    "HUNG",
    "ORDERS",
    "PROVES",
    "SUBMIT_FATES",
    "Figures",
    "TimedEngine",
    "WireGateway",
    "World",
    "empty",
    "on_the_wire",
    "shift",
]
