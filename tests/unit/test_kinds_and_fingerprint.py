from __future__ import annotations

import json
import re
from datetime import date
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.currencies import MINOR_UNITS
from outbox.errors import InvalidParams, SettledError, UnknownKind
from outbox.fingerprint import Fingerprinter, canonical_bytes, canonical_params
from outbox.kinds import MAX_AMOUNT_MINOR, RefundIntent, default_registry

REGISTRY = default_registry()
REFUND = REGISTRY.get("refund")
FP = Fingerprinter({"v1": b"k" * 32, "v2": b"j" * 32}, "v1")
GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}

refs = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True)
refunds = st.fixed_dictionaries(
    {
        "order_id": refs,
        "amount_minor": st.integers(1, MAX_AMOUNT_MINOR),
        "currency": st.sampled_from(sorted(MINOR_UNITS)),
        "payee": refs,
    }
)


def fingerprint(params: dict[str, Any]) -> str:
    return FP.fingerprint("refund", REFUND.parse(params))


@given(refunds, st.randoms())
def test_key_order_does_not_change_the_fingerprint(params: dict[str, Any], rnd: Any) -> None:
    items = list(params.items())
    rnd.shuffle(items)
    assert fingerprint(dict(items)) == fingerprint(params)


@given(refunds)
def test_a_json_round_trip_gives_the_same_fingerprint(params: dict[str, Any]) -> None:
    assert fingerprint(json.loads(json.dumps(params))) == fingerprint(params)


@given(refunds, st.sampled_from(["order_id", "amount_minor", "currency", "payee"]), st.data())
def test_any_changed_field_changes_the_fingerprint(
    params: dict[str, Any], field: str, data: st.DataObject
) -> None:
    strategy = {
        "order_id": refs,
        "payee": refs,
        "amount_minor": st.integers(1, MAX_AMOUNT_MINOR),
        "currency": st.sampled_from(sorted(MINOR_UNITS)),
    }[field]
    other = data.draw(strategy.filter(lambda v: v != params[field]))
    assert fingerprint({**params, field: other}) != fingerprint(params)


SAMPLES: dict[str, dict[str, Any]] = {
    "refund": GOOD,
    "after_sales_ticket": {"ticket_id": "T1", "order_id": "A1042", "reason": "damaged"},
    "pickup": {"ticket_id": "T1", "day": "2026-12-01", "slot": "morning"},
    "ticket_cancel": {"ticket_id": "T1", "reason": "pickup_failed"},
}


def test_samples_cover_every_kind() -> None:
    assert sorted(SAMPLES) == REGISTRY.names()


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_intent_field_of_every_kind_is_fingerprinted(name: str) -> None:
    kind = REGISTRY.get(name)
    intent = kind.parse(SAMPLES[name])
    canon = json.loads(canonical_bytes(name, intent))
    assert set(canon["params"]) == set(kind.intent.model_fields)
    assert canon["kind"] == name
    base = FP.fingerprint(name, intent)
    for field in kind.intent.model_fields:
        value = getattr(intent, field)
        other = value + 1 if isinstance(value, int) else value + "x"
        changed = intent.model_copy(update={field: other})
        assert FP.fingerprint(name, changed) != base, field


def test_kind_is_part_of_the_fingerprint() -> None:
    intent = REFUND.parse(GOOD)
    assert FP.fingerprint("refund", intent) != FP.fingerprint("payout", intent)


def test_fingerprint_is_keyed_and_versioned() -> None:
    intent = REFUND.parse(GOOD)
    v1 = FP.fingerprint("refund", intent)
    v2 = FP.fingerprint("refund", intent, "v2")
    assert v1 != v2
    assert FP.matches("refund", intent, "v1", v1)
    assert FP.matches("refund", intent, "v2", v2)
    assert not FP.matches("refund", intent, "v2", v1)
    unkeyed = __import__("hashlib").sha256(canonical_bytes("refund", intent)).hexdigest()
    assert v1 != unkeyed


def test_unknown_key_version_is_an_error() -> None:
    with pytest.raises(SettledError):
        FP.fingerprint("refund", REFUND.parse(GOOD), "v9")


