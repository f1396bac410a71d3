"""torch's fused optimizer kernels as funcamp custom ops, for eager and compiled code alike.

``funcamp::fused_adam_`` (in place) and ``funcamp::fused_adam`` (on copies) call
``torch._fused_adam_``/``torch._fused_adamw_``. ``funcamp::fused_sgd_`` calls
``torch._fused_sgd_``. One call updates every leaf, or none where ``found_inf`` is set. The kernels
read the flag themselves, so there is no host sync.

Why custom ops: torch's own ops cannot be traced in place (functionalization refuses
``_fused_adamw_`` on a graph's inputs). A custom op that declares what it mutates is traced as
``auto_functionalized``, and inductor puts it back in place. A compiled step then calls torch's
kernel as an extern kernel, and inductor generates no code for the update. (On the CPU every
generated kernel is a C++ build on the first call.)

The ops have no autograd formula and no vmap rule. So the optimizers that use them refuse
``torch.func`` transforms (:func:`funcamp.adamw` with ``fused=True``). Or they take them on the
kernel path only (plain SGD's donated step).

Workaround of torch internals (docs/internals.md#workarounds):

- Root cause: torch.optim's fused kernels (torch._fused_adam_, _fused_adamw_, _fused_sgd_,
  _fused_adagrad_) have no public functional entry; torch.optim calls them by these names.
- Upstream: none filed.
- Why it is safe: called with torch.optim's own arguments; results equal
  torch.optim(fused=True) bit for bit (tests/test_fused_adam.py).
- Tested on: torch 2.13 and 2.14.
- Delete when: torch exposes a functional fused optimizer step.

"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch

from funcamp._core.context import compiling
from funcamp._core.tree import flatten, unflatten

__all__ = [
    "FUSED_ADAM",
    "FUSED_ADAM_COPIES",
    "FUSED_ADAGRAD",
    "FUSED_ADAGRAD_COPIES",
    "FUSED_SGD",
    "FUSED_SGD_COPIES",
    "AdamHyper",
    "SgdHyper",
    "fused_adagrad",
    "fused_adam",
    "fused_sgd",
]

Tensors = list[torch.Tensor]


def _adam_kernel(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    step: torch.Tensor,
    lr: float,
    lr_tensor: torch.Tensor | None,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    found_inf: torch.Tensor,
) -> None:
    """``max_exp_avg_sqs``: one per leaf with ``amsgrad``, else empty (as torch.optim passes)."""
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        [step] * len(params),  # the kernel reads each leaf's step; all leaves share one count
        lr=lr if lr_tensor is None else lr_tensor,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=amsgrad,
        maximize=maximize,
        grad_scale=None,
        found_inf=found_inf,
    )


def _adam_copies(params: Tensors, grads: Tensors, *args: Any) -> Tensors:
    """The kernel on fresh copies: the new params, exp_avgs, exp_avg_sqs and max_exp_avg_sqs
    (none without ``amsgrad``), in one list. ``args``: :func:`_adam_kernel`'s others."""
    exp_avgs, exp_avg_sqs, max_exp_avg_sqs, *rest = args
    ps, ms, vs, xs = (
        [x.clone() for x in leaves] for leaves in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    )
    _adam_kernel(ps, grads, ms, vs, xs, *rest)
    return ps + ms + vs + xs


# torch.library.custom_op infers the op's schema from this signature: _adam_kernel's
# arguments, returning the new tensors.
_adam_copies.__signature__ = inspect.signature(_adam_kernel).replace(  # type: ignore[attr-defined]
    return_annotation="list[torch.Tensor]"
)


def _sgd_kernel(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    lr: float,
    lr_tensor: torch.Tensor | None,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    maximize: bool,
    is_first_step: bool,
    found_inf: torch.Tensor,
) -> None:
    """``momentum_buffers``: one per leaf with momentum, else empty (as torch.optim passes)."""
    torch._fused_sgd_(
        params,
        grads,
        momentum_buffers,
        weight_decay=weight_decay,
        momentum=momentum,
        lr=lr if lr_tensor is None else lr_tensor,
        dampening=dampening,
        nesterov=nesterov,
        maximize=maximize,
        is_first_step=is_first_step,
        grad_scale=None,
        found_inf=found_inf,
    )


def _sgd_copies(params: Tensors, grads: Tensors, momentum_buffers: Tensors, *rest: Any) -> Tensors:
    """The kernel on fresh copies: the new params and momentum buffers, in one list."""
    ps, bufs = [x.clone() for x in params], [x.clone() for x in momentum_buffers]
    _sgd_kernel(ps, grads, bufs, *rest)
    return ps + bufs


_sgd_copies.__signature__ = inspect.signature(_sgd_kernel).replace(  # type: ignore[attr-defined]
    return_annotation="list[torch.Tensor]"
)


