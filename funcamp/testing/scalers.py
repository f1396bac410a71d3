"""The Hypothesis strategy for :class:`funcamp.ScalerState` values."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcamp import ScalerState
from funcamp.testing._hypothesis import st
from funcamp.testing._values import _log2_ceil, _log2_floor

__all__ = ["scaler_states"]

_F32_MAX = float(torch.finfo(torch.float32).max)

_KINDS = ("dynamic", "static", "noop")

_INT32_MAX = 2**31 - 1


def _scale_values(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Powers of two in ``[lo, hi]`` (shrinking towards 1), any float32 in it, and its ends
    (where a scale overflows when it grows, or underflows when it backs off)."""
    lo_k, hi_k = _log2_ceil(lo), _log2_floor(hi)
    branches = [st.just(hi), st.just(lo), st.floats(lo, hi, width=32)]
    if lo_k <= hi_k:
        branches.insert(0, st.integers(lo_k, hi_k).map(lambda k: 2.0**k))
    return st.one_of(branches)


# torch's growth and backoff factors, else any (a growth of 1.0001 among them)
_FACTORS = st.one_of(
    st.just((2.0, 0.5)),
    st.tuples(
        st.one_of(st.floats(1.0, 16.0, exclude_min=True), st.just(1.0001)),
        st.floats(0.0, 1.0, exclude_min=True, exclude_max=True),
    ),
)
# min_scale and max_scale: each one state in four (they hide what the scale does at its ends);
# 0-4: neither, 5: min_scale, 6: max_scale, 7: both
_SCALE_BOUNDS = st.integers(0, 7)
_OCTAVES = st.integers(0, 64)  # how far min_scale/max_scale lie from the scale


@dataclasses.dataclass(frozen=True)
class _Ranges:
    """The strategies of one ``scaler_states()`` call, built once."""

    kinds: st.SearchStrategy[str] | str
    scales: st.SearchStrategy[float]
    growth_intervals: st.SearchStrategy[int]
    hysteresis: st.SearchStrategy[int] | int
    skipped: st.SearchStrategy[int] | int
    lo: float
    hi: float


def _one(draw: Callable[..., Any], choices: st.SearchStrategy[Any] | Any) -> Any:
    """A draw from ``choices``, or ``choices`` itself when it is the only value."""
    return draw(choices) if isinstance(choices, st.SearchStrategy) else choices


def _range(lo: int, hi: int) -> st.SearchStrategy[int] | int:
    return lo if lo == hi else st.integers(lo, hi)


_EDGE = st.booleans()


def _edge_or_any(draw: Callable[..., Any], size: int, edge: int) -> int:
    """``edge`` one time in two, else any int in ``[0, size)``, shrinking towards 0."""
    return edge if draw(_EDGE) else draw(st.integers(0, size - 1))


def _dynamic(
    draw: Callable[..., Any], r: _Ranges, device: torch.device | str | None
) -> ScalerState:
    growth_factor, backoff_factor = draw(_FACTORS)
    growth_interval = draw(r.growth_intervals)
    hysteresis = _one(draw, r.hysteresis)
    scale = draw(r.scales)
    bounds = draw(_SCALE_BOUNDS)
    octaves = draw(_OCTAVES) if bounds > 4 else 0
    state = ScalerState.dynamic(
        scale,
        growth_factor,
        backoff_factor,
        growth_interval,
        min_scale=max(r.lo, scale * 2.0**-octaves) if bounds in (5, 7) else None,
        max_scale=min(r.hi, scale * 2.0**octaves) if bounds in (6, 7) else None,
        hysteresis=hysteresis,
        device=device,
    )
    # A tracker one clean step short of growing, or one overflow short of backing off (1), is
    # where bookkeeping goes wrong: each is drawn one time in two. The hysteresis tracker
    # shrinks towards a full one.
    growth = _edge_or_any(draw, growth_interval, growth_interval - 1)
    hyst = draw(st.integers(0, 2 * hysteresis + 1))  # uniform: small
    hyst = hysteresis - hyst if hyst <= hysteresis else 1
    return dataclasses.replace(
        state,
        growth_tracker=torch.full_like(state.growth_tracker, growth),
        hysteresis_tracker=torch.full_like(state.hysteresis_tracker, hyst),
        skipped=torch.full_like(state.skipped, _one(draw, r.skipped)),
    )


