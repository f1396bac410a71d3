"""The loss-scaling functions under torch.func and torch.compile: ``scaled_grad_and_value``,
``scale``, ``unscale``, ``unscale_and_step`` and ``update`` under ``vmap`` (per-sample gradients
with one scaler; a batch of scalers, vmapped over the state pytree) and under
``torch.compile(fullgraph=True)``, built inside or outside the transform, with and without aux.
Each is held bit for bit to the unbatched eager result, and float16 DP-SGD to
``torch.amp.GradScaler``.
"""

from __future__ import annotations

import optree
import pytest
import torch
from bitwise import assert_bitwise

import funcamp
import funcamp.train.loss

NAMESPACE = "funcamp"
vmap = torch.func.vmap

B = 4  # samples (or ensemble members)


def _data(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)}
    return params, torch.randn(B, 3, generator=g), torch.randn(B, 2, generator=g)


def _model(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.nn.functional.linear(x, params["w"].T, params["b"]))


def _loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (_model(params, x) - y).square().mean()


def _loss_aux(params, x, y):
    out = _model(params, x)
    return (out - y).square().mean(), {"out": out}


LOSSES = {False: _loss, True: _loss_aux}
SCALER = funcamp.ScalerState.dynamic(2.0**10)


def _amp(has_aux: bool, policy: str = "autocast_cpu"):
    return funcamp.amp(LOSSES[has_aux], policy)


def _stack(trees):
    return optree.tree_map(lambda *xs: torch.stack(xs), *trees, namespace=NAMESPACE)


def _member(tree, i: int):
    return optree.tree_map(lambda x: x[i], tree, namespace=NAMESPACE)


def _per_sample_eager(fn, *args_of):
    """``fn`` run sample by sample in plain eager, the results stacked."""
    return _stack([fn(*(a(i) for a in args_of)) for i in range(B)])


def _reference(scaler, has_aux):
    """The same gradients written with torch.func alone."""
    loss_fn = _amp(has_aux)

    def scaled(p, x, y):
        out = loss_fn(p, x, y)
        loss, aux = out if has_aux else (out, None)
        loss = loss.float()
        return funcamp.scale(scaler, loss), ((loss, aux) if has_aux else loss)

    return torch.func.grad(scaled, has_aux=True)


# ----------------------------------------------------------------------- per-sample, one scaler


@pytest.mark.parametrize("has_aux", [False, True], ids=["loss", "aux"])
@pytest.mark.parametrize("built", ["outside", "inside"])
def test_per_sample_grads_under_vmap(built, has_aux):
    params, x, y = _data()
    if built == "outside":
        g = funcamp.scaled_grad_and_value(_amp(has_aux), SCALER, has_aux=has_aux)
        per_sample = vmap(g, in_dims=(None, 0, 0))
    else:

        def per_sample(p, xi, yi):
            return funcamp.scaled_grad_and_value(_amp(has_aux), SCALER, has_aux=has_aux)(p, xi, yi)

        per_sample = vmap(per_sample, in_dims=(None, 0, 0))
    got = per_sample(params, x, y)
    assert_bitwise(got, vmap(_reference(SCALER, has_aux), in_dims=(None, 0, 0))(params, x, y))
    # Sample by sample in plain eager (the torch.autograd engine): batched and unbatched
    # kernels round differently (in float32, an ulp), so close, not equal.
    eager = funcamp.scaled_grad_and_value(_amp(has_aux, "float32"), SCALER, has_aux=has_aux)
    batched = vmap(eager, in_dims=(None, 0, 0))(params, x, y)
    want = _per_sample_eager(eager, lambda i: params, x.__getitem__, y.__getitem__)
    funcamp.testing.assert_trees_close(batched, want, rtol=1e-5, atol=1e-3)


def test_grad_method_is_chosen_where_the_function_runs(monkeypatch):
    """One function, built in plain eager: torch.autograd on leaf copies when called in plain
    eager (the fast path), torch.func when called under vmap."""
    calls = []
    real = funcamp.train.loss.autograd_grad_and_value

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(funcamp.train.loss, "autograd_grad_and_value", spy)
    params, x, y = _data()
    g = funcamp.scaled_grad_and_value(_amp(False), SCALER)
    g(params, x[0], y[0])
    assert len(calls) == 1
    vmap(g, in_dims=(None, 0, 0))(params, x, y)
    assert len(calls) == 1
    g(params, x[0], y[0])
    assert len(calls) == 2


