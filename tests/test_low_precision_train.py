"""Low-precision params end to end: TrainState.create and make_train_step with a bf16-true
(and 16-true) policy, every update mode in one step, eager vs inductor, checkpoint resume."""

from __future__ import annotations

import io
import pathlib
import re

import optree
import pytest
import torch
from torch._dynamo.utils import counters

import funcamp
from funcamp.optim import KahanState, MasterWeightsState, StochasticRoundingState
from funcamp.scaling.skip import device_path

#: The optree namespace funcamp documents for its state types (docs/concepts.md).
pytestmark = pytest.mark.slow  # inductor compiles of every mode: not in the quick subset


NAMESPACE = "funcamp"

MODES = {
    "plain": {},
    "master": {"master_weights": True},
    "kahan": {"kahan": True},
    "sr": {"stochastic_rounding": True, "seed": 3},
}


def by_mode(optimizers: dict[str, funcamp.Optimizer]) -> funcamp.Optimizer:
    """One optimizer per top-level key of the params (optax's multi_transform, in small): all
    modes run in one train step, so one compile covers them."""

    def init(params):
        return {k: opt.init(params[k]) for k, opt in optimizers.items()}

    def update(grads, state, params=None):
        updates, new_state = {}, {}
        for k, opt in optimizers.items():
            p = None if params is None else params[k]
            updates[k], new_state[k] = opt.update(grads[k], state[k], p)
        return updates, new_state

    return funcamp.Optimizer(init, update)


def _leaves_with_paths(tree):
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return list(zip(paths, leaves))


