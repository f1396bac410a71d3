"""torch.optim's adaptive elementwise optimizers, each an algorithm written once with
:func:`funcamp.optim.elementwise`: RMSprop, Adagrad, Adadelta, Adamax (NAdam, RAdam, ASGD and
Rprop are in ``_variants``; both build on the helpers of ``_shared``).

Each ``step`` calls torch.optim's single-tensor operations in their order (a Python scalar
operand is rounded to float32, as torch's kernels read it). Scalars torch computes from the step
number in Python doubles (bias corrections, step sizes) are computed from the step count as
float64 tensors: the same doubles, with no host sync. Where torch's update is
``p.add_(d, alpha=-lr)`` (one rounding) the result is the new params (:func:`_add_scaled`);
``p.addcdiv_(x, y, value=v)`` is ``p + (v * x) / y``, which the delta ``(v * x) / y`` added back
gives bit for bit. Nothing branches on a tensor's value (RAdam's rectification and ASGD's
averaging switch are ``where`` selections).
"""

from __future__ import annotations

from typing import Any

import torch

from funcamp._core.checks import check_flag, check_number
from funcamp.optim import _betas as bt
from funcamp.optim._base import NewParams, Optimizer
from funcamp.optim._fused import fused_adagrad
from funcamp.optim._paths import Ops
from funcamp.optim._shared import (
    LearningRate,
    LowPrecision,
    Tensors,
    _add_scaled,
    _build,
    _common_args_scheduled,
    _f64,
    _kept,
    _map,
    _prologue,
    _steps,
    addcmul,
    at,
    check_fused_modes,
    hyperparameter,
    hyperparameters,
    operand,
    positive,
    refuse_scheduled,
    scheduled,
)
from funcamp.optim._states import (
    AdadeltaState,
    AdagradState,
    AdamaxState,
    RmspropState,
)

__all__ = ["adadelta", "adagrad", "adamax", "rmsprop"]

# --------------------------------------------------------------------------------------------
# rmsprop


def _rmsprop_step(
    alpha: Any, eps: Any, weight_decay: Any, momentum: Any, centered: bool, maximize: bool
) -> Any:
    cfg = (alpha, eps, weight_decay, momentum)
    moves = positive(momentum)

    def step(
        ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any, hyper: Any = None
    ) -> Any:
        # torch.optim.RMSprop: square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha);
        # centered: grad_avg.lerp_(grad, 1 - alpha), avg = square_avg.addcmul(grad_avg,
        # grad_avg, value=-1).sqrt_(); else avg = square_avg.sqrt(); avg.add_(eps); momentum:
        # buf.mul_(momentum).addcdiv_(grad, avg), p.add_(buf, alpha=-lr); else
        # p.addcdiv_(grad, avg, value=-lr).
        alpha, eps, weight_decay, momentum = (at(hyper, x) for x in cfg)
        g = _prologue(ops, g, p, maximize, weight_decay)
        sa = addcmul(ops, ops.mul(buffers["square_avg"], operand(ops, alpha)), g, g, 1.0 - alpha)
        new: dict[str, Tensors] = {}
        if centered:
            ga = ops.lerp(buffers["grad_avg"], g, operand(ops, 1.0 - alpha))
            avg = ops.sqrt(ops.addcmul(sa, ga, ga, -1.0))
        else:
            avg = ops.sqrt(sa)
        avg = ops.add(avg, operand(ops, eps), into=avg)
        neg_lr = ops.scalar(-lr)
        if moves:
            old = buffers["momentum_buffer"]
            buf = ops.add(ops.mul(old, operand(ops, momentum)), ops.div(g, avg))
            deltas = _add_scaled(ops, buf, neg_lr, p)  # p.add_(buf, alpha=-lr)
            if isinstance(momentum, torch.Tensor):  # torch's step without momentum where 0
                on = momentum > 0
                plain = ops.div(ops.mul(g, neg_lr), avg)
                if p is None:
                    deltas = ops.where(on, deltas, plain)
                else:  # p.add_(buf, alpha=-lr), or p.addcdiv_: p + the rounded quotient
                    moved = ops.fma(buf, neg_lr, p)
                    deltas = NewParams(ops.where(on, moved, ops.add(p, plain)))
                buf = ops.where(on, buf, old)
            new.update(_kept(ops, buffers, momentum_buffer=buf))
        else:
            deltas = ops.div(ops.mul(g, neg_lr), avg)
        if centered:
            new.update(_kept(ops, buffers, grad_avg=ga))
        return deltas, {**new, **_kept(ops, buffers, square_avg=sa)}

    return step


