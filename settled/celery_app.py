"""Celery wiring: the only module that knows Celery.

Tasks are thin: an operation id in, a service call, nothing else. No Celery retries,
countdown, ETA or autoretry anywhere: the executor owns retries through the database row.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.sentinel
from celery import Celery
from celery.beat import PersistentScheduler
from celery.signals import worker_process_shutdown
from kombu.exceptions import ChannelError
from kombu.transport import filesystem as kombu_filesystem
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps
from redis.backoff import NoBackoff
from redis.retry import Retry

from outbox.breaker import HintBreaker
from outbox.doorbell import Doorbell, ring_again, rung
from outbox.errors import SettledError
from outbox.outage import DatabaseOutage, database_away
from outbox.relay import Publish, publish_hints
from outbox.settings import Settings, masked
from settled import observe
from settled.metrics import count_hint
from settled.runtime import Runtime, build_runtime
from workers.sweeper import expire_proposals, sweep

log = logging.getLogger(__name__)

SUBMIT = "settled.submit"
SWEEP = "settled.sweep"
RECONCILE = "settled.reconcile"
RECOVERY_PROBE = "settled.recovery_probe"
QUEUE = "settled"
BEAT_QUEUE = "settled.beat"

#: The runtimes of this process (its id), one per settings value (``settings_key``).
_runtimes: tuple[int, dict[Hashable, Runtime]] = (os.getpid(), {})
_building = threading.Lock()
# A child forked while another thread held the lock gets it unlocked.
os.register_at_fork(after_in_child=lambda: globals().update(_building=threading.Lock()))


def settings_key(settings: Settings) -> Hashable:
    """A hashable snapshot of every field of ``settings``: equal for equal settings, secrets
    included (a ``SecretStr`` compares and hashes by its value, and shows only asterisks)."""
    return _frozen(settings.model_dump())


def _frozen(value: Any) -> Hashable:
    if isinstance(value, dict):
        return tuple(sorted((key, _frozen(item)) for key, item in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(item) for item in value)
    if isinstance(value, set | frozenset):
        return frozenset(_frozen(item) for item in value)
    hashable: Hashable = value
    return hashable


def runtime(settings: Settings) -> Runtime:
    """This process's runtime for ``settings``, built on first use (after the worker forks its
    children), once even when the first tasks run in several threads (the thread pool); other
    settings get a runtime of their own (another database, other keys)."""
    global _runtimes
    key = settings_key(settings)
    with _building:
        if _runtimes[0] != os.getpid():  # forked: the parent's engines are not ours
            _runtimes = (os.getpid(), {})
        built = _runtimes[1]
        if key not in built:
            built[key] = build_runtime(settings)
        return built[key]


def close_runtimes() -> None:
    """Close every runtime this process built (``runtime``); the next task builds afresh."""
    global _runtimes
    with _building:
        pid, built = _runtimes
        _runtimes = (os.getpid(), {})
    if pid == os.getpid():
        for built_runtime in built.values():
            built_runtime.close()


@worker_process_shutdown.connect
def _close_runtimes(**_: Any) -> None:
    close_runtimes()


class _RedisChannel(kombu_redis.Channel):
    """kombu's Redis channel, keeping one client per channel, and closable after a broker loss.

    kombu builds a new ``redis.Redis`` for every publish and every ack (over the channel's
    connection pool); with redis-py 8 that costs a fresh table of response callbacks each time,
    about a third of the CPU of a publish. A client is safe to share: every command takes a
    connection from the pool. The client is rebuilt if the channel replaces its pool.
    """

    _kept_client: Any = None

    def _connparams(self, asynchronous: bool = False) -> Any:
        # After a broker loss Celery's consumer calls ``connection.collect()``, then
        # ``connection.close()``. ``collect`` leaves a channel open when closing it needed the
        # lost broker (draining its pending BRPOP, deleting an auto-delete queue), then drops
        # the transport's client; closing that channel again then builds a pool from the
        # missing client and raises AttributeError, which Celery takes for an unrecoverable
        # error: the worker stops consuming (kombu issues #582, #659, same shape). A channel
        # whose connection is gone cannot reach the broker: say so with the connection error
        # every caller in kombu and Celery recovers from.
        transport = self.connection
        if transport is None or transport.client is None:
            raise redis.ConnectionError("the broker connection of this channel is closed")
        return super()._connparams(asynchronous=asynchronous)  # type: ignore[no-untyped-call]

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the consumer's BRPOP client: made once per channel already
            return super()._create_client(asynchronous=True)  # type: ignore[no-untyped-call]
        client = self._kept_client
        if client is None or client.connection_pool is not self.pool:
            client = self._kept_client = super()._create_client()  # type: ignore[no-untyped-call]
        return client


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport with ``_RedisChannel``; used for ``redis://`` brokers."""

    Channel = _RedisChannel


