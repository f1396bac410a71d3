"""torch.optim.ASGD: its algorithm (the for-loop step and the foreach one, which rounds
otherwise), written once with :func:`funcamp.optim.elementwise`. The averaging switch is a
``where`` selection on the step count: no host sync, no branch on a tensor's value."""

from __future__ import annotations

from typing import Any

import torch

from funcamp._core.checks import check_flag, check_number
from funcamp.optim._base import NewParams, Optimizer
from funcamp.optim._paths import Ops
from funcamp.optim._shared import (
    LearningRate,
    LowPrecision,
    Tensors,
    _build,
    _f64,
    _kept,
    _prologue,
)
from funcamp.optim._states import AsgdState

__all__ = ["asgd"]


def _asgd_step(
    lambd: float, alpha: float, t0: float, weight_decay: float, maximize: bool, foreach: bool
) -> Any:
    def step(ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any) -> Any:
        # torch.optim.ASGD, before the step `step`: eta = lr / (1 + lambd * lr * (step -
        # 1))**alpha and mu = 1 / max(1, step - 1 - t0) (1 on the first step), each a float32
        # tensor; p.mul_(1 - lambd * eta); p.add_(grad, alpha=-eta); ax.add_(p.sub(ax).mul_(mu))
        # where mu != 1, else ax.copy_(p).
        g = _prologue(ops, g, p, maximize, weight_decay)
        lr64 = _f64(lr)
        c = count.to(torch.float64)
        mu = torch.where(count == 0, torch.ones_like(c), 1.0 / torch.clamp(c - t0, min=1.0)).to(
            torch.float32
        )
        ax = buffers["ax"]
        if foreach:
            return _asgd_foreach(ops, g, p, ax, buffers, lambd, alpha, lr64, count, mu)
        eta = (lr64 / torch.pow(1.0 + lambd * lr64 * c, alpha)).to(torch.float32)
        eta = eta.to(torch.float64)
        new_p = ops.mul(p, ops.scalar(1.0 - lambd * eta))
        new_p = ops.fma(g, ops.scalar(-eta), new_p, into=new_p)
        averaged = ops.add(ops.mul(ops.sub(new_p, ax), mu), ax)
        ax = ops.where(mu == 1.0, new_p, averaged)
        return NewParams(new_p), _kept(ops, buffers, ax=ax)

    return step


def _asgd_foreach(
    ops: Ops,
    g: Tensors,
    p: Tensors,
    ax: Tensors,
    buffers: dict,
    lambd: float,
    alpha: float,
    lr64: Any,
    count: torch.Tensor,
    mu: torch.Tensor,
) -> Any:
    """torch.optim's ``_multi_tensor_asgd`` (CPU, not capturable): ``eta`` is float32 tensor
    math on the float32 step, ``lr / (1 + lambd * lr * step)**alpha`` (``lr / x`` is
    ``x.reciprocal() * lr``; Python scalars rounded to float32); ``p.addcmul_(grad + lambd * p,
    eta, value=-1)``; ``ax.addcmul_(p - ax, mu)``, also where ``mu`` is 1."""
    steps = count.to(torch.float32)  # 0 on the first step: eta = float32(lr)
    k = torch.as_tensor(lambd * lr64, dtype=torch.float64).to(torch.float32)
    lr32 = torch.as_tensor(lr64, dtype=torch.float64).to(torch.float32)
    eta = torch.reciprocal(torch.pow(1.0 + k.to(steps.device) * steps, alpha)) * lr32.to(
        steps.device
    )
    intermediate = ops.fma(p, lambd, g, into=g)
    new_p = ops.fma(intermediate, ops.scalar(-eta), p, into=ops.target(p))
    averaged = ops.fma(ops.sub(new_p, ax), ops.scalar(mu), ax, into=ops.target(ax))
    return NewParams(new_p), _kept(ops, buffers, ax=averaged)


def asgd(
    learning_rate: LearningRate,
    lambd: float = 1e-4,
    alpha: float = 0.75,
    t0: float = 1e6,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> Optimizer:
    """Averaged SGD with torch.optim.ASGD's semantics: SGD with the step size
    ``eta = lr / (1 + lambd * lr * count)**alpha`` and the decay ``p *= 1 - lambd * eta``, and
    the running average of the params from step ``t0`` on in the state's ``ax``.

    torch.optim keeps ``eta`` and ``mu`` in its state; here they are functions of the step
    count (with a schedule, ``eta`` uses this step's learning rate; torch's uses the previous
    step's).

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr``.
        lambd: decay term (>= 0).
        alpha: power of the ``eta`` update (>= 0).
        t0: the step from which the params are averaged (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0).
        maximize: ascend the objective (the gradients are negated first).
        foreach: True gives the numbers of torch's foreach step (``foreach=True``); None or
            False those of its for-loop step (torch's default on the CPU).
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.AsgdState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.asgd(0.5, lambd=0.0)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates), state.ax
        ({'w': tensor([-0.5000,  1.0000])}, {'w': tensor([-0.5000,  1.0000])})
    """
    api = "asgd"
    check_flag(api, "maximize", maximize)
    lambd = check_number(api, "lambd", lambd)
    alpha = check_number(api, "alpha", alpha)
    t0 = check_number(api, "t0", t0)
    weight_decay = check_number(api, "weight_decay", weight_decay)
    if foreach is not None:
        check_flag(api, "foreach", foreach)
    step = _asgd_step(lambd, alpha, t0, weight_decay, maximize, bool(foreach))
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    return _build(api, AsgdState, step, learning_rate, modes, needs_params=True)
