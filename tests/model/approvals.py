"""The approvals model: agents' refund proposals on one order, the policy's, a human's and a
staff member's approvals, the app's own intake of a refund on the order, and expiry.

What is modelled (storage, locks, time) and what is Settled's own (every decision):

- **transactions** as interleavable steps. An agent's request (``Proposals.propose`` and, when
  the policy approves, ``Proposals.approve`` in the same transaction, as the MCP server runs
  them): take the order's lock exclusively, expire the order's proposals past their time to
  live, read the proposals and operations on the order, add the proposal, ask the policy
  (``on_the_order`` then ``auto_approvable``), approve if it says so, commit. The app's intake
  (``Outbox.enqueue``): one INSERT that takes the order's lock shared, then commit or roll back.
  A human's or staff's approval: read the proposal and ask ``decision_check``; take the order's
  lock exclusively; enqueue the operation and run the conditional UPDATE (still ``proposed``,
  younger than its time to live); commit, or roll back when the UPDATE changed nothing. A
  decline: ``decision_check``, the conditional UPDATE, commit. The sweeper's expiry is one
  autocommit UPDATE.
- **PostgreSQL under READ COMMITTED**: every statement sees what was committed when it ran,
  plus its own transaction's writes; an UPDATE of a row another open transaction updated waits
  for it and then re-checks its WHERE on the row as committed. An advisory lock held blocks a
  conflicting request (shared with shared never conflicts) until the holder commits or rolls
  back.
- **time**: a proposal still waiting may pass its time to live at any moment (by the
  database's clock); the sweeper may run at any moment.

Invariants: the policy never approves a second refund on the order by itself (at its commit no
other refund of the order is live or done: another live proposal, or the app's operation,
committed or written by a transaction still open that later commits); no proposal is approved
after it was declined (or withdrawn) or expired, nor while past its time to live; a proposal is
approved at most once (one approval, one operation). Settlement: every proposal ends approved,
declined or expired, and every transaction ends.

Docs (the "Approvals" section of docs/model.md):

## Approvals

The approvals model (`tests/model/approvals.py`) explores one order on which AI agents propose
refunds and the app enqueues its own. Its actors are the agents' requests (each one
transaction: the order's lock taken exclusively, expiry of the order's proposals past their
time to live, the read of the order's proposals and operations, the new proposal, the policy's
decision and, when it approves, the approval, then commit), the app's intake (one INSERT that
takes the order's lock shared, then commit or roll back), a human (the agent's client) and a
staff member, each approving or declining a waiting proposal in its own transaction, the
sweeper that expires proposals, and the clock, which may age any waiting proposal past its time
to live at any moment. Storage is PostgreSQL under READ COMMITTED: a statement sees what was
committed when it ran and its own writes; a conditional UPDATE of a row another open
transaction updated waits and re-checks its WHERE; an advisory lock blocks conflicting requests
until its holder's transaction ends. Every decision is Settled's own function:
`outbox.proposals.on_the_order` and `auto_approvable` (the policy), `decision_check` (whether a
proposal in a status may be approved or declined). Invariants: the policy never approves a
second refund on the order by itself, counting the app's refund committed or written by a
transaction still open that later commits; no approval of a declined, withdrawn or expired
proposal, nor of one past its time to live; at most one approval and one operation per
proposal; and every proposal ends approved, declined or expired. CI explores three
configurations exhaustively (two agents' proposals; one proposal and the app's intake; two
proposals and the app's intake; each with the policy, a human per proposal and staff).
Broken variants, each caught: the intake without its shared lock, the policy without its
exclusive lock, the policy ignoring the app's own refunds, an approval UPDATE not conditional
on the status, and one that ignores the time to live.
Abstracted away: other orders and tenants (their locks never meet this one's, but for
stripes, which cost a wait only), repeats (the agents ask for different amounts), the lock
queue's fairness (PostgreSQL queues a shared request behind a waiting exclusive one: a matter
of waiting, not of answers), and the instant between an approval's reading of the database's
clock and its UPDATE (a proposal may be approved within that round trip of its expiry).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from outbox.proposals import (
    APPROVED,
    DECLINED,
    EXPIRED,
    LIVE,
    PROPOSED,
    auto_approvable,
    decision_check,
    on_the_order,
)
from outbox.states import State as OpState
from tests.model.engine import Invariant, Step

KIND = "refund"
APP = "app"
STAFF = "staff"
NAMES = "abcdefgh"
T = TypeVar("T")
#: a transaction's writes: ("prop", proposal, status) or ("op", origin)
Write = tuple[str, int | str, str]


@dataclass(frozen=True)
class SeenProposal:
    """A proposal row as the rules read it."""

    status: str
    op_id: str | None


@dataclass(frozen=True)
class SeenOperation:
    """An operation row as the rules read it."""

    kind: str
    op_id: str
    state: str


@dataclass(frozen=True)
class Txn:
    """An open transaction: what it does next (``pc``), the decision it is carrying out
    (``to``, ``target``), its advisory locks, its writes (none visible to others before
    commit), and, for an agent's request, whether the policy approved."""

    pc: str
    to: str = ""
    target: int = -1
    excl: bool = False
    shared: bool = False
    writes: tuple[Write, ...] = ()
    auto: bool = False


