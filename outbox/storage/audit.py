"""The orphan-effect audit's reads and writes (``support.audit``): which of the effects a
downstream listed name an operation here, and the one review item of each that does not."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Select, Table, bindparam, or_, select, union_all
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from outbox.models import Operation, OperationTombstone, ReviewItem

operations: Table = Operation.__table__  # type: ignore[assignment]
reviews: Table = ReviewItem.__table__  # type: ignore[assignment]
tombstones: Table = OperationTombstone.__table__  # type: ignore[assignment]


def _named(table: Table) -> Select[Any]:
    return select(table.c.op_id, table.c.idempotency_key).where(
        table.c.tenant == bindparam("tenant"),
        or_(
            table.c.op_id.in_(bindparam("op_ids", expanding=True)),
            table.c.idempotency_key.in_(bindparam("keys", expanding=True)),
        ),
    )


#: The op ids and keys of a tenant's operations among those named: those here, and those
#: pruned (their tombstones: an effect of a pruned operation is known, not an orphan).
KNOWN = union_all(_named(operations), _named(tombstones))
#: The review item of an effect (open or resolved), if it has one.
EFFECT_ITEM = select(reviews.c.id).where(reviews.c.effect == bindparam("effect"))

#: The reason of an orphan effect's review item.
ORPHAN_EFFECT = "orphan_effect"


def known_operations(
    session: Session, tenant: str, op_ids: Collection[str], keys: Collection[str]
) -> tuple[set[str], set[str]]:
    """Those of ``op_ids`` and of ``keys`` that name an operation of ``tenant`` here, or one
    pruned (its tombstone)."""
    if not op_ids and not keys:
        return set(), set()
    rows = session.execute(
        KNOWN, {"tenant": tenant, "op_ids": sorted(op_ids), "keys": sorted(keys)}
    )
    found_ids, found_keys = set(), set()
    for op_id, key in rows:
        found_ids.add(op_id)
        found_keys.add(key)
    return found_ids & set(op_ids), found_keys & set(keys)


def open_effect_item(
    session: Session, effect: str, tenant: str, evidence: dict[str, Any]
) -> tuple[int, bool]:
    """The review item of orphan effect ``effect`` (``downstream:tenant:reference``): the one
    it has, or one opened now (reason ``orphan_effect``, with ``evidence``); and whether it was
    opened now. At most one per effect ever (a unique index), also when two audits race."""
    found = session.scalar(EFFECT_ITEM, {"effect": effect})
    if found is not None:
        return int(found), False
    item = ReviewItem(
        operation_id=None, effect=effect, tenant=tenant, reason=ORPHAN_EFFECT, evidence=evidence
    )
    try:
        with session.begin_nested():
            session.add(item)
    except IntegrityError:  # another audit opened it meanwhile
        found = session.scalar(EFFECT_ITEM, {"effect": effect})
        assert found is not None
        return int(found), False
    return item.id, True
