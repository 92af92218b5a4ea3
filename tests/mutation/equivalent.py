"""Mutants the fast selections cannot kill because they change nothing the selections can
observe about safety, each with the reason. A mutant listed here is still run by ``--all``
(its result is reported), but its survival does not fail the run, and the CI sample never
draws it.

Keep the reasons checkable: a reviewer should be able to read the line and agree.
"""

from __future__ import annotations

EQUIVALENT: dict[str, str] = {
    "workers/sending.py::SendsBatches._send_and_record::const#7": (
        "`out = ... if first else 0.0` -> -1.0: `out` is only read in "
        "`max(self.record_linger, out)`, and record_linger is never negative (a dataclass "
        "default of 0.1 s, set nowhere else in the product): max(linger, 0.0) == "
        "max(linger, -1.0)."
    ),
    "outbox/storage/attempts.py::start_attempts::boolop#0": (
        "`first_sent_at=c.first_sent_at or c.now` in the claim start_attempts returns: that "
        "claim is only sent (DownstreamRequest.of) and judged (judge_submit, judge_resend), and "
        "neither reads first_sent_at; the key-retention stop reads it from the claim before "
        "the start (workers/claiming.py, check_before_send), and the database's own "
        "first_sent_at is written by the transition. No reader, so no observable change."
    ),
    "outbox/storage/attempts.py::start_attempts::drop-operand#0": (
        "`first_sent_at=c.first_sent_at or c.now` in the claim start_attempts returns: that "
        "claim is only sent (DownstreamRequest.of) and judged (judge_submit, judge_resend), and "
        "neither reads first_sent_at; the key-retention stop reads it from the claim before "
        "the start (workers/claiming.py, check_before_send), and the database's own "
        "first_sent_at is written by the transition. No reader, so no observable change."
    ),
    "outbox/storage/attempts.py::start_attempts::drop-operand#1": (
        "`first_sent_at=c.first_sent_at or c.now` in the claim start_attempts returns: that "
        "claim is only sent (DownstreamRequest.of) and judged (judge_submit, judge_resend), and "
        "neither reads first_sent_at; the key-retention stop reads it from the claim before "
        "the start (workers/claiming.py, check_before_send), and the database's own "
        "first_sent_at is written by the transition. No reader, so no observable change."
    ),
    "workers/sending.py::SendsBatches._send_and_record::const#5": (
        "`first = True` -> False: `first` only arms the test failpoint `after_send` (a no-op "
        "unless a test arms it) and lets the first gather of a batch linger as long as the "
        "sends took (throughput). No outcome, fence or deadline reads it. The crash-after-send "
        "tests that arm the failpoint run real Celery workers (tests/integration/"
        "test_celery_worker.py), outside the fast selection."
    ),
}