@dataclass(frozen=True)
class World:
    """One state: committed rows, open transactions, what each actor has left to do, and the
    history the invariants judge."""

    #: per proposal: its committed status ("" before it is committed) and whether it is past
    #: its time to live
    rows: tuple[tuple[str, bool], ...]
    #: committed operations, by origin (``app``, or ``p<i>``: proposal i's approval)
    ops: tuple[str, ...]
    #: per slot (agents, the app, humans, staff): its open transaction
    txns: tuple[Txn | None, ...]
    #: per slot: "start" (not begun), "done", "idle" (may act); staff: proposals decided
    progress: tuple[str, ...]
    #: per proposal: the decisions committed on it, in order (``status@actor``; an approval
    #: past the time to live is ``approved-late``)
    hist: tuple[tuple[str, ...], ...]
    #: (policy-approved proposal, other refund) written by a transaction open at its commit
    taint: frozenset[tuple[int, str]] = frozenset()
    second: str | None = None


def _with(t: tuple[T, ...], i: int, v: T) -> tuple[T, ...]:
    """``t`` with item ``i`` replaced by ``v``."""
    return (*t[:i], v, *t[i + 1 :])


class ApprovalsModel:
    """Agents' proposals on one order (``amounts``, each under the policy's ``limit``), the
    app's intake (``app``), a human per proposal, one staff member, the sweeper and the clock.

    The keyword switches break one rule each (the variants the checker must catch)."""

    def __init__(
        self,
        name: str,
        *,
        amounts: Sequence[int],
        app: bool,
        limit: int = 5000,
        intake_lock: bool = True,
        policy_lock: bool = True,
        policy_sees_app: bool = True,
        decide_checks_status: bool = True,
        decide_checks_age: bool = True,
    ) -> None:
        self.name = name
        self.amounts = tuple(amounts)
        self.app = app
        self.limit = limit
        self.intake_lock = intake_lock
        self.policy_lock = policy_lock
        self.policy_sees_app = policy_sees_app
        self.decide_checks_status = decide_checks_status
        self.decide_checks_age = decide_checks_age
        n = len(self.amounts)
        self.n = n
        self.app_slot = n
        self.human_slot = n + 1  # humans: n+1 .. 2n
        self.staff_slot = 2 * n + 1
        self.actors = (
            [f"agent-{NAMES[i]}" for i in range(n)]
            + [APP]
            + [f"human-{NAMES[i]}" for i in range(n)]
            + [STAFF]
        )

    # -- the protocol ------------------------------------------------------------------------

    def initial(self) -> Iterable[World]:
        n = self.n
        progress = ("start",) * n + ("start" if self.app else "done",) + ("idle",) * n + ("",)
        yield World(
            rows=(("", False),) * n,
            ops=(),
            txns=(None,) * (2 * n + 2),
            progress=progress,
            hist=((),) * n,
        )

    def invariants(self) -> Sequence[Invariant]:
        return [
            Invariant("a second refund is never approved by the policy alone", _second),
            Invariant("no approval of a declined, withdrawn or expired proposal", _approved_dead),
            Invariant("each proposal approved at most once", _approved_once),
        ]

    def settled(self, w: World) -> bool:
        return (
            all(t is None for t in w.txns)
            and all(w.progress[i] == "done" for i in range(self.n + 1))
            and all(status not in ("", PROPOSED) for status, _ in w.rows)
        )

    def describe(self, w: World) -> str:
        rows = " ".join(
            f"{NAMES[i]}={s or '-'}{'(aged)' if aged else ''}" for i, (s, aged) in enumerate(w.rows)
        )
        lines = [f"proposals: {rows}; operations: {', '.join(w.ops) or 'none'}"]
        for slot, t in enumerate(w.txns):
            if t is not None:
                locks = "X" if t.excl else ("S" if t.shared else "-")
                writes = ", ".join(f"{k}:{a}{'=' + b if b else ''}" for k, a, b in t.writes)
                lines.append(f"open {self.actors[slot]}: next {t.pc}, lock {locks}, [{writes}]")
        decided = "; ".join(f"{NAMES[j]}: {', '.join(h)}" for j, h in enumerate(w.hist) if h)
        if decided:
            lines.append(f"decided: {decided}")
        if w.second:
            lines.append(f"policy: {w.second}")
        return "\n".join(lines)

    def successors(self, w: World) -> Iterator[tuple[Step, World]]:
        for i in range(self.n):
            yield from self._agent(w, i)
        if self.app:
            yield from self._app(w)
        for i in range(self.n):
            yield from self._decider(w, self.human_slot + i, i)
        yield from self._decider(w, self.staff_slot, None)
        yield from self._sweeper(w)
        yield from self._clock(w)

    # -- storage -----------------------------------------------------------------------------

    def _seen(self, w: World, me: int) -> list[str]:
        """Each proposal's status as a statement of slot ``me`` sees it (its own writes over
        the committed rows)."""
        seen = [status for status, _ in w.rows]
        t = w.txns[me]
        if t is not None:
            for k, a, b in t.writes:
                if k == "prop":
                    assert isinstance(a, int)
                    seen[a] = b
        return seen

    def _row_locked(self, w: World, me: int, i: int) -> bool:
        """Whether another open transaction has updated proposal ``i`` (its row lock)."""
        for slot, t in enumerate(w.txns):
            if (
                slot != me
                and t is not None
                and any(k == "prop" and a == i and b != "" for k, a, b in t.writes)
            ):
                return True
        return False

    def _lock_free(self, w: World, me: int, *, shared: bool) -> bool:
        """Whether slot ``me`` may take the order's lock (shared or exclusive) now."""
        for slot, t in enumerate(w.txns):
            if slot != me and t is not None and (t.excl or (not shared and t.shared)):
                return False
        return True

    def _commit(self, w: World, slot: int, done: str) -> World:
        """``slot``'s transaction committed: its writes applied, its locks released."""
        t = w.txns[slot]
        assert t is not None
        rows = list(w.rows)
        ops = list(w.ops)
        hist = list(w.hist)
        origin_of: list[str] = []
        for k, a, b in t.writes:
            if k == "prop":
                assert isinstance(a, int)
                aged = rows[a][1]
                if b == "":  # the insert
                    rows[a] = (PROPOSED, aged)
                    origin_of.append(f"p{a}")
                else:
                    rows[a] = (b.partition("@")[0].removesuffix("-late"), aged)
                    hist[a] = (*hist[a], b)
            else:
                assert isinstance(a, str)
                ops.append(a)
                origin_of.append(a)
        w2 = replace(
            w,
            rows=tuple(rows),
            ops=tuple(sorted(ops)),
            hist=tuple(hist),
            txns=_with(w.txns, slot, None),
            progress=_with(w.progress, slot, done),
        )
        return self._judge_policy(w2, w, slot, t, origin_of)

    def _judge_policy(
        self, w2: World, before: World, slot: int, t: Txn, written: list[str]
    ) -> World:
        """The policy's invariant's bookkeeping at a commit: a refund committing that was
        written while a policy approval committed is a second refund the policy approved."""
        second = w2.second
        taint = set(w2.taint)
        for i, other in list(taint):
            if other in written:
                second = (
                    second
                    or f"proposal {NAMES[i]} approved by the policy while {other} was written"
                )
        if t.auto:
            i = slot
            others: list[str] = []
            for j, (status, _) in enumerate(before.rows):
                if j != i and status in LIVE:
                    others.append(f"p{j}")
            others += [o for o in before.ops if o != f"p{i}"]
            if others:
                second = (
                    second
                    or f"proposal {NAMES[i]} approved by the policy with {others[0]} on the order"
                )
            for t2 in w2.txns:
                if t2 is not None:
                    for k, a, b in t2.writes:
                        if k == "op":
                            taint.add((i, str(a)))
                        elif b == "":
                            taint.add((i, f"p{a}"))
        # a transaction that ends without committing its writes drops its taints
        return replace(w2, second=second, taint=frozenset(taint))

    def _end(self, w: World, slot: int, done: str) -> World:
        """``slot``'s transaction rolled back (or ended without writing)."""
        t = w.txns[slot]
        assert t is not None
        gone = {str(a) if k == "op" else f"p{a}" for k, a, b in t.writes if k == "op" or b == ""}
        taint = frozenset(x for x in w.taint if x[1] not in gone)
        return replace(
            w,
            txns=_with(w.txns, slot, None),
            progress=_with(w.progress, slot, done),
            taint=taint,
        )

    # -- the actors --------------------------------------------------------------------------

    def _agent(self, w: World, i: int) -> Iterator[tuple[Step, World]]:
        actor = self.actors[i]
        t = w.txns[i]
        if w.progress[i] == "start" and t is None:
            if not self.policy_lock:
                yield Step(actor, "begins (no lock)"), self._open(w, i, Txn("read"))
            elif self._lock_free(w, i, shared=False):
                yield (
                    Step(actor, "locks the order (exclusive)"),
                    self._open(w, i, Txn("read", excl=True)),
                )
            return
        if t is None:
            return
        if t.pc == "read":
            # expire_waiting on the order (row locks), then the reads, the insert, the policy
            seen = self._seen(w, i)
            stale = [j for j, (s, aged) in enumerate(w.rows) if aged and seen[j] == PROPOSED]
            if any(self._row_locked(w, i, j) for j in stale):
                return
            writes: list[Write] = [("prop", j, f"{EXPIRED}@{actor}") for j in stale]
            for j in stale:
                seen[j] = EXPIRED
            ever = [
                SeenProposal(s, f"op-p{j}" if s == APPROVED else None)
                for j, s in enumerate(seen)
                if s != "" and j != i
            ]
            ops = [SeenOperation(KIND, f"op-{o}", OpState.PLANNED.value) for o in w.ops]
            if not self.policy_sees_app:
                ops = [op for op in ops if op.op_id != f"op-{APP}"]
            live, others = on_the_order(ever, ops, KIND)
            amount = self.amounts[i]
            auto = auto_approvable(self.limit, amount, live, others)
            writes.append(("prop", i, ""))
            detail: tuple[tuple[str, object], ...] = (
                ("live", len(live)),
                ("app_ops", len(others)),
                ("amount", amount),
                ("limit", self.limit),
                ("auto", auto),
            )
            if auto:
                # Proposals.approve in the same transaction: its own row, the lock it holds
                check = decision_check(PROPOSED, False, APPROVED)
                assert check is None
                writes += [("op", f"p{i}", ""), ("prop", i, f"{APPROVED}@policy")]
            t2 = replace(t, pc="commit", writes=t.writes + tuple(writes), auto=auto)
            action = "proposes; the policy approves" if auto else "proposes; asks a person"
            yield (
                Step(actor, action, detail),
                replace(
                    w,
                    txns=_with(w.txns, i, t2),
                ),
            )
        elif t.pc == "commit":
            w2 = self._commit(w, i, "done")
            if t.auto:  # nobody is asked
                w2 = replace(w2, progress=_with(w2.progress, self.human_slot + i, "done"))
            yield Step(actor, "commits"), w2

    def _open(self, w: World, slot: int, t: Txn) -> World:
        return replace(w, txns=_with(w.txns, slot, t))

    def _app(self, w: World) -> Iterator[tuple[Step, World]]:
        slot = self.app_slot
        t = w.txns[slot]
        if w.progress[slot] == "start" and t is None:
            if not self.intake_lock or self._lock_free(w, slot, shared=True):
                how = "takes the order's lock (shared)" if self.intake_lock else "no lock"
                t2 = Txn("end", shared=self.intake_lock, writes=(("op", APP, ""),))
                yield Step(APP, f"enqueues a refund on the order ({how})"), self._open(w, slot, t2)
            return
        if t is not None:
            yield Step(APP, "commits"), self._commit(w, slot, "done")
            yield Step(APP, "rolls back"), self._end(w, slot, "done")

    def _decider(self, w: World, slot: int, only: int | None) -> Iterator[tuple[Step, World]]:
        """A human (``only``: the proposal the agent's client asked about) or staff (any
        waiting proposal, each once) approving or declining in a transaction of its own."""
        actor = self.actors[slot]
        t = w.txns[slot]
        if t is None:
            if only is not None:
                # asked once the agent's request committed without the policy's approval
                if w.progress[slot] != "idle" or w.progress[only] != "done":
                    return
                targets = [only]
            else:
                # a proposal the staff's list showed waiting, decided from that (perhaps
                # stale) list: any committed proposal, once
                taken = w.progress[slot]
                targets = [j for j, (s, _) in enumerate(w.rows) if s and NAMES[j] not in taken]
            for j in targets:
                for to in (APPROVED, DECLINED):
                    yield from self._find(w, slot, actor, j, to)
            return
        j = t.target
        if t.pc == "lock":
            if self._lock_free(w, slot, shared=False):
                yield (
                    Step(actor, "locks the order (exclusive)"),
                    self._open(w, slot, replace(t, pc="update", excl=True)),
                )
        elif t.pc == "update":
            if self._row_locked(w, slot, j):
                return  # waits for the other transaction's row lock
            status, aged = w.rows[j]  # re-checked on the row as committed
            ok = (status == PROPOSED or not self.decide_checks_status) and (
                t.to == DECLINED or not aged or not self.decide_checks_age
            )
            detail = (("status", status), ("aged", aged), ("updated", ok))
            if not ok:
                yield (
                    Step(actor, f"UPDATE to {t.to} changes nothing; rolls back", detail),
                    (self._end(w, slot, self._done(w, slot, j))),
                )
                return
            writes = list(t.writes)
            label = t.to + ("-late" if aged and t.to == APPROVED else "")
            if t.to == APPROVED:
                writes.append(("op", f"p{j}", ""))
            writes.append(("prop", j, f"{label}@{actor}"))
            yield (
                Step(
                    actor, f"{'enqueues and ' if t.to == APPROVED else ''}marks it {t.to}", detail
                ),
                self._open(w, slot, replace(t, pc="commit", writes=tuple(writes))),
            )
        elif t.pc == "commit":
            yield Step(actor, "commits"), self._commit(w, slot, self._done(w, slot, j))

    def _done(self, w: World, slot: int, j: int) -> str:
        if slot == self.staff_slot:
            return w.progress[slot] + NAMES[j]
        return "done"

    def _find(
        self, w: World, slot: int, actor: str, j: int, to: str
    ) -> Iterator[tuple[Step, World]]:
        status, aged = w.rows[j]
        expired = status == EXPIRED or (status == PROPOSED and aged)
        check = decision_check(status, expired, to)
        detail = (
            ("proposal", NAMES[j]),
            ("status", status),
            ("expired", expired),
            ("check", check),
        )
        verb = "approve" if to == APPROVED else "decline"
        if check is not None:
            # unchanged, or refused: nothing written; the transaction ends
            w2 = replace(w, progress=_with(w.progress, slot, self._done(w, slot, j)))
            yield Step(actor, f"asks to {verb}; answered {check}", detail), w2
            return
        pc = "lock" if to == APPROVED else "update"
        yield Step(actor, f"asks to {verb}", detail), self._open(w, slot, Txn(pc, to=to, target=j))

    def _sweeper(self, w: World) -> Iterator[tuple[Step, World]]:
        due = [j for j, (s, aged) in enumerate(w.rows) if s == PROPOSED and aged]
        if not due or any(self._row_locked(w, -1, j) for j in due):
            return
        rows = list(w.rows)
        hist = list(w.hist)
        for j in due:
            rows[j] = (EXPIRED, True)
            hist[j] = (*hist[j], f"{EXPIRED}@sweeper")
        names = ",".join(NAMES[j] for j in due)
        yield Step("sweeper", f"expires {names}"), replace(w, rows=tuple(rows), hist=tuple(hist))

    def _clock(self, w: World) -> Iterator[tuple[Step, World]]:
        for j, (s, aged) in enumerate(w.rows):
            if s == PROPOSED and not aged:
                rows = _with(w.rows, j, (s, True))
                yield (
                    Step("clock", f"{NAMES[j]} passes its time to live"),
                    replace(
                        w,
                        rows=rows,
                    ),
                )


