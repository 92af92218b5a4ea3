"""The modules the mutation suite changes, and for each the tests that must catch a change.

A selection is the unit tests of the module, the integration tests that drive it on SQLite
only (``-k "not postgresql"``: the PostgreSQL half of each parametrised test runs the same
code path at ten times the cost), and, where the module feeds the model checker, two of its
small CI configurations (``model``: run only when the tests passed, since they cost more).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    module: str  # a path relative to the project's root
    tests: tuple[str, ...]
    model: bool = False  # also explore the model checker's small configurations


_CLASSIFY = (
    "tests/unit/test_classify_edges.py",
    "tests/unit/test_http_classification.py",
    "tests/unit/test_fence_probe.py",
    "tests/unit/test_stripe_classification.py",
    "tests/unit/test_stripe_rules.py",
    "tests/unit/test_wechatpay_classification.py",
    "tests/unit/test_alipay_classification.py",
)

TARGETS: tuple[Target, ...] = (
    Target(
        "reconciler/decide.py",
        (
            "tests/unit/test_decide.py",
            "tests/unit/test_decide_edges.py",
            "tests/unit/test_resend_rules.py",
            "tests/unit/test_verdict_due.py",
        ),
        model=True,
    ),
    Target(
        "reconciler/reconcile.py",
        (
            "tests/unit/test_reconciler_parts.py",
            "tests/integration/test_reconciler.py",
            "tests/integration/test_resend.py",
        ),
    ),
    Target(
        "workers/verdicts.py",
        (
            "tests/unit/test_send_checks.py",
            "tests/unit/test_verdicts.py",
            "tests/unit/test_resend_rules.py",
            "tests/unit/test_retry_settings.py",
        ),
        model=True,
    ),
    Target("workers/http_classify.py", _CLASSIFY),
    Target("workers/stripe_classify.py", _CLASSIFY),
    Target("workers/wechatpay_classify.py", _CLASSIFY),
    Target("workers/alipay_classify.py", _CLASSIFY),
    Target(
        "workers/sending.py",
        (
            "tests/unit/test_send_bound.py",
            "tests/unit/test_send_batches.py",
            "tests/integration/test_send_fencing.py",
            "tests/integration/test_deadline_fence.py",
            "tests/integration/test_executor.py",
            # a slow send holds up no other outcome of its batch (the first gather's linger)
            "tests/integration/test_executor_batch.py",
            # a crash between the send and its record (the ``after_send`` failpoint)
            "tests/integration/test_provider_faults.py",
        ),
    ),
    Target(
        "workers/transport.py",
        ("tests/unit/test_transport.py", "tests/integration/test_transport_bounds.py"),
    ),
    Target(
        "outbox/storage/attempts.py",
        (
            "tests/integration/test_attempt_facts.py",
            # the budget: an attempt started counts as reached until its outcome says otherwise
            "tests/integration/test_budget_edges.py",
            "tests/integration/test_executor_batch.py",
            "tests/integration/test_send_fencing.py",
            "tests/integration/test_reconciler.py",
        ),
        model=True,
    ),
    Target(
        "outbox/leases.py",
        ("tests/unit/test_lease_keeper.py", "tests/integration/test_leases.py"),
    ),
    Target(
        "outbox/downstream_clock.py",
        ("tests/unit/test_downstream_clock.py", "tests/unit/test_provider_clocks.py"),
    ),
    Target(
        "workers/downstream_time.py",
        ("tests/unit/test_provider_clocks.py", "tests/unit/test_downstream_clock.py"),
    ),
    Target(
        "outbox/clock.py",
        (
            "tests/unit/test_db_clock.py",
            "tests/unit/test_clock_steps.py",
            "tests/unit/test_lookup_time.py",
            "tests/unit/test_transport.py",
            "tests/unit/test_http_classification.py",
            "tests/integration/test_deadline_fence.py",
        ),
        model=True,
    ),
)

BY_MODULE = {target.module: target for target in TARGETS}
