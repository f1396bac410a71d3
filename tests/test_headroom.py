"""headroom: exact under/subnormal/overflow fractions, the safe scale range, compiled, and
make_train_step(headroom=True, donate_state=False)."""

from __future__ import annotations

import math

import pytest
import torch
from amp_zoo import one_thread  # noqa: F401 (autouse fixture)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import funcamp

F16, BF16 = torch.float16, torch.bfloat16


def _known_grads() -> tuple[dict[str, torch.Tensor], dict[str, dict[str, int]]]:
    """Unscaled grads for scale 2**4 whose float16 fate is known element by element."""
    s = 2.0**4
    flush = [2.0**-30, -(2.0**-29), 2.0**-40, 1e-30]  # scaled: <= 2**-25 (the tie flushes too)
    sub = [2.0**-20, -(2.0**-18) / s * 4, 2.0**-25 * 1.01 / s, (2.0**-14 - 2.0**-24) / s]
    normal_edge = [(2.0**-14 - 2.0**-25) / s]  # the tie rounds up to the smallest normal
    over = [1e5, -70000.0 / s, 65520.0 / s, math.inf, math.nan]  # 65520: tie rounds to inf
    fine = [1.0, -3.0, 65519.0 / s, 0.5]  # 65519 rounds down to 65504
    a = torch.tensor([0.0] * 4 + flush + sub + normal_edge + over + fine)  # 22 elements
    b = torch.tensor([[0.0, 2.0**-31], [2.0**-22, 1.0]])  # 1 flush, 1 subnormal
    c = torch.zeros(3)
    grads = {"a": a, "nested": {"b": b, "c": c}, "step": torch.tensor(3)}
    counts = {
        "a": {"n": 22, "underflow": 4, "subnormal": 4, "overflow": 5},
        "nested.b": {"n": 4, "underflow": 1, "subnormal": 1, "overflow": 0},
        "nested.c": {"n": 3, "underflow": 0, "subnormal": 0, "overflow": 0},
    }
    return grads, counts


def _frac(count: int, n: int) -> torch.Tensor:
    """``count / n`` correctly rounded to float32 (what an exact fraction must read)."""
    return torch.tensor(count, dtype=torch.float32) / n


def _cast_truth(g: torch.Tensor, scale: float, dtype: torch.dtype) -> dict[str, int]:
    """What a real cast does to the scaled grads."""
    x = g.float() * scale
    h = x.to(dtype)
    tiny = torch.finfo(dtype).smallest_normal
    return {
        "n": x.numel(),
        "underflow": int(((h == 0) & (x != 0)).sum()),
        "subnormal": int(((h != 0) & (h.abs() < tiny)).sum()),
        "overflow": int((~torch.isfinite(h)).sum()),
    }


def test_known_fractions_exactly() -> None:
    grads, counts = _known_grads()
    scaler = funcamp.ScalerState.static(16.0)
    h = funcamp.headroom(grads, scaler)
    assert sorted(h.leaves) == ["a", "nested.b", "nested.c"]  # the int leaf is ignored
    for path, want in counts.items():
        leaf = h.leaves[path]
        g = grads["a"] if path == "a" else grads["nested"][path[-1]]
        assert _cast_truth(g, 16.0, F16) == want, path  # the construction is right
        for field in ("underflow", "subnormal", "overflow"):
            assert torch.equal(getattr(leaf, field), _frac(want[field], want["n"])), (path, field)
        assert leaf.leaves == {}
    total = sum(c["n"] for c in counts.values())
    for field in ("underflow", "subnormal", "overflow"):
        got = getattr(h, field)
        assert got.dtype == torch.float32 and got.dim() == 0
        assert torch.equal(got, _frac(sum(c[field] for c in counts.values()), total)), field
    assert math.isnan(h.amax.item()) and math.isnan(h.leaves["a"].amax.item())
    assert h.leaves["nested.b"].amax.item() == 1.0 and h.leaves["nested.c"].amax.item() == 0.0
    # all-zero leaf: every scale is safe
    assert h.leaves["nested.c"].log2_scale_min.item() == -math.inf
    assert h.leaves["nested.c"].log2_scale_max.item() == math.inf
    # b: amin 2**-31, amax 1 -> flush-free above 2**6, overflow-free below 65520
    assert h.leaves["nested.b"].log2_scale_min.item() == 6.0
    assert h.leaves["nested.b"].log2_scale_max.item() == pytest.approx(math.log2(65520.0))


