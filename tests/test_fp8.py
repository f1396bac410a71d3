"""FP8 linears: numerics against an emulated reference, the delayed-scaling state, the step.

The reference here is written independently of funcamp.casting.fp8: quantize with the scale
(saturating), matmul the dequantized operands in float64 (exact for these sizes: products of
FP8 values have 8 significant bits), unscale, and allow for what torch._scaled_mm does on top
(float32 accumulation, in any order, then one rounding to the output dtype).
"""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from exhaustive import exhaustive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import funcamp
from funcamp import Fp8Recipe, Fp8State

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16 = torch.bfloat16
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


# ----------------------------------------------------------------------------- the reference
def ref_quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = torch.finfo(dtype).max
    return torch.clamp(t.to(torch.float32) * scale, min=-m, max=m).to(dtype)


def ref_current_scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao: fp8_max / max(amax, 1e-12), float64 arithmetic, float32 result."""
    amax = t.detach().abs().max().to(torch.float64)
    return (torch.finfo(dtype).max / torch.clamp(amax, min=1e-12)).to(torch.float32)


def ref_te_update(history, scale, amax, margin):
    """TransformerEngine's delayed-scaling update, in float32 as TE computes it."""
    history = torch.cat([history[:, 1:], amax[:, None]], dim=1)
    peak = history.max(dim=1).values
    fp8_max = torch.tensor([448.0, 448.0, 57344.0])
    sf = (fp8_max / peak) / (2**margin)
    sf = torch.where(peak > 0.0, sf, scale)
    sf = torch.where(torch.isfinite(peak), sf, scale)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, torch.finfo(torch.float32).max), sf)
    return history, sf


def ref_mm(aq, sa, bq, sb):
    """(float64 result, float32 accumulation error bound) of dequant(aq) @ dequant(bq)."""
    inv = (1.0 / sa.double()).float().double() * (1.0 / sb.double()).float().double()
    exact = (aq.double() @ bq.double()) * inv
    bound = aq.shape[1] * 2.0**-24 * (aq.double().abs() @ bq.double().abs()) * inv
    return exact, bound


def assert_rounds_from(out: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    """``out`` is ``exact`` (up to ``bound``) rounded once to ``out.dtype``: within one ulp."""
    dtype = out.dtype
    mag = torch.maximum(exact.abs(), out.double().abs())
    tiny = torch.finfo(dtype).tiny
    ulp = torch.exp2(torch.floor(torch.log2(mag.clamp(min=tiny))) - MANTISSA[dtype])
    ulp = ulp.clamp(min=tiny * 2.0 ** -MANTISSA[dtype])
    err = (out.double() - exact).abs()
    bad = ~(err <= bound + ulp)
    assert not bad.any(), (
        f"{int(bad.sum())} elements off: out {out[bad][:4]}, exact {exact[bad][:4]}, "
        f"allowed {(bound + ulp)[bad][:4]}"
    )


def reference_linear(x, w, b, g, compute, scales=None):
    """Forward output and (dx, dw) of the FP8 linear, as (exact, bound) pairs.

    ``scales``: (sx, sw, sg) for delayed scaling; None computes current scales."""
    xc = x.to(compute).reshape(-1, x.shape[-1])
    g2 = g.reshape(-1, g.shape[-1])
    if scales is None:
        sx, sw = ref_current_scale(xc, E4M3), ref_current_scale(w, E4M3)
        sg = ref_current_scale(g2, E5M2)
    else:
        sx, sw, sg = scales
    xq, wq, gq = ref_quantize(xc, sx, E4M3), ref_quantize(w, sw, E4M3), ref_quantize(g2, sg, E5M2)
    y, y_bound = ref_mm(xq, sx, wq.t(), sw)
    dx, dx_bound = ref_mm(gq, sg, wq, sw)
    dw, dw_bound = ref_mm(gq.t(), sg, xq, sx)
    return (y, y_bound), (dx, dx_bound), (dw, dw_bound)


class One(nn.Module):
    def __init__(self, k: int, n: int, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def run_linear(model, policy, x, g, fp8=None):
    """(y, dx, dparams, dfp8) of ``model(x)`` under ``amp(policy)`` with cotangent ``g``."""
    params = dict(model.named_parameters())
    f = funcamp.with_fp8_state(funcamp.amp(lambda p, x: functional_call(model, p, (x,)), policy))
    state = Fp8State() if fp8 is None else fp8
    y, vjp = torch.func.vjp(f, state, params, x)
    ds, dp, dx = vjp(g)
    return y, dx, dp, ds


def check_against_reference(model, policy, x, g, fp8=None):
    compute = policy.compute_dtype
    w, b = model.fc.weight.detach(), model.fc.bias
    scales = None
    if fp8 is not None:
        scales = tuple(fp8.scale["fc"])
    y, dx, dp, ds = run_linear(model, policy, x, g, fp8)
    (ye, yb), (dxe, dxb), (dwe, dwb) = reference_linear(x, w, b, g, compute, scales)
    assert y.dtype == compute and dx.dtype == x.dtype and dp["fc.weight"].dtype == w.dtype
    y2 = y.reshape(-1, y.shape[-1])
    if b is None:
        assert_rounds_from(y2, ye, yb)
    else:
        # the bias is added after, in the compute dtype (torchao): y = round(round(mm) + b),
        # so one more rounding of the matmul's result is allowed
        ye_b = ye + b.detach().to(compute).double()
        assert_rounds_from(y2, ye_b, yb + _ulp(ye, compute))
        want = g.reshape(-1, g.shape[-1]).sum(0).to(b.dtype)
        assert torch.equal(dp["fc.bias"], want)
    # dx: computed in the compute dtype, then cast to x's dtype (exact for x in compute dtype)
    assert_rounds_from(dx.to(compute).reshape(-1, x.shape[-1]), dxe, dxb)
    assert_rounds_from(dp["fc.weight"].to(compute), dwe, dwb)
    return y, dx, dp, ds


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tiny = torch.finfo(dtype).tiny
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=tiny))) - MANTISSA[dtype])


