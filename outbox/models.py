"""Tables: operations, attempts, operation events (append-only), runs, review items, the
tombstones of pruned operations, API keys, the support console's staff accounts, their
sessions and failed sign-ins, and the proposals an AI agent makes (``outbox.proposals``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

STATES = "'planned','submitted','succeeded','rejected','unknown','cancelled'"
STAFF_ROLES = "'viewer','support','supervisor','admin'"
PROPOSAL_STATUSES = "'proposed','approved','declined','expired'"
REASONS = "'business_rejected','invalid_params','permission_denied','not_executed'"


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive, as UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: Settled stores aware UTC datetimes only")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):  # raw SQLite text, e.g. from strftime()
            value = datetime.fromisoformat(value)
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)  # type: ignore[no-any-return]
        return value.astimezone(UTC)  # type: ignore[no-any-return]


ID = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements INTEGER keys only


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
    }


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(63))
    handle: Mapped[str] = mapped_column(String(64), unique=True)
    title: Mapped[str | None] = mapped_column(String(200))
    cancel_requested_at: Mapped[datetime | None]
    cancelled_by: Mapped[str | None] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(server_default=text("CURRENT_TIMESTAMP"))


class Operation(Base):
    __tablename__ = "operations"
    __table_args__ = (
        UniqueConstraint("tenant", "op_id", name="uq_operations_tenant_op_id"),
        CheckConstraint(f"state IN ({STATES})", name="state"),
        CheckConstraint(f"reason IS NULL OR reason IN ({REASONS})", name="reason"),
        CheckConstraint("(state = 'rejected') = (reason IS NOT NULL)", name="reason_iff_rejected"),
        CheckConstraint("attempts >= 0 AND max_attempts >= 1", name="budget"),
        # The live part of the table: what workers, the sweeper and the reconciler scan.
        Index(
            "ix_operations_due",
            "next_attempt_at",
            postgresql_where=text("state = 'planned'"),
            sqlite_where=text("state = 'planned'"),
        ),
        Index(
            "ix_operations_unresolved",
            "lease_until",
            postgresql_where=text("state IN ('submitted', 'unknown')"),
            sqlite_where=text("state IN ('submitted', 'unknown')"),
        ),
        Index("ix_operations_run_id", "run_id"),
        # What the console searches by (``outbox.storage.search``); migration 0013 also adds,
        # on PostgreSQL, expression indexes on the order, the payee and the references.
        Index("ix_operations_downstream_ref", "downstream_ref"),
        Index("ix_operations_idempotency_key", "idempotency_key"),
        Index("ix_operations_op_id", "op_id", postgresql_ops={"op_id": "text_pattern_ops"}),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(63))
    op_id: Mapped[str] = mapped_column(String(80))
    kind: Mapped[str] = mapped_column(String(40))
    params: Mapped[dict[str, Any]]
    fingerprint: Mapped[str] = mapped_column(String(64))
    fingerprint_key_version: Mapped[str] = mapped_column(String(20))
    idempotency_key: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), default="planned")
    reason: Mapped[str | None] = mapped_column(String(32))
    attempts: Mapped[int] = mapped_column(default=0)
    max_attempts: Mapped[int]
    deadline: Mapped[datetime]
    next_attempt_at: Mapped[datetime]
    first_sent_at: Mapped[datetime | None]
    unknown_since: Mapped[datetime | None]
    lookups: Mapped[int] = mapped_column(default=0, server_default="0")
    lease_owner: Mapped[str | None] = mapped_column(String(100))
    lease_until: Mapped[datetime | None]
    lease_version: Mapped[int] = mapped_column(default=0)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"))
    correlation_id: Mapped[str | None] = mapped_column(String(200))
    compensates_id: Mapped[int | None] = mapped_column(ForeignKey("operations.id"))
    receipt: Mapped[dict[str, Any] | None]
    downstream_ref: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(server_default=text("CURRENT_TIMESTAMP"))
    updated_at: Mapped[datetime] = mapped_column(server_default=text("CURRENT_TIMESTAMP"))


class Attempt(Base):
    """One send, written before it goes out and completed with what came back."""

    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("operation_id", "number"),)

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    operation_id: Mapped[int] = mapped_column(ForeignKey("operations.id"))
    number: Mapped[int]
    lease_version: Mapped[int]
    worker: Mapped[str | None] = mapped_column(String(100))
    started_at: Mapped[datetime]
    #: the latest the request may be on the wire: the sender's lease end (database time); no
    #: send starts after it, so a "not found" is trusted only after it (plus processing time)
    not_after: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    #: what the communication proved: done / not_done / not_sent / not_executed / unknown /
    #: misuse; NULL while the attempt is in flight or if the worker died mid-send
    proof: Mapped[str | None] = mapped_column(String(16))
    status_code: Mapped[int | None]
    detail: Mapped[dict[str, Any] | None]


class OperationEvent(Base):
    """Append-only record of every state change."""

    __tablename__ = "operation_events"

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    operation_id: Mapped[int] = mapped_column(ForeignKey("operations.id"), index=True)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(100))
    lease_version: Mapped[int | None]
    reason: Mapped[str | None] = mapped_column(String(64))
    evidence: Mapped[dict[str, Any] | None]
    at: Mapped[datetime] = mapped_column(server_default=text("CURRENT_TIMESTAMP"))


class ReviewItem(Base):
    """An operation no automatic path can resolve, waiting for support staff."""

    __tablename__ = "review_items"
    __table_args__ = (
        # At most one open item per operation.
        Index(
            "uq_review_items_open",
            "operation_id",
            unique=True,
            postgresql_where=text("resolved_at IS NULL"),
            sqlite_where=text("resolved_at IS NULL"),
        ),
        # At most one item per orphan effect, open or resolved: an audit run again opens none.
        Index("uq_review_items_effect", "effect", unique=True),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    #: None for an orphan effect's item (``effect`` names it): it has no operation here
    operation_id: Mapped[int | None] = mapped_column(ForeignKey("operations.id"))
    #: ``downstream:tenant:reference`` of an orphan effect (``settled ops audit``); else None
    effect: Mapped[str | None] = mapped_column(String(300))
    tenant: Mapped[str] = mapped_column(String(63))
    reason: Mapped[str] = mapped_column(String(64))
    evidence: Mapped[dict[str, Any]]
    version: Mapped[int] = mapped_column(default=1)
    created_at: Mapped[datetime] = mapped_column(server_default=text("CURRENT_TIMESTAMP"))
    resolved_at: Mapped[datetime | None]
    resolved_by: Mapped[str | None] = mapped_column(String(100))
    resolution: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    note: Mapped[str | None] = mapped_column(Text)


class OperationTombstone(Base):
    """What is kept of a pruned operation (``outbox.prune``): enough to answer a replay of its
    ``(tenant, op_id)`` (``outbox.intake``) as its own row did, never a second operation.
    Deleted only by ``outbox.tombstones.prune_tombstones``."""

    __tablename__ = "operation_tombstones"
    __table_args__ = (
        CheckConstraint("state IN ('succeeded','rejected','cancelled')", name="state"),
        Index("ix_operation_tombstones_pruned_at", "pruned_at"),
    )

    tenant: Mapped[str] = mapped_column(String(63), primary_key=True)
    op_id: Mapped[str] = mapped_column(String(80), primary_key=True)
    kind: Mapped[str] = mapped_column(String(40))
    fingerprint: Mapped[str] = mapped_column(String(64))
    fingerprint_key_version: Mapped[str] = mapped_column(String(20))
    idempotency_key: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(32))
    downstream_ref: Mapped[str | None] = mapped_column(String(200))
    #: the operation's own creation time
    created_at: Mapped[datetime]
    pruned_at: Mapped[datetime]


class ApiKey(Base):
    """A tenant's key for the status API; only a SHA-256 hash of the secret is stored."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(63), index=True)
    #: the public part of the key (``stk_<key_id>_<secret>``), used to find the row
    key_id: Mapped[str] = mapped_column(String(32), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(server_default=text("CURRENT_TIMESTAMP"))
    revoked_at: Mapped[datetime | None]


class ClockStep(Base):
    """A step of the database's clock a process saw (``outbox.clock_steps``): every process
    distrusts a "not found" until the newest one's ``distrust_until``."""

    __tablename__ = "clock_steps"

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    #: database time at the reading that showed the step (after it)
    detected_at: Mapped[datetime]
    #: how far the database's clock moved against the monotonic clock (> 0: forward)
    step_seconds: Mapped[float]
    direction: Mapped[str] = mapped_column(String(8))
    distrust_until: Mapped[datetime]
    #: the process that saw it (its worker or reconciler name)
    detected_by: Mapped[str] = mapped_column(String(100))


class DownstreamClockLag(Base):
    """A downstream's clock seen behind the database's beyond the clock margin
    (``outbox.downstream_clock``): one row when an episode begins (counted and alerted), one
    each time its worst grows; the reconciler's fence allows for the worst recent one."""

    __tablename__ = "downstream_clock_lags"
    __table_args__ = (
        Index("ix_downstream_clock_lags_downstream_detected_at", "downstream", "detected_at"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    #: database time (estimated) when the answer that showed it came back
    detected_at: Mapped[datetime]
    #: the kind whose downstream it is
    downstream: Mapped[str] = mapped_column(String(100))
    #: at most this far behind (seconds, rounded up)
    lag_seconds: Mapped[float]
    #: True: the episode began here; False: its worst grew
    begins: Mapped[bool]
    #: the process that saw it (its worker or reconciler name)
    detected_by: Mapped[str] = mapped_column(String(100))


class StaffAccount(Base):
    """A member of staff who signs in to the console; only an argon2id hash of the password."""

    __tablename__ = "staff_accounts"
    __table_args__ = (CheckConstraint(f"role IN ({STAFF_ROLES})", name="role"),)

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    #: the staff id (``support.staff.STAFF_ID``), as the audit trail names them
    name: Mapped[str] = mapped_column(String(64), unique=True)
    password_hash: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(16))
    #: the tenants this member may see; NULL: every tenant
    tenants: Mapped[list[str] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(server_default=text("CURRENT_TIMESTAMP"))
    disabled_at: Mapped[datetime | None]


class StaffSession(Base):
    """A console sign-in; only a SHA-256 hash of its token (the cookie) is stored."""

    __tablename__ = "staff_sessions"

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("staff_accounts.id"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime]
    last_seen_at: Mapped[datetime]
    #: the absolute end (created_at plus the longest a session may last)
    expires_at: Mapped[datetime]
    #: signed out, or the account disabled or its password changed
    ended_at: Mapped[datetime | None]


class StaffLoginFailure(Base):
    """One failed sign-in, counted against a name and an address (each kept only as a hash)."""

    __tablename__ = "staff_login_failures"
    __table_args__ = (Index("ix_staff_login_failures_key_at", "key_hash", "at"),)

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime]


class Proposal(Base):
    """An operation an AI agent asked for, waiting for (or past) a human's or a policy's
    decision; only an approved one becomes an operation intent, under an op_id the app mints."""

    __tablename__ = "proposals"
    __table_args__ = (
        CheckConstraint(f"status IN ({PROPOSAL_STATUSES})", name="status"),
        CheckConstraint("(status = 'approved') = (op_id IS NOT NULL)", name="op_id_iff_approved"),
        Index("ix_proposals_tenant_kind_order_ref", "tenant", "kind", "order_ref"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(63))
    #: what the agent and its user hold: opaque, unguessable (``prp_...``)
    handle: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(40))
    #: the intent's order, where repeats are looked for
    order_ref: Mapped[str] = mapped_column(String(64))
    params: Mapped[dict[str, Any]]
    fingerprint: Mapped[str] = mapped_column(String(64))
    fingerprint_key_version: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str] = mapped_column(String(500))
    #: the model's tool-call id: correlation only, never an op_id
    correlation_id: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="proposed")
    decided_by: Mapped[str | None] = mapped_column(String(100))
    op_id: Mapped[str | None] = mapped_column(String(80))
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"))
    created_at: Mapped[datetime] = mapped_column(server_default=text("CURRENT_TIMESTAMP"))
    decided_at: Mapped[datetime | None]
    #: the approved proposal whose operation this one compensates (None: not a compensation)
    compensates_id: Mapped[int | None] = mapped_column(ForeignKey("proposals.id"))
