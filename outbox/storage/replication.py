"""What a PostgreSQL server says of its replication: whether it is a standby, how its commits
wait for standbys (``synchronous_commit``, ``synchronous_standby_names``), and the standbys
streaming from it with their mode (``pg_stat_replication``).

A primary with standbys none of which is synchronous, or whose commits do not wait for one
(``synchronous_commit`` ``local`` or ``off``), is replicated asynchronously: a failover to a
standby can lose the last commits whole (docs/production.md, "PostgreSQL: failover").
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import column, func, select, table

from outbox.storage.connection import Bind

_REPLICATION = table(
    "pg_stat_replication",
    column("application_name"),
    column("client_addr"),
    column("state"),
    column("sync_state"),
)
#: this server's role and how its commits wait, as this session's commits do
SETTINGS = select(
    func.pg_is_in_recovery(),
    func.current_setting("synchronous_commit"),
    func.current_setting("synchronous_standby_names"),
)
#: the standbys streaming from this server (their modes are NULL to a role without
#: ``pg_read_all_stats``, e.g. ``pg_monitor``)
STANDBYS = select(
    _REPLICATION.c.application_name,
    _REPLICATION.c.state,
    _REPLICATION.c.sync_state,
).order_by(_REPLICATION.c.application_name)
#: whether this server is a standby (recovering from its primary's WAL)
IN_RECOVERY = select(func.pg_is_in_recovery())

#: ``sync_state`` of a standby whose flush a commit waits for
SYNCHRONOUS = frozenset({"sync", "quorum"})
#: ``synchronous_commit`` values whose commits do not wait for any standby
NOT_WAITING = frozenset({"local", "off"})


@dataclass(frozen=True)
class Standby:
    name: str
    #: ``streaming``, ``catchup``, ... (None: not visible to this role)
    state: str | None
    #: ``async``, ``potential``, ``sync``, ``quorum`` (None: not visible to this role)
    sync_state: str | None


@dataclass(frozen=True)
class Replication:
    """A server's replication as its own session sees it."""

    standby: bool
    synchronous_commit: str
    synchronous_standby_names: str
    standbys: tuple[Standby, ...]

    @property
    def asynchronous(self) -> bool:
        """Standbys stream from this primary, and no commit waits for one of them: a failover
        to any of them can lose the last commits."""
        if not self.standbys or any(s.sync_state is None for s in self.standbys):
            return False  # nothing to fail over to, or not visible to this role
        waited = any(s.sync_state in SYNCHRONOUS for s in self.standbys)
        return not waited or self.synchronous_commit in NOT_WAITING

    @property
    def hidden(self) -> bool:
        """Standbys stream from it, but this role may not see their modes."""
        return any(s.sync_state is None for s in self.standbys)

    def describe(self) -> str:
        """One phrase for a start line: the settings and each standby with its mode."""
        names = self.synchronous_standby_names
        said = (
            f"synchronous_commit {self.synchronous_commit}, synchronous_standby_names {names!r}, "
        )
        if not self.standbys:
            return said + "no standbys"
        return said + "standbys " + ", ".join(map(_standby, self.standbys))


def _standby(s: Standby) -> str:
    mode = s.sync_state or "mode not visible (grant pg_monitor)"
    state = f" ({s.state})" if s.state not in (None, "streaming") else ""
    return f"{s.name} {mode}{state}"


def replication(bind: Bind) -> Replication:
    """This server's replication, read on ``bind`` (PostgreSQL)."""
    standby, commit, names = bind.execute(SETTINGS).one()
    standbys = tuple(Standby(*row) for row in bind.execute(STANDBYS))
    return Replication(bool(standby), str(commit), str(names), standbys)


def in_recovery(bind: Bind) -> bool:
    """Whether the server on ``bind`` is a standby."""
    return bool(bind.scalar(IN_RECOVERY))
