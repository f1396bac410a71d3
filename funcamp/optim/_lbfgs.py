"""L-BFGS as a functional optimizer: torch.optim.LBFGS's step, on a flat copy of the params.

Its state is restored from, and returned as, a pytree of tensors.

L-BFGS needs the loss, not only a gradient: it evaluates the function several times a step (its
line search), as torch.optim.LBFGS calls its closure. ``update`` therefore takes the value
function. Its loop stops on conditions of tensor values (tolerances, the line search), so it
syncs with the host and is not for a compiled step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from funcamp._core.checks import (
    check_count,
    check_flag,
    check_int,
    check_number,
    check_state_type,
    flatten_params,
    learning_rate_fn,
)
from funcamp._core.tree import PyTree, describe, unflatten
from funcamp.optim._base import Optimizer, SetParam
from funcamp.optim._states import LbfgsState

__all__ = ["lbfgs"]
LearningRate = Any


def _flat(api: str, leaves: list[torch.Tensor]) -> torch.Tensor:
    dtypes = {x.dtype for x in leaves}
    devices = {x.device for x in leaves}
    if len(dtypes) > 1 or len(devices) > 1 or not all(x.is_floating_point() for x in leaves):
        raise ValueError(
            f"funcamp.{api}: the params must be floating tensors of one dtype on one device "
            f"(L-BFGS works on their concatenation, as torch.optim.LBFGS), got dtypes "
            f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}"
        )
    return torch.cat([x.detach().reshape(-1) for x in leaves])


def _maximize(api: str, maximize: Any) -> dict[str, bool]:
    """torch.optim.LBFGS's ``maximize`` keyword, where asked for (torch 2.14 and newer)."""
    check_flag(api, "maximize", maximize)
    if maximize and "maximize" not in inspect.signature(torch.optim.LBFGS).parameters:
        raise ValueError(
            f"funcamp.{api}: maximize=True needs torch.optim.LBFGS's `maximize` (torch 2.14 and "
            f"newer; this is torch {torch.__version__}): minimize the negated value instead"
        )
    return {"maximize": True} if maximize else {}


