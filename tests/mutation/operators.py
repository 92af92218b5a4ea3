"""The mutation operators, over the AST: where a module can be changed the way a careless edit
would change it, and the changed source.

Each mutant is named by where it is in the code, not by a line number: the module, the
function (its qualified name), the operator and its ordinal among that operator's points in
that function (``reconciler/decide.py::Situation.quiet_at::cmp#2``). An edit elsewhere in the
file leaves the name of every other mutant as it was, so the report, the list of equivalent
mutants and the fixed CI sample stay meaningful from one commit to the next.

The operators are the ones the safety-critical modules' bugs look like: a boundary moved
(``<`` and ``<=``), a condition negated or dropped, ``and`` for ``or``, a constant off by one,
``min`` for ``max``, a term left out of a time sum, a guard deleted, a result replaced by None.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

#: comparison flips: the boundary moved, the test negated
_COMPARE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_SYMBOL: dict[type[ast.cmpop], str] = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}
_MINMAX = {"min": "max", "max": "min"}


@dataclass(frozen=True)
class Mutant:
    module: str  # a path relative to the project's root, e.g. "reconciler/decide.py"
    scope: str  # the qualified name of the enclosing function or class ("<module>" at the top)
    operator: str
    ordinal: int  # among this operator's points in this scope, in source order
    line: int
    change: str  # what it does, for people

    @property
    def id(self) -> str:
        return f"{self.module}::{self.scope}::{self.operator}#{self.ordinal}"


@dataclass(frozen=True)
class _Point:
    scope: str
    operator: str
    line: int
    change: str
    node: ast.AST
    variant: int  # which change of that node (a number has two: +1 and -1)


def _is_docstring(node: ast.AST, parent: ast.AST | None) -> bool:
    return isinstance(parent, ast.Expr) and isinstance(node, ast.Constant)


def _skipped_call(node: ast.Call) -> bool:
    """Calls whose arguments are messages, not logic: logging and the ``Change`` notes."""
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id in {"log", "logger", "_log"}
    return False


def _declarative(call: ast.AST | None) -> bool:
    """``field(repr=False)``, ``dataclass(frozen=True)``: how a class is built, not logic."""
    if not isinstance(call, ast.Call):
        return False
    func = call.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    return name in {"field", "dataclass"}


def _textual(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes))
    )


class _Finder:
    """Walks a module in source order, naming each point by its scope."""

    def __init__(self) -> None:
        self.points: list[_Point] = []
        self._scope: list[str] = []

    def scope(self) -> str:
        return ".".join(self._scope) or "<module>"

    def add(self, operator: str, node: ast.AST, change: str, variant: int = 0) -> None:
        line = getattr(node, "lineno", 0)
        self.points.append(_Point(self.scope(), operator, line, change, node, variant))

    def visit(self, node: ast.AST, parent: ast.AST | None = None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self._scope.append(node.name)
            # decorators and annotations are not logic; the body and the defaults are
            for child in node.body:
                self.visit(child, node)
            if not isinstance(node, ast.ClassDef):
                for default in [*node.args.defaults, *node.args.kw_defaults]:
                    if default is not None:
                        self.visit(default, node)
            self._scope.pop()
            return
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.AnnAssign)) and not (
            isinstance(node, ast.AnnAssign) and node.value is not None
        ):
            return
        if isinstance(node, ast.AnnAssign):
            assert node.value is not None
            self.visit(node.value, node)
            return
        if isinstance(node, ast.Call) and _skipped_call(node):
            return
        if isinstance(node, ast.keyword) and _declarative(parent):
            return
        if isinstance(node, ast.If) and _type_checking(node.test):
            return
        self._points_of(node, parent)
        for child in ast.iter_child_nodes(node):
            self.visit(child, node)

    def _points_of(self, node: ast.AST, parent: ast.AST | None) -> None:
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                flipped = _COMPARE.get(type(op))
                if flipped is not None:
                    self.add("cmp", node, f"{_SYMBOL[type(op)]} -> {_SYMBOL[flipped]}", i)
        elif isinstance(node, ast.BoolOp):
            own, swap = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            self.add("boolop", node, f"{own} -> {swap}")
            for i in range(len(node.values)):
                self.add("drop-operand", node, f"operand {i + 1} of the {own} dropped", i)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self.add("not", node, "not removed")
        elif isinstance(node, ast.Constant) and not _is_docstring(node, parent):
            value = node.value
            if isinstance(value, bool):
                self.add("const", node, f"{value} -> {not value}")
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                self.add("const", node, f"{value} -> {value + 1}", 0)
                self.add("const", node, f"{value} -> {value - 1}", 1)
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in _MINMAX:
                self.add("minmax", node, f"{node.func.id} -> {_MINMAX[node.func.id]}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            if not (_textual(node.left) or _textual(node.right)):
                sign = "+" if isinstance(node.op, ast.Add) else "-"
                self.add("arith", node, f"'{sign} term' dropped", 0)
                other = "-" if sign == "+" else "+"
                self.add("arith", node, f"{sign} -> {other}", 1)
        elif isinstance(node, ast.If):
            # "-> True" is left out: the comparison flips and ``not`` removal reach the same
            # faults at half the cost
            self.add("if", node, "condition -> False (branch deleted)", 0)
        elif isinstance(node, ast.Return) and not _returns_none(node):
            self.add("return", node, "returns None")


def _returns_none(node: ast.Return) -> bool:
    value = node.value
    return value is None or (isinstance(value, ast.Constant) and value.value is None)


def _type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _points(tree: ast.Module) -> list[_Point]:
    finder = _Finder()
    for node in tree.body:
        finder.visit(node, tree)
    return finder.points


def _named(module: str, points: list[_Point]) -> Iterator[tuple[Mutant, _Point]]:
    seen: dict[tuple[str, str], int] = {}
    for point in points:
        key = (point.scope, point.operator)
        ordinal = seen.get(key, 0)
        seen[key] = ordinal + 1
        yield Mutant(module, point.scope, point.operator, ordinal, point.line, point.change), point


def mutants_of(module: str, source: str) -> list[Mutant]:
    """Every mutant of one module's source, in source order."""
    return [mutant for mutant, _ in _named(module, _points(ast.parse(source)))]


