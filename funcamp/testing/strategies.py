"""Hypothesis strategies for funcamp's numerics: dtypes, special values, tensors, pytrees,
policies and scaler states.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "funcamp.testing needs Hypothesis, which is not installed; install it with "
        "`pip install funcamp[testing]` (or `pip install hypothesis`)"
    ) from e

import torch

from funcamp._core.tree import PyTree
from funcamp.policy.ops import OpPolicy, OpRule
from funcamp.policy.policy import Policy
from funcamp.scaling.state import ScalerState

__all__ = [
    "FLOAT_DTYPES",
    "Node",
    "float_dtypes",
    "policies",
    "pytrees",
    "scaler_states",
    "special_values",
    "tensors",
]


DtypeArg = torch.dtype | st.SearchStrategy[torch.dtype] | None

ShapeArg = Sequence[int] | st.SearchStrategy[Sequence[int]] | None

FLOAT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)

_WIDTH = {torch.float16: 16, torch.float32: 32, torch.float64: 64}


def float_dtypes(
    *, include: Sequence[torch.dtype] = FLOAT_DTYPES, exclude: Sequence[torch.dtype] = ()
) -> st.SearchStrategy[torch.dtype]:
    """Floating dtypes: float16, bfloat16, float32 and float64 (shrinking towards float16).

    Args:
        include: the dtypes to draw from.
        exclude: dtypes to leave out, e.g. ``(torch.float64,)``.

    Example:
        >>> import torch
        >>> from hypothesis import given
        >>> from funcamp.testing import float_dtypes
        >>> @given(float_dtypes(exclude=(torch.float64,)))
        ... def test_low_precision(dtype):
        ...     assert torch.finfo(dtype).bits <= 32
        >>> test_low_precision()
    """
    chosen = [d for d in include if d not in set(exclude)]
    for d in chosen:
        if not isinstance(d, torch.dtype) or not d.is_floating_point:
            raise ValueError(
                "funcamp.testing.float_dtypes: `include` must hold floating torch dtypes, "
                f"got {d!r}"
            )
    if not chosen:
        raise ValueError("funcamp.testing.float_dtypes: no dtype left after `exclude`")
    return st.sampled_from(chosen)


def _next(dtype: torch.dtype, x: float, toward: float) -> float:
    t = torch.tensor(x, dtype=dtype)
    return float(torch.nextafter(t, torch.tensor(toward, dtype=dtype)))


def _round(dtype: torch.dtype, x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(dtype))


def _smallest_subnormal(dtype: torch.dtype) -> float:
    return _next(dtype, 0.0, 1.0)


def _is_subnormal(dtype: torch.dtype, x: float) -> bool:
    return x != 0.0 and math.isfinite(x) and abs(x) < torch.finfo(dtype).tiny


def special_values(dtype: torch.dtype) -> list[float]:
    """The special values :func:`tensors` mixes in for ``dtype``, as Python floats.

    * ``0.0``, ``-0.0``, ``1.0``, ``-1.0``, ``inf``, ``-inf``, ``nan``;
    * the largest finite value and its neighbour, and their negatives;
    * the smallest normal value and its neighbours;
    * the smallest and largest subnormals;
    * ``eps`` and ``1 + eps``.

    Each is exactly representable in ``dtype``.

    Example:
        >>> import torch
        >>> from funcamp.testing import special_values
        >>> vals = special_values(torch.float16)
        >>> 65504.0 in vals, 2.0**-24 in vals, float("-inf") in vals
        (True, True, True)
    """
    fi = torch.finfo(dtype)
    sub = _smallest_subnormal(dtype)
    positive = [
        1.0,
        fi.max,
        _next(dtype, fi.max, 0.0),
        fi.tiny,
        _next(dtype, fi.tiny, 0.0),  # largest subnormal
        _next(dtype, fi.tiny, math.inf),
        sub,
        fi.eps,
        1.0 + fi.eps,
    ]
    values = [0.0, -0.0]
    for v in positive:
        values += [v, -v]
    values += [math.inf, -math.inf, math.nan]
    return values


def _dtype_exponents(dtype: torch.dtype) -> tuple[int, int]:
    """Exponents ``k`` of the smallest subnormal and the largest power of two, ``2.0**k``."""
    return math.frexp(_smallest_subnormal(dtype))[1] - 1, math.frexp(torch.finfo(dtype).max)[1] - 1


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


def _elements(
    dtype: torch.dtype,
    min_value: float | None,
    max_value: float | None,
    allow_nan: bool | None,
    allow_infinity: bool | None,
    allow_subnormal: bool,
) -> st.SearchStrategy[float]:
    fi = torch.finfo(dtype)
    if allow_nan is None:
        allow_nan = min_value is None and max_value is None
    if allow_infinity is None:
        allow_infinity = min_value is None or max_value is None
    lo = -math.inf if min_value is None else float(min_value)
    hi = math.inf if max_value is None else float(max_value)
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(
            "funcamp.testing.tensors: `min_value` must be <= `max_value`, got "
            f"{min_value!r} and {max_value!r}"
        )
    bounds = _Bounds(dtype, lo, hi, allow_nan, allow_infinity, allow_subnormal)

    specials = [v for v in special_values(dtype) if bounds.ok(v)]
    lo_exp, hi_exp = _dtype_exponents(dtype)
    powers = st.builds(
        lambda k, neg: -(2.0**k) if neg else 2.0**k,
        st.integers(lo_exp, hi_exp),
        st.booleans(),
    ).filter(bounds.ok)

    # Finite values in the dtype, drawn as floats of its width (float32 for bfloat16, then
    # rounded). The bounds are first rounded inwards to values the dtype can represent.
    flo, fhi = max(lo, -fi.max), min(hi, fi.max)
    if _round(dtype, flo) < flo:
        flo = _next(dtype, _round(dtype, flo), math.inf)
    else:
        flo = _round(dtype, flo)
    if _round(dtype, fhi) > fhi:
        fhi = _next(dtype, _round(dtype, fhi), -math.inf)
    else:
        fhi = _round(dtype, fhi)
    # Finite values come first so that examples shrink to plain numbers (0.0, 101.0), not to
    # special values, unless a special value is what makes the test fail.
    branches: list[st.SearchStrategy[float]] = []
    if flo <= fhi:
        finite = st.floats(
            min_value=flo,
            max_value=fhi,
            allow_nan=False,
            allow_infinity=False,
            allow_subnormal=None if allow_subnormal else False,
            width=_WIDTH.get(dtype, 32),
        )
        if dtype not in _WIDTH:
            finite = finite.map(lambda x: _round(dtype, x))
        branches += [finite.filter(bounds.ok), powers]
    if specials:
        branches.append(st.sampled_from(specials))
    if not branches:
        raise ValueError(
            f"funcamp.testing.tensors: no {dtype} value satisfies min_value={min_value!r}, "
            f"max_value={max_value!r}, allow_nan={allow_nan}, allow_infinity={allow_infinity}"
        )
    return st.one_of(branches)


def _as_strategy(value: Any) -> st.SearchStrategy[Any]:
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


@st.composite
def _tensors(
    draw: Callable[..., Any],
    dtype: DtypeArg,
    shape: ShapeArg,
    min_dims: int,
    max_dims: int,
    min_side: int,
    max_side: int,
    elements: Callable[[torch.dtype], st.SearchStrategy[float]],
    device: torch.device | str | None,
) -> torch.Tensor:
    dt = draw(_as_strategy(dtype))
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(
            f"funcamp.testing.tensors: `dtype` must be a floating torch.dtype, got {dt!r}"
        )
    if shape is None:
        shp = tuple(
            draw(st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims))
        )
    else:
        shp = tuple(draw(_as_strategy(shape)))
    n = math.prod(shp)
    values = draw(st.lists(elements(dt), min_size=n, max_size=n))
    # Every value is exact in ``dt``, so going through float64 rounds nothing.
    return torch.tensor(values, dtype=torch.float64).to(dt).reshape(shp).to(device)


def tensors(
    dtype: DtypeArg = None,
    shape: ShapeArg = None,
    *,
    min_value: float | None = None,
    max_value: float | None = None,
    allow_nan: bool | None = None,
    allow_infinity: bool | None = None,
    allow_subnormal: bool = True,
    min_dims: int = 0,
    max_dims: int = 3,
    min_side: int = 0,
    max_side: int = 5,
    device: torch.device | str | None = None,
) -> st.SearchStrategy[torch.Tensor]:
    """Floating tensors whose elements stress floating-point code.

    Elements mix the dtype's :func:`special_values`, powers of two over the whole exponent range
    (subnormal to max) and arbitrary finite values of the dtype. Each is exactly representable in
    the dtype. Examples shrink to small shapes of zeros.

    Args:
        dtype: a floating dtype or a strategy of them (default :func:`float_dtypes`).
        shape: a shape or a strategy of shapes; default: ``min_dims``..``max_dims`` dims of
            ``min_side``..``max_side`` each.
        min_value: smallest element allowed (``None``: no bound). As with
            ``hypothesis.strategies.floats``, giving bounds turns ``nan`` (either bound) and
            ``inf`` (both bounds) off unless asked for.
        max_value: largest element allowed.
        allow_nan: include ``nan`` (default: when no bound is given).
        allow_infinity: include ``±inf`` (default: unless both bounds are given).
        allow_subnormal: include subnormal values.
        min_dims: fewest dims of a drawn shape.
        max_dims: most dims of a drawn shape.
        min_side: smallest size of a drawn dim.
        max_side: largest size of a drawn dim.
        device: where the tensors live (default: CPU).

    Example:
        >>> import torch
        >>> from hypothesis import given
        >>> from funcamp.testing import tensors
        >>> @given(tensors(dtype=torch.float16, min_value=-1.0, max_value=1.0))
        ... def test_bounded(x):
        ...     assert bool(torch.isfinite(x).all()) and bool((x.abs() <= 1).all())
        >>> test_bounded()
    """
    for name, value in (
        ("min_dims", min_dims),
        ("max_dims", max_dims),
        ("min_side", min_side),
        ("max_side", max_side),
    ):
        if not isinstance(value, int) or value < 0:
            raise ValueError(
                f"funcamp.testing.tensors: `{name}` must be an int >= 0, got {value!r}"
            )
    for name, value in (("min_value", min_value), ("max_value", max_value)):
        if value is not None and (not isinstance(value, (int, float)) or math.isnan(value)):
            raise ValueError(
                f"funcamp.testing.tensors: `{name}` must be None or a float, got {value!r}"
            )
    if min_value is not None and max_value is not None and min_value > max_value:
        raise ValueError(
            "funcamp.testing.tensors: `min_value` must be <= `max_value`, got "
            f"{min_value!r} and {max_value!r}"
        )
    cache: dict[torch.dtype, st.SearchStrategy[float]] = {}

    def elements(dt: torch.dtype) -> st.SearchStrategy[float]:
        if dt not in cache:
            cache[dt] = _elements(
                dt, min_value, max_value, allow_nan, allow_infinity, allow_subnormal
            )
        return cache[dt]

    return _tensors(
        float_dtypes() if dtype is None else dtype,
        shape,
        min_dims,
        max_dims,
        min_side,
        max_side,
        elements,
        device,
    )


class Node(NamedTuple):
    """The NamedTuple container :func:`pytrees` draws (a NamedTuple is a pytree node).

    Example:
        >>> import torch
        >>> from funcamp.testing import Node
        >>> Node(torch.zeros(1), None).first
        tensor([0.])
    """

    first: Any
    second: Any


def pytrees(
    leaves: st.SearchStrategy[Any] | None = None,
    *,
    max_leaves: int = 8,
    keys: st.SearchStrategy[str] | None = None,
) -> st.SearchStrategy[PyTree]:
    """Nested dicts, lists, tuples and NamedTuples (:class:`Node`) of ``leaves``.

    Empty containers and ``None`` (an empty pytree node for optree and torch) are drawn too; a
    drawn tree may also be a bare leaf. Shrinks towards a single leaf.

    Args:
        leaves: a strategy for the leaves (default: small float tensors from :func:`tensors`
            of every floating dtype, with special values).
        max_leaves: a soft bound on the number of leaves (``hypothesis.strategies.recursive``).
        keys: a strategy for dict keys (default: short lowercase names).

    Example:
        >>> import optree
        >>> from hypothesis import given, strategies as st
        >>> from funcamp.testing import pytrees
        >>> @given(pytrees(st.integers()))
        ... def test_roundtrip(tree):
        ...     leaves, spec = optree.tree_flatten(tree)
        ...     assert optree.tree_unflatten(spec, leaves) == tree
        >>> test_roundtrip()
    """
    if leaves is None:
        leaves = tensors(max_dims=2, max_side=3)
    if keys is None:
        keys = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(keys, children, max_size=3),
            st.builds(Node, children, children),
        )

    return st.recursive(st.one_of(leaves, st.none()), extend, max_leaves=max_leaves)


_MODULE_KEYS: tuple[type | str, ...] = (
    torch.nn.Linear,
    torch.nn.LayerNorm,
    torch.nn.Conv2d,
    torch.nn.MultiheadAttention,
    torch.nn.Embedding,
    "encoder.*",
    "*.norm",
    "0",
    "head",
)


@functools.cache
def _overridable_ops() -> list[str]:
    """Op names of the default table that ``with_op_rules`` accepts by name."""
    names = []
    for name in sorted(k for k in OpPolicy.default() if isinstance(k, str)):
        try:
            OpPolicy({name: OpRule.NONE})
        except (TypeError, ValueError):
            continue
        names.append(name)
    return names


def _plain_policies(dtypes: st.SearchStrategy[torch.dtype]) -> st.SearchStrategy[Policy]:
    return st.builds(Policy, dtypes, dtypes, dtypes)


def policies(
    *,
    dtypes: st.SearchStrategy[torch.dtype] | None = None,
    op_overrides: bool = True,
    module_overrides: bool = True,
    ops: Sequence[Any] | None = None,
    module_keys: Sequence[type | str] = _MODULE_KEYS,
) -> st.SearchStrategy[Policy]:
    """:class:`funcamp.Policy` values, optionally with op and module overrides.

    ``param_dtype``, ``compute_dtype`` and ``output_dtype`` are drawn independently. Then, when
    enabled, rules for a few ops are overridden (:meth:`~funcamp.Policy.with_op_rules`). A few
    module classes or path globs get policies of their own
    (:meth:`~funcamp.Policy.with_module_policies`). Shrinks towards an all-float16 policy
    without overrides.

    Args:
        dtypes: strategy for each of the three dtypes (default :func:`float_dtypes`).
        op_overrides: draw op rule overrides.
        module_overrides: draw per-module policies.
        ops: the ops overrides are drawn for (default: every op of ``OpPolicy.default()``
            that has a Python entry point, so can be overridden by name).
        module_keys: the module classes and path globs module policies are drawn for.

    Example:
        >>> import funcamp
        >>> from hypothesis import given
        >>> from funcamp.testing import policies
        >>> @given(policies(op_overrides=False, module_overrides=False))
        ... def test_str_roundtrip(policy):
        ...     assert funcamp.get_policy(str(policy)) == policy
        >>> test_str_roundtrip()
    """
    if dtypes is None:
        dtypes = float_dtypes()
    base = _plain_policies(dtypes)
    op_names = _overridable_ops() if ops is None else list(ops)
    rule_maps = st.dictionaries(
        st.sampled_from(op_names), st.sampled_from(list(OpRule)), max_size=4
    )
    module_maps = st.dictionaries(
        st.sampled_from(list(module_keys)),
        st.one_of(
            _plain_policies(dtypes),
            _plain_policies(dtypes).map(str),
            st.builds(lambda p, r: p.with_op_rules(r), _plain_policies(dtypes), rule_maps),
        ),
        max_size=3,
    )

    @st.composite
    def build(draw: Callable[..., Any]) -> Policy:
        policy = draw(base)
        if op_overrides and op_names:
            rules = draw(rule_maps)
            if rules:
                policy = policy.with_op_rules(rules)
        if module_overrides and module_keys:
            modules = draw(module_maps)
            if modules:
                policy = policy.with_module_policies(modules)
        return policy

    return build()


_F32_MAX = float(torch.finfo(torch.float32).max)

_F32_TINY = float(torch.finfo(torch.float32).tiny)


def _scale_values(lo: float, hi: float) -> st.SearchStrategy[float]:
    lo_k, hi_k = math.ceil(math.log2(lo)), math.floor(math.log2(hi))
    branches = [st.floats(lo, hi, width=32, exclude_min=False)]
    if lo_k <= hi_k:
        branches.insert(0, st.integers(lo_k, hi_k).map(lambda k: 2.0**k))
    return st.one_of(branches)


@st.composite
def _scaler_state(
    draw: Callable[..., Any], kinds: Sequence[str], device: torch.device | str | None
) -> ScalerState:
    kind = draw(st.sampled_from(list(kinds)))
    scales = _scale_values(2.0**-24, _F32_MAX)
    skipped = draw(st.integers(0, 10_000))
    if kind == "noop":
        state = ScalerState.noop(device=device)
    elif kind == "static":
        state = ScalerState.static(draw(scales), device=device)
    else:
        growth_factor = draw(
            st.one_of(st.just(2.0), st.floats(1.0, 16.0, exclude_min=True), st.just(1.0001))
        )
        backoff_factor = draw(
            st.one_of(st.just(0.5), st.floats(0.0, 1.0, exclude_min=True, exclude_max=True))
        )
        growth_interval = draw(st.one_of(st.just(2000), st.integers(1, 5000)))
        hysteresis = draw(st.integers(1, 4))
        init_scale = draw(scales)
        min_scale = draw(st.none() | _scale_values(_F32_TINY, init_scale))
        max_scale = draw(st.none() | _scale_values(init_scale, _F32_MAX))
        state = ScalerState.dynamic(
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
            device=device,
        )
        tracker = draw(st.integers(0, growth_interval - 1))
        hyst = hysteresis - draw(st.integers(0, hysteresis))  # shrinks to a full tracker
        state = dataclasses.replace(
            state,
            growth_tracker=torch.full_like(state.growth_tracker, tracker),
            hysteresis_tracker=torch.full_like(state.hysteresis_tracker, hyst),
        )
    return dataclasses.replace(state, skipped=torch.full_like(state.skipped, skipped))


def scaler_states(
    kinds: Sequence[str] = ("dynamic", "static", "noop"),
    *,
    device: torch.device | str | None = None,
) -> st.SearchStrategy[ScalerState]:
    """:class:`funcamp.ScalerState` values with random valid configuration and leaves.

    Dynamic states draw ``init_scale`` (powers of two and arbitrary float32 values),
    ``growth_factor``, ``backoff_factor``, ``growth_interval`` and ``hysteresis``. They draw
    optional ``min_scale``/``max_scale`` bounds around the scale. Then they draw a growth
    tracker below ``growth_interval``, and a hysteresis tracker up to ``hysteresis``. Every kind
    draws a ``skipped`` count. Shrinks towards ``ScalerState.dynamic(init_scale=1.0)``.

    Args:
        kinds: the kinds to draw (``"dynamic"``, ``"static"``, ``"noop"``).
        device: where the state's tensors live.

    Example:
        >>> import torch, funcamp
        >>> from hypothesis import given
        >>> from funcamp.testing import scaler_states, tensors
        >>> @given(scaler_states(), tensors(dtype=torch.float32, max_dims=1))
        ... def test_scale_then_unscale(state, x):
        ...     grads, _ = funcamp.unscale(state, funcamp.scale(state, x))
        ...     assert grads.shape == x.shape
        >>> test_scale_then_unscale()
    """
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in ("dynamic", "static", "noop")]
    if not kinds or bad:
        raise ValueError(
            "funcamp.testing.scaler_states: `kinds` must be a non-empty subset of "
            f"('dynamic', 'static', 'noop'), got {kinds!r}"
        )
    return _scaler_state(kinds, device)
