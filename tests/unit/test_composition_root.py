"""One builder per service (ARCHITECTURE.md, "settled/"): every service of a Settled process
is built in the composition root, ``settled/runtime.py``, and every entry point takes what it
built. Read from the source (an AST check, no import), like the layering test: a second
builder is how the console once asked a plain HTTP gateway about refunds the worker sent to
Stripe."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit import test_layers as layers

#: The services, by class name: constructing one, or calling a ``from_settings`` of one, is
#: building it.
SERVICES = frozenset(
    {
        "Executor",
        "Reconciler",
        "ReviewQueue",
        "Proposals",
        "Approvals",
        "Finder",
        "Overview",
        "HttpGateway",
        "StripeGateway",
        "GatewayByKind",
        "AgentDesk",
        "ClockWatch",
        "Coalescer",
        "RecoveryProbe",
    }
)
ROOT_MODULE = "settled.runtime"


def builds(path: Path) -> list[tuple[int, str]]:
    """Each place ``path`` builds a service: ``Name(...)`` or ``Name.classmethod(...)``, by
    line, except inside the class of that name itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, inside: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            inside = node.name
        if isinstance(node, ast.Call):
            func = node.func
            name = None
            if isinstance(func, ast.Name):
                name = func.id
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                name = func.value.id
            if name in SERVICES and name != inside:
                found.append((node.lineno, name))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, None)
    return found


def second_builders(root: Path = layers.ROOT) -> list[str]:
    """``module:line Name`` for each service built outside the composition root."""
    return sorted(
        f"{module}:{line} {name}"
        for module, path in layers.find_modules(root, layers.PACKAGES).items()
        if module != ROOT_MODULE
        for line, name in builds(path)
    )


def test_every_service_is_built_in_the_composition_root_only() -> None:
    found = second_builders()
    assert not found, "services built outside settled/runtime.py:\n" + "\n".join(found)


def test_the_check_sees_a_second_builder(tmp_path: Path) -> None:
    for package in layers.PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "settled" / "runtime.py").write_text(
        "def build():\n    return ReviewQueue(s, g, r)\n", encoding="utf-8"
    )
    (tmp_path / "settled" / "web.py").write_text(
        "def page():\n"
        "    q = ReviewQueue(s, HttpGateway(u, k), r)\n"
        "    return Proposals.from_settings(x)\n",
        encoding="utf-8",
    )
    (tmp_path / "outbox" / "proposals.py").write_text(
        "class Proposals:\n    @classmethod\n    def of(cls):\n        return Proposals()\n",
        encoding="utf-8",
    )
    assert second_builders(tmp_path) == [
        "settled.web:2 HttpGateway",
        "settled.web:2 ReviewQueue",
        "settled.web:3 Proposals",
    ]