def _like_sgd(params: Tensors, grads: Any, momentum_buffers: Tensors, *args: Any) -> Tensors:
    return [torch.empty_like(x) for x in params + momentum_buffers]


def _adagrad_kernel(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state_sums: list[torch.Tensor],
    step: torch.Tensor,
    lr: float,
    lr_tensor: torch.Tensor | None,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    found_inf: torch.Tensor,
) -> None:
    torch._fused_adagrad_(
        params,
        grads,
        state_sums,
        [step] * len(params),  # the kernel reads each leaf's step; all leaves share one count
        lr=lr if lr_tensor is None else lr_tensor,
        lr_decay=lr_decay,
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
        grad_scale=None,
        found_inf=found_inf,
    )


def _adagrad_copies(params: Tensors, grads: Tensors, state_sums: Tensors, *rest: Any) -> Tensors:
    """The kernel on fresh copies: the new params and sums, in one list."""
    ps, sums = [x.clone() for x in params], [x.clone() for x in state_sums]
    _adagrad_kernel(ps, grads, sums, *rest)
    return ps + sums


_adagrad_copies.__signature__ = inspect.signature(_adagrad_kernel).replace(  # type: ignore[attr-defined]
    return_annotation="list[torch.Tensor]"
)


def _like_adagrad(params: Tensors, grads: Any, state_sums: Tensors, *args: Any) -> Tensors:
    return [torch.empty_like(x) for x in params + state_sums]


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _like_adam(
    params: list[torch.Tensor],
    grads: Any,
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    *args: Any,
) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in params + exp_avgs + exp_avg_sqs + max_exp_avg_sqs]


def _define(name: str, kernel: Any, fake: Any, torch_op: str, mutates: tuple[str, ...]) -> Any:
    """``funcamp::<name>``, a custom op mutating ``mutates``; None on a torch without
    ``torch.<torch_op>``. torch's schemas mark the grads mutable, but its kernels write them only
    when given a ``grad_scale`` (to store the unscaled grads: CPU and CUDA), which these ops never
    pass: the grads are inputs only. (Declared mutated, they also broke inductor's scheduler on a
    ResNet step: ``KeyError`` in ``compute_ancestors``, torch 2.13.)"""
    if not hasattr(torch, torch_op):  # pragma: no cover - older torch
        return None
    try:
        return getattr(torch.ops.funcamp, name).default  # already defined (a reimported module)
    except (AttributeError, RuntimeError):
        pass
    op_def = torch.library.custom_op(f"funcamp::{name}", kernel, mutates_args=mutates)
    op_def.register_fake(fake)
    return getattr(torch.ops.funcamp, name).default


_ADAM_STATE = ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")
#: ``funcamp::fused_adam_``: torch's fused Adam/AdamW kernel in place (None on an older torch).
FUSED_ADAM = _define("fused_adam_", _adam_kernel, _nothing, "_fused_adamw_", _ADAM_STATE)
#: ``funcamp::fused_adam``: the same on copies; returns new params + exp_avgs + exp_avg_sqs
#: (+ max_exp_avg_sqs with amsgrad).
FUSED_ADAM_COPIES = _define("fused_adam", _adam_copies, _like_adam, "_fused_adamw_", ())
#: ``funcamp::fused_sgd_``: torch's fused SGD kernel, in place (params and momentum buffers).
FUSED_SGD = _define(
    "fused_sgd_", _sgd_kernel, _nothing, "_fused_sgd_", ("params", "momentum_buffers")
)
#: ``funcamp::fused_adagrad_``: torch's fused Adagrad kernel, in place (params and sums).
FUSED_ADAGRAD = _define(
    "fused_adagrad_", _adagrad_kernel, _nothing, "_fused_adagrad_", ("params", "state_sums")
)
#: ``funcamp::fused_adagrad``: the same on copies; returns new params + sums.
FUSED_ADAGRAD_COPIES = _define(
    "fused_adagrad", _adagrad_copies, _like_adagrad, "_fused_adagrad_", ()
)
#: ``funcamp::fused_sgd``: the same on copies; returns new params + momentum buffers.
FUSED_SGD_COPIES = _define("fused_sgd", _sgd_copies, _like_sgd, "_fused_sgd_", ())


# --------------------------------------------------------------------------------------------
# the optimizers' kernels (in place on a donated state, and ``fused_update``)


def _lr_args(lr: Any, device: torch.device) -> tuple[float, torch.Tensor | None]:
    """A fused kernel's learning rate: a Python float as given (torch.optim passes it so), or a
    tensor (a schedule's value) on the params' device: float64 on the CPU, whose kernel reads
    it as a double (a schedule's float64 value gives torch.optim's float-``lr`` numbers: the
    step size ``lr / bias_correction1`` rounded once), float32 elsewhere."""
    if isinstance(lr, torch.Tensor):
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        return 0.0, lr.to(device=device, dtype=dtype)
    return float(lr), None


