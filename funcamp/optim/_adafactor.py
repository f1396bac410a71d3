"""Adafactor with torch.optim.Adafactor's semantics, as a plain ``Optimizer(init, update)``.

It is not built with :func:`funcamp.optim.elementwise`: its factored statistics are not shaped
like the params, and its step sizes are norms of whole leaves. It has the low-precision modes of
the elementwise optimizers all the same.

torch.optim reads its norms with ``.item()`` and computes the step sizes in Python doubles. Here
they are float64 0-d tensors, rounded to float32 where torch's kernels round a Python scalar. So
nothing syncs with the host.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed.tensor as dtensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from funcamp._core.checks import (
    check_count,
    check_flag,
    check_number,
    check_real,
    check_state_type,
    flatten_grads,
    flatten_params,
    learning_rate_fn,
    state_leaves,
)
from funcamp._core.numerics import math_dtype
from funcamp._core.tree import PyTree, describe, leaf_path, unflatten
from funcamp.optim._base import NewParams, Optimizer, Prepared
from funcamp.optim._modes import check_mode_state, init_mode, math_params, select_mode, to_updates
from funcamp.optim._shared import _f64, _half_power, _python_pow
from funcamp.optim._states import AdafactorState
from funcamp.optim._whole import Layout, shard_layouts, sum_across

__all__ = ["adafactor"]
LearningRate = Any
WHOLE = "its row and column means and its RMS norms are over whole params"


def _shapes(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``row_var``, ``col_var`` and ``variance`` shapes for a param (``(0,)``: not kept)."""
    if p.dim() > 1:
        row, col = list(p.shape), list(p.shape)
        row[-1] = 1
        col[-2] = 1
        return tuple(row), tuple(col), (0,)
    return (0,), (0,), tuple(p.shape)


def _like(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A step scalar ``x`` (a plain 0-d tensor) as an operand of ``p``'s math: replicated on
    ``p``'s mesh when ``p`` is a DTensor (DTensor's ops refuse plain tensors)."""
    if not isinstance(p, DTensor):
        return x
    mesh = p.device_mesh
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _zeros(shape: tuple[int, ...], p: torch.Tensor) -> torch.Tensor:
    """A zero statistic of ``shape`` for ``p``; for a DTensor ``p`` a DTensor on its mesh,
    sharded as ``p`` along the dimensions it keeps whole and replicated along those it
    reduces (a row mean of a row-sharded matrix is row-sharded, its column mean replicated)."""
    dtype = math_dtype(p.dtype)
    if not isinstance(p, DTensor):
        return torch.zeros(shape, dtype=dtype, device=p.device)
    placements = [
        q if isinstance(q, Shard) and len(shape) == p.dim() and shape[q.dim] > 1 else Replicate()
        for q in p.placements
    ]
    return dtensor.zeros(shape, dtype=dtype, device_mesh=p.device_mesh, placements=placements)


def _leaf(
    g: torch.Tensor,
    p: torch.Tensor,
    bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    lr64: Any,
    weight: torch.Tensor,
    rho: torch.Tensor,
    cfg: tuple[float | None, float, float, float, bool],
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One leaf of torch.optim's ``_single_tensor_adafactor``: the delta and the new buffers
    (``_multi_tensor_adafactor``'s with ``cfg``'s ``foreach``)."""
    eps1, eps2, d, weight_decay, foreach = cfg
    eps1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
    row_var, col_var, variance = bufs
    # alpha = max(eps2, ||p|| / sqrt(numel)) * rho_t, from the param before the decay
    norm = torch.linalg.vector_norm(p).to(torch.float64) / p.numel() ** 0.5  # Python's pow
    alpha = torch.clamp(norm, min=eps2) * _like(rho, norm)
    new_p = _decayed(p, lr64, weight_decay)
    if g.dim() > 1:
        row_mean = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square() / g.size(-1)
        row_var = torch.lerp(row_var, row_mean, weight)
        col_mean = torch.linalg.vector_norm(g, dim=-2, keepdim=True).square() / g.size(-2)
        col_var = torch.lerp(col_var, col_mean, weight)
        estimate = row_var @ col_var
        estimate = estimate / row_var.mean(dim=-2, keepdim=True).clamp(min=eps1)
    else:
        variance = torch.lerp(variance, g * g, weight)
        estimate = variance
    update = estimate.clamp(min=eps1 * eps1).rsqrt() * g
    unorm = torch.linalg.vector_norm(update).to(torch.float64)
    denom = torch.clamp(unorm / (update.numel() ** 0.5 * d), min=1.0)
    step = (-alpha / denom).to(update.dtype)
    return _stepped(new_p, update, step, foreach), (row_var, col_var, variance)


