"""Bad input to the run API (``outbox.runs``): typed errors, nothing written, on both databases."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from outbox import runs
from outbox.errors import InvalidIdentifier, InvalidInput, NotFound
from outbox.intake import Outbox
from outbox.models import Operation, OperationEvent, Run
from tests.support.rig import GOOD

UNSTORABLE = ["a\x00b", "\ud800", "line\nbreak", "", "x" * 201]


def rows(engine: Engine) -> tuple[int, int, int]:
    with Session(engine) as s:
        return tuple(  # type: ignore[return-value]
            int(s.scalar(select(func.count()).select_from(model)) or 0)
            for model in (Run, Operation, OperationEvent)
        )


@pytest.mark.parametrize("title", UNSTORABLE)
def test_a_run_title_that_cannot_be_stored_is_invalid_input(engine: Engine, title: str) -> None:
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidInput) as info:
            runs.open_run(s, tenant="acme", title=title)
        assert info.value.code == "invalid_title"
        assert not s.new
    assert rows(engine) == (0, 0, 0)


def test_a_unicode_title_is_stored_as_given(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        handle = runs.open_run(s, tenant="acme", title="退款 A1042 ✓").handle
    with Session(engine) as s:
        assert runs.find_run(s, "acme", handle).title == "退款 A1042 ✓"


@pytest.mark.parametrize("actor", UNSTORABLE[:4])
def test_a_cancel_by_an_actor_that_cannot_be_stored_changes_nothing(
    engine: Engine, outbox: Outbox, actor: str
) -> None:
    with Session(engine) as s, s.begin():
        run = runs.open_run(s, tenant="acme")
        outbox.enqueue(s, tenant="acme", op_id="op-1", kind="refund", params=GOOD, run=run)
        handle = run.handle
    before = rows(engine)
    with Session(engine) as s, s.begin(), pytest.raises(InvalidInput) as info:
        runs.cancel_run(s, "acme", handle, actor=actor)
    assert info.value.code == "invalid_actor"
    assert rows(engine) == before
    with Session(engine) as s:
        assert s.scalar(select(Operation.state)) == "planned"
        assert s.scalar(select(Run.cancel_requested_at)) is None


@pytest.mark.parametrize("op_id", ["\x00", "a\x00b", "\ud800", "óp-1", "o" * 81, "op-1\n", 7])
def test_an_op_id_that_could_not_exist_is_not_found(engine: Engine, op_id: object) -> None:
    with Session(engine) as s, pytest.raises(NotFound) as info:
        runs.operation_status(s, "acme", op_id)  # type: ignore[arg-type]
    assert info.value.code == "operation_not_found"


@pytest.mark.parametrize("tenant", ["\x00", "ac\x00me", "\ud800", "Acme"])
def test_a_malformed_tenant_is_an_invalid_identifier_on_every_read(
    engine: Engine, tenant: str
) -> None:
    with Session(engine) as s:
        for read in (
            lambda: runs.operation_status(s, tenant, "op-1"),
            lambda: runs.run_report(s, tenant, runs.new_handle()),
            lambda: runs.cancel_run(s, tenant, runs.new_handle(), actor="user"),
        ):
            with pytest.raises(InvalidIdentifier) as info:
                read()
            assert info.value.code == "invalid_tenant"
