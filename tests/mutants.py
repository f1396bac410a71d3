"""Every mutant of the mutation suite (tests/mutation_suite.py): the numerics ones
(tests/mutants_numerics.py), then the training ones (tests/mutants_training.py)."""

import mutants_numerics
import mutants_training

MUTANTS = [*mutants_numerics.MUTANTS, *mutants_training.MUTANTS]