def test_per_sample_scale_and_unscale_under_vmap():
    """One scaler (``in_dims=None``) for a batch of losses and of per-sample gradients: each
    sample as alone, ``found_inf`` per sample."""
    grads = {"w": torch.randn(B, 3, 2), "b": torch.randn(B, 2)}
    grads["w"][2, 1, 0] = float("inf")
    losses = torch.randn(B, dtype=torch.bfloat16)
    scaled = vmap(funcamp.scale, in_dims=(None, 0))(SCALER, losses)
    assert_bitwise(
        scaled, _per_sample_eager(lambda x: funcamp.scale(SCALER, x), losses.__getitem__)
    )
    got = vmap(funcamp.unscale, in_dims=(None, 0))(SCALER, grads)
    want = _per_sample_eager(lambda gr: funcamp.unscale(SCALER, gr), lambda i: _member(grads, i))
    assert_bitwise(got, want)
    assert got[1].tolist() == [False, False, True, False]


def test_per_sample_grads_under_grad_of_vmap():
    """Built in plain eager, run under ``torch.func.grad`` (a gradient of the per-sample
    gradients' norm): torch.func differentiates there, as it must."""
    params, x, y = _data()
    g = funcamp.scaled_grad_and_value(_amp(False), SCALER)

    def penalty(p):
        grads, _ = vmap(g, in_dims=(None, 0, 0))(p, x, y)
        return sum(v.square().sum() for v in grads.values())

    def reference(p):
        grads, _ = vmap(_reference(SCALER, False), in_dims=(None, 0, 0))(p, x, y)
        return sum(v.square().sum() for v in grads.values())

    assert_bitwise(torch.func.grad(penalty)(params), torch.func.grad(reference)(params))


# ----------------------------------------------------------------------- a batch of scalers


def _scalers():
    """Four scalers in four different states (one will overflow at its scale)."""
    members = [
        funcamp.ScalerState.dynamic(2.0**k, growth_interval=2, hysteresis=2) for k in (3, 8, 40, 12)
    ]
    members[1] = funcamp.update(members[1], torch.tensor(False))
    members[3] = funcamp.update(members[3], torch.tensor(True))
    return members


@pytest.mark.parametrize("has_aux", [False, True], ids=["loss", "aux"])
def test_vmapped_scalers_scaled_grad_and_value(has_aux):
    """A batch of ScalerStates (``in_dims=0`` over the state pytree), each with its own
    params and batch, equals torch.func's own composition bit for bit (a function built
    outside closes over one scaler: a batch of scalers is built inside)."""
    data = [_data(seed) for seed in range(B)]
    args = [_stack([d[k] for d in data]) for k in range(3)]

    def run(scaler, p, xb, yb, policy="autocast_cpu"):
        loss_fn = _amp(has_aux, policy)
        return funcamp.scaled_grad_and_value(loss_fn, scaler, has_aux=has_aux)(p, xb, yb)

    def reference(scaler, p, xb, yb):
        return _reference(scaler, has_aux)(p, xb, yb)

    got = vmap(run)(_stack(_scalers()), *args)
    assert_bitwise(got, vmap(reference)(_stack(_scalers()), *args))
    # Each member alone (float32: batched and unbatched kernels round differently).
    batched = vmap(lambda *a: run(*a, policy="float32"))(_stack(_scalers()), *args)
    alone = _stack([run(s, *d, policy="float32") for s, d in zip(_scalers(), data)])
    funcamp.testing.assert_trees_close(batched, alone, rtol=1e-5, atol=1e-3)


def test_vmapped_scalers_scale_and_unscale():
    members = _scalers()
    grads = {"w": torch.randn(B, 3, 2), "b": torch.randn(B, 2)}
    grads["b"][1, 0] = float("nan")
    losses = torch.randn(B, dtype=torch.bfloat16)
    got = vmap(funcamp.scale)(_stack(members), losses)
    assert_bitwise(got, _stack([funcamp.scale(m, losses[i]) for i, m in enumerate(members)]))
    got = vmap(funcamp.unscale)(_stack(members), grads)
    want = [funcamp.unscale(m, _member(grads, i)) for i, m in enumerate(members)]
    assert_bitwise(got, _stack(want))
    assert got[1].tolist() == [False, True, False, False]


