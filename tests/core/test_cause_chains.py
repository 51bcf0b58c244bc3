"""A failure's cause chain (a dependent's error names the failure it follows from, through
``__cause__``): marking a failure retrieved marks its causes, and asking whether it was
retrieved asks them; both walk at most 64 links, and stop at a cycle."""
from __future__ import annotations

from aiogpu._core.futures import cause_chain, mark_retrieved, was_retrieved
from aiogpu.errors import GPUError


def chain_of(n: int) -> list[BaseException]:
    errors = [GPUError(f"e{i}") for i in range(n)]
    for e, cause in zip(errors, errors[1:]):
        e.__cause__ = cause
    return errors


def test_marking_a_failure_retrieved_marks_its_causes():
    errors = chain_of(3)
    assert not was_retrieved(errors[0])
    mark_retrieved(errors[0])
    assert all(was_retrieved(e) for e in errors)


def test_a_failure_whose_cause_was_retrieved_counts_as_retrieved():
    errors = chain_of(3)
    mark_retrieved(errors[2])
    assert was_retrieved(errors[0]) and not getattr(errors[0], "_aiogpu_retrieved", False)


def test_the_walk_stops_after_64_links():
    errors = chain_of(70)
    assert cause_chain(errors[0]) == errors[:64]
    mark_retrieved(errors[0])
    assert getattr(errors[63], "_aiogpu_retrieved", False)
    assert not getattr(errors[64], "_aiogpu_retrieved", False)


def test_the_walk_stops_at_a_cycle():
    a, b = GPUError("a"), GPUError("b")
    a.__cause__, b.__cause__ = b, a
    assert cause_chain(a) == [a, b]
