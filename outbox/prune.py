"""Pruning terminal operations by age (``settled ops prune``, or ``prune`` from a scheduler
of your own): the operations table and its events grow without bound otherwise.

``prune(engine, timedelta(days=90))`` deletes every terminal operation (succeeded, rejected,
cancelled) that has neither changed nor had an event for that long, with its events,
attempts (lookups are events) and review items, and the runs left with no operation. It never
deletes a live operation, one in review, one whose run still has an operation that stays
(the run's report is read whole), one an operation that stays compensates, nor a
compensation whose original stays (``outbox.storage.prune`` says which are held).

It works in batches (``batch_size`` operations, one short transaction each, the rows locked
for that transaction only), highest id first, so it never holds a lock for long and can run
beside the workers. With ``archive`` each operation and its rows are appended to that file
as one JSON line before its batch commits (a crash may archive a batch that is then not
deleted, and the next run archives it again: never one deleted without its line). With
``dry_run`` nothing is deleted or written: the counts say what would go.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from outbox.errors import InvalidInput
from outbox.storage import prune as store
from outbox.storage.operations import db_time

BATCH_SIZE = 500
MAX_BATCH_SIZE = 5000
#: above every id (BIGINT)
_TOP = 2**63 - 1


@dataclass(frozen=True)
class Pruned:
    """What a prune did (or, ``dry_run``, would do)."""

    older_than: timedelta
    dry_run: bool = False
    operations: int = 0
    events: int = 0
    attempts: int = 0
    review_items: int = 0
    runs: int = 0

    def summary(self) -> str:
        """One line: "pruned 1,204 operations and 9,811 events older than 90 days"."""
        verb = "would prune" if self.dry_run else "pruned"
        return (
            f"{verb} {self.operations:,} operations and {self.events:,} events older than "
            f"{age_words(self.older_than)}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "older_than_seconds": self.older_than.total_seconds(),
            "operations": self.operations,
            "events": self.events,
            "attempts": self.attempts,
            "review_items": self.review_items,
            "runs": self.runs,
        }


def prune(
    engine: Engine,
    older_than: timedelta,
    *,
    archive: str | os.PathLike[str] | None = None,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
) -> Pruned:
    """Delete the terminal operations untouched for ``older_than`` and what hangs on them,
    appending them first to ``archive`` (JSON lines) if given; ``dry_run``: count only.
    InvalidInput, before anything is deleted, for a bad age, batch size or archive."""
    _check(older_than, batch_size, archive, dry_run)
    with _archive(archive) as sink:
        return _Pruning(engine, older_than, batch_size, dry_run, sink).run()


class _Pruning:
    """One prune's batches and its running totals."""

    def __init__(
        self,
        engine: Engine,
        older_than: timedelta,
        batch_size: int,
        dry_run: bool,
        sink: _Archive | None,
    ) -> None:
        self.engine, self.batch_size, self.dry_run, self.sink = engine, batch_size, dry_run, sink
        self.older_than = older_than
        self.totals = [0, 0, 0, 0, 0]  # operations, events, attempts, review items, runs
        #: the compensations pruned (or, dry run, that would be) so far
        self.gone: set[int] = set()
        #: dry run: operations not yet counted in each run some were counted of
        self.run_left: dict[int, int] = {}

    def run(self) -> Pruned:
        with Session(self.engine) as session:
            self.cutoff = db_time(session) - self.older_than
            self.compensations = store.compensations(session)
        below, retried = _TOP, False
        while True:
            with Session(self.engine) as session, session.begin():
                rows = store.candidates(session, cutoff=self.cutoff, below=below,
                                        limit=self.batch_size, lock=not self.dry_run)  # fmt: skip
                if not rows:
                    break
                chosen = self._chosen(session, rows)
                if chosen and not self._batch(session, rows, chosen):
                    if retried:
                        raise InvalidInput(
                            "operations being pruned keep getting new compensations; "
                            "run it again later",
                            code="prune_contended",
                        )
                    retried = True  # the same batch again, with the compensations read anew
                    self.compensations = store.compensations(session)
                    continue
            below, retried = min(row[0] for row in rows), False
        ops, events, attempts, reviews, runs = self.totals
        return Pruned(self.older_than, self.dry_run, ops, events, attempts, reviews, runs)

    def _chosen(
        self, session: Session, rows: list[tuple[int, int | None, int | None]]
    ) -> list[int]:
        """Those of the candidates that may go: not a compensation whose original is held,
        nor an operation that a compensation which stays offsets."""
        originals = {original for _, _, original in rows if original is not None}
        held = store.held_among(session, originals, cutoff=self.cutoff)
        chosen = {i for i, _, original in rows if original is None or original not in held}
        changed = True
        while changed:
            staying = {i for i in chosen if self.compensations.get(i, set()) - self.gone - chosen}
            chosen -= staying
            changed = bool(staying)
        return sorted(chosen)

    def _batch(
        self, session: Session, rows: list[tuple[int, int | None, int | None]], chosen: list[int]
    ) -> bool:
        """Prune (or count) one batch; False: an operation of it turned out to be referenced
        (a compensation made since the map was read): nothing of it was deleted."""
        picked = set(chosen)
        run_ids = {run_id for i, run_id, _ in rows if i in picked and run_id is not None}
        if self.dry_run:
            events, attempts, reviews = store.counts(session, chosen)
            runs = self._runs_emptied(session, rows, picked)
            counted = (len(chosen), events, attempts, reviews, runs)
        else:
            lines = store.rows_of(session, chosen) if self.sink is not None else []
            try:
                with session.begin_nested():
                    ops, events, attempts, reviews = store.delete_operations(session, chosen)
            except IntegrityError:
                return False
            try:
                with session.begin_nested():
                    runs = store.delete_empty_runs(session, run_ids)
            except IntegrityError:
                runs = 0  # an operation was added to one meanwhile: the runs stay
            if self.sink is not None:  # on disk before the batch's delete commits
                self.sink.append(lines)
            counted = (ops, events, attempts, reviews, runs)
        self.totals = [a + b for a, b in zip(self.totals, counted, strict=True)]
        self.gone |= {i for i, _, original in rows if i in picked and original is not None}
        return True

    def _runs_emptied(
        self, session: Session, rows: list[tuple[int, int | None, int | None]], picked: set[int]
    ) -> int:
        """Dry run: how many runs this batch would leave with no operation (and no proposal)."""
        in_runs = [run_id for i, run_id, _ in rows if i in picked and run_id is not None]
        new = {r for r in in_runs if r not in self.run_left}
        if new:
            self.run_left.update(store.run_sizes(session, new))
        emptied = set()
        for run_id in in_runs:
            self.run_left[run_id] -= 1
            if self.run_left[run_id] == 0:
                emptied.add(run_id)
                del self.run_left[run_id]
        return len(emptied - store.runs_proposed(session, emptied)) if emptied else 0


