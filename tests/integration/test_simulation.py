"""A deterministic simulation of the real services: Hypothesis drives the real ``Executor``,
``Reconciler`` (with its same-key resender), ``ReviewQueue`` and runs over real PostgreSQL and
SQLite, against the shipped ``FakeGateway`` (a ledger, requests held on the wire or while the
downstream processes them, hung senders, lookups that see late or answer late, answers lost
after commit, in-use keys, idempotency errors, a key retention the downstream forgets keys
after), its answers read back over the wire protocol by the product's own classifier, with
time moved by the simulation (``tests.support.simulation``), and checks the protocol's
invariants after every step:

- at most one effect per operation (the ledger);
- ``rejected`` or ``cancelled`` means no effect, and no request of it still able to land;
- ``succeeded`` means exactly one effect, the one its reference names;
- every run report line agrees with the operation's state and the ledger;
- each answer is read as what it proves, and a misuse answer goes to review;
- a tenant's policy never approves a second refund on an order by itself;
- at the end, once every request has landed and time has passed with passes run, every
  operation is terminal or in review.

Steps: enqueue (in a run or not), what the next submit meets downstream, lookups down or
answered late, a worker's pass (crashing at a failpoint the project ships, hanging in its
send until it dies, or paused there past its lease while others work), time passing (by a
fixed step, or to just before or after an instant the rules turn on), a clock step within the
clock margin, a request landing late or lost, a reconcile pass, a cancel, a staff resolution
(on the evidence, or a supervisor's override), an agent's proposal (approved by the policy
where it may) and a person's approval. After the machine, one run per fault that a careless
change to the wiring needs to do harm (docs/model.md, "The review's six mutants").

A failure prints the steps that led to it, and how to replay it (``@reproduce_failure``); runs
are reproducible from their seed: ``pytest tests/integration/test_simulation.py
--hypothesis-seed=N``. ``SETTLED_TEST_SIMULATION_EXAMPLES=N`` runs N examples per database
(the long mode; CI runs ``CI_EXAMPLES``); ``SETTLED_TEST_SIMULATION_SHRINK=0`` reports a
failure unshrunk. The figures are printed at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import Engine, update

from outbox.errors import SettledError
from outbox.intake import Outbox
from outbox.kinds import default_registry
from outbox.models import Operation
from support.staff import Role, Staff
from tests.support.simulation import HUNG, ORDERS, SUBMIT_FATES, Figures, TimedEngine, World
from workers.failpoints import STEPS, FailpointHit, arm

CI_EXAMPLES = 40
STEP_COUNT = 30
EXAMPLES = int(os.environ.get("SETTLED_TEST_SIMULATION_EXAMPLES", CI_EXAMPLES))
#: ``SETTLED_TEST_SIMULATION_SHRINK=0``: a failure is reported as found, not shrunk to its
#: shortest steps (a quick verdict, as for a mutant)
SHRINK = os.environ.get("SETTLED_TEST_SIMULATION_SHRINK", "1") != "0"

#: a short key retention (seconds): two minutes, inside the delay bound (5 min), so that a
#: resend may be asked for after the downstream forgot the key
KEY_RETENTION = 120.0
MAX_OPS = 4
MAX_RUNS = 2
WORKERS = ("w1", "w2")
#: how far time moves in one step: within a clock margin, within a lease, past it, past the
#: delay bound, past the review threshold
ADVANCES = (0.5, 1.0, 5.0, 16.0, 60.0, 301.0, 700.0)
#: how near an instant a send makes matter time moves to (``advance_to``): within the
#: clock margin, and within a lookup's time
NEAR = (-0.5, 0.5, -3.0, 3.0)
#: where a step of the database's clock leaves it against the downstream's: within the
#: clock margin (1 s), the contract's assumption
CLOCK_SKEWS = (-0.9, -0.4, 0.0, 0.4, 0.9)
#: what a pass's sends meet downstream, in order
FATES = st.lists(st.sampled_from(SUBMIT_FATES), max_size=3)
#: what goes on while a worker is paused
MEANWHILE = ("advance", "reconcile", "worker", "cancel")
JUSTIFICATION = "checked against the provider's dashboard"

FIGURES: dict[str, Figures] = {}


class Simulation(RuleBasedStateMachine):
    """One example: a fresh database, a fake downstream, up to four operations."""

    db: TimedEngine
    outbox: Outbox
    figures: Figures

    def __init__(self) -> None:
        super().__init__()
        self.world: World | None = None

    @property
    def w(self) -> World:
        assert self.world is not None
        return self.world

    def counted(self, name: str) -> None:
        self.figures.steps += 1
        self.figures.rules[name] += 1

    @initialize(
        visibility=st.sampled_from([0.0, 1.0, 2.0]),
        fenced=st.booleans(),
        retention=st.sampled_from([None, KEY_RETENTION]),
    )
    def start(self, visibility: float, fenced: bool, retention: float | None) -> None:
        """A downstream that enforces the deadline (the fence), or one bounded only by the
        delay bound; lookups that see what was done at once, or up to the processing time
        later; keys remembered for the contract's 24 h, or for ``KEY_RETENTION`` only."""
        outbox = self.outbox if fenced else replace(self.outbox, registry=default_registry())
        self.world = World(self.db, outbox, visibility_delay=visibility, key_retention=retention)
        self.figures.examples += 1

    # -- the app -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.w.ops) < MAX_OPS)
    @rule(data=st.data())
    def enqueue(self, data: st.DataObject) -> None:
        """The app enqueues an operation: alone, in a run it has, or in a new run."""
        self.counted("enqueue")
        new = ["new"] if len(self.w.handles) < MAX_RUNS else []
        handle = data.draw(st.sampled_from([None, *new, *self.w.handles]), label="run")
        if handle == "new":
            handle = self.w.open_run()
        self.w.enqueue(handle, data.draw(st.sampled_from(ORDERS), label="order"))

    @precondition(lambda self: len(self.w.ops) < MAX_OPS and len(self.w.waiting()) < 2)
    @rule(order=st.sampled_from(ORDERS), amount=st.sampled_from([5000, 10000, 50000]))
    def propose(self, order: str, amount: int) -> None:
        """An agent proposes a refund; the tenant's policy approves it by itself where it may
        (never a second refund on one order)."""
        approved = self.w.propose(order, amount)
        self.counted("propose_policy_approved" if approved else "propose")

    @precondition(lambda self: len(self.w.ops) < MAX_OPS and bool(self.w.waiting()))
    @rule(data=st.data())
    def approve(self, data: st.DataObject) -> None:
        """A person approves a waiting proposal (shown the earlier ones on the order)."""
        self.counted("approve")
        self.w.approve(data.draw(st.sampled_from(self.w.waiting()), label="proposal"))

    @precondition(lambda self: bool(self.w.live_runs))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """The user cancels a run (once: cancelling again is a no-op, tested elsewhere)."""
        self.counted("cancel")
        self.w.cancel(data.draw(st.sampled_from(self.w.live_runs), label="run"))

    # -- the downstream, the network, time ---------------------------------------------------

    @precondition(lambda self: bool(self.w.fake.in_flight))
    @rule(data=st.data(), lands=st.booleans())
    def wire(self, data: st.DataObject, lands: bool) -> None:
        """A request on the wire lands now, or is lost."""
        request = data.draw(st.sampled_from(self.w.fake.in_flight), label="request")
        self.counted("land" if lands else "drop")
        if lands:
            self.w.fake.land(request.id)
        else:
            self.w.fake.drop(request.id)

    @precondition(lambda self: bool(self.w.ops))
    @rule(data=st.data(), seconds=st.sampled_from(ADVANCES))
    def advance(self, data: st.DataObject, seconds: float) -> None:
        """Time passes; each request on the wire may land meanwhile (at the end of it: after
        its deadline, a fenced downstream refuses it) or stay on the wire (past the delay
        bound, it is lost)."""
        self.counted("advance")
        self.advance_by(data, seconds)

    @precondition(lambda self: bool(self.w.ops))
    @rule(data=st.data(), off=st.sampled_from(NEAR))
    def advance_to(self, data: st.DataObject, off: float) -> None:
        """Time passes to just before or after an instant the protocol's rules turn on for
        a send (``World.instants``: a lease's end, quiescence with or without the fence, the
        key retention less its margin...), each request on the wire landing at the end of
        it or not, as with ``advance``."""
        instants = dict(self.w.instants())
        if not instants:
            self.counted("advance_to_none")
            return
        name = data.draw(st.sampled_from(sorted(instants)), label="instant")
        seconds = instants[name] + off
        if seconds <= 0:
            self.counted("advance_to_past")
            return
        self.counted("advance_to")
        self.advance_by(data, seconds)

    def advance_by(self, data: st.DataObject, seconds: float) -> None:
        landing = [
            r.id
            for r in self.w.fake.in_flight
            if data.draw(st.booleans(), label=f"request {r.id} lands")
        ]
        self.w.advance(seconds)
        for request_id in landing:
            if request_id in {r.id for r in self.w.fake.in_flight}:
                self.figures.rules["land_late"] += 1
                self.w.fake.land(request_id)

    @precondition(lambda self: bool(self.w.ops))
    @rule(skew=st.sampled_from(CLOCK_SKEWS))
    def clock_step(self, skew: float) -> None:
        """The database's clock is set (stepped) to run ``skew`` seconds off the
        downstream's, within the clock margin."""
        self.counted("clock_step")
        self.w.skew_to(skew)

    # -- the services ------------------------------------------------------------------------

    def script(self, fates: list[str]) -> None:
        for fate in fates:
            self.figures.rules[f"submit_{fate}"] += 1
            self.w.script(fate)

    def hinted(self, data: st.DataObject) -> list[int]:
        """A hint (some operations' ids) or none (a doorbell's claim of what is due)."""
        ops = list(self.w.ops.values())
        return data.draw(st.lists(st.sampled_from(ops), unique=True, max_size=3), label="ids")

    def execute(self, worker: str, ids: list[int], monotonic: object = time.monotonic) -> None:
        executor = self.w.executor(worker, monotonic)  # type: ignore[arg-type]
        try:
            executor.execute(ids, claims=MAX_OPS)
        finally:
            # A pass that died mid-batch may leave sends running in its threads: they end
            # before the next step, so that every step starts from the same world.
            pool = executor._pool
            if pool is not None:
                pool.shutdown(wait=True)
            executor.close()

    @precondition(lambda self: bool(self.w.ops))
    @rule(
        data=st.data(),
        worker=st.sampled_from(WORKERS),
        crash=st.sampled_from([None, None, None, *STEPS, HUNG]),
        fates=FATES,
    )
    def work(self, data: st.DataObject, worker: str, crash: str | None, fates: list[str]) -> None:
        """A worker's pass, its sends meeting ``fates`` downstream (then the default); or a
        pass that dies at a failpoint (its leases left to lapse); or one whose first send
        hangs until its send bound, the worker dying there (nothing written)."""
        ids = self.hinted(data)
        if crash == HUNG:
            fates, crash = [HUNG, *fates], "after_send"
            self.figures.rules["hung"] += 1
        self.script(fates)
        if crash is None:
            self.counted("execute")
            self.execute(worker, ids)
            return
        self.counted(f"crash_{crash}")
        with arm(crash), contextlib.suppress(FailpointHit):
            self.execute(worker, ids)

    @precondition(lambda self: bool(self.w.ops))
    @rule(
        data=st.data(),
        at=st.sampled_from(["after_claim", "after_send"]),
        seconds=st.sampled_from([5.0, 20.0, 60.0]),
        meanwhile=st.lists(st.sampled_from(MEANWHILE), max_size=4),
        fates=FATES,
    )
    def pause(
        self,
        data: st.DataObject,
        at: str,
        seconds: float,
        meanwhile: list[str],
        fates: list[str],
    ) -> None:
        """A worker's pass stalls at ``at`` (a GC pause, SIGSTOP) for ``seconds`` and more,
        while the reconciler, another worker and the app go on; then it resumes, on its own
        clock, which saw the whole pause."""
        self.counted(f"pause_{at}")
        ids = self.hinted(data)
        self.script(fates)
        ahead = [0.0]

        def monotonic() -> float:
            return time.monotonic() + ahead[0]

        def stalled() -> None:
            self.w.advance(seconds)
            ahead[0] += seconds
            for what in meanwhile:
                if what == "advance":
                    self.w.advance(60.0)
                    ahead[0] += 60.0
                elif what == "reconcile":
                    self.reconcile_once()
                elif what == "worker":
                    self.execute("w2", list(self.w.ops.values()))
                elif what == "cancel" and self.w.live_runs:
                    self.w.cancel(self.w.live_runs[0])
            self.w.check()

        with arm(at, stalled):
            self.execute("w1", ids, monotonic)

    def reconcile_once(self) -> None:
        reconciler = self.w.reconciler()
        try:
            report = reconciler.run_once()
        finally:
            reconciler.close()
            self.w.settle_clock()
        if report.outcomes.get("resent"):  # the same-key resends the examples exercised
            self.figures.rules["resent"] += report.outcomes["resent"]

    @precondition(lambda self: bool(self.w.ops))
    @rule(
        data=st.data(),
        down=st.integers(0, 2),
        fates=FATES,
        slow=st.sampled_from([None, None, 0.5, 1.0]),
    )
    def reconcile(
        self, data: st.DataObject, down: int, fates: list[str], slow: float | None
    ) -> None:
        """A reconcile pass, its first ``down`` lookups unanswered (the lookup API down), its
        same-key resends meeting ``fates`` downstream; its first lookup answered ``slow`` of
        its time left after the downstream read it, requests on the wire landing meanwhile."""
        self.counted("reconcile")
        self.script(fates)
        if slow is not None:
            landing = [
                r.id
                for r in self.w.fake.in_flight
                if data.draw(st.booleans(), label=f"request {r.id} lands meanwhile")
            ]
            self.figures.rules["lookup_slow"] += 1
            self.w.slow_lookup(slow, landing)
        if down:
            self.figures.rules["lookups_down"] += 1
            self.w.lookups_down(down)
        self.reconcile_once()

    @precondition(lambda self: bool(self.w.open_items()))
    @rule(data=st.data(), claim=st.sampled_from(["rejected", "succeeded", "override"]))
    def resolve(self, data: st.DataObject, claim: str) -> None:
        """Staff resolve a review item: on the evidence ("rejected", or "succeeded" with the
        reference the downstream gave, or a made-up one when it did nothing), which the queue
        must refuse where the lookup does not prove it; or a supervisor overriding, who has
        checked the provider (the ledger) once nothing of it is on the wire."""
        item = data.draw(st.sampled_from(self.w.open_items()), label="item")
        op_id = next(k for k, v in self.w.ops.items() if v == item.operation_id)
        effects = [e for e in self.w.fake.ledger if e.op_id == op_id]
        reference = effects[0].reference if effects else "fake_made_up"
        queue = self.w.review()
        try:
            if claim == "override":
                if self.w.landable(op_id):
                    self.counted("resolve_override_waits")
                    return  # the supervisor cannot know yet
                staff = Staff("sup-1", Role.SUPERVISOR)
                outcome = "succeeded" if effects else "rejected"
                queue.resolve(
                    staff, item.id, outcome=outcome, version=item.version,
                    reference=reference if effects else None, justification=JUSTIFICATION,
                    override=True,
                )  # fmt: skip
            else:
                staff = Staff("sup-2", Role.SUPPORT)
                queue.resolve(
                    staff, item.id, outcome=claim, version=item.version,
                    reference=reference if claim == "succeeded" else None,
                    justification=JUSTIFICATION,
                )  # fmt: skip
            self.counted(f"resolve_{claim}")
        except SettledError:
            self.counted(f"resolve_{claim}_refused")

    # -- the invariants ----------------------------------------------------------------------

    @invariant()
    def protocol_holds(self) -> None:
        if self.world is not None:
            self.world.check()

    def teardown(self) -> None:
        """Every request lands (or is refused), time passes with passes run: the invariants
        still hold, and every operation ends terminal or in review."""
        world = self.world
        if world is None:
            return
        for request in world.fake.in_flight:
            world.fake.land(request.id)
        world.check()
        for _ in range(12):
            if not world.unsettled():
                break
            world.advance(400.0)  # past a lease, the delay bound and any backoff
            self.execute("w1", list(world.ops.values()))
            self.reconcile_once()
            world.check()
        assert not world.unsettled(), world.describe()
        self.figures.effects += len(world.fake.ledger)
        self.figures.rules.update({f"answered_{k}": v for k, v in world.wire.given.items()})
        self.figures.rules["keys_forgotten"] += world.fake.forgotten
        for row in world.rows().values():
            self.figures.states[row.state] += 1