def test_short_fingerprint_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        Fingerprinter({"v1": b"short"}, "v1")


BAD_REFUNDS: list[tuple[str, dict[str, Any]]] = [
    ("negative amount", {**GOOD, "amount_minor": -1}),
    ("zero amount", {**GOOD, "amount_minor": 0}),
    ("float amount", {**GOOD, "amount_minor": 100.0}),
    ("fractional amount", {**GOOD, "amount_minor": 99.5}),
    ("boolean amount", {**GOOD, "amount_minor": True}),
    ("string amount", {**GOOD, "amount_minor": "10000"}),
    ("enormous amount", {**GOOD, "amount_minor": MAX_AMOUNT_MINOR + 1}),
    ("huge integer", {**GOOD, "amount_minor": 10**40}),
    ("NaN amount", {**GOOD, "amount_minor": float("nan")}),
    ("infinite amount", {**GOOD, "amount_minor": float("inf")}),
    ("null amount", {**GOOD, "amount_minor": None}),
    ("lower-case currency", {**GOOD, "currency": "cny"}),
    ("unknown currency", {**GOOD, "currency": "XYZ"}),
    ("malformed currency", {**GOOD, "currency": "CN"}),
    ("currency with space", {**GOOD, "currency": "CNY "}),
    ("unknown field", {**GOOD, "note": "hi"}),
    ("missing field", {k: v for k, v in GOOD.items() if k != "payee"}),
    ("empty order", {**GOOD, "order_id": ""}),
    ("SQL-shaped payee", {**GOOD, "payee": "x'; DROP TABLE operations;--"}),
    ("unicode order", {**GOOD, "order_id": "А1042"}),
    ("nested object", {**GOOD, "payee": {"id": "P"}}),
    ("oversized payload", {**GOOD, "payee": "P" * 5000}),
]


@pytest.mark.parametrize(("case", "params"), BAD_REFUNDS, ids=[c for c, _ in BAD_REFUNDS])
def test_bad_refund_params_raise_invalid_params(case: str, params: dict[str, Any]) -> None:
    with pytest.raises(InvalidParams) as info:
        REFUND.parse(params)
    assert info.value.code in {"invalid_params", "params_not_json", "params_too_large"}


def test_invalid_params_error_does_not_echo_values() -> None:
    with pytest.raises(InvalidParams) as info:
        REFUND.parse({**GOOD, "payee": "secret-payee-123$"})
    text = json.dumps(info.value.as_dict())
    assert "secret-payee-123" not in text
    assert "payee" in text


def test_params_must_be_an_object() -> None:
    with pytest.raises(InvalidParams) as info:
        REFUND.parse([("amount_minor", 1)])
    assert info.value.code == "params_not_object"


def test_unknown_kind() -> None:
    with pytest.raises(UnknownKind) as info:
        REGISTRY.get("payout")
    assert info.value.code == "unknown_kind"


def test_good_refund_parses_to_explicit_units() -> None:
    intent = REFUND.parse(GOOD)
    assert isinstance(intent, RefundIntent)
    assert intent.amount_minor == 10000 and intent.currency == "CNY"


def test_registry_refuses_duplicate_kind() -> None:
    with pytest.raises(ValueError, match="already registered"):
        REGISTRY.register(REFUND)


def test_with_contract_changes_only_the_copy() -> None:
    other = REGISTRY.with_contract("refund", idempotent=False)
    assert other.get("refund").contract.idempotent is False
    assert REGISTRY.get("refund").contract.idempotent is True


PICKUP = REGISTRY.get("pickup")


def pickup(day: object) -> dict[str, Any]:
    return {"ticket_id": "T1", "day": day, "slot": "morning"}