def _check(older_than: object, batch_size: object, archive: object, dry_run: bool) -> None:
    check_age_and_batch(older_than, batch_size)
    if archive is not None and dry_run:
        raise InvalidInput("a dry run writes nothing: drop the archive", code="invalid_archive",
                           field="archive")  # fmt: skip


def check_age_and_batch(older_than: object, batch_size: object) -> None:
    """InvalidInput unless ``older_than`` is a positive timedelta and ``batch_size`` an int from
    1 to ``MAX_BATCH_SIZE`` (the operations' prune and the tombstones')."""
    if not isinstance(older_than, timedelta) or older_than <= timedelta(0):
        raise InvalidInput("older_than is a positive timedelta", code="invalid_age",
                           field="older_than")  # fmt: skip
    if (
        not isinstance(batch_size, int)
        or isinstance(batch_size, bool)
        or not 1 <= batch_size <= MAX_BATCH_SIZE
    ):
        raise InvalidInput(f"batch_size must be from 1 to {MAX_BATCH_SIZE}",
                           code="invalid_batch_size", field="batch_size")  # fmt: skip


class _Archive:
    """An archive file open for appending JSON lines."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def append(self, lines: list[dict[str, Any]]) -> None:
        """Append one JSON line per mapping, on disk when this returns."""
        data = "".join(
            json.dumps(line, default=_jsonable, ensure_ascii=False) + "\n" for line in lines
        ).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        os.fsync(self.fd)


@contextmanager
def _archive(path: str | os.PathLike[str] | None) -> Iterator[_Archive | None]:
    """The archive file, opened for appending (created readable by its owner only: it holds
    the operations' parameters), or None."""
    if path is None:
        yield None
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as exc:
        raise InvalidInput(
            f"cannot write the archive: {exc.strerror or type(exc).__name__}",
            code="invalid_archive",
            field="archive",
        ) from None
    try:
        yield _Archive(fd)
    finally:
        os.close(fd)


def _jsonable(value: object) -> str:
    if isinstance(value, datetime | date):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def age_words(age: timedelta) -> str:
    """An age in words, in its largest whole unit: "90 days", "36 hours"."""
    seconds = int(age.total_seconds())
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            n = seconds // size
            return f"{n:,} {unit}{'s' if n != 1 else ''}"
    return f"{seconds:,} seconds" if seconds != 1 else "1 second"
