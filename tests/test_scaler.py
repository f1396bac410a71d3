"""Tests for funcamp.scaling (state, ops, step): ScalerState, scale, unscale, update, unscale_and_step."""

from __future__ import annotations

import math
import types
from contextlib import nullcontext
from typing import NamedTuple

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from bitwise import same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

import funcamp
from funcamp.scaling.skip import device_path

#: The optree namespace funcamp documents for its state types (docs/concepts.md).
NAMESPACE = "funcamp"

F32 = torch.finfo(torch.float32)
CONFIG_FIELDS = (
    "kind",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_scale",
    "max_scale",
    "hysteresis",
)
LEAF_FIELDS = ("scale", "growth_tracker", "hysteresis_tracker", "skipped")


def assert_states_equal(a: funcamp.ScalerState, b: funcamp.ScalerState) -> None:
    assert type(a) is type(b) is funcamp.ScalerState
    for name in LEAF_FIELDS:
        assert same_bits(getattr(a, name), getattr(b, name)), name
    for name in CONFIG_FIELDS:
        assert getattr(a, name) == getattr(b, name), name


def rich_state() -> funcamp.ScalerState:
    s = funcamp.ScalerState.dynamic(
        1000.0,
        growth_factor=1.5,
        backoff_factor=0.25,
        growth_interval=3,
        min_scale=1.0,
        max_scale=2.0**20,
        hysteresis=3,
    )
    return funcamp.update(funcamp.update(s, torch.tensor(True)), torch.tensor(False))


def momentum(lr: float = 0.1, beta: float = 0.9) -> funcamp.Optimizer:
    """A stateful optimizer (buffers and a step count) to check skipped steps against."""

    def init(params):
        return {
            "m": optree.tree_map(torch.zeros_like, params, namespace=NAMESPACE),
            "count": torch.zeros((), dtype=torch.int32),
        }

    def update(grads, state, params):
        m = optree.tree_map(lambda b, g: beta * b + g, state["m"], grads, namespace=NAMESPACE)
        updates = optree.tree_map(lambda b: -lr * b, m, namespace=NAMESPACE)
        return updates, {"m": m, "count": state["count"] + 1}

    return funcamp.Optimizer(init, update)


# ----------------------------------------------------------------------- construction


def test_dynamic_defaults_match_grad_scaler():
    s = funcamp.ScalerState.dynamic()
    gs = torch.amp.GradScaler("cpu")
    assert s.to_grad_scaler_state_dict() == gs.state_dict()
    assert s.scale.dtype == torch.float32 and s.scale.dim() == 0
    for name in ("growth_tracker", "hysteresis_tracker", "skipped"):
        leaf = getattr(s, name)
        assert leaf.dtype == torch.int32 and leaf.dim() == 0
    assert (s.kind, s.hysteresis, s.min_scale, s.max_scale) == ("dynamic", 1, None, None)


def test_state_is_frozen():
    s = funcamp.ScalerState.dynamic()
    with pytest.raises(AttributeError):
        s.scale = torch.tensor(1.0)


@pytest.mark.parametrize(
    ("kwargs", "arg", "needle"),
    [
        ({"growth_factor": 1.0}, "growth_factor", "got 1.0"),
        ({"growth_factor": 0.5}, "growth_factor", "got 0.5"),
        ({"backoff_factor": 0.0}, "backoff_factor", "got 0.0"),
        ({"backoff_factor": 1.0}, "backoff_factor", "got 1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor", "got 1.5"),
        ({"backoff_factor": -0.5}, "backoff_factor", "got -0.5"),
        ({"growth_interval": 0}, "growth_interval", "got 0"),
        ({"growth_interval": -3}, "growth_interval", "got -3"),
        ({"init_scale": 0.0}, "init_scale", "got 0.0"),
        ({"init_scale": -1.0}, "init_scale", "got -1.0"),
        ({"init_scale": math.inf}, "init_scale", "got inf"),
        ({"init_scale": math.nan}, "init_scale", "got nan"),
        ({"init_scale": 1e39}, "init_scale", "got 1e+39"),
        ({"min_scale": 10.0, "max_scale": 1.0, "init_scale": 5.0}, "min_scale", "got 10.0"),
        ({"min_scale": 0.0}, "min_scale", "got 0.0"),
        ({"min_scale": 1e-40}, "min_scale", "got 1e-40"),
        ({"max_scale": math.inf}, "max_scale", "got inf"),
        ({"hysteresis": 0}, "hysteresis", "got 0"),
        ({"init_scale": 0.5, "min_scale": 1.0}, "init_scale", "got 0.5"),
        ({"init_scale": 4.0, "max_scale": 2.0}, "init_scale", "got 4.0"),
    ],
)
def test_dynamic_rejects_bad_config(kwargs, arg, needle):
    with pytest.raises(ValueError) as err:
        funcamp.ScalerState.dynamic(**kwargs)
    msg = str(err.value)
    assert msg.startswith(f"funcamp.ScalerState.dynamic: `{arg}` must be")
    assert needle in msg


def test_a_number_of_the_wrong_type_is_a_type_error():
    """One dialect of number checks: the wrong type is a TypeError, a bad value a ValueError."""
    with pytest.raises(TypeError, match=r"`growth_interval` must be an int >= 1, got float 2\.5"):
        funcamp.ScalerState.dynamic(growth_interval=2.5)
    with pytest.raises(TypeError, match=r"`growth_factor` must be a finite real number > 1"):
        funcamp.ScalerState.dynamic(growth_factor="2")
    with pytest.raises(TypeError, match=r"`alpha` must be a finite real number >= 0"):
        funcamp.cosine_decay_schedule(1.0, 5, alpha=None)


def test_static_rejects_bad_scale():
    for bad in (0.0, -2.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"funcamp.ScalerState.static: `scale` must be"):
            funcamp.ScalerState.static(bad)


def test_direct_construction_validates_config():
    s = funcamp.ScalerState.dynamic()
    leaves = [getattr(s, n) for n in LEAF_FIELDS]
    with pytest.raises(ValueError, match=r"funcamp.ScalerState: `kind` must be one of"):
        funcamp.ScalerState(*leaves, kind="sometimes")
    with pytest.raises(ValueError, match=r"`growth_factor` must be a finite real number > 1"):
        funcamp.ScalerState(*leaves, growth_factor=1.0)


@pytest.mark.parametrize(
    ("found_inf", "needle"),
    [
        (torch.tensor(1.0), "torch.float32"),
        (torch.tensor([True]), "shape (1,)"),
        (True, "bool True"),
        (torch.tensor(1, dtype=torch.int32), "torch.int32"),
    ],
)
def test_update_rejects_bad_found_inf(found_inf, needle):
    s = funcamp.ScalerState.dynamic()
    with pytest.raises(TypeError) as err:
        funcamp.update(s, found_inf)
    msg = str(err.value)
    assert msg.startswith("funcamp.update: `found_inf` must be a 0-d bool tensor, got")
    assert needle in msg


def test_state_must_be_scaler_state():
    with pytest.raises(TypeError, match=r"funcamp.update: `state` must be a ScalerState"):
        funcamp.update({"scale": torch.tensor(1.0)}, torch.tensor(False))
    with pytest.raises(TypeError, match=r"funcamp.unscale: `state` must be a ScalerState"):
        funcamp.unscale(None, {})


@pytest.mark.parametrize(
    ("grads", "needle"),
    [
        ({"w": torch.ones(2)}, "leaf ['b'] is in `params` but not in `grads`"),
        (
            {"w": torch.ones(2), "b": torch.ones(1), "c": torch.ones(1)},
            "leaf ['c'] is in `grads` but not in `params`",
        ),
        ({"w": torch.ones(3), "b": torch.ones(1)}, "leaf ['w'] must be a tensor of shape (2,)"),
        ({"w": torch.ones(2), "b": 1.0}, "leaf ['b'] must be a tensor of shape (1,)"),
    ],
)
def test_unscale_and_step_rejects_mismatched_trees(grads, needle):
    params = {"w": torch.zeros(2), "b": torch.zeros(1)}
    opt = funcamp.sgd(0.1)
    with pytest.raises(ValueError) as err:
        funcamp.unscale_and_step(
            funcamp.ScalerState.dynamic(), opt, grads, opt.init(params), params
        )
    msg = str(err.value)
    assert msg.startswith("funcamp.unscale_and_step: `grads`")
    assert needle in msg


