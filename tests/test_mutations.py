"""The mutation suite (tests/mutants.py): funcamp.testing's strategies catch every seeded
mixed-precision bug, and no property fails on the correct code.

By default each mutant runs one seed: its bug must be caught within 200 examples, and its correct
version must pass 50. ``FUNCAMP_TEST_EXHAUSTIVE=1`` runs the measurement of docs/benchmarks.md:
three seeds of 200 examples each, funcamp.testing's strategies and stock Hypothesis's, every
bug caught on every seed by funcamp's, no false alarm from either, and no bug caught on fewer
seeds by funcamp's than by stock's (benchmarks/mutations.py prints the table).
"""

from __future__ import annotations

import pytest

pytest.importorskip("numpy")  # the stock strategies are hypothesis.extra.numpy's

from exhaustive import exhaustive
from mutants import MUTANTS
from mutation_suite import FAMILIES, run

IDS = [m.name for m in MUTANTS]


def test_the_suite_has_twenty_distinct_bugs():
    assert len(MUTANTS) >= 20
    assert len(set(IDS)) == len(IDS)
    assert all(m.buggy is not m.correct for m in MUTANTS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=IDS)
def test_funcamp_strategies_catch_the_bug_without_false_alarms(mutant):
    bug = run(mutant, mutant.buggy, "funcamp", seed=0, examples=200)
    assert bug.failed, f"{mutant.name}: the bug survived 200 examples"
    ok = run(mutant, mutant.correct, "funcamp", seed=0, examples=50)
    assert not ok.failed, f"{mutant.name}: false alarm on the correct code: {ok.error}"


@exhaustive
@pytest.mark.parametrize("mutant", MUTANTS, ids=IDS)
def test_funcamp_catches_every_bug_on_three_seeds_and_no_fewer_than_stock(mutant):
    caught = {family: 0 for family in FAMILIES}
    for seed in range(3):
        for family in FAMILIES:
            caught[family] += run(mutant, mutant.buggy, family, seed, 200).failed
            ok = run(mutant, mutant.correct, family, seed, 200)
            assert not ok.failed, f"{family} seed {seed}: false alarm: {ok.error}"
    assert caught["funcamp"] == 3, caught
    assert caught["funcamp"] >= caught["stock"], caught