@pytest.fixture
def db(engine: Engine) -> Iterator[TimedEngine]:
    """The test's database, its clock movable (``TimedEngine``)."""
    timed = TimedEngine(engine)
    yield timed
    timed.close()


@pytest.fixture(scope="module")
def figures(request: pytest.FixtureRequest) -> Iterator[dict[str, Figures]]:
    """The figures of each database's run, printed when the module is done."""
    yield FIGURES
    plugins = request.config.pluginmanager
    reporter = plugins.get_plugin("terminalreporter")
    capture = plugins.get_plugin("capturemanager")
    for database, figures in FIGURES.items():
        line = figures.line(database)
        if reporter is None or capture is None:  # pragma: no cover (no terminal: xdist)
            print(line)
            continue
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(line)


#: no limit in the long mode; in CI, room for a failure to shrink to its shortest steps
@pytest.mark.timeout(0 if EXAMPLES > CI_EXAMPLES else 900)
def test_protocol_invariants_hold_in_every_simulated_interleaving(
    engine: Engine, db: TimedEngine, outbox: Outbox, figures: dict[str, Figures]
) -> None:
    database = engine.dialect.name
    machine = type(f"Simulation_{database}", (Simulation,), {})
    machine.db = db
    machine.outbox = outbox
    machine.figures = figures.setdefault(database, Figures())
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEP_COUNT,
            deadline=None,
            print_blob=True,
            phases=tuple(Phase) if SHRINK else tuple(p for p in Phase if p is not Phase.shrink),
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert machine.figures.examples >= 1