def test_for_policy_duck_types_dtypes():
    ns = types.SimpleNamespace
    f16, f32, bf16 = torch.float16, torch.float32, torch.bfloat16
    assert funcamp.ScalerState.for_policy(ns(param_dtype=f32, compute_dtype=f16)).kind == "dynamic"
    assert funcamp.ScalerState.for_policy(ns(param_dtype=f16, compute_dtype=f16)).kind == "dynamic"
    assert funcamp.ScalerState.for_policy(ns(param_dtype=f32, compute_dtype=bf16)).kind == "noop"
    assert funcamp.ScalerState.for_policy(ns(param_dtype=f32, compute_dtype=f32)).kind == "noop"
    assert funcamp.ScalerState.for_policy(ns(compute_dtype=f16)).kind == "dynamic"
    with pytest.raises(TypeError, match=r"funcamp.ScalerState.for_policy: `policy` must have"):
        funcamp.ScalerState.for_policy(object())


def test_for_policy_with_real_policies():
    policy = pytest.importorskip("funcamp.policy.policy")
    if not hasattr(policy, "get_policy"):
        pytest.skip("funcamp.get_policy is not available yet")
    assert funcamp.ScalerState.for_policy(policy.get_policy("mixed_float16")).kind == "dynamic"
    assert funcamp.ScalerState.for_policy(policy.get_policy("bf16-mixed")).kind == "noop"
    assert funcamp.ScalerState.for_policy("float32").kind == "noop"


# ----------------------------------------------------------------------- scale / unscale


def test_scale_casts_to_float32_and_passes_non_floating_leaves():
    s = funcamp.ScalerState.dynamic(init_scale=2.0**20)
    tree = {
        "loss": torch.tensor(60000.0, dtype=torch.float16),
        "n": torch.tensor(3),
        "name": "x",
    }
    out = funcamp.scale(s, tree)
    assert out["loss"].dtype == torch.float32
    assert out["loss"].item() == 60000.0 * 2.0**20  # would be inf in float16
    assert out["n"] is tree["n"] and out["name"] == "x"
    loss64 = torch.tensor(0.1, dtype=torch.float64)
    assert funcamp.scale(s, loss64).dtype == torch.float64


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(-60, 60),
    values=st.lists(
        st.one_of(
            st.just(0.0),
            st.floats(2.0**-60, 2.0**60).flatmap(lambda v: st.sampled_from([v, -v])),
        ),
        min_size=1,
        max_size=16,
    ),
)
def test_unscale_of_scale_is_exact_for_powers_of_two(k, values):
    s = funcamp.ScalerState.dynamic(init_scale=2.0**k)
    x = torch.tensor(values, dtype=torch.float32)
    grads, found_inf = funcamp.unscale(s, funcamp.scale(s, {"g": x}))
    assert not found_inf
    assert same_bits(grads["g"], x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unscale_half_grads_in_float32(dtype):
    s = funcamp.ScalerState.dynamic(init_scale=1024.0)
    g = torch.tensor([1024.0, 2048.0, 3.0], dtype=dtype)
    grads, found_inf = funcamp.unscale(s, {"g": g})
    assert grads["g"].dtype == torch.float32
    assert same_bits(grads["g"], g.float() * (1 / 1024.0))
    assert not found_inf
    # GradScaler refuses float16 grads outright; funcamp unscales them.
    if dtype == torch.float16:
        p = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
        p.grad = g.clone()
        opt = torch.optim.SGD([p], lr=0.1)
        gs = torch.amp.GradScaler("cpu")
        gs.scale(torch.tensor(1.0))
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            gs.unscale_(opt)


def test_unscale_never_mutates_inputs():
    s = funcamp.ScalerState.dynamic(init_scale=8.0)
    g = {"a": torch.tensor([8.0, math.inf]), "b": torch.tensor([16.0], dtype=torch.float16)}
    before = {k: v.clone() for k, v in g.items()}
    grads, found_inf = funcamp.unscale(s, g)
    assert bool(found_inf)
    for k in g:
        assert same_bits(g[k], before[k])
        assert grads[k].data_ptr() != g[k].data_ptr()


def test_found_inf_is_judged_on_scaled_grads():
    # A scale below 1 can overflow a finite scaled grad when unscaling; torch's rule (and ours)
    # only looks at the scaled grads.
    s = funcamp.ScalerState.dynamic(init_scale=2.0**-10)
    grads, found_inf = funcamp.unscale(s, {"g": torch.tensor([F32.max])})
    assert not bool(found_inf) and math.isinf(grads["g"].item())
    found = torch.zeros(())
    t = torch.tensor([F32.max])
    torch._amp_foreach_non_finite_check_and_unscale_([t], found, torch.tensor(2.0**10))
    assert found.item() == 0.0 and same_bits(t, grads["g"])


def _random_grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    leaves = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float32):
        n = int(torch.randint(1, 40, (), generator=gen))
        x = (torch.randn(n, generator=gen) * 2.0 ** float(torch.randint(-20, 10, ()))).to(dtype)
        leaves.append(x)
    return leaves


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    scale=st.one_of(st.floats(2.0**-20, 2.0**60), st.integers(-20, 60).map(lambda k: 2.0**k)),
    poison=st.sampled_from([None, math.inf, -math.inf, math.nan]),
    which=st.integers(0, 4),
)
def test_fused_and_pure_unscale_are_identical(seed, scale, poison, which):
    leaves = _random_grads(seed)
    if poison is not None:
        leaves[which][0] = poison
    s = funcamp.ScalerState.static(scale)
    fused, fused_inf = funcamp.unscale(s, leaves)  # plain eager: torch's fused kernel
    # Leaves that autograd tracks take the pure path.
    tracked = [x.detach().clone().requires_grad_(True) for x in leaves]
    pure, pure_inf = funcamp.unscale(s, tracked)
    pure = [x.detach() for x in pure]
    assert bool(fused_inf) == bool(pure_inf) == (poison is not None)
    for a, b in zip(fused, pure):
        assert a.dtype == b.dtype
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def test_unscale_uses_grad_scalers_reciprocal():
    s = funcamp.ScalerState.dynamic(init_scale=3.0)
    g = torch.tensor([1.0, 7.0, 3.0e-3])
    grads, _ = funcamp.unscale(s, {"g": g})
    inv = torch.tensor(3.0, dtype=torch.float64).reciprocal().float()
    assert same_bits(grads["g"], g * inv)


def test_empty_trees():
    s = funcamp.ScalerState.dynamic()
    grads, found_inf = funcamp.unscale(s, {})
    assert grads == {} and found_inf.dtype == torch.bool and not found_inf
    opt = funcamp.sgd(0.1)
    params, _, info = funcamp.unscale_and_step(s, opt, {}, opt.init({}), {})
    assert params == {} and float(info.grad_norm) == 0.0


# ----------------------------------------------------------------------- update properties


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def megatron_reference(state: funcamp.ScalerState, flags: list[bool]) -> list[tuple]:
    """Megatron-LM's DynamicGradScaler.update, with torch's float64 products and finite check."""
    scale, tracker, hyst = state.scale.item(), 0, state.hysteresis
    out = []
    for found in flags:
        if found:
            tracker = 0
            hyst = max(hyst - 1, 0)
            if hyst <= 0:
                scale = _f32(scale * state.backoff_factor)
                if state.min_scale is not None:
                    scale = max(scale, _f32(state.min_scale))
        else:
            tracker += 1
            if tracker == state.growth_interval:
                tracker, hyst = 0, state.hysteresis
                grown = _f32(scale * state.growth_factor)
                if math.isfinite(grown):
                    scale = grown
                if state.max_scale is not None:
                    scale = min(scale, _f32(state.max_scale))
        out.append((scale, tracker, hyst))
    return out


