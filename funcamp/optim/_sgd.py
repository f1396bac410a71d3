"""torch.optim.SGD: its algorithm, written once, and its public factory (see ``_optimizers``
for how an algorithm gives torch.optim's numbers)."""

from __future__ import annotations

from typing import Any

from funcamp._core.checks import check_flag
from funcamp.optim._base import NewParams, Optimizer
from funcamp.optim._fused import SgdHyper, fused_sgd
from funcamp.optim._optimizers import LearningRate, Tensors
from funcamp.optim._paths import Ops
from funcamp.optim._shared import (
    LowPrecision,
    _build,
    at,
    check_fused_modes,
    hyperparameter,
    hyperparameters,
    operand,
    positive,
    refuse_scheduled,
    scheduled,
)
from funcamp.optim._states import SgdState

__all__ = ["SgdState", "sgd"]


def _sgd_step(hyper: SgdHyper) -> Any:
    momentum, dampening, nesterov = hyper.momentum, hyper.dampening, hyper.nesterov
    weight_decay, maximize = hyper.weight_decay, hyper.maximize
    if scheduled(momentum, dampening, weight_decay):
        return _scheduled_sgd_step(hyper)

    def step(ops: Ops, grads: Tensors, params: Any, buffers: dict, lr: Any, count: Any) -> Any:
        # torch.optim.SGD: grad = -grad (maximize); grad.add(p, alpha=weight_decay);
        # buf.mul_(momentum).add_(grad, alpha=1 - dampening) (buf = grad on the first step);
        # grad.add(buf, alpha=momentum) (nesterov) or grad = buf; p.add_(grad, alpha=-lr).
        if maximize:  # times -1 is exact: torch's -grad, bit for bit
            grads = ops.mul(grads, -1.0, into=grads)
        d, new = grads, {}
        if weight_decay > 0:
            d = ops.fma(params, weight_decay, d, into=d)
        free = d  # dead once the step is known: the result may go into it
        if momentum > 0:
            buf = ops.mul(buffers["momentum"], momentum, into=ops.target(buffers["momentum"]))
            if dampening:
                buf = ops.where(count == 0, d, ops.fma(d, 1.0 - dampening, buf))
            else:
                buf = ops.add(buf, d, into=buf)
            new["momentum"] = buf = ops.kept(buf, replaces=buffers["momentum"])
            if nesterov:
                d = free = ops.fma(buf, momentum, d, into=d)
            else:  # the step is the kept buffer; the result goes into the dead grads
                d = buf
        neg_lr = ops.scalar(-lr)
        if params is None:  # no params to add to: the rounded step itself
            return ops.mul(d, neg_lr, into=free), new
        return NewParams(ops.fma(d, neg_lr, params, into=ops.target(params, free))), new

    return step


def _scheduled_sgd_step(hyper: SgdHyper) -> Any:
    """SGD with a scheduled momentum, dampening or weight decay: torch's operations on each
    step's values. The buffer is kept whenever a momentum is given (torch's, when the momentum
    is 0 at a step, neither moves nor is read: a ``where`` selects that), and the term
    ``weight_decay * p`` is always added (0 adds nothing)."""
    momentum, dampening, nesterov = hyper.momentum, hyper.dampening, hyper.nesterov
    weight_decay, maximize = hyper.weight_decay, hyper.maximize
    moves = positive(momentum)
    decays = positive(weight_decay)

    def step(
        ops: Ops, grads: Tensors, params: Any, buffers: dict, lr: Any, count: Any, hyper: Any
    ) -> Any:
        m, damp, wd = at(hyper, momentum), at(hyper, dampening), at(hyper, weight_decay)
        if maximize:
            grads = ops.mul(grads, -1.0, into=grads)
        d, new = grads, {}
        if decays:
            d = ops.fma(params, operand(ops, wd), d, into=d)
        if moves:
            old = buffers["momentum"]
            buf = ops.mul(old, operand(ops, m))
            if scheduled(dampening) or dampening:
                buf = ops.where(count == 0, d, ops.fma(d, operand(ops, 1.0 - damp), buf))
            else:
                buf = ops.add(buf, d, into=buf)
            direction = ops.fma(buf, operand(ops, m), d) if nesterov else buf
            if scheduled(momentum):  # torch skips the momentum where it is 0
                on = m != 0
                buf = ops.where(on, buf, old)
                direction = ops.where(on, direction, d)
            kept = new["momentum"] = ops.kept(buf, replaces=old)
            d = kept if direction is buf else direction
        neg_lr = ops.scalar(-lr)
        if params is None:
            return ops.mul(d, neg_lr), new
        return NewParams(ops.fma(d, neg_lr, params, into=ops.target(params))), new

    return step


