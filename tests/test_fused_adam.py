"""``adam``/``adamw`` with ``fused=True``: torch's fused kernel, in eager and compiled code.

Compared with torch.optim's ``fused=True`` optimizers driven by a real ``torch.amp.GradScaler``,
bit for bit, through :func:`funcamp.unscale_and_step` (donated or not, with or without the
optimizer's fast path) and through the compiled train step, which calls the kernel as an
extern call (``funcamp::fused_adam_``) instead of tracing the update.
"""

from __future__ import annotations

import pytest
import torch
from tiny_step import batches, model_step, recording_backend

import funcamp
from funcamp.testing import assert_trees_equal

INIT_SCALE = 2.0**10
SHAPES = {"w": (8, 5), "b": (5,), "v": (3, 2, 4)}


def _grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = {k: torch.randn(s, generator=g) * INIT_SCALE for k, s in SHAPES.items()}
    if step == 2:  # an overflow: the step is skipped everywhere
        out["w"][0, 0] = float("inf")
    return out


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _torch_run(make_opt, steps: int, groups=None):
    """torch.optim (fused=True) with a GradScaler, fed the same scaled gradients."""
    ps = {k: torch.nn.Parameter(v) for k, v in _params().items()}
    opt = make_opt(list(ps.values()) if groups is None else groups(ps))
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    for i in range(steps):
        scaler.scale(torch.zeros(()))  # GradScaler makes its scale on the first scale()
        for k, g in _grads(i).items():
            ps[k].grad = g.clone()
        scaler.step(opt)  # fused: the kernel takes the scale and found_inf itself
        scaler.update()
    return {k: v.detach() for k, v in ps.items()}, opt


def _funcamp_run(opt, steps: int, *, donate_state: bool = True):
    params = _params()
    state = opt.init(params)
    scaler = funcamp.ScalerState.dynamic(init_scale=INIT_SCALE, growth_interval=2)
    for i in range(steps):
        params, state, info = funcamp.unscale_and_step(
            scaler, opt, _grads(i), state, params, donate_state=donate_state
        )
        scaler = funcamp.update(scaler, info.found_inf)
    return params, state


@pytest.mark.parametrize("name", ["adam", "adamw"])
@pytest.mark.parametrize("donate_state", [True, False])
def test_fused_adam_is_torch_fused_bit_for_bit(name, donate_state):
    torch_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    ref, topt = _torch_run(lambda ps: torch_cls(ps, lr=3e-3, weight_decay=0.1, fused=True), 5)
    opt = getattr(funcamp, name)(3e-3, weight_decay=0.1, fused=True)
    params, state = _funcamp_run(opt, 5, donate_state=donate_state)
    assert_trees_equal(params, ref)
    first = topt.state[topt.param_groups[0]["params"][0]]
    assert int(first["step"]) == int(state.count) == 4  # one of five steps was skipped
    assert torch.equal(state.exp_avg["w"], first["exp_avg"])
    assert torch.equal(state.exp_avg_sq["w"], first["exp_avg_sq"])
    # the same bits without the fast path (update + apply_updates + select)
    plain = funcamp.Optimizer(opt.init, opt.update)
    assert_trees_equal(_funcamp_run(plain, 5, donate_state=donate_state), (params, state))


def test_fused_adamw_mask_is_two_torch_param_groups():
    def groups(ps):
        return [
            {"params": [ps["w"], ps["v"]], "weight_decay": 0.5},
            {"params": [ps["b"]], "weight_decay": 0.0},
        ]

    ref, _ = _torch_run(lambda gs: torch.optim.AdamW(gs, lr=1e-2, fused=True), 4, groups)
    opt = funcamp.adamw(1e-2, weight_decay=0.5, mask={"w": True, "b": False, "v": True}, fused=True)
    assert_trees_equal(_funcamp_run(opt, 4)[0], ref)


