"""funcamp.optim.with_ema: the average of the weights, against torch's AveragedModel and
timm's ModelEmaV3 rule, through the train step (skips, compile, eval, checkpoints)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import funcamp
from funcamp.testing import assert_trees_equal

STEPS = 10


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))


def _grads(model, i):
    g = torch.Generator().manual_seed(i)
    return {k: torch.randn(v.shape, generator=g) for k, v in model.named_parameters()}


def _run_funcamp(opt, steps=STEPS):
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = opt.init(params)
    for i in range(steps):
        updates, state = opt.update(_grads(model, i), state, params)
        params = funcamp.apply_updates(params, updates)
    return params, state


def _run_torch(update_ema, steps=STEPS):
    """torch.optim.AdamW(fused=True) steps; ``update_ema(i, model)`` after each."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for i in range(steps):
        for k, p in model.named_parameters():
            p.grad = _grads(model, i)[k]
        opt.step()
        update_ema(i, model)
    return model


@pytest.mark.parametrize("every", [1, 3])
def test_equals_averaged_model_with_ema_multi_avg_fn(every):
    decay = 0.8
    averaged = None

    def update(i, model):
        nonlocal averaged
        if averaged is None:
            averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
        if (i + 1) % every == 0:
            averaged.update_parameters(model)

    ref = _run_torch(update)
    opt = funcamp.optim.with_ema(funcamp.adamw(0.05, fused=True), decay, every=every)
    params, state = _run_funcamp(opt)
    for k, p in ref.named_parameters():
        assert torch.equal(params[k], p.detach())  # the optimizer: bit for bit (fused)
    ema = funcamp.optim.ema_params(state)
    for k, p in averaged.module.named_parameters():
        assert torch.equal(ema[k], p.detach()), k  # the average: bit for bit
    assert int(state.averaged) == int(averaged.n_averaged) == STEPS // every
    assert not torch.equal(ema["0.weight"], params["0.weight"])


def _timm_decay(step, decay, update_after=0, gamma=1.0, power=2 / 3, min_decay=0.0):
    """timm.utils.model_ema.ModelEmaV3.get_decay (timm 1.0), with use_warmup=True."""
    step = max(0, step - update_after - 1)
    if step <= 0:
        return 0.0
    d = 1 - (1 + step / gamma) ** -power
    return max(min(d, decay), min_decay)


@pytest.mark.parametrize("update_after", [0, 2])
def test_warmup_equals_timm_model_ema_v3(update_after):
    decay = 0.99
    ema = None

    def update(i, model):  # timm: model_ema.update(model, step=num_updates)
        nonlocal ema
        if ema is None:  # ModelEmaV3(model): a deep copy at construction
            ema = copy.deepcopy(model)
        d = _timm_decay(i + 1, decay, update_after, gamma=2.0, power=0.75, min_decay=0.1)
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), weight=1.0 - d)

    _run_torch(update)
    opt = funcamp.optim.with_ema(
        funcamp.adamw(0.05, fused=True),
        decay,
        warmup=True,
        warmup_gamma=2.0,
        warmup_power=0.75,
        min_decay=0.1,
        update_after=update_after,
    )
    _, state = _run_funcamp(opt)
    got = funcamp.optim.ema_params(state)
    for k, p in ema.named_parameters():
        assert torch.equal(got[k], p.detach()), k


def test_half_params_average_in_float32_rounded_once():
    decay = 0.9
    p = {"w": torch.randn(64, dtype=torch.float32).to(torch.bfloat16)}
    opt = funcamp.optim.with_ema(funcamp.sgd(0.1), decay)
    state = opt.init(p)
    ref = p["w"].clone()
    for i in range(4):
        g = {"w": torch.randn(64, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)}
        updates, state = opt.update(g, state, p)
        p = funcamp.apply_updates(p, updates)
        ref = p["w"].clone() if i == 0 else torch.lerp(ref, p["w"], 1 - decay)
    assert state.ema["w"].dtype == torch.bfloat16
    assert torch.equal(state.ema["w"], ref)  # torch's bf16 lerp: float32 math, one rounding


def _loss_fn(model):
    def loss_fn(params, buffers, batch):
        x, y = batch
        out = torch.func.functional_call(model, (params, buffers), (x,))
        return torch.nn.functional.cross_entropy(out, y)

    return loss_fn


def _batches(n, bad=()):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        x = torch.randn(4, 5, generator=g)
        if i in bad:
            x[0, 0] = math.inf
        out.append((x, torch.randint(0, 3, (4,), generator=g)))
    return out


def test_train_step_skips_keep_the_average_compiled_matches_eager_and_eval_reads_it(tmp_path):
    model = _model()
    opt = funcamp.optim.with_ema(funcamp.adamw(0.05), 0.5, every=2)
    params, buffers = funcamp.params_and_buffers(model)
    batches = _batches(7, bad=(2,))
    states = []
    for compile in (False, True):
        how = funcamp.Compile(backend="aot_eager") if compile else False
        step = funcamp.make_train_step(
            _loss_fn(model), opt, "mixed_float16", compile=how, donate_state=False
        )
        state = funcamp.TrainState.create(params, opt, "mixed_float16", buffers=buffers)
        for i, b in enumerate(batches):
            before = state
            state, m = step(state, b)
            if i == 2:  # an overflow: skipped, the average and its counts with it
                assert bool(m["found_inf"])
                assert_trees_equal(state.opt_state, before.opt_state)
        states.append(state)
    eager, compiled = states
    assert_trees_equal(eager.opt_state, compiled.opt_state)
    assert int(eager.opt_state.count) == 6 and int(eager.opt_state.averaged) == 3
    # an eval step on the average
    ema = funcamp.optim.ema_params(eager.opt_state)
    evaluate = funcamp.make_eval_step(_loss_fn(model), "float32", compile=False)
    on_ema = evaluate((ema, buffers), batches[0])
    on_params = evaluate(eager, batches[0])
    assert on_ema.shape == () and not torch.equal(on_ema, on_params)
    # checkpointed with the rest of the state
    path = tmp_path / "ckpt"
    funcamp.save(path, eager, policy="mixed_float16")
    back = funcamp.load(path, eager, policy="mixed_float16")
    assert_trees_equal(funcamp.optim.ema_params(back.opt_state), ema)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"funcamp.optim.with_ema: `decay` must be"):
        funcamp.optim.with_ema(funcamp.sgd(0.1), 1.5)
    with pytest.raises(ValueError, match=r"`every` must be an int >= 1"):
        funcamp.optim.with_ema(funcamp.sgd(0.1), 0.9, every=0)
    opt = funcamp.optim.with_ema(funcamp.sgd(0.1), 0.9)
    p = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"`update` needs the params"):
        opt.update(p, opt.init(p))
    with pytest.raises(ValueError, match=r"must hold exactly one EmaState"):
        funcamp.optim.ema_params(funcamp.sgd(0.1).init(p))