def _stepped(p: torch.Tensor, update: torch.Tensor, step: torch.Tensor, foreach: bool) -> Any:
    """The new param: ``p.add_(update, alpha=step)``, one rounding; foreach,
    ``update.mul_(step)`` then ``p.add_(update)``, two."""
    if foreach:
        return torch.add(p, torch.mul(update, step))
    return torch.addcmul(p, update, step)


def _decayed(p: torch.Tensor, lr64: Any, weight_decay: float) -> torch.Tensor:
    """``p * (1 - lr * weight_decay)`` (``p`` itself without weight decay)."""
    if weight_decay == 0:
        return p
    decay = 1.0 - lr64 * weight_decay  # a Python float or a float64 tensor
    return p * (_like(decay.to(p.dtype), p) if isinstance(decay, torch.Tensor) else decay)


def _on_shards(
    across: Any,
    lays: list[Layout],
    gs: list[torch.Tensor],
    pm: list[torch.Tensor],
    bufs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    lr64: Any,
    weights: list[torch.Tensor],
    rho: torch.Tensor,
    cfg: tuple[float | None, float, float, float, bool],
) -> list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """:func:`_leaf` for every leaf, on this rank's shards of a sharded step (``lays``): what
    spans the cut dimension is summed over the ranks, in two all-reduces for all the leaves.
    The first carries each sharded leaf's partial sum of squares of the param and, of a matrix
    cut along its rows (columns), its partial column (row) sums of squares of the gradient and,
    cut along its rows, its new ``row_var``'s partial sum over the rows (for the mean the
    estimate is divided by); the second each one's partial sum of squares of the update.
    A replicated leaf is whole on every rank: :func:`_leaf` as it is."""
    eps1, eps2, d, weight_decay, foreach = cfg
    out: list[Any] = [None] * len(gs)
    cut = [i for i, lay in enumerate(lays) if lay.dim is not None]
    for i, lay in enumerate(lays):
        if lay.dim is None:
            out[i] = _leaf(gs[i], pm[i], bufs[i], lr64, weights[i], rho, cfg)
    # the first all-reduce
    parts: list[torch.Tensor] = []
    new_rows: dict[int, torch.Tensor] = {}
    for i in cut:
        g, p, (row_var, _, _), lay = gs[i], pm[i], bufs[i], lays[i]
        n = len(lay.shape)
        parts.append(p.square().sum())
        if n > 1 and lay.dim == n - 2:  # rows cut: the column sums, then the rows' mean
            parts.append(g.square().sum(dim=-2, keepdim=True))
            row_mean = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square() / g.size(-1)
            new_rows[i] = torch.lerp(row_var, row_mean, weights[i])
            parts.append(new_rows[i].sum(dim=-2, keepdim=True))
        elif n > 1 and lay.dim == n - 1:  # columns cut: the row sums
            parts.append(g.square().sum(dim=-1, keepdim=True))
    summed = iter(sum_across(across, parts))
    updates: dict[int, torch.Tensor] = {}
    norms: dict[int, torch.Tensor] = {}
    for i in cut:
        g, p, (row_var, col_var, variance), lay = gs[i], pm[i], bufs[i], lays[i]
        e1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
        n, w = len(lay.shape), weights[i]
        norms[i] = next(summed)
        if n > 1:
            rows, cols = lay.shape[-2], lay.shape[-1]
            if lay.dim == n - 2:
                col_mean = next(summed) / rows
                row_var = new_rows[i]
                mean = next(summed) / rows
            else:
                if lay.dim == n - 1:
                    row_mean = next(summed) / cols
                else:
                    row_mean = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square() / cols
                col_mean = torch.linalg.vector_norm(g, dim=-2, keepdim=True).square() / rows
                row_var = torch.lerp(row_var, row_mean, w)
                mean = row_var.mean(dim=-2, keepdim=True)
            col_var = torch.lerp(col_var, col_mean, w)
            estimate = (row_var @ col_var) / mean.clamp(min=e1)
        else:
            variance = torch.lerp(variance, g * g, w)
            estimate = variance
        updates[i] = estimate.clamp(min=e1 * e1).rsqrt() * g
        out[i] = (row_var, col_var, variance)
    # the second all-reduce
    usq = sum_across(across, [updates[i].square().sum() for i in cut])
    for i, u2 in zip(cut, usq):
        p, update, numel = pm[i], updates[i], math.prod(lays[i].shape)
        norm = norms[i].sqrt().to(torch.float64) / numel**0.5
        alpha = torch.clamp(norm, min=eps2) * rho
        unorm = u2.sqrt().to(torch.float64)
        denom = torch.clamp(unorm / (numel**0.5 * d), min=1.0)
        step = (-alpha / denom).to(update.dtype)
        out[i] = (_stepped(_decayed(p, lr64, weight_decay), update, step, foreach), out[i])
    return out