@settings(max_examples=80, deadline=None)
@given(
    init=st.floats(1.0, 1e6),
    growth=st.floats(1.0001, 4.0),
    backoff=st.floats(0.05, 0.95),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    flags=st.lists(st.booleans(), min_size=1, max_size=40),
)
def test_hysteresis_follows_megatron(init, growth, backoff, interval, hysteresis, flags):
    s = funcamp.ScalerState.dynamic(init, growth, backoff, interval, hysteresis=hysteresis)
    for flag, (scale, tracker, hyst) in zip(flags, megatron_reference(s, flags)):
        s = funcamp.update(s, torch.tensor(flag))
        assert (s.scale.item(), int(s.growth_tracker), int(s.hysteresis_tracker)) == (
            scale,
            tracker,
            hyst,
        )


@pytest.mark.parametrize("h", [1, 2, 3, 5])
def test_hysteresis_backs_off_at_hth_overflow_since_growth(h):
    s = funcamp.ScalerState.dynamic(1024.0, growth_interval=3, hysteresis=h)
    # Overflows separated by clean steps (fewer than growth_interval) still count.
    for i in range(1, h + 2):
        s = funcamp.update(s, torch.tensor(True))
        assert float(s.scale) == (1024.0 if i < h else 1024.0 * 0.5 ** (i - h + 1)), i
        s = funcamp.update(s, torch.tensor(False))
    # A growth step restores the full hysteresis.
    scale = float(s.scale)
    s = funcamp.update(funcamp.update(s, torch.tensor(False)), torch.tensor(False))
    assert float(s.scale) == 2 * scale and int(s.hysteresis_tracker) == h
    for i in range(1, h + 1):
        s = funcamp.update(s, torch.tensor(True))
        assert float(s.scale) == (2 * scale if i < h else scale), i


@settings(max_examples=60, deadline=None)
@given(
    init=st.one_of(st.floats(1e-3, 1e30), st.integers(-10, 100).map(lambda k: 2.0**k)),
    growth=st.floats(1.0001, 4.0),
    backoff=st.floats(0.05, 0.95),
    interval=st.integers(1, 5),
    flags=st.lists(st.booleans(), min_size=1, max_size=40),
)
def test_hysteresis_one_is_torch_rule(init, growth, backoff, interval, flags):
    s = funcamp.ScalerState.dynamic(init, growth, backoff, interval, hysteresis=1)
    ref_scale, ref_tracker = s.scale.clone(), s.growth_tracker.clone()
    for flag in flags:
        s = funcamp.update(s, torch.tensor(flag))
        torch._amp_update_scale_(
            ref_scale, ref_tracker, torch.tensor(float(flag)), growth, backoff, interval
        )
        assert same_bits(s.scale, ref_scale) and same_bits(s.growth_tracker, ref_tracker)


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(-20, 20),
    growth=st.sampled_from([2.0, 1.5, 1.0001, 3.0]),
    interval=st.integers(1, 10),
    n=st.integers(0, 60),
)
def test_clean_steps_grow_floor_n_over_interval_times(k, growth, interval, n):
    s = funcamp.ScalerState.dynamic(2.0**k, growth_factor=growth, growth_interval=interval)
    expected = s.scale.item()
    for _ in range(n // interval):
        expected = _f32(expected * growth)
    for _ in range(n):
        s = funcamp.update(s, torch.tensor(False))
    assert s.scale.item() == expected
    assert int(s.growth_tracker) == n % interval
    assert int(s.skipped) == 0


@settings(max_examples=60, deadline=None)
@given(
    min_exp=st.integers(-126, 0),
    span=st.integers(0, 127),
    growth=st.floats(1.0001, 1e6),
    backoff=st.floats(1e-6, 0.999),
    interval=st.integers(1, 3),
    hysteresis=st.integers(1, 3),
    flags=st.lists(st.booleans(), min_size=1, max_size=60),
)
def test_bounds_keep_scale_normal_and_finite(
    min_exp, span, growth, backoff, interval, hysteresis, flags
):
    lo = 2.0**min_exp
    hi = min(2.0 ** min(min_exp + span, 127), F32.max)
    s = funcamp.ScalerState.dynamic(
        lo,
        growth,
        backoff,
        interval,
        min_scale=lo,
        max_scale=hi,
        hysteresis=hysteresis,
    )
    for flag in flags:
        s = funcamp.update(s, torch.tensor(flag))
        v = s.scale.item()
        assert math.isfinite(v) and v >= F32.tiny and lo <= v <= hi


def test_unbounded_backoff_matches_torch_even_to_zero():
    # Without min_scale the scale follows torch all the way down (subnormal, then 0).
    s = funcamp.ScalerState.dynamic(2.0**-120, backoff_factor=0.01)
    ref_s, ref_t = s.scale.clone(), s.growth_tracker.clone()
    for _ in range(12):
        s = funcamp.update(s, torch.tensor(True))
        torch._amp_update_scale_(ref_s, ref_t, torch.tensor(1.0), 2.0, 0.01, 2000)
        assert same_bits(s.scale, ref_s)
    assert s.scale.item() == 0.0


def test_growth_refused_when_grown_scale_not_finite():
    s = funcamp.ScalerState.dynamic(F32.max, growth_interval=1)
    s = funcamp.update(s, torch.tensor(False))
    assert s.scale.item() == F32.max and int(s.growth_tracker) == 0


@pytest.mark.parametrize("kind", ["static", "noop"])
def test_static_and_noop_never_change_scale_but_count_skips(kind):
    s = funcamp.ScalerState.static(64.0) if kind == "static" else funcamp.ScalerState.noop()
    scale = s.scale.clone()
    flags = [True, False, False, True, True, False]
    for flag in flags:
        s = funcamp.update(s, torch.tensor(flag))
        assert same_bits(s.scale, scale) and s.kind == kind
    assert int(s.skipped) == sum(flags)


def test_noop_still_skips_non_finite_steps():
    s = funcamp.ScalerState.noop()
    params = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}
    opt = funcamp.sgd(0.5)
    grads = {"w": torch.tensor([math.nan, 1.0], dtype=torch.bfloat16)}
    new, _, info = funcamp.unscale_and_step(s, opt, grads, opt.init(params), params)
    assert bool(info.found_inf) and same_bits(new["w"], params["w"])
    assert int(funcamp.update(s, info.found_inf).skipped) == 1


# ----------------------------------------------------------------------- unscale_and_step


params_trees = st.fixed_dictionaries(
    {
        "w": st.integers(1, 6).map(lambda n: (n, 3)),
        "b": st.integers(1, 6).map(lambda n: (n,)),
    }
)


@settings(max_examples=40, deadline=None)
@given(
    shapes=params_trees,
    seed=st.integers(0, 10_000),
    poison=st.sampled_from([math.inf, -math.inf, math.nan]),
    leaf=st.sampled_from(["w", "b"]),
    warmup=st.integers(0, 3),
)
def test_skipped_step_leaves_params_and_opt_state_bit_identical(shapes, seed, poison, leaf, warmup):
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(shape, generator=gen) for k, shape in shapes.items()}
    opt = momentum()
    opt_state = opt.init(params)
    s = funcamp.ScalerState.dynamic(2.0**12)

    def grads():
        return {k: torch.randn(v.shape, generator=gen) * 2.0**12 for k, v in params.items()}

    for _ in range(warmup):
        params, opt_state, info = funcamp.unscale_and_step(s, opt, grads(), opt_state, params)
        assert not bool(info.found_inf)
    bad = grads()
    bad[leaf].view(-1)[0] = poison
    new_params, new_state, info = funcamp.unscale_and_step(s, opt, bad, opt_state, params)
    assert bool(info.found_inf)
    for a, b in zip(
        optree.tree_leaves((new_params, new_state), namespace=NAMESPACE),
        optree.tree_leaves((params, opt_state), namespace=NAMESPACE),
    ):
        assert same_bits(a, b)
    # A clean step does move them.
    moved, moved_state, info = funcamp.unscale_and_step(s, opt, grads(), opt_state, params)
    assert not bool(info.found_inf)
    assert int(moved_state["count"]) == warmup + 1
    assert not torch.equal(moved["w"], params["w"])


