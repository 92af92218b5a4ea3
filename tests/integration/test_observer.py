"""The services' observer hooks (``outbox.observer``) around real work: the executor's claim,
send and record of a real send to the simulator, the reconciler's lookup, in order; an
observer that fails changes no outcome; building a Celery app patches nothing."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from outbox import relay
from outbox.downstream import SubmitOutcome
from outbox.intake import Outbox
from outbox.observer import ClaimedBatch, NoObserver, Report
from outbox.settings import Settings
from outbox.states import State
from outbox.storage.claims import Claimed
from reconciler.reconcile import Reconciler
from settled import celery_app
from tests.support.rig import HOLD, Rig
from workers.executor import Executor
from workers.outcomes import RecordsOutcomes
from workers.recovery import RecoversSent
from workers.sending import SendsBatches

SQLITE = pytest.mark.parametrize("engine", ["sqlite"], indirect=True)


class Recording(NoObserver):
    """Writes down each hook's entry, report and exit, with what the rig saw at that moment
    (the downstream's requests, the operation's state)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.calls: list[tuple[Any, ...]] = []

    def _seen(self, claimed: Claimed) -> tuple[int, str]:
        return self.rig.sends(claimed.id), self.rig.op(claimed.id).state

    @contextmanager
    def claiming(self, hinted: Sequence[int]) -> Iterator[Report[ClaimedBatch]]:
        self.calls.append(("claiming", list(hinted)))

        def claimed(batch: ClaimedBatch) -> None:
            self.calls.append(("claimed", [c.op_id for c in batch.to_send]))

        yield claimed
        self.calls.append(("claimed, out",))

    @contextmanager
    def sending(self, claimed: Claimed) -> Iterator[Report[SubmitOutcome]]:
        self.calls.append(("sending", claimed.op_id, claimed.attempts, *self._seen(claimed)))
        yield lambda outcome: self.calls.append(("sent", outcome.proof.value))
        self.calls.append(("sent, out", *self._seen(claimed)))

    @contextmanager
    def recording(
        self, outcomes: Sequence[tuple[Claimed, SubmitOutcome]]
    ) -> Iterator[Report[Mapping[int, State]]]:
        (claimed, outcome), *_ = outcomes
        self.calls.append(("recording", claimed.op_id, outcome.proof.value, *self._seen(claimed)))
        yield lambda written: self.calls.append(("recorded", dict(written)))
        self.calls.append(("recorded, out", *self._seen(claimed)))

    @contextmanager
    def reconciling(self, claimed: Claimed) -> Iterator[Report[str]]:
        self.calls.append(("reconciling", claimed.op_id, self.rig.op(claimed.id).state))
        yield lambda outcome: self.calls.append(("reconciled", outcome))
        self.calls.append(("reconciled, out", self.rig.op(claimed.id).state))


@SQLITE
def test_the_hooks_are_called_in_order_around_a_real_send(rig: Rig) -> None:
    op = rig.enqueue("op-1")
    seen = Recording(rig)
    assert rig.executor(observer=seen).execute([op]) == {op: State.SUCCEEDED}
    assert seen.calls == [
        ("claiming", [op]),
        ("claimed", ["op-1"]),
        ("claimed, out",),
        # around the attempt: nothing sent yet on the way in, its answer back on the way out
        ("sending", "op-1", 1, 0, "submitted"),
        ("sent", "done"),
        ("sent, out", 1, "submitted"),
        # around the write: submitted on the way in, the outcome written on the way out
        ("recording", "op-1", "done", 1, "submitted"),
        ("recorded", {op: State.SUCCEEDED}),
        ("recorded, out", 1, "succeeded"),
    ]


@SQLITE
def test_the_reconcilers_hook_is_around_its_lookup(rig: Rig) -> None:
    lost = rig.enqueue("op-lost")
    rig.control.add_rule("commit_then_timeout", hold_seconds=HOLD, times=1)
    assert rig.executor().execute([lost]) == {lost: State.UNKNOWN}
    seen = Recording(rig)
    assert rig.reconciler(observer=seen).run_once().outcomes == {"found": 1}
    assert seen.calls == [
        ("reconciling", "op-lost", "unknown"),
        ("reconciled", "found"),
        ("reconciled, out", "succeeded"),
    ]


class Failing(NoObserver):
    """Every hook raises where ``where`` says: on the way in, in its report, or on the way
    out."""

    def __init__(self, where: str) -> None:
        self.where = where

    @contextmanager
    def _failing(self, *_: Any) -> Iterator[Report[Any]]:
        if self.where == "in":
            raise RuntimeError("observer broken on the way in")

        def report(_: object) -> None:
            if self.where == "report":
                raise RuntimeError("observer broken in its report")

        yield report
        if self.where == "out":
            raise RuntimeError("observer broken on the way out")

    claiming = sending = recording = recovering = reconciling = _failing  # type: ignore[assignment]

    def enqueuing(self, *_: Any, **__: Any) -> Any:
        return self._failing()

    def hinting(self, *_: Any) -> Any:
        return self._failing()


def observer_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "outbox.observer" and r.levelno == logging.ERROR and r.exc_info
    ]


@SQLITE
@pytest.mark.parametrize("where", ["in", "report", "out"])
def test_an_observer_that_fails_changes_no_outcome(
    rig: Rig, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    broken = Failing(where)
    rig.outbox = replace(rig.outbox, observer=broken)
    hinted: list[list[int]] = []
    op = rig.enqueue("op-1")
    assert relay.publish_hints(hinted.append, [op], observer=broken) == 1
    assert hinted == [[op]]

    assert rig.executor(observer=broken).execute([op]) == {op: State.SUCCEEDED}
    assert (rig.op(op).state, rig.sends(op), rig.effects(op)) == ("succeeded", 1, 1)
    errors = observer_errors(caplog)
    reporting = ("enqueuing", "claiming", "sending", "recording")  # hinting reports nothing
    for hook in reporting if where == "report" else ("hinting", *reporting):
        assert f"an observer failed in {hook}; the step goes on without it" in errors

    lost = rig.enqueue("op-lost")
    rig.control.add_rule("commit_then_timeout", hold_seconds=HOLD, times=1)
    assert rig.executor(observer=broken).execute([lost]) == {lost: State.UNKNOWN}
    assert rig.reconciler(observer=broken).run_once().outcomes == {"found": 1}
    assert rig.op(lost).state == "succeeded"
    assert "an observer failed in reconciling; the step goes on without it" in (
        observer_errors(caplog)
    )


def test_building_a_celery_app_patches_nothing(settings: Settings, tmp_path: Path) -> None:
    owners = (Executor, SendsBatches, RecordsOutcomes, RecoversSent, Reconciler, Outbox, relay)
    before = [dict(vars(owner)) for owner in owners]
    celery_app.create_app(
        settings.model_copy(
            update={"broker_url": "filesystem://", "broker_folder": str(tmp_path / "broker")}
        )
    )
    assert [dict(vars(owner)) for owner in owners] == before
