"""A kind's agent profile: its defaults for a kind of the app's own, its templates, and the
check that it names only fields its intent has."""

from __future__ import annotations

import pytest

from outbox.kinds import (
    AgentProfile,
    Intent,
    Kind,
    KindRegistry,
    Ref,
    default_registry,
)
from outbox.settings import Settings
from settled.runtime import check_providers


class GiftIntent(Intent):
    order_id: Ref
    note: Ref


def test_a_kind_without_a_profile_is_named_by_its_name_and_shows_every_field() -> None:
    gift = Kind("gift", GiftIntent, "/v1/gifts")
    profile = gift.agent
    assert profile.noun_of("gift") == "gift" and profile.title("gift", "zh") == "gift"
    assert profile.what("gift", {"order_id": "A1", "note": "hi"}) == "gift"
    assert profile.shown == () and profile.minted is None and profile.compensation is None
    assert gift.providers == {"http"}


def test_a_profile_s_prompt_is_a_template_of_intent_fields_and_money() -> None:
    profile = AgentProfile(prompt="{money} for {note}", prompt_short="{note}")
    Kind("gift", GiftIntent, "/v1/gifts", agent=profile)
    params = {"order_id": "A1", "note": "hi", "amount_minor": 500, "currency": "JPY"}
    assert profile.what("gift", params) == "500 JPY for hi"
    assert profile.what("gift", params, short=True) == "hi"


@pytest.mark.parametrize(
    "profile",
    [
        AgentProfile(shown=("order_id", "colour")),
        AgentProfile(shown_as={"colour": "color"}),
        AgentProfile(tool_fields={"colour": "color"}),
        AgentProfile(minted="gift_id"),
        AgentProfile(prompt="a gift on order {order_id} in {colour}"),
        AgentProfile(prompt_short="{colour}"),
    ],
    ids=["shown", "shown_as", "tool_fields", "minted", "prompt", "prompt_short"],
)
def test_a_profile_naming_a_field_the_intent_lacks_is_refused(profile: AgentProfile) -> None:
    with pytest.raises(ValueError, match=r"kind 'gift' names fields .* GiftIntent"):
        Kind("gift", GiftIntent, "/v1/gifts", agent=profile)


def test_the_default_kinds_profiles_name_their_own_fields() -> None:
    registry = default_registry()
    ticket = registry.get("after_sales_ticket").agent
    assert ticket.minted == "ticket_id" and ticket.mint().startswith("tkt_")
    assert ticket.compensation is not None and ticket.compensation.kind == "ticket_cancel"
    assert registry.get(ticket.compensation.kind).agent.noun == "compensation"
    assert registry.get("refund").agent.status_tool == "refund_status"
    # a contract changed by the settings keeps the profile
    changed = registry.with_contract("after_sales_ticket", idempotent=False)
    assert changed.get("after_sales_ticket").agent is ticket


def test_the_providers_a_kind_declares_are_the_ones_the_settings_may_name() -> None:
    settings = Settings(downstream_providers={"gift": "stripe"})
    registry = KindRegistry(
        [Kind("gift", GiftIntent, "/v1/gifts", providers=frozenset({"http", "stripe"}))]
    )
    with pytest.raises(Exception, match="SETTLED_STRIPE_API_KEYS"):
        check_providers(settings, registry)  # servable: only the keys are missing
    plain = KindRegistry([Kind("gift", GiftIntent, "/v1/gifts")])
    with pytest.raises(Exception, match="cannot serve"):
        check_providers(settings, plain)
