"""The executor's first step: claim the hinted operations and check each before it is sent.

One step (``Storage.step``): the claim (a conditional update, lease in database time,
fencing version bumped), the last checks of each operation (its run's cancel flag, its
fingerprint, its budget: ``workers.verdicts.check_before_send``), the stops those checks
call for, and the attempt rows of the operations that will be sent (``submitted``, written
before anything is sent).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import Connection

from outbox.change import Change
from outbox.errors import InvalidInput, SettledError
from outbox.fingerprint import Fingerprinter
from outbox.kinds import Kind, KindRegistry
from outbox.retry import DEFAULT_MAX_TRIES
from outbox.states import ConfigFault, State
from outbox.storage import Storage
from outbox.storage.attempts import start_attempts
from outbox.storage.claims import Claimed, claim_for_send
from outbox.storage.runs import cancelled_runs
from outbox.storage.transitions import Transition
from workers.verdicts import check_before_send

log = logging.getLogger(__name__)

#: An operation this worker cannot check (its kind or fingerprint key version is not configured
#: here) is looked at again this much later: a rolling deploy has time to bring a worker that can.
HOLD_SECONDS = 60.0


@dataclass
class Claims:
    """What one claim step took, by what happens to it next."""

    #: checked, and its attempt started: to be sent now
    send: list[tuple[Claimed, Kind]] = field(default_factory=list)
    #: found ``submitted`` with an expired lease: may have been sent, so only looked up
    recover: list[Claimed] = field(default_factory=list)
    #: this worker cannot check it (its kind or fingerprint key is not configured here): held
    blocked: list[tuple[Claimed, str]] = field(default_factory=list)
    #: stopped before a send (cancelled, out of budget, ...): the state written
    written: dict[int, State] = field(default_factory=dict)

    @property
    def claimed(self) -> list[Claimed]:
        """Every operation the step claimed."""
        return [c for c, _ in self.send] + self.recover + [c for c, _ in self.blocked]


@dataclass(frozen=True)
class SendClaims:
    """Claims operations for one worker, and checks them before they are sent."""

    storage: Storage
    registry: KindRegistry
    fingerprinter: Fingerprinter
    worker: str
    lease_seconds: float
    #: the most tries an operation may record (``SETTLED_RETRY_MAX_TRIES``)
    max_tries: int = DEFAULT_MAX_TRIES

    def claim(self, conn: Connection, ids: Sequence[int], extra: int) -> Claims:
        """Claim the operations ``ids`` and up to ``extra`` other due ones, in one step."""
        claims = Claims()
        stops: list[Transition] = []
        claimed = claim_for_send(
            conn, worker=self.worker, lease_seconds=self.lease_seconds, ids=ids, extra=extra
        )
        cancelled = cancelled_runs(conn, (c.run_id for c in claimed))
        fresh: list[tuple[Claimed, Kind]] = []
        for one in claimed:
            if one.state is State.SUBMITTED:
                claims.recover.append(one)
                continue
            try:
                kind = self.registry.get(one.kind)
                fingerprint_ok = self.fingerprint_ok(one, kind)
            except SettledError as exc:
                log.error(
                    "not sent: this worker cannot check the operation",
                    extra={"operation_id": one.id, "error": exc.code},
                )
                claims.blocked.append((one, exc.code))
                continue
            check = self.check(one, kind, fingerprint_ok, one.run_id in cancelled)
            if check is None:
                fresh.append((one, kind))
            else:
                stops.append(Transition.of(one, check))
        stopped = self.storage.write_transitions(conn, stops, actor=self.worker)
        for stop in stops:
            if stop.id in stopped:
                claims.written[stop.id] = stop.to
                _log_stop(stop)
        kinds = {c.id: k for c, k in fresh}
        started = start_attempts(self.storage, conn, [c for c, _ in fresh], worker=self.worker)
        claims.send = [(c, kinds[c.id]) for c in started]
        return claims

    def check(
        self, one: Claimed, kind: Kind, fingerprint_ok: bool, cancelled: bool
    ) -> Change | None:
        """The stop the last checks before a send call for, or None: send it."""
        return check_before_send(
            now=one.now,
            deadline=one.deadline,
            attempts=one.attempts,
            max_attempts=one.max_attempts,
            reached_downstream=one.reached,
            first_sent_at=one.first_sent_at,
            contract=kind.contract,
            run_cancelled=cancelled,
            fingerprint_ok=fingerprint_ok,
            max_tries=self.max_tries,
        )

    def fingerprint_ok(self, claimed: Claimed, kind: Kind) -> bool:
        """Whether the stored params still match the stored fingerprint. Raises SettledError
        when the fingerprint's key version is not configured here (nothing can be checked)."""
        try:
            intent = kind.parse(claimed.params)
        except InvalidInput:
            return False
        return self.fingerprinter.matches(
            kind.name, intent, claimed.fingerprint_key_version, claimed.fingerprint
        )


def _log_stop(stop: Transition) -> None:
    """The line a stop before a send writes: ERROR, naming the operation, for a stop of our
    own configuration (a fingerprint that does not match: staff must look at it)."""
    why = (stop.evidence or {}).get("stop")
    if stop.note == ConfigFault.FINGERPRINT_MISMATCH and isinstance(stop.operation, Claimed):
        log.error(
            "not sent: the stored intent does not match its fingerprint under this worker's "
            "key (SETTLED_FINGERPRINT_KEYS differ between the app and the worker, or the row "
            "was altered); rejected, and put in review",
            extra={
                "operation_id": stop.id,
                "tenant": stop.operation.tenant,
                "op_id": stop.operation.op_id,
                "kind": stop.operation.kind,
                "stop": why,
            },
        )
        return
    log.info("not sent", extra={"operation_id": stop.id, "stop": why})