class _FilesystemChannel(kombu_filesystem.Channel):
    """kombu's folder channel, whose messages appear in the folder only once written whole.

    kombu creates a message's file under its final name and only then writes it, and a reader
    takes a file without waiting for its writer's lock: a worker polling the folder in between
    (a writer preempted on a busy machine) takes an empty file. JSON cannot decode it, which
    Celery's consumer takes for an unrecoverable error: the worker and its embedded beat stop,
    and the message, written after its file was taken, is lost. Here a message is written to a
    hidden file of the same folder and renamed to its name when complete (a rename within a
    folder is atomic); a file that still cannot be read (written by a plain kombu producer) is
    dropped with a warning, as a lost hint is: the sweeper hints its operations again.
    """

    # kombu's folder channel's signature (its base class names the argument ``message``)
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        folder = self.data_folder_out
        name = f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"  # as kombu names it
        data = dumps(payload).encode()  # type: ignore[no-untyped-call]
        # ``.part``: never a message name (``<stamp>_<uuid>.<queue>.msg``) a reader takes; made
        # with the mode kombu gives its files (the umask's), for a worker of another user
        part = os.path.join(folder, f".{uuid.uuid4()}.part")
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(part, os.path.join(folder, name))
        except OSError as exc:
            with suppress(OSError):
                os.unlink(part)
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        while True:  # each failed read has taken its file: this ends (Empty) when none is left
            try:
                return super()._get(queue)  # type: ignore[no-untyped-call]
            except ValueError:  # JSONDecodeError, UnicodeDecodeError: empty or cut short
                log.warning(
                    "broker message file unreadable (empty or cut short); dropped, the "
                    "sweeper hints its operations again",
                    extra={"queue": queue},
                )


class FilesystemTransport(kombu_filesystem.Transport):
    """kombu's folder transport with ``_FilesystemChannel``; used for ``filesystem://``
    brokers (the embedded default)."""

    Channel = _FilesystemChannel


class _SentinelChannel(_RedisChannel, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel (its pool follows the master the Sentinels name) with what
    ``_RedisChannel`` adds."""


class BeatScheduler(PersistentScheduler):  # type: ignore[misc]
    """Celery's persistent scheduler (``SETTLED_BEAT_SCHEDULE_FILE``), closed once.

    Beat's SIGTERM handler closes the scheduler (its shelf) and raises ``SystemExit``; when
    the signal lands while a due task is being sent, the send's ``finally`` syncs the shelf it
    just closed, and the service's own ``finally`` closes it again: "invalid operation on
    closed shelf", and a clean stop ends with exit status 1. Here a sync or a close after the
    close does nothing (what was due to be saved was saved by the first close)."""

    _closed = False

    def sync(self) -> None:
        if not self._closed:
            super().sync()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        super().close()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self._closed:  # stopping: nothing more is sent, and the shelf is not read again
            return float(self.max_interval)
        return float(super().tick(*args, **kwargs))


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Sentinel transport with ``_SentinelChannel``; used for ``sentinel://`` brokers
    (``SETTLED_REDIS_SENTINEL_MASTER`` names the master)."""

    Channel = _SentinelChannel


def broker_redis(
    settings: Settings, timeout: float = 2.0, *, once: bool = False
) -> redis.Redis[Any] | None:
    """A Redis client on the broker's Redis: with ``sentinel://`` URLs, on the master the
    Sentinels name now (found again after a failover). None when the broker is not Redis.
    ``timeout`` bounds each round trip (the connect, each reply); ``once``: a command is never
    tried again, whatever redis-py's default.

    As kombu reads a Sentinel URL: ``sentinel://[user:password@]host:port[/db]`` per Sentinel,
    separated by ``;``; the first one's credentials and database are the master's."""
    url = settings.broker_url
    tries: dict[str, Any] = {"retry": Retry(NoBackoff(), 0)} if once else {}
    if url.startswith(("redis://", "rediss://")):
        client: redis.Redis[Any] = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, **tries
        )
        return client
    if settings.redis_sentinel_master is None:
        return None
    nodes = [urlsplit(part) for part in url.split(";") if part.strip()]
    first = nodes[0]
    db = first.path.strip("/")
    sentinel = redis.sentinel.Sentinel(
        [(node.hostname or "127.0.0.1", node.port or 26379) for node in nodes],
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )
    master: redis.Redis[Any] = sentinel.master_for(
        settings.redis_sentinel_master,
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password else None,
        db=int(db) if db.isdigit() else 0,
        **tries,
    )
    return master


