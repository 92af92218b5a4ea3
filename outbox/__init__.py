"""Settled's outbox: operation intents written in the caller's transaction.

What an app imports (``from outbox import Outbox, new_op_id, install_relay, ...``)::

    Outbox, Enqueued                 write an intent in your own transaction (outbox.intake)
    AsyncOutbox                      the same from async code, on an AsyncSession (outbox.aio;
                                     its runs API there too)
    new_op_id                        mint an op_id (outbox.ids)
    install_relay, publish_hints     hints to the workers after commit (outbox.relay)
    open_run, find_run, cancel_run,  group operations of one user task, stop them, offset
    compensate, run_report,          one, and tell the user where they stand (outbox.runs)
    operation_status
    Settings, make_engine, upgrade   configuration and the database (outbox.settings, .db)
    SettledError and its subclasses  misuse and bad input (outbox.errors)
    FakeGateway                      the downstream in memory, for your tests (outbox.testing)

Importing this package imports none of them: each is loaded on first use, so the pure core
(``outbox.downstream``, ``outbox.states``...) stays free of SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.aio import AsyncOutbox
    from outbox.db import make_engine, upgrade
    from outbox.errors import (
        FenceNotVerified,
        Forbidden,
        IdempotencyConflict,
        IllegalTransition,
        InvalidIdentifier,
        InvalidInput,
        InvalidParams,
        InvalidSetting,
        NotFound,
        ProposalConflict,
        ReviewConflict,
        SettledError,
        StaleLease,
        UnknownKind,
    )
    from outbox.ids import new_op_id
    from outbox.intake import Enqueued, Outbox
    from outbox.relay import install as install_relay
    from outbox.relay import publish_hints
    from outbox.runs import (
        cancel_run,
        compensate,
        find_run,
        open_run,
        operation_status,
        run_report,
    )
    from outbox.settings import Settings
    from outbox.testing import FakeGateway

#: exported name -> (module, name in that module)
_EXPORTS: dict[str, tuple[str, str]] = {
    "Outbox": ("outbox.intake", "Outbox"),
    "AsyncOutbox": ("outbox.aio", "AsyncOutbox"),
    "Enqueued": ("outbox.intake", "Enqueued"),
    "new_op_id": ("outbox.ids", "new_op_id"),
    "install_relay": ("outbox.relay", "install"),
    "publish_hints": ("outbox.relay", "publish_hints"),
    "open_run": ("outbox.runs", "open_run"),
    "find_run": ("outbox.runs", "find_run"),
    "cancel_run": ("outbox.runs", "cancel_run"),
    "compensate": ("outbox.runs", "compensate"),
    "run_report": ("outbox.runs", "run_report"),
    "operation_status": ("outbox.runs", "operation_status"),
    "Settings": ("outbox.settings", "Settings"),
    "make_engine": ("outbox.db", "make_engine"),
    "upgrade": ("outbox.db", "upgrade"),
    "FakeGateway": ("outbox.testing", "FakeGateway"),
    **{
        name: ("outbox.errors", name)
        for name in (
            "SettledError",
            "InvalidInput",
            "InvalidIdentifier",
            "UnknownKind",
            "InvalidParams",
            "InvalidSetting",
            "FenceNotVerified",
            "IdempotencyConflict",
            "IllegalTransition",
            "StaleLease",
            "NotFound",
            "Forbidden",
            "ReviewConflict",
            "ProposalConflict",
        )
    },
}

__all__ = [
    "AsyncOutbox",
    "Enqueued",
    "FakeGateway",
    "FenceNotVerified",
    "Forbidden",
    "IdempotencyConflict",
    "IllegalTransition",
    "InvalidIdentifier",
    "InvalidInput",
    "InvalidParams",
    "InvalidSetting",
    "NotFound",
    "Outbox",
    "ProposalConflict",
    "ReviewConflict",
    "Settings",
    "SettledError",
    "StaleLease",
    "UnknownKind",
    "cancel_run",
    "compensate",
    "find_run",
    "install_relay",
    "make_engine",
    "new_op_id",
    "open_run",
    "operation_status",
    "publish_hints",
    "run_report",
    "upgrade",
]

if not TYPE_CHECKING:  # for type checkers every name above is a plain import

    def __getattr__(name: str) -> Any:
        """Load an exported name on first use (PEP 562), and keep it."""
        try:
            module, attribute = _EXPORTS[name]
        except KeyError:
            raise AttributeError(f"module 'outbox' has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
