"""``headroom``: how close scaled gradients are to flushing to zero or overflowing a half dtype.

A loss scale moves every gradient by the same power of two. Cast into a half-precision dtype,
a scaled gradient element can *flush to zero* (it rounds to 0), land *subnormal* (it keeps fewer
significant bits) or *overflow* (it rounds past the dtype's largest finite value to inf).
:func:`headroom` counts each, per gradient leaf and overall. It gives the range of scales at
which nothing flushes and nothing overflows. Everything is computed with tensor ops and no host
sync. So it runs inside a compiled step (``make_train_step(..., headroom=True)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.tree import NAMESPACE, describe, dotted_path
from funcamp.scaling.state import ScalerState

__all__ = ["Headroom", "headroom"]

_DTYPES = (torch.float16, torch.bfloat16)


class Headroom(NamedTuple):
    """What :func:`headroom` measured: fractions of elements, the amax and the safe scale range.

    Every field is a 0-d float32 tensor (no host sync to build it).

    Attributes:
        underflow: fraction of all elements that are nonzero but flush to zero once scaled and
            cast (zeros count in the denominator). Their magnitude is at most half the dtype's
            smallest subnormal (the tie rounds to the even value, 0).
        subnormal: fraction of all elements that are nonzero and land in the dtype's subnormal
            range once scaled and cast. They survive with fewer significant bits.
        overflow: fraction of all elements that overflow once scaled and cast. They round past
            the dtype's max to inf, or are already inf or nan.
        amax: the largest magnitude among the *unscaled* gradients (nan when one is nan).
        log2_scale_min: scales ``s`` with ``log2(s) > log2_scale_min`` flush no nonzero element
            to zero (``-inf`` when every element is zero).
        log2_scale_max: scales ``s`` with ``log2(s) < log2_scale_max`` overflow no element
            (``inf`` when every element is zero; ``-inf`` when one is already non-finite).
        leaves: ``{path: Headroom}`` for each gradient leaf (the same fields; their ``leaves``
            is ``{}``). A path joins the keys with dots (``"fc.weight"``, ``"encoder.0"``).

    The open interval ``(log2_scale_min, log2_scale_max)`` is the range of scales that lose
    nothing measurable: nothing flushes, nothing overflows. When it is empty, the gradients span
    more than the dtype can hold at any one scale.

    Example:
        >>> import torch, funcamp
        >>> grads = {"w": torch.tensor([0.0, 1e-12, 1e-6, 1.0])}
        >>> h = funcamp.headroom(grads, funcamp.ScalerState.static(1024.0))
        >>> h.underflow, h.subnormal, h.overflow  # 1e-12 flushes, 1e-6 * 1024 is normal
        (tensor(0.2500), tensor(0.), tensor(0.))
        >>> h.leaves["w"].amax
        tensor(1.)
    """

    underflow: torch.Tensor
    subnormal: torch.Tensor
    overflow: torch.Tensor
    amax: torch.Tensor
    log2_scale_min: torch.Tensor
    log2_scale_max: torch.Tensor
    leaves: dict[str, Headroom]

    def summary(self) -> dict[str, torch.Tensor]:
        """The overall fields as a dict of 0-d tensors.

        ``make_train_step(..., headroom=True)`` puts this in ``metrics["headroom"]``.

        Example:
            >>> import torch, funcamp
            >>> h = funcamp.headroom([torch.tensor([1e5])], funcamp.ScalerState.static(1.0))
            >>> sorted(h.summary()), h.summary()["overflow"]
            (['amax', 'log2_scale_max', 'log2_scale_min', 'overflow', 'subnormal', 'underflow'], tensor(1.))
        """
        return {f: getattr(self, f) for f in self._fields if f != "leaves"}


class _Limits(NamedTuple):
    """Thresholds on a float32 magnitude ``a`` that give what ``a.to(dtype)`` rounds to."""

    flush: float  # a <= flush: rounds to 0 (half the smallest subnormal; the tie goes to 0)
    normal: float  # a >= normal: rounds to a normal number (the tie goes to the normal one)
    overflow: float  # a >= overflow: rounds to inf (max + half an ulp; the tie goes to inf)


def _limits(dtype: torch.dtype) -> _Limits:
    fi = torch.finfo(dtype)
    subnormal = fi.smallest_normal * fi.eps  # 2**(emin - mantissa bits)
    ulp_of_max = 2.0 ** (math.frexp(fi.max)[1] - 1) * fi.eps
    return _Limits(subnormal / 2, fi.smallest_normal - subnormal / 2, fi.max + ulp_of_max / 2)


class _Counts(NamedTuple):
    underflow: torch.Tensor
    subnormal: torch.Tensor
    overflow: torch.Tensor
    amax: torch.Tensor  # of the scaled magnitudes
    amin: torch.Tensor  # smallest nonzero finite scaled magnitude (inf if none)
    amax_unscaled: torch.Tensor  # of the unscaled magnitudes (not rounded at the scale)


def _count(
    scaled: torch.Tensor, lim: _Limits, scale: torch.Tensor, unscaled: torch.Tensor | None
) -> _Counts:
    """Counts of ``scaled``; the unscaled amax from ``unscaled`` when the caller has the
    gradients as given (``scaled`` may have lost their subnormal bits), else from ``scaled``
    divided by ``scale``."""
    a = scaled.abs()
    nonzero = a != 0  # nan counts as nonzero
    under = (nonzero & (a <= lim.flush)).sum()
    sub = ((a > lim.flush) & (a < lim.normal)).sum()
    over = (~(a < lim.overflow)).sum()  # inf, nan, and what rounds to inf
    if a.numel() == 0:
        zero = a.new_zeros((), dtype=torch.float32)
        return _Counts(under, sub, over, zero, zero + math.inf, zero)
    amax = a.amax()
    amin = torch.where(nonzero & torch.isfinite(a), a, math.inf).amin()
    amax_unscaled = amax / scale if unscaled is None else unscaled.abs().amax()
    return _Counts(under, sub, over, amax, amin, amax_unscaled)


def _result(
    counts: _Counts, numel: int, scale: torch.Tensor, lim: _Limits, leaves: dict[str, Headroom]
) -> Headroom:
    denom = float(max(numel, 1))
    amax_scaled = counts.amax
    # log2 of the scaled magnitudes' range, shifted back to scale 1: exact for powers of two.
    log2_scale = torch.log2(scale)
    low = math.log2(lim.flush) - (torch.log2(counts.amin) - log2_scale)
    high = torch.where(
        torch.isfinite(amax_scaled),
        math.log2(lim.overflow) - (torch.log2(amax_scaled) - log2_scale),
        -math.inf,
    )
    return Headroom(
        underflow=counts.underflow.to(torch.float32) / denom,
        subnormal=counts.subnormal.to(torch.float32) / denom,
        overflow=counts.overflow.to(torch.float32) / denom,
        amax=counts.amax_unscaled,
        log2_scale_min=low,
        log2_scale_max=high,
        leaves=leaves,
    )


def headroom_of(
    grads: Any,
    scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    scaled: bool,
    leaves: bool = True,
    include: Callable[[str], bool] | None = None,
) -> Headroom:
    """``headroom`` of ``grads``.

    With ``scaled=True`` they are already multiplied by ``scale`` (the train step's own
    gradients). ``leaves=False`` skips the per-leaf results. ``include``, a predicate of the
    leaf path, keeps only some leaves.
    """
    lim = _limits(dtype)
    paths, tensors, _ = optree.tree_flatten_with_path(grads, namespace=NAMESPACE)
    scale = scale.to(torch.float32)
    per_leaf: dict[str, Headroom] = {}
    all_counts: list[_Counts] = []
    total = 0
    for path, g in zip(paths, tensors):
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            continue
        if include is not None and not include(dotted_path(path)):
            continue
        x = g.to(torch.float32)
        counts = _count(x, lim, scale, None) if scaled else _count(x * scale, lim, scale, x)
        if leaves:
            per_leaf[dotted_path(path)] = _result(counts, x.numel(), scale, lim, {})
        all_counts.append(counts)
        total += x.numel()
    if not all_counts:
        zero = torch.zeros((), dtype=torch.float32, device=scale.device)
        all_counts.append(_Counts(zero, zero, zero, zero, zero + math.inf, zero))
    stacked = _Counts(*(torch.stack([getattr(c, f) for c in all_counts]) for f in _Counts._fields))
    overall = _Counts(
        stacked.underflow.sum(),
        stacked.subnormal.sum(),
        stacked.overflow.sum(),
        # nan-propagating max, as amax of one leaf is
        torch.where(stacked.amax.isnan().any(), math.nan, stacked.amax.amax()),
        stacked.amin.amin(),
        torch.where(stacked.amax_unscaled.isnan().any(), math.nan, stacked.amax_unscaled.amax()),
    )
    return _result(overall, total, scale, lim, per_leaf)


def headroom_dtype(policy: Any) -> torch.dtype:
    """The dtype ``make_train_step(..., headroom=True)`` measures against."""
    dtype = policy.compute_dtype
    return dtype if dtype in _DTYPES else torch.float16


def _check_dtype(dtype: Any, api: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise TypeError(
            f"funcamp.{api}: `dtype` must be torch.float16 or torch.bfloat16 (the dtype the "
            f"gradients would be cast to), got {dtype!r}"
        )
    return dtype


def headroom(grads: Any, scaler_state: ScalerState, dtype: torch.dtype = torch.float16) -> Headroom:
    """Measure how ``grads`` fare once multiplied by the loss scale and cast to ``dtype``.

    It works for each floating leaf of ``grads`` (the *unscaled* gradients), and for all of them
    together. It gives the fractions of elements that flush to zero, land subnormal or overflow.
    (That is, once multiplied by ``scaler_state.scale`` in float32 and cast to ``dtype``.) It gives
    the amax of the unscaled gradients, and the range of scales (log2) at which nothing flushes and
    nothing overflows. Fractions count every element, zeros included, in the denominator. The
    thresholds are those of round-to-nearest-even, so the counts equal what ``(g *
    scale).to(dtype)`` does.

    A parameter gradient is the end of a backward pass whose activation gradients ran in ``dtype``.
    So its headroom is a direct reading of where the loss scale sits against the dtype's range.
    Pure and traceable: tensor ops only, no host sync. It runs inside
    ``torch.compile(fullgraph=True)``.

    Args:
        grads: a pytree of gradients, unscaled (as :func:`funcamp.unscale` returns them).
            Non-floating leaves are ignored.
        scaler_state: the :class:`funcamp.ScalerState` whose ``scale`` to apply.
        dtype: the half dtype to measure against: ``torch.float16`` (default) or
            ``torch.bfloat16``.

    Returns:
        A :class:`Headroom` of 0-d float32 tensors, with ``leaves`` keyed by leaf path.

    Example:
        >>> import torch, funcamp
        >>> g = {"a": torch.tensor([2.0**-30, 2.0**-20, 0.0, 1.0])}
        >>> h = funcamp.headroom(g, funcamp.ScalerState.static(2.0**4))
        >>> h.underflow, h.subnormal  # 2**-26 flushes to zero; 2**-16 is subnormal in float16
        (tensor(0.2500), tensor(0.2500))
        >>> h.log2_scale_min, h.log2_scale_max  # any scale 2**k with 5 < k < 16 (about) is safe
        (tensor(5.), tensor(15.9996))
    """
    api = "headroom"
    if not isinstance(scaler_state, ScalerState):
        raise TypeError(
            f"funcamp.{api}: `scaler_state` must be a funcamp.ScalerState (for a bare scale "
            f"use ScalerState.static(scale)), got {describe(scaler_state)}"
        )
    _check_dtype(dtype, api)
    return headroom_of(grads, scaler_state.scale, dtype, scaled=False)
