"""A run moving between torch and funcamp: :meth:`funcamp.TrainState.from_torch` and
:meth:`funcamp.TrainState.to_torch`.

What moves: the module's params and buffers, the optimizer (translated by
:func:`funcamp.optim.from_torch`) and its state (:mod:`funcamp.optim._torch_state`'s table), the
GradScaler's state, and the scheduler's position (:mod:`funcamp.optim._torch_schedulers`).

One count, two positions: funcamp's schedule reads the optimizer's count of applied updates,
while torch's loop steps its scheduler on every iteration, a skipped one (GradScaler found an
inf) included. A scheduler ahead of the optimizer's step by ``d`` moves as a schedule shifted
by ``d``, so the next learning rate is torch's; moving back keeps the lead the torch objects had.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from funcamp._core.donation import refuse_consumed
from funcamp._core.tree import describe
from funcamp.optim._base import Optimizer
from funcamp.optim._torch_schedulers import (
    plateau_from_torch,
    plateau_to_torch,
    position,
    set_position,
    translate,
)
from funcamp.optim._torch_state import (
    check_groups,
    group_names,
    group_states,
    opt_state_from_torch,
    opt_state_to_torch,
    plain,
    torch_steps,
)
from funcamp.policy.policy import Policy
from funcamp.scaling.state import ScalerState
from funcamp.train.frozen import combine

__all__ = ["state_from_torch", "state_to_torch"]

PLATEAU = torch.optim.lr_scheduler.ReduceLROnPlateau


def _check_objects(api: str, module: Any, optimizer: Any, scheduler: Any, scaler: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"funcamp.{api}: `module` must be a torch.nn.Module, got {describe(module)}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"funcamp.{api}: `optimizer` must be a torch.optim.Optimizer, got {describe(optimizer)}"
        )
    if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
        raise ValueError(
            f"funcamp.{api}: `scheduler` must be an lr_scheduler of `optimizer` (or None), got "
            f"{describe(scheduler)}"
        )
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"funcamp.{api}: `scaler` must be a torch.amp.GradScaler (or None), got "
            f"{describe(scaler)}"
        )


def _counts(
    api: str, optimizer: Any, names: list[list[str]], scheduler: Any
) -> tuple[list[int], list[int]]:
    """Each group's count and the lead of the scheduler over it (see the module)."""
    steps = torch_steps(api, optimizer, names)
    stepped = scheduler is not None and not isinstance(scheduler, PLATEAU)
    at = position(scheduler) if stepped else 0
    counts, shifts = [], []
    for i, step in enumerate(steps):
        if step is None:  # torch keeps no count (SGD, Muon): the scheduler's, or 1 once stepped
            held = any(optimizer.state.get(p) for p in optimizer.param_groups[i]["params"])
            counts.append(at if stepped else int(held))
            shifts.append(0)
            continue
        if stepped and at < step:
            raise ValueError(
                f"funcamp.{api}: `scheduler` has stepped {at} times but `optimizer` param group "
                f"{i} {step} times; funcamp's schedule advances with every update, so a "
                "scheduler stepped less often (once an epoch) has no translation: step it after "
                "every optimizer.step() (and rescale its step sizes)"
            )
        counts.append(step)
        shifts.append(at - step if stepped else 0)
    return counts, shifts


def state_from_torch(
    create: Callable[..., Any],
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: Policy | str,
    scheduler: Any,
    scaler: Any,
    total_steps: int | None,
) -> tuple[Any, Optimizer]:
    """``TrainState.from_torch``; ``create`` is ``TrainState.create``."""
    api = "TrainState.from_torch"
    _check_objects(api, module, optimizer, scheduler, scaler)
    named = dict(module.named_parameters())
    names = group_names(api, optimizer, named)
    in_optimizer = {n for row in names for n in row}
    counts, shifts = _counts(api, optimizer, names, scheduler)
    opt = translate(
        optimizer,
        {k: v for k, v in named.items() if k in in_optimizer},
        scheduler,
        shifts,
        total_steps,
    )
    params = {k: plain(v).detach().clone() for k, v in named.items()}
    buffers = {k: plain(v).detach().clone() for k, v in module.named_buffers()}
    state = create(
        params,
        opt,
        policy,
        buffers=buffers,
        scaler=None if scaler is None else ScalerState.from_grad_scaler(scaler),
        model=module,
        trainable=lambda path: path in in_optimizer,
    )
    opt_state = opt_state_from_torch(api, optimizer, names, state.opt_state, counts)
    if isinstance(scheduler, PLATEAU):
        opt_state = plateau_from_torch(opt_state, scheduler)
    return state._replace(opt_state=opt_state), opt