BF16_MIXED = funcamp.get_policy("params=float32,compute=bfloat16,output=bfloat16")


# ------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
def test_current_linear_matches_reference(compute: torch.dtype) -> None:
    torch.manual_seed(0)
    model = One(48, 24)
    policy = funcamp.Policy(compute_dtype=compute, output_dtype=compute).with_fp8(
        Fp8Recipe.current()
    )
    x = torch.randn(2, 5, 48) * 3
    g = (torch.randn(2, 5, 24) * 1e-3).to(compute)
    y, _, _, _ = check_against_reference(model, policy, x, g)
    # and it is not just the plain bf16/f32 linear: FP8 rounding shows
    plain = funcamp.amp(lambda x: model(x), funcamp.Policy(compute_dtype=compute))(x)
    assert not torch.equal(y.float(), plain.float())


def test_delayed_linear_matches_reference_and_updates_state_like_te() -> None:
    torch.manual_seed(1)
    model = One(32, 16)
    policy = BF16_MIXED.with_fp8(Fp8Recipe.delayed(history=3, margin=1))
    fp8 = Fp8State.init(One(32, 16), policy)
    # stale scales: the input's is far too large, so the input saturates at +-448
    history = torch.tensor([[0.5, 2.0, 0.0], [0.1, 0.3, 0.2], [1e-3, 0.0, 2e-3]])
    scale = torch.tensor([4096.0, 1500.0, 2.0**20])
    fp8 = Fp8State({"fc": history}, {"fc": scale})
    x = torch.randn(8, 32)
    g = (torch.randn(8, 16) * 1e-4).to(BF16)
    *_, ds = check_against_reference(model, policy, x, g, fp8)
    assert (ref_quantize(x.to(BF16), scale[0], E4M3).float().abs() == 448).any()  # saturated
    amax = torch.stack(
        [x.to(BF16).abs().max().float(), model.fc.weight.abs().max(), g.abs().max().float()]
    )
    want_history, want_scale = ref_te_update(history, scale, amax, margin=1)
    assert torch.equal(ds.amax_history["fc"], want_history)
    assert torch.equal(ds.scale["fc"], want_scale)
    new = funcamp.fp8_update(fp8, ds)
    assert torch.equal(new.scale["fc"], want_scale)
    assert torch.equal(fp8.scale["fc"], scale) and torch.equal(fp8.amax_history["fc"], history)


