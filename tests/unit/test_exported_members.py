"""The public API an app imports from ``outbox`` (in the style of httpx's own test): exactly
the curated names, each importable and defined inside the package, loaded lazily."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import outbox

ROOT = Path(__file__).resolve().parents[2]

CURATED = [
    # intake, identifiers, the relay
    "Outbox",
    "Enqueued",
    "AsyncOutbox",
    "new_op_id",
    "install_relay",
    "publish_hints",
    # runs
    "open_run",
    "find_run",
    "cancel_run",
    "compensate",
    "run_report",
    "operation_status",
    # configuration and the database
    "Settings",
    "make_engine",
    "upgrade",
    # errors (outbox.errors: the whole tree)
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
    # for the app's own tests
    "FakeGateway",
]


def test_all_is_the_curated_list_sorted() -> None:
    assert outbox.__all__ == sorted(CURATED)
    assert len(set(outbox.__all__)) == len(outbox.__all__)


@pytest.mark.parametrize("name", CURATED)
def test_each_exported_name_is_importable_and_defined_in_the_package(name: str) -> None:
    member = getattr(outbox, name)
    assert member.__module__.startswith("outbox."), member.__module__
    namespace: dict[str, object] = {}
    exec(f"from outbox import {name}", namespace)
    assert namespace[name] is member


def test_every_error_of_the_tree_is_exported() -> None:
    from outbox import errors

    tree = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.SettledError)
    }
    assert tree <= set(outbox.__all__)


def test_dir_lists_the_exports_and_an_unknown_name_is_an_attribute_error() -> None:
    assert set(outbox.__all__) <= set(dir(outbox))
    with pytest.raises(AttributeError, match="no_such_name"):
        outbox.no_such_name  # type: ignore[attr-defined]  # noqa: B018


def test_submodules_still_import_by_name() -> None:
    from outbox import kinds, relay  # modules, not exports

    assert relay.install is outbox.install_relay
    assert kinds.__name__ == "outbox.kinds"


def test_importing_the_package_loads_no_sqlalchemy_until_a_name_needs_it() -> None:
    probe = (
        "import sys, outbox\n"
        "before = 'sqlalchemy' in sys.modules\n"
        "outbox.new_op_id, outbox.SettledError, outbox.FakeGateway\n"
        "light = 'sqlalchemy' in sys.modules\n"
        "outbox.Outbox\n"
        "print(before, light, 'sqlalchemy' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "False", "True"]


def test_the_lookup_answer_keeps_its_0_1_name_for_adapters_written_for_it() -> None:
    from outbox.downstream import LookupNotFound, NotFound, lookup_name

    assert NotFound is LookupNotFound and lookup_name(NotFound()) == "not_found"
    assert outbox.NotFound is not LookupNotFound  # the status API's error, unchanged
    assert issubclass(outbox.NotFound, outbox.SettledError)
