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


def test_outputs_are_float32_scalars():
    for s in (
        funcamp.constant_schedule(0.5),
        funcamp.linear_schedule(1.0, 0.0, 3),
        funcamp.cosine_decay_schedule(1.0, 3),
        funcamp.linear_warmup_cosine_decay(1.0, 1, 3),
    ):
        v = s(torch.tensor(2, dtype=torch.int32))
        assert v.dtype == torch.float32 and v.dim() == 0


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
            lambda: funcamp.linear_warmup_cosine_decay(1.0, 5, 5),
            r"`decay_steps` must be an int >= 6",
        ),
        (lambda: funcamp.constant_schedule(float("nan")), r"`value` must be a finite real"),
        (lambda: funcamp.linear_schedule(1.0, 0.0, 2.5), r"`transition_steps` must be an int"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