def test_te_rule_edge_cases() -> None:
    """amax 0 or non-finite keeps the previous scale; a scale overflowing float32 is clamped."""
    from funcamp.casting.fp8 import delayed_update

    history = torch.zeros(3, 2)
    scale = torch.tensor([3.0, 5.0, 7.0])
    for amax in ([0.0, float("inf"), float("nan")], [1e-45, 2.0, 0.0]):
        a = torch.tensor(amax)
        got = delayed_update(history, scale, a, 0)
        want = ref_te_update(history, scale, a, 0)
        assert torch.equal(got[0], want[0]) or torch.equal(got[0].isnan(), want[0].isnan())
        assert torch.equal(got[1], want[1]), (amax, got[1], want[1])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(1, 9),
    k=st.integers(1, 40),
    n=st.integers(1, 20),
    log_mag=st.integers(-24, 24),
    recipe=st.sampled_from(["current", "delayed"]),
    stale=st.sampled_from([1.0, 2.0**-8, 2.0**8]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_fp8_linear_matches_reference(m, k, n, log_mag, recipe, stale, bias, seed):
    """Shapes, magnitudes from 2**-24 to 2**24 and recipes; delayed scales from a history that
    is right, too small (values saturate) or too large."""
    gen = torch.Generator().manual_seed(seed)
    mag = 2.0**log_mag
    model = One(k, n, bias=bias)
    with torch.no_grad():
        model.fc.weight.copy_(torch.randn(n, k, generator=gen) * mag)
    x = torch.randn(m, k, generator=gen) * mag
    g = (torch.randn(m, n, generator=gen) * mag).to(BF16)
    if recipe == "current":
        policy = BF16_MIXED.with_fp8(Fp8Recipe.current())
        check_against_reference(model, policy, x, g)
        return
    policy = BF16_MIXED.with_fp8(Fp8Recipe.delayed(history=2))
    amax = torch.stack(
        [x.to(BF16).abs().max().float(), model.fc.weight.abs().max(), g.abs().max().float()]
    )
    # a scale from the right amax, times `stale`: > 1 saturates, < 1 loses precision
    scale = (torch.tensor([448.0, 448.0, 57344.0]) / amax.clamp(min=1e-30) * stale).clamp(
        max=torch.finfo(torch.float32).max
    )
    fp8 = Fp8State({"fc": torch.zeros(3, 2)}, {"fc": scale})
    *_, ds = check_against_reference(model, policy, x, g, fp8)
    want = ref_te_update(torch.zeros(3, 2), scale, amax, 0)
    assert torch.equal(ds.amax_history["fc"], want[0]) and torch.equal(ds.scale["fc"], want[1])


def test_float16_and_leading_dims() -> None:
    torch.manual_seed(2)
    model = One(16, 8)
    policy = funcamp.get_policy("float16").with_fp8(Fp8Recipe.current())
    x = torch.randn(2, 3, 16).half()
    model = model.half()
    g = torch.randn(2, 3, 8).half()
    y, dx, dp, _ = run_linear(model, policy, x, g)
    assert y.shape == (2, 3, 8) and y.dtype == torch.float16 and dx.shape == x.shape
    _, _, (dwe, dwb) = reference_linear(x, model.fc.weight.detach(), None, g, torch.float16)
    assert_rounds_from(dp["fc.weight"], dwe, dwb)


# -------------------------------------------------------------------------- policy and trace
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_module_matching_and_exclude_globs_win() -> None:
    net = Net()
    x = torch.randn(4, 16)
    base = funcamp.get_policy("mixed_bfloat16")
    policy = base.with_fp8(Fp8Recipe.current(), exclude=("head",))
    t = funcamp.trace(lambda x: net(x), policy)(x)
    linears = t.ops("linear")
    assert [r.module for r in linears] == ["body.0", "body.2", "head"]
    assert [r.input_dtypes[0] for r in linears] == [E4M3, E4M3, BF16]
    assert [f.site for f in t.fp8] == ["body.0", "body.2"]
    assert all(t[f.index].op == "linear" for f in t.fp8)
    # the scales recorded are the current scales of the operands
    assert torch.equal(t.fp8[0].input_scale, ref_current_scale(x.to(BF16), E4M3))
    assert torch.equal(t.fp8[0].weight_scale, ref_current_scale(net.body[0].weight, E4M3))
    assert "FP8 #0 body.0 (current)" in str(t)
    # globs select modules; classes too
    only = base.with_fp8(Fp8Recipe.current(), modules=("body.*",), exclude=("body.2",))
    assert [f.site for f in funcamp.trace(lambda x: net(x), only)(x).fp8] == ["body.0"]
    none = base.with_fp8(Fp8Recipe.current(), modules=(nn.Conv1d,))
    assert funcamp.trace(lambda x: net(x), none)(x).fp8 == []
    # a float64 input is never cast: it follows the policy
    net64 = Net().double()
    assert funcamp.trace(lambda x: net64(x), policy)(x.double()).fp8 == []


def test_policy_with_fp8_is_a_new_value_and_validates() -> None:
    base = funcamp.get_policy("mixed_bfloat16")
    p = base.with_fp8(Fp8Recipe.delayed(8, 2), modules=(nn.Linear, "x.*"))
    assert base.fp8 is None and p.fp8.recipe == Fp8Recipe.delayed(8, 2)
    assert p == base.with_fp8(Fp8Recipe.delayed(8, 2), modules=(nn.Linear, "x.*"))
    assert hash(p) == hash(base.with_fp8(Fp8Recipe.delayed(8, 2), modules=(nn.Linear, "x.*")))
    linear = "<class torch.nn.modules.linear.Linear>"
    assert str(p) == f"{base},fp8=delayed(history=8,margin=2),fp8.modules=({linear},x.*)"
    with pytest.raises(TypeError, match=r"funcamp.Policy.with_fp8: `recipe` must be"):
        base.with_fp8("delayed")
    with pytest.raises(TypeError, match=r"`modules` entries must be"):
        base.with_fp8(Fp8Recipe.current(), modules=(3,))
    with pytest.raises(ValueError, match=r"`history` must be an int >= 1, got int 0"):
        Fp8Recipe.delayed(history=0)
    with pytest.raises(ValueError, match=r"`margin` must be an int >= 0"):
        Fp8Recipe.delayed(margin=-1)
    with pytest.raises(ValueError, match=r"`kind` must be 'current' or 'delayed'"):
        Fp8Recipe("tensorwise")


def test_delayed_needs_its_state_and_one_call_per_site() -> None:
    net = Net()
    policy = funcamp.get_policy("mixed_bfloat16").with_fp8(Fp8Recipe.delayed())
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match=r"needs its Fp8State: call the function through"):
        funcamp.amp(lambda x: net(x), policy)(x)
    state = Fp8State.init(net, policy)
    assert sorted(state.scale) == ["body.0", "body.2", "head"]
    partial = Fp8State({"head": state.amax_history["head"]}, {"head": state.scale["head"]})
    run = funcamp.with_fp8_state(funcamp.amp(lambda x: net(x), policy))
    with pytest.raises(KeyError, match=r"no entry for the FP8 call site 'body.0'"):
        run(partial, x)
    lin = nn.Linear(32, 32)
    twice = funcamp.with_fp8_state(funcamp.amp(lambda x: lin(lin(x)), policy))
    with pytest.raises(RuntimeError, match=r"ran twice in one call"):
        twice(Fp8State.init(lin, policy), torch.randn(2, 32))
    # evaluation reads the state and leaves it alone
    out = run(state, x)
    assert out.shape == (2, 4)
    with pytest.raises(TypeError, match=r"first argument must be a funcamp.Fp8State"):
        run({}, x)