# -- the world itself: time, the wire and the judge, step by step ----------------------------


def test_simulated_time_lapses_a_dead_workers_lease_and_a_late_request_settles_it(
    db: TimedEngine, outbox: Outbox
) -> None:
    """A worker dies after its request left (held on the wire); time passes (no sleeping),
    the request lands within its deadline, the lease lapses, and the reconciler takes over:
    its lookup finds what the request did, and the operation is done, once."""
    world = World(db, outbox)
    op_id = world.enqueue(world.open_run(), ORDERS[0])
    world.fake.hold_submits()
    with arm("after_send"), pytest.raises(FailpointHit):
        world.executor("w1").execute(list(world.ops.values()))
    assert world.rows()[op_id].state == "submitted"
    world.advance(10.0)
    assert world.reconciler().run_once().claimed == 0  # its lease still holds
    (request,) = world.fake.in_flight
    assert world.fake.land(request.id) is not None  # late, within its deadline: done
    world.advance(6.0)  # the dead worker's lease is over
    assert world.reconciler().run_once().outcomes == {"found": 1}
    row = world.rows()[op_id]
    assert (row.state, world.fake.effects_of("acme", op_id)) == ("succeeded", 1)
    world.check()


def test_the_judge_sees_a_rejected_operation_that_a_request_can_still_reach(
    db: TimedEngine, outbox: Outbox
) -> None:
    """The invariants are not vacuous: an operation settled ``rejected`` (here by hand, as
    a broken rule would) while its request is still on the wire fails them, and so does the
    effect once it lands."""
    world = World(db, outbox)
    op_id = world.enqueue(None, ORDERS[0])
    world.fake.hold_submits()
    world.executor("w1").execute(list(world.ops.values()))
    with world.sessions.begin() as s:
        s.execute(
            update(Operation)
            .where(Operation.id == world.ops[op_id])
            .values(state="rejected", reason="not_executed")
        )
    with pytest.raises(AssertionError, match="a request of it can still land"):
        world.check()
    world.fake.land(world.fake.in_flight[0].id)
    with pytest.raises(AssertionError, match="but the downstream did it"):
        world.check()


