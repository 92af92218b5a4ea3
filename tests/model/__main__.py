"""``python -m tests.model``: the CI configurations of the protocol model and of the approvals
model, the real rules in each broken variant's own configuration (its control), then every
broken variant of each, then every world that breaks one of the contract's assumptions; one
figures line each. Exit status 1 on any violation of the real rules, on a variant the checker
does not catch (or catches only as a failure to settle), or on a broken assumption the real
rules survive. This is the one run of these explorations: the tests of ``tests/model`` check
the checker itself and the smaller configurations, not these again.

``--jobs N``: explore in N processes (``scripts/test.sh`` uses two).

``--long``: bigger configurations, each explored for at most ``--seconds`` (bounded runs say
so in their figures line).
"""

from __future__ import annotations

import argparse
import multiprocessing
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
    return [(name, _variant(name, max_states)) for name in VARIANTS]


def run_assumptions(max_states: int = 200_000) -> list[tuple[str, Result]]:
    """The real rules in each world that breaks one of the contract's assumptions."""
    return [
        (name, explore(ProtocolModel(replace(config, name=name)), max_states=max_states))
        for name, config in ASSUMPTIONS.items()
    ]


def _variant(name: str, max_states: int = 200_000) -> Result:
    config = VARIANTS[name][1]
    return explore(ProtocolModel(replace(config, variant=name)), max_states=max_states)


def controls() -> dict[str, Config]:
    """The configuration of each broken variant that the CI set does not already explore,
    named after the variants it serves: the real rules must hold there, or a variant caught in
    it proves nothing (the checker would flag the real code too)."""
    explored = {replace(c, name="") for c in CI}
    out: dict[str, list[str]] = {}
    configs: dict[str, Config] = {}
    for name, (_, config) in VARIANTS.items():
        key = replace(config, name="", variant=None)
        if key in explored:
            continue
        label = repr(key)
        out.setdefault(label, []).append(name)
        configs[label] = key
    return {f"control of {', '.join(names)}": configs[label] for label, names in out.items()}


def _stopped(result: Result) -> str:
    """The figures of a run that ended at its first violation (not a whole exploration)."""
    return result.figures.line().replace("exhaustive", "stopped at the first violation")


def _holds(result: Result) -> tuple[bool, str]:
    """A run of the real rules: its figures, and its violation if any; True if none."""
    text = result.figures.line()
    if result.violation is not None:
        text += "\n" + result.violation.render()
    return result.violation is None, text


def _caught(name: str, result: Result) -> tuple[bool, str]:
    """A run of a broken variant: True if the checker caught it, by a safety property (a
    variant that only stops the protocol settling is not the bug it stands for)."""
    if result.violation is None:
        return False, f"{result.figures.line()}: variant {name} NOT CAUGHT"
    if result.violation.property == "settlement":
        return False, f"{_stopped(result)}: variant {name} caught only by settlement"
    return True, f"{_stopped(result)}: caught ({result.violation.property})"


def _needed(name: str, result: Result) -> tuple[bool, str]:
    """A run of the real rules in a world without one of the contract's assumptions: they
    must break there (else the assumption, or the model of it, is wrong)."""
    if result.violation is None:
        return False, f"{result.figures.line()}: assumption {name} NOT NEEDED?"
    return True, f"{_stopped(result)}: fails without it ({result.violation.property})"


#: One exploration of the run: what it is, and its name there.
Job = tuple[str, str]


def jobs(long: bool) -> list[Job]:
    """Every exploration of a run, in the order their lines are printed."""
    configs = LONG if long else CI
    approval_models = approvals.LONG if long else approvals.CONFIGURATIONS
    return [
        *(("config", c.name) for c in configs),
        *(("approvals", name) for name in approval_models),
        *(("control", name) for name in ([] if long else controls())),
        *(("approvals-variant", name) for name in approvals.VARIANTS),
        *(("variant", name) for name in VARIANTS),
        *(("assumption", name) for name in ASSUMPTIONS),
    ]


def run_job(job: Job, long: bool = False, seconds: float = 600.0) -> tuple[bool, str]:
    """Explore one job; True if it came out as it must, and the lines to print."""
    what, name = job
    if what == "config":
        config = next(c for c in (LONG if long else CI) if c.name == name)
        limit = 2_000_000
        if long:
            # A first measured rate turns the time budget into a bound on states.
            probe = explore(ProtocolModel(config), max_states=20_000)
            limit = max(20_000, int(probe.figures.states_per_second * seconds))
        return _holds(explore(ProtocolModel(config), max_states=limit))
    if what == "approvals":
        return _holds(explore((approvals.LONG if long else approvals.CONFIGURATIONS)[name]))
    if what == "control":
        return _holds(explore(ProtocolModel(replace(controls()[name], name=name))))
    if what == "approvals-variant":
        return _caught(name, explore(approvals.VARIANTS[name]))
    if what == "variant":
        return _caught(name, _variant(name))
    config = ASSUMPTIONS[name]
    return _needed(name, explore(ProtocolModel(replace(config, name=name)), max_states=200_000))


def _run_job(args: tuple[Job, bool, float]) -> tuple[bool, str]:
    return run_job(*args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.model", description=__doc__)
    parser.add_argument("--long", action="store_true", help="explore bigger configurations")
    parser.add_argument("--seconds", type=float, default=600.0, help="budget per --long run")
    parser.add_argument(
        "--jobs", type=int, default=1, help="explore in this many processes (lines in order)"
    )
    args = parser.parse_args(argv)
    failed = False
    started = time.monotonic()
    work = [(job, args.long, args.seconds) for job in jobs(args.long)]
    if args.jobs > 1:
        # fork: each process has the models as this one built them
        context = multiprocessing.get_context("fork")
        with context.Pool(args.jobs) as pool:
            results = pool.imap(_run_job, work)
            for ok, text in results:
                print(text, flush=True)
                failed |= not ok
    else:
        for item in work:
            ok, text = _run_job(item)
            print(text, flush=True)
            failed |= not ok
    print(f"model: {'FAILED' if failed else 'ok'} in {time.monotonic() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
