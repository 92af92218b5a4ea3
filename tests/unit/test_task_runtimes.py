"""The tasks' runtimes (``settled.celery_app.runtime``): one per settings value and process,
built once, closed when the worker's process shuts down."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from celery.signals import worker_process_shutdown

from outbox.settings import Settings
from settled import celery_app

SECRET = "a-secret-of-twenty-chars"


class _Built:
    """What ``build_runtime`` gave: its settings, and how often it was closed."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[_Built]:
    """An empty cache, and every runtime built from now on (not a real one)."""
    built: list[_Built] = []

    def build(settings: Settings) -> _Built:
        built.append(_Built(settings))
        return built[-1]

    monkeypatch.setattr(celery_app, "_runtimes", (os.getpid(), {}))
    monkeypatch.setattr(celery_app, "build_runtime", build)
    return built


def test_a_task_of_other_settings_gets_its_own_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(celery_app, "_runtimes", (os.getpid(), {}))
    one = f"sqlite:///{tmp_path / 'one.sqlite3'}"
    other = f"sqlite:///{tmp_path / 'other.sqlite3'}"
    try:
        first = celery_app.runtime(Settings(database_url=one))
        second = celery_app.runtime(Settings(database_url=other))
        assert str(first.engine.url) == one
        assert str(second.engine.url) == other
        assert celery_app.runtime(Settings(database_url=one)) is first
    finally:
        celery_app.close_runtimes()


def test_equal_settings_share_a_runtime_and_another_secret_does_not(
    builds: list[_Built],
) -> None:
    first = celery_app.runtime(Settings(idempotency_secret=SECRET))
    assert celery_app.runtime(Settings(idempotency_secret=SECRET)) is first  # equal, not same
    other = celery_app.runtime(Settings(idempotency_secret=SECRET.upper()))
    keys = celery_app.runtime(
        Settings(idempotency_secret=SECRET, fingerprint_keys={"v1": SECRET.upper()})
    )
    assert len({id(first), id(other), id(keys)}) == 3
    assert len(builds) == 3
    assert SECRET not in repr(celery_app.settings_key(Settings(idempotency_secret=SECRET)))


def test_the_process_shutdown_closes_every_runtime_it_built(builds: list[_Built]) -> None:
    celery_app.runtime(Settings(database_url="sqlite:///one.sqlite3"))
    celery_app.runtime(Settings(database_url="sqlite:///other.sqlite3"))
    worker_process_shutdown.send(sender=None)
    assert [b.closed for b in builds] == [1, 1]
    celery_app.runtime(Settings(database_url="sqlite:///one.sqlite3"))
    assert len(builds) == 3  # built afresh after the close


def test_a_forked_child_builds_its_own_and_never_closes_its_parents(
    builds: list[_Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(database_url="sqlite:///one.sqlite3")
    parents: object = celery_app.runtime(settings)
    monkeypatch.setattr(os, "getpid", lambda: -1)  # the child's id
    childs: object = celery_app.runtime(settings)
    assert childs is not parents
    celery_app.close_runtimes()
    assert parents is builds[0] and childs is builds[1]
    assert (builds[0].closed, builds[1].closed) == (0, 1)  # the parent's engine is not ours
