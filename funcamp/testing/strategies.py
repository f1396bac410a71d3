"""Hypothesis strategies for funcamp's numerics: dtypes, tensors, pytrees and policies."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from funcamp import OpPolicy, OpRule, Policy
from funcamp.testing._hypothesis import st
from funcamp.testing._values import LOW_PRECISION_DTYPES, Elements, _Bounds, elements

__all__ = [
    "FLOAT_DTYPES",
    "Node",
    "float_dtypes",
    "policies",
    "pytrees",
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


def _as_strategy(value: Any) -> st.SearchStrategy[Any]:
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


@functools.cache
def _jitter_table(size: int) -> torch.Tensor:
    i = torch.arange(size, dtype=torch.float64)
    return torch.remainder(i * 0.6180339887498949 + 0.5, 1.0) * 2 - 1


def _jitter(n: int) -> torch.Tensor:
    """``n`` quasi-random offsets in [-1, 1) (the golden-ratio sequence), the first 0: where a
    cluster's elements lie around its centre."""
    return _jitter_table(1 << max(n - 1, 1).bit_length())[:n]


_FILL_KINDS = ("repeat", "cluster", "ramp")

# Start and stride of the positions of the values drawn alone, taken modulo the size (so that
# their draws stay valid when the shape shrinks).
_POSITIONS = st.integers(0, 2**16 - 1)


@dataclasses.dataclass(frozen=True)
class _Draws:
    """The strategies one dtype's tensors draw from (built once per dtype)."""

    el: Elements
    kinds: st.SearchStrategy[str]
    spreads: st.SearchStrategy[int]

    @classmethod
    def build(cls, el: Elements) -> _Draws:
        bits = -math.frexp(torch.finfo(el.dtype).eps)[1] + 3  # spreads down to about an ulp
        return cls(
            el,
            st.sampled_from(_FILL_KINDS if el.spread_ok else _FILL_KINDS[:1]),
            st.integers(1, bits),
        )


def _fill(draw: Callable[..., Any], d: _Draws, n: int) -> torch.Tensor:
    """``n`` float64 values, exact in the dtype: one value repeated, a cluster around it (a
    spread of a few ulps to half its magnitude), or a ramp to a second value."""
    el = d.el
    v = el.draw(draw)
    kind = draw(d.kinds)
    if kind == "repeat" or not math.isfinite(v):
        return torch.full((n,), v, dtype=torch.float64)
    if kind == "cluster":
        spread = (abs(v) or 1.0) * 2.0 ** -draw(d.spreads)
        values = v + spread * _jitter(n)
        values[0] = v  # exactly, -0.0 included
    else:
        w = el.draw(draw)
        values = torch.linspace(v, w if math.isfinite(w) else v, n, dtype=torch.float64)
    values = values.clamp(el.lo, el.hi).to(el.dtype).to(torch.float64)
    if not el.allow_subnormal:
        subnormal = (values != 0) & (values.abs() < torch.finfo(el.dtype).smallest_normal)
        values = torch.where(subnormal, v, values)
    return values


@st.composite
def _tensors(
    draw: Callable[..., Any],
    dtype: DtypeArg,
    shape: st.SearchStrategy[Sequence[int]],
    draws: Callable[[torch.dtype], _Draws],
    device: torch.device | str | None,
) -> torch.Tensor:
    dt = draw(_as_strategy(dtype))
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(
            f"funcamp.testing.tensors: `dtype` must be a floating torch.dtype, got {dt!r}"
        )
    shp = tuple(draw(shape))
    n = math.prod(shp)
    if n == 0:
        return torch.empty(shp, dtype=dt, device=device)
    d = draws(dt)
    # The same draws whatever n (one element included), so that shrinking the shape keeps the
    # values: a fill, then up to sqrt(n) values (8 at least, n at most) drawn alone, at evenly
    # strided positions.
    flat = _fill(draw, d, n)
    count = draw(st.integers(0, min(n, max(8, math.isqrt(n)))))
    if count:
        values = [d.el.draw(draw) for _ in range(count)]
        start, stride = draw(_POSITIONS), draw(_POSITIONS)
        index = torch.arange(count) * (stride % max(n - 1, 1) + 1) + start
        flat[index % n] = torch.tensor(values, dtype=torch.float64)
    # Every value is exact in ``dt``, so going through float64 rounds nothing.
    return flat.to(dt).reshape(shp).to(device)


@st.composite
def _shapes(
    draw: Callable[..., Any],
    small: st.SearchStrategy[list[int]],
    long: st.SearchStrategy[int] | None,
) -> tuple[int, ...]:
    # One shape in eight is a long vector (shrinking towards the small shapes).
    if long is not None and draw(st.integers(0, 7)) == 7:
        return (draw(long),)
    return tuple(draw(small))