def test_unscale_and_step_grad_norm_and_half_params():
    s = funcamp.ScalerState.dynamic(2.0**8)
    params = {"w": torch.ones(3, dtype=torch.float16), "b": torch.zeros(2)}
    grads = {
        "w": torch.tensor([3.0, 4.0, 0.0], dtype=torch.float16) * 2**8,
        "b": torch.tensor([12.0, 0.0]) * 2**8,
    }
    opt = funcamp.sgd(0.125)
    new, _, info = funcamp.unscale_and_step(s, opt, grads, opt.init(params), params)
    assert isinstance(info, funcamp.StepInfo)
    assert info.grad_norm.dtype == torch.float32 and info.grad_norm.item() == 13.0
    assert info.found_inf.dtype == torch.bool and info.found_inf.dim() == 0
    assert new["w"].dtype == torch.float16
    assert new["w"].tolist() == [1 - 0.375, 1 - 0.5, 1.0]
    assert new["b"].tolist() == [-1.5, 0.0]
    for donate in (False, True):  # grad_norm=False: no norm, the same step
        g = {k: v.clone() for k, v in grads.items()}
        same, _, quiet = funcamp.unscale_and_step(
            s, opt, g, opt.init(params), params, donate_grads=donate, grad_norm=False
        )
        assert quiet.grad_norm is None and quiet.found_inf.item() is False
        assert all(torch.equal(same[k], new[k]) for k in new)
    with pytest.raises(TypeError, match=r"`grad_norm` must be a bool"):
        funcamp.unscale_and_step(s, opt, grads, opt.init(params), params, grad_norm=1)


def test_step_info_is_a_pytree():
    info = funcamp.StepInfo(torch.tensor(True), torch.tensor(2.0))
    assert len(optree.tree_leaves(info, namespace=NAMESPACE)) == 2
    leaves, spec = torch_pytree.tree_flatten(info)
    assert torch_pytree.tree_unflatten(leaves, spec) == info


def test_no_host_sync_in_step(monkeypatch):
    params = {"w": torch.randn(3, 2), "b": torch.zeros(2)}
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    opt = momentum()
    opt_state = opt.init(params)
    s = funcamp.ScalerState.dynamic(2.0**10, growth_interval=2, hysteresis=2, min_scale=1.0)

    def boom(*args, **kwargs):
        raise AssertionError("host sync")

    monkeypatch.setattr(torch.Tensor, "item", boom)
    monkeypatch.setattr(torch.Tensor, "__bool__", boom)
    with device_path():  # as on CUDA (the CPU's eager step reads its skip flag: test_host_sync)
        for poison in (0.0, math.inf, 0.0, 0.0):
            params, opt_state, s, _ = _train_step(params, opt_state, s, x, y, torch.tensor(poison))
    monkeypatch.undo()
    assert int(s.skipped) == 1


# ----------------------------------------------------------------------- pytree, vmap, compile


@pytest.mark.parametrize(
    "make",
    [
        rich_state,
        lambda: funcamp.ScalerState.static(3.0),
        lambda: funcamp.ScalerState.noop(),
    ],
)
def test_every_field_survives_optree_and_torch_pytree(make):
    s = make()
    leaves, spec = optree.tree_flatten(s, namespace=NAMESPACE)
    assert len(leaves) == 4
    assert_states_equal(optree.tree_unflatten(spec, leaves), s)
    paths = optree.tree_flatten_with_path(s, namespace=NAMESPACE)[0]
    assert paths == [(n,) for n in LEAF_FIELDS]
    leaves, spec = torch_pytree.tree_flatten(s)
    assert len(leaves) == 4
    assert_states_equal(torch_pytree.tree_unflatten(leaves, spec), s)
    keyed, _ = torch_pytree.tree_flatten_with_path(s)
    assert [torch_pytree.keystr(k) for k, _ in keyed] == [f".{n}" for n in LEAF_FIELDS]
    # The configuration is part of the structure.
    other = funcamp.ScalerState.dynamic(growth_interval=5)
    assert torch_pytree.tree_structure(other) != torch_pytree.tree_structure(s)
    assert optree.tree_structure(other, namespace=NAMESPACE) != optree.tree_structure(
        s, namespace=NAMESPACE
    )


def test_every_field_survives_compile_input_and_output():
    s = rich_state()

    @torch.compile(backend="eager", fullgraph=True)
    def roundtrip(state, flag):
        return state, funcamp.update(state, flag)

    same, updated = roundtrip(s, torch.tensor(True))
    assert_states_equal(same, s)
    assert_states_equal(updated, funcamp.update(s, torch.tensor(True)))


def test_vmap_over_stacked_scalers_updates_each_independently():
    members = [
        funcamp.ScalerState.dynamic(2.0**k, growth_interval=2, hysteresis=2) for k in (3, 10, 20)
    ]
    members[1] = funcamp.update(members[1], torch.tensor(False))
    members[2] = funcamp.update(members[2], torch.tensor(True))
    stacked = optree.tree_map(lambda *xs: torch.stack(xs), *members, namespace=NAMESPACE)
    batched_update = torch.func.vmap(funcamp.update)
    for flags in ([True, False, False], [False, False, True], [True, True, True]):
        flag_tensor = torch.tensor(flags)
        stacked = batched_update(stacked, flag_tensor)
        members = [funcamp.update(m, torch.tensor(f)) for m, f in zip(members, flags)]
        for i, m in enumerate(members):
            member = optree.tree_map(lambda x, i=i: x[i], stacked, namespace=NAMESPACE)
            assert_states_equal(member, m)


def _loss(params, x, y):
    return ((x @ params["w"] + params["b"] - y) ** 2).mean()


def _train_step(params, opt_state, scaler, x, y, poison):
    def scaled(p):
        # poison is 0 or inf: multiplying makes the gradients non-finite, not just the loss.
        loss = _loss(p, x, y) * (1.0 + poison)
        return funcamp.scale(scaler, loss), loss

    grads, _ = torch.func.grad(scaled, has_aux=True)(params)
    params, opt_state, info = funcamp.unscale_and_step(
        scaler, _train_step.opt, grads, opt_state, params
    )
    scaler = funcamp.update(scaler, info.found_inf)
    return params, opt_state, scaler, info


_train_step.opt = momentum()


@pytest.fixture(scope="module")
def compiled_step():
    torch._dynamo.reset()
    return torch.compile(_train_step, backend="aot_eager", fullgraph=True)


def test_compiled_step_no_breaks_no_recompiles(compiled_step):
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 2), "b": torch.zeros(2)}
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    opt_state = _train_step.opt.init(params)
    s = funcamp.ScalerState.dynamic(2.0**10, growth_interval=2)
    explain = torch._dynamo.explain(_train_step)(params, opt_state, s, x, y, torch.tensor(0.0))
    assert explain.graph_break_count == 0 and explain.graph_count == 1

    eager = (params, opt_state, s)
    compiled = (params, opt_state, s)
    scales = set()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(20):
            poison = torch.tensor(math.inf if i % 6 == 5 else 0.0)
            *eager, _ = _train_step(*eager, x, y, poison)
            *compiled, info = compiled_step(*compiled, x, y, poison)
            assert bool(info.found_inf) == (i % 6 == 5)
            assert_states_equal(compiled[2], eager[2])
            for a, b in zip(
                optree.tree_leaves(compiled[:2], namespace=NAMESPACE),
                optree.tree_leaves(eager[:2], namespace=NAMESPACE),
            ):
                assert same_bits(a, b)
            scales.add(compiled[2].scale.item())
    assert len(scales) > 3
    assert int(compiled[2].skipped) == 3


def test_inductor_update_and_unscale_bit_identical_to_eager():
    """Inductor keeps the float64 products and float32 rounding of the update kernel."""

    def f(state, grads):
        unscaled, found_inf = funcamp.unscale(state, grads)
        return unscaled, found_inf, funcamp.update(state, found_inf)

    compiled = torch.compile(f, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(7, generator=gen), "b": torch.randn(5, generator=gen).half()}
    state = funcamp.ScalerState.dynamic(3.0, 1.0001, 0.9, 1)
    ref = state
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(30):
            g = dict(grads)
            if i % 4 == 3:
                g["a"] = g["a"].clone().index_fill_(0, torch.tensor([2]), math.nan)
            got_grads, got_inf, state = compiled(state, g)
            want_grads, want_inf, ref = f(ref, g)
            assert bool(got_inf) == bool(want_inf)
            assert_states_equal(state, ref)
            for k in g:
                assert torch.equal(got_grads[k].nan_to_num(), want_grads[k].nan_to_num())


