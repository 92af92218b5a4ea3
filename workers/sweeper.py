"""The sweeper (on beat): re-hints every due operation, so a lost hint costs latency only; and
marks ``expired`` the agents' proposals nobody decided in time (approval refuses them anyway:
this keeps the staff's list and the stored status true)."""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from outbox.relay import PER_MESSAGE, Publish, publish_hints
from outbox.storage.claims import due_ids
from outbox.storage.proposals import expire_waiting

log = logging.getLogger(__name__)


def sweep(
    sessions: sessionmaker[Session],
    publish: Publish,
    *,
    limit: int = 1000,
    per_message: int = PER_MESSAGE,
) -> int:
    """Publish hints for the due operations (planned and due, or abandoned mid-send)."""
    with sessions() as session:
        ids = due_ids(session, limit=limit)
    sent = publish_hints(publish, ids, per_message=per_message)
    if ids:
        log.info("sweep", extra={"due": len(ids), "hinted": sent})
    return sent


def expire_proposals(sessions: sessionmaker[Session], ttl: timedelta) -> int:
    """Mark ``expired`` the proposals undecided for longer than ``ttl``; how many."""
    with sessions.begin() as session:
        expired = expire_waiting(session, ttl)
    if expired:
        log.info("proposals expired", extra={"expired": expired})
    return expired