def _check_tensor_args(**kwargs: Any) -> None:
    for name in ("min_dims", "max_dims", "min_side", "max_side", "max_length"):
        value = kwargs[name]
        if not isinstance(value, int) or value < 0:
            raise ValueError(
                f"funcamp.testing.tensors: `{name}` must be an int >= 0, got {value!r}"
            )
    for name in ("min_value", "max_value"):
        value = kwargs[name]
        if value is not None and (not isinstance(value, (int, float)) or math.isnan(value)):
            raise ValueError(
                f"funcamp.testing.tensors: `{name}` must be None or a float, got {value!r}"
            )
    lo, hi = kwargs["min_value"], kwargs["max_value"]
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(
            f"funcamp.testing.tensors: `min_value` must be <= `max_value`, got {lo!r} and {hi!r}"
        )
    for low in kwargs["boundaries"]:
        if not isinstance(low, torch.dtype) or not low.is_floating_point:
            raise ValueError(
                "funcamp.testing.tensors: `boundaries` must hold floating torch dtypes, got "
                f"{low!r}"
            )
    for v in kwargs["values"]:
        if not isinstance(v, (int, float)):
            raise ValueError(f"funcamp.testing.tensors: `values` must hold floats, got {v!r}")


def tensors(
    dtype: DtypeArg = None,
    shape: ShapeArg = None,
    *,
    min_value: float | None = None,
    max_value: float | None = None,
    allow_nan: bool | None = None,
    allow_infinity: bool | None = None,
    allow_subnormal: bool = True,
    boundaries: Sequence[torch.dtype] = LOW_PRECISION_DTYPES,
    values: Sequence[float] = (),
    min_dims: int = 0,
    max_dims: int = 3,
    min_side: int = 0,
    max_side: int = 5,
    max_length: int = 1024,
    device: torch.device | str | None = None,
) -> st.SearchStrategy[torch.Tensor]:
    """Floating tensors whose elements stress mixed-precision code.

    Each element is an arbitrary finite value of the dtype, a power of two, one of the dtype's
    :func:`special_values`, or one of the :func:`boundary_values` of the lower-precision dtypes
    code casts to (float16's max and the top of its rounding band, 65520; its subnormals;
    bfloat16's max; float8's 448, 464, 57344 and 61440...). Every value lies within the bounds
    and is exact in the dtype. Tensors are structured: a fill (one value repeated, a cluster
    around it, or a ramp between two values) with a few elements drawn on top. A drawn shape is
    now and then a long vector. Examples shrink to small shapes filled with one value.

    Args:
        dtype: a floating dtype or a strategy of them (default :func:`float_dtypes`).
        shape: a shape or a strategy of shapes; default: ``min_dims``..``max_dims`` dims of
            ``min_side``..``max_side`` each, or a vector of up to ``max_length``.
        min_value: smallest element allowed (``None``: no bound). As with
            ``hypothesis.strategies.floats``, giving bounds turns ``nan`` (either bound) and
            ``inf`` (both bounds) off unless asked for.
        max_value: largest element allowed.
        allow_nan: include ``nan`` (default: when no bound is given).
        allow_infinity: include ``±inf`` (default: unless both bounds are given).
        allow_subnormal: include subnormal values.
        boundaries: the dtypes whose boundaries are mixed in; ``()`` for none.
        values: more values to mix in, e.g. ``special_values(torch.float16)``; each is rounded
            to its neighbours in the dtype, and those out of bounds are left out.
        min_dims: fewest dims of a drawn shape.
        max_dims: most dims of a drawn shape.
        min_side: smallest size of a drawn dim.
        max_side: largest size of a drawn dim (a long vector's excepted).
        max_length: most elements of a long vector; no long vectors if ``<= max_side``.
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
    _check_tensor_args(**locals())
    lo = -math.inf if min_value is None else float(min_value)
    hi = math.inf if max_value is None else float(max_value)
    if allow_nan is None:
        allow_nan = min_value is None and max_value is None
    if allow_infinity is None:
        allow_infinity = min_value is None or max_value is None
    boundaries, values = tuple(boundaries), tuple(float(v) for v in values)
    cache: dict[torch.dtype, _Draws] = {}

    def draws(dt: torch.dtype) -> _Draws:
        if dt not in cache:
            bounds = _Bounds(dt, lo, hi, allow_nan, allow_infinity, allow_subnormal)
            cache[dt] = _Draws.build(elements(dt, bounds, boundaries, values))
        return cache[dt]

    if shape is None:
        small = st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims)
        long = None
        if max_length > max_side and min_dims <= 1 <= max_dims:
            long = st.integers(max(max_side + 1, min_side), max_length)
        shapes: st.SearchStrategy[Sequence[int]] = _shapes(small, long)
    else:
        shapes = _as_strategy(shape)
    return _tensors(float_dtypes() if dtype is None else dtype, shapes, draws, device)


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
) -> st.SearchStrategy[Any]:
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