def celery_broker_url(settings: Settings) -> str:
    """The broker URL as Celery is given it: a bare ``filesystem://`` names a host, which the
    folder transport ignores, so that kombu does not warn "No hostname was supplied" at the
    first connection (the demo's first line, once)."""
    if settings.broker_url.rstrip("/") == "filesystem:":
        return "filesystem://localhost/"
    return settings.broker_url


def broker_options(settings: Settings) -> dict[str, Any]:
    if settings.broker_url.startswith("filesystem"):
        folder = Path(settings.broker_folder)
        folder.mkdir(parents=True, exist_ok=True)
        # One folder for in and out: the worker reads what the app writes.
        return {
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "control_folder": str(folder / "control"),  # else kombu writes ./control
            "processed_folder": str(folder / "processed"),
        }
    # Far above the longest task (one HTTP attempt is bounded by downstream_timeout).
    options: dict[str, Any] = {"visibility_timeout": 6 * 3600}
    if settings.redis_sentinel_master is not None:
        options["master_name"] = settings.redis_sentinel_master
    return options


def check_broker(settings: Settings, timeout: float = 5.0) -> None:
    """Raise SettledError (``broker_unreachable``) when the broker does not answer now; the
    message names it without its password."""
    from kombu import connection as kombu_connection

    if settings.broker_url.startswith("filesystem"):
        return  # a folder: created when the app is
    connection: Any = kombu_connection.Connection  # kombu's annotations are partial
    conn = connection(
        settings.broker_url, connect_timeout=timeout, transport_options=broker_options(settings)
    )
    try:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=timeout)
    except Exception as exc:
        where = masked(settings.broker_url)
        raise SettledError(
            f"cannot reach the broker at {where} ({type(exc).__name__}): is it running? "
            "(SETTLED_BROKER_URL)",
            code="broker_unreachable",
        ) from None
    finally:
        conn.release()


#: How hints are delivered: acknowledged after the work (a worker lost mid-task leaves its hint
#: to be redelivered), one prefetched per process slot, JSON, no results.
DELIVERY: dict[str, Any] = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1,
    "task_serializer": "json",
    "accept_content": ["json"],
    "result_backend": None,
    "task_ignore_result": True,
}


class SettledCelery(Celery):  # type: ignore[misc]  # Celery has no type hints
    """A Celery app that knows its doorbell (``outbox.doorbell``): ``doorbell`` rings for the
    app's relay (None when off; its Redis round trips bounded as the app's hints are),
    ``bell`` answers id-less hints in a worker (None when the broker is not Redis); and how
    the app's hints are bounded (``hint_publisher``)."""

    doorbell: Doorbell | None = None
    bell: Doorbell | None = None
    hint_timeout: float = Settings.model_fields["hint_timeout"].default
    hint_cooldown: float = Settings.model_fields["hint_cooldown_seconds"].default
    _hint_senders: list[HintSender]

    def close(self) -> None:
        for sender in getattr(self, "_hint_senders", ()):
            sender.close()
        super().close()


class HintSender:
    """The app's hint messages, each tried once on a broker connection of its own: every
    round trip (the connect, each reply) within ``timeout``, no retry of the publish, nor of
    the connect. A connection that failed is dropped (the next hint connects afresh); the
    others are kept for the next hints, one per thread publishing at once."""

    def __init__(self, app: Celery, timeout: float) -> None:
        self.app = app
        self.timeout = timeout
        self._lock = threading.Lock()
        self._idle: list[Any] = []  # kombu producers, each on its own connection
        self._pid = os.getpid()

    def _take(self) -> Any:
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop()
        t = self.timeout
        conn = self.app.connection_for_write(
            connect_timeout=t,
            # kombu's channel reads the socket timeouts; ``max_retries`` 0: one connect try
            transport_options={"socket_timeout": t, "socket_connect_timeout": t, "max_retries": 0},
        )
        return self.app.amqp.Producer(conn, auto_declare=False)

    def __call__(self, operation_ids: Sequence[int]) -> None:
        producer = self._take()
        try:
            self.app.send_task(
                SUBMIT, args=[list(operation_ids)], queue=QUEUE, producer=producer, retry=False
            )
        except BaseException:
            with suppress(Exception):
                producer.connection.collect()  # no round trip to a broker that is not there
            raise
        with self._lock:
            if self._pid == os.getpid():
                self._idle.append(producer)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for producer in idle:
            with suppress(Exception):
                producer.connection.release()


