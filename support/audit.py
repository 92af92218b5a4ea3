"""The orphan-effect audit (``settled ops audit``): after a failover that lost committed
intents, or a restore from a backup, the downstream may hold effects made under Settled's keys
for which this database has no operation. Each downstream that can list its effects is asked
for those of each of its tenants since a time; an effect that names no operation here (by its
tenant and op id where the downstream keeps them, by its tenant and idempotency key where it
keeps only the key) is an *orphan*, and gets one review item (reason ``orphan_effect``) with the
evidence, once ever: an audit run again opens no second one.

A downstream that lists nothing (the wire protocol without its optional list, WeChat Pay and
Alipay, whose queries name one order at a time) is reported as not audited, with why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from outbox.clock import Deadline
from outbox.downstream import Effect, EffectLister, EffectsListed
from outbox.ids import KEY_PREFIX
from outbox.storage.audit import known_operations, open_effect_item

Sessions = Callable[[], Any]  # a sessionmaker: ``sessions.begin()`` gives a transaction


@dataclass(frozen=True)
class Source:
    """One downstream and the tenants whose effects it is asked for: ``lister`` None where it
    cannot list them (``why`` says so)."""

    downstream: str
    tenants: tuple[str, ...]
    lister: EffectLister | None
    why: str | None = None


@dataclass(frozen=True)
class Orphan:
    """An effect with no operation here, and its review item (``opened``: by this run)."""

    effect: Effect
    item: int
    opened: bool


@dataclass(frozen=True)
class Checked:
    """What one downstream's list showed for one tenant (``tenant`` None: the downstream was
    not asked at all): how many of Settled's effects, whether it was read to the end, why not;
    ``listed`` False where it could not list anything (not audited)."""

    downstream: str
    tenant: str | None
    effects: int
    complete: bool
    detail: str | None = None
    listed: bool = True


@dataclass
class Audit:
    """The audit's answer: the orphans, and what was and was not checked."""

    since: datetime
    orphans: list[Orphan] = field(default_factory=list)
    checked: list[Checked] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Every downstream was read to the end for every tenant."""
        return all(c.complete for c in self.checked)

    def as_dict(self) -> dict[str, Any]:
        return {
            "since": self.since.isoformat(),
            "complete": self.complete,
            "orphans": [
                {**evidence_of(o.effect), "review_item": o.item, "opened": o.opened}
                for o in self.orphans
            ],
            "checked": [asdict(c) for c in self.checked],
        }


def effect_name(effect: Effect) -> str:
    """The name its review item is kept under: one per effect, ever."""
    return f"{effect.downstream}:{effect.tenant}:{effect.reference}"


def evidence_of(effect: Effect) -> dict[str, Any]:
    """What support sees of an orphan: the downstream's reference and record, and the
    operation it names (no secret: the downstream's keys are never part of it)."""
    return {
        "downstream": effect.downstream,
        "tenant": effect.tenant,
        "reference": effect.reference,
        "op_id": effect.op_id,
        "idempotency_key": effect.idempotency_key,
        "amount_minor": effect.amount_minor,
        "currency": effect.currency,
        "status": effect.status,
        "created": effect.created.isoformat() if effect.created else None,
    }


def ours(effect: Effect) -> bool:
    """Made under Settled's keys: it names an op id, or its key is one Settled derives."""
    return effect.op_id is not None or (effect.idempotency_key or "").startswith(KEY_PREFIX)


def orphans_among(
    effects: Iterable[Effect], known_ids: set[str], known_keys: set[str]
) -> list[Effect]:
    """Those of ``effects`` (one tenant's) that name no operation here: by op id where the
    effect carries one, else by idempotency key (pure)."""
    return [
        e
        for e in effects
        if (
            e.op_id not in known_ids if e.op_id is not None else e.idempotency_key not in known_keys
        )
    ]


def audit(
    sessions: Sessions,
    sources: Iterable[Source],
    since: datetime,
    *,
    deadline: Callable[[], Deadline],
) -> Audit:
    """Ask every source for each of its tenants' effects since ``since`` (each list bounded by
    a fresh ``deadline()``), and open a review item for each orphan (``support.audit``)."""
    found = Audit(since)
    for source in sources:
        if source.lister is None:
            found.checked.append(Checked(source.downstream, None, 0, False, source.why, False))
            continue
        for tenant in source.tenants:
            listed = source.lister.effects_since(tenant, since, deadline=deadline())
            if not isinstance(listed, EffectsListed):
                found.checked.append(
                    Checked(source.downstream, tenant, 0, False, listed.detail, False)
                )
                continue
            effects = [e for e in listed.effects if ours(e) and e.tenant == tenant]
            found.checked.append(
                Checked(source.downstream, tenant, len(effects), listed.complete, listed.detail)
            )
            found.orphans.extend(_record(sessions, tenant, effects))
    return found


def _record(sessions: Sessions, tenant: str, effects: list[Effect]) -> list[Orphan]:
    """The orphans among one tenant's effects, each with its review item (opened if new)."""
    if not effects:
        return []
    op_ids = {e.op_id for e in effects if e.op_id is not None}
    keys = {e.idempotency_key for e in effects if e.idempotency_key is not None}
    out = []
    with sessions.begin() as session:  # type: ignore[attr-defined]
        known_ids, known_keys = known_operations(session, tenant, op_ids, keys)
        for effect in orphans_among(effects, known_ids, known_keys):
            item, opened = _open(session, effect)
            out.append(Orphan(effect, item, opened))
    return out


def _open(session: Session, effect: Effect) -> tuple[int, bool]:
    return open_effect_item(session, effect_name(effect), effect.tenant, evidence_of(effect))
