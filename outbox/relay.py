"""The relay: wake-up hints published after the app's transaction commits, never inside it.

A hint carries operation database ids and nothing else: one message per committed transaction
with the ids of the operations it created (split into messages of at most ``per_message``
ids), so an app that enqueues many operations in one transaction pays for few messages and a
worker claims them in one statement. Losing a hint costs latency only: the sweeper re-hints
every due operation; so the app's publish is bounded and, after a failure, skipped for a while
(``outbox.breaker``), and never raises into the app.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from outbox.intake import CREATED_KEY as CREATED
from outbox.observer import NO_OBSERVER, Observer, guarded

log = logging.getLogger(__name__)


#: Publishes one message carrying these operation ids.
Publish = Callable[[Sequence[int]], None]

#: Operation ids per hint message: enough to amortise a message over a batch, few enough that
#: the operations of one large transaction spread over several worker processes.
PER_MESSAGE = 20


class HintNotPublished(Exception):
    """A publish that did not publish its hint and has counted and logged why already
    (``outbox.breaker``): ``publish_hints`` passes over it without a line of its own."""


def publish_hints(
    publish: Publish,
    ids: Iterable[int],
    *,
    per_message: int = PER_MESSAGE,
    observer: Observer = NO_OBSERVER,
) -> int:
    """Publish hints for ``ids``, ``per_message`` to a message, inside ``observer``'s
    ``hinting``; a broker error is logged, not raised (the sweeper brings those operations
    back). Returns how many ids went out."""
    if per_message < 1:
        raise ValueError("per_message must be at least 1")
    todo = list(ids)
    sent = 0
    with guarded(observer).hinting(todo):
        for start in range(0, len(todo), per_message):
            chunk = todo[start : start + per_message]
            try:
                publish(chunk)
                sent += len(chunk)
            except HintNotPublished:
                pass  # counted, and logged once per outage, by the breaker
            except Exception:  # never fail the app here
                log.warning("hint not published; the sweeper will pick it up", exc_info=True)
    return sent


#: What the relay can be installed on: a session, a sessionmaker or a Session class, or their
#: async counterparts (``outbox.aio``).
Target = (
    Session
    | sessionmaker[Session]
    | type[Session]
    | AsyncSession
    | async_sessionmaker[AsyncSession]
    | type[AsyncSession]
)


def _sync_target(target: Target) -> Session | sessionmaker[Session] | type[Session]:
    """Where the events of ``target``'s transactions are: an async session's are its sync
    session's. An ``async_sessionmaker`` gets a Session class of its own, so that the relay
    hears its sessions' commits and no other's."""
    if isinstance(target, AsyncSession):
        return target.sync_session
    if isinstance(target, async_sessionmaker):
        base: type[Session] = target.kw.get("sync_session_class", Session)
        own = type("RelayedSession", (base,), {})
        target.configure(sync_session_class=own)
        return own
    if isinstance(target, type) and issubclass(target, AsyncSession):
        return target.sync_session_class
    return target


def install(
    target: Target,
    publish: Publish,
    *,
    per_message: int = PER_MESSAGE,
    observer: Observer = NO_OBSERVER,
) -> None:
    """Publish hints for the operations intake created, once their transaction commits (in
    ``observer``'s ``hinting``: ``settled.observe.observer()`` continues their traces).

    ``target``: a session, sessionmaker or Session class, or an ``AsyncSession``,
    ``async_sessionmaker`` or AsyncSession class (the publish then runs on the event loop's
    thread when the commit completes: one broker round trip)."""
    if per_message < 1:
        raise ValueError("per_message must be at least 1")
    target = _sync_target(target)

    @event.listens_for(target, "after_commit")
    def _after_commit(session: Session) -> None:
        ids = session.info.pop(CREATED, None)
        if ids:
            publish_hints(publish, ids, per_message=per_message, observer=observer)

    @event.listens_for(target, "after_rollback")
    def _after_rollback(session: Session) -> None:
        session.info.pop(CREATED, None)
