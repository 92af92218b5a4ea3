"""What the support console searches: a page of review items, operations by the keys a
customer or a colleague quotes (order id, idempotency key, run handle), operations by one
free text that may be any of them (``operations_matching``), and the proposals AI agents
made that wait for staff, with everything else on their orders.

An operation's order is its kind's ``order_field`` (``KindRegistry.order_fields``): the
statements that read it are built once per set of order fields (``_order_reads``).

Every key is found through an index on PostgreSQL (migration 0013): the free-text search
collects the matching ids as a UNION of one indexed lookup per key, never one OR over the
table (which PostgreSQL can answer only by scanning every operation).

Every read takes the tenants the member of staff may see (None: all), so a limited member's
lists never hold another tenant's rows: the rule is applied in the query, not after it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Select,
    String,
    and_,
    bindparam,
    false,
    func,
    or_,
    select,
    tuple_,
    union,
)
from sqlalchemy.orm import Session

from outbox.kinds import KindRegistry
from outbox.models import Attempt, Operation, OperationEvent, Proposal, ReviewItem, Run
from outbox.proposal_states import ProposalStatus

#: Review items with their operation's op_id, kind, state and params, oldest first (all four
#: None for an orphan effect's item: it has no operation here).
REVIEW_PAGE = (
    select(ReviewItem, Operation.op_id, Operation.kind, Operation.state, Operation.params)
    .outerjoin(Operation, Operation.id == ReviewItem.operation_id)
    .order_by(ReviewItem.created_at, ReviewItem.id)
    .offset(bindparam("offset"))
    .limit(bindparam("limit"))
)
REVIEW_COUNT = (
    select(func.count())
    .select_from(ReviewItem)
    .outerjoin(Operation, Operation.id == ReviewItem.operation_id)
)
MAX_FOUND = 50
BY_IDEMPOTENCY_KEY = (
    select(Operation)
    .where(Operation.idempotency_key == bindparam("key"))
    .order_by(Operation.id)
    .limit(MAX_FOUND)
)
_RUN_IDS = select(Run.id).where(Run.handle == bindparam("handle")).scalar_subquery()
BY_RUN_HANDLE = (
    select(Operation).where(Operation.run_id.in_(_RUN_IDS)).order_by(Operation.id).limit(MAX_FOUND)
)
#: Proposals nobody has decided yet, oldest first.
WAITING_PROPOSALS = (
    select(Proposal)
    .where(Proposal.status == ProposalStatus.PROPOSED.value)
    .order_by(Proposal.created_at, Proposal.id)
    .limit(bindparam("limit"))
)
WAITING_COUNT = (
    select(func.count())
    .select_from(Proposal)
    .where(Proposal.status == ProposalStatus.PROPOSED.value)
)
PROPOSAL_BY_ID = select(Proposal).where(Proposal.id == bindparam("proposal_id"))
MAX_ON_ORDERS = 500
BY_OP_ID = (
    select(Operation)
    .where(Operation.tenant == bindparam("tenant"), Operation.op_id == bindparam("op_id"))
    .limit(1)
)

#: The escape character of the prefix patterns (``prefix_pattern``): not a backslash, which
#: the SQL string literal of ``ESCAPE`` would itself need escaped on some backends.
LIKE_ESCAPE = "/"
_PAYEE_OF = Operation.params["payee"].as_string()
_Q: BindParameter[str] = bindparam("q", type_=String())
_PREFIX: BindParameter[str] = bindparam("prefix", type_=String())
#: The operations a downstream reference was seen on other than in their receipt, one
#: indexed lookup each: an attempt's answer (``detail``), a lookup's find (an event's
#: ``reference``), the record a lookup found unlike the intent (an event's ``record``, what
#: a mismatch item asks for).
_SEEN_REFERENCE = (
    select(Attempt.operation_id).where(Attempt.detail["reference"].as_string() == _Q),
    select(OperationEvent.operation_id).where(
        OperationEvent.evidence["reference"].as_string() == _Q
    ),
    select(OperationEvent.operation_id).where(
        OperationEvent.evidence[("record", "reference")].as_string() == _Q
    ),
)


@dataclass(frozen=True)
class Match:
    """One thing a free text may be: ``holds``, a condition on the operation (what the page
    says it matched), and ``ids``, the same operations' ids, each select one indexed lookup."""

    holds: ColumnElement[bool]
    ids: tuple[Select[Any], ...]

    @classmethod
    def on_operation(cls, holds: ColumnElement[bool]) -> Match:
        return cls(holds, (select(Operation.id).where(holds),))


