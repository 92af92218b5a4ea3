"""Staff roles and tenant limits (support.staff), and who may override the evidence rule."""

from __future__ import annotations

import pytest

from outbox.errors import Forbidden, InvalidInput
from support.resolve import Resolution
from support.staff import Role, Staff, require_acting


def test_a_member_without_a_tenant_limit_sees_every_tenant() -> None:
    assert Staff("ann", Role.VIEWER).sees("acme")


def test_a_member_limited_to_tenants_sees_only_those() -> None:
    limited = Staff("ann", Role.SUPPORT, frozenset({"acme"}))
    assert limited.sees("acme")
    assert not limited.sees("globex")


@pytest.mark.parametrize("role", [Role.SUPPORT, Role.SUPERVISOR, Role.ADMIN])
def test_acting_roles_may_act(role: Role) -> None:
    require_acting(Staff("ann", role))


def test_a_viewer_may_not_act() -> None:
    with pytest.raises(Forbidden):
        require_acting(Staff("ann", Role.VIEWER))


def test_admin_parses_as_a_role() -> None:
    assert Staff.parse("ann", "admin").role is Role.ADMIN
    with pytest.raises(InvalidInput):
        Staff.parse("ann", "root")


def _override(role: Role) -> Resolution:
    return Resolution.parse(
        Staff("ann", role),
        1,
        outcome="rejected",
        version=1,
        reference=None,
        justification="checked with the payment service by phone",
        override=True,
    )


@pytest.mark.parametrize("role", [Role.SUPERVISOR, Role.ADMIN])
def test_supervisors_and_admins_may_override(role: Role) -> None:
    assert _override(role).override


def test_support_may_not_override() -> None:
    with pytest.raises(Forbidden, match="supervisor or an admin"):
        _override(Role.SUPPORT)
