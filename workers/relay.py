"""The relay: wake-up hints published after the app's transaction commits, never inside it.

A hint carries the operation's database id and nothing else. Losing one costs latency only:
the sweeper re-hints every due operation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from outbox.intake import CREATED_KEY as CREATED

log = logging.getLogger(__name__)


Publish = Callable[[int], None]


def publish_hints(publish: Publish, ids: Iterable[int]) -> int:
    """Publish one hint per id; a broker error is logged, not raised. Returns how many went."""
    sent = 0
    for op in ids:
        try:
            publish(op)
            sent += 1
        except Exception:  # the sweeper brings the operation back; never fail the app here
            log.warning("hint not published; the sweeper will pick it up", exc_info=True)
    return sent


def install(target: Session | sessionmaker[Session] | type[Session], publish: Publish) -> None:
    """Publish hints for the operations intake created, once their transaction commits."""

    @event.listens_for(target, "after_commit")
    def _after_commit(session: Session) -> None:
        ids = session.info.pop(CREATED, None)
        if ids:
            publish_hints(publish, ids)

    @event.listens_for(target, "after_rollback")
    def _after_rollback(session: Session) -> None:
        session.info.pop(CREATED, None)
