"""The last checks before a send (``check_before_send``) at the edges the mutation suite found
unpinned (docs/mutation.md): an idempotent operation with a send behind it may be sent again
within its budget; a non-idempotent one may not; a stop records that nothing was sent."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from outbox.kinds import DownstreamContract
from workers.verdicts import check_before_send

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _check(contract: DownstreamContract) -> object:
    return check_before_send(
        now=NOW,
        deadline=NOW + timedelta(hours=1),
        attempts=1,
        max_attempts=3,
        reached_downstream=1,
        first_sent_at=NOW - timedelta(minutes=1),
        contract=contract,
        run_cancelled=False,
        fingerprint_ok=True,
    )


def test_an_idempotent_operation_may_be_sent_again_within_its_budget() -> None:
    assert _check(DownstreamContract(idempotent=True)) is None


def test_a_non_idempotent_one_is_stopped_after_one_send_and_records_nothing_sent() -> None:
    change = _check(DownstreamContract(idempotent=False))
    assert change is not None
    assert change.evidence == {
        "stop": "one_send_without_idempotency",
        "sent": False,
        "tries": 1,
        "reached": 1,
    }
