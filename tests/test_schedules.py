"""Learning-rate schedules: values, optax semantics, compile behaviour and errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcamp


def _vals(schedule, n):
    return [schedule(torch.tensor(i, dtype=torch.int32)) for i in range(n)]


def test_outputs_are_float64_scalars():
    for s in (
        funcamp.constant_schedule(0.5),
        funcamp.linear_schedule(1.0, 0.0, 3),
        funcamp.cosine_decay_schedule(1.0, 3),
        funcamp.linear_warmup_cosine_decay(1.0, 1, 3),
    ):
        v = s(torch.tensor(2, dtype=torch.int32))
        assert v.dtype == torch.float64 and v.dim() == 0  # torch's lr is a Python double


@settings(max_examples=30, deadline=None)
@given(
    init=st.floats(0, 1),
    end=st.floats(0, 1),
    steps=st.integers(1, 50),
    begin=st.integers(0, 10),
    count=st.integers(0, 100),
)
def test_linear_schedule(init, end, steps, begin, count):
    s = funcamp.linear_schedule(init, end, steps, begin)
    frac = min(max(count - begin, 0), steps) / steps
    expected = init + (end - init) * frac
    assert s(torch.tensor(count)).item() == pytest.approx(expected, rel=1e-6, abs=1e-7)


@settings(max_examples=30, deadline=None)
@given(
    init=st.floats(1e-5, 1),
    steps=st.integers(1, 100),
    alpha=st.floats(0, 0.5),
    exponent=st.sampled_from([1.0, 2.0]),
    count=st.integers(0, 200),
)
def test_cosine_decay_schedule(init, steps, alpha, exponent, count):
    s = funcamp.cosine_decay_schedule(init, steps, alpha, exponent)
    c = min(count, steps)
    expected = init * (
        (1 - alpha) * (0.5 * (1 + math.cos(math.pi * c / steps))) ** exponent + alpha
    )
    assert s(torch.tensor(count)).item() == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_cosine_matches_torch_cosine_annealing():
    lr, t_max, eta_min = 0.1, 20, 0.01
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max, eta_min=eta_min)
    ours = funcamp.cosine_decay_schedule(lr, t_max, alpha=eta_min / lr)
    for count in range(t_max + 1):
        assert ours(torch.tensor(count)).item() == pytest.approx(
            opt.param_groups[0]["lr"], rel=1e-6
        )
        opt.step()
        sched.step()


def test_linear_warmup_cosine_decay_shape():
    s = funcamp.linear_warmup_cosine_decay(1.0, 4, 12, init_value=0.2, end_value=0.1)
    v = [x.item() for x in _vals(s, 15)]
    assert v[0] == pytest.approx(0.2) and v[4] == pytest.approx(1.0)
    assert all(a < b for a, b in itertools.pairwise(v[:5]))  # warmup rises
    assert all(a > b for a, b in itertools.pairwise(v[4:13]))  # decay falls
    assert v[12:] == pytest.approx([0.1] * 3)
    assert v[8] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    no_warmup = funcamp.linear_warmup_cosine_decay(1.0, 0, 4)
    assert no_warmup(torch.tensor(0)).item() == pytest.approx(1.0)


def test_linear_warmup_cosine_decay_run_shorter_than_warmup():
    """nanoGPT's get_lr takes lr_decay_iters <= warmup_iters: the warmup, then the end value."""
    s = funcamp.linear_warmup_cosine_decay(1.0, 10, 4, end_value=0.1)
    v = [x.item() for x in _vals(s, 12)]
    assert v[:10] == pytest.approx([i / 10 for i in range(10)])
    assert v[10:] == pytest.approx([0.1, 0.1])
    s = funcamp.linear_warmup_cosine_decay(1.0, 10, 10, end_value=0.1)
    assert [x.item() for x in _vals(s, 12)][10:] == pytest.approx([0.1, 0.1])


def test_constant_schedule():
    assert [x.item() for x in _vals(funcamp.constant_schedule(0.25), 3)] == [0.25] * 3


