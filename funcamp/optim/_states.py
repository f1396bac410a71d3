"""The optimizers' states: NamedTuples of tensors (no ``None`` leaves), one per algorithm."""

from __future__ import annotations

from typing import NamedTuple

import torch

from funcamp._core.tree import PyTree


class SgdState(NamedTuple):
    """State of :func:`funcamp.sgd`.

    Attributes:
        count: 0-d int32, the updates applied so far.
        momentum: a params-shaped tree of buffers, or ``()`` without momentum.
        low: a low-precision mode's state, or ``()``.

    Example:
        >>> import torch, funcamp
        >>> funcamp.sgd(0.1).init({"w": torch.ones(2)})
        SgdState(count=tensor(0, dtype=torch.int32), momentum=(), low=())
    """

    count: torch.Tensor
    momentum: PyTree
    low: PyTree


class AdamState(NamedTuple):
    """State of :func:`funcamp.adam`/:func:`funcamp.adamw` (and :func:`funcamp.scale_by_amsgrad`).

    Attributes:
        count: 0-d int32, the updates applied so far.
        exp_avg: params-shaped tree, float32 for half params.
        exp_avg_sq: params-shaped tree, float32 for half params.
        max_exp_avg_sq: with ``amsgrad=True``, the running maximum of ``exp_avg_sq``
            (torch.optim's ``state["max_exp_avg_sq"]``); ``()`` otherwise. It defaults to
            ``()``, so older checkpoints without it still load (:func:`funcamp.load`).
        low: a low-precision mode's state, or ``()``.

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
    """State of :func:`funcamp.lion`.

    Attributes:
        count: 0-d int32, the updates applied so far.
        exp_avg: params-shaped, float32 for half params.
        low: a low-precision mode's state, or ``()``.

    Example:
        >>> import torch, funcamp
        >>> funcamp.lion(0.1).init({"w": torch.ones(1)}).exp_avg
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    exp_avg: PyTree
    low: PyTree


class RmspropState(NamedTuple):
    """State of :func:`funcamp.rmsprop`: torch.optim.RMSprop's per-param state of the same names.

    The fields are ``count``, ``square_avg``, ``momentum_buffer``, ``grad_avg`` and ``low``.
    ``momentum_buffer`` is ``()`` unless ``momentum > 0``. ``grad_avg`` is ``()`` unless
    ``centered=True``.

    Example:
        >>> import torch, funcamp
        >>> funcamp.rmsprop(0.01).init({"w": torch.ones(1)}).square_avg
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    square_avg: PyTree
    momentum_buffer: PyTree
    grad_avg: PyTree
    low: PyTree


class AdagradState(NamedTuple):
    """State of :func:`funcamp.adagrad`: ``count``, ``sum`` (starting at
    ``initial_accumulator_value``) and ``low``.

    Example:
        >>> import torch, funcamp
        >>> funcamp.adagrad(0.01, initial_accumulator_value=0.1).init({"w": torch.ones(1)}).sum
        {'w': tensor([0.1000])}
    """

    count: torch.Tensor
    sum: PyTree
    low: PyTree


class AdadeltaState(NamedTuple):
    """State of :func:`funcamp.adadelta`: ``count``, ``square_avg``, ``acc_delta`` and ``low``.

    Example:
        >>> import torch, funcamp
        >>> funcamp.adadelta().init({"w": torch.ones(1)}).acc_delta
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    square_avg: PyTree
    acc_delta: PyTree
    low: PyTree


