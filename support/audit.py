"""The orphan-effect audit (``settled ops audit``): after a failover that lost committed
intents, or a restore from a backup, the downstream may hold effects made under Settled's keys
for which this database has no operation. Each downstream that can list its effects is asked
for those of each of its tenants since a time; an effect that names no operation here (by its
tenant and op id where the downstream keeps them, by its tenant and idempotency key where it
keeps only the key) is an *orphan*, and gets one review item (reason ``orphan_effect``) with the
evidence, once ever: an audit run again opens no second one.

A downstream that lists nothing (the wire protocol without its optional list, WeChat Pay and
Alipay, whose queries name one order at a time) is reported as not audited, with why. What
the app names from its own records (``Named``: the tenant, op id, kind and intent it kept with
its business row) is looked up one by one instead (``audit_named``), through the gateway's own
lookup by the key Settled derives from the op id: that works on every downstream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from outbox.clock import Deadline
from outbox.downstream import (
    DownstreamRequest,
    Effect,
    EffectLister,
    EffectsListed,
    Found,
    Gateway,
    LookupMisuse,
    LookupNotFound,
)
from outbox.ids import KEY_PREFIX, derive_idempotency_key, validate_op_id, validate_tenant
from outbox.kinds import KindRegistry
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
    ``listed`` False where it could not list anything (not audited); ``asked``: the named
    operations looked up one by one (``audit_named``; None for a list)."""

    downstream: str
    tenant: str | None
    effects: int
    complete: bool
    detail: str | None = None
    listed: bool = True
    asked: int | None = None


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


@dataclass(frozen=True)
class Named:
    """An operation the app names from its own records: its tenant and op id, its kind and
    the intent it was enqueued with (``checked`` makes one from a line of the app's file)."""

    tenant: str
    op_id: str
    kind: str
    params: Mapping[str, Any]

    @classmethod
    def checked(cls, registry: KindRegistry, value: object) -> Named:
        """``value`` (a JSON object: ``tenant``, ``op_id``, ``kind``, ``params``) checked as
        intake checks them; InvalidInput (no value echoed) for the first bad one."""
        from outbox.errors import InvalidInput
        from outbox.fingerprint import canonical_params

        if not isinstance(value, Mapping):
            raise InvalidInput("each line must be a JSON object", code="named_not_object")
        tenant = validate_tenant(value.get("tenant"))
        op_id = validate_op_id(value.get("op_id"))
        kind = registry.get(value.get("kind"))
        params = canonical_params(kind.parse(value.get("params")))
        return cls(tenant, op_id, kind.name, params)


def audit_named(
    found: Audit,
    sessions: Sessions,
    gateway: Gateway,
    registry: KindRegistry,
    secret: bytes,
    named: Iterable[Named],
    downstream_of: Callable[[str], str],
    *,
    deadline: Callable[[], Deadline],
) -> Audit:
    """``found`` with each of ``named`` that has no operation here (nor a tombstone) looked
    up at its downstream (``downstream_of(kind)``) by the key Settled derived for it: one made
    there is an orphan, with its review item; one the lookup cannot settle (unavailable, a
    record not ours) leaves the audit incomplete; one its downstream's list showed already
    (in ``found``) is not asked again. One ``Checked`` per downstream and tenant (``asked``:
    the lookups made)."""
    tallies: dict[tuple[str, str], Checked] = {}
    listed = {
        (o.effect.downstream, o.effect.tenant, o.effect.idempotency_key) for o in found.orphans
    }
    for one in named:
        where = (downstream_of(one.kind), one.tenant)
        tally = tallies.setdefault(where, Checked(*where, effects=0, complete=True, asked=0))
        key = derive_idempotency_key(secret, one.tenant, one.op_id)
        if (*where, key) in listed:
            continue  # its downstream's list showed it already
        with sessions() as session:
            known_ids, _ = known_operations(session, one.tenant, {one.op_id}, set())
        if known_ids:
            continue
        request = DownstreamRequest(one.tenant, one.op_id, registry.get(one.kind), key, one.params)
        outcome = gateway.lookup(request, deadline=deadline())
        tally = replace(tally, asked=(tally.asked or 0) + 1)
        record = outcome.receipt if isinstance(outcome, Found) else None
        if isinstance(outcome, LookupMisuse):
            record = outcome.record
        if record is None:
            if not isinstance(outcome, LookupNotFound):  # nobody can say: not audited
                detail = getattr(outcome, "detail", type(outcome).__name__)
                tally = replace(tally, complete=False, detail=detail)
            tallies[where] = tally
            continue  # not found: never made there, nothing lost
        tallies[where] = replace(tally, effects=tally.effects + 1)
        effect = Effect(
            downstream=where[0],
            tenant=one.tenant,
            reference=record.reference,
            idempotency_key=key,
            op_id=one.op_id,
            amount_minor=record.params.get("amount_minor"),
            currency=record.params.get("currency"),
            status=record.status,
            created=None,
        )
        found.orphans.extend(_record(sessions, one.tenant, [effect]))
    found.checked.extend(tallies.values())
    return found