def test_overwrite_with_gradient_under_plain_autograd() -> None:
    """loss.backward() works too: the state's .grad is its new value."""
    torch.manual_seed(3)
    net = Net()
    policy = funcamp.get_policy("mixed_bfloat16").with_fp8(Fp8Recipe.delayed(4))
    state = Fp8State.init(net, policy)
    leaves = Fp8State(
        {k: v.clone().requires_grad_() for k, v in state.amax_history.items()},
        {k: v.clone().requires_grad_() for k, v in state.scale.items()},
    )
    x = torch.randn(8, 16)
    run = funcamp.with_fp8_state(funcamp.amp(lambda x: net(x).float().square().mean(), policy))
    run(leaves, x).backward()
    grads = Fp8State(
        {k: v.grad for k, v in leaves.amax_history.items()},
        {k: v.grad for k, v in leaves.scale.items()},
    )
    new = funcamp.fp8_update(state, grads)
    # the same as torch.func.grad gives
    fg = torch.func.grad(lambda s: run(s, x))(state)
    assert all(torch.equal(new.scale[k], funcamp.fp8_update(state, fg).scale[k]) for k in new.scale)
    assert torch.equal(new.amax_history["body.0"][0, -1], x.to(BF16).abs().max().float())


# --------------------------------------------------------------------------------- training
def make_problem(policy_spec="mixed_bfloat16", recipe=None):
    torch.manual_seed(0)
    net = Net()
    policy = funcamp.get_policy(policy_spec).with_fp8(recipe or Fp8Recipe.delayed(history=4))

    def loss_fn(params, buffers, batch):
        x, y = batch
        return nn.functional.cross_entropy(functional_call(net, (params, buffers), (x,)), y)

    opt = funcamp.adam(1e-2)
    params, buffers = funcamp.params_and_buffers(net)
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers, model=net)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen))]
    batches += [(torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen))]
    return net, policy, loss_fn, opt, state, batches


