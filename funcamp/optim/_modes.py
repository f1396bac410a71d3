"""Low-precision modes: what an optimizer does with float16/bfloat16 params.

An algorithm computes float32 deltas, and :func:`to_updates` turns them into update leaves. For
float32/float64 params (and half params without a mode) they stay plain deltas. For half params
in a mode, the leaf is a :class:`funcamp.optim.SetParam` holding the new half param, computed by
the mode:

* ``master_weights``: the delta is added to a float32 copy in the state. The param becomes that
  copy rounded to nearest.
* ``kahan``: a compensation buffer in the param dtype carries each step's rounding error into
  the next.
* ``stochastic_rounding``: the new param is rounded up or down at random. The bits come from a
  counter-based hash of seed, count, leaf and element, never the global RNG.

All rounding is done on the float32 bit pattern (:mod:`funcamp._core.rounding`), so eager and
inductor agree.
"""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.checks import check_count, check_state_like, state_leaves
from funcamp._core.numerics import as_dtype, is_half, math_dtype
from funcamp._core.rounding import (
    bits_from_key,
    computed_once,
    leaf_keys,
    round_nearest,
    round_stochastic,
)
from funcamp._core.tree import NAMESPACE, PyTree, describe, unflatten
from funcamp.optim._base import NewParams, Optimizer, SetParam

__all__ = [
    "KahanState",
    "MasterWeightsState",
    "StochasticRoundingState",
    "check_mode_state",
    "init_from_exact",
    "init_mode",
    "math_params",
    "select_mode",
    "to_updates",
]
MODES = ("master_weights", "kahan", "stochastic_rounding")


class MasterWeightsState(NamedTuple):
    """State of ``master_weights=True``: float32 copies of the half params (empty tensors for
    the others).

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.sgd(0.1, master_weights=True)
        >>> opt.init({"w": torch.ones(2, dtype=torch.bfloat16)}).low.master["w"].dtype
        torch.float32
    """

    master: PyTree


class KahanState(NamedTuple):
    """State of ``kahan=True``: compensation buffers in the param dtype (empty tensors for
    float32 params).

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.sgd(0.1, kahan=True)
        >>> opt.init({"w": torch.ones(2, dtype=torch.bfloat16)}).low.compensation["w"]
        tensor([0., 0.], dtype=torch.bfloat16)
    """

    compensation: PyTree


class StochasticRoundingState(NamedTuple):
    """State of ``stochastic_rounding=True``: the 0-d int64 seed of the hash.

    Example:
        >>> import torch, funcamp
        >>> funcamp.sgd(0.1, stochastic_rounding=True, seed=7).init({"w": torch.ones(1)}).low
        StochasticRoundingState(seed=tensor(7))
    """

    seed: torch.Tensor


_STATE = {
    "master_weights": MasterWeightsState,
    "kahan": KahanState,
    "stochastic_rounding": StochasticRoundingState,
}


def select_mode(
    api: str, master_weights: bool, kahan: bool, stochastic_rounding: bool, seed: Any
) -> str | None:
    """The chosen mode (at most one), or None; checks ``seed``."""
    chosen = [
        name
        for name, on in zip(MODES, (master_weights, kahan, stochastic_rounding), strict=True)
        if on
    ]
    if len(chosen) > 1:
        raise ValueError(
            f"funcamp.{api}: at most one of `master_weights`, `kahan`, `stochastic_rounding` "
            f"must be True, got {', '.join(chosen)}"
        )
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"funcamp.{api}: `seed` must be an int, got {seed!r}")
    return chosen[0] if chosen else None


#: Set by :func:`init_from_exact`: ``{id(half param): the float32 tensor it was rounded
#: from}``. ``master_weights`` starts each master from that tensor instead of the rounded param.
_EXACT_MASTERS: contextvars.ContextVar[dict[int, torch.Tensor] | None] = contextvars.ContextVar(
    "funcamp_exact_masters", default=None
)


def init_from_exact(optimizer: Optimizer, params: PyTree, originals: PyTree) -> PyTree:
    """``optimizer.init(params)`` for ``params`` that were rounded from ``originals``.

    ``originals`` has the same structure, usually float32. Float32 master weights start from
    the originals, so they are exact rather than rounded through the half dtype. Everything else
    is what ``init`` builds. Leaves are matched by identity. So this works through every wrapper
    that hands the same params (or a subset of them) to the inner ``init``.
    """
    leaves = optree.tree_leaves(params, namespace=NAMESPACE)
    exact = optree.tree_leaves(originals, namespace=NAMESPACE)
    table = {
        id(p): o
        for p, o in zip(leaves, exact)
        if isinstance(p, torch.Tensor)
        and isinstance(o, torch.Tensor)
        and is_half(p)
        and o.shape == p.shape
        and o.dtype in (torch.float32, torch.float64)
    }
    token = _EXACT_MASTERS.set(table)
    try:
        return optimizer.init(params)
    finally:
        _EXACT_MASTERS.reset(token)


def _master_of(p: torch.Tensor) -> torch.Tensor:
    exact = (_EXACT_MASTERS.get() or {}).get(id(p))
    if exact is not None:  # a copy: the state never shares memory with the caller's tensors
        return exact.detach().to(device=p.device, dtype=torch.float32, copy=True)
    return p.to(torch.float32)


