"""torch.optim's NAdam, RAdam and Rprop (ASGD: ``_asgd``), each an algorithm written once with
:func:`funcamp.optim.elementwise`, rounding as torch.optim's single-tensor CPU path (see
``_adaptive``). RAdam's rectification is a ``where`` selection on the step count: no host
sync, no branch on a tensor's value.
"""

from __future__ import annotations

from typing import Any

import torch

from funcamp._core.checks import check_flag, check_number
from funcamp.optim import _betas as bt
from funcamp.optim import _shared as hp
from funcamp.optim._base import NewParams, Optimizer
from funcamp.optim._paths import Ops
from funcamp.optim._shared import (
    LearningRate,
    LowPrecision,
    Tensors,
    _build,
    _common_args,
    _decayed_prologue,
    _f64,
    _half_power,
    _kept,
    _map,
    _pair,
    _steps,
)
from funcamp.optim._states import NadamState, RadamState, RpropState

__all__ = ["nadam", "radam", "rprop"]


def _implementation(
    api: str, foreach: Any, betas: dict[str, Any], differentiable: bool = False
) -> bool:
    """Whether to run torch's foreach step (``foreach``: None or a bool), checked: torch's
    foreach step refuses ``differentiable`` and fails on the tensor ``betas`` given (by
    name)."""
    if foreach is not None:
        check_flag(api, "foreach", foreach)
    check_flag(api, "differentiable", differentiable)
    if not foreach:
        return False
    if differentiable:
        raise ValueError(
            f"funcamp.{api}: `foreach=True` and `differentiable=True` select two torch "
            "implementations (torch.optim refuses both at once); pass one of them"
        )
    for name, beta in betas.items():
        if isinstance(beta, torch.Tensor):
            raise ValueError(
                f"funcamp.{api}: `foreach=True` takes a float {name} (torch.optim's foreach "
                f"step fails on a tensor one); pass float({name}), or foreach=None"
            )
    return True


# --------------------------------------------------------------------------------------------
# nadam


def _nadam_scalars(
    ops: Ops, b1: Any, b2: Any, momentum_decay: float, lr: Any, count: Any, mu_product: Any
) -> tuple[Any, Any, Any, Any]:
    """NAdam's step scalars: ``bias_correction2``, the new ``mu_product`` and the two
    ``addcdiv`` values, as torch computes them (Python doubles, or tensor math in a tensor
    beta's dtype: see ``_betas``)."""
    t = _steps(count)
    if isinstance(b2, torch.Tensor):
        bc2 = ops.scalar(bt.one_minus_power(bt.on(b2, t), t))
    else:
        bc2 = ops.scalar(1.0 - torch.pow(b2, t))
    c = 1.0 - 0.5 * torch.pow(0.96, t * momentum_decay)
    c_next = 1.0 - 0.5 * torch.pow(0.96, (t + 1.0) * momentum_decay)
    if not isinstance(b1, torch.Tensor):
        mu, mu_next = b1 * c, b1 * c_next
        mu_product = mu_product * ops.scalar(mu)
        mp = mu_product.to(torch.float64)
        if bt.is_tensor_rate(lr):  # torch's tensor lr: its dtype's math, Python floats rounded
            neg_lr = -lr
            c1 = (neg_lr * (1.0 - mu).to(lr.dtype)) / (1.0 - mp).to(lr.dtype)
            c2 = (neg_lr * mu_next.to(lr.dtype)) / (1.0 - mp * mu_next).to(lr.dtype)
            return bc2, mu_product, ops.scalar(c1), ops.scalar(c2)
        lr64 = _f64(lr)
        c1 = ops.scalar(-lr64 * (1.0 - mu) / (1.0 - mp))
        c2 = ops.scalar((-lr64 * mu_next) / (1.0 - mp * mu_next))
        return bc2, mu_product, c1, c2
    beta1 = bt.on(b1, t)
    dtype = beta1.dtype
    mu, mu_next = beta1 * c.to(dtype), beta1 * c_next.to(dtype)
    wide = torch.promote_types(torch.float32, dtype)  # mu_product *= mu: 0-d tensors promote
    mu_product = (mu_product.to(wide) * mu.to(wide)).to(torch.float32)
    mp = mu_product.to(torch.float64)  # torch's _get_value(mu_product), a Python float
    neg_lr, out = bt.rate(lr, dtype)
    neg_lr = -neg_lr.to(t.device)
    c1 = (neg_lr * (1 - mu).to(out)) / (1.0 - mp).to(out)
    mp_next = mp.to(dtype) * mu_next
    c2 = (neg_lr * mu_next.to(out)) / (1 - mp_next).to(out)
    return bc2, mu_product, ops.scalar(c1), ops.scalar(c2)


