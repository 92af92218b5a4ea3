"""Mutants the fast selections cannot kill because they change nothing the selections can
observe about safety, each with the reason. A mutant listed here is still run by ``--all``
(its result is reported), but its survival does not fail the run, and the CI sample never
draws it.

Keep the reasons checkable: a reviewer should be able to read the line and agree.
"""

from __future__ import annotations

_STRIPE_HEADERS = (
    '`(error.headers or {}).get("Retry-After")`, the `or {}` dropped: the SDK\'s '
    "StripeError.__init__ sets `self.headers = headers or {}` (stripe/_error.py), so "
    "`error.headers` is always a dict, `{}` where the answer had none: the same lookup. The "
    "fallback guards only a hand-made error value."
)

EQUIVALENT: dict[str, str] = {
    "outbox/downstream_clock.py::corrected_deadline::cmp#1": (
        "`not lag > 0` -> `not lag >= 0`: differs only for a lag of exactly 0 (or -0.0), which "
        "the mutant goes on to subtract: `deadline - timedelta(seconds=0)` is equal to "
        "`deadline` (the same instant and tzinfo), so the header said is the same."
    ),
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
    "workers/sending.py::SendsBatches._send_and_record::const#3": (
        "`max_workers=max(1, self.max_batch)`, the 1 -> 2 or 0: the pool is made only for a "
        "batch of two or more (`len(batch) <= 1` is sent in the caller's thread), and a batch "
        "is at most max(1, max_batch) operations (Executor.execute cuts the hinted ids in "
        "chunks of that size and claims up to that many in all: ids plus extra), so max_batch "
        ">= 2 wherever the pool is made, and then max(2, n) == max(1, n) == max(0, n) == n."
    ),
    "workers/sending.py::SendsBatches._send_and_record::const#4": (
        "`max_workers=max(1, self.max_batch)`, the 1 -> 2 or 0: the pool is made only for a "
        "batch of two or more (`len(batch) <= 1` is sent in the caller's thread), and a batch "
        "is at most max(1, max_batch) operations (Executor.execute cuts the hinted ids in "
        "chunks of that size and claims up to that many in all: ids plus extra), so max_batch "
        ">= 2 wherever the pool is made, and then max(2, n) == max(1, n) == max(0, n) == n."
    ),
    "reconciler/reconcile.py::Reconciler.run_once::const#3": (
        "`self._clock_read(claims[0].now, mono)` -> `claims[-1].now`: every claim's `now` is "
        "the database's clock read by the same claim UPDATE (its RETURNING, outbox/storage/"
        "claims.py), so both are readings taken between `mono` (before the claim) and the "
        "monotonic time `_clock_read` takes after it, the interval the step detector judges a "
        "reading by; they differ by the statement's own microseconds, far inside the clock "
        "margin (1 s) the detector allows. (claims[1] instead, const#2, fails on one claim.)"
    ),
    "outbox/leases.py::LeaseKeeper.__init__::const#2": (
        "`self._pid = 0` -> 1 or -1 in __init__: `_pid` is read only in `_start`, after "
        "`self._thread is not None and`, and `_thread` is None until `_start` first runs, "
        "which assigns `_pid` (os.getpid()) before `_thread`: the initial value is never read."
    ),
    "outbox/leases.py::LeaseKeeper.__init__::const#3": (
        "`self._pid = 0` -> 1 or -1 in __init__: `_pid` is read only in `_start`, after "
        "`self._thread is not None and`, and `_thread` is None until `_start` first runs, "
        "which assigns `_pid` (os.getpid()) before `_thread`: the initial value is never read."
    ),
    "outbox/leases.py::LeaseKeeper.holding::const#0": (
        "`self._held.get(op_id, (None, 0.0))[0]`, the 0.0 -> 1.0 or -1.0: only `[0]` of the "
        "default is read (None, never a lease version); its second element is a placeholder for "
        "the tuple's shape."
    ),
    "outbox/leases.py::LeaseKeeper.holding::const#1": (
        "`self._held.get(op_id, (None, 0.0))[0]`, the 0.0 -> 1.0 or -1.0: only `[0]` of the "
        "default is read (None, never a lease version); its second element is a placeholder for "
        "the tuple's shape."
    ),
    "outbox/leases.py::LeaseKeeper.renew_now::const#0": (
        "`self._held.get(op_id, (None, 0.0))[0]`, the 0.0 -> 1.0 or -1.0: only `[0]` of the "
        "default is read (None, never a lease version); its second element is a placeholder for "
        "the tuple's shape."
    ),
    "outbox/leases.py::LeaseKeeper.renew_now::const#1": (
        "`self._held.get(op_id, (None, 0.0))[0]`, the 0.0 -> 1.0 or -1.0: only `[0]` of the "
        "default is read (None, never a lease version); its second element is a placeholder for "
        "the tuple's shape."
    ),
    "outbox/leases.py::LeaseKeeper._start::drop-operand#0": (
        "`self._thread is not None and self._pid == os.getpid() and ...`, the first operand "
        "dropped: `_pid` is 0 (never a process id) until `_start` assigns it, before it "
        "assigns `_thread`, so `_pid == os.getpid()` is False whenever `_thread` is None and "
        "`and` stops before `self._thread.is_alive()`."
    ),
    "outbox/leases.py::LeaseKeeper._start::drop-operand#1": (
        "`... and self._pid == os.getpid() and self._thread.is_alive()`, the pid check dropped: it"
        " differs only in a forked child, and there CPython marks every thread but the forking one"
        " stopped (threading's after-fork handler), so `is_alive()` is already False and the child"
        " starts its own thread either way; the forking thread is never the keeper's own (it only "
        "renews and waits)."
    ),
    "workers/transport.py::BoundedTransport.__init__::const#0": (
        "`super().__init__(..., retries=0)` -> 1 or -1: the pool HTTPTransport.__init__ builds "
        "with it is replaced by the next statement (`self._pool = httpcore.ConnectionPool(...)`, "
        "retries=0), and HTTPTransport keeps nothing else of `retries` (httpx 0.29: it only "
        "builds `self._pool`). No request ever reaches that first pool."
    ),
    "workers/transport.py::BoundedTransport.__init__::const#1": (
        "`super().__init__(..., retries=0)` -> 1 or -1: the pool HTTPTransport.__init__ builds "
        "with it is replaced by the next statement (`self._pool = httpcore.ConnectionPool(...)`, "
        "retries=0), and HTTPTransport keeps nothing else of `retries` (httpx 0.29: it only "
        "builds `self._pool`). No request ever reaches that first pool."
    ),
    "workers/transport.py::BoundedTransport.__init__::const#2": (
        "`http1=True` -> False (with `http2=False`): httpcore 1.0.9 reads `_http1` only in "
        "`self._http2 and not self._http1` (HTTPConnection.handle_request, is_available) and "
        "offers ALPN h2 only when `_http2`; with http2 False every connection is HTTP/1.1 "
        "whatever http1 says. The HTTP/1.1-only offer is pinned by test_transport_bounds::"
        "test_a_tls_downstream_inside_the_deadline_is_answered_as_usual (a terminator that "
        "prefers h2), which kills `http2=True`."
    ),
    "workers/transport.py::BoundedTransport.__init__::const#4": (
        "the pool's `retries=0` -> 1 or -1: httpcore retries a connect only on its own "
        "ConnectError/ConnectTimeout from the backend's connect_tcp or the stream's start_tls "
        "(HTTPConnection._connect); BoundedBackend.connect_tcp and BoundedStream.start_tls turn "
        "every one of those into NotSentError (an httpx error), so the retry branch is never "
        "reached (and -1 fails `retries_left <= 0` as 0 does). That a refused connect is tried "
        "once is pinned by test_transport_bounds::test_a_refused_connection_is_tried_once."
    ),
    "workers/transport.py::BoundedTransport.__init__::const#5": (
        "the pool's `retries=0` -> 1 or -1: httpcore retries a connect only on its own "
        "ConnectError/ConnectTimeout from the backend's connect_tcp or the stream's start_tls "
        "(HTTPConnection._connect); BoundedBackend.connect_tcp and BoundedStream.start_tls turn "
        "every one of those into NotSentError (an httpx error), so the retry branch is never "
        "reached (and -1 fails `retries_left <= 0` as 0 does). That a refused connect is tried "
        "once is pinned by test_transport_bounds::test_a_refused_connection_is_tried_once."
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
    "workers/http_classify.py::_receipt::drop-operand#1": (
        "`not isinstance(status, str)` dropped from the receipt's check: a body whose status is "
        "not a string is then a Receipt with that status. Both callers read the status only by "
        "comparing it with strings: classify_submit answers `Unknown` for `status != "
        '"succeeded"` and classify_lookup `Unavailable` for `status not in ("succeeded", '
        '"rejected")`, the very answers they give for no receipt (None). JSON\'s other values '
        "(numbers, lists, objects, null, booleans) never equal a string."
    ),
    "workers/stripe_classify.py::classify_error::drop-operand#7": _STRIPE_HEADERS,
    "workers/stripe_classify.py::classify_intent_error::drop-operand#11": _STRIPE_HEADERS,
    "workers/stripe_classify.py::classify_intent_error::drop-operand#3": (
        "`and error.__cause__ is not None` dropped: `not_sent(None)` is then called, and "
        "answers None (None is no NotSentError, PoolTimeout, ConnectError or ConnectTimeout), "
        "which the next line treats exactly as a cause that proves nothing: the same outcome."
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