#: What one free text may be besides an order, named as the page names it: equal to its op
#: id, idempotency key, run handle, payee, or a downstream reference (its receipt's, or one
#: seen on it: ``_SEEN_REFERENCE``).
_EXACT_OTHERS: dict[str, Match] = {
    "op_id": Match.on_operation(Operation.op_id == _Q),
    "idempotency_key": Match.on_operation(Operation.idempotency_key == _Q),
    "run": Match.on_operation(Operation.run_id.in_(select(Run.id).where(Run.handle == _Q))),
    "payee": Match.on_operation(_PAYEE_OF == _Q),
    "reference": Match(
        or_(Operation.downstream_ref == _Q, Operation.id.in_(union(*_SEEN_REFERENCE))),
        (select(Operation.id).where(Operation.downstream_ref == _Q), *_SEEN_REFERENCE),
    ),
}
#: An op id's beginning (a colleague quotes the start of one).
_OP_ID_PREFIX = Match.on_operation(Operation.op_id.like(_PREFIX, escape=LIKE_ESCAPE))

#: the kinds' order fields, as ``KindRegistry.order_fields`` gives them
OrderFields = tuple[tuple[str, tuple[str, ...]], ...]


def _order_where(
    fields: OrderFields, test: Callable[[str], ColumnElement[bool]]
) -> ColumnElement[bool]:
    """``test`` of each order field, on the operations of the kinds whose order it is (one
    arm per field, so each can use that field's index); false where no kind has an order."""
    arms = [and_(Operation.kind.in_(kinds), test(field)) for field, kinds in fields]
    return or_(*arms) if arms else false()


def order_is(fields: OrderFields, value: ColumnElement[str]) -> ColumnElement[bool]:
    """The operation is on order ``value``: its kind's order field holds it."""
    return _order_where(fields, lambda field: Operation.params[field].as_string() == value)


@dataclass(frozen=True)
class _OrderReads:
    """The statements that read an operation's order, for one set of order fields."""

    #: operations by their order, oldest first
    by_order: Select[Any]
    exact: dict[str, Match]
    prefix: dict[str, Match]
    #: operations one free text names exactly, newest first, with which keys it matched
    matching: Select[Any]
    #: the same, or whose order or op id begins with it
    matching_or_prefix: Select[Any]


def _matching(matches: dict[str, Match]) -> Select[Any]:
    labelled = [match.holds.label(name) for name, match in matches.items()]
    ids = union(*(s for match in matches.values() for s in match.ids))
    return (
        select(Operation)
        .add_columns(*labelled)
        .where(Operation.id.in_(ids))
        .order_by(Operation.created_at.desc(), Operation.id.desc())
        .limit(bindparam("limit"))
    )


@lru_cache(maxsize=16)
def _order_reads(fields: OrderFields) -> _OrderReads:
    on_order = order_is(fields, bindparam("order_id", type_=String()))
    exact = {"order_id": Match.on_operation(order_is(fields, _Q)), **_EXACT_OTHERS}
    # what a beginning may match (a customer quotes part of an order id, a colleague the
    # start of an op id); never a key or a handle, which are secrets of a kind, nor a payee
    order_prefix = _order_where(
        fields, lambda f: Operation.params[f].as_string().like(_PREFIX, escape=LIKE_ESCAPE)
    )
    prefix = {"order_id_prefix": Match.on_operation(order_prefix), "op_id_prefix": _OP_ID_PREFIX}
    return _OrderReads(
        by_order=select(Operation).where(on_order).order_by(Operation.id).limit(MAX_FOUND),
        exact=exact,
        prefix=prefix,
        matching=_matching(exact),
        matching_or_prefix=_matching({**exact, **prefix}),
    )