def leaves(tree: Any) -> list[torch.Tensor]:
    return torch.utils._pytree.tree_leaves(tree)


def assert_states_equal(a: Any, b: Any) -> None:
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        assert u.dtype == v.dtype and torch.equal(u, v)


def test_train_state_create_builds_fp8_state_and_positional_construction_works() -> None:
    net, policy, _, opt, state, _ = make_problem()
    assert sorted(state.fp8.scale) == ["body.0", "body.2", "head"]
    old_style = funcamp.TrainState(state.params, state.buffers, state.opt_state, state.scaler)
    assert old_style.fp8 == Fp8State() and old_style.fp8.scale == {}
    plain = funcamp.TrainState.create(state.params, opt, "mixed_bfloat16", model=net)
    assert plain.fp8.scale == {}  # model= ignored: no delayed recipe
    with pytest.raises(ValueError, match=r"pass `model=`"):
        funcamp.TrainState.create(state.params, opt, policy)
    with pytest.raises(TypeError, match=r"`model` must be the torch.nn.Module"):
        funcamp.TrainState.create(state.params, opt, policy, model="net")


def test_make_train_step_threads_fp8_state_like_the_manual_loop() -> None:
    """make_train_step == amp + torch.func.grad + with_fp8_state + fp8_update, bit for bit."""
    _, policy, loss_fn, opt, state, batches = make_problem()
    step = funcamp.make_train_step(loss_fn, opt, policy, compile=False, donate_state=False)
    s, m = step(state, batches[0])
    assert not m["found_inf"]

    run = funcamp.with_fp8_state(funcamp.amp(loss_fn, policy))
    (g, fg), loss = torch.func.grad_and_value(
        lambda p, f: run(f, p, state.buffers, batches[0]).float(), argnums=(0, 1)
    )(state.params, state.fp8)
    params, _, _ = funcamp.unscale_and_step(state.scaler, opt, g, state.opt_state, state.params)
    assert_states_equal(s.params, params)
    assert_states_equal(s.fp8, funcamp.fp8_update(state.fp8, fg))
    assert torch.equal(m["loss"], loss)
    # the state moved: this step's amaxes are in the histories, scales follow them
    for site in s.fp8.scale:
        assert (s.fp8.amax_history[site][:, -1] > 0).all()
        assert not torch.equal(s.fp8.scale[site], state.fp8.scale[site])
    assert_states_equal(state.fp8, make_problem()[4].fp8)  # the input state is untouched


def counting_compile(step_fn_builder):
    graphs: list[Any] = []
    aot_eager = torch._dynamo.backends.registry.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return step_fn_builder(backend), graphs


