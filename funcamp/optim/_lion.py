"""Lion (Chen et al., 2023; torch has no twin: lion-pytorch's and optax's numbers), written
once with the same building blocks as the torch.optim optimizers of ``_optimizers``."""

from __future__ import annotations

from typing import Any

from funcamp._core.checks import check_number
from funcamp.optim._base import NewParams, Optimizer
from funcamp.optim._optimizers import LearningRate, Mask, Tensors, _added, _decayed, _merge, _pick
from funcamp.optim._paths import Ops
from funcamp.optim._shared import LowPrecision, _build, _f64
from funcamp.optim._states import LionState

__all__ = ["LionState", "lion"]


def _lion_step(b1: float, b2: float, weight_decay: float) -> Any:
    def step(
        ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any, mask: Any = None
    ) -> Any:
        # Chen et al. 2023, Program 1, with decoupled weight decay done as torch does it:
        # p.mul_(1 - lr * wd); p.add_(sign(b1 * m + (1 - b1) * g), alpha=-lr);
        # m = b2 * m + (1 - b2) * g. Each `mul(b) + x * (1 - b)` is one fused multiply-add.
        m = buffers["exp_avg"]
        direction = ops.mul(m, b1)
        direction = ops.fma(g, 1.0 - b1, direction, into=direction)
        direction = ops.sign(direction, into=direction)
        new_m = ops.mul(m, b2, into=ops.target(m))  # m is read: the direction is known
        new_m = ops.kept(ops.fma(g, 1.0 - b2, new_m, into=new_m), replaces=m)
        neg_lr = ops.scalar(-lr)
        on = _decayed(mask) if weight_decay > 0 else []
        if on == []:  # -lr * (+-1 or 0) is exact: apply_updates adds it as torch does
            return _added(ops, p, ops.mul(direction, neg_lr, into=direction)), {"exp_avg": new_m}
        # p.mul_(1 - lr * wd), then p.add_(sign, alpha=-lr): the new params themselves
        lr64 = _f64(lr)
        pd, dd = _pick(p, on), _pick(direction, on)
        factor = ops.scalar(1.0 - lr64 * weight_decay)
        new_p = ops.mul(pd, factor, into=ops.target(pd, _pick(g, on)))  # g is dead
        decayed = ops.fma(dd, neg_lr, new_p, into=new_p)
        if on is None:
            return NewParams(decayed), {"exp_avg": new_m}
        off = [i for i, flag in zip(range(len(mask)), mask) if not flag]  # no decay
        po = _pick(p, off)
        plain = ops.fma(_pick(direction, off), neg_lr, po, into=ops.target(po))
        return NewParams(_merge(len(direction), (on, decayed), (off, plain))), {"exp_avg": new_m}

    return step


def lion(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1e-3,
    *,
    mask: Mask = None,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> Optimizer:
    """Lion: the sign of an interpolation of momentum and gradient, with decoupled weight decay.

    From Chen et al., "Symbolic Discovery of Optimization Algorithms".

    The step is ``p = p * (1 - lr * weight_decay) - lr * sign(b1 * m + (1 - b1) * g)``, then ``m =
    b2 * m + (1 - b2) * g``. Lion keeps one buffer per param (half Adam's memory). Lion wants a
    learning rate 3-10x smaller than AdamW's, and a larger weight decay. ``mask`` picks the leaves
    the weight decay applies to, as optax's ``lion(mask=)`` does (see :func:`funcamp.adamw`).

    The defaults are optax's (``optax.lion``), including ``weight_decay=1e-3``. lion-pytorch's
    ``Lion`` defaults to ``weight_decay=0.0``; pass ``weight_decay=0.0`` to reproduce it. Its
    decay, when set, is this one: ``p *= 1 - lr * weight_decay``. With its
    ``decoupled_weight_decay=True``, pass its ``weight_decay / lr``.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr`` (probed once when
            built). A value that is NaN, infinite or negative at run time skips the step.
        b1: interpolation factor of the update direction, in [0, 1).
        b2: decay of the momentum, in [0, 1).
        weight_decay: decoupled decay rate (>= 0). 1e-3 by default (optax's; lion-pytorch's is
            0.0).
        mask: where the weight decay applies: a pytree of Python bools (or a prefix of the
            params' structure), or a callable of the leaf path or of the params (see
            :func:`funcamp.adamw`). ``None`` (default): every leaf.
        master_weights: keep float32 copies of half params.
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.

    Returns:
        An :class:`Optimizer` whose state is a :class:`funcamp.optim.LionState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.lion(0.1, weight_decay=0.0)
        >>> params = {"w": torch.zeros(3)}
        >>> g = {"w": torch.tensor([2.0, -0.5, 0.0])}
        >>> updates, state = opt.update(g, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([-0.1000,  0.1000,  0.0000])}
    """
    api = "lion"
    b1 = check_number(api, "b1", b1, maximum=1.0)
    b2 = check_number(api, "b2", b2, maximum=1.0)
    weight_decay = check_number(api, "weight_decay", weight_decay)
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    step = _lion_step(b1, b2, weight_decay)
    return _build(
        api, LionState, step, learning_rate, modes, needs_params=weight_decay > 0, mask=mask
    )