def prefix_pattern(text: str) -> str:
    """A LIKE pattern matching what begins with ``text``: its ``%``, ``_`` and escape
    characters stand for themselves (``A10%`` finds ``A10%1``, never ``A1042``)."""
    for special in (LIKE_ESCAPE, "%", "_"):
        text = text.replace(special, LIKE_ESCAPE + special)
    return text + "%"


def operations_matching(
    session: Session,
    text: str,
    *,
    kinds: KindRegistry,
    tenants: Collection[str] | None,
    prefix: bool,
    limit: int = MAX_FOUND,
) -> tuple[list[tuple[Operation, list[str]]], bool]:
    """Operations of ``tenants`` (None: all) that ``text`` names (the order of their kind in
    ``kinds``, op id, key, run, payee or a reference; with ``prefix``, also the beginning of
    an order or an op id), newest first, each with the names of what it
    matched (a prefix only where the key is not equal); at most ``limit``, and whether more
    match."""
    reads = _order_reads(kinds.order_fields())
    stmt = reads.matching_or_prefix if prefix else reads.matching
    params: dict[str, Any] = {"q": text, "limit": limit + 1}
    if prefix:
        params["prefix"] = prefix_pattern(text)
    if tenants is not None:
        stmt = stmt.where(Operation.tenant.in_(bindparam("tenants", expanding=True)))
        params["tenants"] = sorted(tenants)
    names = [*reads.exact, *(reads.prefix if prefix else ())]
    rows = session.execute(stmt, params).all()
    found: list[tuple[Operation, list[str]]] = []
    for row in rows[:limit]:
        hits = [name for name, hit in zip(names, row[1:], strict=True) if hit]
        # "begins with" says nothing more where the key is equal
        shown = [n for n in hits if not (n.endswith("_prefix") and n[: -len("_prefix")] in hits)]
        found.append((row[0], shown))
    return found, len(rows) > limit


def _review_filters(
    stmt: Select[Any],
    params: dict[str, Any],
    *,
    tenants: Collection[str] | None,
    tenant: str | None,
    reason: str | None,
    kind: str | None,
    created_before: datetime | None,
    include_resolved: bool,
) -> Select[Any]:
    if not include_resolved:
        stmt = stmt.where(ReviewItem.resolved_at.is_(None))
    if tenants is not None:
        stmt = stmt.where(ReviewItem.tenant.in_(bindparam("tenants", expanding=True)))
        params["tenants"] = sorted(tenants)
    narrowing = {"tenant": (ReviewItem.tenant, tenant), "reason": (ReviewItem.reason, reason),
                 "kind": (Operation.kind, kind)}  # fmt: skip
    for name, (column, value) in narrowing.items():
        if value is not None:
            stmt = stmt.where(column == bindparam(name))
            params[name] = value
    if created_before is not None:
        stmt = stmt.where(ReviewItem.created_at <= bindparam("created_before"))
        params["created_before"] = created_before
    return stmt


def review_page(
    session: Session,
    *,
    tenants: Collection[str] | None,
    tenant: str | None = None,
    reason: str | None = None,
    kind: str | None = None,
    created_before: datetime | None = None,
    include_resolved: bool = False,
    offset: int = 0,
    limit: int = 50,
) -> tuple[list[tuple[ReviewItem, Any, Any, Any, Any]], int]:
    """One page of review items (open ones unless ``include_resolved``), oldest first, with
    their operation's op_id, kind, state and params (None for an orphan effect's item); and
    how many match in all."""
    filters: dict[str, Any] = {"tenants": tenants, "tenant": tenant, "reason": reason, "kind": kind,
               "created_before": created_before, "include_resolved": include_resolved}  # fmt: skip
    params: dict[str, Any] = {"offset": offset, "limit": limit}
    rows = session.execute(_review_filters(REVIEW_PAGE, params, **filters), params)
    counted: dict[str, Any] = {}
    total = session.scalar(_review_filters(REVIEW_COUNT, counted, **filters), counted) or 0
    return [(row[0], row[1], row[2], row[3], row[4]) for row in rows], total


