"""The judge of every fault test: the simulator's ledger against the states Settled reports."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from outbox.models import Operation
from settled.simulator import SimulatorControl


def check_truthful(sessions: sessionmaker[Session], control: SimulatorControl) -> None:
    """An operation reported ``rejected`` or ``cancelled`` caused no business effect; one
    reported ``succeeded`` on the downstream's receipt caused exactly one; none caused more."""
    effects: dict[tuple[str, str], int] = {}
    for e in control.ledger()["effects"]:
        key = (e["tenant"], e["idempotency_key"])
        effects[key] = effects.get(key, 0) + 1
    with sessions() as s:
        rows = s.execute(
            select(Operation.op_id, Operation.tenant, Operation.idempotency_key,
                   Operation.state, Operation.receipt)
        ).all()  # fmt: skip
    for row in rows:
        n = effects.get((row.tenant, row.idempotency_key), 0)
        assert n <= 1, f"{row.op_id} caused {n} effects"
        if row.state in ("rejected", "cancelled"):
            assert n == 0, f"{row.op_id} is {row.state} but caused {n} effect(s)"
        if row.state == "succeeded" and (row.receipt or {}).get("source") != "staff":
            assert n == 1, f"{row.op_id} is succeeded on a receipt but caused {n} effect(s)"