def lbfgs(
    learning_rate: LearningRate = 1.0,
    max_iter: int = 20,
    max_eval: int | None = None,
    tolerance_grad: float = 1e-7,
    tolerance_change: float = 1e-9,
    history_size: int = 100,
    line_search_fn: str | None = None,
    *,
    maximize: bool = False,
) -> Optimizer:
    """L-BFGS with torch.optim.LBFGS's semantics, defaults and numbers.

    Its ``step`` runs on a flat copy of the params (all of one dtype). Its state is restored
    from the :class:`funcamp.optim.LbfgsState` and returned as a new one.

    The update is ``update(grads, state, params, *, value_fn)``. ``value_fn(params) -> loss`` is
    what torch.optim.LBFGS's closure computes: a 0-d tensor differentiable in the params. It is
    evaluated up to ``max_eval`` times, its gradient by autograd. ``grads`` is not read (pass
    None); the first evaluation gives them. The update leaves are :class:`funcamp.optim.SetParam`
    (the new params). ``state.loss`` is the loss at the params the update started from (what
    torch.optim's ``step`` returns).

    The loop's stopping rules read tensor values, so the update syncs with the host. It is for an
    eager loop. It is not for ``unscale_and_step``, ``make_train_step`` or a compiled step, which
    have no ``value_fn`` to give. The state's history is ``history_size`` vectors of the params'
    total size, twice.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr``.
        max_iter: iterations per update (>= 1).
        max_eval: evaluations of ``value_fn`` per update (None: ``max_iter * 5 // 4``).
        tolerance_grad: stop when the gradient's largest entry is at most this (>= 0).
        tolerance_change: stop when the step or the loss changes by less (>= 0).
        history_size: the number of curvature pairs kept (>= 1).
        line_search_fn: None or ``"strong_wolfe"``.
        maximize: ascend ``value_fn``, as ``torch.optim.LBFGS(maximize=True)``. Needs torch 2.14
            or newer; an error on a torch whose LBFGS has no ``maximize``.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.LbfgsState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.lbfgs(line_search_fn="strong_wolfe")
        >>> params = {"x": torch.tensor([3.0, -1.0])}
        >>> value_fn = lambda p: ((p["x"] - torch.tensor([1.0, 2.0])) ** 2).sum()
        >>> updates, state = opt.update(None, opt.init(params), params, value_fn=value_fn)
        >>> funcamp.apply_updates(params, updates), state.loss
        ({'x': tensor([1.0000, 2.0000])}, tensor(13., dtype=torch.float64))
    """
    api = "lbfgs"
    max_iter = check_int(api, "max_iter", max_iter, minimum=1)
    max_eval = (
        max_iter * 5 // 4 if max_eval is None else check_int(api, "max_eval", max_eval, minimum=1)
    )
    tolerance_grad = check_number(api, "tolerance_grad", tolerance_grad)
    tolerance_change = check_number(api, "tolerance_change", tolerance_change)
    history_size = check_int(api, "history_size", history_size, minimum=1)
    if line_search_fn not in (None, "strong_wolfe"):
        raise ValueError(
            f"funcamp.{api}: `line_search_fn` must be None or 'strong_wolfe', got "
            f"{line_search_fn!r}"
        )
    lr_fn = learning_rate_fn(api, learning_rate)
    extra = _maximize(api, maximize)
    settings = dict(
        max_iter=max_iter, max_eval=max_eval, tolerance_grad=tolerance_grad,
        tolerance_change=tolerance_change, history_size=history_size,
        line_search_fn=line_search_fn, **extra,
    )  # fmt: skip

    def init(params: PyTree) -> LbfgsState:
        leaves, _ = flatten_params(api, params)
        flat = _flat(api, leaves) if leaves else torch.zeros(0)
        n, dt, dev = flat.numel(), flat.dtype, flat.device

        def zeros(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        i64, f64 = torch.int64, torch.float64
        return LbfgsState(
            count=zeros(dtype=torch.int32), func_evals=zeros(dtype=i64),
            n_iter=zeros(dtype=i64), d=zeros(n), t=zeros(dtype=f64),
            old_dirs=zeros(history_size, n), old_stps=zeros(history_size, n),
            ro=zeros(history_size), history=zeros(dtype=i64), h_diag=zeros(),
            prev_flat_grad=zeros(n), prev_loss=zeros(dtype=f64), loss=zeros(dtype=f64),
        )  # fmt: skip

    def update(
        grads: PyTree,
        state: Any,
        params: PyTree = None,
        *,
        value_fn: Callable[[PyTree], torch.Tensor] | None = None,
    ) -> tuple[PyTree, LbfgsState]:
        if not callable(value_fn):
            raise TypeError(
                f"funcamp.{api}: `value_fn` must be a function of the params returning the loss "
                f"(L-BFGS evaluates it, as torch.optim.LBFGS calls its closure), got "
                f"{describe(value_fn)}; call opt.update(None, state, params, value_fn=loss_fn) "
                "in an eager loop (unscale_and_step and make_train_step pass no loss function)"
            )
        check_state_type(api, state, LbfgsState, "an")
        check_count(api, "count", state.count)
        leaves, spec = flatten_params(api, params)
        flat = _flat(api, leaves)
        if state.d.shape != flat.shape or state.old_dirs.shape[0] != history_size:
            raise ValueError(
                f"funcamp.{api}: `state` was built for {state.d.numel()} param elements and a "
                f"history of {state.old_dirs.shape[0]}, got {flat.numel()} and {history_size}; "
                "build the state with init(params)"
            )
        x = flat.clone().requires_grad_(False)
        ref = torch.optim.LBFGS([x], lr=_lr(lr_fn(state.count)[0]), **settings)
        ref.state[x].update(_restore(state))
        shapes = [leaf.shape for leaf in leaves]
        sizes = [leaf.numel() for leaf in leaves]

        def closure() -> torch.Tensor:
            v = x.detach().requires_grad_(True)
            tree = unflatten(spec, [c.view(s) for c, s in zip(v.split(sizes), shapes)])
            loss = value_fn(tree)
            (x.grad,) = torch.autograd.grad(loss, v, allow_unused=True, materialize_grads=True)
            return loss.detach()

        loss = ref.step(closure)
        new = [SetParam(c.view(s).clone()) for c, s in zip(x.detach().split(sizes), shapes)]
        return unflatten(spec, new), _save(state, ref.state[x], loss, history_size)

    def rate(state: Any) -> torch.Tensor:
        lr = lr_fn(state.count)[0]
        return lr if isinstance(lr, torch.Tensor) else torch.tensor(lr, device=state.count.device)

    return Optimizer(init, update, learning_rate=rate)


def _lr(lr: Any) -> Any:
    return lr.clone() if isinstance(lr, torch.Tensor) else lr


def _restore(state: LbfgsState) -> dict[str, Any]:
    """torch.optim.LBFGS's per-param state from an :class:`LbfgsState`."""
    n_iter = int(state.n_iter)
    out: dict[str, Any] = {"func_evals": int(state.func_evals), "n_iter": n_iter}
    if n_iter == 0:
        return out
    k = int(state.history)
    out.update(
        d=state.d.clone(),
        t=float(state.t),
        old_dirs=[state.old_dirs[i].clone() for i in range(k)],
        old_stps=[state.old_stps[i].clone() for i in range(k)],
        ro=[state.ro[i].clone() for i in range(k)],
        H_diag=state.h_diag.clone(),
        prev_flat_grad=state.prev_flat_grad.clone(),
        prev_loss=float(state.prev_loss),
    )
    return out


def _save(old: LbfgsState, s: dict[str, Any], loss: Any, history_size: int) -> LbfgsState:
    """An :class:`LbfgsState` from torch.optim.LBFGS's per-param state after a step."""
    f64 = torch.float64
    dev = old.d.device

    def stacked(xs: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(like)
        for i, x in zip(range(history_size), xs):
            out[i] = x
        return out

    if "d" not in s:  # the first evaluation met the tolerance: nothing moved
        return old._replace(
            count=old.count + 1,
            func_evals=torch.tensor(s["func_evals"], device=dev),
            loss=torch.as_tensor(float(loss), dtype=f64, device=dev),
        )
    h = s["H_diag"]
    return LbfgsState(
        count=old.count + 1,
        func_evals=torch.tensor(s["func_evals"], device=dev),
        n_iter=torch.tensor(s["n_iter"], device=dev),
        d=s["d"].detach().clone(),
        t=torch.as_tensor(float(s["t"]), dtype=f64, device=dev),
        old_dirs=stacked(s["old_dirs"], old.old_dirs),
        old_stps=stacked(s["old_stps"], old.old_stps),
        ro=stacked(s["ro"], old.ro),
        history=torch.tensor(len(s["old_dirs"]), device=dev),
        h_diag=torch.as_tensor(h, dtype=old.h_diag.dtype, device=dev).clone(),
        prev_flat_grad=s["prev_flat_grad"].detach().clone(),
        prev_loss=torch.as_tensor(float(s["prev_loss"]), dtype=f64, device=dev),
        loss=torch.as_tensor(float(loss), dtype=f64, device=dev),
    )
