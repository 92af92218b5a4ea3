"""``settled`` as a shell runs it, on PostgreSQL and SQLite, against an open review item: bad
input found by fuzzing (an id beyond BIGINT, bytes that are not UTF-8 in argv) is one
``Error:`` line and a non-zero exit, writes nothing; and ``settled apikey`` works on the
database the status API reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from outbox.apikeys import authenticate
from outbox.models import ApiKey, OperationEvent, ReviewItem
from tests.support.rig import HOLD, Rig


def in_review(rig: Rig) -> int:
    """An operation left unknown with an open review item (its lookup down for too long)."""
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    rig.executor().execute([op])
    rig.control.add_rule("lookup_unavailable", times=1)
    rig.set(op, unknown_since=datetime.now(UTC) - timedelta(hours=1))
    assert rig.reconciler().run_once().outcomes == {"to_review": 1}
    (item,) = rig.reviews(op)
    return item.id


def settled(rig: Rig, *args: str | bytes) -> subprocess.CompletedProcess[bytes]:
    """``settled ARGS`` in a process of its own; ``bytes`` arguments reach argv unchanged."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    env.update(
        SETTLED_DATABASE_URL=rig.engine.url.render_as_string(hide_password=False),
        SETTLED_DOWNSTREAM_URL=rig.url,
        SETTLED_DOWNSTREAM_API_KEYS=json.dumps({"acme": rig.tenant.api_key.get_secret_value()}),
        SETTLED_DOWNSTREAM_TIMEOUT="2",
        # The rig's own keys: review refuses the development ones against PostgreSQL.
        SETTLED_FINGERPRINT_KEYS=json.dumps({"v1": "test-fingerprint-key-0001"}),
        SETTLED_IDEMPOTENCY_SECRET="test-idempotency-secret",
        SETTLED_STAFF_ID="alice",
        SETTLED_STAFF_ROLE="support",
    )
    return subprocess.run(
        [sys.executable, "-m", "settled.cli", *args],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[bytes], status: int) -> str:
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == status, stderr
    assert "Traceback" not in stderr
    (line,) = stderr.splitlines()
    assert line.startswith("Error: ")
    return line


def written(rig: Rig) -> tuple[int, int, int]:
    """Rows an action could have written: events, resolved items, API keys."""
    with rig.sessions() as s:
        return (
            s.scalar(select(func.count()).select_from(OperationEvent)) or 0,
            s.scalar(select(func.count()).where(ReviewItem.resolved_at.is_not(None))) or 0,
            s.scalar(select(func.count()).select_from(ApiKey)) or 0,
        )


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("review", "show", "99999999999999999999"), "ITEM"),
        (("review", "requery", "99999999999999999999"), "ITEM"),
        (("review", "list", "--tenant", b"ac\xffme"), "--tenant"),
        (("review", "list", "--reason", b"\xfe"), "--reason"),
        (("apikey", "create", "--tenant", b"ac\xffme"), "--tenant"),
        (("apikey", "revoke", b"\xff\xfe"), "KEY_ID"),
    ],
    ids=["show-bigint", "requery-bigint", "tenant-bytes", "reason-bytes", "apikey-tenant",
         "apikey-id"],
)  # fmt: skip
def test_bad_input_from_the_shell_is_one_line_and_writes_nothing(
    rig: Rig, args: tuple[str | bytes, ...], names: str
) -> None:
    rig.judged_by_ledger = False  # nothing is sent
    before = written(rig)
    line = assert_one_line_error(settled(rig, *args), 2)
    assert names in line
    assert written(rig) == before


@pytest.mark.parametrize(
    "evidence",
    [
        ("--as", "rejected", "--justification", b"\xff\xfe"),
        ("--as", "succeeded", "--reference", b"re_\xff"),
        ("--as", "rejected", "--justification", "fine", "--version", "99999999999"),
    ],
    ids=["justification-bytes", "reference-bytes", "version-beyond-integer"],
)
def test_a_resolve_with_bad_evidence_is_one_line_and_leaves_the_item_open(
    rig: Rig, evidence: tuple[str | bytes, ...]
) -> None:
    item = in_review(rig)
    before = written(rig)
    version = () if "--version" in evidence else ("--version", "1")
    line = assert_one_line_error(
        settled(rig, "review", "resolve", str(item), *evidence, *version), 2
    )
    assert "Invalid value" in line
    assert written(rig) == before
    shown = settled(rig, "review", "show", str(item))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["item"]["resolved_at"] is None


def test_apikey_create_and_revoke_on_the_database(rig: Rig) -> None:
    rig.judged_by_ledger = False
    created = settled(rig, "apikey", "create", "--tenant", "acme")
    assert created.returncode == 0, created.stderr
    key = created.stdout.decode().strip()
    key_id = created.stderr.decode().strip().removeprefix("key id: ")
    with rig.sessions() as s:
        principal = authenticate(s, key)
    assert principal is not None and (principal.tenant, principal.key_id) == ("acme", key_id)
    revoked = settled(rig, "apikey", "revoke", key_id)
    assert (revoked.returncode, revoked.stdout.strip()) == (0, b"revoked")
    with rig.sessions() as s:
        assert authenticate(s, key) is None
    again = settled(rig, "apikey", "revoke", key_id)
    assert assert_one_line_error(again, 1) == "Error: [api_key_not_found] no such active key"
