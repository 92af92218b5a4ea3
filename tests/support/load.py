"""The app under load for the failover tests: one refund per transaction, one after the other,
while a test takes an engine away (``Producer``), and the judgement after
(``judge_committed``): every refund the app saw committed is in the database, done exactly once
by the simulator's ledger, every state true."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from outbox.models import Operation
from tests.integration.test_celery_worker import GOOD, wait_settled
from tests.support.judge import check_truthful

if TYPE_CHECKING:
    from outbox.intake import Outbox
    from settled.simulator import SimulatorControl
    from tests.integration.test_celery_worker import App
    from tests.support.stack import Stack


class Producer(threading.Thread):
    """One refund per transaction, ``rate`` a second at most (an app's steady traffic: how
    many refunds a failover test judges does not depend on how fast commits are while the
    broker is away, when the app skips its hints). A commit that fails (the database or its
    pool gone, or the commit's outcome unknown) is tried again with the same ``op_id``, as
    an app does: intake answers the operation already there if it had committed. Only a
    commit that returned counts as committed. ``recovered`` is how long after ``mark()`` the
    first commit after a failure returned."""

    def __init__(self, app: App, outbox: Outbox, rate: float = 100.0) -> None:
        super().__init__(daemon=True)
        self.app, self.outbox = app, outbox
        self.period = 1 / rate
        self.committed: list[str] = []
        self.failures = 0
        self.marked: float | None = None
        self.recovered: float | None = None
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def mark(self) -> int:
        """The fault starts now; the number committed so far."""
        self.marked = time.monotonic()
        return len(self.committed)

    def run(self) -> None:
        n = 0
        failed = False
        due = time.monotonic()
        try:
            while not self.stopping.wait(max(0.0, due - time.monotonic())):
                due = max(due + self.period, time.monotonic() - self.period)
                op_id = f"load-{n}"
                try:
                    with self.app.sessions.begin() as s:
                        self.outbox.enqueue(
                            s, tenant="acme", op_id=op_id, kind="refund",
                            params={**GOOD, "amount_minor": 100 + n},
                        )  # fmt: skip
                except DBAPIError:
                    self.failures += 1
                    failed = True
                    self.stopping.wait(0.05)  # the app's own pause before it tries again
                    continue
                if failed and self.recovered is None and self.marked is not None:
                    self.recovered = time.monotonic() - self.marked
                self.committed.append(op_id)
                n += 1
        except BaseException as exc:  # the test reads it: a thread's error is otherwise lost
            self.error = exc

    def finish(self) -> None:
        self.stopping.set()
        self.join(10)
        assert not self.is_alive(), "the producer did not stop"
        assert self.error is None, self.error


def judge_committed(
    app: App, stack: Stack, producer: Producer, control: SimulatorControl, timeout: float = 120
) -> list[int]:
    """0 lost, 0 dup, 0 lies: every refund ``producer`` saw committed is in the database and
    ends done, exactly once by the ledger; every operation's state agrees with the ledger.
    The operations' ids."""
    with app.sessions() as s:
        rows = s.execute(
            select(Operation.op_id, Operation.id).where(Operation.op_id.in_(producer.committed))
        ).all()
    ids = {op_id: op for op_id, op in rows}
    assert sorted(ids) == sorted(producer.committed)  # none lost
    states = wait_settled(app, stack, list(ids.values()), timeout=timeout)
    assert set(states.values()) == {"succeeded"}, states
    counts = control.effect_counts("acme")  # one read of the ledger, however many refunds
    effects = [counts[key] for key in app.keys(list(ids.values()))]
    assert effects == [1] * len(ids)  # each done, exactly once
    check_truthful(app.sessions, control)
    return list(ids.values())
