"""The feeds of Settled itself and of the stock Celery no-op reference (``bench.peers.feed``)."""

from __future__ import annotations

import time
from typing import Any

from bench.noop_app import NOOP, stock_app
from bench.phases.common import Endpoints
from bench.phases.intake import Producer
from settled.celery_app import QUEUE


class SettledFeed:
    """One refund per intake transaction through ``Outbox.enqueue``, its hint published after
    commit by the relay, as ``bench.phases.intake.Producer`` does."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.producer = Producer(Endpoints(**cfg["endpoints"]), tag=f"live{cfg['index']}-")

    @property
    def commits(self) -> int:
        return self.producer.commits

    def commit_one(self) -> tuple[int, float]:
        (op,) = self.producer.intake(1, 1)
        return op, self.producer.committed_at[op]

    def close(self) -> None:
        self.producer.close()


class NoopFeed:
    """Stock Celery (``bench.noop_app.stock_app``): one ``bench.noop`` task per "commit"; the
    id is the producer's own serial, unique across producers."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.app = stock_app(cfg["broker_url"])
        self.serial = cfg["index"] * 10**9
        self.commits = 0

    def commit_one(self) -> tuple[int, float]:
        self.serial += 1
        at = time.time()
        self.app.send_task(NOOP, args=[[self.serial]], queue=QUEUE)
        return self.serial, at

    def close(self) -> None:
        self.app.close()