@st.composite
def _scaler_state(
    draw: Callable[..., Any], r: _Ranges, device: torch.device | str | None
) -> ScalerState:
    kind = _one(draw, r.kinds)
    if kind == "dynamic":
        return _dynamic(draw, r, device)
    if kind == "noop":
        state = ScalerState.noop(device=device)
    else:
        state = ScalerState.static(draw(r.scales), device=device)
    return dataclasses.replace(state, skipped=torch.full_like(state.skipped, _one(draw, r.skipped)))


def _check_range(name: str, value: Any, lo: float, hi: float, kind: type) -> tuple[Any, Any]:
    ok = (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
        and lo <= value[0] <= value[1] <= hi
    )
    if not ok:
        what = "ints" if kind is int else "floats"
        raise ValueError(
            f"funcamp.testing.scaler_states: `{name}` must be a (low, high) pair of {what} "
            f"with {lo:g} <= low <= high <= {hi:g}, got {value!r}"
        )
    return value[0], value[1]


def scaler_states(
    kinds: Sequence[str] = _KINDS,
    *,
    scale: tuple[float, float] = (2.0**-24, _F32_MAX),
    growth_interval: tuple[int, int] = (1, 5000),
    hysteresis: tuple[int, int] = (1, 4),
    skipped: tuple[int, int] = (0, 10_000),
    device: torch.device | str | None = None,
) -> st.SearchStrategy[ScalerState]:
    """:class:`funcamp.ScalerState` values with random valid configuration and leaves.

    Dynamic states (six draws in eight when ``kinds`` allows them) draw a scale, a
    ``growth_factor``, ``backoff_factor``, ``growth_interval`` and ``hysteresis``, and now and
    then ``min_scale``/``max_scale`` bounds around the scale. Their growth tracker is drawn
    below ``growth_interval`` and their hysteresis tracker up to ``hysteresis``; one time in
    two each sits at its edge (one clean step from growing, one overflow from backing off).
    Every kind draws a ``skipped`` count. Scales are powers of two, arbitrary float32 values and
    the ends of the range. Shrinks towards ``ScalerState.dynamic(init_scale=1.0)``.

    Args:
        kinds: the kinds to draw (``"dynamic"``, ``"static"``, ``"noop"``).
        scale: the range of a static or dynamic state's scale (and of its
            ``min_scale``/``max_scale``); a noop state's scale is always 1.
        growth_interval: the range of ``growth_interval``.
        hysteresis: the range of ``hysteresis``.
        skipped: the range of the ``skipped`` count.
        device: where the state's tensors live.

    Example:
        >>> import torch, funcamp
        >>> from hypothesis import given
        >>> from funcamp.testing import scaler_states, tensors
        >>> @given(scaler_states(scale=(1.0, 2.0**24)), tensors(dtype=torch.float32,
        ...        min_value=-1e30, max_value=1e30))
        ... def test_unscale_inverts_scale(state, g):
        ...     grads, found_inf = funcamp.unscale(state, funcamp.scale(state, g))
        ...     assert not bool(found_inf)
        ...     assert torch.allclose(grads, g, rtol=1e-6, atol=1e-38)
        >>> test_unscale_inverts_scale()
    """
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in _KINDS]
    if not kinds or bad:
        raise ValueError(
            "funcamp.testing.scaler_states: `kinds` must be a non-empty subset of "
            f"('dynamic', 'static', 'noop'), got {kinds!r}"
        )
    scale = tuple(float(v) if isinstance(v, int) else v for v in scale)  # type: ignore[assignment]
    lo, hi = _check_range("scale", scale, 2.0**-149, _F32_MAX, float)
    g_lo, g_hi = _check_range("growth_interval", tuple(growth_interval), 1, _INT32_MAX, int)
    # Short intervals one draw in three, so that a few clean steps make the scale grow; torch's
    # default first, so that states shrink to it.
    branches = [st.integers(g_lo, min(g_hi, g_lo + 15)), st.integers(g_lo, g_hi)]
    if g_lo <= 2000 <= g_hi:
        branches.insert(0, st.just(2000))
    intervals = st.one_of(branches)
    # Dynamic states, the ones with bookkeeping to get wrong, are drawn six times in eight.
    choices = [k for k in ("dynamic",) * 6 + ("static", "noop") if k in kinds]
    ranges = _Ranges(
        st.sampled_from(choices) if len(kinds) > 1 else kinds[0],
        _scale_values(lo, hi),
        intervals,
        _range(*_check_range("hysteresis", tuple(hysteresis), 1, _INT32_MAX, int)),
        _range(*_check_range("skipped", tuple(skipped), 0, _INT32_MAX, int)),
        lo,
        hi,
    )
    return _scaler_state(ranges, device)
