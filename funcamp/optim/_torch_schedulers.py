"""Where a torch lr_scheduler stands, as funcamp's step count reads it, and back.

funcamp's schedule is a function of the optimizer's count; a torch scheduler keeps its position
(``last_epoch``) and, for the chainable ones, the last learning rate in the optimizer's param
groups. Moving a run reads the position (:func:`position`) and translates the scheduler as if
fresh (:func:`translate`); moving it back writes the position, the learning rates funcamp's
schedule gives there, and whatever else the scheduler keeps (:data:`POSITIONS`: one entry per
scheduler with more state than ``last_epoch``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from funcamp._core.tree import describe
from funcamp.optim._base import Optimizer
from funcamp.optim._from_torch import _schedule, cycled_group, from_torch
from funcamp.optim._plateau import PlateauState
from funcamp.optim._schedules import _mark

__all__ = [
    "POSITIONS",
    "plateau_from_torch",
    "plateau_to_torch",
    "position",
    "set_position",
    "translate",
]

LRS = torch.optim.lr_scheduler


def position(scheduler: Any) -> int:
    """The number of ``scheduler.step()`` calls so far (its ``last_epoch``; a
    ``ChainedScheduler``'s is its schedulers')."""
    subs = getattr(scheduler, "_schedulers", None)
    if isinstance(scheduler, LRS.ChainedScheduler) and subs:
        return position(subs[0])
    return int(scheduler.last_epoch)


def fresh(scheduler: Any) -> Any:
    """A shallow copy of ``scheduler`` (and of the schedulers it holds) at position 0: what
    :func:`funcamp.optim.from_torch` translates (the translation reads only the scheduler's
    configuration)."""
    out = copy.copy(scheduler)
    if hasattr(out, "last_epoch"):
        out.last_epoch = 0
    subs = getattr(scheduler, "_schedulers", None)
    if subs is not None:
        out._schedulers = [fresh(s) for s in subs]
    return out


def _shifted(schedule: Callable[..., Any], by: int) -> Callable[..., Any]:
    if by == 0:
        return schedule

    def shifted(count: torch.Tensor) -> torch.Tensor:
        return schedule(count + by)

    base = getattr(schedule, "base_lr", None)
    return shifted if base is None else _mark(shifted, base)


def translate(
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, torch.Tensor],
    scheduler: Any,
    shifts: Sequence[int],
    total_steps: int | None,
) -> Optimizer:
    """:func:`funcamp.optim.from_torch` of ``optimizer`` and a stepped ``scheduler``: group
    ``i``'s schedule reads the count plus ``shifts[i]`` (the steps the scheduler took beyond the
    optimizer's)."""
    if scheduler is None or isinstance(scheduler, LRS.ReduceLROnPlateau):
        return from_torch(optimizer, params, scheduler, total_steps=total_steps)
    view = fresh(scheduler)
    proxy = copy.copy(optimizer)  # the same params and hyperparameters; the lr a schedule
    proxy.param_groups = [
        {**_cycled(view, group, i, by), "lr": _shifted(_schedule(view, i, total_steps), by)}
        for i, (group, by) in enumerate(zip(optimizer.param_groups, shifts))
    ]
    return from_torch(proxy, params)


def _cycled(scheduler: Any, group: Mapping[str, Any], i: int, by: int) -> dict[str, Any]:
    """``group`` with the momentum the scheduler cycles (OneCycleLR's, CyclicLR's) as its
    schedule, shifted as the learning rate's."""
    out = dict(cycled_group(scheduler, group, i))
    if callable(out.get("momentum")):
        out["momentum"] = _shifted(out["momentum"], by)
    betas = out.get("betas")
    if isinstance(betas, tuple) and callable(betas[0]):
        out["betas"] = (_shifted(betas[0], by), *betas[1:])
    return out


def momenta(scheduler: Any, optimizer: torch.optim.Optimizer, n: int) -> list[Any]:
    """The momentum (or first beta) of each group at count ``n`` where the scheduler cycles
    it (None elsewhere): what torch's groups hold after ``n`` steps."""
    at = torch.tensor(n)
    out: list[Any] = []
    for i, group in enumerate(optimizer.param_groups):
        cycled = _cycled(fresh(scheduler), group, i, 0)
        m = cycled.get("momentum")
        if not callable(m):
            m = cycled["betas"][0] if isinstance(cycled.get("betas"), tuple) else None
        out.append(float(m(at)) if callable(m) else None)
    return out


