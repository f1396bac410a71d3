"""funcamp.testing: the strategies reach every special value and shrink well, the assertions
name the differing leaf, and property tests of funcamp itself built on them."""

from __future__ import annotations

import dataclasses
import importlib
import io
import math
import pathlib
import re
import sys

import optree
import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

import funcamp
from funcamp.testing import (
    FLOAT_DTYPES,
    Node,
    assert_trees_close,
    assert_trees_equal,
    float_dtypes,
    policies,
    pytrees,
    scaler_states,
    special_values,
    tensors,
)

#: The optree namespace funcamp documents for its state types (docs/concepts.md).
NAMESPACE = "funcamp"

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Deterministic searches; no explain phase (it reruns shrunk examples to annotate failures,
# which `find` does not need).
FIND = settings(
    max_examples=2000,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.generate, Phase.shrink],
)


def _is_subnormal(t: torch.Tensor) -> torch.Tensor:
    return (t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)


def _is_power_of_two(t: torch.Tensor) -> torch.Tensor:
    mantissa, _ = torch.frexp(t.double())
    return torch.isfinite(t) & (mantissa.abs() == 0.5)


SPECIAL_CLASSES = {
    "+inf": lambda t: t == math.inf,
    "-inf": lambda t: t == -math.inf,
    "nan": torch.isnan,
    "+0": lambda t: (t == 0) & ~t.signbit(),
    "-0": lambda t: (t == 0) & t.signbit(),
    "subnormal": _is_subnormal,
    "near max": lambda t: t.isfinite() & (t.abs() >= torch.finfo(t.dtype).max / 2),
    "max": lambda t: t.abs() == torch.finfo(t.dtype).max,
    "smallest normal": lambda t: t.abs() == torch.finfo(t.dtype).tiny,
    "power of two (not special)": lambda t: (
        _is_power_of_two(t) & (t.abs() > 2) & (t.abs() < torch.finfo(t.dtype).max / 4)
    ),
}


# ------------------------------------------------------------------------- special values


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_tensors_generate_every_special_value_class(dtype):
    for name, predicate in SPECIAL_CLASSES.items():
        found = find(
            tensors(dtype=dtype, shape=()),
            lambda t, p=predicate: bool(p(t).any()),
            settings=FIND,
        )
        assert found.dtype == dtype, name
        assert bool(predicate(found)), name


def test_tensors_default_shapes_contain_special_values_and_shrink_to_one_element():
    # With the default (drawn) shapes and dtypes, a special value is found and the example
    # shrinks to a single element.
    for name in ("nan", "-inf", "subnormal", "-0"):
        predicate = SPECIAL_CLASSES[name]
        found = find(tensors(), lambda t, p=predicate: bool(p(t).any()), settings=FIND)
        assert found.numel() == 1, (name, found)
        assert found.dim() <= 1, (name, found)


def test_special_values_are_exact_in_their_dtype():
    for dtype in FLOAT_DTYPES:
        values = special_values(dtype)
        t = torch.tensor(values, dtype=torch.float64).to(dtype)
        back = t.double()
        same = (back == torch.tensor(values, dtype=torch.float64)) | torch.isnan(back)
        assert bool(same.all()), dtype


# ------------------------------------------------------------------------------ shrinking


def test_tensors_shrink_to_zeros_of_the_smallest_shape():
    found = find(tensors(dtype=torch.float32), lambda t: t.numel() >= 3, settings=FIND)
    assert found.shape == (3,)
    assert_trees_equal(found, torch.zeros(3))


def test_tensors_shrink_a_value_above_a_bound_to_a_simple_number():
    found = find(
        tensors(dtype=torch.float32, shape=()),
        lambda t: bool((t > 100) & (t < 1000)),
        settings=FIND,
    )
    # a plain number, or the simplest boundary in range (float8 e4m3's max)
    assert float(found) in (101.0, 128.0, 448.0), found


def test_dtypes_policies_and_scalers_shrink_to_the_simplest_value():
    assert find(float_dtypes(), lambda d: True, settings=FIND) == torch.float16
    p = find(policies(), lambda p: p.compute_dtype == torch.bfloat16, settings=FIND)
    assert p == funcamp.Policy(torch.float16, torch.bfloat16, torch.float16)
    s = find(scaler_states(), lambda s: s.kind == "dynamic", settings=FIND)
    assert_trees_equal(s, funcamp.ScalerState.dynamic(init_scale=1.0))
    s = find(scaler_states(), lambda s: s.kind == "static", settings=FIND)
    assert_trees_equal(s, funcamp.ScalerState.static(1.0))