def _assert_bit_identical(a, b):
    la, lb = _leaves_with_paths(a), _leaves_with_paths(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, path
            if x.numel():
                assert torch.equal(
                    x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
                ), path
        else:
            assert x == y, path


def _assert_within_rounding(a, b):
    """Eager (torch's foreach kernels) and inductor (its own code) round the float32 math
    otherwise in the last bit; the bfloat16 params then differ by an ulp at most (rtol 2**-7,
    the bound tests/test_low_precision.py holds whole optimizers to), and the counts, flags and
    scaler not at all."""
    la, lb = _leaves_with_paths(a), _leaves_with_paths(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, path
            if x.is_floating_point():
                torch.testing.assert_close(x, y, rtol=2**-7, atol=1e-5, msg=str(path))
            else:
                assert torch.equal(x, y), path
        else:
            assert x == y, path


def _bytes_per_param(tree, n):
    return (
        sum(
            t.numel() * t.element_size()
            for t in optree.tree_leaves(tree, namespace=NAMESPACE)
            if t.dim() > 0
        )
        / n
    )


# ------------------------------------------------------------------------- TrainState.create


def test_create_starts_master_weights_exact_through_wrappers():
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}
    inner = funcamp.adamw(1e-3, master_weights=True)
    opt = funcamp.accumulate(funcamp.chain(funcamp.clip_by_global_norm(1.0), inner), 2)
    state = funcamp.TrainState.create(params, opt, "bf16-true")
    masters = state.opt_state.inner[1].low
    assert isinstance(masters, MasterWeightsState)
    for k, p in params.items():
        assert state.params[k].dtype == torch.bfloat16
        assert torch.equal(masters.master[k], p)  # exact, not rounded through bfloat16
        assert not torch.equal(masters.master[k], p.bfloat16().float())
        assert masters.master[k].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
    # optimizer.init on the cast params alone rounds: only create knows the originals
    plain_init = inner.init(state.params)
    assert torch.equal(plain_init.low.master["w"], state.params["w"].float())
    # the other modes allocate in the param dtype; nothing is kept for a float32 policy
    kahan = funcamp.TrainState.create(params, funcamp.adam(1e-3, kahan=True), "bf16-true")
    assert isinstance(kahan.opt_state.low, KahanState)
    assert kahan.opt_state.low.compensation["w"].dtype == torch.bfloat16
    sr = funcamp.TrainState.create(
        params, funcamp.adam(1e-3, stochastic_rounding=True), "bf16-true"
    )
    assert isinstance(sr.opt_state.low, StochasticRoundingState)
    f32 = funcamp.TrainState.create(params, inner, "float32")
    assert f32.opt_state.low.master["w"].numel() == 0


# Optimizer state per param element for bfloat16 params (funcamp.optim's table), plus the 2-byte
# param itself.
ADAM_BYTES = {"plain": 8, "master": 12, "kahan": 10, "sr": 8}
SGD_MOMENTUM_BYTES = {"plain": 4, "master": 8, "kahan": 6, "sr": 4}


@pytest.mark.parametrize("mode", list(MODES))
def test_bytes_per_param_through_train_state(mode):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    params, _ = funcamp.params_and_buffers(model)
    n = sum(p.numel() for p in params.values())
    for make, table in (
        (lambda kw: funcamp.adamw(1e-3, **kw), ADAM_BYTES),
        (lambda kw: funcamp.sgd(1e-3, momentum=0.9, **kw), SGD_MOMENTUM_BYTES),
    ):
        state = funcamp.TrainState.create(params, make(MODES[mode]), "bf16-true")
        assert _bytes_per_param(state.params, n) == 2
        assert _bytes_per_param(state.opt_state, n) == table[mode]


# ------------------------------------------------------------------------ make_train_step


def linear_loss(params, buffers, batch):
    # d/dw = batch exactly (bfloat16): every mode sees the same, exactly known gradient
    return sum((params[k] * batch).sum() for k in MODES)


def test_plain_bf16_stalls_through_make_train_step_while_modes_keep_improving():
    # lr * grad = 1e-3 is below half a bfloat16 ulp just under 1.0 (2**-9 ~ 1.95e-3): plain
    # round-to-nearest brings every step back to 1.0; the modes accumulate the small steps.
    n, steps, lr = 256, 100, 1e-3
    opt = by_mode({k: funcamp.sgd(lr, **kw) for k, kw in MODES.items()})
    params = {k: torch.ones(n) for k in MODES}
    state = funcamp.TrainState.create(params, opt, "bf16-true")
    step = funcamp.make_train_step(linear_loss, opt, "bf16-true", compile=False, donate_state=False)
    grad = torch.ones(n)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, grad)
        losses.append(float(metrics["loss"]))
    target = 1.0 - steps * lr  # 0.9
    err = {k: (state.params[k].float() - target).abs().mean().item() for k in MODES}
    assert torch.equal(state.params["plain"], torch.ones(n, dtype=torch.bfloat16))  # stalled
    half_ulp = 2.0**-9  # bfloat16 spacing in [0.5, 1) is 2**-8
    assert err["master"] <= half_ulp and err["kahan"] <= half_ulp
    # stochastic rounding is unbiased, but each element does a random walk of ~4 ulps (std)
    # around the target: its mean is on target, single elements are not
    assert abs(state.params["sr"].float().mean().item() - target) < 3.5e-3
    assert err["sr"] < err["plain"] / 5, err
    assert losses[-1] < losses[0] - 0.09 * 3 * n  # the three modes each lost ~0.1 per element
    assert state.opt_state["master"].low.master.sub(target).abs().max() < 1e-5  # float32 sum