@pytest.mark.slow
@pytest.mark.parametrize(
    # current scaling compiled: in the suite through test_device_parity's FP8 training test
    "recipe",
    [pytest.param("current", marks=exhaustive), "delayed"],
)
def test_compiled_step_is_one_graph_no_recompile_and_matches_eager(recipe: str) -> None:
    r = Fp8Recipe.current() if recipe == "current" else Fp8Recipe.delayed(4)
    _, policy, loss_fn, opt, state, batches = make_problem(recipe=r)
    torch._dynamo.reset()
    step, graphs = counting_compile(
        lambda backend: funcamp.make_train_step(
            loss_fn, opt, policy, compile=funcamp.Compile(backend=backend), donate_state=False
        )
    )
    eager = funcamp.make_train_step(loss_fn, opt, policy, compile=False, donate_state=False)
    s, e = state, state
    for i in range(4):
        s, m = step(s, batches[i % 2])
        e, me = eager(e, batches[i % 2])
    assert len(graphs) == 1  # fullgraph: no break, no host sync; no recompile over 4 steps
    assert_states_equal(s, e)
    assert torch.equal(m["loss"], me["loss"])


def test_skipped_step_keeps_fp8_state_and_checkpoint_resumes_bit_for_bit(tmp_path) -> None:
    _, policy, loss_fn, opt, state, batches = make_problem("mixed_float16")
    step = funcamp.make_train_step(loss_fn, opt, policy, compile=False, donate_state=False)
    s, _ = step(state, batches[0])
    # a nan input (an inf one would saturate at +-448 in a delayed-scaled linear, as in
    # TransformerEngine, and not reach the loss)
    bad = (torch.full((16, 16), float("nan")), batches[0][1])
    s2, m = step(s, bad)
    assert m["found_inf"]
    assert_states_equal(s2.fp8, s.fp8)
    assert_states_equal(s2.params, s.params)

    # straight: 4 steps; resumed: 2 steps, save, load (weights_only), 2 steps
    straight = s2
    for i in range(4):
        straight, _ = step(straight, batches[i % 2])
    half = s2
    for i in range(2):
        half, _ = step(half, batches[i % 2])
    buf = io.BytesIO()
    torch.save(funcamp.state_dict(half), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert set(sd["fp8"]["scale"]) == {"body.0", "body.2", "head"}
    template = make_problem("mixed_float16")[4]
    resumed = funcamp.load_state_dict(template, sd)
    assert_states_equal(resumed, half)
    for i in range(2, 4):
        resumed, _ = step(resumed, batches[i % 2])
    assert_states_equal(resumed, straight)


def test_delayed_fp8_with_a_one_rank_group_equals_no_group(single_rank_group) -> None:
    # The amax max-reduction over one rank is the identity: the state is bit for bit the same
    # (2 ranks: tests/test_distributed.py).
    _, policy, loss_fn, opt, state, batches = make_problem()
    alone = funcamp.make_train_step(loss_fn, opt, policy, compile=False, donate_state=False)
    grouped = funcamp.make_train_step(
        loss_fn,
        opt,
        policy,
        compile=False,
        parallel=funcamp.distributed.DataParallel(single_rank_group),
        donate_state=False,
    )
    a = b = state
    for i in range(3):
        a, _ = alone(a, batches[i % 2])
        b, _ = grouped(b, batches[i % 2])
    assert_states_equal(a, b)
    assert (b.fp8.amax_history["head"][:, -3:] > 0).all()  # three steps recorded


def test_amax_histories_are_pure_values() -> None:
    s = Fp8State({"a": torch.zeros(3, 2)}, {"a": torch.ones(3)})
    flat, spec = torch.utils._pytree.tree_flatten(s)
    assert torch.utils._pytree.tree_unflatten(flat, spec) == s
    import optree

    assert len(optree.tree_leaves(s, namespace="funcamp")) == 2
    with pytest.raises(ValueError, match=r"`grads` must have the sites of `state`"):
        funcamp.fp8_update(s, Fp8State())
    assert math.isclose(float(s.scale["a"][0]), 1.0)
