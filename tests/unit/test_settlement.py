"""The one rule for a downstream record found by a lookup (``outbox.downstream.settlement``),
used alike by a worker recovering an abandoned send, the reconciler and staff."""

from __future__ import annotations

import pytest

from outbox.downstream import Found, Receipt, settlement
from outbox.states import RejectReason, State

DONE = Receipt("re_1", "succeeded", {"amount_minor": 100})
REFUSED = Receipt("re_2", "rejected", {"amount_minor": 100})


def test_a_found_success_settles_as_succeeded_with_its_receipt() -> None:
    settled = settlement(Found(DONE))
    assert (settled.state, settled.reason) == (State.SUCCEEDED, None)
    assert settled.receipt == DONE.as_dict()
    assert settled.evidence == {}


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (RejectReason.INVALID_PARAMS, RejectReason.INVALID_PARAMS),
        (None, RejectReason.BUSINESS_REJECTED),  # the downstream gave no reason
    ],
)
def test_a_found_refusal_settles_as_rejected_with_the_downstreams_reason(
    reason: RejectReason | None, expected: RejectReason
) -> None:
    settled = settlement(Found(REFUSED, reason, "order_closed"))
    assert (settled.state, settled.reason) == (State.REJECTED, expected)
    assert settled.receipt == REFUSED.as_dict()
    assert settled.evidence == {"code": "order_closed"}
