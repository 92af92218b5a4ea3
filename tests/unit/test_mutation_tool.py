"""The mutation suite's own tool (tests/mutation): its mutants change what they say, keep their
names when other code moves, and the CI sample is the same every run."""

from __future__ import annotations

import ast

import pytest

from tests.mutation.__main__ import every_mutant, sample
from tests.mutation.equivalent import EQUIVALENT
from tests.mutation.operators import UnknownMutantError, mutants_of, mutate
from tests.mutation.targets import TARGETS

SOURCE = '''
def bound(a, b, until):
    """Docstrings are not mutated."""
    if a < b and not until:
        return min(a, b + 1)
    return True
'''


def _by_operator(source: str) -> dict[str, str]:
    return {m.id.split("::")[-1]: mutate(source, m) for m in mutants_of("m.py", source)}


def test_each_operator_changes_what_it_names() -> None:
    mutated = _by_operator(SOURCE)
    assert "a <= b" in mutated["cmp#0"]
    assert "a < b or not until" in mutated["boolop#0"]
    assert "if not until:" in mutated["drop-operand#0"]
    assert "if a < b:" in mutated["drop-operand#1"]
    assert "a < b and until" in mutated["not#0"]
    assert "max(a, b + 1)" in mutated["minmax#0"]
    assert "min(a, b)" in mutated["arith#0"]
    assert "b - 1" in mutated["arith#1"]
    assert "b + 2" in mutated["const#0"] and "b + 0" in mutated["const#1"]
    assert "return False" in mutated["const#2"]
    assert "if False:" in mutated["if#0"]
    assert "return None" in mutated["return#0"]
    assert all("Docstrings are not mutated." in text for text in mutated.values())
    for text in mutated.values():
        ast.parse(text)  # every mutant is valid Python


def test_names_survive_an_edit_elsewhere_in_the_module() -> None:
    before = {m.id: m.change for m in mutants_of("m.py", SOURCE)}
    edited = "def other(x):\n    return x > 1\n\n" + SOURCE
    after = {m.id: m.change for m in mutants_of("m.py", edited)}
    assert before.items() <= after.items()


def test_a_mutant_not_in_the_source_is_refused() -> None:
    mutant = mutants_of("m.py", SOURCE)[0]
    with pytest.raises(UnknownMutantError):
        mutate("def bound():\n    return 1\n", mutant)


def test_the_ci_sample_is_fixed_and_draws_no_equivalent_mutant() -> None:
    mutants = every_mutant(target.module for target in TARGETS)
    first = sample(mutants, 4)
    assert first == sample(list(reversed(mutants)), 4)
    assert {m.module for m in first} == {target.module for target in TARGETS}
    assert not {m.id for m in first} & EQUIVALENT.keys()


def test_every_equivalent_mutant_exists_and_says_why() -> None:
    names = {m.id for m in every_mutant(target.module for target in TARGETS)}
    assert EQUIVALENT.keys() <= names
    assert all(len(reason) > 20 for reason in EQUIVALENT.values())
