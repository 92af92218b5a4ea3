from __future__ import annotations

import pytest

from outbox.errors import InvalidIdentifier, InvalidInput
from outbox.ids import (
    derive_idempotency_key,
    new_op_id,
    validate_correlation_id,
    validate_label,
    validate_op_id,
    validate_tenant,
)

SECRET = b"test-secret-0000"


def test_new_op_ids_are_unique_and_time_ordered() -> None:
    ids = [new_op_id() for _ in range(5000)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert all(validate_op_id(i) == i for i in ids[:10])


def test_idempotency_key_is_stable_opaque_and_per_tenant() -> None:
    a = derive_idempotency_key(SECRET, "acme", "op-9")
    assert a == derive_idempotency_key(SECRET, "acme", "op-9")
    assert a != derive_idempotency_key(SECRET, "globex", "op-9")
    assert a != derive_idempotency_key(SECRET, "acme", "op-10")
    assert "acme" not in a and "op-9" not in a
    assert len(a) == 40


def test_idempotency_key_does_not_collide_across_the_separator() -> None:
    assert derive_idempotency_key(SECRET, "ab", "c") != derive_idempotency_key(SECRET, "a", "bc")


BAD_IDS = [
    "",
    " ",
    " op-1",
    "op-1 ",
    "op\t1",
    "op\n1",
    "x" * 81,
    "óp-1",
    "оp-1",  # Cyrillic o
    "op-１",  # fullwidth digit
    "op-1'; DROP TABLE operations;--",
    "op-1\x00",
    "op\x00\x01",
    "op-\ud800",  # a lone surrogate: no encoding can store it
    "op-٣",  # Arabic-Indic digit: "\\d" would take it
    "op-𝟘",  # mathematical double-struck digit
    "op-1\n",  # "$" in a Python pattern matches before a final newline
    "op\u200b1",  # zero-width space
    "-leading-dash",
    None,
    12,
    b"op-1",
]


@pytest.mark.parametrize("value", BAD_IDS)
def test_malformed_op_id_is_refused(value: object) -> None:
    with pytest.raises(InvalidIdentifier) as info:
        validate_op_id(value)
    assert info.value.code == "invalid_op_id"


@pytest.mark.parametrize("value", [*BAD_IDS, "Acme", "x" * 64, "acme.corp"])
def test_malformed_tenant_is_refused(value: object) -> None:
    with pytest.raises(InvalidIdentifier) as info:
        validate_tenant(value)
    assert info.value.code == "invalid_tenant"


@pytest.mark.parametrize("value", ["op-9", "A1042.refund:1", "x" * 80, "op_01J"])
def test_well_formed_op_ids_pass(value: str) -> None:
    assert validate_op_id(value) == value


GOOD_CORRELATION_IDS = [
    "call_02",
    "toolu_01A09q90qw90lq917835lq9",
    "chatcmpl-tool-4f1c9a7e",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # a W3C traceparent
    "c2VjcmV0/Ym9keQ+==",  # base64
    "x" * 200,
]


@pytest.mark.parametrize("value", GOOD_CORRELATION_IDS)
def test_well_formed_correlation_ids_pass(value: str) -> None:
    assert validate_correlation_id(value) == value


@pytest.mark.parametrize(
    "value",
    [
        *[v for v in BAD_IDS if v not in ("x" * 81, "op-1'; DROP TABLE operations;--")],
        "a\x00b",
        "\ud800",
        "x" * 201,
        "call 02",
        'call"02',
        "call<02>",
        "/leading-slash",
    ],
)
def test_malformed_correlation_id_is_refused_without_echoing_it(value: object) -> None:
    with pytest.raises(InvalidIdentifier) as info:
        validate_correlation_id(value)
    assert info.value.code == "invalid_correlation_id"
    assert info.value.data == {"field": "correlation_id"}
    if isinstance(value, str) and len(value) > 2:
        assert value not in info.value.message


@pytest.mark.parametrize("value", ["Refunds on order A1042", "退款 A1042", "Ünïcödé ✓", "x" * 200])
def test_printable_labels_pass(value: str) -> None:
    assert validate_label(value, field="title", max_length=200) == value


@pytest.mark.parametrize(
    "value", ["", "a\x00b", "\ud800", "line\nbreak", "tab\t", "zero\u200bwidth", "x" * 201, None, 7]
)
def test_unprintable_labels_are_refused(value: object) -> None:
    with pytest.raises(InvalidInput) as info:
        validate_label(value, field="title", max_length=200)
    assert info.value.code == "invalid_title"
    assert info.value.data == {"field": "title"}
