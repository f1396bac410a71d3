"""An exponential moving average of the weights, kept in the optimizer's state.

:func:`with_ema` wraps an optimizer. After each update it folds the new params into an average.
This is ``torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))``,
or timm's ``ModelEmaV3`` with its warm-up. The average is a tree of tensors shaped and placed like
the params. It is sharded like them: a DTensor param gives a DTensor average with the same
placements, since every operation on it is elementwise. So it compiles, checkpoints and skips with
the rest of the optimizer state. A step the loss scaler skips keeps the old state, and the average
with it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.checks import check_flag, check_int, check_real, flatten_grads
from funcamp._core.rounding import round_nearest
from funcamp._core.tree import NAMESPACE, PyTree, describe, unflatten
from funcamp.optim._base import Optimizer, apply_updates, check_optimizer, prepare_around
from funcamp.optim._paths import choose_ops

__all__ = ["EmaState", "ema_params", "with_ema"]


class EmaState(NamedTuple):
    """:func:`with_ema`'s state.

    Attributes:
        inner: the wrapped optimizer's state.
        count: the updates applied so far (0-d int32; a skipped step does not advance it).
        averaged: the times the average was updated (0-d int32; torch's ``n_averaged``).
        ema: the average, a tree like the params (their dtypes, shapes and placements).

    Example:
        >>> import torch, funcamp
        >>> state = funcamp.optim.with_ema(funcamp.sgd(0.1), 0.9).init({"w": torch.ones(1)})
        >>> state.ema, state.averaged
        ({'w': tensor([1.])}, tensor(0, dtype=torch.int32))
    """

    inner: Any
    count: torch.Tensor
    averaged: torch.Tensor
    ema: Any


def with_ema(
    optimizer: Optimizer,
    decay: float,
    *,
    every: int = 1,
    warmup: bool = False,
    warmup_gamma: float = 1.0,
    warmup_power: float = 2 / 3,
    min_decay: float = 0.0,
    update_after: int = 0,
) -> Optimizer:
    """``optimizer``, plus an exponential moving average of the params it produces.

    Every ``every``-th applied update, the average becomes ``lerp(ema, new_params, 1 - d)``
    (torch's ``_foreach_lerp_``, rounded as its CPU kernel). Without ``warmup``, ``d = decay``,
    except on the first averaging, which copies the params. This is ``AveragedModel(model,
    multi_avg_fn=get_ema_multi_avg_fn(decay))`` with ``update_parameters(model)`` called after
    every ``every``-th ``optimizer.step()``.

    With ``warmup``, ``d`` is timm's ``ModelEmaV3`` decay at step ``s``, the count of applied
    updates. Let ``t = s - update_after - 1``. Then ``d`` is 0 for ``t <= 0``, else ``1 - (1 + t /
    warmup_gamma) ** -warmup_power``, clamped to ``[min_decay, decay]``.

    Read the average with :func:`funcamp.optim.ema_params`. Evaluate on it with
    ``funcamp.make_eval_step(fn, policy)((ema_params, buffers), batch)``. ``update`` needs the
    params. The average needs the new params, so the wrapped optimizer's in-place fast paths are
    not used: a donated step runs the pure update.

    Args:
        optimizer: the :class:`~funcamp.Optimizer` whose params to average.
        decay: the decay, in [0, 1].
        every: average every this many applied updates (>= 1).
        warmup: use timm's warm-up of the decay.
        warmup_gamma: timm's ``warmup_gamma`` (> 0).
        warmup_power: timm's ``warmup_power`` (> 0).
        min_decay: timm's ``min_decay``, in [0, decay].
        update_after: timm's ``update_after_step`` (>= 0).

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.EmaState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.optim.with_ema(funcamp.sgd(1.0), decay=0.5)
        >>> params = {"w": torch.zeros(1)}
        >>> state = opt.init(params)
        >>> for _ in range(3):
        ...     updates, state = opt.update({"w": torch.ones(1)}, state, params)
        ...     params = funcamp.apply_updates(params, updates)
        >>> params, funcamp.optim.ema_params(state)
        ({'w': tensor([-3.])}, {'w': tensor([-2.2500])})
    """
    api = "optim.with_ema"
    check_optimizer(api, "optimizer", optimizer)
    decay = check_real(api, "decay", decay, low=0.0, high=1.0)
    every = check_int(api, "every", every, minimum=1)
    check_flag(api, "warmup", warmup)
    warmup_gamma = check_real(api, "warmup_gamma", warmup_gamma)
    warmup_power = check_real(api, "warmup_power", warmup_power)
    for name, value in (("warmup_gamma", warmup_gamma), ("warmup_power", warmup_power)):
        if value <= 0:
            raise ValueError(f"funcamp.{api}: `{name}` must be > 0, got {value!r}")
    min_decay = check_real(api, "min_decay", min_decay, low=0.0, high=decay)
    update_after = check_int(api, "update_after", update_after, minimum=0)

    def init(params: PyTree) -> EmaState:
        leaves = optree.tree_leaves(params, namespace=NAMESPACE)
        device = leaves[0].device if leaves else torch.device("cpu")
        zero = torch.zeros((), dtype=torch.int32, device=device)
        ema = optree.tree_map(lambda p: p.detach().clone(), params, namespace=NAMESPACE)
        return EmaState(optimizer.init(params), zero, zero.clone(), ema)

    def weight(count: torch.Tensor, averaged: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """``1 - d`` (a Python float, or a 0-d float64 tensor with warmup) and the copy flag."""
        if not warmup:
            return 1.0 - decay, averaged == 0
        t = (count + 1 - update_after - 1).to(torch.float64)
        d = 1.0 - (1.0 + t / warmup_gamma) ** -warmup_power
        d = torch.clamp(d, min=min_decay, max=decay)
        return 1.0 - d, t <= 0

    def update(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, EmaState]:
        state = _check(state)
        if params is None:
            raise ValueError(
                f"funcamp.{api}: `update` needs the params (the average is of the new params): "
                "call update(grads, state, params)"
            )
        flatten_grads(api, grads, params, need_params=True)
        updates, inner = optimizer.update(grads, state.inner, params)
        new_params = apply_updates(params, updates)
        ps, spec = optree.tree_flatten(new_params, namespace=NAMESPACE)
        es = spec.flatten_up_to(state.ema)
        w, copy = weight(state.count, state.averaged)
        ops = choose_ops([*ps, *es, state.count], device=ps[0].device if ps else None)
        pm, em = ops.to_math(ps), ops.to_math(es)
        if isinstance(w, float):
            mixed = ops.lerp(em, pm, w)
        else:  # torch's lerp with a tensor weight: from the nearer end, one multiply-add
            ws = ops.scalar(w)
            diff = ops.sub(pm, em)
            near = ops.fma(diff, ws, em)
            far = ops.fma(diff, ws - 1.0, pm)  # exact in float32 where it is used (w >= 0.5)
            mixed = ops.where(ws < 0.5, near, far)
        mixed = ops.where(copy, pm, mixed)
        new = [
            m if m.dtype == e.dtype else round_nearest(m, e.dtype).to(e.dtype)
            for m, e in zip(mixed, es)
        ]
        applies = (state.count + 1) % every == 0
        new = ops.where(applies, new, es) if every > 1 else new
        averaged = state.averaged + applies.to(torch.int32)
        return updates, EmaState(inner, state.count + 1, averaged, unflatten(spec, new))

    # the average is taken of new params: the plain update runs
    prepare = prepare_around(optimizer, update, lambda state: _check(state).inner)

    def rate(state: Any) -> Any:
        return optimizer.learning_rate(_check(state).inner)  # type: ignore[misc]

    return Optimizer(init, update, prepare, None if optimizer.learning_rate is None else rate)


def _check(state: Any) -> EmaState:
    if not isinstance(state, EmaState):
        raise TypeError(
            "funcamp.optim.with_ema: `state` must be an EmaState from this optimizer's init, "
            f"got {describe(state)}"
        )
    return state


def ema_params(opt_state: Any) -> PyTree:
    """The average of the params kept by :func:`with_ema`.

    ``opt_state`` must hold one :class:`EmaState`, at the top or inside a
    :func:`funcamp.chain`'s or another combinator's state.

    Args:
        opt_state: the optimizer state (``TrainState.opt_state``).

    Returns:
        The average, a tree like the params.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.chain(
        ...     funcamp.clip_by_global_norm(1.0), funcamp.optim.with_ema(funcamp.sgd(0.1), 0.9)
        ... )
        >>> funcamp.optim.ema_params(opt.init({"w": torch.ones(2)}))
        {'w': tensor([1., 1.])}
    """
    if isinstance(opt_state, EmaState):
        return opt_state.ema
    found = [
        x
        for x in optree.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, EmaState), namespace=NAMESPACE
        )
        if isinstance(x, EmaState)
    ]
    if len(found) != 1:
        raise ValueError(
            "funcamp.optim.ema_params: `opt_state` must hold exactly one EmaState (from "
            f"funcamp.optim.with_ema), got {len(found)}"
        )
    return found[0].ema
