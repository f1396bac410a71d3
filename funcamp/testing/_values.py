"""The values :func:`~funcamp.testing.tensors` mixes into its elements: a dtype's own special
values, the boundaries of the lower-precision dtypes code casts to, and the element strategy that
draws them within bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcamp.testing._hypothesis import st

__all__ = [
    "LOW_PRECISION_DTYPES",
    "Elements",
    "boundary_values",
    "elements",
    "special_values",
]

#: The dtypes whose boundaries :func:`tensors` mixes in by default: the ones mixed-precision code
#: casts to.
LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)

_WIDTH = {torch.float16: 16, torch.float32: 32, torch.float64: 64}


def _next(dtype: torch.dtype, x: float, toward: float) -> float:
    t = torch.tensor(x, dtype=dtype)
    return float(torch.nextafter(t, torch.tensor(toward, dtype=dtype)))


def _round(dtype: torch.dtype, x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(dtype))


def _smallest_subnormal(dtype: torch.dtype) -> float:
    fi = torch.finfo(dtype)
    return float(fi.smallest_normal) * float(fi.eps)


def _is_subnormal(dtype: torch.dtype, x: float) -> bool:
    return x != 0.0 and math.isfinite(x) and abs(x) < torch.finfo(dtype).smallest_normal


def special_values(dtype: torch.dtype) -> list[float]:
    """The special values of ``dtype`` that :func:`tensors` mixes in, as Python floats.

    * ``0.0``, ``-0.0``, ``1.0``, ``-1.0``, ``inf``, ``-inf``, ``nan``;
    * the largest finite value and its neighbour, and their negatives;
    * the smallest normal value and its neighbours;
    * the smallest and largest subnormals;
    * ``eps`` and ``1 + eps``.

    Each is exactly representable in ``dtype``.

    Args:
        dtype: float16, bfloat16, float32 or float64.

    Example:
        >>> import torch
        >>> from funcamp.testing import special_values
        >>> vals = special_values(torch.float16)
        >>> 65504.0 in vals, 2.0**-24 in vals, float("-inf") in vals
        (True, True, True)
    """
    fi = torch.finfo(dtype)
    positive = [
        1.0,
        fi.max,
        _next(dtype, fi.max, 0.0),
        fi.tiny,
        _next(dtype, fi.tiny, 0.0),  # largest subnormal
        _next(dtype, fi.tiny, math.inf),
        _smallest_subnormal(dtype),
        fi.eps,
        1.0 + fi.eps,
    ]
    values = [0.0, -0.0]
    for v in positive:
        values += [v, -v]
    values += [math.inf, -math.inf, math.nan]
    return values


def _edges(low: torch.dtype) -> dict[str, list[tuple[float, float]]]:
    """The positive values where casting to ``low`` changes behaviour, exact in float64: at the
    top of its range (``"overflow"``) and among its subnormals (``"underflow"``). Each comes
    with the direction (``±inf``) of a neighbour that counts too, or ``0.0``."""
    fi = torch.finfo(low)
    top = float(fi.max)
    band = 2.0 ** math.floor(math.log2(top)) * float(fi.eps) / 2  # half an ulp of the max
    sub = _smallest_subnormal(low)
    tiny = float(fi.smallest_normal)
    return {
        "overflow": [
            (top, math.inf),  # the largest finite value; just above it still rounds to it
            # the top of its rounding band, a tie: rounds past the max (to inf, saturating, or
            # to nan in the fn formats), as does just above it; just below it rounds to the max
            (top + band, -math.inf),
            (top + band, math.inf),
        ],
        "underflow": [
            (tiny, 0.0),  # the smallest normal
            (tiny - sub, 0.0),  # the largest subnormal
            (sub, 0.0),  # the smallest subnormal
            (sub / 2, math.inf),  # a tie, rounds to zero; just above it rounds up to `sub`
            (sub * 1.5, 0.0),  # a tie, rounds up to 2 * sub
        ],
    }


def _neighbours(dtype: torch.dtype, x: float) -> list[float]:
    """``x`` if ``dtype`` holds it exactly, else the finite values of ``dtype`` around it."""
    r = _round(dtype, x)
    if r == x:
        return [r]
    around = [r, _next(dtype, r, math.copysign(math.inf, x - r))] if math.isfinite(r) else []
    return sorted(v for v in around if math.isfinite(v))


@functools.cache
def _boundary_values(
    dtype: torch.dtype, of: tuple[torch.dtype, ...], where: tuple[str, ...]
) -> tuple[float, ...]:
    positive: set[float] = set()
    for low in of:
        edges = _edges(low)
        for edge, toward in (e for w in where for e in edges[w]):
            near = _neighbours(dtype, edge)
            if toward and near == [edge]:
                near.append(_next(dtype, edge, toward))
            positive.update(v for v in near if 0.0 < v < math.inf)
    return tuple(v for p in sorted(positive, key=_simplicity) for v in (p, -p))


def boundary_values(
    dtype: torch.dtype, of: Sequence[torch.dtype] = LOW_PRECISION_DTYPES
) -> list[float]:
    """Values of ``dtype`` at the boundaries of the lower-precision dtypes ``of``.

    For each dtype in ``of``: its largest value and the value just above it (which still rounds
    to it); the top of its rounding band, the first value that rounds past the max (float16's
    65520, float8 e4m3's 464, e5m2's 61440), and the values either side of it; its smallest
    normal and its largest and smallest subnormals; half the smallest subnormal (rounds to
    zero), the value just above that (rounds up), and one and a half of it. The neighbours in
    ``dtype`` stand for a boundary it cannot hold (bfloat16's 65280 and 65536 for float16's
    65504); one beyond its range is left out. Both signs, sorted by magnitude.

    Args:
        dtype: the dtype the values are drawn in.
        of: the dtypes code casts to (default :data:`LOW_PRECISION_DTYPES`: float16,
            bfloat16, float8 e4m3 and e5m2).

    Example:
        >>> import torch
        >>> from funcamp.testing import boundary_values
        >>> vals = boundary_values(torch.float32, of=[torch.float16])
        >>> 65504.0 in vals, 65520.0 in vals, 65519.99609375 in vals, 2.0**-25 in vals
        (True, True, True, True)
        >>> boundary_values(torch.float16, of=[torch.float8_e4m3fn])[-6:]
        [-463.75, 463.75, -464.0, 464.0, -464.25, 464.25]
    """
    of = tuple(of)
    for low in of:
        if not isinstance(low, torch.dtype) or not low.is_floating_point:
            raise ValueError(
                f"funcamp.testing.boundary_values: `of` must hold floating torch dtypes, got {low!r}"
            )
    return sorted(_boundary_values(dtype, of, ("overflow", "underflow")), key=lambda v: (abs(v), v))


@dataclasses.dataclass(frozen=True)
class _Bounds:
    dtype: torch.dtype
    min_value: float
    max_value: float
    allow_nan: bool
    allow_infinity: bool
    allow_subnormal: bool

    def ok(self, x: float) -> bool:
        if math.isnan(x):
            return self.allow_nan
        if math.isinf(x):
            return self.allow_infinity and self.min_value <= x <= self.max_value
        if not self.allow_subnormal and _is_subnormal(self.dtype, x):
            return False
        if x == 0.0 and self.min_value == 0.0 and math.copysign(1.0, self.min_value) > 0:
            return math.copysign(1.0, x) > 0  # min_value=0.0 excludes -0.0, as in Hypothesis
        if x == 0.0 and self.max_value == 0.0 and math.copysign(1.0, self.max_value) < 0:
            return math.copysign(1.0, x) < 0
        return self.min_value <= x <= self.max_value


#: An element is coded by one small integer (then a float draw when it codes an arbitrary
#: finite value), which costs Hypothesis a fraction of a ``one_of``. Hypothesis draws integers
#: below 256 uniformly (larger ones lean towards small values).
_CODES = 256


def _round_bf16(x: float) -> float:
    """``x`` (a float32 value) rounded to nearest-even bfloat16, without a tensor."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