def _bell(settings: Settings, timeout: float = 2.0, *, once: bool = False) -> Doorbell | None:
    """The broker's doorbell count; None when the broker is not Redis. A worker answers the
    id-less hints an app rang for whatever its own settings say (the app's may differ): with
    the doorbell or extra claims off here, it uses their defaults for those hints."""
    client = broker_redis(settings, timeout, once=once)
    if client is None:
        return None
    return Doorbell(
        client,
        pending=settings.hint_doorbell or Settings.model_fields["hint_doorbell"].default,
        ring_seconds=settings.sweep_seconds,
        claims=settings.claim_batch or Settings.model_fields["claim_batch"].default,
        key=f"settled:doorbell:{QUEUE}",
    )


def doorbell(settings: Settings) -> Doorbell | None:
    """The doorbell an app rings (``SETTLED_HINT_DOORBELL``), on the broker's Redis; None when
    it is off (it is with ``SETTLED_CLAIM_BATCH`` 0) or the broker is not Redis. A ring counts
    for one sweeper period at most. Its round trips are bounded as the app's hints are
    (``SETTLED_HINT_TIMEOUT``, tried once): it rings in the app's request."""
    if not (settings.hint_doorbell and settings.claim_batch):
        return None
    return _bell(settings, settings.hint_timeout, once=True)


def create_app(settings: Settings, *, coalesce: bool = False) -> SettledCelery:
    """A Celery app for these settings, with the submit, sweep and reconcile tasks.

    ``coalesce``: the worker runs several submit tasks at once in one process (the thread
    pool), and their hints are worked in shared batches (``workers.coalesce``).
    """
    app = SettledCelery("settled", broker=celery_broker_url(settings), set_as_current=False)
    app.bell = _bell(settings)
    app.doorbell = doorbell(settings)
    app.hint_timeout = settings.hint_timeout
    app.hint_cooldown = settings.hint_cooldown_seconds
    # Traces when the environment asks for them (Celery's spans from the start; the
    # services' observer is the runtime's: ``settled.observe``). Nothing is patched.
    observe.start_tracing()
    app.conf.update(
        **DELIVERY,
        task_store_errors_even_if_ignored=False,
        broker_transport_options=broker_options(settings),
        broker_connection_retry_on_startup=True,
        task_default_queue=QUEUE,
        task_routes={
            SWEEP: {"queue": BEAT_QUEUE},
            RECONCILE: {"queue": BEAT_QUEUE},
            RECOVERY_PROBE: {"queue": BEAT_QUEUE},
        },
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        beat_schedule={
            "sweep": {
                "task": SWEEP,
                "schedule": settings.sweep_seconds,
                # A sweep that waited longer than two periods is stale: drop it.
                "options": {"expires": max(2 * settings.sweep_seconds, 1.0)},
            },
            "reconcile": {
                "task": RECONCILE,
                "schedule": settings.reconcile_seconds,
                "options": {"expires": max(2 * settings.reconcile_seconds, 1.0)},
            },
            # On the sweeper's period: is a downstream operations wait for back?
            "recovery-probe": {
                "task": RECOVERY_PROBE,
                "schedule": settings.sweep_seconds,
                "options": {"expires": max(2 * settings.sweep_seconds, 1.0)},
            },
        },
        beat_schedule_filename=settings.beat_schedule_file,
        beat_scheduler=f"{__name__}:BeatScheduler",
    )
    if settings.broker_url.startswith(("redis://", "rediss://")):
        app.conf.broker_transport = f"{__name__}:RedisTransport"
    elif settings.broker_url.startswith("filesystem"):
        app.conf.broker_transport = f"{__name__}:FilesystemTransport"
    elif settings.redis_sentinel_master is not None:
        app.conf.broker_transport = f"{__name__}:SentinelTransport"

    @app.task(name=SUBMIT, ignore_result=True, shared=False)
    def submit(operation_ids: list[int] | int) -> None:
        # A bare id is the hint format of earlier releases, still queued during an upgrade.
        ids = [operation_ids] if isinstance(operation_ids, int) else operation_ids
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            log.warning("malformed hint dropped")  # the sweeper finds due operations anyway
            return
        with while_database_away(runtime(settings).outage):
            if not ids and app.bell is not None:
                # A doorbell hint: its ring leaves the count, and it claims the oldest due
                # operations; a full claim rings again for the next batch (``outbox.doorbell``).
                app.bell.answer()
                again = ring_again(ids_publisher(app), app.bell)
                runtime(settings).executor.execute(ids, when_full=again, claims=app.bell.claims)
            elif coalesce:
                runtime(settings).coalescer().execute(ids)
            else:
                runtime(settings).executor.execute(ids)

    @app.task(name=SWEEP, ignore_result=True, shared=False)
    def sweep_task() -> None:
        rt = runtime(settings)
        with while_database_away(rt.outage):
            try:
                expire_proposals(
                    rt.sessions, timedelta(seconds=settings.agent_proposal_ttl_seconds)
                )
            except Exception as exc:
                if database_away(exc):
                    raise  # the sweep cannot read either: one skipped task, said once
                # The re-hinting below is the safety net for lost hints: an expiry error must
                # never stop it (the next beat tries the expiry again).
                log.exception("proposal expiry failed; sweeping anyway")
            sweep(rt.sessions, ids_publisher(app), per_message=settings.hint_batch)

    @app.task(name=RECOVERY_PROBE, ignore_result=True, shared=False)
    def recovery_probe_task() -> None:
        rt = runtime(settings)
        with while_database_away(rt.outage):
            woken = rt.recovery_probe.run_once()
            # Woken operations are due now: the sweeper would find them, a hint is faster.
            publish_hints(ids_publisher(app), woken, per_message=settings.hint_batch)

    @app.task(name=RECONCILE, ignore_result=True, shared=False)
    def reconcile_task() -> None:
        rt = runtime(settings)
        with while_database_away(rt.outage):
            report = rt.reconciler.run_once()
            if report.outcomes.get("requeued"):
                # Requeued operations are due now: the sweeper would find them, a hint is
                # faster.
                sweep(rt.sessions, ids_publisher(app), per_message=settings.hint_batch)

    return app


