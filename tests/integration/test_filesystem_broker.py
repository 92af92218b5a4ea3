"""A real worker on the filesystem broker (the embedded default: ``settled demo``) keeps working
past a message file it cannot read; kombu's own channel raised its JSON error to Celery's
consumer, which stopped the worker and its embedded beat, and every operation after it stayed
planned."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.settings import Settings
from settled.celery_app import QUEUE, SUBMIT, create_app
from tests.support.simtools import wait_until
from tests.support.stack import Stack, embedded_stack

pytestmark = [pytest.mark.slow]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with embedded_stack(tmp_path) as s:
        yield s


def test_worker_drops_an_empty_message_file_and_works_the_next_message(
    stack: Stack, tmp_path: Path
) -> None:
    folder = tmp_path / "broker"
    proc = stack.start_worker(pool="solo", beat=True)
    wait_until(lambda: "ready." in stack.log_of(proc), 60, "the worker is ready")
    # A message file taken while its writer had created it and not yet written it (a writer
    # preempted on a busy machine), named to be read before the next message.
    (folder / f"0_taken-mid-write.{QUEUE}.msg").write_bytes(b"")
    app = create_app(Settings(broker_url="filesystem://", broker_folder=str(folder)))
    try:
        app.send_task(SUBMIT, args=[["not an id"]], queue=QUEUE)  # answered by a warning line
    finally:
        app.close()
    wait_until(
        lambda: "malformed hint dropped" in stack.log_of(proc) or proc.poll() is not None,
        60,
        "the worker to answer the next message",
    )
    log = stack.log_of(proc)
    assert proc.poll() is None, log[-4000:]
    assert "Unrecoverable error" not in log
    assert "message file unreadable" in log
    assert "beat: Shutting down" not in log  # its embedded beat goes on sweeping