def _empty(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


def init_mode(mode: str | None, leaves: list[torch.Tensor], spec: Any, seed: int) -> PyTree:
    """The mode's initial state for these param leaves (``()`` without a mode)."""
    if mode is None:
        return ()
    if mode == "master_weights":
        master = [_master_of(p) if is_half(p) else _empty(p) for p in leaves]
        return MasterWeightsState(unflatten(spec, master))
    if mode == "kahan":
        comp = [torch.zeros_like(p) if is_half(p) else _empty(p) for p in leaves]
        return KahanState(unflatten(spec, comp))
    device = leaves[0].device if leaves else torch.device("cpu")
    return StochasticRoundingState(torch.tensor(seed, dtype=torch.int64, device=device))


def check_mode_state(
    api: str, mode: str | None, low: Any, ps: list[torch.Tensor], spec: Any, grads: PyTree
) -> None:
    """A mode's state must match the params (metadata only)."""
    if mode is None:
        return
    want = _STATE[mode]
    if not isinstance(low, want):
        raise TypeError(
            f"funcamp.{api}: `state.low` must be a {want.__name__} (this optimizer uses "
            f"{mode}=True), got {describe(low)}; build the state with init(params)"
        )
    if mode == "stochastic_rounding":
        check_count(api, "low.seed", low.seed, torch.int64)
        return
    half = [is_half(p) for p in ps]
    if mode == "master_weights":
        name, leaves = "low.master", state_leaves(api, "low.master", low.master, spec)
        dtypes = [torch.float32 if h else p.dtype for h, p in zip(half, ps)]
    else:
        name = "low.compensation"
        leaves = state_leaves(api, name, low.compensation, spec)
        dtypes = [p.dtype for p in ps]
    check_state_like(api, name, leaves, ps, dtypes, grads, empty=[not h for h in half])


def math_params(
    api: str, mode: str | None, low: PyTree, params: list[torch.Tensor], spec: Any
) -> list[torch.Tensor]:
    """The params as the math sees them: the float32 master for half params in master mode,
    else the params in their math dtype."""
    if mode == "master_weights":
        master = state_leaves(api, "low.master", low.master, spec)
        return [m if is_half(p) else p for m, p in zip(master, params)]
    return [as_dtype(p, math_dtype(p.dtype)) for p in params]


def to_updates(
    api: str,
    mode: str | None,
    low: PyTree,
    count: torch.Tensor,
    result: Any,
    params: list[torch.Tensor] | None,
    spec: Any,
    new_params: bool = False,
) -> tuple[PyTree, PyTree]:
    """Turn an algorithm's result into update leaves and the mode's new state.

    ``result`` is a list of float32 deltas, or :class:`NewParams` (the new params in the math
    dtype, as torch.optim's last op on the param rounds them). With ``new_params`` the caller
    installs the updates: new params become :class:`SetParam` leaves, bit for bit; without it
    they become deltas (``new - p``). Half params in a mode always get a :class:`SetParam`
    computed by the mode.
    """
    exact = isinstance(result, NewParams)
    values = list(result.values) if exact else list(result)
    if params is None:
        return unflatten(spec, values), low
    if mode is None:
        return unflatten(
            spec, [_plain(v, p, exact, new_params) for v, p in zip(values, params)]
        ), low
    updates: list[Any] = []
    if mode == "master_weights":
        master = state_leaves(api, "low.master", low.master, spec)
        new_master = []
        for v, p, m in zip(values, params, master):
            if is_half(p):
                m = v if exact else m + v
                updates.append(SetParam(round_nearest(m, p.dtype).to(p.dtype)))
            else:
                updates.append(_plain(v, p, exact, new_params))
            new_master.append(m)
        return unflatten(spec, updates), MasterWeightsState(unflatten(spec, new_master))
    if mode == "kahan":
        comp = state_leaves(api, "low.compensation", low.compensation, spec)
        new_comp = []
        for v, p, c in zip(values, params, comp):
            if is_half(p):
                pf = p.to(torch.float32)
                y = (v - pf if exact else v) + c.to(torch.float32)
                new_p = round_nearest(pf + y, p.dtype)
                c = round_nearest(y - (new_p - pf), p.dtype).to(p.dtype)
                updates.append(SetParam(new_p.to(p.dtype)))
            else:
                updates.append(_plain(v, p, exact, new_params))
            new_comp.append(c)
        return unflatten(spec, updates), KahanState(unflatten(spec, new_comp))
    # Every leaf's key at once, in a buffer of its own under compile (see computed_once): the
    # same bits as funcamp._core.rounding.random_bits(low.seed, count, i, shape) for leaf i.
    keys = computed_once(leaf_keys(low.seed, count, len(values)))
    for i, v, p in zip(range(len(values)), values, params):
        if is_half(p):
            noise = bits_from_key(keys[i], p.shape)
            target = v if exact else p.to(torch.float32) + v
            new_p = round_stochastic(target, p.dtype, noise)
            updates.append(SetParam(new_p.to(p.dtype)))
        else:
            updates.append(_plain(v, p, exact, new_params))
    return unflatten(spec, updates), low


def _plain(v: torch.Tensor, p: torch.Tensor, exact: bool, new_params: bool) -> Any:
    """One leaf's update without a mode: a delta stays one; new params are a
    :class:`SetParam` (rounded to nearest into a half param) when the caller installs them,
    else the delta to them."""
    if not exact:
        return v
    if new_params:
        return SetParam(v if v.dtype == p.dtype else round_nearest(v, p.dtype).to(p.dtype))
    return v - as_dtype(p, v.dtype)
