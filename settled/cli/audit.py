"""``settled ops audit``: the orphan-effect audit, after a failover that lost committed intents
or a restore from a backup (docs/production.md, "After a failover or a restore").

Asks each configured downstream that can list its effects (Stripe's refunds list; the wire
protocol's optional ``GET /v1/effects``) for those made since ``--since`` under Settled's keys,
and lists every one with no operation here, each with its review item (``support.audit``).
WeChat Pay and Alipay query one order at a time: they are reported as not audited by a list
(a full audit of them needs the provider's bill download, which Settled does not fetch).
``--named FILE`` looks up, on any downstream, the operations the app names from its own
records (JSON lines: ``tenant``, ``op_id``, ``kind``, ``params``) that have no operation here,
by the key Settled derives from each op id (``support.audit.audit_named``).

Exit status: 0 nothing found and every downstream read to the end; 1 orphan effects found;
3 none found, but some downstream or tenant could not be read (the output says which).
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import IO, Any

import click

from settled.cli.common import Seconds
from settled.cli.ops import AS_JSON, Age, _table

#: Exit status when nothing was found but the audit could not read everything.
INCOMPLETE = 3
#: What a provider without a list of its effects says instead.
PER_ORDER_ONLY = (
    "queries name one order at a time: not audited; a full audit needs the provider's bill "
    "download (not built)"
)


class Since(click.ParamType):  # type: ignore[type-arg]
    """A moment: an ISO 8601 time (UTC unless it names its offset), or an age (``6h``: six
    hours ago, as ``Age`` reads it)."""

    name = "time"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> datetime:
        if isinstance(value, datetime):
            return value
        text = str(value).strip()
        try:
            at = datetime.fromisoformat(text)
        except ValueError:
            try:
                ago = Age().convert(text, param, ctx)
            except click.BadParameter:
                self.fail("is not a time (2026-12-07T09:00:00Z) nor an age (6h, 2d)", param, ctx)
            return datetime.now(UTC) - ago
        return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


@click.command("audit")
@click.option(
    "--since", required=True, type=Since(), help="effects made from then on: a time or an age"
)
@click.option(
    "--timeout", type=Seconds(), default=60.0, show_default=True,
    help="the longest one downstream's list of one tenant is read for",
)  # fmt: skip
@click.option(
    "--named", type=click.File("r", encoding="utf-8"), default=None,
    help="JSON lines of operations the app kept (tenant, op_id, kind, params), each looked up",
)  # fmt: skip
@AS_JSON
def ops_audit(since: datetime, timeout: float, named: IO[str] | None, as_json: bool) -> None:
    """Effects the downstreams hold under Settled's keys with no operation here (orphans, as a
    failover or a restore leaves them), each with a review item (opened once)."""
    from outbox.clock import Deadline
    from settled.cli.common import runtime
    from support.audit import audit, audit_named
    from workers.downstreams import WIRE

    rt = runtime()
    try:
        kept = [] if named is None else _named(rt.registry, named)  # all checked first

        def deadline() -> Deadline:
            return Deadline(
                datetime.now(UTC) + timedelta(seconds=timeout), time.monotonic() + timeout
            )

        found = audit(rt.sessions, _sources(rt), since, deadline=deadline)
        if kept:
            providers = rt.settings.downstream_providers
            audit_named(
                found, rt.sessions, rt.gateway, rt.registry, rt.outbox.idempotency_secret, kept,
                lambda kind: providers.get(kind, WIRE), deadline=deadline,
            )  # fmt: skip
    finally:
        rt.close()
    if as_json:
        click.echo(json.dumps(found.as_dict(), indent=2, ensure_ascii=False))
    else:
        _print(found)
    status = 1 if found.orphans else (0 if found.complete else INCOMPLETE)
    click.get_current_context().exit(status)


def _named(registry: Any, lines: IO[str]) -> list[Any]:
    """The operations of ``--named``, each line checked as intake checks an enqueue; a bad
    line is a usage error naming its number and what is wrong (never its values)."""
    from outbox.errors import InvalidInput
    from support.audit import Named

    kept = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            kept.append(Named.checked(registry, json.loads(line)))
        except ValueError:
            raise click.BadParameter(f"line {number} is not JSON", param_hint="'--named'") from None
        except InvalidInput as exc:
            raise click.BadParameter(
                f"line {number}: [{exc.code}] {exc}", param_hint="'--named'"
            ) from None
    return kept


def _sources(rt: Any) -> list[Any]:
    """Each configured downstream with the tenants it holds keys of, and its lister."""
    from support.audit import Source
    from workers.downstreams import WIRE
    from workers.routing import GatewayByKind

    settings, gateway = rt.settings, rt.gateway
    default = gateway.default if isinstance(gateway, GatewayByKind) else gateway
    by_kind = gateway.by_kind if isinstance(gateway, GatewayByKind) else {}
    providers = settings.downstream_providers
    sources = []
    if any(providers.get(kind, WIRE) == WIRE for kind in rt.registry.names()):
        tenants = tuple(sorted(settings.downstream_api_keys))
        sources.append(_source(Source, WIRE, tenants, default))
    for name in sorted(set(providers.values()) - {WIRE}):
        kinds = [k for k, p in providers.items() if p == name]
        if name == "stripe":
            tenants = tuple(sorted(settings.stripe_api_keys))
            sources.append(_source(Source, name, tenants, by_kind[kinds[0]]))
        else:
            sources.append(Source(name, (), None, PER_ORDER_ONLY))
    return sources


def _source(source: Any, name: str, tenants: tuple[str, ...], gateway: object) -> Any:
    """The source of a gateway that lists its effects; one not audited where it cannot."""
    if not hasattr(gateway, "effects_since"):
        return source(name, (), None, "this gateway cannot list its effects")
    return source(name, tenants, gateway)


def _print(found: Any) -> None:
    from outbox.currencies import format_amount

    click.echo(f"Orphan effects since {found.since.isoformat()} (no operation here)")
    if found.orphans:
        rows: list[tuple[str, ...]] = [
            ("DOWNSTREAM", "TENANT", "REFERENCE", "AMOUNT", "OP_ID / KEY", "MADE", "REVIEW")
        ]
        for o in found.orphans:
            e = o.effect
            rows.append((
                e.downstream, e.tenant, e.reference, format_amount(e.amount_minor, e.currency),
                e.op_id or e.idempotency_key or "", e.created.isoformat() if e.created else "",
                f"#{o.item}" + (" (new)" if o.opened else ""),
            ))  # fmt: skip
        _table(rows, indent="  ")
    click.echo("\nChecked")
    for c in found.checked:
        where = c.downstream + (f" {c.tenant}" if c.tenant else "")
        if c.asked is not None:
            click.echo(
                f"  {where}: {c.asked} named operation(s) with none here looked up, "
                f"{c.effects} made there" + ("" if c.complete else f"; INCOMPLETE: {c.detail}")
            )
        elif c.complete:
            click.echo(f"  {where}: {c.effects} effect(s) of Settled's, read to the end")
        elif not c.listed:
            click.echo(f"  {where}: NOT AUDITED: {c.detail}")
        else:
            click.echo(f"  {where}: INCOMPLETE after {c.effects} effect(s): {c.detail}")
    opened = sum(1 for o in found.orphans if o.opened)
    click.echo(
        f"\n{len(found.orphans)} orphan effect(s), {opened} review item(s) opened now"
        + ("" if found.complete else "; the audit is incomplete (see above)")
    )
