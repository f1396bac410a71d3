"""Bit-for-bit comparison of pytrees, for the tests that hold two runs to the same bits."""

from __future__ import annotations

from typing import Any

import optree
import torch

from funcamp.testing import assert_trees_equal

#: The optree namespace funcamp documents for its state types (docs/concepts.md).
NAMESPACE = "funcamp"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two tensors of one dtype and shape with the same bytes (``-0.0`` is not ``0.0``, a NaN
    equals the same NaN) -- what ``torch.equal`` does not check."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8),
        b.detach().contiguous().reshape(-1).view(torch.uint8),
    )


def assert_bitwise(actual: Any, expected: Any) -> None:
    """:func:`funcamp.testing.assert_trees_equal` (structure, shapes, dtypes, values), then the
    bytes of every tensor leaf: ``-0.0`` differs from ``0.0``, and NaN payloads count."""
    assert_trees_equal(actual, expected)
    paths, leaves, _ = optree.tree_flatten_with_path(actual, namespace=NAMESPACE)
    for path, x, y in zip(paths, leaves, optree.tree_leaves(expected, namespace=NAMESPACE)):
        if isinstance(x, torch.Tensor):
            assert same_bits(x, y), f"leaf {path} differs in its bits"