@pytest.mark.parametrize(
    "day",
    [
        "20٣٣-01-01",  # Arabic-Indic digits: "\d" took them
        "20𝟘𝟘-01-01",  # mathematical double-struck digits
        "２０２６-12-01",  # fullwidth digits
        "2026-١٢-01",
        "2024-02-31",
        "2023-02-29",  # not a leap year
        "2026-04-31",
        "2026-13-01",
        "2026-00-10",
        "2026-12-00",
        "20261201",  # date.fromisoformat takes it; the canonical form is YYYY-MM-DD
        "2026-W01-1",  # an ISO week date
        "2026-12-01T00:00",
        "2026-12-01\n",
        " 2026-12-01",
        "1999-12-31",
        "2100-01-01",
        "",
        20261201,
    ],
)
def test_a_pickup_day_must_be_a_real_calendar_day_in_ascii_digits(day: object) -> None:
    with pytest.raises(InvalidParams) as info:
        PICKUP.parse(pickup(day))
    assert [e["field"] for e in info.value.data["errors"]] == ["day"]
    if isinstance(day, str) and day.strip():
        assert day.strip() not in json.dumps(info.value.as_dict(), ensure_ascii=False)


@pytest.mark.parametrize("day", ["2024-02-29", "2000-01-01", "2099-12-31", "2026-12-01"])
def test_real_days_are_kept_exactly_as_sent(day: str) -> None:
    assert PICKUP.parse(pickup(day)).model_dump()["day"] == day


@given(st.dates(min_value=date(2000, 1, 1), max_value=date(2099, 12, 31)))
def test_every_day_of_the_century_is_accepted_in_its_iso_form(day: date) -> None:
    assert canonical_params(PICKUP.parse(pickup(day.isoformat())))["day"] == day.isoformat()


# Day-shaped strings: the year's digits from any script, the day up to 31 in any month.
day_like = st.builds(
    "20{}-{:02d}-{:02d}".format,
    st.text(st.characters(categories=["Nd"]), min_size=2, max_size=2),
    st.integers(1, 12),
    st.integers(1, 31),
)


@given(st.text(max_size=12) | day_like)
def test_any_accepted_day_is_an_ascii_calendar_day(day: str) -> None:
    try:
        intent = PICKUP.parse(pickup(day))
    except InvalidParams:
        return
    assert day.isascii()
    assert date.fromisoformat(day).isoformat() == day
    assert canonical_params(intent)["day"] == day


# Fingerprints of one intent of each kind, computed before the day became a calendar check:
# tightening validation must never change the canonical form of an intent that was valid.
GOLDEN = {
    "refund": "870f0f31b587fa0ad98a4ed8a6f0c4e18d6e718040bf963fd5ec24bf53eacfc9",
    "after_sales_ticket": "f23935e36ff3615c8cd762db1ca81124984d39b484df20457ee3d265d29297e4",
    "pickup": "03289eecf47a2f678cfc83334d1aa109f1317721e8df3ed483ae07483cf9d729",
    "ticket_cancel": "296956f10ad11806a67f04c5f03878c19e077fd7aeed007b7d8e0a6fd93631d5",
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_fingerprints_of_valid_intents_are_unchanged(name: str) -> None:
    assert FP.fingerprint(name, REGISTRY.get(name).parse(SAMPLES[name])) == GOLDEN[name]
    leap = {"ticket_id": "T1", "day": "2024-02-29", "slot": "evening"}
    assert FP.fingerprint("pickup", PICKUP.parse(leap)) == (
        "f2b266692294d70414d140f391ba30e0ef8f47bc9c63d1d50dd3b0b36b9772ef"
    )


def _patterns(annotation_metadata: list[Any]) -> list[str]:
    found = []
    for item in annotation_metadata:
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str):
            found.append(pattern)
    return found


@pytest.mark.parametrize("name", REGISTRY.names())
def test_no_intent_pattern_uses_unicode_aware_shorthand_classes(name: str) -> None:
    # pydantic's regex engine gives \d, \w and \s their Unicode meaning: "٣" is a \d.
    kind = REGISTRY.get(name)
    for field_name, info in kind.intent.model_fields.items():
        for pattern in _patterns(info.metadata):
            assert not re.search(r"\\[dDwWsSbB]", pattern), (field_name, pattern)


@pytest.mark.parametrize("value", ["A١٠٤٢", "A𝟙042", "A1042\n", "Ａ1042", "A1042\u200b"])
def test_refs_take_ascii_only(value: str) -> None:
    with pytest.raises(InvalidParams):
        REFUND.parse({**GOOD, "order_id": value})