class _Adafactor(NamedTuple):
    """An :func:`adafactor`'s configuration, as its update reads it."""

    mode: Any
    lr_fn: Any
    maximize: bool
    beta2_decay: float
    cfg: tuple[Any, ...]


def _checked_state(
    mode: Any, grads: PyTree, state: Any, params: PyTree
) -> tuple[Any, Any, Any, list]:
    """The grads, params and buffers of one update, checked against the state's structure."""
    api = "adafactor"
    check_state_type(api, state, AdafactorState, "an")
    gs, ps, spec = flatten_grads(api, grads, params, need_params=True)
    check_count(api, "count", state.count)
    bufs = [state_leaves(api, f, getattr(state, f), spec) for f in AdafactorState._fields[1:4]]
    for i, p in zip(range(len(ps)), ps):
        for f, want, x in zip(AdafactorState._fields[1:4], _shapes(p), (b[i] for b in bufs)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                raise ValueError(
                    f"funcamp.{api}: `state.{f}` leaf {leaf_path(grads, i)} must be a tensor "
                    f"of shape {want}, got {describe(x)}; build the state with init(params)"
                )
    check_mode_state(api, mode, state.low, ps, spec, grads)
    return gs, ps, spec, bufs


def _run(
    how: _Adafactor, grads: PyTree, state: Any, params: PyTree, new_params: bool
) -> tuple[PyTree, Any]:
    """One Adafactor update with the configuration ``how``."""
    api, mode, lr_fn, maximize, cfg = "adafactor", how.mode, how.lr_fn, how.maximize, how.cfg
    beta2_decay = how.beta2_decay
    gs, ps, spec, bufs = _checked_state(mode, grads, state, params)
    count = state.count
    if not gs:
        return unflatten(spec, []), state._replace(count=count + 1)
    on_shards = shard_layouts(api, WHOLE, grads)
    lr = lr_fn(count)[0]
    lr64 = _f64(lr)
    t = (count + 1).to(torch.float64)
    # torch's one_minus_beta2_t = step ** beta2_decay and rho_t = min(lr, 1 / step ** 0.5):
    # Python doubles (C's pow); the lerp weight rounded to float32 by the kernel
    weight = _python_pow(t, beta2_decay).to(torch.float32)
    inv_sqrt = 1.0 / _half_power(t)
    if isinstance(lr64, torch.Tensor):
        rho = torch.minimum(lr64.to(t.device), inv_sqrt)
    else:
        rho = torch.clamp(inv_sqrt, max=lr64)
    pm = math_params(api, mode, state.low, ps, spec)
    gs = [-g.to(p.dtype) if maximize else g.to(p.dtype) for g, p in zip(gs, pm)]
    ws = [_like(weight.to(p.device, p.dtype), p) for p in pm]
    leaf_bufs = [tuple(b[i] for b in bufs) for i in range(len(gs))]
    if on_shards is None:
        results = [_leaf(g, p, b, lr64, w, rho, cfg) for g, p, b, w in zip(gs, pm, leaf_bufs, ws)]
    else:
        across, lays = on_shards
        results = _on_shards(across, lays, gs, pm, leaf_bufs, lr64, ws, rho, cfg)
    news, new = [], ([], [], [])
    for new_p, leaf_new in results:
        news.append(new_p)
        for out, x in zip(new, leaf_new):
            out.append(x)
    updates, low = to_updates(
        api, mode, state.low, count, NewParams(news), ps, spec, new_params=new_params
    )
    trees = [unflatten(spec, xs) for xs in new]
    return updates, AdafactorState(count + 1, *trees, low)


def adafactor(
    learning_rate: LearningRate = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> Optimizer:
    """Adafactor (Shazeer and Stern 2018) with torch.optim.Adafactor's semantics and defaults.

    The second moment of a matrix (of each trailing matrix of a higher-dimensional param) is kept
    factored. It is kept as its row and column means (``row_var``, ``col_var``), in O(rows + cols)
    memory. A vector keeps it whole (``variance``). Their decay is ``1 - t**beta2_decay``. The
    update ``g / sqrt(v)`` is clipped to RMS ``d``. It is then scaled by the relative step size,
    ``max(eps2, rms(p)) * min(lr, 1 / sqrt(t))``. The weight decay is decoupled: ``p *= 1 - lr *
    weight_decay``.

    Sharded params: the column means of a row-sharded matrix (the row means of a column-sharded
    one), the mean of ``row_var`` and the RMS norms are over whole params. Under
    ``parallel=Sharded(mesh)`` the update runs on each rank's shards and all-reduces their
    partial sums; nothing is gathered. That is two all-reduces a step, all leaves packed in
    float32 (float64 for float64 params). The first carries ``cols + 2`` floats per matrix
    sharded along its rows (``rows + 1`` along its columns); the second, 1 float per leaf. The
    result is the unsharded computation with the sums in another order. On DTensor params,
    DTensor's collectives reduce the same sums, with the same result within float32 rounding.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr``.
        beta2_decay: the decay exponent of the second moment (<= 0).
        eps: ``(eps1, eps2)``, the floors of the variance estimate and of the params' RMS.
            ``eps1=None`` means the param dtype's machine epsilon.
        d: the update's clipping threshold (>= 1).
        weight_decay: decoupled weight decay (>= 0).
        maximize: ascend the objective (the gradients are negated first).
        foreach: True gives the numbers of torch's foreach step (``foreach=True``); None or
            False those of its for-loop step (torch's default on the CPU).
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.AdafactorState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.adafactor(0.01)
        >>> params = {"w": torch.ones(2, 3), "b": torch.ones(3)}
        >>> state = opt.init(params)
        >>> state.row_var["w"].shape, state.col_var["w"].shape, state.variance["b"].shape
        (torch.Size([2, 1]), torch.Size([1, 3]), torch.Size([3]))
        >>> grads = {"w": torch.ones(2, 3), "b": torch.ones(3)}
        >>> updates, state = opt.update(grads, state, params)
        >>> funcamp.apply_updates(params, updates)["b"]
        tensor([0.9900, 0.9900, 0.9900])
    """
    api = "adafactor"
    check_flag(api, "maximize", maximize)
    beta2_decay = check_real(api, "beta2_decay", beta2_decay, low=None, high=0.0, high_open=False)
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise TypeError(f"funcamp.{api}: `eps` must be a pair (eps1, eps2), got {describe(eps)}")
    eps1 = None if eps[0] is None else check_number(api, "eps[0]", eps[0])
    eps2 = check_number(api, "eps[1]", eps[1])
    d = check_number(api, "d", d, minimum=1.0)
    weight_decay = check_number(api, "weight_decay", weight_decay)
    if foreach is not None:
        check_flag(api, "foreach", foreach)
    mode = select_mode(api, master_weights, kahan, stochastic_rounding, seed)
    lr_fn = learning_rate_fn(api, learning_rate)
    cfg = (eps1, eps2, d, weight_decay, bool(foreach))

    def init(params: PyTree) -> AdafactorState:
        leaves, spec = flatten_params(api, params)
        device = leaves[0].device if leaves else torch.device("cpu")
        shapes = [_shapes(p) for p in leaves]
        bufs = [
            unflatten(
                spec,
                [_zeros(s[i], p) for s, p in zip(shapes, leaves)],
            )
            for i in range(3)
        ]
        return AdafactorState(
            torch.zeros((), dtype=torch.int32, device=device),
            *bufs,
            init_mode(mode, leaves, spec, seed),
        )

    how = _Adafactor(mode, lr_fn, maximize, beta2_decay, cfg)

    def update(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        return _run(how, grads, state, params, False)

    def prepare(grads: PyTree, state: Any, params: PyTree = None) -> Prepared:
        _checked_state(mode, grads, state, params)
        unusable = lr_fn(state.count)[1]
        return Prepared(unusable, lambda g, writes: _run(how, g, state, params, writes.new_params))

    def rate(state: Any) -> torch.Tensor:
        lr = lr_fn(state.count)[0]
        return lr if isinstance(lr, torch.Tensor) else torch.tensor(lr, device=state.count.device)

    return Optimizer(init, update, prepare, rate)