def test_inputs_untouched_and_bfloat16() -> None:
    grads, _ = _known_grads()
    before = {k: v.clone() for k, v in grads.items() if isinstance(v, torch.Tensor)}
    scaler = funcamp.ScalerState.static(2.0**100)
    h = funcamp.headroom(grads, scaler, dtype=BF16)
    for k, v in before.items():
        torch.testing.assert_close(grads[k], v, rtol=0, atol=0, equal_nan=True)
    # at 2**100 every nonzero finite element is normal in bfloat16; only inf and nan overflow
    truth = _cast_truth(grads["a"], 2.0**100, BF16)
    assert truth == {"n": 22, "underflow": 0, "subnormal": 0, "overflow": 2}
    leaf = h.leaves["a"]
    assert leaf.underflow.item() == 0 and leaf.subnormal.item() == 0
    assert torch.equal(leaf.overflow, _frac(2, 22))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32), min_size=1, max_size=40
    ),
    st.integers(-40, 40),
    st.sampled_from([F16, BF16]),
)
@example([4.97e-33], -3, F16)  # a subnormal float32 gradient: scaling by 2**-3 drops its bits
def test_fractions_match_a_real_cast(values: list[float], k: int, dtype: torch.dtype) -> None:
    g = torch.tensor(values) * 2.0**-20  # spread over float16's whole range
    scale = 2.0**k
    h = funcamp.headroom({"g": g}, funcamp.ScalerState.static(scale), dtype)
    truth = _cast_truth(g, scale, dtype)
    for field in ("underflow", "subnormal", "overflow"):
        assert torch.equal(getattr(h, field), _frac(truth[field], truth["n"])), field
    assert h.amax.item() == g.abs().max().item()


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.floats(min_value=2.0**-30, max_value=2.0**14, allow_nan=False, width=32),
        min_size=1,
        max_size=20,
    ),
    st.sampled_from([F16, BF16]),
)
def test_log2_range_is_the_safe_range(values: list[float], dtype: torch.dtype) -> None:
    """For every power of two 2**k: nothing flushes iff k > log2_scale_min, nothing overflows
    iff k < log2_scale_max (checked with a real cast)."""
    g = torch.tensor(values)
    h = funcamp.headroom(g, funcamp.ScalerState.static(1.0), dtype)
    lo, hi = h.log2_scale_min.item(), h.log2_scale_max.item()
    for k in range(math.floor(lo) - 2, math.ceil(lo) + 3):
        if abs(k) > 126:  # the scale itself must be a normal float32
            continue
        truth = _cast_truth(g, 2.0**k, dtype)
        assert (truth["underflow"] == 0) == (k > lo), (k, lo)
    for k in range(math.floor(hi) - 2, math.ceil(hi) + 3):
        if abs(k) > 126:
            continue
        truth = _cast_truth(g, 2.0**k, dtype)
        assert (truth["overflow"] == 0) == (k < hi), (k, hi)


def test_empty_and_errors() -> None:
    h = funcamp.headroom({}, funcamp.ScalerState.noop())
    assert h.underflow.item() == 0 and h.leaves == {} and h.amax.item() == 0
    assert h.log2_scale_min.item() == -math.inf and h.log2_scale_max.item() == math.inf
    with pytest.raises(TypeError, match=r"funcamp.headroom: `scaler_state` must be a funcamp"):
        funcamp.headroom({}, 2.0**16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"funcamp.headroom: `dtype` must be torch.float16 or"):
        funcamp.headroom({}, funcamp.ScalerState.noop(), torch.float32)