@dataclasses.dataclass(frozen=True)
class Elements:
    """One dtype's element mix, and the finite range (exact in the dtype) it draws from.

    An element is coded by one integer in ``[0, 256)``: equal shares of it pick a group
    (arbitrary finite values first, when the bounds leave room for them), and the code within
    the share a value of the group; a group larger than its share draws its value with a
    second integer (leaning towards its simplest values). Every group is drawn equally often
    whatever its size, and codes shrink towards the first group.
    """

    dtype: torch.dtype
    finite: st.SearchStrategy[float] | None
    groups: tuple[tuple[float, ...], ...]
    lo: float
    hi: float
    allow_subnormal: bool
    #: whether a fill may spread around a value (not when a bound is a signed zero)
    spread_ok: bool

    def draw(self, draw: Callable[..., Any]) -> float:
        n = len(self.groups) + (self.finite is not None)
        code = draw(_CODE)
        group, slot = divmod(code * n, _CODES)
        if self.finite is not None:
            if group == 0:
                x = draw(self.finite)
                return _round_bf16(x) if self.dtype == torch.bfloat16 else x
            group -= 1
        values = self.groups[group]
        if len(values) * n > _CODES:
            return values[draw(st.integers(0, len(values) - 1))]
        return values[slot // n % len(values)]


_CODE = st.integers(0, _CODES - 1)


def _finite_range(dtype: torch.dtype, lo: float, hi: float) -> tuple[float, float]:
    """The bounds rounded inwards to finite values ``dtype`` holds."""
    fi = torch.finfo(dtype)
    flo, fhi = max(lo, -fi.max), min(hi, fi.max)
    r = _round(dtype, flo)
    flo = _next(dtype, r, math.inf) if r < flo else r
    r = _round(dtype, fhi)
    fhi = _next(dtype, r, -math.inf) if r > fhi else r
    return flo, fhi


def _log2_floor(x: float) -> int:
    """The largest ``k`` with ``2.0**k <= x`` (``x > 0``), exact for every float."""
    return math.frexp(x)[1] - 1


def _log2_ceil(x: float) -> int:
    """The smallest ``k`` with ``2.0**k >= x`` (``x > 0``)."""
    m, e = math.frexp(x)
    return e - 1 if m == 0.5 else e


def _powers(bounds: _Bounds, flo: float, fhi: float) -> list[float]:
    """The powers of two (and their negatives) within the bounds."""
    smallest = float(torch.finfo(bounds.dtype).smallest_normal)
    if bounds.allow_subnormal:
        smallest = _smallest_subnormal(bounds.dtype)
    out = []
    for sign, a, b in ((1.0, max(flo, 0.0), fhi), (-1.0, max(-fhi, 0.0), -flo)):
        a = max(a, smallest)
        if a <= b:
            out += [sign * 2.0**k for k in range(_log2_ceil(a), _log2_floor(b) + 1)]
    return out


def elements(
    dtype: torch.dtype,
    bounds: _Bounds,
    boundaries: tuple[torch.dtype, ...],
    values: tuple[float, ...],
) -> Elements:
    """The element mix of one dtype, all within ``bounds``, each drawn directly in range (no
    filtering). Shrinks towards arbitrary finite values, the first branch."""
    flo, fhi = _finite_range(dtype, bounds.min_value, bounds.max_value)
    finite = None
    if flo <= fhi:
        finite = st.floats(
            min_value=flo,
            max_value=fhi,
            allow_nan=False,
            allow_infinity=False,
            allow_subnormal=None if bounds.allow_subnormal else False,
            width=_WIDTH.get(dtype, 32),  # bfloat16: float32, rounded within [flo, fhi]
        )
    # One group each, so that each is drawn as often as the others whatever its size (a test
    # that needs nan or float16's 65520 sees them often): powers of two, the dtype's finite
    # special values, its non-finite ones, the top of each lower-precision dtype's range, their
    # subnormals, the caller's values.
    groups = []
    for group in (
        _powers(bounds, flo, fhi) if flo <= fhi else [],
        [v for v in special_values(dtype) if math.isfinite(v)],
        [math.nan, math.inf, -math.inf],
        *(_boundary_values(dtype, (low,), ("overflow",)) for low in boundaries),
        _boundary_values(dtype, boundaries, ("underflow",)),
        [r for v in values if not math.isnan(v) for r in _neighbours(dtype, v)]
        + [v for v in values if math.isnan(v)],
    ):
        # distinct by sign too: a set would merge 0.0 and -0.0
        distinct = {(v, math.copysign(1.0, v)): v for v in group if bounds.ok(v)}
        kept = sorted(distinct.values(), key=_simplicity)
        if len(kept) > 1 and math.isnan(kept[-1]) and not any(map(math.isfinite, kept)):
            kept.append(math.nan)  # as often as the infinities: nan alone is what checks miss
        if kept:
            groups.append(tuple(kept))
    n_groups = len(groups) + (finite is not None)
    if not n_groups:
        raise ValueError(
            f"funcamp.testing.tensors: no {dtype} value satisfies min_value="
            f"{bounds.min_value!r}, max_value={bounds.max_value!r}, "
            f"allow_nan={bounds.allow_nan}, allow_infinity={bounds.allow_infinity}"
        )
    lo, hi = bounds.min_value, bounds.max_value
    signed_zero_bound = (lo == 0.0 and math.copysign(1.0, lo) > 0) or (
        hi == 0.0 and math.copysign(1.0, hi) < 0
    )
    return Elements(
        dtype=dtype,
        finite=finite,
        groups=tuple(groups),
        lo=flo,
        hi=fhi,
        allow_subnormal=bounds.allow_subnormal,
        spread_ok=flo < fhi and not signed_zero_bound,
    )


def _simplicity(x: float) -> tuple[int, int, int, bool]:
    """Sort key, simplest first: zero, then finite values by significant bits (powers of two,
    then 448 = 0b111 << 6...), then by how far their exponent is from 1's; then infinities,
    then nan; positive before negative."""
    if math.isnan(x):
        return (2, 0, 0, False)
    if math.isinf(x):
        return (1, 0, 0, x < 0)
    m, e = math.frexp(x)
    m = abs(m)
    bits = 0
    while m:
        m = m * 2 - int(m * 2)
        bits += 1
    return (0, bits, abs(e - 1), math.copysign(1.0, x) < 0)
