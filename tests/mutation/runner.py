"""Run mutants: apply each to a private copy of the project, run its module's tests there.

The copy matters: other processes (workers, test runs, other engineers' tools) import from the
worktree, and a mutant written into it, even for seconds, would be live code for them. Each slot
owns one copy (``Workspace``), writes the mutated module into it, runs the selection with the
copy first on ``sys.path`` (ahead of the editable install, which points at the worktree), and
puts the original back before its next mutant.

Most of a test run's start is importing SQLAlchemy, Celery, Redis, Hypothesis and pytest
(about 2 s of 3 on this machine). This process imports those once (``warm``) and forks a child
per run; the child forgets every module of the project (``outbox``, ``workers``, ...) so the
copy's mutated code is what it imports, and runs pytest in-process. The parent has no threads,
so forking it is safe.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.mutation.operators import Mutant, mutate
from tests.mutation.targets import BY_MODULE

ROOT = Path(__file__).resolve().parents[2]
#: the project's top-level packages: a child must import these from its copy
PROJECT = frozenset({"outbox", "workers", "reconciler", "settled", "support", "tests"})
#: imported once here, inherited by every child (the slow part of a test run's start); not
#: pytest's plugins, which pytest must import itself to rewrite their asserts
WARM = (
    "sqlalchemy",
    "sqlalchemy.orm",
    "sqlalchemy.dialects.postgresql",
    "sqlalchemy.dialects.sqlite",
    "redis",
    "redis.asyncio",
    "hypothesis",
    "hypothesis.strategies",
    "pytest",
    "celery",
    "kombu",
    "httpx",
    "httpcore",
    "pydantic",
    "pydantic_settings",
    "structlog",
    "prometheus_client",
    "psycopg",
    "alembic",
    "stripe",
    "fastapi",
    "jinja2",
    "click",
)
_IGNORED = shutil.ignore_patterns(
    ".venv", ".git", "site", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "*.pyc"
)


@dataclass(frozen=True)
class Result:
    mutant: Mutant
    status: str  # "killed", "survived", "timeout" (counted as killed), "model" (killed by it)
    seconds: float
    detail: str = ""

    @property
    def survived(self) -> bool:
        return self.status == "survived"


def warm() -> None:
    for name in WARM:
        try:
            importlib.import_module(name)
        except ImportError:
            continue


class Workspace:
    """A private copy of the project, for one run at a time."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="settled-mutation-")) / "project"
        shutil.copytree(ROOT, self.root, ignore=_IGNORED)
        self.log = self.root.parent / "run.log"

    def close(self) -> None:
        shutil.rmtree(self.root.parent, ignore_errors=True)

    def apply(self, mutant: Mutant) -> None:
        self._write(mutant.module, mutate((ROOT / mutant.module).read_text(), mutant))

    def restore(self, mutant: Mutant) -> None:
        self._write(mutant.module, (ROOT / mutant.module).read_text())

    def _write(self, module: str, text: str) -> None:
        path = self.root / module
        path.write_text(text)
        # the bytecode cache validates by mtime and size: a mutant of the same size written
        # in the same second would otherwise run the previous code
        for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            cached.unlink(missing_ok=True)

    def fork(self, run: Callable[[], int]) -> int:
        """Run ``run`` in a child, in this copy, its output into ``self.log``; its pid."""
        pid = os.fork()
        if pid:
            return pid
        status = 99
        try:
            os.setpgid(0, 0)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            out = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.chdir(self.root)
            os.environ["PYTHONPATH"] = str(self.root)
            os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
            os.environ.pop("PYTEST_ADDOPTS", None)
            for name in list(sys.modules):
                if name.partition(".")[0] in PROJECT:
                    del sys.modules[name]
            sys.path[:] = [str(self.root)] + [
                p for p in sys.path if Path(p or ".").resolve() != ROOT
            ]
            status = run()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    def failure(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        return (failed or lines[-1:] or [""])[0][:300]


def _pytest(tests: Sequence[str]) -> Callable[[], int]:
    def run() -> int:
        import pytest

        # the warm imports include modules pytest's plugins would rewrite (Hypothesis's)
        quiet = "ignore::pytest.PytestAssertRewriteWarning"
        args = ["-x", "-q", "-p", "no:cacheprovider", "-W", quiet, "-k", "not postgresql"]
        args.extend(tests)
        return int(pytest.main(args))

    return run


def _model() -> int:
    from tests.mutation import model_check

    return model_check.main()


@dataclass
class _Slot:
    space: Workspace
    model: bool = True
    mutant: Mutant | None = None
    phase: str = ""
    pid: int = 0
    started: float = 0.0
    deadline: float = 0.0
    results: list[Result] = field(default_factory=list)

    def start(self, mutant: Mutant, timeout: float) -> None:
        self.mutant = mutant
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.space.apply(mutant)
        self._spawn("tests")

    def _spawn(self, phase: str) -> None:
        assert self.mutant is not None
        self.phase = phase
        target = BY_MODULE[self.mutant.module]
        self.pid = self.space.fork(_pytest(target.tests) if phase == "tests" else _model)

    def exited(self, code: int) -> Result | None:
        """The child ended with ``code``: the result, or None if a model run follows."""
        assert self.mutant is not None
        if code in (3, 4, 5, 99):  # pytest's internal error, usage error, nothing collected
            raise RuntimeError(f"{self.mutant.id}: the run broke: {self.space.failure()}")
        modelled = self.model and BY_MODULE[self.mutant.module].model
        if code == 0 and self.phase == "tests" and modelled:
            self._spawn("model")
            return None
        status = "survived" if code == 0 else ("killed" if self.phase == "tests" else "model")
        return self._finish(status, "" if code == 0 else self.space.failure())

    def expire(self) -> Result:
        os.killpg(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        return self._finish("timeout", f"no verdict in {self.deadline - self.started:.0f} s")

    def _finish(self, status: str, detail: str) -> Result:
        assert self.mutant is not None
        self.space.restore(self.mutant)
        result = Result(self.mutant, status, time.monotonic() - self.started, detail)
        self.mutant, self.pid = None, 0
        return result


def run_all(
    mutants: Sequence[Mutant], jobs: int, timeout: float, *, model: bool = True
) -> Iterator[Result]:
    """Every mutant's result, as each finishes, with ``jobs`` children at a time; ``model``:
    a mutant the tests let through is also given to the model checker (``model_check``)."""
    warm()
    # a terminated run still kills its children and removes its copies (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    slots = [_Slot(Workspace(), model=model) for _ in range(max(1, jobs))]
    waiting = list(reversed(mutants))
    try:
        while waiting or any(slot.pid for slot in slots):
            for slot in slots:
                if not slot.pid and waiting:
                    slot.start(waiting.pop(), timeout)
            for slot in slots:
                if not slot.pid:
                    continue
                pid, status = os.waitpid(slot.pid, os.WNOHANG)
                if pid:
                    result = slot.exited(os.waitstatus_to_exitcode(status))
                elif time.monotonic() > slot.deadline:
                    result = slot.expire()
                else:
                    continue
                if result is not None:
                    yield result
            time.sleep(0.05)
    finally:
        for slot in slots:
            if slot.pid:
                os.killpg(slot.pid, signal.SIGKILL)
                os.waitpid(slot.pid, 0)
            slot.space.close()
