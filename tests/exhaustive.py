"""The exhaustive sweeps: long differential runs whose results tables live in the docs.

The README's suite keeps to its time budget with a shorter run of each (in the quick subset);
``FUNCAMP_TEST_EXHAUSTIVE=1`` adds the long ones (every OpInfo sample under every transform, the
600-step float16 scaling runs, the 150-step accumulation runs) and the grids the whole suite
samples (every configuration of torch's optimizer database compiled, every model, transform and
order of tests/test_func_transforms.py compiled).
"""

import os

import pytest

ON = os.environ.get("FUNCAMP_TEST_EXHAUSTIVE") == "1"

exhaustive = pytest.mark.skipif(
    not ON, reason="an exhaustive sweep: FUNCAMP_TEST_EXHAUSTIVE=1 runs it"
)