def rmsprop(
    learning_rate: LearningRate,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> Optimizer:
    """RMSprop with torch.optim.RMSprop's semantics and defaults.

    ``v = alpha * v + (1 - alpha) * g**2``; the step is ``-lr * g / (sqrt(v) + eps)``
    (``sqrt(v - mean(g)**2)`` with ``centered``), through a momentum buffer with ``momentum``.
    ``eps`` is added after the root (optax's ``rmsprop(eps_in_sqrt=False)``).

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr``.
        alpha: smoothing constant of the squared gradients, in [0, 1].
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0).
        momentum: momentum factor (>= 0).
        centered: normalise by the estimated variance of the gradient.
        maximize: ascend the objective (the gradients are negated first).
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.RmspropState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.rmsprop(0.01)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([-0.1000,  0.1000])}
    """
    api = "rmsprop"
    check_flag(api, "centered", centered)
    eps, weight_decay = _common_args_scheduled(api, maximize, eps, weight_decay)
    alpha = hyperparameter(api, "alpha", alpha, maximum=1.0, maximum_open=False)
    momentum = hyperparameter(api, "momentum", momentum)
    buffers = ["square_avg"]
    if positive(momentum):
        buffers.append("momentum_buffer")
    if centered:
        buffers.append("grad_avg")
    step = _rmsprop_step(alpha, eps, weight_decay, momentum, centered, maximize)
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    return _build(
        api, RmspropState, step, learning_rate, modes, buffers=buffers,
        needs_params=positive(weight_decay),
        hyper=hyperparameters(alpha, eps, weight_decay, momentum),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# adagrad


def _adagrad_step(lr_decay: Any, weight_decay: Any, eps: Any, maximize: bool) -> Any:
    cfg = (lr_decay, weight_decay, eps)

    def step(
        ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any, hyper: Any = None
    ) -> Any:
        # torch.optim.Adagrad: clr = lr / (1 + (step - 1) * lr_decay) (double);
        # state_sum.addcmul_(grad, grad, value=1); std = state_sum.sqrt().add_(eps);
        # p.addcdiv_(grad, std, value=-clr).
        lr_decay, weight_decay, eps = (at(hyper, x) for x in cfg)
        g = _prologue(ops, g, p, maximize, weight_decay)
        neg_clr = ops.scalar(-(_f64(lr) / (1.0 + count.to(torch.float64) * lr_decay)))
        s = ops.addcmul(buffers["sum"], g, g, 1.0)
        std = ops.sqrt(s)
        std = ops.add(std, operand(ops, eps), into=std)
        deltas = ops.div(ops.mul(g, neg_clr), std)
        return deltas, _kept(ops, buffers, sum=s)

    return step


def adagrad(
    learning_rate: LearningRate,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    maximize: bool = False,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
    fused: bool = False,
) -> Optimizer:
    """Adagrad with torch.optim.Adagrad's semantics and defaults (dense gradients).

    ``sum += g**2``; the step is ``-clr * g / (sqrt(sum) + eps)`` with
    ``clr = lr / (1 + count * lr_decay)``.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr``.
        lr_decay: learning-rate decay per step (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0).
        initial_accumulator_value: the accumulator's initial value (>= 0).
        eps: added to the denominator (>= 0).
        maximize: ascend the objective (the gradients are negated first).
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.
        fused: run torch's fused Adagrad kernel, bit for bit ``torch.optim.Adagrad(fused=True)``
            (its rounding differs from the default step's). Float32 params on one device; not
            under ``torch.func`` transforms.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.AdagradState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.adagrad(0.5)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates), state.sum
        ({'w': tensor([-0.5000,  0.5000])}, {'w': tensor([1., 4.])})
    """
    api = "adagrad"
    eps, weight_decay = _common_args_scheduled(api, maximize, eps, weight_decay)
    lr_decay = hyperparameter(api, "lr_decay", lr_decay)
    hyper = hyperparameters(lr_decay, weight_decay, eps)
    iav = check_number(api, "initial_accumulator_value", initial_accumulator_value)
    step = _adagrad_step(lr_decay, weight_decay, eps, maximize)
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    check_flag(api, "fused", fused)
    if fused:
        refuse_scheduled(
            api, "torch's fused kernel takes fixed values: pass floats, or fused=False", **hyper
        )
    in_place, copies = (
        fused_adagrad(lr_decay, weight_decay, eps, maximize) if fused else (None, None)
    )
    if fused:
        check_fused_modes(api, modes)
    decays = positive(weight_decay)
    return _build(
        api, AdagradState, step, learning_rate, modes, needs_params=decays or fused,
        fill={"sum": iav}, fused_kernel=in_place, fused_update=copies, hyper=hyper,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# adadelta


def _adadelta_step(rho: Any, eps: Any, weight_decay: Any, maximize: bool) -> Any:
    cfg = (rho, eps, weight_decay)

    def step(
        ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any, hyper: Any = None
    ) -> Any:
        # torch.optim.Adadelta: square_avg.mul_(rho).addcmul_(grad, grad, value=1 - rho);
        # std = square_avg.add(eps).sqrt_(); delta = acc_delta.add(eps).sqrt_();
        # delta.div_(std).mul_(grad); acc_delta.mul_(rho).addcmul_(delta, delta, value=1 - rho);
        # p.add_(delta, alpha=-lr).
        rho, eps, weight_decay = (at(hyper, x) for x in cfg)
        r, e = operand(ops, rho), operand(ops, eps)
        g = _prologue(ops, g, p, maximize, weight_decay)
        sa = addcmul(ops, ops.mul(buffers["square_avg"], r), g, g, 1.0 - rho)
        std = ops.sqrt(ops.add(sa, e))
        delta = ops.sqrt(ops.add(buffers["acc_delta"], e))
        delta = ops.mul(ops.div(delta, std, into=delta), g)
        acc = addcmul(ops, ops.mul(buffers["acc_delta"], r), delta, delta, 1.0 - rho)
        deltas = _add_scaled(ops, delta, ops.scalar(-lr), p)
        return deltas, _kept(ops, buffers, square_avg=sa, acc_delta=acc)

    return step


def adadelta(
    learning_rate: LearningRate = 1.0,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> Optimizer:
    """Adadelta with torch.optim.Adadelta's semantics and defaults (``learning_rate=1.0``).

    ``v = rho * v + (1 - rho) * g**2``; ``d = sqrt(u + eps) / sqrt(v + eps) * g``;
    ``u = rho * u + (1 - rho) * d**2``; the step is ``-lr * d``.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr`` (1.0: Zeiler's).
        rho: decay of the running averages, in [0, 1].
        eps: added inside both square roots (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0).
        maximize: ascend the objective (the gradients are negated first).
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.AdadeltaState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.adadelta()
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([-0.0032,  0.0032])}
    """
    api = "adadelta"
    eps, weight_decay = _common_args_scheduled(api, maximize, eps, weight_decay)
    rho = hyperparameter(api, "rho", rho, maximum=1.0, maximum_open=False)
    step = _adadelta_step(rho, eps, weight_decay, maximize)
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    return _build(
        api, AdadeltaState, step, learning_rate, modes,
        needs_params=positive(weight_decay),
        hyper=hyperparameters(rho, eps, weight_decay),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# adamax


def _adamax_step(b1: Any, b2: Any, eps: Any, weight_decay: Any, maximize: bool) -> Any:
    # as torch's kernels read them (float32); a schedule's value is read each step
    w1 = None if scheduled(b1) else bt.one_minus(b1)
    beta2 = bt.f32(b2) if isinstance(b2, torch.Tensor) else b2
    cfg = (b1, beta2, eps, weight_decay)

    def step(
        ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any, hyper: Any = None
    ) -> Any:
        # torch.optim.Adamax: exp_avg.lerp_(grad, 1 - b1); torch.maximum(exp_inf.mul_(b2),
        # grad.abs().add_(eps), out=exp_inf); clr = lr / (1 - b1**step) (double; a tensor b1:
        # its dtype, see _betas); p.addcdiv_(exp_avg, exp_inf, value=-clr).
        beta1, beta2, eps, weight_decay = (at(hyper, x) for x in cfg)
        g = _prologue(ops, g, p, maximize, weight_decay)
        t = _steps(count)
        if isinstance(b1, torch.Tensor):
            neg_clr = ops.scalar(-bt.over(lr, bt.one_minus_power(bt.on(b1, t), t)))
        elif bt.is_tensor_rate(lr):  # torch's tensor lr / a Python float: in lr's dtype
            neg_clr = ops.scalar(-(lr / (1.0 - torch.pow(beta1, t)).to(lr.dtype)))
        else:  # a float b1, or a schedule's float64 value (torch's Python float)
            neg_clr = ops.scalar(-(_f64(lr) / (1.0 - torch.pow(beta1, t))))
        m = ops.lerp(buffers["exp_avg"], g, operand(ops, 1.0 - beta1) if w1 is None else w1)
        norm = ops.add(_map(torch.abs, g), operand(ops, eps))
        u = ops.maximum(ops.mul(buffers["exp_inf"], operand(ops, beta2)), norm, into=norm)
        deltas = ops.div(ops.mul(m, neg_clr), u)
        return deltas, _kept(ops, buffers, exp_avg=m, exp_inf=u)

    return step


def adamax(
    learning_rate: LearningRate,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> Optimizer:
    """Adamax (Adam with the infinity norm) with torch.optim.Adamax's semantics.

    ``m = b1 * m + (1 - b1) * g``; ``u = max(b2 * u, |g| + eps)``; the step is
    ``-lr / (1 - b1**t) * m / u``. torch's ``betas=(b1, b2)`` are ``b1, b2`` here.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr``.
        b1: decay of the first moment, in [0, 1): a float, or a 0-d float32/float64 tensor
            as torch.optim accepts (the bias correction is then tensor math, as torch's).
        b2: decay of the infinity norm, in [0, 1) (a float or a 0-d tensor, as ``b1``).
        eps: added to ``|g|`` (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0).
        maximize: ascend the objective (the gradients are negated first).
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.AdamaxState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.adamax(0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([-0.1000,  0.1000])}
    """
    api = "adamax"
    eps, weight_decay = _common_args_scheduled(api, maximize, eps, weight_decay)
    b1 = hyperparameter(api, "b1", b1, maximum=1.0) if callable(b1) else bt.betas(api, b1, 0)[0]
    b2 = hyperparameter(api, "b2", b2, maximum=1.0) if callable(b2) else bt.betas(api, 0, b2)[1]
    step = _adamax_step(b1, b2, eps, weight_decay, maximize)
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    return _build(
        api, AdamaxState, step, learning_rate, modes,
        needs_params=positive(weight_decay),
        hyper=hyperparameters(b1, b2, eps, weight_decay),
    )  # fmt: skip
