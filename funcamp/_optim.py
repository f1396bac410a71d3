"""Functional optimizers in optax's shape: ``init(params) -> state``, ``update(grads, state, params)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from funcamp._tree import NAMESPACE

__all__ = ["Optimizer", "apply_updates", "sgd"]

PyTree = Any


class Optimizer(NamedTuple):
    """A pair of pure functions: ``init(params) -> state`` and
    ``update(grads, state, params) -> (updates, state)``.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.sgd(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([0.9000, 0.9000])}
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """Return ``params + updates`` leaf-wise, adding in float32 and rounding once into each
    param's dtype.

    Example:
        >>> import torch, funcamp
        >>> funcamp.apply_updates({"w": torch.zeros(2)}, {"w": torch.ones(2)})
        {'w': tensor([1., 1.])}
    """

    def add(p: Any, u: Any) -> Any:
        if not isinstance(p, torch.Tensor):
            return p
        if p.dtype in (torch.float16, torch.bfloat16):
            return (p.float() + u.float()).to(p.dtype)
        return p + u.to(p.dtype)

    return optree.tree_map(add, params, updates, namespace=NAMESPACE)


def sgd(learning_rate: float) -> Optimizer:
    """Plain stochastic gradient descent: ``update = -learning_rate * grad``.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.sgd(0.5)
        >>> updates, _ = opt.update({"w": torch.ones(1)}, opt.init({}), None)
        >>> updates
        {'w': tensor([-0.5000])}
    """

    def init(params: PyTree) -> PyTree:
        return ()

    def update(grads: PyTree, state: PyTree, params: PyTree = None) -> tuple[PyTree, PyTree]:
        updates = optree.tree_map(lambda g: -learning_rate * g, grads, namespace=NAMESPACE)
        return updates, state

    return Optimizer(init, update)
