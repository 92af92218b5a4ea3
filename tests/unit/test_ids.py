from __future__ import annotations

import pytest

from outbox.errors import InvalidIdentifier
from outbox.ids import derive_idempotency_key, new_op_id, validate_op_id, validate_tenant

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