# ----------------------------------------------------------------------- GradScaler interop


def _drive_grad_scaler(gs: torch.amp.GradScaler, flags: list[bool]) -> None:
    """Run GradScaler's public loop (scale, backward, unscale_, step, update) once per flag,
    with an inf injected into the gradient where the flag is True."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for flag in flags:
        opt.zero_grad()
        gs.scale((p * 3.0).sum()).backward()
        if flag:
            p.grad[0] = math.inf
        gs.unscale_(opt)
        gs.step(opt)
        gs.update()


@pytest.mark.parametrize("initialized", [False, True])
def test_from_grad_scaler_round_trips_state_dict(initialized):
    gs = torch.amp.GradScaler(
        "cpu", init_scale=3.0e5, growth_factor=1.7, backoff_factor=0.3, growth_interval=4
    )
    if initialized:
        _drive_grad_scaler(gs, [False, True, False, False])
    for source in (gs, gs.state_dict()):
        s = funcamp.ScalerState.from_grad_scaler(source)
        assert s.to_grad_scaler_state_dict() == gs.state_dict()


def test_disabled_grad_scaler_is_noop():
    gs = torch.amp.GradScaler("cpu", enabled=False)
    s = funcamp.ScalerState.from_grad_scaler(gs)
    assert s.kind == "noop" and s.to_grad_scaler_state_dict() == {} == gs.state_dict()
    assert funcamp.ScalerState.from_grad_scaler({}).kind == "noop"


def test_grad_scaler_loaded_from_ours_continues_bit_identically():
    gen = torch.Generator().manual_seed(1)
    s = funcamp.ScalerState.dynamic(12345.0, 1.0001, 0.9, 3)
    for _ in range(10):
        s = funcamp.update(s, torch.rand((), generator=gen) < 0.3)
    gs = torch.amp.GradScaler("cpu")
    gs.load_state_dict(s.to_grad_scaler_state_dict())
    for _ in range(40):
        flag = bool(torch.rand((), generator=gen) < 0.3)
        _drive_grad_scaler(gs, [flag])
        s = funcamp.update(s, torch.tensor(flag))
        assert same_bits(s.scale, gs._scale) and same_bits(s.growth_tracker, gs._growth_tracker)
    back = funcamp.ScalerState.from_grad_scaler(gs)
    assert same_bits(back.scale, s.scale) and same_bits(back.growth_tracker, s.growth_tracker)


def test_grad_scaler_interop_errors():
    with pytest.raises(ValueError, match=r"has no static mode"):
        funcamp.ScalerState.static(2.0).to_grad_scaler_state_dict()
    with pytest.raises(ValueError, match=r"cannot represent hysteresis=2"):
        funcamp.ScalerState.dynamic(hysteresis=2).to_grad_scaler_state_dict()
    with pytest.raises(ValueError, match=r"missing \['_growth_tracker'\]"):
        funcamp.ScalerState.from_grad_scaler(
            {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1}
        )
    with pytest.raises(TypeError, match=r"`scaler_or_state_dict` must be"):
        funcamp.ScalerState.from_grad_scaler(3.0)
    bad = torch.amp.GradScaler("cpu", growth_interval=0).state_dict()
    with pytest.raises(ValueError, match=r"`growth_interval` must be an int >= 1, got 0"):
        funcamp.ScalerState.from_grad_scaler(bad)


# ------------------------------------------------- fast eager path: in-place reuse, donate_grads


def _tree_bits(tree) -> list[torch.Tensor]:
    """Copies of the tensor leaves (kept apart from later in-place writes)."""
    return [
        x.detach().clone()
        for x in optree.tree_leaves(tree, namespace=NAMESPACE)
        if isinstance(x, torch.Tensor)
    ]


def _same_bits(a, b) -> bool:
    la, lb = _tree_bits(a), _tree_bits(b)
    return len(la) == len(lb) and all(same_bits(x, y) for x, y in zip(la, lb))


def _reference_step(state, optimizer, grads, opt_state, params):
    """unscale_and_step as its docstring composes it, from the public out-of-place functions
    (the update as new params where the optimizer computes them: torch's single rounding)."""
    unscaled, found_inf = funcamp.unscale(state, grads)
    prepared = funcamp.optim.prepare_update(optimizer, unscaled, opt_state, params)
    updates, new_state = prepared.run(unscaled, funcamp.optim.Writes(new_params=True))
    new_params = funcamp.apply_updates(params, updates)
    leaves = list(unscaled.values())  # the params' order, as clip_grad_norm_ sums them
    norms = [n.to(torch.float32) for n in torch._foreach_norm(leaves)]
    norm = torch.linalg.vector_norm(torch.stack(norms))
    return (
        funcamp.tree_select(found_inf, params, new_params),
        funcamp.tree_select(found_inf, opt_state, new_state),
        funcamp.StepInfo(found_inf, norm, torch.zeros_like(found_inf)),
    )


FAST_PATH_OPTIMIZERS = {
    "sgd": lambda: funcamp.sgd(0.01),
    "sgd_tensor_lr": lambda: funcamp.sgd(torch.tensor(0.01)),
    "sgd_momentum": lambda: funcamp.sgd(0.01, momentum=0.9),
    "sgd_nesterov_wd": lambda: funcamp.sgd(0.01, momentum=0.9, nesterov=True, weight_decay=0.1),
    "sgd_dampening": lambda: funcamp.sgd(0.01, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "adam": lambda: funcamp.adam(1e-2, weight_decay=0.01),
    "adamw": lambda: funcamp.adamw(1e-2, weight_decay=0.1),
    "chain": lambda: funcamp.chain(funcamp.clip_by_global_norm(1.0), funcamp.sgd(0.1, 0.5)),
    "sgd_master": lambda: funcamp.sgd(0.01, master_weights=True),
    "adam_kahan": lambda: funcamp.adam(0.01, kahan=True),
    "custom": lambda: momentum(),
}


def _special_params(gen: torch.Generator, mixed: bool) -> dict[str, torch.Tensor]:
    params = {
        "w": torch.randn(5, 7, generator=gen),
        "b": torch.randn(33, generator=gen),
        "s": torch.randn((), generator=gen),
        "e": torch.zeros(0),
    }
    # Signed zero, infinity, NaN and a subnormal must survive a skipped step bit for bit.
    params["b"][:4] = torch.tensor([-0.0, math.inf, math.nan, 1e-42])
    if mixed:
        params["w"] = params["w"].to(torch.bfloat16)
        params["s"] = params["s"].double()
    return params


@pytest.mark.parametrize("name", sorted(FAST_PATH_OPTIMIZERS))
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**-3])
def test_fast_step_matches_reference_and_never_mutates_inputs(name, mixed, init_scale):
    if name == "custom" and mixed:
        pytest.skip("the custom test optimizer is float32-only")
    gen = torch.Generator().manual_seed(3)
    opt = FAST_PATH_OPTIMIZERS[name]()
    params = _special_params(gen, mixed)
    opt_state = opt.init(params)
    s = funcamp.ScalerState.dynamic(init_scale, growth_interval=2)
    for step in range(6):
        grads = {k: torch.randn(v.shape, generator=gen).to(v.dtype) * 3 for k, v in params.items()}
        if step == 2:
            grads["w"].view(-1)[3] = math.inf
        if step == 4:
            grads["b"][0] = math.nan
        before = _tree_bits((grads, opt_state, params, s))
        ref = _reference_step(s, opt, grads, opt_state, params)
        out = funcamp.unscale_and_step(s, opt, grads, opt_state, params)
        assert all(
            same_bits(a, b) for a, b in zip(before, _tree_bits((grads, opt_state, params, s)))
        )
        donated = {k: v.clone() for k, v in grads.items()}
        out_donated = funcamp.unscale_and_step(
            s, opt, donated, opt_state, params, donate_grads=True
        )
        assert all(
            same_bits(a, b)
            for a, b in zip(before[len(grads) :], _tree_bits((opt_state, params, s)))
        )
        assert _same_bits(out, ref) and _same_bits(out_donated, ref)
        assert bool(out[2].found_inf) == (step in (2, 4))
        params, opt_state, info = out_donated
        s = funcamp.update(s, info.found_inf)


