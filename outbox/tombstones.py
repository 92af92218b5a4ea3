"""Tombstones: what is kept of each operation ``outbox.prune`` deletes, so that a replay of a
pruned ``(tenant, op_id)`` is answered as the operation would have answered it (the same
replay, or ``IdempotencyConflict`` for another intent) and never creates a second operation
under the same idempotency key.

A tombstone is small (no parameters, no receipt, no personal data beyond the op_id) and is
never deleted by ``prune``. ``prune_tombstones`` deletes those written longer ago than an age,
and says what that re-opens: an app that enqueues such an op_id again creates a new operation
with the same idempotency key, which a downstream past its key retention carries out again.
``outbox.storage.tombstones`` says why a prune and an intake of the same op_id at once cannot
make two operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox.models import OperationTombstone
from outbox.prune import BATCH_SIZE, age_words, check_age_and_batch
from outbox.storage import tombstones as store
from outbox.storage.operations import db_time

#: What ``settled ops prune-tombstones`` prints before it deletes anything.
WARNING = (
    "WARNING: a pruned operation's tombstone is what answers a replay of its op_id. Once it "
    "is deleted, an app that enqueues that (tenant, op_id) again creates a NEW operation with "
    "the SAME idempotency key: inside the downstream's key retention the downstream replays "
    "its first answer; past it, the refund is carried out a second time. Delete only "
    "tombstones older than any retransmission your apps can make."
)


@dataclass(frozen=True)
class Tombstone:
    """A pruned operation as a replay of it is answered (``outbox.intake.Enqueued.pruned``):
    its final state (and reason, if rejected), the downstream's reference, when it was
    created and when it was pruned. Its id, run, parameters and receipt are gone."""

    tenant: str
    op_id: str
    kind: str
    state: str
    reason: str | None
    idempotency_key: str
    #: the downstream's reference for the effect (None: it had none)
    reference: str | None
    created_at: datetime
    pruned_at: datetime

    @classmethod
    def of(cls, row: OperationTombstone) -> Tombstone:
        return cls(
            tenant=row.tenant,
            op_id=row.op_id,
            kind=row.kind,
            state=row.state,
            reason=row.reason,
            idempotency_key=row.idempotency_key,
            reference=row.downstream_ref,
            created_at=row.created_at,
            pruned_at=row.pruned_at,
        )


@dataclass(frozen=True)
class TombstonesPruned:
    """What ``prune_tombstones`` did (or, ``dry_run``, would do)."""

    older_than: timedelta
    dry_run: bool
    tombstones: int

    def summary(self) -> str:
        """One line: "deleted 1,204 tombstones older than 400 days"."""
        verb = "would delete" if self.dry_run else "deleted"
        return f"{verb} {self.tombstones:,} tombstones older than {age_words(self.older_than)}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "older_than_seconds": self.older_than.total_seconds(),
            "tombstones": self.tombstones,
        }


def prune_tombstones(
    engine: Engine, older_than: timedelta, *, dry_run: bool = False, batch_size: int = BATCH_SIZE
) -> TombstonesPruned:
    """Delete the tombstones written (operations pruned) longer than ``older_than`` ago, in
    batches of ``batch_size``, one short transaction each; ``dry_run``: count only. This
    re-opens those op_ids to a second execution (``WARNING``). InvalidInput, before anything
    is deleted, for a bad age or batch size."""
    check_age_and_batch(older_than, batch_size)
    with Session(engine) as session:
        cutoff = db_time(session) - older_than
        if dry_run:
            return TombstonesPruned(older_than, True, store.count_older(session, cutoff))
    deleted = 0
    while True:
        with Session(engine) as session, session.begin():
            gone = store.delete_older(session, cutoff, batch_size)
        deleted += gone
        if gone < batch_size:
            return TombstonesPruned(older_than, False, deleted)