def learning_rates(scheduler: Any, n: int, groups: int) -> list[float]:
    """funcamp's learning rate of each group at count ``n`` (the translated schedules; a
    Python function of ``LambdaLR`` called on Python ints, as torch calls it)."""
    view = fresh(scheduler)
    at = torch.tensor(n)
    return [float(_schedule(view, i, max(n, 1))(at)) for i in range(groups)]


# ------------------------------------------------------------------------------- writing back


def _plain_position(s: Any, n: int) -> None:
    s.last_epoch = n
    s._step_count = n + 1  # the construction's step and one a step since


def _warm_restarts(s: Any, n: int) -> None:
    _plain_position(s, n)
    t_cur, t_i = n, s.T_0  # what n calls of step() leave (each wraps T_cur at T_i)
    while t_cur >= t_i:
        t_cur -= t_i
        t_i *= s.T_mult
    s.T_cur, s.T_i = t_cur, t_i


def _sequential(s: Any, n: int) -> None:
    _plain_position(s, n)
    bounds = [0, *s._milestones]
    for i, sub in enumerate(s._schedulers):
        # -1 until its milestone (SequentialLR undoes their construction's step), then a step
        # a step up to the step before the next milestone
        last = n if i + 1 == len(bounds) else min(n, bounds[i + 1] - 1)
        _write(sub, last - bounds[i] if n >= bounds[i] else -1)


def _chained(s: Any, n: int) -> None:
    for sub in s._schedulers:
        _write(sub, n)


#: scheduler class -> ``write(scheduler, n)``: its internal state after ``n`` steps (besides the
#: learning rates); a class not here keeps ``last_epoch`` alone.
POSITIONS: dict[type, Callable[[Any, int], None]] = {
    LRS.CosineAnnealingWarmRestarts: _warm_restarts,
    LRS.SequentialLR: _sequential,
    LRS.ChainedScheduler: _chained,
}


def _write(s: Any, n: int) -> None:
    POSITIONS.get(type(s), _plain_position)(s, n)
    s._last_lr = _group_lrs(s.optimizer)


def _group_lrs(optimizer: torch.optim.Optimizer) -> list[Any]:
    return [
        g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
        for g in optimizer.param_groups
    ]


def _set_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> None:
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def set_position(api: str, scheduler: Any, optimizer: torch.optim.Optimizer, n: int) -> None:
    """Put ``scheduler`` where ``n`` steps leave it, with funcamp's learning rates there (its
    next ``get_last_lr()``, and the param groups' ``lr``)."""
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise ValueError(f"funcamp.{api}: `scheduler` must be an lr_scheduler of `optimizer`")
    _set_lrs(optimizer, learning_rates(scheduler, n, len(optimizer.param_groups)))
    for group, m in zip(optimizer.param_groups, momenta(scheduler, optimizer, n)):
        if m is None:
            continue
        if getattr(scheduler, "use_beta1", False):
            group["betas"] = (m, *tuple(group["betas"])[1:])
        else:
            group["momentum"] = m
    _write(scheduler, n)


# --------------------------------------------------------------------------- ReduceLROnPlateau


def plateau_from_torch(state: PlateauState, plateau: Any) -> PlateauState:
    """``state`` (the translated optimizer's, whose learning rate is the group's current one)
    with the plateau's best metric, bad-epoch count and cooldown."""
    best = torch.full_like(state.best, float(plateau.best))
    return state._replace(
        best=best,
        num_bad=torch.full_like(state.num_bad, int(plateau.num_bad_epochs)),
        cooldown=torch.full_like(state.cooldown, int(plateau.cooldown_counter)),
    )


def plateau_to_torch(api: str, state: Any, plateau: Any, optimizer: torch.optim.Optimizer) -> None:
    """Write a :class:`~funcamp.optim.PlateauState` into ``plateau`` and the group's lr."""
    if not isinstance(state, PlateauState):
        raise ValueError(
            f"funcamp.{api}: `scheduler` is a ReduceLROnPlateau, but the state's optimizer "
            f"state is {describe(state)}, not a funcamp.optim.PlateauState (a state built "
            "with it: TrainState.from_torch(..., scheduler=plateau))"
        )
    if getattr(plateau, "optimizer", None) is not optimizer:
        raise ValueError(f"funcamp.{api}: `scheduler` must be an lr_scheduler of `optimizer`")
    _set_lrs(optimizer, [float(state.lr * state.scale)])
    plateau.best = float(state.best)
    plateau.num_bad_epochs = int(state.num_bad)
    plateau.cooldown_counter = int(state.cooldown)
    plateau._last_lr = _group_lrs(optimizer)