def test_donated_grads_are_reused_and_aliased_grads_are_not():
    s, opt = funcamp.ScalerState.dynamic(4.0), funcamp.sgd(0.5)
    params = {"w": torch.ones(3), "b": torch.zeros(2)}
    grads = {"w": torch.tensor([4.0, 8.0, 0.0]), "b": torch.tensor([4.0, -4.0])}
    ptrs = {k: v.data_ptr() for k, v in grads.items()}
    new, _, _ = funcamp.unscale_and_step(s, opt, grads, opt.init(params), params, donate_grads=True)
    assert {k: new[k].data_ptr() for k in new} == ptrs  # no fresh memory at all
    assert new["w"].tolist() == [0.5, 0.0, 1.0] and new["b"].tolist() == [-0.5, 0.5]
    # One tensor given twice (tied weights) must not be unscaled twice.
    shared = torch.tensor([4.0, 8.0])
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    new, _, info = funcamp.unscale_and_step(
        s, opt, {"a": shared, "b": shared}, opt.init(params), params, donate_grads=True
    )
    assert new["a"].tolist() == new["b"].tolist() == [-0.5, -1.0]
    assert same_bits(info.grad_norm, torch.tensor(10.0).sqrt())
    # Grads that alias the params are copied, so the params are untouched.
    p = torch.tensor([4.0, 8.0])
    new, _, _ = funcamp.unscale_and_step(
        s, opt, {"p": p}, opt.init({"p": p}), {"p": p}, donate_grads=True
    )
    assert p.tolist() == [4.0, 8.0] and new["p"].tolist() == [3.5, 7.0]


class _FreshTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that return a fresh tensor of at least ``n`` elements (not in place,
    not into ``out=``, not a view)."""

    VIEWS = frozenset({"aten::view", "aten::detach", "aten::alias", "aten::_unsafe_view"})

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.ops = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if not (func._schema.is_mutable or "out" in kwargs or name in self.VIEWS):
            for o in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(o, torch.Tensor) and o.numel() >= self.n:
                    self.ops.append(name)
        return out


@pytest.mark.parametrize(
    ("name", "fresh", "fresh_donated"),
    [
        # the new exp_avg_sq, the denominator (torch's sqrt) and the new params; the new
        # exp_avg goes into the donated grads. On a donated state known to apply (the CPU
        # reads the flag) each new moment goes into its buffer, the denominator into the dead
        # grads, and the params take torch's p.addcdiv_ in place: nothing fresh.
        # torch.optim's step allocates two (its square roots).
        ("adam", 3, 0),
        ("adamw", 3, 0),
        # the new momentum; the new params go into the grads. On a donated state both are
        # computed in place, as torch.optim computes them (the step is known to apply).
        ("sgd_momentum", 1, 0),
        # the new momentum and the update direction (then the new params); donated: the
        # momentum in place
        ("lion", 2, 1),
    ],
)
@pytest.mark.parametrize("donate_state", [False, True])
def test_eager_step_allocates_little_more_than_it_returns(
    name: str, fresh: int, fresh_donated: int, donate_state: bool
) -> None:
    """The eager loss-scaled step with donated grads (the train step's) puts its results and
    temporaries into memory it owns: each fresh tensor page-faults on CPU. Counted per leaf, for
    leaves large enough that nothing else is that size; the results equal the undonated step's,
    and a donated state comes back in its own tensors."""
    opt = {
        "adam": funcamp.adam(1e-3),
        "adamw": funcamp.adamw(1e-3, weight_decay=0.1),
        "sgd_momentum": funcamp.sgd(1e-3, momentum=0.9),
        "lion": funcamp.lion(1e-4),
    }[name]
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(64, 64, generator=g), "v": torch.randn(64, 64, generator=g)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    state, s = opt.init(params), funcamp.ScalerState.dynamic(init_scale=2.0)
    state = opt.update(grads, state, params)[1]  # a state that is not all zeros
    expected = funcamp.unscale_and_step(s, opt, grads, state, params)
    donated = {k: v.clone() for k, v in grads.items()}
    mine = optree.tree_map(torch.clone, (params, state)) if donate_state else (params, state)
    with _FreshTensors(64 * 64) as mode:
        got = funcamp.unscale_and_step(
            s, opt, donated, mine[1], mine[0], donate_grads=True, donate_state=donate_state
        )
    assert len(mode.ops) == (fresh_donated if donate_state else fresh) * len(params), mode.ops
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        assert same_bits(a, b)
    if donate_state:
        for a, b in zip(optree.tree_leaves(got[:2]), optree.tree_leaves(mine)):
            assert a is b


class _SignumState(NamedTuple):
    count: torch.Tensor
    momentum: dict
    low: tuple


def _signum_step(ops, grads, params, buffers, lr, count):  # docs/guides/writing-an-optimizer.md
    new = ops.fma(grads, 1.0 - 0.9, ops.mul(buffers["momentum"], 0.9))
    momentum = ops.kept(new, replaces=buffers["momentum"])
    direction = ops.sign(momentum)
    return ops.mul(direction, ops.scalar(-lr), into=direction), {"momentum": momentum}


def _signum_rereads(ops, grads, params, buffers, lr, count):
    """Signum reading its buffer again after ``kept``: the new values, on every path."""
    new = ops.fma(grads, 1.0 - 0.9, ops.mul(buffers["momentum"], 0.9))
    ops.kept(new, replaces=buffers["momentum"])
    direction = ops.sign(buffers["momentum"])
    return ops.mul(direction, ops.scalar(-lr), into=direction), {"momentum": buffers["momentum"]}


_DONATING = {
    "adam": lambda: funcamp.adam(1e-2),
    "adam-l2": lambda: funcamp.adam(1e-2, weight_decay=0.1),
    "adamw": lambda: funcamp.adamw(1e-2, weight_decay=0.1),
    "adamw-mask": lambda: funcamp.adamw(1e-2, weight_decay=0.1, mask={"w": True, "v": False}),
    "adam-kahan": lambda: funcamp.adam(1e-2, kahan=True),
    "adamw-master": lambda: funcamp.adamw(1e-2, master_weights=True),
    "sgd-momentum": lambda: funcamp.sgd(1e-2, momentum=0.9),
    "sgd-nesterov": lambda: funcamp.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-dampening": lambda: funcamp.sgd(1e-2, momentum=0.9, dampening=0.1),
    "lion": lambda: funcamp.lion(1e-3),
    "lion-mask-sr": lambda: funcamp.lion(
        1e-3, mask={"w": True, "v": False}, stochastic_rounding=True
    ),
    "chain": lambda: funcamp.chain(funcamp.clip_by_global_norm(1.0), funcamp.adamw(1e-2)),
    "signum": lambda: funcamp.optim.elementwise("signum", _SignumState, _signum_step, 1e-2),
    "signum-rereads": lambda: funcamp.optim.elementwise(
        "signum", _SignumState, _signum_rereads, 1e-2
    ),
}


@pytest.mark.parametrize("name", sorted(_DONATING))
def test_eager_donated_step_is_the_pure_step(name: str) -> None:
    """On a donated state the eager step's optimizer writes each new buffer into the old one as
    soon as it is known (``Writes.skip``): over four steps, one skipped (an inf
    gradient), it gives the undonated step's params and state bit for bit, a skipped step leaves
    them bit-identical, and the donated tensors come back holding the new values. bfloat16
    params where a low-precision mode is on."""
    opt = _DONATING[name]()
    assert opt.prepare is not None
    low = any(k in name for k in ("kahan", "master", "sr"))
    dtype = torch.bfloat16 if low else torch.float32
    g = torch.Generator().manual_seed(6)
    params = {"w": torch.randn(40, 30, generator=g).to(dtype), "v": torch.randn(70, generator=g)}
    state, s = opt.init(params), funcamp.ScalerState.dynamic(init_scale=4.0)
    for i in range(4):
        grads = {k: 4 * torch.randn(x.shape, generator=g).to(x.dtype) for k, x in params.items()}
        if i == 2:
            grads["w"][3, 4] = math.inf
        want_p, want_s, info = funcamp.unscale_and_step(s, opt, grads, state, params)
        mine = optree.tree_map(torch.clone, (params, state))
        got_p, got_s, _ = funcamp.unscale_and_step(
            s, opt, optree.tree_map(torch.clone, grads), mine[1], mine[0],
            donate_grads=True, donate_state=True,
        )  # fmt: skip
        got, want = optree.tree_leaves((got_p, got_s)), optree.tree_leaves((want_p, want_s))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert same_bits(a, b)
        for a, b in zip(optree.tree_leaves((got_p, got_s)), optree.tree_leaves(mine)):
            assert a is b
        if i == 2:
            assert bool(info.found_inf)
            for a, b in zip(got, optree.tree_leaves((params, state))):
                assert same_bits(a, b)
        params, state = want_p, want_s


class _FreshFloat32(_FreshTensors):
    """Records the float32 tensors of at least ``n`` elements that ops return fresh."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = len(self.ops)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        outs = out if isinstance(out, (list, tuple)) else [out]
        floats = [o for o in outs if isinstance(o, torch.Tensor) and o.dtype == torch.float32]
        self.ops[n:] = [name for name in self.ops[n:] if floats]
        return out


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_eager_donated_adam_allocates_what_torch_optim_adam_does(weight_decay: float) -> None:
    """Differential, against torch.optim: the eager step on a donated state (the train step's
    with ``donate_state=True``) allocates no params-sized float32 tensor, where
    ``torch.optim.AdamW(foreach=True).step()`` allocates one a leaf (its square root): the
    denominator goes into the dead grads and the update into the params (``p.addcdiv_``).
    The params are torch's bit for bit."""
    g = torch.Generator().manual_seed(4)
    shapes = {"w": (64, 64), "v": (80, 64)}
    params = {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}
    grads = [{k: torch.randn(shape, generator=g) for k, shape in shapes.items()} for _ in range(2)]
    n = 64 * 64
    torch_params = [torch.nn.Parameter(p.clone()) for p in params.values()]
    ref = torch.optim.AdamW(torch_params, lr=1e-3, weight_decay=weight_decay, foreach=True)
    opt = funcamp.adamw(1e-3, weight_decay=weight_decay)
    state, s = opt.init(params), funcamp.ScalerState.noop()
    for grad in grads:  # the second step: torch's state exists by then
        for p, x in zip(torch_params, grad.values()):
            p.grad = x.clone()
        with _FreshFloat32(n) as torch_mode:
            ref.step()
        donated = {k: x.clone() for k, x in grad.items()}
        with _FreshFloat32(n) as mode:
            params, state, _ = funcamp.unscale_and_step(
                s, opt, donated, state, params, donate_grads=True, donate_state=True
            )
    assert len(torch_mode.ops) == len(shapes) and mode.ops == [], (torch_mode.ops, mode.ops)
    for p, q in zip(torch_params, params.values()):
        assert torch.equal(p.detach(), q)


@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "lion"])
def test_grads_wider_than_their_params_are_refused(name):
    """float64 grads for float32 params would widen the state and the updates (and the next
    step would refuse that state): refused up front, naming the leaf and the fix."""
    opt = {
        "adam": funcamp.adam(1e-3),
        "sgd_momentum": funcamp.sgd(0.1, momentum=0.9),
        "lion": funcamp.lion(1e-3),
    }[name]
    params = {"w": torch.ones(3)}
    grads = {"w": torch.ones(3, dtype=torch.float64)}
    match = rf"funcamp.{name.split('_')[0]}: `grads` leaf \['w'\] is torch.float64 but its param"
    with pytest.raises(TypeError, match=match):
        opt.update(grads, opt.init(params), params)
    with pytest.raises(TypeError, match=match):  # before anything is unscaled or written
        funcamp.unscale_and_step(
            funcamp.ScalerState.dynamic(2.0), opt, grads, opt.init(params), params,
            donate_grads=True,
        )  # fmt: skip
    assert grads["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum", "lion"])