def test_16_true_step_unscales_float16_grads():
    """float16 params: the grads are float16 and are unscaled in float32 (GradScaler.unscale_
    refuses float16 grads); the dynamic scaler grows, backs off and skips as usual."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    params, buffers = funcamp.params_and_buffers(model)

    def loss_fn(p, b, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, (p, b), (x,)), y)

    opt = funcamp.adam(1e-2, kahan=True)
    scaler = funcamp.ScalerState.dynamic(2.0**10, growth_interval=3)
    state = funcamp.TrainState.create(params, opt, "16-true", buffers=buffers, scaler=scaler)
    assert state.params["0.weight"].dtype == torch.float16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=g)
    y = torch.stack([x[:, 0] * 0.5, x[:, 1] - x[:, 2]], 1)
    # what the step differentiates: float16 params give float16 grads ...
    amp_loss = funcamp.amp(loss_fn, "16-true")
    grads = torch.func.grad(lambda p: amp_loss(p, state.buffers, (x, y)).float())(state.params)
    assert {v.dtype for v in grads.values()} == {torch.float16}
    # ... which funcamp unscales in float32, where GradScaler refuses
    unscaled, found_inf = funcamp.unscale(state.scaler, grads)
    assert {v.dtype for v in unscaled.values()} == {torch.float32} and not bool(found_inf)
    tparams = [p.clone().requires_grad_() for p in state.params.values()]
    for p, gr in zip(tparams, grads.values()):
        p.grad = gr.clone()
    gs = torch.amp.GradScaler("cpu")
    gs.scale(torch.ones((), requires_grad=True))  # initializes the scale
    with pytest.raises(ValueError, match="FP16 gradients"):
        gs.unscale_(torch.optim.SGD(tparams, lr=0.1))

    step = funcamp.make_train_step(loss_fn, opt, "16-true", compile=False, donate_state=False)
    losses, scales, found = [], [], []
    for i in range(40):
        batch = (x, y) if i != 7 else (torch.full_like(x, float("inf")), y)
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        scales.append(float(m["scale"]))
        found.append(bool(m["found_inf"]))
    # the injected inf, and overflows of the float16 backward when the scale has grown too far
    assert found[7] and sum(found) == int(state.scaler.skipped) < 10
    assert all(bool(v.isfinite().all()) for v in state.params.values())
    assert all(v.dtype == torch.float16 for v in state.params.values())
    assert max(scales) > 2.0**10 and min(scales[8:]) < max(scales[:8])  # grew, then backed off
    assert losses[-1] < 0.5 * losses[0]


# ----------------------------------------------------- every mode: eager vs inductor, one compile


def _mlp_loss(params, buffers, batch):
    x, y = batch
    total = torch.zeros((), dtype=torch.float32)
    for k in MODES:
        # bfloat16 matmuls (aten's kernels in eager and compiled), then float32 elementwise ops;
        # no reduction feeds a gradient (its order differs between eager and inductor)
        r = ((x @ params[k]["w1"]) @ params[k]["w2"]).float() - y
        total = total + 0.5 * (r * r).mean()
    return total


def _mode_optimizer():
    sched = funcamp.linear_warmup_cosine_decay(2e-2, 2, 10)
    return by_mode(
        {
            "plain": funcamp.adamw(1e-2),
            "master": funcamp.sgd(3e-2, 0.9, nesterov=True, weight_decay=1e-3, master_weights=True),
            "kahan": funcamp.adamw(sched, kahan=True),
            "sr": funcamp.adam(1e-2, weight_decay=1e-3, stochastic_rounding=True, seed=5),
        }
    )


def _mode_params():
    g = torch.Generator().manual_seed(0)
    return {
        k: {"w1": torch.randn(8, 6, generator=g) / 3, "w2": torch.randn(6, 4, generator=g) / 2}
        for k in MODES
    }


def _mode_batches(n=6):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(16, 8, generator=g)
        if i == 3:
            x[0, 0] = float("inf")  # a skipped step in the middle
        out.append((x, torch.randn(16, 4, generator=g)))
    return out


@pytest.fixture(scope="module")
def mode_steps():
    """The compiled (default inductor, default options) and eager steps over all four modes,
    run once side by side; the tests below check what they produced."""
    opt = _mode_optimizer()
    eager = funcamp.make_train_step(_mlp_loss, opt, "bf16-true", compile=False, donate_state=False)
    compiled = funcamp.make_train_step(_mlp_loss, opt, "bf16-true", donate_state=False)
    state = funcamp.TrainState.create(_mode_params(), opt, "bf16-true")
    counters.clear()
    s_e = s_c = state
    metrics = []
    for batch in _mode_batches():
        s_e, m_e = eager(s_e, batch)
        s_c, m_c = compiled(s_c, batch)
        metrics.append((m_e, m_c))
    stats = {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
    }
    return {"eager": eager, "compiled": compiled, "start": state, "eager_state": s_e,
            "compiled_state": s_c, "metrics": metrics, "stats": stats}  # fmt: skip


def test_every_mode_eager_and_inductor_agree_through_make_train_step(
    mode_steps, donate_state=False
):
    s_e, s_c = mode_steps["eager_state"], mode_steps["compiled_state"]
    _assert_within_rounding(s_e, s_c)  # params, optimizer states (masters, buffers), counts
    assert torch.equal(s_e.scaler.scale, s_c.scaler.scale)
    assert mode_steps["stats"] == {"graphs": 1, "breaks": 0}
    for m_e, m_c in mode_steps["metrics"]:
        assert bool(m_e["found_inf"]) == bool(m_c["found_inf"])
        # metrics are reductions (loss, norm), whose order differs between eager and inductor
        torch.testing.assert_close(m_e["grad_norm"], m_c["grad_norm"], equal_nan=True)
        torch.testing.assert_close(m_e["loss"], m_c["loss"], rtol=1e-2, atol=1e-2, equal_nan=True)
    assert int(s_c.scaler.skipped) == 1
    start = mode_steps["start"]
    for k in MODES:
        assert s_c.params[k]["w1"].dtype == torch.bfloat16
        assert not torch.equal(s_c.params[k]["w1"], start.params[k]["w1"])
    # the modes kept their own state and it moved
    assert bool(s_c.opt_state["kahan"].low.compensation["w1"].ne(0).any())
    assert int(s_c.opt_state["sr"].count) == 5


def test_no_host_sync_in_any_mode(mode_steps, monkeypatch):
    state = mode_steps["start"]
    batches = _mode_batches(4)
    with monkeypatch.context() as mp:

        def boom(*args, **kwargs):
            raise AssertionError("host sync on the step path")

        for name in ("item", "__bool__", "tolist", "__float__", "__int__"):
            mp.setattr(torch.Tensor, name, boom)
        s_c = s_e = state
        with device_path():  # the CPU eager step reads its skip flag; on CUDA it does not
            for b in batches:
                s_c, _ = mode_steps["compiled"](s_c, b)
                s_e, _ = mode_steps["eager"](s_e, b)
    _assert_within_rounding(s_c, s_e)


# ------------------------------------------------------------------ stochastic rounding resume


def test_stochastic_rounding_resumes_bit_identically():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    params, buffers = funcamp.params_and_buffers(model)

    def loss_fn(p, b, batch):
        x, y = batch
        out = torch.func.functional_call(model, (p, b), (x,))
        return torch.nn.functional.cross_entropy(out.float(), y)

    opt = funcamp.adamw(3e-3, stochastic_rounding=True, seed=11)
    step = funcamp.make_train_step(loss_fn, opt, "bf16-true", compile=False, donate_state=False)
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(8)
    ]

    def create():
        return funcamp.TrainState.create(params, opt, "bf16-true", buffers=buffers)

    straight = create()
    for b in batches:
        straight, _ = step(straight, b)

    state = create()
    for b in batches[:4]:
        state, _ = step(state, b)
    buf = io.BytesIO()
    torch.save(funcamp.state_dict(state), buf)
    buf.seek(0)
    torch.manual_seed(123)  # the global RNG plays no part
    resumed = funcamp.load_state_dict(create(), torch.load(buf, weights_only=True))
    for b in batches[4:]:
        resumed, _ = step(resumed, b)
    _assert_bit_identical(straight, resumed)
    assert int(resumed.opt_state.count) == 8


def test_low_precision_guide_snippets_run():
    """The ```python blocks of docs/guides/low-precision.md, in order, in one namespace."""
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides" / "low-precision.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 3
    namespace: dict[str, object] = {"__name__": "snippet:guides/low-precision.md"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/guides/low-precision.md [block {i + 1}]", "exec"), namespace)
