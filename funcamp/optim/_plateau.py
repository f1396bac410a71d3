"""``torch.optim.lr_scheduler.ReduceLROnPlateau`` as state.

An optimizer wrapper scales its updates by a factor. :func:`plateau_step` lowers the factor when
a metric stops improving.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.checks import check_int, check_real
from funcamp._core.tree import NAMESPACE, PyTree, describe
from funcamp.optim._base import Optimizer, SetParam, check_optimizer, prepare_around

__all__ = ["PlateauState", "plateau_step", "reduce_on_plateau"]


class PlateauState(NamedTuple):
    """:func:`reduce_on_plateau`'s state (0-d tensors besides ``inner``).

    Attributes:
        inner: the wrapped optimizer's state.
        scale: the factor on the wrapped optimizer's learning rate (float64, 1 at first).
        lr: the wrapped optimizer's own learning rate for the next update (float64).
        best: the best metric so far (float64).
        num_bad: metrics since the best one (int32; torch's ``num_bad_epochs``).
        cooldown: steps of cooldown left (int32; torch's ``cooldown_counter``).

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.optim.reduce_on_plateau(funcamp.sgd(0.1))
        >>> state = opt.init({"w": torch.ones(1)})
        >>> state.scale, state.best
        (tensor(1., dtype=torch.float64), tensor(inf, dtype=torch.float64))
    """

    inner: Any
    scale: torch.Tensor
    lr: torch.Tensor
    best: torch.Tensor
    num_bad: torch.Tensor
    cooldown: torch.Tensor


class _Rule(NamedTuple):
    mode: str
    factor: float
    patience: int
    threshold: float
    threshold_mode: str
    cooldown: int
    min_lr: float
    eps: float


def reduce_on_plateau(
    optimizer: Optimizer,
    mode: str = "min",
    factor: float = 0.1,
    patience: int = 10,
    threshold: float = 1e-4,
    threshold_mode: str = "rel",
    cooldown: int = 0,
    min_lr: float = 0.0,
    eps: float = 1e-8,
) -> Optimizer:
    """``torch.optim.lr_scheduler.ReduceLROnPlateau`` on ``optimizer``.

    The optimizer's updates are scaled by a factor. :func:`funcamp.optim.plateau_step` (torch's
    ``scheduler.step(metric)``) multiplies the factor by ``factor`` when the metric has not
    improved for ``patience`` calls.

    The factor multiplies the wrapped optimizer's learning rate, a float or a schedule. (Torch's
    schedulers chained with ReduceLROnPlateau multiply ``group["lr"]`` the same way.)
    :func:`funcamp.optim.learning_rate` reports the product. Updates of SGD/Adam/AdamW are
    proportional to the learning rate, so scaling them is torch's step up to rounding. The
    low-precision modes and ``fused=True`` are refused, since their updates are new params.

    Args:
        optimizer: the :class:`~funcamp.Optimizer`; it must declare a learning rate.
        mode: ``"min"`` (lower is better) or ``"max"``.
        factor: the reduction, in [0, 1).
        patience: metrics without improvement tolerated (>= 0).
        threshold: the improvement that counts.
        threshold_mode: ``"rel"`` or ``"abs"``.
        cooldown: metrics ignored after a reduction (>= 0).
        min_lr: the lowest learning rate.
        eps: a reduction smaller than this is not made.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.PlateauState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.optim.reduce_on_plateau(funcamp.sgd(1.0), patience=0, factor=0.5)
        >>> state = opt.init({"w": torch.zeros(1)})
        >>> for loss in (1.0, 1.0, 0.5):
        ...     state = funcamp.optim.plateau_step(opt, state, loss)
        >>> funcamp.optim.learning_rate(opt, state)
        tensor(0.5000, dtype=torch.float64)
    """
    api = "optim.reduce_on_plateau"
    check_optimizer(api, "optimizer", optimizer)
    rate = optimizer.learning_rate
    if rate is None:
        raise ValueError(
            f"funcamp.{api}: `optimizer` must declare a learning rate (sgd, adam, adamw, ...), "
            "got one without"
        )
    if mode not in ("min", "max"):
        raise ValueError(f"funcamp.{api}: `mode` must be 'min' or 'max', got {mode!r}")
    if threshold_mode not in ("rel", "abs"):
        raise ValueError(
            f"funcamp.{api}: `threshold_mode` must be 'rel' or 'abs', got {threshold_mode!r}"
        )
    factor = check_real(api, "factor", factor, low=0.0)
    if factor >= 1.0:
        raise ValueError(f"funcamp.{api}: `factor` must be < 1.0, got {factor!r}")
    rule = _Rule(
        mode,
        factor,
        check_int(api, "patience", patience, minimum=0),
        check_real(api, "threshold", threshold),
        threshold_mode,
        check_int(api, "cooldown", cooldown, minimum=0),
        check_real(api, "min_lr", min_lr, low=0.0),
        check_real(api, "eps", eps, low=0.0),
    )

    def inner_lr(inner: Any) -> torch.Tensor:
        lr = rate(inner)
        if isinstance(lr, dict):  # multi_transform: one plateau over every group
            lr = next(iter(lr.values()))
        return lr.to(torch.float64)

    def init(params: PyTree) -> PlateauState:
        inner = optimizer.init(params)
        lr = inner_lr(inner)
        one = torch.ones((), dtype=torch.float64, device=lr.device)
        best = one * (math.inf if mode == "min" else -math.inf)
        zero = torch.zeros((), dtype=torch.int32, device=lr.device)
        return PlateauState(inner, one, lr, best, zero, zero.clone())

    def check(state: Any) -> PlateauState:
        if not isinstance(state, PlateauState):
            raise TypeError(
                f"funcamp.{api}: `state` must be a PlateauState from this optimizer's init, "
                f"got {describe(state)}"
            )
        return state

    def update(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, PlateauState]:
        state = check(state)
        updates, inner = optimizer.update(grads, state.inner, params)
        leaves = optree.tree_leaves(
            updates, is_leaf=lambda x: isinstance(x, SetParam), namespace=NAMESPACE
        )
        if any(isinstance(x, SetParam) for x in leaves):
            raise ValueError(
                f"funcamp.{api}: `optimizer`'s updates are new params (a low-precision mode or "
                "fused=True), which a factor cannot scale; use the optimizer without them"
            )
        scale = state.scale.to(torch.float32)
        updates = optree.tree_map(
            lambda u: u * scale.to(u.device) if isinstance(u, torch.Tensor) else u,
            updates,
            namespace=NAMESPACE,
        )
        return updates, state._replace(inner=inner, lr=inner_lr(inner))

    prepare = prepare_around(optimizer, update, lambda state: check(state).inner)

    def learning_rate(state: Any) -> torch.Tensor:
        state = check(state)
        return inner_lr(state.inner) * state.scale

    update.plateau_rule = rule  # type: ignore[attr-defined]  # read by plateau_step
    return Optimizer(init, update, prepare, learning_rate)


def plateau_step(optimizer: Optimizer, opt_state: Any, value: Any) -> Any:
    """torch's ``ReduceLROnPlateau.step(metric)``: the optimizer state after one metric.

    The metric is typically a loss on the validation set, once an epoch. The best metric, the
    count of metrics without improvement and the cooldown advance. The learning-rate factor
    drops by ``factor`` when the patience runs out. Pure tensor operations: no host sync,
    compilable.

    Args:
        optimizer: the :func:`reduce_on_plateau` optimizer (not a chain holding it).
        opt_state: an optimizer state holding its :class:`PlateauState` (at the top or inside
            a combinator's state, as ``TrainState.opt_state``).
        value: the metric, a float or a 0-d tensor.

    Returns:
        ``opt_state`` with the :class:`PlateauState` advanced.

    Example:
        >>> import torch, funcamp
        >>> plateau = funcamp.optim.reduce_on_plateau(funcamp.sgd(1.0), patience=1)
        >>> opt = funcamp.chain(funcamp.clip_by_global_norm(1.0), plateau)
        >>> state = opt.init({"w": torch.zeros(1)})
        >>> for loss in (1.0, 2.0, 2.0):
        ...     state = funcamp.optim.plateau_step(plateau, state, loss)
        >>> funcamp.optim.learning_rate(opt, state)
        tensor(0.1000, dtype=torch.float64)
    """
    api = "optim.plateau_step"
    rule = getattr(getattr(optimizer, "update", None), "plateau_rule", None)
    if not isinstance(optimizer, Optimizer) or rule is None:
        raise TypeError(
            f"funcamp.{api}: `optimizer` must be a funcamp.optim.reduce_on_plateau optimizer "
            f"(keep a reference to it when chaining), got {describe(optimizer)}"
        )
    found = [0]

    def advance(state: Any) -> Any:
        if not isinstance(state, PlateauState):
            return state
        found[0] += 1
        return _advance(rule, state, value)

    out = optree.tree_map(
        advance, opt_state, is_leaf=lambda x: isinstance(x, PlateauState), namespace=NAMESPACE
    )
    if found[0] != 1:
        raise ValueError(
            f"funcamp.{api}: `opt_state` must hold exactly one PlateauState, got {found[0]}"
        )
    return out


def _advance(rule: _Rule, s: PlateauState, value: Any) -> PlateauState:
    v = torch.as_tensor(value).to(device=s.best.device, dtype=torch.float64)
    if rule.mode == "min":
        bound = (
            s.best * (1.0 - rule.threshold)
            if rule.threshold_mode == "rel"
            else (s.best - rule.threshold)
        )
        better = v < bound
    else:
        bound = (
            s.best * (rule.threshold + 1.0)
            if rule.threshold_mode == "rel"
            else (s.best + rule.threshold)
        )
        better = v > bound
    best = torch.where(better, v, s.best)
    num_bad = torch.where(better, torch.zeros_like(s.num_bad), s.num_bad + 1)
    cooling = s.cooldown > 0
    cooldown = torch.where(cooling, s.cooldown - 1, s.cooldown)
    num_bad = torch.where(cooling, torch.zeros_like(num_bad), num_bad)
    reduce = num_bad > rule.patience
    old = s.lr * s.scale
    new = torch.clamp(old * rule.factor, min=rule.min_lr)
    scale = torch.where(reduce & (old - new > rule.eps), new / s.lr, s.scale)
    cooldown = torch.where(reduce, torch.full_like(cooldown, rule.cooldown), cooldown)
    num_bad = torch.where(reduce, torch.zeros_like(num_bad), num_bad)
    return s._replace(scale=scale, best=best, num_bad=num_bad, cooldown=cooldown)