def test_pytrees_shrink_to_two_zero_leaves():
    tree = find(pytrees(), lambda t: len(optree.tree_leaves(t)) >= 2, settings=FIND)
    assert len(optree.tree_leaves(tree)) == 2
    assert all(float(x.abs().sum()) == 0 for x in optree.tree_leaves(tree))


# ------------------------------------------------------------------------------ coverage


def test_pytrees_generate_every_container_empty_ones_and_none():
    def contains(tree, pred):
        if pred(tree):
            return True
        if isinstance(tree, dict):
            return any(contains(v, pred) for v in tree.values())
        if isinstance(tree, (list, tuple)):
            return any(contains(v, pred) for v in tree)
        return False

    checks = {
        "dict": lambda x: isinstance(x, dict) and len(x) > 0,
        "list": lambda x: isinstance(x, list) and len(x) > 0,
        "tuple": lambda x: type(x) is tuple and len(x) > 0,
        "namedtuple": lambda x: isinstance(x, Node),
        "empty dict": lambda x: x == {} and isinstance(x, dict),
        "empty list": lambda x: isinstance(x, list) and not x,
        "empty tuple": lambda x: type(x) is tuple and not x,
        "None": lambda x: x is None,
    }
    for name, pred in checks.items():
        find(pytrees(), lambda t, p=pred: contains(t, p), settings=FIND)
        assert name  # found, or find raised NoSuchExample


def test_policies_generate_op_and_module_overrides():
    with_ops = find(
        policies(module_overrides=False),
        lambda p: p.ops != funcamp.OpPolicy.default(),
        settings=FIND,
    )
    assert not with_ops.module_policies
    with_modules = find(
        policies(op_overrides=False),
        lambda p: (
            any(isinstance(k, str) for k, _ in p.module_policies)
            and any(isinstance(k, type) for k, _ in p.module_policies)
        ),
        settings=FIND,
    )
    assert with_modules.ops == funcamp.OpPolicy.default()
    find(policies(), lambda p: any(v.ops != p.ops for _, v in p.module_policies), settings=FIND)


def test_scaler_states_generate_every_kind_and_option():
    for kind in ("dynamic", "static", "noop"):
        find(scaler_states(), lambda s, k=kind: s.kind == k, settings=FIND)
    for pred in (
        lambda s: s.min_scale is not None and s.max_scale is not None,
        lambda s: s.hysteresis > 1 and int(s.hysteresis_tracker) < s.hysteresis,
        lambda s: int(s.growth_tracker) > 0 and int(s.skipped) > 0,
        lambda s: s.growth_factor != 2.0 and s.backoff_factor != 0.5,
    ):
        find(scaler_states(kinds=("dynamic",)), pred, settings=FIND)


# ---------------------------------------------------------------------- strategy options


@PROPERTY
@given(tensors(allow_nan=False, allow_infinity=False, allow_subnormal=False))
def test_tensors_options_exclude_non_finite_and_subnormal(x):
    assert bool(torch.isfinite(x).all())
    assert not bool(_is_subnormal(x).any())


@PROPERTY
@given(tensors(min_value=-3.0, max_value=0.5))
def test_tensors_bounds_hold(x):
    assert bool(torch.isfinite(x).all())
    assert bool(((x >= -3.0) & (x <= 0.5)).all())


@PROPERTY
@given(tensors(dtype=st.sampled_from([torch.float16, torch.bfloat16]), max_dims=2))
def test_tensors_hold_the_requested_dtype_and_rank(x):
    assert x.dtype in (torch.float16, torch.bfloat16)
    # sides of at most max_side=5, or a long vector of max_length=1024 at most
    assert (x.dim() <= 2 and all(s <= 5 for s in x.shape)) or (x.dim() == 1 and x.numel() <= 1024)


def test_bad_strategy_arguments_raise():
    with pytest.raises(ValueError, match="min_value"):
        tensors(dtype=torch.float32, min_value=1.0, max_value=0.0)
    with pytest.raises(ValueError, match="kinds"):
        scaler_states(kinds=("fancy",))
    with pytest.raises(ValueError, match="no dtype"):
        float_dtypes(exclude=FLOAT_DTYPES)