def _stepped_state(state: Any, skip: Any = None, **buffers: Any) -> Any:
    """The state with its count advanced (kept where ``skip`` skips) and ``buffers`` replaced."""
    count = state.count + 1 if skip is None else skip.advance(state.count)
    return state._replace(count=count.to(state.count.dtype), **buffers)


class SgdHyper(NamedTuple):
    """SGD's hyperparameters besides the learning rate: what both SGD's step and
    :func:`fused_sgd` read."""

    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    maximize: bool = False


def fused_sgd(hyper: SgdHyper) -> tuple[Any, Any]:
    """torch's fused SGD kernel as ``(in place on a donated state, on copies)``.

    One pass a leaf over the params (and the momentum buffers), or none where the step is
    skipped: the kernel reads the skip's flag itself, so there is no host sync. It gives
    ``torch.optim.SGD(fused=True)``'s numbers bit for bit, and without momentum the
    single-tensor step's too. Its first step with momentum sets the buffer to the gradient:
    with ``dampening`` that differs from the later steps' formula, so the copies run the kernel
    both ways and select on the count (the in-place kernel declines those).
    """
    momentum, dampening, nesterov = hyper.momentum, hyper.dampening, hyper.nesterov
    weight_decay, maximize = hyper.weight_decay, hyper.maximize
    if FUSED_SGD is None or FUSED_SGD_COPIES is None:  # pragma: no cover - older torch
        return None, None

    def args(ps: Tensors, grads: Tensors, state: Any, lr: Any, first: bool, found: Any) -> tuple:
        device = ps[0].device
        lr_value, lr_tensor = _lr_args(lr, device)
        bufs = flatten(state.momentum)[0] if momentum > 0 else []
        return (
            ps, grads, bufs, lr_value, lr_tensor, weight_decay, momentum, dampening, nesterov,
            maximize, first, found,
        )  # fmt: skip

    def in_place(ps: Tensors, grads: Tensors, state: Any, lr: Any, skip: Any, mask: Any) -> Any:
        if momentum > 0 and dampening != 0:
            return None  # the first step's buffer needs the count: the copies select on it
        found = skip.flag(ps[0].device)
        if compiling():
            FUSED_SGD(*args(ps, grads, state, lr, False, found))
            return _stepped_state(state, skip)
        try:  # a torch whose fused SGD has no kernel for this device raises before writing
            _sgd_kernel(*args(ps, grads, state, lr, False, found))
        except NotImplementedError:  # pragma: no cover - depends on the torch build
            return None
        return _stepped_state(state, skip)

    def copies(ps: Tensors, grads: Tensors, state: Any, lr: Any, mask: Any) -> Any:
        no_inf = torch.zeros((), dtype=torch.float32, device=ps[0].device)
        kernel = FUSED_SGD_COPIES if compiling() else _sgd_copies
        out = kernel(*args(ps, grads, state, lr, False, no_inf))
        if momentum > 0 and dampening != 0:
            first = kernel(*args(ps, grads, state, lr, True, no_inf))
            at_first = (state.count == 0).to(ps[0].device)
            out = [torch.where(at_first, a, b) for a, b in zip(first, out)]
        n = len(ps)
        if momentum == 0:
            return out, _stepped_state(state)
        spec = flatten(state.momentum)[1]
        return out[:n], _stepped_state(state, momentum=unflatten(spec, out[n:]))

    return in_place, copies


def fused_adagrad(lr_decay: float, weight_decay: float, eps: float, maximize: bool) -> Any:
    """torch's fused Adagrad kernel as ``(in place on a donated state, on copies)``: one pass
    a leaf over the params and sums, bit for bit ``torch.optim.Adagrad(fused=True)``; the
    kernel reads the skip's flag itself."""
    if FUSED_ADAGRAD is None or FUSED_ADAGRAD_COPIES is None:  # pragma: no cover - older torch
        return None, None

    def args(ps: Tensors, grads: Tensors, state: Any, lr: Any, found: Any) -> tuple:
        device = ps[0].device
        lr_value, lr_tensor = _lr_args(lr, device)
        step = (state.count + 1).to(device=device, dtype=torch.float32)
        sums = flatten(state.sum)[0]
        return (
            ps, grads, sums, step, lr_value, lr_tensor, lr_decay, weight_decay, eps, maximize,
            found,
        )  # fmt: skip

    def in_place(ps: Tensors, grads: Tensors, state: Any, lr: Any, skip: Any, mask: Any) -> Any:
        kernel = FUSED_ADAGRAD if compiling() else _adagrad_kernel
        kernel(*args(ps, grads, state, lr, skip.flag(ps[0].device)))
        return _stepped_state(state, skip)

    def copies(ps: Tensors, grads: Tensors, state: Any, lr: Any, mask: Any) -> Any:
        no_inf = torch.zeros((), dtype=torch.float32, device=ps[0].device)
        kernel = FUSED_ADAGRAD_COPIES if compiling() else _adagrad_copies
        out = kernel(*args(ps, grads, state, lr, no_inf))
        n, spec = len(ps), flatten(state.sum)[1]
        return out[:n], _stepped_state(state, sum=unflatten(spec, out[n:]))

    return in_place, copies


