"""Errors that name the fix: a ``torch.optim`` optimizer given where a funcamp one is needed."""

from __future__ import annotations

from typing import Any

import torch

from funcamp._core.tree import describe

__all__ = ["optimizer_type_error"]


def _num(x: Any) -> str:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    return repr(x)


def _equivalent(optimizer: torch.optim.Optimizer) -> tuple[str, list[str]]:
    """``(funcamp call, caveats)`` for a torch.optim optimizer, from its first param group."""
    g = optimizer.param_groups[0] if optimizer.param_groups else dict(optimizer.defaults)
    name = type(optimizer).__name__
    caveats = []
    if g.get("maximize"):
        caveats.append("maximize=True has no funcamp equivalent (negate the loss)")
    if len(optimizer.param_groups) > 1:
        caveats.append(
            f"it has {len(optimizer.param_groups)} param groups and the values above are the "
            "first's; give each group its own optimizer with funcamp.multi_transform({label: "
            "optimizer}, labels)"
        )
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
        decoupled = isinstance(optimizer, torch.optim.AdamW) or g.get("decoupled_weight_decay")
        fn = "adamw" if decoupled else "adam"
        b1, b2 = g["betas"]
        call = (
            f"funcamp.{fn}({_num(g['lr'])}, b1={_num(b1)}, b2={_num(b2)}, eps={_num(g['eps'])}, "
            f"weight_decay={_num(g['weight_decay'])})"
        )
        sig = f"funcamp.{fn}(lr, b1, b2, eps, weight_decay)"
    elif isinstance(optimizer, torch.optim.SGD):
        call = (
            f"funcamp.sgd({_num(g['lr'])}, momentum={_num(g['momentum'])}, "
            f"nesterov={_num(g['nesterov'])}, weight_decay={_num(g['weight_decay'])}, "
            f"dampening={_num(g['dampening'])})"
        )
        sig = "funcamp.sgd(lr, momentum, nesterov, weight_decay, dampening)"
    else:
        return "", [
            f"funcamp has no {name}: use funcamp.sgd, funcamp.adam, funcamp.adamw or "
            "funcamp.lion, or write one with funcamp.optim.elementwise (or a "
            "funcamp.Optimizer(init, update) pair)"
        ]
    if g.get("amsgrad"):
        caveats.append("amsgrad=True has no funcamp equivalent")
    return f"{call}, i.e. {sig} with its values", caveats


def optimizer_type_error(api: str, optimizer: Any) -> TypeError:
    """The error for an ``optimizer`` that is not a :class:`funcamp.Optimizer`."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return TypeError(
            f"funcamp.{api}: `optimizer` must be a funcamp.Optimizer (e.g. funcamp.adamw(1e-3)), "
            f"got {describe(optimizer)}"
        )
    name = f"torch.optim.{type(optimizer).__name__}"
    call, caveats = _equivalent(optimizer)
    msg = (
        f"funcamp.{api}: `optimizer` must be a funcamp.Optimizer (pure init/update functions "
        f"over the params pytree), got a {name}"
    )
    if call:
        msg += f"; its funcamp equivalent is {call}"
    if caveats:
        msg += "; " + "; ".join(caveats)
    msg += (
        ". funcamp optimizers hold no params: build the state with "
        "funcamp.TrainState.create(params, opt, policy) from funcamp.params_and_buffers(model) "
        "(see the migration guide)"
    )
    return TypeError(msg)
