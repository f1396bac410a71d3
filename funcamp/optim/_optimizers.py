"""The optimizers: each one's algorithm, written once, and its public factory.

Each algorithm is a ``step(ops, grads, params, buffers, lr, count)`` function (see
:func:`funcamp.optim.elementwise`). It calls torch.optim's single-tensor operations in
torch.optim's order, so an eager step gives torch.optim's numbers bit for bit. Where torch's last
operation on a param rounds once (``p.add_(d, alpha=-lr)``, the decoupled decay
``p.mul_(1 - lr * wd)``), the algorithm returns the new params themselves
(:class:`~funcamp.optim.NewParams`); elsewhere (``p.addcdiv_``) the delta, which ``p + delta``
adds back with the same single rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcamp._core.checks import check_flag
from funcamp._core.tree import PyTree
from funcamp.optim import _betas as bt
from funcamp.optim._base import NewParams, Optimizer
from funcamp.optim._fused import FUSED_ADAM, AdamHyper, fused_adam
from funcamp.optim._paths import Ops
from funcamp.optim._shared import (
    LowPrecision,
    _beta,
    _build,
    _f64,
    _half_power,
    at,
    check_fused_modes,
    hyperparameter,
    hyperparameters,
    operand,
    positive,
    refuse_scheduled,
    scheduled,
)
from funcamp.optim._states import AdamState

__all__ = ["AdamState", "adam", "adamw"]
Tensors = list[torch.Tensor]
#: A learning rate: a Python float (fixed), a 0-d tensor, or a schedule of the step count.
LearningRate = Any
#: Where the weight decay applies: a pytree of bools with the params' structure (or a prefix of
#: it), a callable of the dotted leaf path, or a callable of the params returning such a pytree.
Mask = Any | Callable[[PyTree], PyTree]


def _decayed(mask: Sequence[bool] | None) -> list[int] | None:
    """The indices of the leaves the weight decay applies to: None for every leaf (no mask, or
    a mask that is True everywhere)."""
    if mask is None:
        return None
    on = [i for i, m in zip(range(len(mask)), mask) if m]
    return None if len(on) == len(mask) else on


def _pick(xs: Tensors, idx: list[int] | None) -> Tensors:
    return xs if idx is None else [xs[i] for i in idx]


def _merge(n: int, *parts: tuple[list[int], Tensors]) -> Tensors:
    """One list of ``n`` leaves from ``(indices, leaves)`` parts."""
    out: list[Any] = [None] * n
    for idx, leaves in parts:
        for i, x in zip(idx, leaves):
            out[i] = x
    return out


def _added(ops: Ops, p: Any, deltas: Tensors) -> Tensors | NewParams:
    """``deltas``, or ``p + deltas`` computed in the params where this update may write them
    (a donated state whose step is known to apply: torch.optim's in-place add)."""
    into = None if p is None else ops.target(p)
    return deltas if into is None else NewParams(ops.add(p, deltas, into=into))


# --------------------------------------------------------------------------------------------
# adam / adamw


def _step_scalars(
    b1: Any, b2: Any, lr: Any, count: Any, tensors: tuple[Any, Any]
) -> tuple[Any, Any]:
    """torch.optim.Adam's ``-step_size`` and ``bias_correction2 ** 0.5``: Python doubles of the
    step (float64 here), rounded once; tensor math in a tensor beta's dtype (see ``_betas``)
    where the beta given (``tensors``: as configured) is a tensor. A scheduled beta is a
    float64 0-d tensor standing for torch's Python float."""
    t = (count + 1).to(torch.float64)
    if isinstance(tensors[0], torch.Tensor):
        neg_step = -bt.over(lr, bt.one_minus_power(bt.on(b1, t), t))
    else:
        neg_step = -(_f64(lr) / (1.0 - torch.pow(b1, t)))
    if isinstance(tensors[1], torch.Tensor):  # tensor ** 0.5 is torch's sqrt kernel
        return neg_step, torch.sqrt(bt.one_minus_power(bt.on(b2, t), t))
    return neg_step, _half_power(1.0 - torch.pow(b2, t))  # Python's bias_correction2 ** 0.5


def _tensor_step_scalars(b1: Any, b2: Any, eps: float, lr: Any, count: Any) -> tuple[Any, Any]:
    """The two denominator scalars of torch.optim.Adam's ``capturable or differentiable``
    step: ``bias_correction2_sqrt * step_size_neg`` and ``eps / step_size_neg``, tensor math of
    torch's float32 ``step`` (``1 - beta ** step``, ``lr / bias_correction1``, ``.sqrt()``)."""
    t = (count + 1).to(torch.float32)  # torch's state["step"] after `step_t += 1`
    beta1 = bt.on(b1, t) if isinstance(b1, torch.Tensor) else b1
    beta2 = bt.on(b2, t) if isinstance(b2, torch.Tensor) else b2
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    step_size_neg = bt.over(lr, bias_correction1).neg()
    return bias_correction2.sqrt() * step_size_neg, eps / step_size_neg


def _adam_step(cfg: AdamHyper, differentiable: bool = False) -> Any:
    """Adam's algorithm for the hyperparameters ``cfg`` (read by name: a fingerprint of the
    optimizer names each one), torch.optim's single-tensor step or its differentiable one."""
    decoupled, amsgrad, maximize = cfg.decoupled, cfg.amsgrad, cfg.maximize
    decays = positive(cfg.weight_decay)

    def step(
        ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any, mask: Any = None,
        hyper: Any = None,
    ) -> Any:  # fmt: skip
        # torch.optim.Adam/AdamW: grad = -grad (maximize); grad.add(p, alpha=weight_decay) or
        # p.mul_(1 - lr * wd); exp_avg.lerp_(grad, 1 - b1);
        # exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2); with amsgrad
        # torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq), the denominator's
        # square then; denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps;
        # p.addcdiv_(exp_avg, denom, value=-step_size), that is p + (-step_size * m) / denom.
        # A scheduled value is a float64 0-d tensor: torch's Python float, with float math.
        b1, b2 = at(hyper, cfg.b1), at(hyper, cfg.b2)
        eps, weight_decay = operand(ops, at(hyper, cfg.eps)), at(hyper, cfg.weight_decay)
        if maximize:  # times -1 is exact: torch's -grad, bit for bit
            g = ops.mul(g, -1.0, into=g)
        if decays and not decoupled:
            g = ops.fma(p, operand(ops, weight_decay), g, into=g)
        lr64 = _f64(lr)
        # denom = sqrt / divisor + offset: torch's `sqrt / bias_correction2_sqrt + eps`, or
        # its differentiable step's `(sqrt / (bc2_sqrt * step_size_neg)).add_(eps /
        # step_size_neg)` (fixed values only: refused with schedules when built)
        if differentiable:
            scalars = _tensor_step_scalars(cfg.b1, cfg.b2, cfg.eps, lr, count)
            divisor, offset = (ops.scalar(x) for x in scalars)
        else:
            scalars = _step_scalars(b1, b2, lr, count, tensors=(cfg.b1, cfg.b2))
            neg_step, divisor = (ops.scalar(x) for x in scalars)
            offset = eps
        # v first, then m. Where the step is known to apply on a donated state, each is
        # computed in its buffer, as torch.optim does. Elsewhere v goes into a temporary and m
        # into the grads (when the eager path owns them); on a donated state each then goes
        # into its buffer as it is kept, leaving the temporary for the denominator and the
        # grads for the step: torch.optim's memory (one temporary).
        v_old, m_old = buffers["exp_avg_sq"], buffers["exp_avg"]
        if isinstance(cfg.b2, torch.Tensor):  # torch's mul_(beta2).addcmul_(value=1 - beta2)
            vb = ops.mul(v_old, ops.scalar(b2), into=ops.target(v_old))
            v = ops.fma(ops.mul(g, ops.scalar(1.0 - b2.float())), g, vb, into=vb)
        elif scheduled(cfg.b2):  # addcmul(value=w) is z + (w * x) * y: one rounding each
            vb = ops.mul(v_old, ops.scalar(b2), into=ops.target(v_old))
            v = ops.fma(ops.mul(g, ops.scalar(1.0 - b2)), g, vb, into=vb)
        else:
            vb = ops.mul(v_old, b2, into=ops.target(v_old))
            v = ops.addcmul(vb, g, g, 1.0 - b2, into=vb)
        v = ops.kept(v, replaces=v_old)
        if isinstance(cfg.b1, torch.Tensor):
            w1 = ops.scalar(1.0 - b1.float())
        else:  # a float, or a scheduled value (its double, rounded once)
            w1 = operand(ops, 1.0 - b1)
        m = ops.kept(ops.lerp(m_old, g, w1, into=ops.target(m_old, g)), replaces=m_old)
        new = {"exp_avg": m, "exp_avg_sq": v}
        sq = v  # what the denominator is the root of
        if amsgrad:  # the running maximum, into the temporary when it is free (donated state)
            old = buffers["max_exp_avg_sq"]
            x = ops.maximum(old, v, into=ops.target(old, vb))
            sq = new["max_exp_avg_sq"] = ops.kept(x, replaces=old)
        on = _decayed(mask)  # the masked-off leaves keep the plain step (weight_decay=0)
        decoupled_decay = decays and decoupled and on != []
        # Known to apply on a donated CPU state: torch's in-place `p.addcdiv_` (the denominator
        # in the dead grads), no temporary of the params' size.
        in_place = not differentiable and (on is None or not decoupled_decay) and ops.writable(p)
        denom = ops.sqrt(sq, into=ops.target(vb, g) if in_place else ops.target(vb))
        denom = ops.div(denom, divisor, into=denom)
        denom = ops.add(denom, offset, into=denom)
        # with decoupled decay torch's p.mul_(1 - lr * wd) comes first: the new params themselves
        factor = ops.scalar(1.0 - lr64 * weight_decay) if decoupled_decay else None
        if in_place:
            new_p = ops.mul(p, factor, into=ops.target(p)) if decoupled_decay else ops.target(p)
            return NewParams(ops.addcdiv(new_p, m, denom, neg_step, into=new_p)), new
        if differentiable:
            deltas = ops.div(m, denom, into=g)  # p.addcdiv_(exp_avg, denom): value 1
        else:
            deltas = ops.mul(m, neg_step, into=g)
            deltas = ops.div(deltas, denom, into=deltas)
        if not decoupled_decay:
            # p.addcdiv_(...) is p + delta: one rounding either way (in place where it may)
            return _added(ops, p, deltas), new
        if on is None:
            new_p = ops.mul(p, factor, into=ops.target(p, denom))
            return NewParams(ops.add(new_p, deltas, into=new_p)), new
        pd = _pick(p, on)
        decayed = ops.mul(pd, factor, into=ops.target(pd, _pick(denom, on)))
        decayed = ops.add(decayed, _pick(deltas, on), into=decayed)
        off = [i for i, flag in zip(range(len(mask)), mask) if not flag]
        po = _pick(p, off)
        plain = ops.add(po, _pick(deltas, off), into=ops.target(po))
        return NewParams(_merge(len(deltas), (on, decayed), (off, plain))), new

    return step


_ADAM_BUFFERS = ("exp_avg", "exp_avg_sq")


def _adam(
    api: str,
    learning_rate: LearningRate,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    modes: LowPrecision,
    mask: Mask = None,
    fused: bool = False,
    amsgrad: bool = False,
    maximize: bool = False,
    differentiable: bool = False,
) -> Optimizer:
    check_flag(api, "amsgrad", amsgrad)
    check_flag(api, "maximize", maximize)
    check_flag(api, "differentiable", differentiable)
    b1 = hyperparameter(api, "b1", b1, maximum=1.0) if callable(b1) else _beta(api, "b1", b1)
    b2 = hyperparameter(api, "b2", b2, maximum=1.0) if callable(b2) else _beta(api, "b2", b2)
    eps = hyperparameter(api, "eps", eps)
    weight_decay = hyperparameter(api, "weight_decay", weight_decay)
    check_flag(api, "fused", fused)
    hyper = AdamHyper(b1, b2, eps, weight_decay, decoupled, amsgrad, maximize)
    hyper_fns = hyperparameters(b1, b2, eps, weight_decay)
    if differentiable:
        refuse_scheduled(
            api, "the differentiable step takes fixed values: pass floats, or differentiable=False",
            **hyper_fns,
        )  # fmt: skip
    kernels: tuple[Any, Any] = (None, None)
    if fused:
        refuse_scheduled(
            api, "torch's fused kernel takes fixed values: pass floats, or fused=False",
            **hyper_fns,
        )  # fmt: skip
        check_fused_modes(api, modes)
        if differentiable:
            raise ValueError(
                f"funcamp.{api}: `fused=True` and `differentiable=True` select two torch "
                "implementations (torch.optim refuses both at once); pass one of them"
            )
        if isinstance(b1, torch.Tensor) or isinstance(b2, torch.Tensor):
            raise ValueError(
                f"funcamp.{api}: `fused=True` takes float betas (b1, b2); pass floats, or "
                "fused=False for tensor betas"
            )
        if FUSED_ADAM is None:  # pragma: no cover - older torch
            raise ValueError(f"funcamp.{api}: `fused=True` needs torch._fused_adamw_ (torch>=2.4)")
        kernels = fused_adam(hyper)
    return _build(
        api, AdamState, _adam_step(hyper, differentiable),
        learning_rate, modes,
        buffers=(*_ADAM_BUFFERS, "max_exp_avg_sq") if amsgrad else _ADAM_BUFFERS,
        needs_params=positive(weight_decay) or fused, mask=mask,
        fused_kernel=kernels[0], fused_update=kernels[1], hyper=hyper_fns,
    )  # fmt: skip


def adam(
    learning_rate: LearningRate,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
    fused: bool = False,
    differentiable: bool = False,
) -> Optimizer:
    """Adam with torch.optim.Adam's semantics.

    ``weight_decay`` is an L2 term added to the gradient. ``eps`` is added after the
    bias-corrected square root.

    Math runs in float32 for half params (moments are float32). For the memory per parameter of
    each low-precision mode see the table in :mod:`funcamp.optim`.

    Fused kernel: with ``fused=True`` each leaf takes one pass of torch's fused kernel. Its
    rounding differs from the default path's in the last bit of a few elements a step. The
    update leaves are :class:`funcamp.optim.SetParam` (the new params). The kernel has no
    derivative and no batching rule. Compiled, it is called as an extern kernel.
    ``amsgrad`` and ``maximize`` are the kernel's own arguments.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr`` (probed once when
            built). A value that is NaN, infinite or negative at run time skips the step.
        b1: decay of the first moment, in [0, 1). A float, or a 0-d tensor as torch.optim
            accepts (the bias corrections are then float32 tensor math, as torch's).
        b2: decay of the second moment, in [0, 1) (a float or a 0-d tensor, as ``b1``).
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty (>= 0).
        amsgrad: divide by the running maximum of the second moment, as
            ``torch.optim.Adam(amsgrad=True)``. :func:`funcamp.scale_by_amsgrad` is the same
            as a transform.
        maximize: ascend the objective: negate the gradients first, as
            ``torch.optim.Adam(maximize=True)`` does. The same as
            ``funcamp.chain(funcamp.negate_gradients(), funcamp.adam(...))``.
        master_weights: keep float32 copies of half params.
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.
        fused: run torch's fused Adam kernel, bit for bit ``torch.optim.Adam(fused=True)``.
            Float32 params on one device; the last transform of a ``chain``; not under
            ``torch.func`` transforms. See "Fused kernel" above.
        differentiable: give the numbers of ``torch.optim.Adam(differentiable=True)`` (and
            of its ``capturable=True`` single-tensor step): float32 tensor bias corrections.
            Every funcamp step is differentiable either way; this picks the rounding only.

    Returns:
        An :class:`Optimizer` whose state is a :class:`funcamp.optim.AdamState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.adam(0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([-0.1000,  0.1000])}
    """
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    return _adam(
        "adam", learning_rate, b1, b2, eps, weight_decay, False, modes, None, fused, amsgrad,
        maximize, differentiable,
    )  # fmt: skip


def adamw(
    learning_rate: LearningRate,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    mask: Mask = None,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
    fused: bool = False,
    differentiable: bool = False,
) -> Optimizer:
    """AdamW with torch.optim.AdamW's semantics: decoupled weight decay
    ``p -= lr * weight_decay * p`` next to the Adam step.

    ``mask`` picks the leaves the weight decay applies to, as optax's ``adamw(mask=)`` does.
    The others take the plain Adam step. So ``adamw(lr, weight_decay=wd, mask=m)`` is
    ``torch.optim.AdamW`` with two param groups: ``weight_decay=wd`` where ``m`` is True, and
    ``weight_decay=0`` elsewhere. It keeps one optimizer, one state and one step count.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr`` (probed once when
            built). A value that is NaN, infinite or negative at run time skips the step.
        b1: decay of the first moment, in [0, 1). A float, or a 0-d tensor as torch.optim
            accepts (the bias corrections are then float32 tensor math, as torch's).
        b2: decay of the second moment, in [0, 1) (a float or a 0-d tensor, as ``b1``).
        eps: added to the denominator (>= 0).
        weight_decay: decoupled decay rate (>= 0).
        mask: where the weight decay applies: a pytree of bools, a callable of the dotted
            leaf path (as :func:`funcamp.masked`) or of the params (optax's). It must select
            a leaf. ``None`` (default): every leaf.
        amsgrad: divide by the running maximum of the second moment, as
            ``torch.optim.AdamW(amsgrad=True)``. :func:`funcamp.scale_by_amsgrad` is the same
            as a transform.
        maximize: ascend the objective: negate the gradients first, as
            ``torch.optim.AdamW(maximize=True)`` does. The same as
            ``funcamp.chain(funcamp.negate_gradients(), funcamp.adamw(...))``.
        master_weights: keep float32 copies of half params.
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.
        fused: run torch's fused AdamW kernel, bit for bit ``torch.optim.AdamW(fused=True)``.
            Float32 params on one device; the last transform of a ``chain``; not under
            ``torch.func`` transforms. See "Fused kernel" above.
        differentiable: give the numbers of ``torch.optim.AdamW(differentiable=True)`` (and
            of its ``capturable=True`` single-tensor step): float32 tensor bias corrections.
            Every funcamp step is differentiable either way; this picks the rounding only.

    Returns:
        An :class:`Optimizer` whose state is a :class:`funcamp.optim.AdamState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.adamw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(1)}
        >>> updates, _ = opt.update({"w": torch.zeros(1)}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([0.9500])}

        No decay for 1-d params (biases, norms), as optax's ``mask`` examples do:

        >>> opt = funcamp.adamw(
        ...     0.1, weight_decay=0.5, mask=lambda ps: {k: p.ndim > 1 for k, p in ps.items()}
        ... )
        >>> params = {"weight": torch.ones(1, 1), "bias": torch.ones(1)}
        >>> grads = {"weight": torch.zeros(1, 1), "bias": torch.zeros(1)}
        >>> updates, _ = opt.update(grads, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'weight': tensor([[0.9500]]), 'bias': tensor([1.])}

        torch's fused kernel, bit for bit ``torch.optim.AdamW(fused=True)``:

        >>> opt = funcamp.adamw(0.1, weight_decay=0.5, fused=True)
        >>> p = torch.nn.Parameter(torch.ones(3))
        >>> ref = torch.optim.AdamW([p], lr=0.1, weight_decay=0.5, fused=True)
        >>> p.grad = torch.tensor([1.0, -2.0, 0.5])
        >>> ref.step()
        >>> params = {"w": torch.ones(3)}
        >>> updates, _ = opt.update({"w": p.grad}, opt.init(params), params)
        >>> torch.equal(funcamp.apply_updates(params, updates)["w"], p.detach())
        True
    """
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    return _adam(
        "adamw", learning_rate, b1, b2, eps, weight_decay, True, modes, mask, fused, amsgrad,
        maximize, differentiable,
    )  # fmt: skip
