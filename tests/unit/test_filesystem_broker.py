"""The filesystem broker (``settled.celery_app.FilesystemTransport``, the embedded default): a
message is in the folder only once written whole, and a message file that cannot be read is
dropped, never raised to the worker's consumer (Celery stops the worker on that error)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

from outbox.settings import Settings
from settled.celery_app import QUEUE, FilesystemTransport, create_app


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "broker"


@pytest.fixture
def channels(folder: Path) -> Iterator[tuple[Any, Any]]:
    """A writer's channel (an app's relay, beat) and a reader's (the worker's), on one folder."""
    app = create_app(Settings(broker_url="filesystem://", broker_folder=str(folder)))
    with app.connection_for_write() as writer, app.connection_for_read() as reader:
        assert isinstance(writer.transport, FilesystemTransport)
        yield writer.default_channel, reader.default_channel


class ReadWhileEncoded:
    """A message value whose encoding polls the queue meanwhile, as a worker polling the folder
    does while a writer is preempted in the middle of its message."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self.read = read
        self.seen: list[Any] = []

    def __json__(self) -> str:
        try:
            self.seen.append(self.read())
        except Empty:
            self.seen.append(None)
        return "value"


def test_a_message_being_written_is_not_in_the_folder_and_arrives_whole(
    channels: tuple[Any, Any], folder: Path
) -> None:
    writer, reader = channels
    value = ReadWhileEncoded(lambda: reader._get(QUEUE))
    writer._put(QUEUE, {"body": value})
    # kombu's own writer creates the file first: the reader took it empty (JSONDecodeError,
    # or, dropped, the message written after it was taken was lost)
    assert value.seen == [None]
    assert reader._get(QUEUE) == {"body": "value"}
    assert not [p for p in folder.iterdir() if p.is_file()]  # no part file left behind


def test_an_unreadable_message_file_is_dropped_and_the_next_message_delivered(
    channels: tuple[Any, Any], folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer, reader = channels
    writer._put(QUEUE, {"body": "next"})
    # Named to sort first: written by a producer of plain kombu, taken mid-write.
    (folder / f"0_a.{QUEUE}.msg").write_bytes(b"")
    (folder / f"0_b.{QUEUE}.msg").write_bytes(b'{"body": "cut')
    with caplog.at_level(logging.WARNING, logger="settled.celery_app"):
        assert reader._get(QUEUE) == {"body": "next"}
    dropped = [r for r in caplog.records if "message file unreadable" in r.getMessage()]
    assert len(dropped) == 2
    assert not list(folder.glob("*.msg"))
    with pytest.raises(Empty):
        reader._get(QUEUE)