class AdamaxState(NamedTuple):
    """State of :func:`funcamp.adamax`: ``count``, ``exp_avg``, ``exp_inf`` and ``low``.

    Example:
        >>> import torch, funcamp
        >>> funcamp.adamax(0.002).init({"w": torch.ones(1)}).exp_inf
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    exp_avg: PyTree
    exp_inf: PyTree
    low: PyTree


class NadamState(NamedTuple):
    """State of :func:`funcamp.nadam`: ``count``, ``exp_avg``, ``exp_avg_sq``, ``mu_product``
    and ``low``.

    ``mu_product`` is a 0-d float32 tensor, the product of the momentum coefficients so far.
    (torch.optim.NAdam keeps one per param, all equal.)

    Example:
        >>> import torch, funcamp
        >>> funcamp.nadam(0.002).init({"w": torch.ones(1)}).mu_product
        tensor(1.)
    """

    count: torch.Tensor
    exp_avg: PyTree
    exp_avg_sq: PyTree
    mu_product: torch.Tensor
    low: PyTree


class RadamState(NamedTuple):
    """State of :func:`funcamp.radam`: ``count``, ``exp_avg``, ``exp_avg_sq`` and ``low``.

    Example:
        >>> import torch, funcamp
        >>> funcamp.radam(0.001).init({"w": torch.ones(1)}).exp_avg
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    exp_avg: PyTree
    exp_avg_sq: PyTree
    low: PyTree


class AsgdState(NamedTuple):
    """State of :func:`funcamp.asgd`: ``count``, ``ax`` (the averaged params) and ``low``.
    torch.optim.ASGD's ``eta`` and ``mu`` are functions of the step count, computed each step.

    Example:
        >>> import torch, funcamp
        >>> funcamp.asgd(0.01).init({"w": torch.ones(1)}).ax
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    ax: PyTree
    low: PyTree


class RpropState(NamedTuple):
    """State of :func:`funcamp.rprop`: ``count``, ``prev``, ``step_size`` and ``low``.

    ``prev`` is the previous step's gradient, zero where its sign flipped. ``step_size`` is per
    element. It is zero before the first step, which starts it at the learning rate.

    Example:
        >>> import torch, funcamp
        >>> funcamp.rprop(0.01).init({"w": torch.ones(1)}).step_size
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    prev: PyTree
    step_size: PyTree
    low: PyTree


class MuonState(NamedTuple):
    """State of :func:`funcamp.muon`: ``count``, ``momentum_buffer`` and ``low``.

    Example:
        >>> import torch, funcamp
        >>> funcamp.muon(0.01).init({"w": torch.ones(1, 2)}).momentum_buffer
        {'w': tensor([[0., 0.]])}
    """

    count: torch.Tensor
    momentum_buffer: PyTree
    low: PyTree


class AdafactorState(NamedTuple):
    """State of :func:`funcamp.adafactor`.

    Attributes:
        count: 0-d int32, the updates applied so far.
        row_var: the factored second moment of a param with two or more dimensions: its shape
            with the last dimension 1.
        col_var: the same with the second-to-last dimension 1.
        variance: the whole second moment of a vector.
        low: a low-precision mode's state, or ``()``.

    A field is an empty tensor, shape ``(0,)``, where torch.optim.Adafactor keeps no such entry.

    Example:
        >>> import torch, funcamp
        >>> funcamp.adafactor().init({"b": torch.ones(2)}).row_var
        {'b': tensor([])}
    """

    count: torch.Tensor
    row_var: PyTree
    col_var: PyTree
    variance: PyTree
    low: PyTree


class LbfgsState(NamedTuple):
    """State of :func:`funcamp.lbfgs`: torch.optim.LBFGS's state as tensors.

    Vectors are over the params' concatenation. ``count`` is the updates so far. ``func_evals``
    and ``n_iter`` are torch's counters (int64). ``d`` and ``t`` are the last direction and step
    size. ``old_dirs``/``old_stps``/``ro`` are the curvature history: its first ``history``
    rows, oldest first. Then come ``h_diag``, ``prev_flat_grad`` and ``prev_loss``. ``loss`` is
    the loss at the params the last update started from.

    Example:
        >>> import torch, funcamp
        >>> funcamp.lbfgs(history_size=3).init({"w": torch.ones(2)}).old_dirs.shape
        torch.Size([3, 2])
    """

    count: torch.Tensor
    func_evals: torch.Tensor
    n_iter: torch.Tensor
    d: torch.Tensor
    t: torch.Tensor
    old_dirs: torch.Tensor
    old_stps: torch.Tensor
    ro: torch.Tensor
    history: torch.Tensor
    h_diag: torch.Tensor
    prev_flat_grad: torch.Tensor
    prev_loss: torch.Tensor
    loss: torch.Tensor
