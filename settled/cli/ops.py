"""``settled ops``: operations as an operator reads and handles them.

    list       operations by state, reason, tenant and age, each in the run report's words
    show       one operation as the console's operation page shows it (report, timeline)
    resubmit   a rejected or cancelled intent again, under a new op id, audited
    prune      delete terminal operations older than N days (optionally archived first),
               keeping a tombstone of each that answers a replay of its op_id
    prune-tombstones  delete tombstones older than N days: re-opens those op_ids (warned)
    audit      effects the downstreams hold with no operation here (``settled.cli.audit``)

``list`` and ``show`` read through ``support.listing``, ``resubmit`` writes through
``outbox.resubmit`` (the normal intake), ``prune`` is ``outbox.prune.prune``,
``prune-tombstones`` ``outbox.tombstones.prune_tombstones``.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import Any, ClassVar

import click

from settled.cli.common import TEXT, Text

LANG = click.option(
    "--lang", type=click.Choice(["en", "zh"]), default="en", show_default=True,
    help="the language of the report's words",
)  # fmt: skip
AS_JSON = click.option("--json", "as_json", is_flag=True, help="machine-readable output")
#: what the words of each report group are, as the run report's headings say them
GROUP_WORDS = {"done": "done", "not_done": "not done", "uncertain": "uncertain"}


class Age(click.ParamType):  # type: ignore[type-arg]
    """An age: a number with a unit (``90s``, ``15m``, ``1h``, ``7d``), or seconds."""

    name = "age"
    units: ClassVar[dict[str, int]] = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    largest = 100 * 365 * 86400
    pattern = re.compile(r"(\d{1,12})([smhd]?)")

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        if isinstance(value, timedelta):
            return value
        found = self.pattern.fullmatch(str(value).strip())
        if found is None:
            self.fail("is not an age such as 90s, 15m, 1h or 7d", param, ctx)
        seconds = int(found.group(1)) * self.units[found.group(2) or "s"]
        if seconds > self.largest:
            self.fail("is more than 100 years", param, ctx)
        return timedelta(seconds=seconds)


def _read(action: Any) -> Any:
    """Run ``action(session)`` on the configured database, reading only (no write lock)."""
    from sqlalchemy.orm import Session

    from outbox.db import make_engine
    from outbox.settings import Settings

    engine = make_engine(Settings().database_url)
    try:
        with Session(engine) as session:
            return action(session)
    finally:
        engine.dispose()


@click.group()
def ops() -> None:
    """Operations: list, show, resubmit, prune, prune-tombstones, audit (operators)."""


@ops.command("list")
@click.option(
    "--state", default=None,
    type=click.Choice(["planned", "submitted", "unknown", "succeeded", "rejected", "cancelled"]),
)  # fmt: skip
@click.option(
    "--reason", default=None,
    type=click.Choice(["business_rejected", "invalid_params", "permission_denied",
                       "not_executed"]),
    help="why it was rejected",
)  # fmt: skip
@click.option("--tenant", default=None, type=TEXT)
@click.option("--older-than", type=Age(), default=None, help="created longer ago, e.g. 1h")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@LANG
@AS_JSON
def ops_list(
    state: str | None,
    reason: str | None,
    tenant: str | None,
    older_than: timedelta | None,
    limit: int,
    lang: str,
    as_json: bool,
) -> None:
    """Operations, oldest first, each with its line of the run report."""
    from support.listing import list_operations

    rows = _read(
        lambda s: list_operations(
            s, state=state, reason=reason, tenant=tenant, older_than=older_than, limit=limit
        )
    )
    if as_json:
        click.echo(json.dumps(rows, indent=2, ensure_ascii=False))
        return
    from settled.console.formats import age

    table: list[tuple[str, ...]] = [("AGE", "TENANT", "OP_ID", "KIND", "STATE", "GROUP", "REPORT")]
    for row in rows:
        since = datetime.fromisoformat(row["created_at"])
        now = since + timedelta(seconds=row["age_seconds"])
        state_shown = row["state"] + (f"/{row['reason']}" if row["reason"] else "")
        group = GROUP_WORDS[row["report"]["group"]]
        table.append((age(since, now), row["tenant"], row["op_id"], row["kind"], state_shown,
                      group, row["report"]["text"][lang]))  # fmt: skip
    _table(table)
    click.echo(f"{len(rows)} operation(s)")


@ops.command("show")
@click.argument("tenant", type=TEXT)
@click.argument("op_id", type=TEXT)
@LANG
@AS_JSON
def ops_show(tenant: str, op_id: str, lang: str, as_json: bool) -> None:
    """One operation: the report's words, its facts, attempts, lookups and events."""
    from support.listing import show_operation

    shown = _read(lambda s: show_operation(s, tenant, op_id))
    if as_json:
        click.echo(json.dumps(shown, indent=2, ensure_ascii=False))
        return
    _show(shown, lang)