def test_compiled_fullgraph_matches_eager() -> None:
    grads, _ = _known_grads()
    scaler = funcamp.ScalerState.dynamic(init_scale=16.0)
    compiled = torch.compile(funcamp.headroom, fullgraph=True, backend="aot_eager")
    got, want = compiled(grads, scaler), funcamp.headroom(grads, scaler)
    flat_got, spec_got = torch.utils._pytree.tree_flatten(got)
    flat_want, spec_want = torch.utils._pytree.tree_flatten(want)
    assert spec_got == spec_want
    for a, b in zip(flat_got, flat_want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------- make_train_step(headroom=True, donate_state=False)


def _step_setup():
    """loss = sum(w * batch): the gradient of w is the batch itself, exactly."""

    def loss_fn(params, buffers, batch):
        return (params["w"] * batch).sum()

    opt = funcamp.sgd(0.0)
    scaler = funcamp.ScalerState.static(16.0)
    params = {"w": torch.ones(22)}
    return loss_fn, opt, scaler, params


def _batch() -> torch.Tensor:
    grads, _ = _known_grads()
    return torch.nan_to_num(grads["a"], nan=2.0, posinf=3e5)  # a finite step


@pytest.mark.parametrize(("policy", "dtype"), [("mixed_float16", F16), ("mixed_bfloat16", BF16)])
def test_train_step_metrics(policy: str, dtype: torch.dtype) -> None:
    """Eager; measured against the policy's compute dtype."""
    loss_fn, opt, scaler, params = _step_setup()
    state = funcamp.TrainState.create(params, opt, policy, scaler=scaler)
    step = funcamp.make_train_step(
        loss_fn, opt, policy, compile=False, headroom=True, donate_state=False
    )
    batch = _batch()
    _, metrics = step(state, batch)
    want = funcamp.headroom({"w": batch}, scaler, dtype).summary()
    assert set(metrics["headroom"]) == set(want)
    for k, v in want.items():
        assert torch.equal(metrics["headroom"][k], v), k
    # float16: 4 flush, 4 subnormal, 4 overflow (65520/16, 1e5, -70000/16, 3e5) of 22;
    # bfloat16: 2**-40 * 16 and 1e-30 * 16 are normal, nothing overflows
    n_flush, n_over = (4, 4) if dtype == F16 else (0, 0)
    assert torch.equal(metrics["headroom"]["underflow"], _frac(n_flush, 22))
    assert torch.equal(metrics["headroom"]["overflow"], _frac(n_over, 22))
    plain = funcamp.make_train_step(loss_fn, opt, policy, compile=False, donate_state=False)
    assert "headroom" not in plain(state, batch)[1]


def test_train_step_headroom_of_some_leaves() -> None:
    """A predicate of the leaf path measures only the leaves it accepts."""

    def loss_fn(params, buffers, batch):
        return (params["fp16.w"] * batch).sum() + (params["fp32.w"] * batch * 2.0**-20).sum()

    opt = funcamp.sgd(0.0)
    scaler = funcamp.ScalerState.static(16.0)
    params = {"fp16.w": torch.ones(22), "fp32.w": torch.ones(22)}
    state = funcamp.TrainState.create(params, opt, "mixed_float16", scaler=scaler)
    batch = _batch()
    keep = lambda path: not path.startswith("fp32.")  # noqa: E731
    step = funcamp.make_train_step(
        loss_fn, opt, "mixed_float16", compile=False, headroom=keep, donate_state=False
    )
    _, metrics = step(state, batch)
    want = funcamp.headroom({"fp16.w": batch}, scaler).summary()
    for k, v in want.items():
        assert torch.equal(metrics["headroom"][k], v), k
    every = funcamp.make_train_step(
        loss_fn, opt, "mixed_float16", compile=False, headroom=True, donate_state=False
    )
    grads = {"fp16.w": batch, "fp32.w": batch * 2.0**-20}
    want = funcamp.headroom(grads, scaler).summary()
    for k, v in every(state, batch)[1]["headroom"].items():
        assert torch.equal(v, want[k]), k
    assert not torch.equal(want["underflow"], metrics["headroom"]["underflow"])


def test_train_step_compiled_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled (fullgraph: a host sync would be a graph break) and run with every host read
    forbidden; the same metrics as eager."""
    loss_fn, opt, scaler, params = _step_setup()
    state = funcamp.TrainState.create(params, opt, "mixed_float16", scaler=scaler)
    step = funcamp.make_train_step(
        loss_fn,
        opt,
        "mixed_float16",
        headroom=True,
        compile=funcamp.Compile(backend="aot_eager"),
        donate_state=False,
    )
    batch = _batch()
    state, _ = step(state, batch)  # traced, compiled and validated before the patch

    def no_sync(*a, **k):
        raise AssertionError("host sync on the step path")

    with monkeypatch.context() as mp:
        for name in ("item", "__bool__", "tolist", "__float__", "__int__"):
            mp.setattr(torch.Tensor, name, no_sync)
        _, metrics = step(state, batch)
    want = funcamp.headroom({"w": batch}, scaler).summary()
    for k, v in want.items():
        assert torch.equal(metrics["headroom"][k], v), k
    assert torch.equal(metrics["headroom"]["subnormal"], _frac(4, 22))


def test_train_step_headroom_must_be_bool() -> None:
    loss_fn, opt, _, _ = _step_setup()
    with pytest.raises(
        TypeError, match=r"funcamp.make_train_step: `headroom` must be a bool or a callable"
    ):
        funcamp.make_train_step(loss_fn, opt, "mixed_float16", headroom=1, donate_state=False)  # type: ignore[arg-type]