def _nadam_differentiable(
    ops: Ops, b1: float, momentum_decay: float, lr: Any, count: Any, mu_product: Any
) -> tuple[Any, Any]:
    """The factors of ``grad`` and ``exp_avg`` on torch.optim.NAdam's ``differentiable`` step:
    ``-lr * (1 - mu) / (1 - mu_product)`` and ``-lr * mu_next / (1 - mu_product * mu_next)``,
    with the new float32 ``mu_product``: a Python double over a 0-d tensor is
    ``tensor.reciprocal() * double`` in float32 (a tensor ``lr``: a division of tensors)."""
    t = _steps(count)
    mu = b1 * (1.0 - 0.5 * torch.pow(0.96, t * momentum_decay))
    mu_next = b1 * (1.0 - 0.5 * torch.pow(0.96, (t + 1.0) * momentum_decay))
    mu_product_next = mu_product * ops.scalar(mu_next)  # float32 * float32(mu_next)
    factors = []
    for numerator, below in ((1.0 - mu, 1.0 - mu_product), (mu_next, 1.0 - mu_product_next)):
        if bt.is_tensor_rate(lr):  # (-lr * x) / tensor: tensor math in lr's dtype
            factors.append(ops.scalar((-lr * numerator.to(lr.dtype)) / below))
        else:
            value = (-_f64(lr) * numerator).to(below.dtype)  # the Python double, rounded
            factors.append(ops.scalar(below.reciprocal() * value))
    return factors[0], factors[1]


def _nadam_step(
    b1: Any,
    b2: Any,
    eps: float,
    weight_decay: float,
    momentum_decay: float,
    decoupled: bool,
    maximize: bool,
    foreach: bool = False,
    differentiable: bool = False,
) -> Any:
    w1, w2 = bt.one_minus(b1), bt.one_minus(b2)  # as torch's kernels read them (float32)
    beta2 = bt.f32(b2) if isinstance(b2, torch.Tensor) else b2

    def step(ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any) -> Any:
        # torch.optim.NAdam: bias_correction2 = 1 - b2**step; p.mul_(1 - lr * wd) (decoupled)
        # or grad.add(p, alpha=wd); mu = b1 * (1 - 0.5 * 0.96**(step * momentum_decay)),
        # mu_next the same at step + 1 (doubles); mu_product *= mu (float32);
        # exp_avg.lerp_(grad, 1 - b1); exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2);
        # denom = exp_avg_sq.div(bias_correction2).sqrt().add_(eps);
        # p.addcdiv_(grad, denom, value=-lr * (1 - mu) / (1 - mu_product));
        # p.addcdiv_(exp_avg, denom, value=-lr * mu_next / (1 - mu_product * mu_next)).
        # torch's foreach step (_multi_tensor_nadam): denom = sqrt(v) / bias_correction2**0.5
        # + eps; lr read as a Python double. Its differentiable step: grad and exp_avg times
        # tensor factors of mu_product (_nadam_differentiable), then addcdiv_ with value 1.
        lr64 = _f64(lr)
        g, decayed = _decayed_prologue(ops, g, p, maximize, weight_decay, decoupled, lr64)
        base = p if decayed is None else decayed
        bc2, mu_product, c1, c2 = _nadam_scalars(
            ops, b1, b2, momentum_decay, lr64 if foreach else lr, count, buffers["mu_product"]
        )
        if differentiable:
            c1, c2 = _nadam_differentiable(ops, b1, momentum_decay, lr, count, mu_product)
        m = ops.lerp(buffers["exp_avg"], g, w1)
        v = ops.addcmul(ops.mul(buffers["exp_avg_sq"], beta2), g, g, w2)
        if foreach:
            root = _half_power(1.0 - torch.pow(b2, _steps(count)))  # (1 - b2**step) ** 0.5
            denom = ops.div(ops.sqrt(v), ops.scalar(root))
        else:
            denom = ops.sqrt(ops.div(v, bc2))
        denom = ops.add(denom, eps, into=denom)
        a = ops.div(ops.mul(g, c1), denom)
        b = ops.div(ops.mul(m, c2), denom)
        if base is None:  # p.addcdiv_(grad, ...) then p.addcdiv_(exp_avg, ...): two roundings
            deltas = ops.add(a, b, into=a) if p is None else NewParams(ops.add(ops.add(p, a), b))
        else:
            deltas = NewParams(ops.add(ops.add(base, a), b))
        return deltas, {**_kept(ops, buffers, exp_avg=m, exp_avg_sq=v), "mu_product": mu_product}

    return step