def test_vmapped_scalers_train_an_ensemble_as_members_alone():
    """An ensemble, each member with its own scaler: per-member grads of the scaled loss, then
    unscale_and_step (one member overflows and is skipped) and update, vmapped over the
    states: the step equals each member's eager step on the same grads, bit for bit, over
    five steps."""
    opt = funcamp.adam(1e-2)
    data = [_data(seed) for seed in range(B)]
    x, y = _stack([d[1] for d in data]), _stack([d[2] for d in data])
    y[2, 0, 0] = 1e30  # member 2 overflows at its scale (2**40) while the others step
    loss_fn = _amp(False)

    def grads_of(scaler, params, x, y):
        return funcamp.scaled_grad_and_value(loss_fn, scaler)(params, x, y)

    def step(scaler, params, opt_state, grads):
        params, opt_state, info = funcamp.unscale_and_step(scaler, opt, grads, opt_state, params)
        return funcamp.update(scaler, info.found_inf), params, opt_state, info

    state = _stack([(s, d[0], opt.init(d[0])) for s, d in zip(_scalers(), data)])
    flags = []
    for _ in range(5):
        grads, _ = vmap(grads_of)(state[0], state[1], x, y)
        new = vmap(step)(*state, grads)
        alone = [step(*_member((*state, grads), i)) for i in range(B)]
        assert_bitwise(new, _stack(alone))
        state = new[:3]
        flags.append(new[3].found_inf.tolist())
    assert flags[0] == [False, False, True, False]
    assert [int(k) for k in state[0].skipped] == [0, 0, 5, 1]


# ----------------------------------------------------------------------- torch.compile


def _built_inside(loss_fn, has_aux):
    def inside(p, x, y):
        return funcamp.scaled_grad_and_value(loss_fn, SCALER, has_aux=has_aux)(p, x, y)

    return inside


@pytest.fixture(scope="module")
def compiled():
    """Compiled functions, shared by the tests below (each compile costs seconds)."""
    torch._dynamo.reset()
    out = {}
    for has_aux in (False, True):
        g = funcamp.scaled_grad_and_value(_amp(has_aux), SCALER, has_aux=has_aux)
        out["outside", has_aux] = torch.compile(g, fullgraph=True, backend="aot_eager")
        out["inside", has_aux] = torch.compile(
            _built_inside(_amp(has_aux), has_aux), fullgraph=True, backend="aot_eager"
        )
    return out


@pytest.mark.parametrize("has_aux", [False, True], ids=["loss", "aux"])
@pytest.mark.parametrize("built", ["outside", "inside"])
def test_scaled_grad_and_value_compiles_fullgraph(compiled, built, has_aux):
    params, x, y = _data()
    eager = funcamp.scaled_grad_and_value(_amp(has_aux), SCALER, has_aux=has_aux)
    assert_bitwise(compiled[built, has_aux](params, x, y), eager(params, x, y))


def _dp_step(opt, loss_fn, clip, params, opt_state, scaler, x, y):
    """DP-SGD's core without noise: per-sample gradients of the scaled loss, each clipped to
    norm ``clip * scale`` (the clip in unscaled units), summed; unscale_and_step; update."""
    grads, losses = vmap(funcamp.scaled_grad_and_value(loss_fn, scaler), in_dims=(None, 0, 0))(
        params, x, y
    )
    leaves = optree.tree_leaves(grads, namespace=NAMESPACE)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in leaves]).sum(0).sqrt()
    factor = (clip * scaler.scale / norms).clamp(max=1.0)  # inf norm: 0 * inf = nan, kept
    summed = optree.tree_map(
        lambda g: (g * factor.view(-1, *[1] * (g.dim() - 1))).sum(0) / len(factor),
        grads,
        namespace=NAMESPACE,
    )
    params, opt_state, info = funcamp.unscale_and_step(scaler, opt, summed, opt_state, params)
    return params, opt_state, funcamp.update(scaler, info.found_inf), info, losses.mean()


