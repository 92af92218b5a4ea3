"""``settled review``: the manual review queue support staff work (``support.review``);
every command runs as a named member of staff with a role."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import click

from settled.cli.common import INT_MAX, ITEM_ID, TEXT, Seconds, runtime

staff_options = [
    click.option(
        "--staff", envvar="SETTLED_STAFF_ID", required=True, type=TEXT, help="your staff id"
    ),
    click.option(
        "--role",
        envvar="SETTLED_STAFF_ROLE",
        required=True,
        type=click.Choice(["viewer", "support", "supervisor", "admin"]),
    ),
    click.option("--json", "as_json", is_flag=True, help="machine-readable output"),
]


def with_staff(f: Any) -> Any:
    for option in reversed(staff_options):
        f = option(f)
    return f


def _as_staff(staff: str, role: str, action: Any) -> Any:
    """Run ``action(review_queue, staff)`` with the staff's identity checked first."""
    from support.staff import Staff

    who = Staff.parse(staff, role)
    rt = runtime()
    try:
        return action(rt.review, who)
    finally:
        rt.close()


def _emit(data: Any, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    if isinstance(data, list):
        for line in table(data):
            click.echo(line)
        click.echo(f"{len(data)} item(s)")
        return
    click.echo(json.dumps(data, indent=2, default=str))


#: The columns of ``review list``: header, and the row's value.
COLUMNS: tuple[tuple[str, Any], ...] = (
    ("ITEM", lambda row: f"#{row['id']}"),
    ("TENANT", lambda row: row["tenant"]),
    ("OP_ID", lambda row: row["op_id"] or "-"),  # none known: an orphan effect's wire key
    ("KIND", lambda row: row["kind"] or "-"),  # none: an orphan effect's item
    ("REASON", lambda row: row["reason"]),
    ("VERSION", lambda row: f"v{row['version']}"),
    ("SINCE", lambda row: row["created_at"]),
)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The items under a header line, each column as wide as its widest value (none when
    there are no items)."""
    if not rows:
        return []
    cells = [[h for h, _ in COLUMNS]] + [[str(v(row)) for _, v in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in cells]  # fmt: skip


@click.group()
def review() -> None:
    """The manual review queue (support staff)."""


@review.command("list")
@click.option("--tenant", default=None, type=TEXT)
@click.option("--reason", default=None, type=TEXT)
@click.option("--older-than", type=Seconds(), default=None, help="seconds")
@click.option("--all", "include_resolved", is_flag=True, help="include resolved items")
@with_staff
def review_list(
    tenant: str | None,
    reason: str | None,
    older_than: float | None,
    include_resolved: bool,
    staff: str,
    role: str,
    as_json: bool,
) -> None:
    """Open review items, oldest first."""
    age = timedelta(seconds=older_than) if older_than is not None else None
    items = _as_staff(
        staff,
        role,
        lambda q, who: q.list(
            who, tenant=tenant, reason=reason, older_than=age, include_resolved=include_resolved
        ),
    )
    _emit(items, as_json)


@review.command("show")
@click.argument("item", type=ITEM_ID)
@with_staff
def review_show(item: int, staff: str, role: str, as_json: bool) -> None:
    """One item: the operation, its attempts, lookups and events."""
    _emit(_as_staff(staff, role, lambda q, who: q.show(who, item)), True)


@review.command("requery")
@click.argument("item", type=ITEM_ID)
@with_staff
def review_requery(item: int, staff: str, role: str, as_json: bool) -> None:
    """Ask the downstream again now."""
    _emit(_as_staff(staff, role, lambda q, who: q.requery(who, item)), True)


@review.command("resolve")
@click.argument("item", type=ITEM_ID)
@click.option("--as", "outcome", required=True, type=click.Choice(["succeeded", "rejected"]))
@click.option(
    "--version",
    required=True,
    type=click.IntRange(1, INT_MAX),
    help="the item version you read (show)",
)
@click.option("--reference", default=None, type=TEXT, help="downstream reference (for succeeded)")
@click.option("--justification", default=None, type=TEXT, help="why (required for rejected)")
@click.option(
    "--override",
    is_flag=True,
    help="supervisor: record it as your statement where the downstream's lookup cannot tell "
    "(needs --justification; recorded as an override)",
)
@with_staff
def review_resolve(
    item: int,
    outcome: str,
    version: int,
    reference: str | None,
    justification: str | None,
    override: bool,
    staff: str,
    role: str,
    as_json: bool,
) -> None:
    """Settle an item's operation as succeeded or rejected, with evidence."""
    result = _as_staff(
        staff,
        role,
        lambda q, who: q.resolve(
            who,
            item,
            outcome=outcome,
            version=version,
            reference=reference,
            justification=justification,
            override=override,
        ),
    )
    _emit(result, True)
