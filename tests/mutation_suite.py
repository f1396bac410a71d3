"""A mutation suite for funcamp.testing: seeded mixed-precision bugs, one property each.

Each :class:`Mutant` is a small function users write around mixed precision (a softmax, a loss
scaler's update, an FP8 round trip...) in a correct and a buggy version, and one property, written
as docs/guides/property-testing.md teaches, that the correct version satisfies. The property runs
with two families of strategies:

* ``"funcamp"``: :func:`funcamp.testing.tensors` and :func:`funcamp.testing.scaler_states`;
* ``"stock"``: what a user writes with Hypothesis alone, ``hypothesis.extra.numpy.arrays`` of
  ``st.floats`` with the same bounds (float32 arrays rounded for bfloat16), and
  ``st.builds(ScalerState.dynamic, ...)`` over the same ranges.

A run *catches* a bug when the property fails on the buggy version; a failure on the correct
version is a false alarm. tests/test_mutations.py runs the suite (a short run by default, the full
three seeds of 200 examples with ``FUNCAMP_TEST_EXHAUSTIVE=1``); benchmarks/mutations.py prints
the table of docs/benchmarks.md. The mutants themselves live in tests/mutants.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.extra.numpy import arrays

import funcamp
from funcamp.testing import scaler_states, tensors

FAMILIES = ("funcamp", "stock")

_NUMPY = {
    torch.float16: (np.float16, 16),
    torch.bfloat16: (np.float32, 32),  # numpy has no bfloat16: float32, rounded by torch
    torch.float32: (np.float32, 32),
    torch.float64: (np.float64, 64),
}


def tensor(family: str, dtype: torch.dtype, shape: Any, **bounds: Any) -> st.SearchStrategy:
    """Tensors of ``dtype`` and ``shape`` (a tuple or a strategy) within ``bounds`` (the
    keyword arguments both ``tensors`` and ``st.floats`` take)."""
    if family == "funcamp":
        return tensors(dtype=dtype, shape=shape, **bounds)
    np_dtype, width = _NUMPY[dtype]
    elements = st.floats(width=width, **bounds)
    return arrays(np_dtype, shape, elements=elements).map(lambda a: torch.from_numpy(a).to(dtype))


def vectors(lo: int, hi: int) -> st.SearchStrategy[tuple[int]]:
    """1-d shapes of ``lo``..``hi`` elements (one strategy, shared by both families)."""
    return st.integers(lo, hi).map(lambda n: (n,))


def dynamic_scalers(
    family: str, scale: tuple[float, float], growth_interval: tuple[int, int]
) -> st.SearchStrategy[funcamp.ScalerState]:
    """Dynamic scaler states with torch's hysteresis of 1, over the same ranges."""
    if family == "funcamp":
        return scaler_states(
            ("dynamic",), scale=scale, growth_interval=growth_interval, hysteresis=(1, 1)
        )
    return st.builds(
        funcamp.ScalerState.dynamic,
        init_scale=st.floats(*scale, width=32),
        growth_interval=st.integers(*growth_interval),
    )


def loss_scalers(family: str, lo: float, hi: float) -> st.SearchStrategy[funcamp.ScalerState]:
    """Scaler states whose scale lies in ``[lo, hi]``."""
    if family == "funcamp":
        return scaler_states(("dynamic", "static"), scale=(lo, hi))
    return st.builds(funcamp.ScalerState.dynamic, init_scale=st.floats(lo, hi, width=32))


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A function in a correct and a buggy version, and the property that tells them apart."""

    name: str
    #: the bug, in a few words
    bug: str
    correct: Callable[..., Any]
    buggy: Callable[..., Any]
    #: ``check(impl, **drawn)`` raises (an AssertionError) when ``impl`` breaks the property
    check: Callable[..., None]
    #: ``strategies(family)``: the keyword strategies of the property
    strategies: Callable[[str], dict[str, st.SearchStrategy]]


@dataclasses.dataclass(frozen=True)
class Run:
    """One property run: did it fail, after how many examples, in how long."""

    failed: bool
    examples: int
    seconds: float
    error: str = ""


F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS32 = torch.finfo(F32).eps
FINITE = {"allow_nan": False, "allow_infinity": False}


def registrar(into: list[Mutant]) -> Callable[..., Callable]:
    """``mutant(name, bug, correct, buggy, strategies)``: a decorator that adds the decorated
    property to ``into`` as a :class:`Mutant`."""

    def mutant(name: str, bug: str, correct, buggy, strategies):
        def register(check):
            into.append(Mutant(name, bug, correct, buggy, check, strategies))
            return check

        return register

    return mutant


def close(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor | float) -> None:
    """Assert ``|actual - expected| <= tol`` elementwise, ``actual`` finite (in float64). The
    tolerance gets ``2**-140`` more: float32 arithmetic among subnormals rounds to ``2**-149``."""
    a, e = actual.double(), expected.double()
    assert bool(torch.isfinite(a).all()), f"not finite: {actual}"
    err = (a - e).abs()
    assert bool((err <= tol + 2.0**-140).all()), f"max error {float(err.max()):.3g} over tolerance"


def run(mutant: Mutant, impl: Callable[..., Any], family: str, seed: int, examples: int) -> Run:
    """Run ``mutant``'s property on ``impl`` with ``family``'s strategies: ``examples`` examples
    at most, generation only (no shrinking), Hypothesis's health checks on."""
    count = [0]
    first_failure: list[int] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        verbosity=Verbosity.quiet,
        suppress_health_check=[HealthCheck.too_slow],  # the machine's load, not the data
        print_blob=False,
    )
    @hypothesis_seed(seed)
    @given(**mutant.strategies(family))
    def prop(**drawn: Any) -> None:
        count[0] += 1
        try:
            mutant.check(impl, **drawn)
        except Exception:
            if not first_failure:
                first_failure.append(count[0])
            raise

    start = time.perf_counter()
    try:
        prop()
    except HypothesisException:
        raise  # a health check or an unsatisfiable strategy: the harness's failure, not a catch
    except Exception as e:
        seconds = time.perf_counter() - start
        return Run(True, first_failure[0] if first_failure else count[0], seconds, repr(e)[:200])
    return Run(False, count[0], time.perf_counter() - start)