def test_a_same_key_resend_settles_a_held_request_once_and_its_late_landing_replays(
    db: TimedEngine, outbox: Outbox
) -> None:
    """The first request is held on the wire; a lookup finds nothing, long before that proves
    anything; the reconciler has it sent again with the same key, which is carried out and
    settles it. The held request landing later is a replay of the key: one effect."""
    world = World(db, outbox)
    op_id = world.enqueue(world.open_run(), ORDERS[0])
    world.fake.hold_submits()
    world.executor("w1").execute(list(world.ops.values()))
    assert world.rows()[op_id].state == "unknown"
    assert world.reconciler().run_once().outcomes == {"resent": 1}
    assert world.rows()[op_id].state == "succeeded"
    (request,) = world.fake.in_flight
    world.fake.land(request.id)
    assert world.fake.effects_of("acme", op_id) == 1
    world.check()


# -- the faults the review's missed mutants need: one run each, judged after every step ------
#
# Each drives the world through the shortest run in which one of six careless changes to the
# wiring around the reconciler's decisions does harm (docs/model.md, "The deterministic
# simulation"), with the invariants checked after every step: with the real code each run
# holds; with the change, the step named fails.


def steps(world: World, *actions: Callable[[], object]) -> None:
    """Each action, then the invariants."""
    for action in actions:
        action()
        world.check()