def operations_by(
    session: Session,
    key: str,
    value: str,
    *,
    kinds: KindRegistry,
    tenants: Collection[str] | None,
    tenant: str | None = None,
) -> list[Operation]:
    """Operations of ``tenants`` (None: all) whose ``key`` (``op_id`` with ``tenant``,
    ``order_id``: the order of their kind in ``kinds``, ``idempotency_key`` or ``run``) is
    ``value``, oldest first, at most ``MAX_FOUND``."""
    by_order = _order_reads(kinds.order_fields()).by_order
    choices: dict[str, tuple[Select[Any], dict[str, Any]]] = {
        "op_id": (BY_OP_ID, {"tenant": tenant, "op_id": value}),
        "order_id": (by_order, {"order_id": value}),
        "idempotency_key": (BY_IDEMPOTENCY_KEY, {"key": value}),
        "run": (BY_RUN_HANDLE, {"handle": value}),
    }
    stmt, params = choices[key]
    if tenants is not None:
        stmt = stmt.where(Operation.tenant.in_(bindparam("tenants", expanding=True)))
        params = {**params, "tenants": sorted(tenants)}
    return list(session.scalars(stmt, params))


def waiting_proposals(
    session: Session, *, tenants: Collection[str] | None, made_after: datetime, limit: int
) -> tuple[list[Proposal], int]:
    """The first ``limit`` proposals of ``tenants`` (None: all) waiting for a decision, oldest
    first, and how many wait in all; only those made after ``made_after`` (the others have
    expired, whether or not the sweeper has marked them yet)."""
    young = Proposal.created_at > bindparam("made_after")
    listed, counted = WAITING_PROPOSALS.where(young), WAITING_COUNT.where(young)
    params: dict[str, Any] = {"limit": limit, "made_after": made_after}
    if tenants is not None:
        listed = listed.where(Proposal.tenant.in_(bindparam("tenants", expanding=True)))
        counted = counted.where(Proposal.tenant.in_(bindparam("tenants", expanding=True)))
        params["tenants"] = sorted(tenants)
    rows = list(session.scalars(listed, params))
    total = session.scalar(counted, {k: v for k, v in params.items() if k != "limit"}) or 0
    return rows, total


def proposal_by_id(
    session: Session, proposal_id: int, *, tenants: Collection[str] | None
) -> Proposal | None:
    """Proposal ``proposal_id`` if it is of ``tenants`` (None: any); else None."""
    stmt = PROPOSAL_BY_ID
    params: dict[str, Any] = {"proposal_id": proposal_id}
    if tenants is not None:
        stmt = stmt.where(Proposal.tenant.in_(bindparam("tenants", expanding=True)))
        params = {**params, "tenants": sorted(tenants)}
    found: Proposal | None = session.scalars(stmt, params).one_or_none()
    return found


def on_orders(
    session: Session, orders: Collection[tuple[str, str]], *, kinds: KindRegistry
) -> tuple[list[Proposal], list[Operation]]:
    """The proposals and the operations (of any kind of ``kinds``, however made) on the
    orders ``(tenant, order id)``, oldest first: the newest ``MAX_ON_ORDERS`` of each."""
    operations = operations_on_orders(session, orders, kinds=kinds)
    return proposals_on_orders(session, orders), operations


def proposals_on_orders(session: Session, orders: Collection[tuple[str, str]]) -> list[Proposal]:
    """The proposals on the orders ``(tenant, order id)``, oldest first (the newest
    ``MAX_ON_ORDERS``)."""
    pairs = tuple_(Proposal.tenant, Proposal.order_ref).in_(sorted(set(orders)))
    stmt = select(Proposal).where(pairs).order_by(Proposal.id.desc()).limit(MAX_ON_ORDERS)
    return list(reversed(session.scalars(stmt).all())) if orders else []


def operations_on_orders(
    session: Session, orders: Collection[tuple[str, str]], *, kinds: KindRegistry
) -> list[Operation]:
    """The operations (of any kind of ``kinds``, however made) on the orders ``(tenant,
    order id)``, oldest first (the newest ``MAX_ON_ORDERS``)."""
    wanted = sorted(set(orders))
    pairs = _order_where(
        kinds.order_fields(),
        lambda f: tuple_(Operation.tenant, Operation.params[f].as_string()).in_(wanted),
    )
    stmt = select(Operation).where(pairs).order_by(Operation.id.desc()).limit(MAX_ON_ORDERS)
    return list(reversed(session.scalars(stmt).all())) if orders else []
