"""The layering contract of ARCHITECTURE.md, read from the source (an AST check, no import).

    settled             entry points: CLI, runtime wiring, Celery app, web, metrics, demo
      │  ╲
      │   settled.simulator   a product of its own: the core's wire protocol only
      ▼    ╲
      │    support            the people: staff, finding, review, approvals
      │      │
      ▼      ▼
    workers   reconciler      not each other
      ╲        ╱
       outbox                 the core: imports nothing above it

Every import counts, at module level or inside a function (and under ``TYPE_CHECKING``): an
upward import is a dependency whenever it runs. The module graph has no cycle. The pure
decisions load no database, HTTP or broker library (checked in a fresh interpreter).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("outbox", "workers", "reconciler", "support", "settled")

#: layer -> the layers its modules may import (a module's layer: ``layer_of``).
MAY_IMPORT: dict[str, frozenset[str]] = {
    "outbox": frozenset({"outbox"}),
    "workers": frozenset({"outbox", "workers"}),
    "reconciler": frozenset({"outbox", "reconciler"}),
    "support": frozenset({"outbox", "reconciler", "support"}),
    "settled.simulator": frozenset({"outbox", "settled.simulator"}),
    "settled": frozenset(
        {"outbox", "workers", "reconciler", "support", "settled", "settled.simulator"}
    ),
}

#: Pure decisions and values: importing one loads none of these.
PURE = (
    "outbox.states",
    "outbox.proposal_states",
    "outbox.proposal_rules",
    "outbox.errors",
    "outbox.ids",
    "outbox.kinds",
    "outbox.fingerprint",
    "outbox.retry",
    "outbox.clock",
    "outbox.downstream_clock",
    "outbox.change",
    "outbox.wire",
    "outbox.downstream",
    "outbox.port_shim",
    "outbox.report",
    "outbox.report_lines",
    "outbox.report_text",
    "outbox.quiescence",
    "outbox.verdict_due",
    "workers.verdicts",
    "workers.http_classify",
    "workers.downstreams",
    "reconciler.decide",
    "support.evidence",
    "support.staff",
)
HEAVY = ("sqlalchemy", "psycopg", "alembic", "httpx", "celery", "kombu", "fastapi", "redis")


def find_modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name (a package by its own)."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The first-party modules ``name`` imports anywhere in its source: ``from a import b``
    counts as ``a.b`` where that is a module, else as ``a``."""
    tops = {module.split(".")[0] for module in modules}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets.update(_nearest(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else _nearest(base, modules))
    return {t for t in targets if t.split(".")[0] in tops and t != name}


def _nearest(dotted: str, modules: Mapping[str, Path]) -> str:
    """``dotted`` if it is a module, else its longest prefix that is (third-party: as is)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return dotted


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    modules = find_modules(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> str:
    if module == "settled.simulator" or module.startswith("settled.simulator."):
        return "settled.simulator"
    return module.split(".")[0]


def forbidden_imports(graph: Mapping[str, set[str]]) -> list[str]:
    """Every import that breaks ``MAY_IMPORT``, as ``importer -> imported``."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) not in MAY_IMPORT[layer_of(module)]
    )


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_package_module_is_seen() -> None:
    graph = import_graph()
    for must in (
        "outbox.downstream",
        "workers.executor",
        "reconciler.decide",
        "support.review",
        "settled.cli",
    ):
        assert must in graph
    assert "settled.simulator" in graph  # a package counts by its own name


def test_each_layer_imports_only_the_layers_below_it() -> None:
    forbidden = forbidden_imports(import_graph())
    assert not forbidden, "imports ARCHITECTURE.md forbids:\n" + "\n".join(forbidden)


def test_no_import_cycle_between_modules() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("module", PURE)
def test_a_pure_module_loads_no_database_http_or_broker_library(module: str) -> None:
    probe = (
        f"import sys, {module}\n"
        f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert loaded == [], f"importing {module} loads {loaded}"


# The checker itself, on a tree made for it: it must see what the real tree must not have.


def _tree(root: Path, files: Mapping[str, str]) -> None:
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")


def test_the_check_catches_upward_sideways_and_in_function_imports(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "outbox/__init__.py": "",
            "outbox/core.py": "def f():\n    from settled import cli\n",
            "workers/__init__.py": "",
            "workers/verdicts.py": "from reconciler.decide import decide\n",
            "reconciler/__init__.py": "",
            "reconciler/decide.py": "from outbox import core\n",
            "reconciler/reconcile.py": "def f():\n    from support.review import ReviewQueue\n",
            "support/__init__.py": "",
            "support/review.py": "from reconciler.decide import decide\nimport workers.verdicts\n",
            "settled/__init__.py": "",
            "settled/cli.py": "import workers.verdicts\n",
            "settled/simulator/__init__.py": "from . import server\n",
            "settled/simulator/server.py": "from ..cli import main\nimport reconciler\n",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["settled.simulator"] == {"settled.simulator.server"}
    assert forbidden_imports(graph) == [
        "outbox.core -> settled.cli",
        "reconciler.reconcile -> support.review",
        "settled.simulator.server -> reconciler",
        "settled.simulator.server -> settled.cli",
        "support.review -> workers.verdicts",
        "workers.verdicts -> reconciler.decide",
    ]


def test_the_check_catches_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "outbox/__init__.py": "",
            "outbox/a.py": "from outbox import b\n",
            "outbox/b.py": "def late():\n    import outbox.c\n",
            "outbox/c.py": "from outbox.a import thing\n",
            "outbox/d.py": "from outbox import a\n",
        },
    )
    assert cycles(import_graph(tmp_path, ("outbox",))) == [["outbox.a", "outbox.b", "outbox.c"]]