def reconcile(world: World) -> None:
    reconciler = world.reconciler()
    try:
        reconciler.run_once()
    finally:
        reconciler.close()
        world.settle_clock()


def send(world: World, *fates: str, crash: str | None = None) -> None:
    for fate in fates:
        world.script(fate)
    executor = world.executor("w1")
    try:
        if crash is None:
            executor.execute(list(world.ops.values()))
        else:
            with arm(crash), contextlib.suppress(FailpointHit):
                executor.execute(list(world.ops.values()))
    finally:
        executor.close()


def test_a_lookup_answered_late_is_dated_when_it_was_asked(db: TimedEngine, outbox: Outbox) -> None:
    """The request lands just inside its deadline, visible the processing time later; the
    reconciler asks before that, and the answer ("not found") comes back after the lease's
    end plus processing: dated by when it was asked, it proves nothing yet, and the
    same-key resend settles it. (Dated by its answer, the operation goes back to planned
    with its refund made: the report says "not done".)"""
    world = World(db, outbox, visibility_delay=2.0)
    op_id = world.enqueue(world.open_run(), ORDERS[0])
    steps(
        world,
        lambda: send(world, "held"),
        lambda: world.advance(13.5),
        lambda: world.fake.land(world.fake.in_flight[0].id),
        lambda: world.advance(1.5),  # past the lease's end; landed, not visible yet
        lambda: world.slow_lookup(1.0, []),  # asked now, answered a client timeout later
        lambda: reconcile(world),
    )
    assert (world.rows()[op_id].state, world.fake.effects_of("acme", op_id)) == ("succeeded", 1)