#: Errors of the broker's Redis that say it did not answer (refused, timed out, reset).
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)


@contextmanager
def while_database_away(outage: DatabaseOutage) -> Iterator[None]:
    """A task's work: if the database is away (``outbox.outage.database_away``), the task
    ends as skipped (counted, said once per outage), never as a failed task logged each
    time: the rows are where they were, and the next beat pass or sweep takes them up. A
    task that ends otherwise tells the outage the database answered."""
    try:
        yield
    except Exception as exc:
        if outage.away(exc, skipped=1):
            return
        raise
    outage.back()


def hint_publisher(app: Celery) -> Publish:
    """The relay's ``publish(operation_ids)`` for an app: one hint message per call, or, with
    the doorbell on (``SETTLED_HINT_DOORBELL``), a doorbell hint only while fewer than that
    many wait in the queue (``outbox.doorbell``).

    It never holds the app's request: each broker round trip is bounded by
    ``SETTLED_HINT_TIMEOUT`` and tried once (``HintSender``, and the doorbell's client), and
    after a failure hints are skipped for ``SETTLED_HINT_COOLDOWN_SECONDS`` before one is tried
    again (``outbox.breaker``), counted in ``settled_hints_total{outcome}``. Build it once per
    process: the breaker's state is its own."""
    sender = HintSender(app, getattr(app, "hint_timeout", SettledCelery.hint_timeout))
    if isinstance(app, SettledCelery):
        app._hint_senders = [*getattr(app, "_hint_senders", ()), sender]
    bell = getattr(app, "doorbell", None)
    return HintBreaker(
        sender if bell is None else rung(sender, bell, unreachable=UNREACHABLE),
        cooldown=getattr(app, "hint_cooldown", SettledCelery.hint_cooldown),
        count=count_hint,
        broker=masked(str(app.conf.broker_url)),
    )


def ids_publisher(app: Celery) -> Publish:
    """One hint message carrying these operation ids (the sweeper's; the relay's without the
    doorbell)."""

    def publish(operation_ids: Sequence[int]) -> None:
        app.send_task(SUBMIT, args=[list(operation_ids)], queue=QUEUE)

    return publish


def worker_argv(
    *, beat: bool, pool: str, concurrency: int, loglevel: str, hostname: str | None
) -> list[str]:
    # --quiet: no banner on stdout (every line Settled writes is a log line on stderr).
    argv = [
        "--quiet",
        "worker",
        f"--pool={pool}",
        f"--loglevel={loglevel}",
        f"--queues={QUEUE},{BEAT_QUEUE}",
    ]
    if pool != "solo":
        argv.append(f"--concurrency={concurrency}")
    if beat:
        argv.append("--beat")
    if hostname:
        argv.append(f"--hostname={hostname}")
    argv += ["--without-gossip", "--without-mingle"]
    return argv