def test_import_needs_hypothesis_only_for_funcamp_testing(monkeypatch):
    # No other funcamp module imports hypothesis, so `import funcamp` works without it ...
    package = pathlib.Path(funcamp.__file__).parent
    for path in package.rglob("*.py"):
        if "testing" not in path.relative_to(package).parts:
            assert "hypothesis" not in path.read_text(), path
    # ... and importing funcamp.testing without it says what to install.
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    for name in [
        m for m in sys.modules if m == "funcamp.testing" or m.startswith("funcamp.testing.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=re.escape("pip install funcamp[testing]")):
        importlib.import_module("funcamp.testing")


# ---------------------------------------------------------------------------- assertions


def test_assert_trees_equal_names_the_leaf_and_the_errors():
    a = {"layer": [torch.zeros(2, 2), torch.ones(3)], "step": 3}
    b = {"layer": [torch.zeros(2, 2), torch.tensor([1.0, 1.0, 1.25])], "step": 3}
    with pytest.raises(AssertionError) as e:
        assert_trees_equal(a, b)
    msg = str(e.value)
    assert "['layer'][1]" in msg
    assert "1 of 3 elements" in msg
    assert "max abs error 0.25" in msg and "max rel error 0.2" in msg
    assert "index (2,)" in msg
    with pytest.raises(AssertionError, match=r"\['step'\] differs: 3 vs 4"):
        assert_trees_equal(a, {**b, "step": 4, "layer": a["layer"]})


def test_assert_trees_equal_checks_structure_dtype_shape_and_nan():
    with pytest.raises(AssertionError, match=r"leaf \['b'\] is in `expected`"):
        assert_trees_equal({"a": torch.ones(1)}, {"a": torch.ones(1), "b": torch.ones(1)})
    with pytest.raises(AssertionError, match="dtype"):
        assert_trees_equal(torch.ones(2), torch.ones(2, dtype=torch.float64))
    with pytest.raises(AssertionError, match="shape"):
        assert_trees_equal(torch.ones(2), torch.ones(3))
    nan = torch.tensor([math.nan, 1.0])
    assert_trees_equal(nan, nan.clone())
    with pytest.raises(AssertionError, match="max abs error inf"):
        assert_trees_equal(nan, nan.clone(), equal_nan=False)
    with pytest.raises(AssertionError, match="static metadata"):
        assert_trees_equal(
            funcamp.ScalerState.dynamic(growth_interval=3),
            funcamp.ScalerState.dynamic(growth_interval=4),
        )


def test_assert_trees_close_tolerances():
    x = torch.linspace(-2, 2, 9)
    assert_trees_close(x.bfloat16(), x, check_dtype=False)
    assert_trees_close([x + 1e-6], [x])
    with pytest.raises(AssertionError) as e:
        assert_trees_close({"y": (x, x * 1.1)}, {"y": (x, x)}, rtol=0.01, atol=0.0)
    msg = str(e.value)
    assert "['y'][1]" in msg and "rtol=0.01" in msg
    assert "max rel error 0.1" in msg and "max abs error 0.2" in msg
    with pytest.raises(AssertionError, match="-inf"):
        assert_trees_close(torch.tensor([math.inf]), torch.tensor([-math.inf]))
    with pytest.raises(ValueError, match="both"):
        assert_trees_close(x, x, rtol=0.1)


# ------------------------------------------------------------- property tests of funcamp


@PROPERTY
@given(pytrees(), float_dtypes())
def test_tree_cast_preserves_structure_and_casts_only_floating_leaves(tree, dtype):
    out = funcamp.tree_cast(tree, dtype)
    assert optree.tree_structure(out, namespace=NAMESPACE) == optree.tree_structure(
        tree, namespace=NAMESPACE
    )
    for before, after in zip(
        optree.tree_leaves(tree, namespace=NAMESPACE), optree.tree_leaves(out, namespace=NAMESPACE)
    ):
        assert after.dtype == dtype and after.shape == before.shape
    # float32 -> float64 -> float32 is exact, nan, inf, -0 and subnormals included.
    t32 = funcamp.tree_cast(tree, torch.float32)
    wide = funcamp.tree_cast(t32, torch.float64)
    assert_trees_equal(funcamp.tree_cast(wide, torch.float32), t32)


@PROPERTY
@given(pytrees())
def test_all_finite_agrees_with_torch_isfinite(tree):
    leaves = optree.tree_leaves(tree, namespace=NAMESPACE)
    expected = all(bool(torch.isfinite(x).all()) for x in leaves)
    result = funcamp.all_finite(tree)
    assert result.dtype == torch.bool and result.dim() == 0
    assert bool(result) == expected


@PROPERTY
@given(
    tensors(dtype=float_dtypes(exclude=(torch.float64,)), allow_nan=False, allow_infinity=False),
    st.integers(0, 24),
)
def test_unscale_of_scale_is_exact_for_power_of_two_scales(x, k):
    state = funcamp.ScalerState.static(2.0**k)
    x32 = x.float()
    small = x32.abs() <= torch.finfo(torch.float32).max / 2.0**k
    x32 = torch.where(small, x32, torch.zeros_like(x32))
    grads, found_inf = funcamp.unscale(state, {"g": funcamp.scale(state, x32)})
    assert not bool(found_inf)
    assert_trees_equal(grads, {"g": x32})


@PROPERTY
@given(scaler_states(), tensors(dtype=torch.float32, max_dims=1))
def test_unscale_flags_exactly_the_non_finite_scaled_grads(state, g):
    _, found_inf = funcamp.unscale(state, [g])
    assert bool(found_inf) == (not bool(torch.isfinite(g).all()))


@PROPERTY
@given(scaler_states())
def test_scaler_states_round_trip_through_state_dict(state):
    buf = io.BytesIO()
    torch.save(funcamp.state_dict({"scaler": state}), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    out = funcamp.load_state_dict({"scaler": funcamp.ScalerState.noop()}, sd)
    assert_trees_equal(out, {"scaler": state})


@PROPERTY
@given(scaler_states(), st.booleans())
def test_update_keeps_the_state_valid(state, overflow):
    new = funcamp.update(state, torch.tensor(overflow))
    assert_trees_equal(
        optree.tree_structure(new, namespace=NAMESPACE),
        optree.tree_structure(state, namespace=NAMESPACE),
    )
    assert int(new.skipped) == int(state.skipped) + overflow
    scale, old = float(new.scale), float(state.scale)
    # Finite always; positive when min_scale is set. Without it a backoff as tiny as 5e-324 takes
    # the scale to 0, exactly as torch._amp_update_scale_ does (update is bit-identical to it).
    assert math.isfinite(scale) and scale >= 0
    assert scale > 0 or (state.min_scale is None and overflow)
    if overflow or state.kind != "dynamic":
        assert scale <= old
    if state.min_scale is not None:
        assert scale >= min(state.min_scale, old)
    if state.max_scale is not None:
        assert scale <= max(state.max_scale, old)
    if state.kind == "dynamic":
        assert 0 <= int(new.growth_tracker) < state.growth_interval


@PROPERTY
@given(policies())
def test_policies_round_trip_through_str_and_get_policy(policy):
    """Every drawn policy prints whole: it reads back equal, or (a module class among its keys)
    holds a marker that get_policy refuses; it never reads back as a policy without a part."""
    plain = dataclasses.replace(policy, ops=funcamp.OpPolicy.default(), module_policies=())
    assert hash(policy) == hash(dataclasses.replace(policy))
    if "<class " in str(policy):
        with pytest.raises(ValueError, match="has no text form"):
            funcamp.get_policy(str(policy))
    else:
        assert funcamp.get_policy(str(policy)) == policy
    if policy != plain:
        assert str(policy) != str(plain) and repr(policy) != repr(plain)


@PROPERTY
@given(policies(), pytrees())
def test_policy_casts_preserve_structure_and_leave_float64_alone(policy, tree):
    for cast, dtype in (
        (policy.cast_to_param, policy.param_dtype),
        (policy.cast_to_compute, policy.compute_dtype),
        (policy.cast_to_output, policy.output_dtype),
    ):
        out = cast(tree)
        paths = optree.tree_flatten_with_path(out, namespace=NAMESPACE)[0]
        assert paths == optree.tree_flatten_with_path(tree, namespace=NAMESPACE)[0]
        for before, after in zip(
            optree.tree_leaves(tree, namespace=NAMESPACE),
            optree.tree_leaves(out, namespace=NAMESPACE),
        ):
            if before.dtype == torch.float64 and dtype != torch.float64:
                assert after is before
            else:
                assert after.dtype == dtype


@PROPERTY
@given(st.booleans(), pytrees())
def test_tree_select_picks_one_tree_bit_for_bit(pred, tree):
    other = optree.tree_map(lambda x: x.to(torch.float64) + 1, tree, namespace=NAMESPACE)
    other = funcamp.tree_cast(other, torch.float32)
    tree32 = funcamp.tree_cast(tree, torch.float32)
    out = funcamp.tree_select(torch.tensor(pred), tree32, other)
    assert_trees_equal(out, tree32 if pred else other)
