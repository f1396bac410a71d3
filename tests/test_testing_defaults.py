"""funcamp.testing's defaults stress mixed precision: tensors pass Hypothesis's health checks at the
sizes users test, mix in the boundaries of the dtypes code casts to, come as structured fills and
long vectors and shrink to them; scaler states take bounds (issue 60)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, find, given, seed, settings
from hypothesis import strategies as st

from funcamp.testing import (
    FLOAT_DTYPES,
    LOW_PRECISION_DTYPES,
    boundary_values,
    scaler_states,
    special_values,
    tensors,
)

# The guide's settings, every health check on.
GUIDE = settings(max_examples=50, deadline=None, database=None)
# Hypothesis checks health on the base example and the first 10 valid ones: 15 cover them.
HEALTH = settings(GUIDE, max_examples=15)
# A default that stresses mixed precision finds these within a few hundred examples.
EARLY = settings(
    max_examples=1000,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.generate, Phase.shrink],
)
BF16_MAX = torch.finfo(torch.bfloat16).max


def _f32_below(x: float) -> float:
    """The float32 just below ``x`` (computed: a literal would be a Hypothesis constant)."""
    return float(torch.nextafter(torch.tensor(x), torch.tensor(0.0)))


# ------------------------------------------------------------------------------ health checks


def _run_with_the_guides_settings(shape, dtype, s, bounds):
    @HEALTH
    @seed(s)
    @given(tensors(dtype=dtype, shape=shape, **bounds))
    def prop(x):
        assert x.shape == shape and x.dtype == dtype
        assert not bounds or bool(((x >= -4) & (x <= 4)).all())

    prop()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(16, 8), (64, 64), (4096,), (8, 128)], ids=str)
def test_tensors_pass_every_health_check_at_the_sizes_users_test(shape, dtype):
    bounded = {"min_value": -4.0, "max_value": 4.0}
    for s, bounds in ((0, bounded), (1, bounded), (2, bounded), (3, {})):
        _run_with_the_guides_settings(shape, dtype, s, bounds)


# ------------------------------------------------------------------------------- boundaries

F32_BOUNDARIES = {
    "float16's rounding band (65504, 65520)": lambda t: (t.abs() > 65504) & (t.abs() < 65520),
    "float16's overflow tie, 65520": lambda t: t.abs() == 65520,
    "a float16 subnormal": lambda t: (t.abs() >= 2.0**-24) & (t.abs() < 2.0**-14),
    "half float16's smallest subnormal": lambda t: t.abs() == 2.0**-25,
    "bfloat16's max": lambda t: t.abs() == BF16_MAX,
    "bfloat16's rounding band": lambda t: (t.abs() > BF16_MAX) & t.isfinite(),
    "float8 e4m3's rounding band (448, 464)": lambda t: (t.abs() > 448) & (t.abs() < 464),
    "float8 e4m3's overflow tie, 464": lambda t: t.abs() == 464,
    "float8 e5m2's max, 57344": lambda t: t.abs() == 57344,
    "float8 e5m2's overflow tie, 61440": lambda t: t.abs() == 61440,
    "-0.0": lambda t: (t == 0) & t.signbit(),
}


@pytest.mark.parametrize("name", list(F32_BOUNDARIES))
def test_default_tensors_draw_the_boundaries_of_lower_precision_dtypes(name):
    predicate = F32_BOUNDARIES[name]
    found = find(tensors(dtype=torch.float32), lambda t: bool(predicate(t).any()), settings=EARLY)
    assert found.numel() == 1, found  # and shrinks to that one value


def test_boundaries_narrow_and_widen():
    in_band = F32_BOUNDARIES["float16's rounding band (65504, 65520)"]

    @GUIDE
    @given(tensors(dtype=torch.float32, boundaries=()))
    def none_without_boundaries(t):
        assert not bool(in_band(t).any())

    none_without_boundaries()
    # float8 e4m3fnuz (max 240, rounding band up to 248) is not a default; asked for, it is drawn
    fnuz = tensors(dtype=torch.float32, boundaries=(torch.float8_e4m3fnuz,))
    find(fnuz, lambda t: bool(((t.abs() > 240) & (t.abs() < 248)).any()), settings=EARLY)
    # `values` mixes in more, rounded to the dtype: float16's own special values in float32
    third = tensors(dtype=torch.float32, shape=(), values=[1 / 3])
    found = find(third, lambda t: abs(float(t) - 1 / 3) < 1e-7, settings=EARLY)
    assert float(found) in (float(torch.tensor(1 / 3)), _f32_below(float(torch.tensor(1 / 3))))
    halves = tensors(dtype=torch.float32, shape=(16,), values=special_values(torch.float16))
    below_max = float(torch.nextafter(torch.tensor(65504.0), torch.tensor(0.0)).half())
    find(halves, lambda t: bool((t.abs() == below_max).any()), settings=EARLY)


def test_boundary_values_are_exact_and_sorted_by_magnitude():
    vals = boundary_values(torch.float32)
    assert {65504.0, 65520.0, _f32_below(65520.0), 448.0, 464.0, 57344.0, 61440.0} <= set(vals)
    assert {2.0**-24, 2.0**-25, BF16_MAX} <= set(vals)
    assert [abs(v) for v in vals] == sorted(abs(v) for v in vals)
    assert all(-v in vals for v in vals) and 0.0 not in vals
    for dtype in FLOAT_DTYPES:
        t = torch.tensor(boundary_values(dtype), dtype=torch.float64)
        assert torch.equal(t.to(dtype).double(), t), dtype  # each exact in its dtype
    # float16 cannot hold 65520 or bfloat16's max: left out, not rounded to inf
    assert max(boundary_values(torch.float16)) == 65504.0
    assert set(LOW_PRECISION_DTYPES) == {
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
    with pytest.raises(ValueError, match="`of` must hold floating torch dtypes"):
        boundary_values(torch.float32, of=[torch.int8])


# -------------------------------------------------------------------------------- structure


def test_tensors_draw_structured_fills_and_long_vectors():
    vec = tensors(dtype=torch.float32, shape=(256,), allow_nan=False, allow_infinity=False)
    repeated = find(vec, lambda t: bool((t == t[0]).all()) and float(t[0]) != 0, settings=EARLY)
    assert torch.unique(repeated).numel() == 1

    def cluster(t):
        distinct, mean = torch.unique(t).numel(), float(t.double().mean())
        spread = float(t.max() - t.min())
        return distinct >= 128 and mean != 0 and spread <= 2**-6 * abs(mean)

    find(vec, cluster, settings=EARLY)

    def ramp(t):
        steps = t.diff()
        monotonic = bool((steps > 0).all()) or bool((steps < 0).all())
        return monotonic and torch.unique(t).numel() >= 200

    find(vec, ramp, settings=EARLY)
    long = find(tensors(), lambda t: t.numel() > 125, settings=EARLY)  # beyond 5 x 5 x 5
    assert long.dim() == 1


def test_failures_shrink_to_structured_fills():
    vectors = st.integers(1, 256).map(lambda n: (n,))
    finite = {"allow_nan": False, "allow_infinity": False}
    # a float16 sum past 65504: two elements, one value repeated
    x = find(
        tensors(dtype=torch.float16, shape=vectors, **finite),
        lambda x: not bool(torch.isfinite(x.sum())),
        settings=EARLY,
    )
    assert x.numel() == 2 and x[0] == x[1], x

    def mean_in_bf16(x):
        acc = torch.zeros((), dtype=torch.bfloat16)
        for v in x:
            acc = acc + v
        return acc / x.numel()

    # a bfloat16 mean accumulated in bfloat16 goes wrong on one value repeated
    x = find(
        tensors(dtype=torch.bfloat16, shape=vectors, min_value=-1e4, max_value=1e4),
        lambda x: (
            abs(float(mean_in_bf16(x)) - float(x.double().mean())) > 0.01 * float(x.abs().max())
        ),
        settings=EARLY,
    )
    assert torch.unique(x).numel() == 1, x
    # an overflow check against finfo(float16).max: one value in the rounding band
    x = find(
        tensors(dtype=torch.float32, shape=vectors, min_value=-1e5, max_value=1e5),
        lambda x: bool(((x.abs() > 65504) != ~torch.isfinite(x.half())).any()),
        settings=EARLY,
    )
    assert x.numel() == 1 and 65504 < abs(float(x)) < 65520, x


# ---------------------------------------------------------------------------- scaler states


@GUIDE
@given(
    scaler_states(scale=(1.0, 2.0**24), growth_interval=(1, 10), hysteresis=(2, 3), skipped=(5, 9))
)
def test_scaler_states_stay_within_their_bounds(state):
    assert 1.0 <= float(state.scale) <= 2.0**24
    assert 5 <= int(state.skipped) <= 9
    if state.kind == "dynamic":
        assert 1 <= state.growth_interval <= 10 and 2 <= state.hysteresis <= 3
        assert 0 <= int(state.growth_tracker) < state.growth_interval
        assert 0 <= int(state.hysteresis_tracker) <= state.hysteresis
        for bound in (state.min_scale, state.max_scale):
            assert bound is None or 1.0 <= bound <= 2.0**24


def test_scaler_states_are_mostly_dynamic_and_at_the_edge_of_their_bookkeeping():
    kinds, edges = [], []

    @settings(max_examples=200, deadline=None, database=None, phases=[Phase.generate])
    @seed(0)
    @given(scaler_states())
    def record(state):
        kinds.append(state.kind)
        if state.kind == "dynamic":
            edges.append(int(state.growth_tracker) == state.growth_interval - 1)

    record()
    assert kinds.count("dynamic") > len(kinds) / 2
    assert {"static", "noop"} <= set(kinds)
    assert len(edges) / 4 < sum(edges) < len(edges)  # one step from growing: about half


def test_scaler_states_bad_bounds_say_what_is_wrong():
    for kwargs, match in (
        ({"scale": (0.0, 1.0)}, "`scale` must be a \\(low, high\\) pair of floats"),
        ({"scale": (2.0, 1.0)}, "`scale`"),
        ({"growth_interval": (0, 5)}, "`growth_interval` must be a \\(low, high\\) pair of ints"),
        ({"hysteresis": (1.5, 2)}, "`hysteresis`"),
        ({"skipped": (-1, 3)}, "`skipped`"),
    ):
        with pytest.raises(ValueError, match=match):
            scaler_states(**kwargs)


def test_bad_tensor_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="`boundaries` must hold floating torch dtypes"):
        tensors(boundaries=(torch.int32,))
    with pytest.raises(ValueError, match="`values` must hold floats"):
        tensors(values=["1.0"])
    with pytest.raises(ValueError, match="`max_length` must be an int >= 0"):
        tensors(max_length=-1)