def sgd(
    learning_rate: LearningRate,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    dampening: float = 0.0,
    *,
    maximize: bool = False,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
    fused: bool = False,
) -> Optimizer:
    """Stochastic gradient descent with torch.optim.SGD's semantics.

    The direction is ``d = g + weight_decay * p`` (``g`` is negated first with ``maximize``). With
    momentum, ``buf = momentum * buf + (1 - dampening) * d`` (``buf = d`` on the first step). Then
    ``d = d + momentum * buf`` (nesterov) or ``d = buf``. The update is ``-lr * d``. Math runs in
    float32 for half params.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr`` (probed once when
            built). A value that is NaN, infinite or negative at run time skips the step.
        momentum: momentum factor (>= 0).
        nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        weight_decay: L2 penalty added to the gradient (>= 0).
        dampening: dampening for momentum, in [0, 1].
        maximize: ascend the objective: negate the gradients first, as
            ``torch.optim.SGD(maximize=True)`` does. The same as
            ``funcamp.chain(funcamp.negate_gradients(), funcamp.sgd(...))``.
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.
        fused: run torch's fused SGD kernel, bit for bit ``torch.optim.SGD(fused=True)``
            (with momentum its rounding differs from the default step's). Float32 params on
            one device; not under ``torch.func`` transforms.

    Returns:
        An :class:`Optimizer` whose state is a :class:`funcamp.optim.SgdState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.sgd(0.5, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> for _ in range(2):
        ...     updates, state = opt.update({"w": torch.ones(2)}, state, params)
        ...     params = funcamp.apply_updates(params, updates)
        >>> params, state.count
        ({'w': tensor([-0.4500, -0.4500])}, tensor(2, dtype=torch.int32))

        Gradient ascent, as ``torch.optim.SGD(maximize=True)``:

        >>> opt = funcamp.sgd(0.5, maximize=True)
        >>> params = {"w": torch.ones(2)}
        >>> updates, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([1.5000, 1.5000])}
    """
    api = "sgd"
    check_flag(api, "maximize", maximize)
    momentum = hyperparameter(api, "momentum", momentum)
    weight_decay = hyperparameter(api, "weight_decay", weight_decay)
    dampening = hyperparameter(api, "dampening", dampening, maximum=1.0, maximum_open=False)
    hyper_fns = hyperparameters(momentum, weight_decay, dampening)
    if hyper_fns:
        check_flag(api, "fused", fused)
        refuse_scheduled(
            api, "torch's fused kernel takes fixed values: pass floats, or fused=False",
            **(hyper_fns if fused else {}),
        )  # fmt: skip
        if nesterov and (
            (not scheduled(momentum) and momentum <= 0) or scheduled(dampening) or dampening != 0
        ):
            raise ValueError(
                f"funcamp.{api}: `nesterov` must be False unless momentum > 0 and dampening "
                "== 0 (a float)"
            )
        return _build(
            api, SgdState, _sgd_step(SgdHyper(momentum, dampening, nesterov, weight_decay,
                                              maximize)),
            learning_rate, LowPrecision(master_weights, kahan, stochastic_rounding, seed),
            buffers=("momentum",) if positive(momentum) else (),
            needs_params=positive(weight_decay), hyper=hyper_fns,
        )  # fmt: skip
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"funcamp.{api}: `nesterov` must be False unless momentum > 0 and dampening == 0, "
            f"got nesterov=True with momentum={momentum!r}, dampening={dampening!r}"
        )
    hyper = SgdHyper(momentum, dampening, nesterov, weight_decay, maximize)
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    check_flag(api, "fused", fused)
    in_place, copies = fused_sgd(hyper)
    if fused:
        check_fused_modes(api, modes)
    elif momentum > 0:  # the kernel's momentum rounds otherwise than the default step
        in_place = None
    return _build(
        api, SgdState, _sgd_step(hyper), learning_rate, modes,
        buffers=("momentum",) if momentum > 0 else (), needs_params=weight_decay > 0 or fused,
        fused_kernel=in_place, fused_update=copies if fused else None,
    )  # fmt: skip
