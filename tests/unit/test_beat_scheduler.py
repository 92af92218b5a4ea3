"""Beat's scheduler closes once: a stop signal in the middle of a tick is a clean stop."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery
from celery.beat import PersistentScheduler, Service

from settled.celery_app import BeatScheduler


def _service(tmp_path: Path, cls: type) -> Service:
    app = Celery("t", broker="memory://", set_as_current=False)
    app.conf.beat_schedule = {"sweep": {"task": "t.sweep", "schedule": 1.0}}
    return Service(app, scheduler_cls=cls, schedule_filename=str(tmp_path / "schedule"))


def test_what_follows_beat_s_stop_handler_touches_no_closed_shelf(tmp_path: Path) -> None:
    service = _service(tmp_path, BeatScheduler)
    scheduler = service.scheduler
    assert isinstance(scheduler, BeatScheduler)
    service.sync()  # beat's SIGTERM handler: closes the scheduler, then raises SystemExit
    scheduler.sync()  # an interrupted send's ``finally``
    assert scheduler.tick() == scheduler.max_interval  # a tick begun before the flag was seen
    service.sync()  # the service's own ``finally``


def test_celery_s_own_scheduler_fails_on_its_closed_shelf(tmp_path: Path) -> None:
    """Why the subclass: the same steps on Celery's scheduler reach the closed shelf."""
    scheduler = _service(tmp_path, PersistentScheduler).scheduler
    scheduler.close()
    with pytest.raises(ValueError, match="closed shelf"):
        scheduler.tick()


def test_a_schedule_saved_before_the_stop_is_read_back(tmp_path: Path) -> None:
    service = _service(tmp_path, BeatScheduler)
    service.scheduler.tick()  # sends nothing yet (due in 1 s) and keeps the entry
    service.sync()
    again = _service(tmp_path, BeatScheduler).scheduler
    assert "sweep" in again.schedule
