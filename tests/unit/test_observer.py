"""``outbox.observer.guarded``: an observer's errors are logged and go no further, and the
step's own error is never hidden nor replaced by the observer's."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest

from outbox.observer import NO_OBSERVER, Guarded, NoObserver, Report, guarded


class Step(Exception):
    """The step's own error."""


class Swallowing(NoObserver):
    """``reconciling`` swallows whatever the step raised (a context manager may)."""

    @contextmanager
    def reconciling(self, claimed: Any) -> Iterator[Report[str]]:
        with suppress(Exception):
            yield lambda _: None


class RaisingOnExit(NoObserver):
    """``reconciling`` raises an error of its own on the way out, whatever the step did."""

    @contextmanager
    def reconciling(self, claimed: Any) -> Iterator[Report[str]]:
        try:
            yield lambda _: None
        finally:
            raise RuntimeError("observer")


@pytest.mark.parametrize("observer", [Swallowing(), RaisingOnExit()])
def test_the_steps_own_error_goes_on(observer: NoObserver) -> None:
    def step() -> None:
        with guarded(observer).reconciling(None) as seen:  # type: ignore[arg-type]
            seen("found")
            raise Step

    with pytest.raises(Step):
        step()


def test_an_error_of_the_observers_own_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with guarded(RaisingOnExit()).reconciling(None) as seen:  # type: ignore[arg-type]
        seen("found")
    (record,) = [r for r in caplog.records if r.name == "outbox.observer"]
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.getMessage() == "an observer failed in reconciling; the step goes on without it"


def test_doing_nothing_needs_no_guard_and_a_guard_no_second() -> None:
    assert guarded(NO_OBSERVER) is NO_OBSERVER
    once = guarded(Swallowing())
    assert isinstance(once, Guarded) and guarded(once) is once