def nadam(
    learning_rate: LearningRate,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum_decay: float = 4e-3,
    *,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
    foreach: bool | None = None,
    differentiable: bool = False,
) -> Optimizer:
    """NAdam (Adam with Nesterov momentum, Dozat 2016) with torch.optim.NAdam's semantics:
    its momentum schedule ``mu_t = b1 * (1 - 0.5 * 0.96**(t * momentum_decay))`` and the
    product of the ``mu_t`` kept in the state.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr``.
        b1: decay of the first moment, in [0, 1): a float, or a 0-d float32/float64 tensor
            as torch.optim accepts (the step's scalars are then tensor math, as torch's).
        b2: decay of the second moment, in [0, 1) (a float or a 0-d tensor, as ``b1``).
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty (>= 0), or decoupled (AdamW's) with
            ``decoupled_weight_decay``.
        momentum_decay: the momentum schedule's decay (>= 0).
        decoupled_weight_decay: ``p *= 1 - lr * weight_decay`` instead of the L2 term.
        maximize: ascend the objective (the gradients are negated first).
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.
        foreach: True gives the numbers of ``torch.optim.NAdam(foreach=True)`` (its
            ``_foreach_*`` step); None or False those of its single-tensor step (torch's
            default on the CPU). Float betas only.
        differentiable: give the numbers of ``torch.optim.NAdam(differentiable=True)``
            (float b1). Every funcamp step is differentiable either way.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.NadamState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.nadam(0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates), state.mu_product
        ({'w': tensor([-0.1056,  0.1056])}, tensor(0.4501))
    """
    api = "nadam"
    check_flag(api, "decoupled_weight_decay", decoupled_weight_decay)
    eps, weight_decay = _common_args(api, maximize, eps, weight_decay)
    b1, b2 = bt.betas(api, b1, b2)
    momentum_decay = check_number(api, "momentum_decay", momentum_decay)
    foreach = _implementation(api, foreach, {"b1": b1, "b2": b2}, differentiable)
    if differentiable and isinstance(b1, torch.Tensor):
        raise ValueError(
            f"funcamp.{api}: `differentiable=True` takes a float b1 (torch's differentiable "
            "step with a tensor b1 is not reproduced); pass float(b1), or differentiable=False"
        )
    step = _nadam_step(
        b1, b2, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize, foreach,
        differentiable,
    )  # fmt: skip
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    return _build(
        api, NadamState, step, learning_rate, modes, buffers=("exp_avg", "exp_avg_sq"),
        needs_params=weight_decay > 0, scalars={"mu_product": 1.0},
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# radam


def _radam_scalars(b1: Any, b2: Any, count: Any) -> tuple[Any, Any, Any, Any]:
    """RAdam's step scalars: ``bias_correction1``, ``sqrt(bias_correction2)``, whether the step
    is rectified, the rectification term; Python doubles in torch, or tensor math in a tensor
    beta's dtype (see ``_betas``)."""
    t = _steps(count)
    if isinstance(b1, torch.Tensor):
        bc1 = bt.one_minus_power(bt.on(b1, t), t)
    else:
        bc1 = 1.0 - torch.pow(b1, t)
    if isinstance(b2, torch.Tensor):  # rho_inf = 2 / (1 - b2) - 1: Tensor.__rtruediv__
        beta2 = bt.on(b2, t)
        bc2 = bt.one_minus_power(beta2, t)
        rho_inf = (1 - beta2).reciprocal() * 2 - 1
        rho_t = rho_inf - ((2.0 * t).to(beta2.dtype) * bt.power(beta2, t)) / bc2
        root = torch.pow(bc2, 0.5)
    else:
        bc2 = 1.0 - torch.pow(b2, t)
        rho_inf = 2.0 / (1.0 - b2) - 1.0
        rho_t = rho_inf - 2.0 * t * torch.pow(b2, t) / bc2
        root = _half_power(bc2)
    on = rho_t > 5.0
    safe = torch.where(on, rho_t, torch.full_like(rho_t, 6.0))  # no NaN in the other branch
    rect = (safe - 4) * (safe - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * safe)
    # torch's rect is `(...) ** 0.5` of a Python float, or of a tensor (a tensor b2): its sqrt
    return (
        bc1,
        root,
        on,
        torch.pow(rect, 0.5) if isinstance(b2, torch.Tensor) else _half_power(rect),
    )


def _quotient(num: Any, bc: Any, tensors: tuple[bool, bool]) -> Any:
    """torch's ``num / bc`` where each is a Python double (a float64 0-d tensor here) or a
    0-d tensor (``tensors``: which): a double over a tensor is ``bc.reciprocal() * num`` in
    ``bc``'s dtype, a tensor over a double is rounded to the tensor's dtype."""
    if tensors == (False, False):
        return num / bc
    if tensors == (True, False):
        return num / bc.to(num.dtype)
    if tensors == (False, True):
        return bc.reciprocal() * num.to(bc.dtype)
    return num / bc


def _radam_foreach(
    ops: Ops, b1: Any, b2: float, eps: float, lr: Any, count: Any, m: Tensors, v: Tensors
) -> Tensors:
    """The ``buffer`` of torch's foreach RAdam step (``_multi_tensor_radam``), whose
    ``p.addcmul_(exp_avg, buffer)`` is the step:
    ``buffer = 1 / ((sqrt(v) + eps) / (bc2**0.5 * (lr * rect / bc1) * -1)) + (lr *
    unrectified / bc1) * -1`` with ``rect`` 0 (``unrectified`` 1) until ``rho_t > 5``: Python
    doubles, tensor math for a tensor ``lr`` or ``b1`` (see :func:`_quotient`)."""
    bc1, root_bc2, on, rect = _radam_scalars(b1, b2, count)
    rect = torch.where(on, rect, torch.zeros_like(rect))
    unrectified = torch.where(rect > 0, torch.zeros_like(rect), torch.ones_like(rect))
    kinds = (bt.is_tensor_rate(lr), isinstance(b1, torch.Tensor))
    if kinds[0]:  # lr * x: tensor math, the double rounded to lr's dtype
        rate = lr.to(bc1.device)
        unrect = _quotient(rate * unrectified.to(lr.dtype), bc1, kinds) * -1
        by = _quotient(rate * rect.to(lr.dtype), bc1, kinds)
    else:
        lr64 = _f64(lr)
        unrect = _quotient(lr64 * unrectified, bc1, kinds) * -1
        by = _quotient(lr64 * rect, bc1, kinds)
    # (1 - b2**step) ** 0.5 * (lr * rect / bc) * -1: the double in `by`'s dtype
    scale = by * root_bc2.to(by.dtype) * -1
    buffer = ops.sqrt(v)
    buffer = ops.add(buffer, eps, into=buffer)
    buffer = ops.div(buffer, ops.scalar(scale), into=buffer)  # by -0.0 before rho_t > 5
    buffer = _map(torch.reciprocal, buffer)
    buffer = ops.add(buffer, ops.scalar(unrect), into=buffer)
    return buffer


def _radam_step(
    b1: Any,
    b2: Any,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    foreach: bool = False,
) -> Any:
    w1, w2 = bt.one_minus(b1), bt.one_minus(b2)  # as torch's kernels read them (float32)
    beta2 = bt.f32(b2) if isinstance(b2, torch.Tensor) else b2

    def step(ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any) -> Any:
        # torch.optim.RAdam: weight decay as NAdam's; exp_avg.lerp_(grad, 1 - b1);
        # exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2); bc1, bc2 = 1 - b**step;
        # rho_t = rho_inf - 2 * step * b2**step / bc2 (doubles); with rho_t > 5:
        # p.add_(exp_avg / bc1 * lr * (bc2**0.5 / (exp_avg_sq.sqrt() + eps)) * rect,
        # alpha=-1), else p.add_(exp_avg / bc1 * lr, alpha=-1). `x / tensor` is
        # `tensor.reciprocal() * x` in torch (a tensor b2: bc2**0.5 is one, and `/` divides).
        g, base = _decayed_prologue(ops, g, p, maximize, weight_decay, decoupled, _f64(lr))
        m = ops.lerp(buffers["exp_avg"], g, w1)
        v = ops.addcmul(ops.mul(buffers["exp_avg_sq"], beta2), g, g, w2)
        if foreach:  # p.addcmul_(exp_avg, buffer): one fused multiply-add on the CPU
            buffer = _radam_foreach(ops, b1, b2, eps, lr, count, m, v)
            new = _kept(ops, buffers, exp_avg=m, exp_avg_sq=v)
            return NewParams(ops.addcmul(p if base is None else base, m, buffer, 1.0)), new
        bc1, root_bc2, on, rect = _radam_scalars(b1, b2, count)
        scaled = ops.mul(ops.div(m, ops.scalar(bc1)), ops.scalar(lr))
        root = ops.sqrt(v)
        root = ops.add(root, eps, into=root)
        if isinstance(b2, torch.Tensor):
            numerator = ops.scalar(root_bc2)
            adaptive = _map(lambda r: torch.div(numerator, r), root)
        else:
            adaptive = ops.mul(_map(torch.reciprocal, root), ops.scalar(root_bc2))
        rectified = ops.mul(ops.mul(scaled, adaptive), ops.scalar(rect))
        steps = ops.where(on, rectified, scaled)
        if base is None:  # p.add_(steps, alpha=-1): p - steps, the delta exactly
            deltas = ops.mul(steps, -1.0)
        else:  # p.mul_(1 - lr * wd) first
            deltas = NewParams(ops.sub(base, steps))
        return deltas, _kept(ops, buffers, exp_avg=m, exp_avg_sq=v)

    return step


def radam(
    learning_rate: LearningRate,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
    foreach: bool | None = None,
) -> Optimizer:
    """RAdam (rectified Adam, Liu et al. 2020) with torch.optim.RAdam's semantics: the
    adaptive step, scaled by the rectification term, once the variance estimate is tractable
    (``rho_t > 5``), the bias-corrected momentum alone before (a ``where`` on the step count:
    no host sync).

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr``.
        b1: decay of the first moment, in [0, 1): a float, or a 0-d float32/float64 tensor
            as torch.optim accepts (the step's scalars are then tensor math, as torch's).
        b2: decay of the second moment, in [0, 1) (a float or a 0-d tensor, as ``b1``).
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty (>= 0), or decoupled (AdamW's) with
            ``decoupled_weight_decay``.
        decoupled_weight_decay: ``p *= 1 - lr * weight_decay`` instead of the L2 term.
        maximize: ascend the objective (the gradients are negated first).
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.
        foreach: True gives the numbers of ``torch.optim.RAdam(foreach=True)`` (its
            ``_foreach_*`` step); None or False those of its single-tensor step (torch's
            default on the CPU). A float ``b2`` only.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.RadamState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.radam(0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)  # not rectified yet: momentum SGD
        {'w': tensor([-0.1000,  0.2000])}
    """
    api = "radam"
    check_flag(api, "decoupled_weight_decay", decoupled_weight_decay)
    eps, weight_decay = _common_args(api, maximize, eps, weight_decay)
    b1, b2 = bt.betas(api, b1, b2)
    foreach = _implementation(api, foreach, {"b2": b2})
    step = _radam_step(b1, b2, eps, weight_decay, decoupled_weight_decay, maximize, foreach)
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    return _build(
        api, RadamState, step, learning_rate, modes, needs_params=weight_decay > 0 or foreach
    )


# --------------------------------------------------------------------------------------------
# rprop


def _rprop_step(etaminus: Any, etaplus: Any, smin: Any, smax: Any, maximize: bool) -> Any:
    cfg = (etaminus, etaplus, smin, smax)

    def step(
        ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any, hyper: Any = None
    ) -> Any:
        # torch.optim.Rprop: sign = grad.mul(prev).sign() -> etaplus / etaminus / 1;
        # step_size.mul_(sign).clamp_(min, max) (step_size starts at lr); grad = 0 where the
        # sign flipped; p.addcmul_(grad.sign(), step_size, value=-1); prev.copy_(grad).
        # (A schedule's value: its float32 number, as torch writes a Python float.)
        etaminus, etaplus, smin, smax = (hp.operand(ops, hp.at(hyper, x)) for x in cfg)
        if isinstance(smin, torch.Tensor) or isinstance(smax, torch.Tensor):  # clamp's overload
            smin, smax = ops.scalar(smin), ops.scalar(smax)
        if maximize:
            g = ops.mul(g, -1.0)
        s = ops.sign(ops.mul(g, buffers["prev"]))
        factor = _map(lambda x: torch.where(x > 0, etaplus, torch.where(x < 0, etaminus, 1.0)), s)
        lr32 = ops.scalar(lr)
        first = count == 0
        size = _map(lambda x: torch.where(first, lr32, x), buffers["step_size"])
        size = _map(lambda x: torch.clamp(x, smin, smax), ops.mul(size, factor))
        g = _map(lambda x, y: torch.where(y < 0, 0.0, x), g, s)
        deltas = ops.mul(ops.mul(ops.sign(g), size), -1.0)
        return deltas, _kept(ops, buffers, prev=g, step_size=size)

    return step


def rprop(
    learning_rate: LearningRate,
    etas: tuple[float, float] = (0.5, 1.2),
    step_sizes: tuple[float, float] = (1e-6, 50.0),
    *,
    maximize: bool = False,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> Optimizer:
    """Rprop (resilient backpropagation) with torch.optim.Rprop's semantics: a step size per
    element, multiplied by ``etas[1]`` while the gradient keeps its sign and by ``etas[0]``
    when it flips (the step is then skipped), clamped to ``step_sizes``; the update is
    ``-sign(g) * step_size``.

    The learning rate is the initial step size (read on the first update only).

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr``.
        etas: ``(etaminus, etaplus)``, with ``0 < etaminus < 1 < etaplus``.
        step_sizes: ``(min, max)`` step size, ``0 <= min <= max``.
        maximize: ascend the objective (the gradients are negated first).
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.RpropState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.rprop(0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> state = opt.init(params)
        >>> for g in ([1.0, -2.0], [1.0, 2.0]):
        ...     updates, state = opt.update({"w": torch.tensor(g)}, state, params)
        ...     params = funcamp.apply_updates(params, updates)
        >>> params, state.step_size
        ({'w': tensor([-0.2200,  0.1000])}, {'w': tensor([0.1200, 0.0500])})
    """
    api = "rprop"
    check_flag(api, "maximize", maximize)
    etaminus, etaplus = _pair(api, "etas", etas)
    smin, smax = _pair(api, "step_sizes", step_sizes)
    # a schedule's values: etaminus in [0, 1), etaplus >= 1 (checked each step)
    etaminus = hp.hyperparameter(
        api, "etas[0]", etaminus, maximum=1.0 if callable(etaminus) else None
    )
    etaplus = hp.hyperparameter(api, "etas[1]", etaplus, minimum=1.0 if callable(etaplus) else 0.0)
    if not hp.scheduled(etaminus, etaplus) and not 0.0 < etaminus < 1.0 < etaplus:
        raise ValueError(
            f"funcamp.{api}: `etas` must be (etaminus, etaplus) with 0 < etaminus < 1 < "
            f"etaplus, got {etas!r}"
        )
    smin = hp.hyperparameter(api, "step_sizes[0]", smin)
    smax = hp.hyperparameter(api, "step_sizes[1]", smax)
    if not hp.scheduled(smin, smax) and smin > smax:
        raise ValueError(
            f"funcamp.{api}: `step_sizes` must be (min, max) with min <= max, got {step_sizes!r}"
        )
    step = _rprop_step(etaminus, etaplus, smin, smax, maximize)
    return _build(
        api, RpropState, step, learning_rate, LowPrecision(master_weights, kahan, stochastic_rounding, seed),
        hyper=hp.hyperparameters(etaminus, etaplus, smin, smax),
    )  # fmt: skip
