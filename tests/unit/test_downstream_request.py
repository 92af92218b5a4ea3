"""The one value a gateway's calls take (``DownstreamRequest``), and the shim for adapters and
callers still written with the six keywords of earlier releases."""

from __future__ import annotations

import dataclasses
import warnings
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outbox import FakeGateway
from outbox.downstream import (
    Accepted,
    DownstreamRequest,
)
from outbox.kinds import default_registry
from outbox.port_shim import OldStyleGateway, as_gateway, takes_request

REFUND = default_registry().get("refund")
PARAMS = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
LATER = datetime.now(UTC) + timedelta(days=1)


def request(**kw: Any) -> DownstreamRequest:
    fields: dict[str, Any] = {
        "tenant": "acme", "op_id": "op-1", "kind": REFUND, "idempotency_key": "k1",
        "params": PARAMS, **kw,
    }  # fmt: skip
    return DownstreamRequest(**fields)


def test_a_request_is_frozen_and_its_params_a_read_only_copy() -> None:
    params = dict(PARAMS)
    req = request(params=params)
    params["amount_minor"] = 1  # the caller's dict changes afterwards: the request does not
    assert req.params["amount_minor"] == 10000
    with pytest.raises(TypeError):
        req.params["amount_minor"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.tenant = "other"  # type: ignore[misc]
    assert "A1042" not in repr(req) and "P-7" not in repr(req)  # intent fields: not in a log
    assert hash(req) == hash(request())


@pytest.mark.parametrize(
    ("fields", "wrong"),
    [
        ({"tenant": ""}, "tenant"),
        ({"op_id": None}, "op_id"),
        ({"idempotency_key": 7}, "idempotency_key"),
        ({"kind": "refund"}, "kind"),
        ({"params": [("amount_minor", 1)]}, "params"),
    ],
)
def test_a_request_refuses_what_is_not_one(fields: dict[str, Any], wrong: str) -> None:
    with pytest.raises(TypeError, match=f"DownstreamRequest.{wrong} must be"):
        request(**fields)


class NewForm:
    def submit(self, request: DownstreamRequest, /, *, deadline: Any) -> Any: ...
    def lookup(self, request: DownstreamRequest, /, *, deadline: Any) -> Any: ...


class Passing:
    def submit(self, *args: Any, **kw: Any) -> Any: ...
    def lookup(self, *args: Any, **kw: Any) -> Any: ...


class OldForm:
    def submit(self, *, tenant: str, op_id: str, kind: Any, idempotency_key: str,
               params: Any, deadline: Any) -> Any: ...  # fmt: skip
    def lookup(self, **kw: Any) -> Any: ...


class HalfOld(NewForm):
    def lookup(self, *, tenant: str, op_id: str, kind: Any, idempotency_key: str,
               params: Any, deadline: Any) -> Any: ...  # fmt: skip


def test_the_old_form_is_told_by_signature() -> None:
    assert takes_request(NewForm().submit) and takes_request(Passing().lookup)
    assert takes_request(FakeGateway().submit)  # the shipped ones, old_keywords and all
    assert not takes_request(OldForm().submit) and not takes_request(OldForm().lookup)


def test_a_new_style_gateway_is_taken_as_it_is_without_a_warning() -> None:
    fake, new = FakeGateway(), NewForm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_gateway(fake) is fake and as_gateway(new) is new


def test_an_old_style_gateway_is_wrapped_once_and_called_the_old_way() -> None:
    with pytest.warns(DeprecationWarning, match="HalfOld.lookup takes the old keywords"):
        wrapped = as_gateway(HalfOld())
    assert isinstance(wrapped, OldStyleGateway) and wrapped.old == {"lookup"}
    assert as_gateway(wrapped) is wrapped  # already wrapped: no second warning


def test_a_shipped_gateway_still_takes_the_old_keywords_for_one_release_with_a_warning() -> None:
    fake = FakeGateway()
    with pytest.warns(DeprecationWarning, match=r"FakeGateway.submit\(tenant=.*deprecated"):
        outcome = fake.submit(  # type: ignore[call-arg]
            tenant="acme", op_id="op-1", kind=REFUND, idempotency_key="k1", params=PARAMS,
            deadline=LATER,
        )  # fmt: skip
    assert isinstance(outcome, Accepted)
    assert fake.submit(request(), deadline=LATER) == outcome  # the same key: a replay
    assert fake.effects("acme", "k1") == 1


def test_the_old_keywords_only_in_part_are_a_type_error() -> None:
    with pytest.raises(TypeError):
        FakeGateway().submit(tenant="acme", idempotency_key="k1", deadline=LATER)  # type: ignore[call-arg]


def test_a_gateway_that_lacks_a_call_is_taken_as_it_is() -> None:
    class LookupOnly:
        def lookup(self, request: DownstreamRequest, /, *, deadline: Any) -> Any: ...

    only = LookupOnly()
    assert as_gateway(only) is only  # a review queue's stand-in: asked lookups only