# -- the invariants ------------------------------------------------------------------------


def _second(w: World) -> str | None:
    return w.second


def _approved_dead(w: World) -> str | None:
    for j, labels in enumerate(w.hist):
        h = [label.partition("@")[0] for label in labels]
        for n, decision in enumerate(h):
            if decision == APPROVED + "-late":
                return f"proposal {NAMES[j]} approved past its time to live"
            if decision == APPROVED and any(d in (DECLINED, EXPIRED) for d in h[:n]):
                return f"proposal {NAMES[j]} approved after it was {h[n - 1]}"
    return None


def _approved_once(w: World) -> str | None:
    for j, h in enumerate(w.hist):
        approvals = sum(d.startswith(APPROVED) for d in h)
        ops = w.ops.count(f"p{j}")
        if approvals > 1 or ops > 1:
            return f"proposal {NAMES[j]} approved {approvals} times, {ops} operations"
    return None


TWO = (1000, 2000)
CONFIGURATIONS: dict[str, ApprovalsModel] = {
    "approvals: two agents": ApprovalsModel("approvals: two agents", amounts=TWO, app=False),
    "approvals: agent and app": ApprovalsModel(
        "approvals: agent and app", amounts=(1000,), app=True
    ),
    "approvals: two agents and app": ApprovalsModel(
        "approvals: two agents and app", amounts=TWO, app=True
    ),
}
#: larger configurations for a long run (three agents: about 140,000 states, 30 s)
LONG: dict[str, ApprovalsModel] = {
    "approvals: three agents": ApprovalsModel(
        "approvals: three agents", amounts=(*TWO, 3000), app=False
    ),
}
VARIANTS: dict[str, ApprovalsModel] = {
    "intake without the shared lock": ApprovalsModel(
        "approvals, broken: intake without the shared lock",
        amounts=(1000,),
        app=True,
        intake_lock=False,
    ),
    "policy without the exclusive lock": ApprovalsModel(
        "approvals, broken: policy without the exclusive lock",
        amounts=(1000,),
        app=True,
        policy_lock=False,
    ),
    "policy ignores the app's refunds": ApprovalsModel(
        "approvals, broken: policy ignores the app's refunds",
        amounts=(1000,),
        app=True,
        policy_sees_app=False,
    ),
    "approval not conditional on the status": ApprovalsModel(
        "approvals, broken: approval not conditional on the status",
        amounts=(1000,),
        app=False,
        limit=0,
        decide_checks_status=False,
    ),
    "approval ignores the time to live": ApprovalsModel(
        "approvals, broken: approval ignores the time to live",
        amounts=(1000,),
        app=False,
        limit=0,
        decide_checks_age=False,
    ),
}