def test_a_dead_senders_attempt_counts_to_its_lease_end(db: TimedEngine, outbox: Outbox) -> None:
    """Without the fence: a worker's send hangs until its send bound and the worker dies
    there, its request still on the wire (it may land up to the delay bound after that).
    Its attempt counts to its lease's end: a "not found" just past the delay bound after
    the send proves nothing, and the same-key resend settles it. (Counted from its start
    plus the client timeout, the "not found" is trusted: planned again, reported "not
    done", while the request can still land.)"""
    world = World(db, replace(outbox, registry=default_registry()))
    op_id = world.enqueue(world.open_run(), ORDERS[0])
    steps(
        world,
        lambda: send(world, HUNG, crash="after_send"),
        lambda: world.advance(301.0),
        lambda: world.advance(5.0),
        lambda: world.advance(5.0),  # past start + timeout + delay bound, not lease end's
        lambda: reconcile(world),  # the dead worker's send: unknown
        lambda: reconcile(world),
    )
    assert world.rows()[op_id].state == "succeeded"
    steps(world, lambda: world.fake.land(world.fake.in_flight[0].id))
    assert world.fake.effects_of("acme", op_id) == 1


def test_a_send_bound_leaves_the_clock_margin_before_the_lease_ends(
    db: TimedEngine, outbox: Outbox
) -> None:
    """The database's clock 0.9 s ahead of the downstream's (within the 1 s margin), which
    reads each request's deadline on its own clock. A request held until just after the
    lease's end is refused (its deadline was the lease's end less the margin), and the
    "not found" at the lease's end plus processing is the truth. (Bounded by the lease's end
    itself, it is taken, visible only after that "not found" was trusted: reported "not
    done", with the refund made.)"""
    world = World(db, outbox, visibility_delay=2.0)
    op_id = world.enqueue(world.open_run(), ORDERS[0])
    steps(
        world,
        lambda: world.skew_to(0.9),
        lambda: send(world, "held"),
        lambda: world.advance(15.5),
        lambda: world.fake.land(world.fake.in_flight[0].id),
        lambda: world.advance(1.7),
        lambda: reconcile(world),
    )
    assert world.fake.effects_of("acme", op_id) == 0
    steps(world, lambda: send(world))
    assert (world.rows()[op_id].state, world.fake.effects_of("acme", op_id)) == ("succeeded", 1)


