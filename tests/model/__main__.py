"""``python -m tests.model``: the CI configurations of the protocol model and of the approvals
model, then every broken variant of each, then every world that breaks one of the contract's
assumptions; one figures line each. Exit status 1 on any violation of the real rules, on a
variant the checker does not catch, or on a broken assumption the real rules survive.

``--long``: bigger configurations, each explored for at most ``--seconds`` (bounded runs say
so in their figures line).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from tests.model import approvals
from tests.model.engine import Result, explore
from tests.model.protocol import ASSUMPTIONS, VARIANTS, Config, ProtocolModel

#: Exhaustive in CI: two workers, the reconciler, staff and a cancel, for each kind of contract.
CI: tuple[Config, ...] = (
    Config(name="fenced"),
    Config(name="delay-bound", enforces_deadline=False),
    Config(name="not-idempotent", idempotent=False),
    Config(name="no-lookup", queryable=False, lease=1, deadline=2),
    Config(name="short-retention", retention=4, lease=1, deadline=2),
    Config(name="refusals", refusals=True, lease=1, deadline=2),
    # the key retention (less its margin) ends before the deadline: the resend's and the
    # claim's stop on it (``check_before_send``) decides whether a key is sent again
    Config(name="key-retention", retention=2, lease=1, deadline=3, max_attempts=3, throttle=False),
    # the downstream answering a replay with an idempotency error or a receipt unlike the
    # intent: the classifier's misuse branches, and review at once
    Config(name="misuse-answers", misuse=True, lease=1, deadline=1, throttle=False),
    # the database's clock set forward or back by a point (10 s), once, at any moment
    Config(name="fenced-clock-step", clock_steps=(1, -1), lease=1, deadline=1, throttle=False),
    # the downstream's clock 11 s behind the database's (a point beyond the margin), said on
    # every answer and measured: the fence allows for it
    Config(name="fenced-downstream-behind", downstream_lag=11, lease=1, deadline=2, throttle=False),
    Config(
        name="delay-bound-clock-step",
        enforces_deadline=False,
        clock_steps=(1,),
        lease=1,
        deadline=1,
        throttle=False,
    ),
)

#: ``--long``: two operations (a cancel of their run, workers shared between them); longer
#: leases and deadlines; two operations with everything.
LONG: tuple[Config, ...] = (
    Config(
        name="two-operations",
        ops=2,
        lease=1,
        deadline=1,
        throttle=False,
        staff=False,
        crashes=False,
    ),
    Config(
        name="two-operations-one-worker",
        ops=2,
        workers=1,
        lease=1,
        deadline=1,
        throttle=False,
        staff=False,
    ),
    Config(name="long-fenced", lease=3, deadline=4, refusals=True),
    Config(name="long-delay-bound", enforces_deadline=False, delay=2, lease=3, deadline=4),
    Config(name="long-two-operations", ops=2, refusals=True),
    Config(name="long-two-operations-delay", ops=2, enforces_deadline=False),
    Config(name="long-fenced-clock-step", clock_steps=(1, -1, 2), refusals=True),
    Config(name="long-delay-bound-clock-step", enforces_deadline=False, clock_steps=(1, -1, 2)),
)


def run_variants(max_states: int = 200_000) -> list[tuple[str, Result]]:
    """Every broken variant in the configuration it must be caught in."""
    return [
        (name, explore(ProtocolModel(replace(config, variant=name)), max_states=max_states))
        for name, (_, config) in VARIANTS.items()
    ]


def run_assumptions(max_states: int = 200_000) -> list[tuple[str, Result]]:
    """The real rules in each world that breaks one of the contract's assumptions."""
    return [
        (name, explore(ProtocolModel(replace(config, name=name)), max_states=max_states))
        for name, config in ASSUMPTIONS.items()
    ]


def _stopped(result: Result) -> str:
    """The figures of a run that ended at its first violation (not a whole exploration)."""
    return result.figures.line().replace("exhaustive", "stopped at the first violation")


def _holds(result: Result) -> bool:
    """Print a run of the real rules: its figures, and its violation if any; True if none."""
    print(result.figures.line(), flush=True)
    if result.violation is not None:
        print(result.violation.render(), flush=True)
    return result.violation is None


def _caught(name: str, result: Result) -> bool:
    """Print a run of a broken variant; True if the checker caught it."""
    if result.violation is None:
        print(f"{result.figures.line()}: variant {name} NOT CAUGHT", flush=True)
        return False
    print(f"{_stopped(result)}: caught ({result.violation.property})", flush=True)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.model", description=__doc__)
    parser.add_argument("--long", action="store_true", help="explore bigger configurations")
    parser.add_argument("--seconds", type=float, default=600.0, help="budget per --long run")
    args = parser.parse_args(argv)
    failed = False
    started = time.monotonic()
    configs = LONG if args.long else CI
    for config in configs:
        limit = 2_000_000
        if args.long:
            # A first measured rate turns the time budget into a bound on states.
            probe = explore(ProtocolModel(config), max_states=20_000)
            limit = max(20_000, int(probe.figures.states_per_second * args.seconds))
        result = explore(ProtocolModel(config), max_states=limit)
        failed |= not _holds(result)
    approval_models = approvals.LONG if args.long else approvals.CONFIGURATIONS
    for model in approval_models.values():
        failed |= not _holds(explore(model))
    variants = [(name, explore(model)) for name, model in approvals.VARIANTS.items()]
    for name, result in variants + run_variants():
        failed |= not _caught(name, result)
    for name, result in run_assumptions():
        # The real rules rest on it: a world without it must break them (else the assumption,
        # or the model of it, is wrong).
        if result.violation is None:
            print(f"{result.figures.line()}: assumption {name} NOT NEEDED?", flush=True)
            failed = True
        else:
            print(f"{_stopped(result)}: fails without it ({result.violation.property})")
    print(f"model: {'FAILED' if failed else 'ok'} in {time.monotonic() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
