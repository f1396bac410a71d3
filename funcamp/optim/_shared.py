"""The helpers the built-in elementwise optimizers share.

* :func:`_build`: :func:`funcamp.optim.elementwise` with the low-precision mode's arguments
  as one tuple;
* the common argument checks;
* the steps' building blocks: the gradient prologue, ``p.add_(d, alpha=)``, the float64 step
  count and learning rate;
* :func:`_stateless`: the scaffolding of a stateless gradient transform;
* scheduled hyperparameters (:class:`Hyper`, :func:`hyperparameter`, :func:`hyperparameters`,
  :func:`at`, :func:`refuse_scheduled`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from funcamp._core.checks import (
    HyperFn,
    check_flag,
    check_number,
    flatten_grads,
    hyperparameter_fn,
)
from funcamp._core.tree import PyTree, describe, unflatten
from funcamp.optim._base import NewParams, Optimizer, Prepared
from funcamp.optim._elementwise import elementwise
from funcamp.optim._paths import Ops, choose_ops

__all__: list[str] = []
Tensors = list[torch.Tensor]
LearningRate = Any


class Hyper(NamedTuple):
    """A hyperparameter that follows a schedule of the step count: its name (the key of the
    ``hyper`` dict the algorithm's step receives) and ``count -> (value, bad)``."""

    name: str
    fn: HyperFn


def hyperparameter(
    api: str,
    name: str,
    value: Any,
    *,
    minimum: float = 0.0,
    maximum: float | None = None,
    maximum_open: bool = True,
) -> float | Hyper:
    """A float hyperparameter in ``[minimum, maximum)`` (``]`` unless ``maximum_open``), or,
    for a callable, a :class:`Hyper` (the schedule probed once, at the count 0)."""
    if callable(value) and not isinstance(value, torch.Tensor):
        fn = hyperparameter_fn(api, name, value, low=minimum, high=maximum, high_open=maximum_open)
        return Hyper(name, fn)
    return check_number(
        api, name, value, minimum=minimum, maximum=maximum, maximum_open=maximum_open
    )


def scheduled(*values: Any) -> bool:
    """Whether any of ``values`` is a :class:`Hyper`."""
    return any(isinstance(v, Hyper) for v in values)


def positive(value: Any) -> bool:
    """Whether a hyperparameter may be above 0 at a step: a schedule, or a float > 0 (the
    buffer or the param it needs is then kept)."""
    return isinstance(value, Hyper) or value > 0


def hyperparameters(*values: Any) -> dict[str, Hyper]:
    """The :class:`Hyper` among ``values``, by name (``build(hyper=)``)."""
    return {v.name: v for v in values if isinstance(v, Hyper)}


def at(hyper: dict[str, torch.Tensor] | None, value: Any) -> Any:
    """A hyperparameter's value this step: the float itself, or its schedule's 0-d float64
    value from the ``hyper`` dict the step received."""
    return hyper[value.name] if isinstance(value, Hyper) else value


def operand(ops: Ops, value: Any) -> Any:
    """A hyperparameter as a step's scalar operand: a Python float as it is (the kernels round
    it to float32), a schedule's value as a float32 0-d tensor on the update's device (the same
    float32 number)."""
    return ops.scalar(value) if isinstance(value, torch.Tensor) else value


def addcmul(ops: Ops, z: Tensors, x: Tensors, y: Tensors, value: Any, into: Any = None) -> Tensors:
    """``torch.addcmul(z, x, y, value=value)``: its kernel's ``z + (value * x) * y``, for a
    schedule's value too (``(x * value)`` rounded, then ``z + that * y``: the same bits)."""
    if isinstance(value, torch.Tensor):
        return ops.fma(ops.mul(x, ops.scalar(value)), y, z, into=into)
    return ops.addcmul(z, x, y, value, into=into)


def refuse_scheduled(api: str, why: str, **values: Any) -> None:
    """A clear error where a hyperparameter may not follow a schedule (``why`` says what
    needs it fixed and the way out)."""
    for name, value in values.items():
        if isinstance(value, Hyper):
            raise ValueError(f"funcamp.{api}: `{name}` is a schedule, but {why}")


class LowPrecision(NamedTuple):
    """An optimizer's low-precision mode, as its factory's keywords give it (see
    :mod:`funcamp.optim`): read by name, never by position."""

    master_weights: bool = False
    kahan: bool = False
    stochastic_rounding: bool = False
    seed: int = 0


def _build(
    api: str,
    state_type: type,
    step: Callable[..., Any],
    learning_rate: LearningRate,
    modes: LowPrecision,
    *,
    buffers: Any = None,
    needs_params: bool = False,
    hyper: dict[str, Hyper] | None = None,
    **options: Any,
) -> Optimizer:
    """:func:`funcamp.optim.elementwise` for ``step``, the low-precision mode given as
    :class:`LowPrecision`; ``hyper``: the scheduled
    hyperparameters (``step`` then gets ``hyper=``, their values this step, by name);
    ``options``: elementwise's others (``fused_kernel``, ``mask``, ``fill``, ...)."""
    return elementwise(
        api, state_type, step, learning_rate, buffers=buffers, needs_params=needs_params,
        hyper={name: h.fn for name, h in (hyper or {}).items()},
        master_weights=modes.master_weights, kahan=modes.kahan,
        stochastic_rounding=modes.stochastic_rounding, seed=modes.seed, **options,
    )  # fmt: skip


def check_fused_modes(api: str, modes: LowPrecision) -> None:
    """``fused=True`` runs torch's kernel on float32 params: no low-precision mode."""
    on = [m for m in ("master_weights", "kahan", "stochastic_rounding") if getattr(modes, m)]
    if on:
        raise ValueError(
            f"funcamp.{api}: `fused=True` runs torch's fused kernel on float32 params and "
            f"does not compose with {on[0]}=True (a low-precision mode); pass one or the other"
        )


def _common_args(api: str, maximize: bool, eps: float, weight_decay: float) -> tuple[float, float]:
    """The arguments most of these optimizers take: ``maximize`` checked, ``eps`` and
    ``weight_decay`` (both >= 0) returned."""
    check_flag(api, "maximize", maximize)
    return check_number(api, "eps", eps), check_number(api, "weight_decay", weight_decay)


def _common_args_scheduled(
    api: str, maximize: bool, eps: Any, weight_decay: Any
) -> tuple[Any, Any]:
    """:func:`_common_args` where ``eps`` and ``weight_decay`` may follow schedules (see
    :func:`hyperparameter`)."""
    check_flag(api, "maximize", maximize)
    return hyperparameter(api, "eps", eps), hyperparameter(api, "weight_decay", weight_decay)


def _kept(ops: Ops, buffers: dict, **values: Tensors) -> dict[str, Tensors]:
    """The new buffers by name, each kept in place of the old one (``ops.kept``)."""
    return {name: ops.kept(x, replaces=buffers[name]) for name, x in values.items()}


def _map(fn: Callable[..., torch.Tensor], *lists: Tensors) -> Tensors:
    """``fn`` leaf by leaf (plain torch ops: right on both paths, never in place)."""
    return [fn(*xs) for xs in zip(*lists)]


def _f64(lr: Any) -> Any:
    return lr.to(torch.float64) if isinstance(lr, torch.Tensor) else lr


def _python_pow(x: torch.Tensor, exponent: float) -> torch.Tensor:
    """Python's ``x ** exponent`` for a float64 0-d tensor ``x``: C's ``pow``, through torch's
    tensor-exponent ``pow`` (a Python exponent takes torch's special cases: ``sqrt`` for 0.5,
    ``rsqrt`` for -0.5, products for 2 and 3)."""
    return torch.pow(x, torch.tensor(exponent, dtype=x.dtype, device=x.device))


def _half_power(x: torch.Tensor) -> torch.Tensor:
    """Python's ``x ** 0.5`` for a float64 0-d tensor (torch.optim's
    ``bias_correction2 ** 0.5``). torch's ``sqrt``, correctly rounded, differs from C's
    ``pow(x, 0.5)`` in the last bit for a few steps in a hundred."""
    return _python_pow(x, 0.5)


def _steps(count: torch.Tensor) -> torch.Tensor:
    """torch.optim's ``step`` (1 on the first update) as a float64 0-d tensor."""
    return (count + 1).to(torch.float64)


def _prologue(ops: Ops, g: Tensors, p: Any, maximize: bool, weight_decay: Any) -> Tensors:
    """``grad = -grad`` (maximize; exact), then ``grad.add(param, alpha=weight_decay)`` (a
    schedule's value: always added, where 0 adds nothing)."""
    if maximize:
        g = ops.mul(g, -1.0)
    if isinstance(weight_decay, torch.Tensor) or weight_decay > 0:
        g = ops.fma(p, operand(ops, weight_decay), g)
    return g


def _decayed_prologue(
    ops: Ops, g: Tensors, p: Any, maximize: bool, weight_decay: float, decoupled: bool, lr64: Any
) -> tuple[Tensors, Any]:
    """NAdam's and RAdam's weight decay: ``(grad, p * (1 - lr * weight_decay))`` decoupled,
    else ``(grad + weight_decay * p, None)`` (see :func:`_prologue`; ``None`` without decay)."""
    if decoupled and weight_decay > 0:
        g = _prologue(ops, g, p, maximize, 0.0)
        return g, ops.mul(p, ops.scalar(1.0 - lr64 * weight_decay))
    return _prologue(ops, g, p, maximize, weight_decay), None


def _add_scaled(ops: Ops, d: Tensors, neg_lr: Any, p: Any) -> Tensors | NewParams:
    """The result of ``p.add_(d, alpha=neg_lr)``: the new params, rounded once as torch's
    kernel rounds them, or ``neg_lr * d`` without params."""
    if p is None:
        return ops.mul(d, neg_lr)
    return NewParams(ops.fma(d, neg_lr, p))


def _betas(api: str, b1: float, b2: float) -> tuple[float, float]:
    return check_number(api, "b1", b1, maximum=1.0), check_number(api, "b2", b2, maximum=1.0)


def _pair(api: str, name: str, value: Any) -> tuple[Any, Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"funcamp.{api}: `{name}` must be a pair of floats, got {describe(value)}")
    return value[0], value[1]


def _beta(api: str, name: str, value: Any) -> Any:
    """A decay in [0, 1): a Python float, or a 0-d floating tensor (as torch.optim.Adam
    accepts; its value is read here, once)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.is_floating_point() or value.requires_grad:
            raise TypeError(
                f"funcamp.{api}: `{name}` must be a float or a 0-d floating tensor without "
                f"grad, got {describe(value)}"
            )
        check_number(api, name, float(value), maximum=1.0)
        return value.detach().clone()
    return check_number(api, name, value, maximum=1.0)


def _stateless(api: str, fn: Callable[[Ops, Tensors, PyTree, PyTree], Tensors]) -> Optimizer:
    """A gradient transform with state ``()``: the new grads' leaves are
    ``fn(ops, leaves, grads, params)``; its prepared run may write into grads it owns."""

    def init(params: PyTree) -> tuple[()]:
        return ()

    def run(
        grads: PyTree, state: tuple[()], params: PyTree, owned: Sequence[torch.Tensor]
    ) -> tuple[PyTree, tuple[()]]:
        gs, _, spec = flatten_grads(api, grads, params, need_params=False)
        if not gs:
            return grads, state
        return unflatten(spec, fn(choose_ops(gs, owned=owned), gs, grads, params)), state

    def update(grads: PyTree, state: tuple[()], params: PyTree = None) -> tuple[PyTree, Any]:
        return run(grads, state, params, ())

    def prepare(grads: PyTree, state: tuple[()], params: PyTree = None) -> Prepared:
        return Prepared(None, lambda grads, writes: run(grads, state, params, writes.owned))

    return Optimizer(init, update, prepare)
