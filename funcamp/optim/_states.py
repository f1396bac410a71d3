"""The optimizers' states: NamedTuples of tensors (no ``None`` leaves), one per algorithm."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["AdamState", "LionState", "SgdState"]

PyTree = Any


class SgdState(NamedTuple):
    """State of :func:`funcamp.sgd`: ``count`` (0-d int32), ``momentum`` (a params-shaped tree
    of buffers, or ``()`` without momentum) and ``low`` (a low-precision mode's state or ``()``).

    Example:
        >>> import torch, funcamp
        >>> funcamp.sgd(0.1).init({"w": torch.ones(2)})
        SgdState(count=tensor(0, dtype=torch.int32), momentum=(), low=())
    """

    count: torch.Tensor
    momentum: PyTree
    low: PyTree


class AdamState(NamedTuple):
    """State of :func:`funcamp.adam`/:func:`funcamp.adamw` (and :func:`funcamp.scale_by_amsgrad`):
    ``count`` (0-d int32), ``exp_avg`` and ``exp_avg_sq`` (params-shaped trees, float32 for half
    params), ``max_exp_avg_sq`` (with ``amsgrad=True``: the running maximum of ``exp_avg_sq``,
    params-shaped like it, torch.optim's ``state["max_exp_avg_sq"]``; ``()`` otherwise) and
    ``low`` (a mode's state or ``()``).

    ``max_exp_avg_sq`` came after the first releases: it has a default, ``()``, so checkpoints
    of an optimizer without ``amsgrad`` written before it still load (:func:`funcamp.load`).

    Example:
        >>> import torch, funcamp
        >>> funcamp.adam(0.1).init({"w": torch.ones(1)}).exp_avg_sq
        {'w': tensor([0.])}
        >>> funcamp.adam(0.1).init({"w": torch.ones(1)}).max_exp_avg_sq
        ()
        >>> funcamp.adam(0.1, amsgrad=True).init({"w": torch.ones(1)}).max_exp_avg_sq
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    exp_avg: PyTree
    exp_avg_sq: PyTree
    max_exp_avg_sq: PyTree = ()
    low: PyTree = ()


class LionState(NamedTuple):
    """State of :func:`funcamp.lion`: ``count`` (0-d int32), ``exp_avg`` (params-shaped, float32
    for half params) and ``low`` (a mode's state or ``()``).

    Example:
        >>> import torch, funcamp
        >>> funcamp.lion(0.1).init({"w": torch.ones(1)}).exp_avg
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    exp_avg: PyTree
    low: PyTree