@pytest.mark.parametrize(("param_dtype", "grad_dtype"), [(torch.float64, torch.float32)])
def test_owned_step_with_mixed_dtypes_matches_the_plain_update(name, param_dtype, grad_dtype):
    """float64 params with float32 grads: the state and the updates are float64. The eager
    step that owns its grads must not write a float64 result into a float32 grad (out= would
    cast it down) nor run a kernel that does not promote: the same bits as the plain update."""
    opt = {
        "adam": funcamp.adam(1e-3),
        "adamw": funcamp.adamw(1e-3, weight_decay=0.1),
        "sgd_momentum": funcamp.sgd(0.1, momentum=0.9),
        "lion": funcamp.lion(1e-3, weight_decay=0.1),
    }[name]
    g = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(300, generator=g, dtype=param_dtype)}
    grads = {"w": torch.randn(300, generator=g, dtype=grad_dtype)}
    state = opt.update(grads, opt.init(params), params)[1]
    updates, new_state = opt.update(grads, state, params)
    owned = {"w": grads["w"].clone()}
    prepared = funcamp.optim.prepare_update(opt, owned, state, params)
    got, got_state = prepared.run(owned, funcamp.optim.Writes([owned["w"]]))
    for a, b in zip(optree.tree_leaves((got, got_state)), optree.tree_leaves((updates, new_state))):
        assert same_bits(a, b)
    assert got["w"].dtype == param_dtype


def test_expanded_grads_are_copied_not_written_in_place():
    """torch.func.grad of ``w.sum()`` is an expanded tensor (strides 0), which torch refuses to
    write in place: a donated step copies it instead (the eager train step donates its grads),
    with the undonated step's results."""
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    g = torch.func.grad(lambda w: w.sum())(w)
    assert g.stride() == (0, 0)
    base = torch.randn(8, generator=torch.Generator().manual_seed(3))
    for opt in (funcamp.adam(1e-3), funcamp.lion(1e-3, weight_decay=0.1), funcamp.sgd(0.1, 0.9)):
        s, state = funcamp.ScalerState.dynamic(2.0), opt.init({"w": w})
        # expanded, and a sliding window (elements share memory: torch cannot tell cheaply)
        for make in (lambda: g, lambda: base.clone().as_strided((4, 3), (1, 1))):
            want = funcamp.unscale_and_step(s, opt, {"w": make().contiguous()}, state, {"w": w})
            got = funcamp.unscale_and_step(
                s, opt, {"w": make()}, state, {"w": w}, donate_grads=True
            )
            for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
                assert same_bits(a, b)
            grad = make()
            prepared = funcamp.optim.prepare_update(opt, {"w": grad}, state, {"w": w})
            owned = prepared.run({"w": grad}, funcamp.optim.Writes([grad]))
            plain = opt.update({"w": make().contiguous()}, state, {"w": w})
            for a, b in zip(optree.tree_leaves(owned), optree.tree_leaves(plain)):
                assert same_bits(a, b)

    def loss_fn(params, buffers, batch):  # b's grad is expanded
        return (batch @ params["w"]).square().mean() + params["b"].sum()

    opt = funcamp.adam(1e-2)
    state = funcamp.TrainState.create({"w": w, "b": torch.zeros(3)}, opt, "float32")
    step = funcamp.make_train_step(loss_fn, opt, "float32", compile=False, donate_state=False)
    state, metrics = step(state, torch.ones(2, 4))
    # Adam's first step is -lr * sign(g) (to rounding): g = 1 for every element of b
    assert torch.isfinite(metrics["loss"])
    assert torch.allclose(state.params["b"], torch.full((3,), -0.01))


def test_unscale_donate_grads():
    s = funcamp.ScalerState.dynamic(init_scale=4.0)
    grads = {"w": torch.tensor([8.0, math.inf]), "h": torch.tensor([2.0], dtype=torch.float16)}
    ref, ref_inf = funcamp.unscale(s, grads)
    assert grads["w"].tolist() == [8.0, math.inf]  # not donated: untouched
    out, found_inf = funcamp.unscale(s, grads, donate_grads=True)
    assert out["w"] is grads["w"] and out["h"].dtype == torch.float32
    assert bool(found_inf) and bool(ref_inf) and _same_bits(out, ref)
    with pytest.raises(TypeError, match=r"funcamp.unscale: `donate_grads` must be a bool"):
        funcamp.unscale(s, grads, donate_grads=1)
    with pytest.raises(TypeError, match=r"funcamp.unscale_and_step: `donate_grads` must be"):
        opt = funcamp.sgd(0.1)
        funcamp.unscale_and_step(s, opt, {}, opt.init({}), {}, donate_grads="yes")