@ops.command("resubmit")
@click.argument("tenant", type=TEXT)
@click.argument("op_id", type=TEXT)
@click.option("--new-op-id", required=True, type=TEXT, help="the new operation's op id")
@click.option("--by", "by", required=True, type=Text(max_length=64), help="who asks for it")
@click.option("--reason", "why", required=True, type=Text(max_length=500), help="why")
@AS_JSON
def ops_resubmit(tenant: str, op_id: str, new_op_id: str, by: str, why: str, as_json: bool) -> None:
    """Submit a rejected or cancelled operation's intent again, as NEW_OP_ID.

    Only for one proven not carried out; both operations record who asked and why. The
    sweeper hands the new one to a worker (within SETTLED_SWEEP_SECONDS)."""
    from outbox.resubmit import resubmit
    from outbox.settings import Settings
    from settled.runtime import build_runtime

    rt = build_runtime(Settings())
    try:
        with rt.sessions.begin() as s:
            done = _resubmitted(
                resubmit(
                    rt.outbox, s, tenant=tenant, op_id=op_id, new_op_id=new_op_id, by=by, why=why
                )
            )
    finally:
        rt.close()
    if as_json:
        click.echo(json.dumps(done, indent=2, ensure_ascii=False))
        return
    verb = "resubmitted" if done["created"] else "already resubmitted"
    run = f" in run {done['run']}" if done["run"] else ""
    click.echo(f"{verb} {tenant}/{done['original']} as {done['op_id']}{run} ({done['state']})")


def _resubmitted(done: Any) -> dict[str, Any]:
    return {
        "original": done.original.op_id,
        "op_id": done.operation.op_id,
        "state": done.operation.state,
        "created": done.created,
        "run": done.run.handle if done.run is not None else None,
    }


@ops.command("prune")
@click.option(
    "--older-than", "days", required=True, type=click.IntRange(1, 36500), metavar="DAYS",
    help="untouched for this many days",
)  # fmt: skip
@click.option(
    "--archive", type=click.Path(dir_okay=False), default=None,
    help="append each operation and its rows to this file first, as JSON lines",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="count only: delete and write nothing")
@click.option("--batch-size", type=click.IntRange(1, 5000), default=500, show_default=True)
@AS_JSON
def ops_prune(
    days: int, archive: str | None, dry_run: bool, batch_size: int, as_json: bool
) -> None:
    """Delete terminal operations untouched for DAYS, with their events, attempts and review
    items; never a live one, one in review, or one a live run or compensation needs."""
    from outbox.db import make_engine
    from outbox.prune import prune
    from outbox.settings import Settings

    engine = make_engine(Settings().database_url)
    try:
        pruned = prune(
            engine, timedelta(days=days), archive=archive, dry_run=dry_run, batch_size=batch_size
        )
    finally:
        engine.dispose()
    click.echo(json.dumps(pruned.as_dict()) if as_json else pruned.summary())


@ops.command("prune-tombstones")
@click.option(
    "--older-than", "days", required=True, type=click.IntRange(1, 36500), metavar="DAYS",
    help="operations pruned this many days ago or more",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="count only: delete nothing")