def test_fused_schedule_is_torch_tensor_lr():
    """A schedule's value goes to the kernel as a tensor, as torch.optim's tensor ``lr``."""
    sched = funcamp.linear_schedule(1e-2, 1e-3, 4)
    opt = funcamp.adamw(sched, weight_decay=0.1, fused=True)
    params, _ = _funcamp_run(opt, 1)
    ref, _ = _torch_run(
        lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), weight_decay=0.1, fused=True), 1
    )
    assert_trees_equal(params, ref)


def test_fused_refuses_what_the_kernel_cannot_do():
    with pytest.raises(ValueError, match=r"fused=True.*master_weights"):
        funcamp.adamw(1e-3, fused=True, master_weights=True)
    opt = funcamp.adamw(1e-3, fused=True)
    with pytest.raises(
        ValueError, match=r"float32 params \(plain torch.Tensor\); \['h'\] is a torch.bfloat16"
    ):
        opt.init({"h": torch.ones(2, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="non-contiguous"):
        opt.init({"w": torch.ones(3, 2).t()})
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"torch\.func transforms"):
        torch.func.grad(lambda p: opt.update({"w": p}, state, {"w": p})[0]["w"].value.sum())(
            torch.ones(3)
        )
    with pytest.raises(TypeError, match="fused"):
        funcamp.adam(1e-3, fused=1)
    # a state whose moments are not contiguous (a hand-made one) is refused, not misread
    bent = state._replace(exp_avg={"w": torch.zeros(2, 3).t()[:, 0].contiguous()[[0, 1, 0]]})
    odd = state._replace(exp_avg_sq={"w": torch.zeros(6)[::2]})
    with pytest.raises(
        ValueError, match=r"float32 exp_avg_sq \(plain torch.Tensor\); \['w'\] is a non-"
    ):
        opt.update({"w": torch.ones(3)}, odd, params)
    new, _ = opt.update({"w": torch.ones(3)}, bent, params)  # a contiguous copy is fine
    assert torch.isfinite(new["w"].value).all()


# --------------------------------------------------------------------------------------------
# compiled: the kernel is called, not traced


@pytest.mark.parametrize("donate_state", [True, False])
def test_compiled_step_calls_the_kernel_and_matches_eager(donate_state):
    def opt():
        return funcamp.adamw(funcamp.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.1, fused=True)

    seen: list[str] = []
    compiled, state = model_step(
        opt(), funcamp.Compile(backend=recording_backend(seen)), donate_state=donate_state
    )
    eager, state2 = model_step(opt(), False, donate_state=donate_state)
    for batch in batches():
        state, got = compiled(state, batch)
        state2, want = eager(state2, batch)
        assert_trees_equal(got, want)
    assert_trees_equal(state.params, state2.params)
    assert_trees_equal(state.opt_state, state2.opt_state)
    kernel = "funcamp.fused_adam_" if donate_state else "funcamp.fused_adam.default"
    assert sum(kernel in s for s in seen) == 1, seen


def test_inductor_calls_the_fused_kernel_in_place():
    """Inductor puts the custom op back in place on the donated state (no copies) and calls
    it as an extern kernel: the update generates no C++."""
    from torch._inductor.utils import run_and_get_code

    opt = funcamp.adamw(1e-2, weight_decay=0.1, fused=True)
    step, state = model_step(opt, True)
    batch = batches()[0]
    (new, _), codes = run_and_get_code(step, state, batch)
    code = "\n".join(codes)
    assert "torch.ops.funcamp.fused_adam_.default(" in code
    assert "auto_functionalized" not in code
    assert new.params["0.weight"] is state.params["0.weight"]  # written in place (donated)
    assert int(new.opt_state.count) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True])
