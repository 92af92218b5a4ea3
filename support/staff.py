"""Who works the review queue, what each role may do, and the way out of each review reason.

A member of staff is an id, a role and, optionally, the tenants they may see: a ``viewer`` may
list and show; ``support``, ``supervisor`` and ``admin`` may also requery and resolve; only a
supervisor or an admin may override the evidence rule (``support.resolve``). A member limited
to some tenants sees nothing of the others (``Staff.sees``). ``REASONS`` is every reason an
operation is put in review, and how staff resolve it. Pure: the queue that uses these is
``support.review``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from outbox.errors import Forbidden, InvalidInput

STAFF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


#: Every reason an operation is put in review, and how staff resolve it (docs/support.md, "The
#: review queue"). What a resolution may store is weighed by ``support.evidence``.
REASONS: dict[str, str] = {
    "lookup_unavailable": "requery once the lookup is back; resolve as its record says",
    "ambiguous_without_idempotency": "resolve as the lookup shows once it is quiet",
    "receipt_mismatch": (
        "the downstream did something else under this key: resolve as its record says (its "
        "reference); stored as its record, marked as differing; then correct it"
    ),
    "lookup_mismatch": "as receipt_mismatch",
    "receipt_key_mismatch": "requery; a supervisor may override after checking",
    "receipt_unreadable": "requery; a supervisor may override after checking",
    "idempotency_error": "resolve as the lookup shows (not found, once quiet: rejected)",
    "unexpected_response": "resolve as the lookup shows (not found, once quiet: rejected)",
    "outcome_not_recorded": "requery, or resolve as the lookup shows",
    "reconcile_failed": "requery, or resolve as the lookup shows",
    "past_key_retention": "a supervisor resolves with --override and a justification",
    "no_lookup_replay_cannot_settle": "no lookup: resolve on your own evidence (a statement)",
    "no_lookup_without_idempotency": "no lookup: resolve on your own evidence (a statement)",
    "ambiguous_without_idempotency_or_lookup": (
        "no lookup: resolve on your own evidence (a statement)"
    ),
    "fingerprint_mismatch": (
        "nothing was sent and it is rejected: make the app's and the worker's "
        "SETTLED_FINGERPRINT_KEYS agree (or find who altered the row), then confirm it as "
        "rejected with a justification; the app creates the intent again under a new op id"
    ),
    "orphan_effect": (
        "the downstream made this effect under Settled's key but the operation is gone from the "
        "database (a failover or a restore lost it): ask the app whether it still holds the "
        "intent; never send it again; correct the books from the evidence"
    ),
}


class Role(enum.StrEnum):
    VIEWER = "viewer"  # may list and show
    SUPPORT = "support"  # may also requery and resolve
    SUPERVISOR = "supervisor"  # may also override the evidence rule
    ADMIN = "admin"  # a supervisor who also manages staff accounts (the console)


ACTING = frozenset({Role.SUPPORT, Role.SUPERVISOR, Role.ADMIN})
#: roles that may override the evidence rule with a written justification
OVERRIDING = frozenset({Role.SUPERVISOR, Role.ADMIN})


@dataclass(frozen=True)
class Staff:
    id: str
    role: Role
    #: the tenants this member may see; None: every tenant
    tenants: frozenset[str] | None = None

    def sees(self, tenant: str) -> bool:
        """Whether this member may see anything of ``tenant``."""
        return self.tenants is None or tenant in self.tenants

    @classmethod
    def parse(cls, staff_id: object, role: object) -> Staff:
        if not isinstance(staff_id, str) or STAFF_ID.fullmatch(staff_id) is None:
            raise InvalidInput("a staff id is required", code="invalid_staff", field="staff")
        try:
            return cls(staff_id, Role(str(role)))
        except ValueError:
            raise InvalidInput(
                f"role must be one of {[r.value for r in Role]}", code="invalid_role", field="role"
            ) from None

    @property
    def actor(self) -> str:
        return f"staff:{self.id}"


def require_acting(staff: Staff) -> None:
    """Forbidden unless ``staff`` may act on an item (requery, resolve), not only read it."""
    if staff.role not in ACTING:
        raise Forbidden(f"role {staff.role.value!r} may only list and show", code="forbidden")
