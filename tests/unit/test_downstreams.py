"""Which downstream serves each kind, and which answers prove a downstream back
(``workers.downstreams``): the table of every outcome value, written out independently."""

from __future__ import annotations

import pytest

from outbox.downstream import (
    Accepted,
    Found,
    LookupMisuse,
    LookupNotFound,
    Misuse,
    NotExecuted,
    NotSent,
    Receipt,
    Refused,
    Unavailable,
    Unknown,
)
from outbox.states import RejectReason
from workers.downstreams import WIRE, Downstreams, proves_back

RECEIPT = Receipt(reference="re_1", status="succeeded", params={})

#: outcome -> whether it proves the downstream reachable and processing
ANSWERS = [
    (Accepted(RECEIPT), True),
    (Refused(RejectReason.BUSINESS_REJECTED, code="balance_insufficient", status=402), True),
    (Refused(RejectReason.PERMISSION_DENIED, code="unauthorized", status=401), True),
    (Found(RECEIPT), True),
    (LookupNotFound(), True),
    (NotSent("connection refused"), False),
    (NotExecuted(429, retry_after=3.0), False),
    (NotExecuted(503), False),
    (Unknown("read timeout"), False),
    (Unknown("server error", status=500), False),
    (Misuse("receipt_mismatch", "amount differs"), False),
    (Unavailable("connection refused"), False),
    (LookupMisuse("receipt_mismatch", "amount differs"), False),
]


@pytest.mark.parametrize(("outcome", "back"), ANSWERS, ids=lambda v: type(v).__name__)
def test_only_an_answer_on_the_merits_proves_the_downstream_back(
    outcome: object, back: bool
) -> None:
    assert proves_back(outcome) is back  # type: ignore[arg-type]


def test_a_kind_no_provider_is_named_for_is_the_wire_protocols() -> None:
    downstreams = Downstreams({"refund": "stripe"})
    assert downstreams.of("refund") == "stripe"
    assert downstreams.of("ticket") == WIRE
    kinds = ["ticket", "refund", "pickup", "ticket"]
    assert downstreams.kinds_of("stripe", kinds) == ["refund"]
    assert downstreams.kinds_of(WIRE, kinds) == ["pickup", "ticket"]
    assert downstreams.served(kinds) == {"stripe": ["refund"], WIRE: ["pickup", "ticket"]}
    assert Downstreams().served(kinds) == {WIRE: ["pickup", "refund", "ticket"]}
