"""Mutants the fast selections cannot kill because they change nothing the selections can
observe about safety, each with the reason. A mutant listed here is still run by ``--all``
(its result is reported), but its survival does not fail the run, and the CI sample never
draws it.

Keep the reasons checkable: a reviewer should be able to read the line and agree.
"""

from __future__ import annotations

EQUIVALENT: dict[str, str] = {
    "outbox/clock.py::Step.direction::cmp#0": (
        "`seconds > 0` -> `>= 0`: differs only for a step of exactly 0 s, which StepDetector "
        "never reports: it reports one only when lo - last_hi (or last_lo - hi) exceeds the "
        "allowance (>= 0), and then the midpoints differ by more than 0."
    ),
    "reconciler/decide.py::backoff::const#2": (
        "`2 ** min(s.lookups, 16)` seconds, the 16 -> 15 or 17: the delay is then capped at "
        "MAX_RECHECK (5 minutes = 300 s); from 9 lookups on 2**n s is already past the cap "
        "(512 s), so the inner cap (2**15 s or 2**17 s instead of 2**16 s, hours) never shows. "
        "It only keeps the integer small."
    ),
    "reconciler/decide.py::backoff::const#3": (
        "`2 ** min(s.lookups, 16)` seconds, the 16 -> 15 or 17: the delay is then capped at "
        "MAX_RECHECK (5 minutes = 300 s); from 9 lookups on 2**n s is already past the cap "
        "(512 s), so the inner cap (2**15 s or 2**17 s instead of 2**16 s, hours) never shows. "
        "It only keeps the integer small."
    ),
    "reconciler/decide.py::decide::drop-operand#8": (
        '`doubt == "clock_step" and s.clock_trusted_at is not None`, the second operand '
        'dropped: not_found_doubt returns "clock_step" only when clock_trusted_at is not '
        "None, so the second operand is always true there; it narrows the type for mypy."
    ),
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
    "workers/verdicts.py::judge_resend::const#1": (
        "`timedelta(seconds=retry_after or 0.0)` -> `or -1.0`, inside "
        "`max(..., contract.processing_time)`: only a falsy retry_after (None or 0) reaches the "
        "constant, and then max(-1 s, processing_time) == max(0 s, processing_time) == "
        "processing_time, because processing_time is never negative (the default 2 s, the "
        "providers' 30 s, and `processing_seconds` is validated `ge=0` in "
        "outbox/settings_contracts.py). The 0.0 -> 1.0 mutant is killed "
        "(test_resend_rules, a processing time of 0 and 0.5 s)."
    ),
    "workers/wechatpay_classify.py::code_of::drop-operand#1": (
        "`code if isinstance(code, str) and code else None`, the `and code` dropped: an empty "
        'code is then returned as "" instead of None. code_of has two callers, both in the '
        'module (classify_error, classify_lookup), and every use of its value treats "" as '
        "None: membership in the code sets (non-empty strings), `code or ...` fallbacks, "
        "`== \"RESOURCE_NOT_EXISTS\"`, and `code or ''` in a detail. The non-string case "
        "(operand 1 dropped, and `or`) is killed by test_classify_edges (a 401 whose code is 7)."
    ),
}