# ------------------------------------------------------------------------------ to torch


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target.copy_(value)``, either of them a DTensor (a funcamp sharded state's leaf, an
    FSDP2 module's param): the whole value, placed as the target is."""
    value = plain(value)
    if isinstance(target, DTensor):
        value = distribute_tensor(
            value.to(target.to_local().device),
            target.device_mesh,
            target.placements,
            src_data_rank=None,
        )
    target.copy_(value)


def _writes(
    api: str, what: str, given: Any, own: Mapping[str, torch.Tensor]
) -> list[tuple[torch.Tensor, Any]]:
    if not isinstance(given, dict) or set(given) != set(own):
        extra = sorted(set(given) ^ set(own)) if isinstance(given, dict) else []
        raise ValueError(
            f"funcamp.{api}: the state's {what} must name exactly `module`'s (the state "
            f"TrainState.from_torch built for it), got {describe(given)}"
            + (f"; they differ in {extra[:3]}" if extra else "")
        )
    out = []
    for name, target in own.items():
        value = given[name]
        if not isinstance(value, torch.Tensor) or value.shape != target.shape:
            raise ValueError(
                f"funcamp.{api}: the state's {what} {name!r} must be a tensor of shape "
                f"{tuple(target.shape)}, got {describe(value)}"
            )
        out.append((target, value))
    return out


def _lead(optimizer: Any, names: list[list[str]], api: str, scheduler: Any) -> int:
    """How many steps ``scheduler`` is ahead of ``optimizer``'s first group (0 without steps)."""
    steps = torch_steps(api, optimizer, names)
    if not steps or steps[0] is None or not any(optimizer.state.values()):
        return 0
    return max(position(scheduler) - steps[0], 0)


def _scaler_state_dict(api: str, state_scaler: ScalerState, scaler: Any) -> dict | None:
    """What ``scaler.load_state_dict`` takes (None: nothing to write, a disabled one)."""
    sd = state_scaler.to_grad_scaler_state_dict()
    if sd and not scaler.is_enabled():
        raise ValueError(
            f"funcamp.{api}: `scaler` is a disabled GradScaler, but the state's scaler is a "
            f"{state_scaler.kind!r} one: pass an enabled GradScaler"
        )
    if not sd and scaler.is_enabled():
        raise ValueError(
            f"funcamp.{api}: the state's scaler is a 'noop' one, but `scaler` is an enabled "
            "GradScaler: pass a GradScaler(enabled=False), or none"
        )
    return sd or None


def state_to_torch(
    state: Any,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
) -> None:
    """``TrainState.to_torch``."""
    api = "TrainState.to_torch"
    refuse_consumed(api, state.scaler)
    _check_objects(api, module, optimizer, scheduler, scaler)
    named = dict(module.named_parameters())
    names = group_names(api, optimizer, named)
    # everything checked before anything is written
    writes = _writes(api, "params", combine(state.params, state.frozen), named)
    writes += _writes(api, "buffers", state.buffers, dict(module.named_buffers()))
    check_groups(api, state.opt_state, optimizer, names)
    scaler_sd = None if scaler is None else _scaler_state_dict(api, state.scaler, scaler)
    if isinstance(scheduler, PLATEAU):
        plateau_to_torch(api, state.opt_state, scheduler, optimizer)
    elif scheduler is not None:
        count = int(plain(group_states(state.opt_state)[0].count))
        set_position(api, scheduler, optimizer, count + _lead(optimizer, names, api, scheduler))
    opt_state_to_torch(api, state.opt_state, optimizer, names)  # after the groups' lr (ASGD)
    if scaler_sd is not None:
        scaler.load_state_dict(scaler_sd)
    with torch.no_grad():
        for target, value in writes:
            _write(target, value)