def test_an_in_use_key_proves_nothing(db: TimedEngine, outbox: Outbox) -> None:
    """The first request is on its way; the reconciler's same-key resend meets it at the
    downstream: 409 idempotency_key_in_use, nothing done, which proves nothing either way
    (read as not executed, the attempt's proof is wrong)."""
    world = World(db, outbox)
    op_id = world.enqueue(world.open_run(), ORDERS[0])
    steps(
        world,
        lambda: send(world, "held"),
        lambda: world.script("in_use"),
        lambda: reconcile(world),
    )
    assert world.wire.given["in_use"] == 1
    assert world.rows()[op_id].state == "unknown"


def test_an_idempotency_error_goes_to_review(db: TimedEngine, outbox: Outbox) -> None:
    """The downstream answers the first send with an idempotency error (it reads the
    parameters otherwise): misuse, and a person must look (read as a plain unknown, it
    would be looked up and resent with no one told)."""
    world = World(db, outbox)
    op_id = world.enqueue(world.open_run(), ORDERS[0])
    steps(world, lambda: send(world, "misuse"))
    assert op_id in world.in_review()


def test_no_resend_once_the_key_may_be_forgotten(db: TimedEngine, outbox: Outbox) -> None:
    """Without the fence, a key kept two minutes: the first request was carried out, its
    answer lost; the lookups are down until the downstream has forgotten the key. The
    "not found" then proves nothing (the delay bound has not passed either), and resending
    the key would carry the refund out again: the last checks before a send stop it, past
    the key retention less its margin, and the operation goes to review."""
    world = World(db, replace(outbox, registry=default_registry()), key_retention=120.0)
    op_id = world.enqueue(world.open_run(), ORDERS[0])
    steps(
        world,
        lambda: send(world, "answer_lost"),
        lambda: world.advance(60.0),
        lambda: world.advance(60.0),  # the downstream forgets the key
        lambda: reconcile(world),
    )
    assert world.fake.forgotten == 1
    assert world.fake.effects_of("acme", op_id) == 1


def test_resends_stop_the_retention_margin_before_the_key_is_forgotten(
    db: TimedEngine, outbox: Outbox
) -> None:
    """As above, with the database's clock set back 0.9 s after the first send (within the
    clock margin): the downstream forgets the key 119.1 s after it by the database's clock.
    The stop comes the retention margin before the retention's end, not at it."""
    world = World(db, replace(outbox, registry=default_registry()), key_retention=120.0)
    op_id = world.enqueue(world.open_run(), ORDERS[0])
    steps(
        world,
        lambda: send(world, "answer_lost"),
        lambda: world.advance(60.0),
        lambda: world.skew_to(-0.9),
        lambda: world.advance(60.0),  # forgotten; 119.1 s by the database's clock
        lambda: reconcile(world),
    )
    assert world.fake.forgotten == 1
    assert world.fake.effects_of("acme", op_id) == 1