def test_schedules_compile_without_recompiles_and_match_eager():
    s = funcamp.linear_warmup_cosine_decay(1e-3, 3, 20, end_value=1e-5)
    compiled = torch.compile(s, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for count in range(25):
            c = torch.tensor(count, dtype=torch.int32)
            assert torch.equal(compiled(c), s(c))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: funcamp.linear_schedule(1.0, 0.0, 0),
            r"`transition_steps` must be an int >= 1, got 0",
        ),
        (
            lambda: funcamp.linear_schedule(1.0, 0.0, 5, -1),
            r"`transition_begin` must be an int >= 0",
        ),
        (lambda: funcamp.cosine_decay_schedule(1.0, 0), r"cosine_decay_schedule: `decay_steps`"),
        (
            lambda: funcamp.cosine_decay_schedule(1.0, 5, alpha=-1),
            r"`alpha` must be a finite real number >= 0",
        ),
        (
            lambda: funcamp.linear_warmup_cosine_decay(1.0, 5, 0),
            r"`decay_steps` must be an int >= 1",
        ),
        (lambda: funcamp.constant_schedule(float("nan")), r"`value` must be a finite real"),
        (lambda: funcamp.linear_schedule(1.0, 0.0, 2.5), r"`transition_steps` must be an int"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# --------------------------------------------------------------------------------------------
# torch.optim.lr_scheduler's classes (funcamp.optim.<name>_lr)

LRS = torch.optim.lr_scheduler
FO = funcamp.optim


def _torch_lrs(make, n, lr=0.1, momentum=0.0):
    """torch's learning rate of each of ``n`` optimizer steps: ``get_last_lr()`` after ``t``
    calls of ``scheduler.step()`` (Python doubles)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum)
    scheds = make(opt)
    scheds = scheds if isinstance(scheds, list) else [scheds]
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        for s in scheds:
            s.step()
    return out


def _ours(schedule, n):
    return [schedule(torch.tensor(t, dtype=torch.int32)).item() for t in range(n)]


def _check(ours, theirs, exact=False):
    for t, (a, b) in enumerate(zip(ours, theirs)):
        if exact:
            assert a == b, (t, a, b)
        else:  # torch's chainable (recursive) forms drift by double ulps
            assert a == pytest.approx(b, rel=1e-12, abs=1e-15), (t, a, b)
            # rounded to float32 (what a step size sees), equal
            assert torch.tensor(a).float() == torch.tensor(b).float(), (t, a, b)


N = 400
CASES = {
    "step": (lambda o: LRS.StepLR(o, step_size=7, gamma=0.9), FO.step_lr(0.1, 7, 0.9)),
    "step_db": (lambda o: LRS.StepLR(o, step_size=10, gamma=0.9), FO.step_lr(0.1, 10, 0.9)),
    "multistep": (
        lambda o: LRS.MultiStepLR(o, milestones=[30, 5, 80, 80], gamma=0.3),
        FO.multi_step_lr(0.1, [30, 5, 80, 80], 0.3),
    ),
    "exponential": (lambda o: LRS.ExponentialLR(o, gamma=0.99), FO.exponential_lr(0.1, 0.99)),
    "cosine": (
        lambda o: LRS.CosineAnnealingLR(o, T_max=50, eta_min=0.001),
        FO.cosine_annealing_lr(0.1, 50, 0.001),
    ),
    "cosine_zero_min": (
        lambda o: LRS.CosineAnnealingLR(o, T_max=37),
        FO.cosine_annealing_lr(0.1, 37),
    ),
    "warm_restarts": (
        lambda o: LRS.CosineAnnealingWarmRestarts(o, T_0=10, T_mult=1, eta_min=0.01),
        FO.cosine_annealing_warm_restarts(0.1, 10, 1, 0.01),
    ),
    "warm_restarts_mult": (
        lambda o: LRS.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
        FO.cosine_annealing_warm_restarts(0.1, 3, 2),
    ),
    "linear": (
        lambda o: LRS.LinearLR(o, start_factor=0.4, end_factor=0.8, total_iters=40),
        FO.linear_lr(0.1, 0.4, 0.8, 40),
    ),
    "linear_db": (
        lambda o: LRS.LinearLR(o, start_factor=0.4, total_iters=4),
        FO.linear_lr(0.1, 0.4, 1.0, 4),
    ),
    "linear_default": (lambda o: LRS.LinearLR(o), FO.linear_lr(0.1)),
    "constant": (
        lambda o: LRS.ConstantLR(o, factor=0.4, total_iters=4),
        FO.constant_lr(0.1, 0.4, 4),
    ),
    "polynomial": (
        lambda o: LRS.PolynomialLR(o, power=0.9, total_iters=4),
        FO.polynomial_lr(0.1, 4, 0.9),
    ),
    "polynomial_long": (
        lambda o: LRS.PolynomialLR(o, power=2.0, total_iters=300),
        FO.polynomial_lr(0.1, 300, 2.0),
    ),
    "cyclic": (
        lambda o: LRS.CyclicLR(o, 0.01, 0.1, step_size_up=7, cycle_momentum=False),
        FO.cyclic_lr(0.01, 0.1, 7),
    ),
    "cyclic_tri2": (
        lambda o: LRS.CyclicLR(
            o,
            0.01,
            0.1,
            step_size_up=5,
            step_size_down=9,
            mode="triangular2",
            cycle_momentum=False,
        ),
        FO.cyclic_lr(0.01, 0.1, 5, 9, "triangular2"),
    ),
    "cyclic_exp": (
        lambda o: LRS.CyclicLR(
            o, 0.01, 0.1, step_size_up=4, mode="exp_range", gamma=0.99, cycle_momentum=False
        ),
        FO.cyclic_lr(0.01, 0.1, 4, mode="exp_range", gamma=0.99),
    ),
    "cyclic_scale_fn": (
        lambda o: LRS.CyclicLR(
            o,
            0.01,
            0.1,
            step_size_up=4,
            scale_fn=lambda x: 0.5**x,
            scale_mode="iterations",
            cycle_momentum=False,
        ),
        FO.cyclic_lr(0.01, 0.1, 4, scale_fn=lambda x: 0.5**x, scale_mode="iterations"),
    ),
    "one_cycle": (
        lambda o: LRS.OneCycleLR(o, max_lr=0.1, total_steps=N, cycle_momentum=False),
        FO.one_cycle_lr(0.1, N),
    ),
    "one_cycle_three_linear": (
        lambda o: LRS.OneCycleLR(
            o,
            max_lr=0.1,
            total_steps=N,
            pct_start=0.25,
            anneal_strategy="linear",
            three_phase=True,
            div_factor=10,
            final_div_factor=100,
            cycle_momentum=False,
        ),
        FO.one_cycle_lr(0.1, N, 0.25, "linear", 10, 100, three_phase=True),
    ),
    "lambda": (
        lambda o: LRS.LambdaLR(o, lambda t: 1 / (1 + 0.01 * t)),
        FO.lambda_lr(0.1, lambda t: 1 / (1 + 0.01 * t)),
    ),
    "multiplicative": (
        lambda o: LRS.MultiplicativeLR(o, lambda t: 0.999 if t % 3 else 0.95),
        FO.multiplicative_lr(0.1, lambda t: 0.999 if t % 3 else 0.95, N),
    ),
    "sequential": (
        lambda o: LRS.SequentialLR(
            o, [LRS.LinearLR(o, 0.1, total_iters=20), LRS.CosineAnnealingLR(o, T_max=300)], [20]
        ),
        FO.join_schedules(
            [FO.linear_lr(0.1, 0.1, total_iters=20), FO.cosine_annealing_lr(0.1, 300)], [20]
        ),
    ),
    "chained_db": (
        lambda o: [LRS.ConstantLR(o, factor=0.4, total_iters=4), LRS.ExponentialLR(o, gamma=0.9)],
        FO.chained_lr(FO.constant_lr(0.1, 0.4, 4), FO.exponential_lr(0.1, 0.9)),
    ),
    "chained_step_linear_db": (
        lambda o: [
            LRS.StepLR(o, gamma=0.9, step_size=10),
            LRS.LinearLR(o, start_factor=0.4, end_factor=0.6, total_iters=4),
        ],
        FO.chained_lr(FO.step_lr(0.1, 10, 0.9), FO.linear_lr(0.1, 0.4, 0.6, 4)),
    ),
    "chained_class": (
        lambda o: LRS.ChainedScheduler(
            [LRS.StepLR(o, gamma=0.99, step_size=10), LRS.ExponentialLR(o, gamma=0.99)]
        ),
        FO.chained_lr(FO.step_lr(0.1, 10, 0.99), FO.exponential_lr(0.1, 0.99)),
    ),
}
# closed forms torch also computes in closed form: equal bit for bit in double
EXACT = {"lambda", "multiplicative", "cyclic", "cyclic_tri2", "cyclic_exp", "cyclic_scale_fn",
         "one_cycle_three_linear", "warm_restarts", "warm_restarts_mult"}  # fmt: skip
# one_cycle: torch.cos (float64, CPU) and math.cos differ by an ulp at some points


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_torch_lr_scheduler(name):
    make, ours = CASES[name]
    _check(_ours(ours, N), _torch_lrs(make, N), exact=name in EXACT)


# --------------------------------------------------------------------------------------------
# ReduceLROnPlateau: funcamp.optim.reduce_on_plateau + plateau_step

METRICS = [5.0, 4.0, 4.0, 3.9999, 4.1, 4.2, 3.0, 3.0, 3.0, 3.0, 3.0, 2.0, float("nan"), 2.0,
           2.5, 2.5, 2.5, 2.5, 2.5, 2.5]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "make_inner", "torch_extra"),
    [
        ({"patience": 1}, lambda: FO.from_torch, None),
        (
            {
                "patience": 0,
                "factor": 0.5,
                "cooldown": 2,
                "threshold_mode": "abs",
                "threshold": 0.05,
                "min_lr": 0.02,
            },
            None,
            None,
        ),
        ({"mode": "max", "patience": 1, "factor": 0.3, "eps": 1e-3}, None, None),
        ({"patience": 1}, None, lambda o: LRS.ExponentialLR(o, gamma=0.9)),  # optim_db's pairing
    ],
)
def test_reduce_on_plateau_equals_torch(kwargs, make_inner, torch_extra):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    extra = torch_extra(torch_opt) if torch_extra else None
    plateau_ref = LRS.ReduceLROnPlateau(torch_opt, **kwargs)
    if make_inner is not None:  # through from_torch
        mirror = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        plateau = FO.from_torch(
            mirror, dict(model.named_parameters()), LRS.ReduceLROnPlateau(mirror, **kwargs)
        )
    else:
        lr = FO.exponential_lr(0.1, 0.9) if torch_extra else 0.1
        plateau = FO.reduce_on_plateau(funcamp.sgd(lr, momentum=0.9), **kwargs)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = plateau.init(params)
    for epoch, metric in enumerate(METRICS):
        for i in range(2):  # two steps an epoch
            assert FO.learning_rate(plateau, state).item() == pytest.approx(
                torch_opt.param_groups[0]["lr"], rel=1e-12
            )
            g = torch.Generator().manual_seed(10 * epoch + i)
            grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
            updates, state = plateau.update(grads, state, params)
            params = funcamp.apply_updates(params, updates)
            for k, p in ref.named_parameters():
                p.grad = grads[k].clone()
            torch_opt.step()
            if extra is not None:
                extra.step()
        state = FO.plateau_step(plateau, state, metric)
        plateau_ref.step(metric)
    assert float(state.scale) < 1.0  # it reduced
    for k, p in ref.named_parameters():
        torch.testing.assert_close(params[k], p.detach(), rtol=1e-5, atol=1e-6)


def test_plateau_step_compiles_without_recompiles():
    plateau = FO.reduce_on_plateau(funcamp.sgd(0.1), patience=1)
    state = plateau.init({"w": torch.zeros(2)})
    step = torch.compile(lambda s, v: FO.plateau_step(plateau, s, v), backend="eager")
    eager = state
    with torch._dynamo.config.patch(error_on_recompile=True):
        for m in (x for x in METRICS if not math.isnan(x)):  # dynamo guards a 0-d NaN input
            state = step(state, torch.tensor(m, dtype=torch.float64))
            eager = FO.plateau_step(plateau, eager, m)
    assert all(torch.equal(a, b) for a, b in zip(state[1:], eager[1:]))


def test_reduce_on_plateau_refuses():
    with pytest.raises(ValueError, match=r"funcamp.optim.reduce_on_plateau: `mode` must be"):
        FO.reduce_on_plateau(funcamp.sgd(0.1), mode="low")
    with pytest.raises(ValueError, match=r"must declare a learning rate"):
        FO.reduce_on_plateau(funcamp.clip_by_global_norm(1.0))
    with pytest.raises(TypeError, match=r"plateau_step: `optimizer` must be a funcamp"):
        FO.plateau_step(funcamp.sgd(0.1), (), 1.0)
    opt = FO.reduce_on_plateau(funcamp.adamw(0.1, fused=True))
    p = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"updates are new params"):
        opt.update(p, opt.init(p), p)


def test_torch_schedules_compile_without_recompiles_and_match_eager():
    """Traceable (no host sync): one graph per schedule over every count, equal to eager."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        for name, (_, schedule) in sorted(CASES.items()):
            torch._dynamo.reset()
            compiled = torch.compile(schedule, backend="aot_eager", fullgraph=True)
            for count in (0, 1, 7, 30, 399):
                c = torch.tensor(count, dtype=torch.int32)
                assert torch.equal(compiled(c), schedule(c)), (name, count)
