"""Hypothesis strategies and pytree assertions for property-testing mixed-precision code.

Install the extra to use it: ``pip install "funcamp[testing]"`` (it brings Hypothesis).

Strategies:

* :func:`float_dtypes`: the floating dtypes funcamp works with.
* :func:`policies`: :class:`funcamp.Policy` values, with op and module overrides.
* :func:`tensors`: tensors that stress mixed precision. Their elements mix arbitrary values
  with the dtype's :func:`special_values` (``±inf``, ``nan``, ``±0``, subnormals, its max...)
  and the :func:`boundary_values` of the lower-precision dtypes code casts to (float16's max and
  rounding band, its subnormals, bfloat16's max, float8's 448 and 57344...). They come as
  structured fills (one value repeated, clusters, ramps) and, now and then, long vectors.
* :func:`pytrees`: nested dicts, lists, tuples and NamedTuples (empty containers and ``None``
  included) of tensor leaves.
* :func:`scaler_states`: :class:`funcamp.ScalerState` values of every kind, with random valid
  configuration and leaves, their scale and counters within the bounds asked for.

Assertions :func:`assert_trees_equal` and :func:`assert_trees_close` compare two pytrees. On
failure they name the leaf path that differs, and show the largest absolute and relative error.

Example:
    >>> import torch, funcamp
    >>> from hypothesis import given
    >>> from funcamp.testing import tensors
    >>> @given(tensors(dtype=torch.bfloat16, allow_nan=False, allow_infinity=False))
    ... def test_cast_roundtrip(x):
    ...     assert torch.equal(x.float().bfloat16(), x)
    >>> test_cast_roundtrip()
"""

from funcamp.testing._values import (
    LOW_PRECISION_DTYPES as LOW_PRECISION_DTYPES,
)
from funcamp.testing._values import boundary_values, special_values
from funcamp.testing.assertions import assert_trees_close, assert_trees_equal
from funcamp.testing.scalers import scaler_states
from funcamp.testing.strategies import (
    FLOAT_DTYPES as FLOAT_DTYPES,
)
from funcamp.testing.strategies import (
    Node,
    float_dtypes,
    policies,
    pytrees,
    tensors,
)

__all__ = [
    "Node",
    "assert_trees_close",
    "assert_trees_equal",
    "boundary_values",
    "float_dtypes",
    "policies",
    "pytrees",
    "scaler_states",
    "special_values",
    "tensors",
]