def test_fast_step_never_writes_tensors_held_elsewhere():
    # A transform that keeps the grads in its state and passes them on: the sgd after it in a
    # chain must not overwrite them in place.
    def keep() -> funcamp.Optimizer:
        return funcamp.Optimizer(lambda p: {"seen": torch.zeros(2)}, lambda g, st, p: (g, g))

    s = funcamp.ScalerState.dynamic(2.0)
    opt = funcamp.chain(keep(), funcamp.sgd(0.5))
    params = {"seen": torch.zeros(2)}
    for donate in (False, True):
        _, (kept, _), _ = funcamp.unscale_and_step(
            s, opt, {"seen": torch.tensor([2.0, 4.0])}, opt.init(params), params,
            donate_grads=donate,
        )  # fmt: skip
        assert kept["seen"].tolist() == [1.0, 2.0]
    # An optimizer returning a tensor it keeps elsewhere (a cached constant) as its update.
    const = torch.full((2,), 0.25)
    cached = funcamp.Optimizer(lambda p: (), lambda g, st, p: ({"seen": const}, st))
    for donate in (False, True):
        new, _, _ = funcamp.unscale_and_step(
            s, cached, {"seen": torch.tensor([2.0, 4.0])}, (), params, donate_grads=donate
        )
        assert new["seen"].tolist() == [0.25, 0.25] and const.tolist() == [0.25, 0.25]
        bad = {"seen": torch.tensor([math.nan, 4.0])}
        new, _, _ = funcamp.unscale_and_step(s, cached, bad, (), params, donate_grads=donate)
        assert new["seen"].tolist() == [0.0, 0.0] and const.tolist() == [0.25, 0.25]


def test_skipped_step_is_exact_while_subnormals_are_flushed():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        s, opt = funcamp.ScalerState.dynamic(2.0), funcamp.sgd(0.5)
        params = {"w": torch.tensor([1e-42, -0.0, 1.0])}
        for donate in (False, True):
            grads = {"w": torch.tensor([1.0, math.inf, 1.0])}
            new, _, info = funcamp.unscale_and_step(
                s, opt, grads, opt.init(params), params, donate_grads=donate
            )
            assert bool(info.found_inf) and same_bits(new["w"], params["w"])
    finally:
        torch.set_flush_denormal(False)


# ------------------------------------------------------------------------------ donate_state


def _sgd_grads(step: int, shapes: dict[str, tuple[int, ...]], scale: float) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    grads = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    return {k: v * scale for k, v in grads.items()}  # a power-of-two scale: exact


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("schedule", [False, True])
def test_donated_sgd_runs_in_place_like_torch(weight_decay, schedule, path, monkeypatch):
    """donate_state with plain SGD: torch's fused kernel, in place; params bit-identical to
    torch.optim.SGD on the unscaled grads. On the device path (as on CUDA) the kernel skips on
    found_inf by itself, every step, with no host sync; on the CPU the skipped step is known on
    the host and the kernel does not run."""
    shapes = {"w": (40, 30), "b": (30,)}
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    torch_params = [torch.nn.Parameter(v.clone()) for v in params.values()]
    lr = funcamp.linear_schedule(0.1, 0.01, 10) if schedule else 0.05
    torch_opt = torch.optim.SGD(
        torch_params, lr=0.1 if schedule else 0.05, weight_decay=weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda c: max(0.1, 1 - 0.09 * c))
    opt = funcamp.sgd(lr, weight_decay=weight_decay)
    opt_state = opt.init(params)
    scaler = funcamp.ScalerState.dynamic(2.0**10)
    ids = [id(x) for x in params.values()]

    def boom(*args, **kwargs):
        raise AssertionError("host sync")

    calls = []
    fused_sgd = torch._fused_sgd_

    def counting(*args, **kwargs):
        calls.append(1)
        return fused_sgd(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_sgd_", counting)
    for step in range(8):
        scaled = _sgd_grads(step, shapes, float(scaler.scale))  # backs off after step 3
        if step == 3:
            scaled["w"][1, 2] = float("inf")
        before = {k: v.clone() for k, v in params.items()}
        with monkeypatch.context() as m, device_path() if path == "device" else nullcontext():
            if path == "device":
                m.setattr(torch.Tensor, "item", boom)
                m.setattr(torch.Tensor, "__bool__", boom)
            params, opt_state, info = funcamp.unscale_and_step(
                scaler, opt, scaled, opt_state, params, donate_grads=True, donate_state=True
            )
        assert [id(x) for x in params.values()] == ids  # the input tensors, updated in place
        if step == 3:
            assert bool(info.found_inf)
            assert all(torch.equal(params[k], before[k]) for k in params)
        else:
            for p, g in zip(torch_params, _sgd_grads(step, shapes, 1.0).values()):
                p.grad = g
            torch_opt.step()
            if schedule:
                sched.step()
            for p, q in zip(torch_params, params.values()):
                assert torch.equal(p.detach(), q)
        scaler = funcamp.update(scaler, info.found_inf)
    assert int(opt_state.count) == 7
    # the device path's kernel ran every step, the skipped one included
    assert len(calls) == (8 if path == "device" else 7)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_donated_step_matches_the_pure_step(backend):
    """Any optimizer (Adam here: no in-place kernel): the same bits as without donation, and
    the returned tensors are the inputs'."""
    opt = funcamp.adamw(1e-2, weight_decay=0.1)
    shapes = {"w": (8, 5), "b": (5,)}
    gen = torch.Generator().manual_seed(1)
    start = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}

    def step(scaler, grads, opt_state, params, donate):
        return funcamp.unscale_and_step(scaler, opt, grads, opt_state, params, donate_state=donate)

    run = step if backend is None else torch.compile(step, backend=backend, fullgraph=True)
    pa, pb = dict(start), {k: v.clone() for k, v in start.items()}
    sa, sb = opt.init(pa), opt.init(pb)
    scaler = funcamp.ScalerState.dynamic(2.0**4)
    for i in range(6):
        grads = _sgd_grads(i, shapes, float(scaler.scale))
        if i == 2:
            grads["b"][0] = float("nan")
        old = optree.tree_leaves((pb, sb), namespace="funcamp")
        pa, sa, ia = run(scaler, grads, sa, pa, False)
        pb, sb, _ = run(scaler, grads, sb, pb, True)
        new = optree.tree_leaves((pb, sb), namespace="funcamp")
        assert all(x is y for x, y in zip(new, old))
        for x, y in zip(optree.tree_leaves((pa, sa)), new):
            assert torch.equal(x, y)
        scaler = funcamp.update(scaler, ia.found_inf)


def test_donate_state_refuses_shared_memory():
    opt = funcamp.sgd(0.1)
    w = torch.zeros(4)
    params = {"a": w, "b": w[:2]}
    with pytest.raises(
        ValueError, match=r"donate_state=True .* params\['a'\] and params\['b'\] share memory"
    ):
        funcamp.unscale_and_step(
            funcamp.ScalerState.static(1.0),
            opt,
            {"a": torch.ones(4), "b": torch.ones(2)},
            opt.init(params),
            params,
            donate_state=True,
        )
    # Across the trees, named down to the leaf (paths are made only for the message).
    heavy = funcamp.sgd(0.1, momentum=0.9)
    params = {"a": torch.zeros(4), "b": torch.zeros(2)}
    opt_state = heavy.init(params)
    opt_state = opt_state._replace(momentum={**opt_state.momentum, "b": params["b"]})
    with pytest.raises(ValueError, match=r"params\['b'\] and opt_state\[1\]\['b'\] share memory"):
        funcamp.unscale_and_step(
            funcamp.ScalerState.static(1.0),
            heavy,
            {"a": torch.ones(4), "b": torch.ones(2)},
            opt_state,
            params,
            donate_state=True,
        )
    with pytest.raises(TypeError, match="`donate_state` must be a bool"):
        funcamp.unscale_and_step(
            funcamp.ScalerState.static(1.0),
            opt,
            {"a": w},
            opt.init({"a": w}),
            {"a": w},
            donate_state="yes",
        )
