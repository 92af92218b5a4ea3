"""A pytest plugin: with ``SETTLED_TEST_NO_SKIPS=1`` (``.ci/run`` sets it) a test that skips
fails instead, naming why it skipped, so that CI never passes with a test left unrun.

Expected failures (``xfail``) are not skips and stay as they are."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

FLAG = "SETTLED_TEST_NO_SKIPS"


def _on() -> bool:
    return os.environ.get(FLAG, "") not in ("", "0")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not (_on() and report.skipped) or hasattr(report, "wasxfail"):
        return
    why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped with {FLAG}=1 (every test must run here): {why}"