def test_dp_sgd_step_compiles_fullgraph_and_equals_eager():
    """The per-sample step of the DP-SGD recipe, compiled whole (aot_eager), equals eager bit
    for bit over steps that overflow and grow the scale."""
    opt = funcamp.sgd(0.1)
    loss_fn = _amp(False)
    params, x, y = _data()
    scaler = funcamp.ScalerState.dynamic(2.0**20, growth_interval=1)
    y = y.clone()
    y[1, 0] = 1e33  # sample 1's scaled gradient overflows above a scale of 2**18
    state = (params, opt.init(params), scaler)
    eager_state = state

    def step(params, opt_state, scaler, x, y):
        return _dp_step(opt, loss_fn, 1.0, params, opt_state, scaler, x, y)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    flags = []
    for _ in range(4):
        *state, info, loss = compiled(*state, x, y)
        *eager_state, e_info, e_loss = step(*eager_state, x, y)
        assert_bitwise((state, info, loss), (eager_state, e_info, e_loss))
        flags.append(bool(info.found_inf))
    assert flags == [True, True, False, True]


@pytest.mark.slow
def test_scaled_grad_and_value_under_inductor():
    """Per-sample gradients compiled by inductor (float32: inductor's default fuses away
    bfloat16 roundings, docs/differences.md) equal eager's within float32 rounding."""
    params, x, y = _data()
    g = funcamp.scaled_grad_and_value(_amp(True, "float32"), SCALER, has_aux=True)
    got = torch.compile(vmap(g, in_dims=(None, 0, 0)), fullgraph=True)(params, x, y)
    want = vmap(g, in_dims=(None, 0, 0))(params, x, y)
    funcamp.testing.assert_trees_close(got, want, rtol=1e-4, atol=1e-4)  # inductor's tanh


# ----------------------------------------------------------------------- DP-SGD vs GradScaler

F16 = "params=float32,compute=float16,output=float32,ops=autocast_cpu"


def test_float16_dp_sgd_matches_grad_scaler():
    """float16 DP-SGD (per-sample grads of the scaled loss, clipped at ``C * scale``, averaged)
    against torch: ``vmap(grad)`` of ``GradScaler.scale(loss)`` under
    ``torch.autocast("cpu", float16)``, the same clip, then ``GradScaler.step``/``update``.
    The skipped steps and the scale sequence agree exactly, the params to float32 rounding."""
    params, x, y = _data()
    clip = 0.5
    init, interval = 2.0**14, 2
    opt = funcamp.sgd(0.1)
    loss_fn = funcamp.amp(_loss, F16)

    model = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = torch.optim.SGD(list(model.values()), lr=0.1)
    gs = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    state = (params, opt.init(params), funcamp.ScalerState.dynamic(init, growth_interval=interval))

    ours, theirs = [], []
    for step in range(6):
        # far targets at steps 0 and 3: the scaled float16 gradients overflow
        ys = y * (100.0 if step in (0, 3) else 1.0)
        *state, info, _ = _dp_step(opt, loss_fn, clip, *state, x, ys)
        ours.append((bool(info.found_inf), float(state[2].scale)))

        # torch's own per-sample gradients: vmap(grad) of the scaled loss under autocast (the
        # same transform funcamp's step runs, so autocast's vmap casting rules apply to both)
        def scaled(p, xi, yi):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(p, xi, yi)
            return gs.scale(loss)

        detached = {k: v.detach() for k, v in model.items()}
        per_sample = torch.func.vmap(torch.func.grad(scaled), in_dims=(None, 0, 0))(detached, x, ys)
        grads = [per_sample[k] for k in model]
        norms = torch.stack([g.flatten(1).square().sum(1) for g in grads]).sum(0).sqrt()
        factor = (clip * torch.tensor(gs.get_scale()) / norms).clamp(max=1.0)
        for p, g in zip(model.values(), grads):
            p.grad = (g * factor.view(-1, *[1] * (g.dim() - 1))).sum(0) / B
        before = gs.get_scale()
        gs.step(torch_opt)
        gs.update()
        theirs.append((gs.get_scale() < before, gs.get_scale()))
        torch_opt.zero_grad()
    assert [o[0] for o in ours] == [t[0] for t in theirs]
    assert [o[1] for o in ours] == [t[1] for t in theirs]
    assert ours[0][0] and ours[3][0] and not ours[1][0]
    # Batched and sample-by-sample kernels round differently: the params agree to float32's
    # rounding, the decisions exactly.
    want = {k: v.detach() for k, v in model.items()}
    funcamp.testing.assert_trees_close(state[0], want, rtol=1e-5, atol=1e-6)