class AdamHyper(NamedTuple):
    """Adam's hyperparameters besides the learning rate: what both Adam's step
    (``_optimizers._adam_step``) and :func:`fused_adam` read."""

    b1: float | torch.Tensor
    b2: float | torch.Tensor
    eps: float
    weight_decay: float
    decoupled: bool
    amsgrad: bool = False
    maximize: bool = False


def fused_adam(hyper: AdamHyper) -> tuple[Any, Any]:
    """torch's fused Adam/AdamW kernel as ``(in place on a donated state, on copies)``.

    It updates params and moments in one pass a leaf (with ``amsgrad``, also the running maxima
    of the second moments). It matches ``torch.optim.Adam``/``AdamW(fused=True)`` bit for bit,
    ``amsgrad`` and ``maximize`` included. A weight-decay mask splits the leaves into two calls,
    as two param groups would.
    """
    b1, b2, eps, weight_decay = hyper.b1, hyper.b2, hyper.eps, hyper.weight_decay
    decoupled, amsgrad, maximize = hyper.decoupled, hyper.amsgrad, hyper.maximize

    def groups(n: int, mask: Any) -> list[tuple[list[int], float]]:
        if mask is None or weight_decay == 0:
            return [(list(range(n)), weight_decay)]
        on = [i for i, flag in zip(range(n), mask) if flag]
        off = [i for i, flag in zip(range(n), mask) if not flag]
        return [(idx, wd) for idx, wd in ((on, weight_decay), (off, 0.0)) if idx]

    def calls(ps: Tensors, grads: Tensors, state: Any, lr: Any, found: Any, mask: Any) -> Any:
        """``(leaf indices, the op's arguments)`` for each weight-decay group."""
        device = ps[0].device
        lr_value, lr_tensor = _lr_args(lr, device)
        step = (state.count + 1).to(device=device, dtype=torch.float32)
        ms, vs = flatten(state.exp_avg)[0], flatten(state.exp_avg_sq)[0]
        xs = flatten(state.max_exp_avg_sq)[0] if amsgrad else []
        return [
            (idx, (
                [ps[i] for i in idx], [grads[i] for i in idx], [ms[i] for i in idx],
                [vs[i] for i in idx], [xs[i] for i in idx] if amsgrad else [], step, lr_value,
                lr_tensor, b1, b2, wd, eps, decoupled, amsgrad, maximize, found,
            ))
            for idx, wd in groups(len(ps), mask)
        ]  # fmt: skip

    def in_place(ps: Tensors, grads: Tensors, state: Any, lr: Any, skip: Any, mask: Any) -> Any:
        kernel = FUSED_ADAM if compiling() else _adam_kernel  # eager: no custom-op dispatch
        for _, args in calls(ps, grads, state, lr, skip.flag(ps[0].device), mask):
            kernel(*args)
        return _stepped_state(state, skip)

    def copies(ps: Tensors, grads: Tensors, state: Any, lr: Any, mask: Any) -> Any:
        no_inf = torch.zeros((), dtype=torch.float32, device=ps[0].device)
        ms, spec = flatten(state.exp_avg)
        new_ps, new_ms, new_vs = list(ps), list(ms), flatten(state.exp_avg_sq)[0]
        new_xs = flatten(state.max_exp_avg_sq)[0] if amsgrad else []
        kernel = FUSED_ADAM_COPIES if compiling() else _adam_copies
        for idx, args in calls(ps, grads, state, lr, no_inf, mask):
            out = kernel(*args)
            k = len(idx)
            for j, i in zip(range(k), idx):
                new_ps[i], new_ms[i], new_vs[i] = out[j], out[k + j], out[2 * k + j]
                if amsgrad:
                    new_xs[i] = out[3 * k + j]
        buffers = {"exp_avg": unflatten(spec, new_ms), "exp_avg_sq": unflatten(spec, new_vs)}
        if amsgrad:
            buffers["max_exp_avg_sq"] = unflatten(spec, new_xs)
        return new_ps, _stepped_state(state, **buffers)

    return in_place, copies