def test_fused_adamw_on_cuda_is_torch_fused(compile):
    """On CUDA the same kernel runs (found_inf read on the device: no host sync), eager and in
    a compiled donated step, with torch.optim.AdamW(fused=True)'s bits."""
    dev = torch.device("cuda")
    shapes = {"w": (64, 32), "b": (32,)}
    g = torch.Generator().manual_seed(0)
    p0 = {k: torch.randn(s, generator=g).to(dev) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g).to(dev) for k, s in shapes.items()} for _ in range(3)]
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in p0.items()}
    topt = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.1, fused=True)
    for gr in grads:
        for k in ref:
            ref[k].grad = gr[k].clone()
        topt.step()
    opt = funcamp.adamw(1e-2, weight_decay=0.1, fused=True)
    scaler = funcamp.ScalerState.noop()

    def step(params, state, gr):
        return funcamp.unscale_and_step(scaler, opt, gr, state, params, donate_state=True)[:2]

    run = torch.compile(step, fullgraph=True) if compile else step
    params = {k: v.clone() for k, v in p0.items()}
    state = opt.init(params)
    for gr in grads:
        params, state = run(params, state, {k: v.clone() for k, v in gr.items()})
    assert_trees_equal(params, {k: v.detach() for k, v in ref.items()})


def _transposed_grad_loss(p, b, x):
    return (x * p["w"].t()).sum()  # torch.func.grad gives w a non-contiguous (transposed) grad


@pytest.mark.parametrize("name", ["adamw_fused", "sgd"])
@pytest.mark.parametrize("donate_state", [True, False])
def test_non_contiguous_grads_are_read_right(name, donate_state):
    """A grad with a transposed layout is read through a contiguous copy: the fused kernels
    read flat arrays (found by review: the donated path used to scramble such a grad)."""
    make = {
        "adamw_fused": lambda: funcamp.adamw(0.1, fused=True),
        "sgd": lambda: funcamp.sgd(0.1),
    }[name]
    x = torch.arange(6.0).reshape(3, 2)
    results = []
    for opt in (make(), funcamp.Optimizer(make().init, make().update)):
        params = {"w": torch.ones(2, 3)}
        state = opt.init(params)
        grads = torch.func.grad(_transposed_grad_loss)(params, {}, x)
        assert not grads["w"].is_contiguous()
        scaler = funcamp.ScalerState.noop()
        new, _, _ = funcamp.unscale_and_step(
            scaler, opt, grads, state, params, donate_state=donate_state
        )
        results.append(new["w"].clone())
    want = torch.nn.Parameter(torch.ones(2, 3))
    cls = torch.optim.AdamW if name == "adamw_fused" else torch.optim.SGD
    ref = cls([want], lr=0.1, **({"fused": True} if name == "adamw_fused" else {}))
    want.grad = x.t().contiguous()
    ref.step()
    for got in results:
        assert torch.equal(got, want.detach())


def test_compiled_donated_step_refuses_a_short_state():
    """Compiled, the preflight does not compare the state's shapes: the fused path must, or the
    kernel would write past a short buffer (found by review)."""
    opt = funcamp.adamw(1e-2, fused=True)
    params = {"w": torch.ones(6)}
    state = opt.init(params)
    bad = state._replace(exp_avg_sq={"w": torch.zeros(3)})
    grads = {"w": torch.ones(6)}

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(params, state, grads):
        scaler = funcamp.ScalerState.noop()
        return funcamp.unscale_and_step(scaler, opt, grads, state, params, donate_state=True)

    with pytest.raises(Exception, match=r"exp_avg_sq"):
        step(params, bad, grads)


def test_update_on_parameters_is_torch_optims_no_grad():
    """``update`` with params that require grad (``dict(model.named_parameters())``) runs the
    kernel as torch.optim's step does, under no_grad: the new state carries no autograd
    history."""
    model = torch.nn.Linear(3, 2)
    opt = funcamp.adamw(1e-2, fused=True)
    params = dict(model.named_parameters())
    state = opt.init({k: v.detach() for k, v in params.items()})
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    updates, new_state = opt.update(grads, state, params)
    assert not new_state.exp_avg["weight"].requires_grad
    assert not updates["weight"].value.requires_grad