class UnknownMutantError(LookupError):
    """The mutant named is not in this source (the code moved, or the name is wrong)."""


def mutate(source: str, mutant: Mutant) -> str:
    """The module's source with this one mutant applied."""
    tree = ast.parse(source)
    for named, point in _named(mutant.module, _points(tree)):
        if named.id == mutant.id:
            _apply(tree, point)
            return ast.unparse(ast.fix_missing_locations(tree)) + "\n"
    raise UnknownMutantError(mutant.id)


def _apply(tree: ast.Module, point: _Point) -> None:
    node = point.node
    if isinstance(node, ast.Compare):
        node.ops[point.variant] = _COMPARE[type(node.ops[point.variant])]()
    elif isinstance(node, ast.BoolOp):
        if point.operator == "boolop":
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        else:
            del node.values[point.variant]
            if len(node.values) == 1:
                _replace(tree, node, node.values[0])
    elif isinstance(node, ast.UnaryOp):
        _replace(tree, node, node.operand)
    elif isinstance(node, ast.Constant):
        if isinstance(node.value, bool):
            node.value = not node.value
        else:
            node.value = node.value + (1 if point.variant == 0 else -1)
    elif isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        node.func.id = _MINMAX[node.func.id]
    elif isinstance(node, ast.BinOp):
        if point.variant == 0:
            _replace(tree, node, node.left)
        else:
            node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
    elif isinstance(node, ast.If):
        node.test = ast.Constant(value=point.variant == 1)
    elif isinstance(node, ast.Return):
        node.value = ast.Constant(value=None)


def _replace(tree: ast.Module, old: ast.AST, new: ast.AST) -> None:
    """Put ``new`` where ``old`` is in its parent (``old`` is an expression)."""
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(item is old for item in value):
                value[[id(item) for item in value].index(id(old))] = new
                return
    raise AssertionError("node not found in its tree")