@click.option(
    "--yes-replays-execute-again", "confirmed", is_flag=True,
    help="required to delete: those op_ids, enqueued again, are carried out again",
)  # fmt: skip
@click.option("--batch-size", type=click.IntRange(1, 5000), default=500, show_default=True)
@AS_JSON
def ops_prune_tombstones(
    days: int, dry_run: bool, confirmed: bool, batch_size: int, as_json: bool
) -> None:
    """Delete the tombstones of operations pruned DAYS ago or more. This RE-OPENS their
    op_ids: enqueued again, each makes a new operation with the same idempotency key, which a
    downstream past its key retention carries out a second time."""
    from outbox.db import make_engine
    from outbox.settings import Settings
    from outbox.tombstones import WARNING, prune_tombstones

    click.echo(WARNING, err=True)
    if not dry_run and not confirmed:
        raise click.UsageError(
            "deleting tombstones needs --yes-replays-execute-again (or --dry-run to count)"
        )
    engine = make_engine(Settings().database_url)
    try:
        pruned = prune_tombstones(
            engine, timedelta(days=days), dry_run=dry_run, batch_size=batch_size
        )
    finally:
        engine.dispose()
    click.echo(json.dumps(pruned.as_dict()) if as_json else pruned.summary())


# -- output ----------------------------------------------------------------------------------


def _table(rows: list[tuple[str, ...]], indent: str = "") -> None:
    """Rows in columns, the first row the headers; the last column is not padded."""
    rows = [tuple(cell or "-" for cell in row) for row in rows]  # an empty cell keeps its column
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        click.echo((indent + "  ".join([*cells, row[-1]])).rstrip())


def _show(shown: dict[str, Any], lang: str) -> None:
    from settled.console.formats import amount, who

    op, report = shown["operation"], shown["report"]
    click.echo(f"Operation {op['op_id']} of {op['tenant']}")
    click.echo(f"{GROUP_WORDS[report['group']]}: {report['text'][lang]}")
    if shown["review_item"] is not None:
        click.echo(f"in review: item #{shown['review_item']} (settled review show)")
    state = op["state"] + (f" ({op['reason']})" if op["reason"] else "")
    facts = [
        ("tenant", op["tenant"]), ("op_id", op["op_id"]), ("kind", op["kind"]),
        ("amount", amount(op["params"].get("amount_minor"), op["params"].get("currency"))),
        ("state", state), ("params", json.dumps(op["params"], ensure_ascii=False)),
        ("idempotency key", op["idempotency_key"]), ("created", op["created_at"]),
        ("deadline", op["deadline"]), ("unknown since", op["unknown_since"] or "none"),
        ("reference", op["downstream_ref"] or "none"),
    ]  # fmt: skip
    click.echo("\nOperation")
    _table([("FIELD", "VALUE"), *facts], indent="  ")
    run = shown["run"]
    shown_run = (
        "none" if run is None else run["handle"] + (f": {run['title']}" if run["title"] else "")
    )
    click.echo(f"\nRun: {shown_run}")
    click.echo("\nAttempts")
    _table(
        [("#", "REQUESTED", "FINISHED", "OUTCOME", "HTTP", "DETAIL")]
        + [(str(a["number"]), a["started_at"], a["finished_at"] or "",
            a["proof"] or "in flight", str(a["status_code"] or ""), _compact(a["detail"]))
           for a in shown["attempts"]],
        indent="  ",
    )  # fmt: skip
    click.echo("\nLookups")
    _table(
        [("AT", "BY", "ANSWER", "DETAIL")]
        + [(lk["at"], who(lk["by"]), lk["answer"] or "", str(lk["detail"] or ""))
           for lk in shown["lookups"]],
        indent="  ",
    )  # fmt: skip
    click.echo("\nEvents")
    _table(
        [("AT", "FROM", "TO", "BY", "REASON", "EVIDENCE")]
        + [(e["at"], e["from"] or "", e["to"], e["actor"], e["reason"] or "",
            _compact(e["evidence"])) for e in shown["events"]],
        indent="  ",
    )  # fmt: skip


def _compact(value: Any) -> str:
    return "" if not value else json.dumps(value, ensure_ascii=False, sort_keys=True)
