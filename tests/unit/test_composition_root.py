"""One builder per service (ARCHITECTURE.md, "settled/"): every service of a Settled process
is built in the composition root, ``settled/runtime.py``, and every entry point takes what it
built. Read from the source (an AST check, no import), like the layering test: a second
builder is how the console once asked a plain HTTP gateway about refunds the worker sent to
Stripe.

The services are read from the root itself, not listed here: every class of the product
packages whose instance ``settled/runtime.py`` makes. A module makes an instance of a class
when it calls the class, calls one of the class's own classmethods (``Outbox.from_settings``),
or hands the class uncalled to a call as the factory of one (``self._once("outage",
DatabaseOutage)``; ``isinstance`` and ``issubclass`` excepted); an exception it raises is not
a service. A name is followed through every import, re-exports included (``from outbox import
Outbox``), to the module whose ``class`` statement defines it; that module may make its own
class (a classmethod, a default), and no other product module may make a service but those in
``ALLOWED``. A service's field may default to another service (``clock_watch:
ClockWatch = field(default_factory=ClockWatch)``, for a service made by hand in a test) only
where the root passes that field every time it makes the class: else the process would hold a
second one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from tests.unit import test_layers as layers

ROOT_MODULE = "settled.runtime"

#: ``(module, class)``: a service that module builds on purpose, and why. Keep it short.
ALLOWED: dict[tuple[str, str], str] = {}

#: Calls that take a class to look at it, not to make one.
INSPECTING = frozenset({"isinstance", "issubclass"})

Class = tuple[str, str]  # (the module whose ``class`` statement defines it, its name)


class Made(NamedTuple):
    """An instance a module makes: where, of which class, with which keywords (None: not
    called with its arguments here, a factory handed over or a classmethod)."""

    line: int
    cls: Class
    given: frozenset[str] | None


class Default(NamedTuple):
    """A field of ``owner`` whose default is an instance of ``cls``."""

    line: int
    cls: Class
    owner: Class
    field: str
    factory: ast.expr


@dataclass
class Module:
    """One product module's source: what its names are bound to, what it defines."""

    name: str
    path: Path
    tree: ast.Module = field(init=False)

    def __post_init__(self) -> None:
        self.tree = ast.parse(self.path.read_text(encoding="utf-8"), str(self.path))

    @cached_property
    def classes(self) -> dict[str, ast.ClassDef]:
        """Its classes at module level (under an ``if`` too), by name."""
        return {node.name: node for node in _top_level(self.tree) if isinstance(node, ast.ClassDef)}

    @cached_property
    def bound(self) -> dict[str, str]:
        """Each name an import anywhere in it binds (in a function, under ``TYPE_CHECKING``),
        to the dotted name it stands for; its own classes to themselves."""
        package = self.name if self.path.name == "__init__.py" else self.name.rpartition(".")[0]
        names: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        names[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        names[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    anchor = parts[: len(parts) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{base}.{alias.name}"
        names.update({name: f"{self.name}.{name}" for name in self.classes})
        return names


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If | ast.Try):
            todo += [*node.body, *node.orelse]


@dataclass
class Product:
    """The product packages' modules, and where each dotted name's class is defined."""

    modules: dict[str, Module]

    @classmethod
    def under(cls, root: Path) -> Product:
        found = layers.find_modules(root, layers.PACKAGES)
        return cls({name: Module(name, path) for name, path in found.items()})

    def defined(self, dotted: str, seen: frozenset[str] = frozenset()) -> Class | None:
        """The class ``dotted`` names, by its defining module (None: not a product class)."""
        if dotted in seen:
            return None
        parts = dotted.split(".")
        for end in range(len(parts) - 1, 0, -1):
            module = self.modules.get(".".join(parts[:end]))
            if module is None:
                continue
            name, rest = parts[end], parts[end + 1 :]
            if name in module.classes:
                return (module.name, name) if not rest else None
            target = module.bound.get(name)
            if target is None or target == dotted:
                return None
            return self.defined(".".join([target, *rest]), seen | {dotted})
        return None

    def is_classmethod(self, cls: Class, method: str) -> bool:
        node = self.modules[cls[0]].classes[cls[1]]
        return any(
            isinstance(item, ast.FunctionDef)
            and item.name == method
            and any(isinstance(d, ast.Name) and d.id == "classmethod" for d in item.decorator_list)
            for item in node.body
        )

    def made(self, module: Module) -> Iterator[Made]:
        """Each instance of a product class ``module`` makes (a field's default apart)."""
        raised = {id(node.exc) for node in ast.walk(module.tree) if isinstance(node, ast.Raise)}
        defaults = {id(default.factory) for default in self.defaults(module)}
        for call in ast.walk(module.tree):
            if not isinstance(call, ast.Call) or id(call) in raised:
                continue
            given = frozenset(k.arg for k in call.keywords if k.arg is not None)
            called = self.class_of(module, call.func)
            if called is not None:
                yield Made(call.lineno, called, given)
            elif isinstance(call.func, ast.Attribute):
                owner = self.class_of(module, call.func.value)
                if owner is not None and self.is_classmethod(owner, call.func.attr):
                    yield Made(call.lineno, owner, None)
            if isinstance(call.func, ast.Name) and call.func.id in INSPECTING:
                continue
            for argument in [*call.args, *(k.value for k in call.keywords)]:
                factory = self.class_of(module, argument)
                if factory is not None and id(argument) not in defaults:
                    yield Made(argument.lineno, factory, None)

    def defaults(self, module: Module) -> Iterator[Default]:
        """Each ``name: T = field(default_factory=Class)`` in a class of ``module``."""
        for owner, node in module.classes.items():
            for item in node.body:
                if not (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and isinstance(item.value, ast.Call)
                ):
                    continue
                for keyword in item.value.keywords:
                    made = self.class_of(module, keyword.value)
                    if keyword.arg == "default_factory" and made is not None:
                        yield Default(
                            item.lineno, made, (module.name, owner), item.target.id, keyword.value
                        )

    def class_of(self, module: Module, node: ast.expr) -> Class | None:
        """The product class ``node`` names in ``module`` (None: another thing)."""

        def named(node: ast.expr) -> str | None:
            if isinstance(node, ast.Name):
                return module.bound.get(node.id)
            if isinstance(node, ast.Attribute):
                owner = named(node.value)
                return None if owner is None else f"{owner}.{node.attr}"
            return None

        dotted = named(node)
        return None if dotted is None else self.defined(dotted)

    def services(self) -> set[Class]:
        """Every product class the composition root makes an instance of."""
        return {made.cls for made in self.made(self.modules[ROOT_MODULE])}

    def second_builders(self, allowed: Mapping[Class, str] = ALLOWED) -> list[str]:
        """``module:line Class`` for each service made outside the composition root and the
        class's own module, but for ``allowed``; and for each field defaulting to a service
        that the root does not pass where it makes the field's class."""
        root = list(self.made(self.modules[ROOT_MODULE]))
        services = {made.cls for made in root}
        found = [
            f"{name}:{made.line} {made.cls[1]}"
            for name, module in self.modules.items()
            if name != ROOT_MODULE
            for made in self.made(module)
            if made.cls in services and made.cls[0] != name and (name, made.cls[1]) not in allowed
        ]
        for name, module in self.modules.items():
            for default in self.defaults(module):
                makes = [made.given for made in root if made.cls == default.owner]
                if default.cls in services and not all(
                    given is not None and default.field in given for given in makes
                ):
                    found.append(
                        f"{name}:{default.line} {default.cls[1]} "
                        f"({default.owner[1]}.{default.field} not passed by the root)"
                    )
        return sorted(found)


def test_every_service_is_built_in_the_composition_root_only() -> None:
    found = Product.under(layers.ROOT).second_builders()
    assert not found, "services built outside settled/runtime.py:\n" + "\n".join(found)


def test_the_services_are_read_from_the_composition_root() -> None:
    """Called, made by a classmethod, handed over as a factory, imported inside a method."""
    services = {name for _, name in Product.under(layers.ROOT).services()}
    assert {"Executor", "Outbox", "DatabaseOutage", "WechatPayNotifications"} <= services
    assert "Runtime" in services  # ``build_runtime`` is its one builder too
    assert "Settings" not in services  # passed in, never made there


def test_every_allowed_exception_is_still_needed() -> None:
    found = Product.under(layers.ROOT).second_builders(allowed={})
    for (module, name), why in ALLOWED.items():
        assert why, f"{module} {name}: say why"
        assert any(f.startswith(f"{module}:") and f.endswith(f" {name}") for f in found)


def _write(root: Path, module: str, text: str) -> None:
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_the_check_sees_a_second_builder_by_any_name(tmp_path: Path) -> None:
    for package in layers.PACKAGES:
        _write(tmp_path, f"{package}.__init__", "")
    _write(tmp_path, "outbox.__init__", "if X:\n    from outbox.intake import Outbox\n")
    _write(
        tmp_path,
        "outbox.intake",
        "class Outbox:\n"
        "    @classmethod\n"
        "    def from_settings(cls):\n"
        "        return Outbox()\n"  # its own module: allowed
        "    @staticmethod\n"
        "    def helper():\n"
        "        return 1\n",
    )
    _write(tmp_path, "outbox.outage", "class DatabaseOutage: ...\nclass Unused: ...\n")
    _write(tmp_path, "support.review", "class ReviewQueue: ...\n")
    _write(
        tmp_path,
        "settled.runtime",
        "from outbox.intake import Outbox\n"
        "from outbox.outage import DatabaseOutage, Unused\n"
        "def build(once):\n"
        "    from support.review import ReviewQueue\n"
        "    once('outage', DatabaseOutage)\n"
        "    isinstance(x, Unused)\n"
        "    return ReviewQueue(Outbox.from_settings())\n",
    )
    _write(
        tmp_path,
        "settled.web",
        "import support.review\n"
        "from outbox import Outbox as Door\n"
        "from outbox import outage\n"
        "from outbox.outage import Unused\n"
        "def page(partial):\n"
        "    q = support.review.ReviewQueue(s)\n"
        "    d = Door.from_settings()\n"
        "    Door.helper()\n"  # not a classmethod: makes nothing
        "    Unused()\n"  # not a service
        "    return partial(outage.DatabaseOutage)\n",
    )
    product = Product.under(tmp_path)
    assert product.services() == {
        ("outbox.intake", "Outbox"),
        ("outbox.outage", "DatabaseOutage"),
        ("support.review", "ReviewQueue"),
    }
    assert product.second_builders() == [
        "settled.web:10 DatabaseOutage",
        "settled.web:6 ReviewQueue",
        "settled.web:7 Outbox",
    ]
    assert product.second_builders({("settled.web", "Outbox"): "a test"}) == [
        "settled.web:10 DatabaseOutage",
        "settled.web:6 ReviewQueue",
    ]


def test_the_check_sees_a_default_the_root_does_not_replace(tmp_path: Path) -> None:
    for package in layers.PACKAGES:
        _write(tmp_path, f"{package}.__init__", "")
    _write(tmp_path, "outbox.clock_steps", "class ClockWatch: ...\n")
    for module, name in (("workers.executor", "Executor"), ("support.review", "ReviewQueue")):
        _write(
            tmp_path,
            module,
            "from outbox.clock_steps import ClockWatch\n"
            "@dataclass\n"
            f"class {name}:\n"
            "    clock_watch: ClockWatch = field(default_factory=ClockWatch)\n",
        )
    _write(
        tmp_path,
        "settled.runtime",
        "from outbox.clock_steps import ClockWatch\n"
        "from support.review import ReviewQueue\n"
        "from workers.executor import Executor\n"
        "watch = ClockWatch()\n"
        "Executor(clock_watch=watch)\n"
        "ReviewQueue(clock_watch=watch)\n"
        "ReviewQueue()\n",  # a second watch for this review queue
    )
    assert Product.under(tmp_path).second_builders() == [
        "support.review:4 ClockWatch (ReviewQueue.clock_watch not passed by the root)"
    ]
