"""Differential tests: funcamp's loss scaling against a real ``torch.amp.GradScaler("cpu")``."""

from __future__ import annotations

import math

import optree
import pytest
import torch
import torch.nn.functional as F
from bitwise import same_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import funcamp

#: The optree namespace funcamp documents for its state types (docs/concepts.md).
NAMESPACE = "funcamp"

LR = 0.05
F32_MAX = torch.finfo(torch.float32).max


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # The model is tiny: with a shared, busy CPU, intra-op threads only add barrier waits
    # (milliseconds per float16 matmul). Restore the setting for the rest of the suite.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


init_scales = st.one_of(
    st.integers(-20, 127).map(lambda k: 2.0**k),
    st.floats(1e-4, 1e30, allow_nan=False, allow_infinity=False),
    st.sampled_from([2.0**127, 3.0e38, F32_MAX, 1.5 * 2.0**126]),
)
growth_factors = st.one_of(
    st.sampled_from([2.0, 1.0001, 1.5, 4.0]),
    st.floats(1.0001, 8.0, allow_nan=False, allow_infinity=False),
)
backoff_factors = st.one_of(
    st.sampled_from([0.5, 0.9, 0.25]),
    st.floats(0.01, 0.99, allow_nan=False, allow_infinity=False),
)
injections = st.sampled_from([None, None, None, math.inf, -math.inf, math.nan])


class GradScalerMachine(RuleBasedStateMachine):
    """A tiny float16-autocast model trained side by side by torch and by funcamp.

    Torch runs scale -> backward -> (inject) -> unscale_ -> step -> update; funcamp gets the same
    scaled gradients and runs unscale_and_step -> update on its own copy of the params.
    """

    @initialize(
        init_scale=init_scales,
        growth_factor=growth_factors,
        backoff_factor=backoff_factors,
        growth_interval=st.integers(1, 10),
        seed=st.integers(0, 2**16),
    )
    def setup(self, init_scale, growth_factor, backoff_factor, growth_interval, seed):
        gen = torch.Generator().manual_seed(seed)
        self.model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.x = torch.randn(4, 3, generator=gen)
        self.y = torch.randn(4, 2, generator=gen)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.gs = torch.amp.GradScaler(
            "cpu",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
        self.state = funcamp.ScalerState.dynamic(
            init_scale, growth_factor, backoff_factor, growth_interval
        )
        self.params = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        self.sgd = funcamp.sgd(LR)
        self.opt_state = self.sgd.init(self.params)
        self.skipped = 0

    @rule(
        inject=injections,
        leaf=st.sampled_from(["weight", "bias"]),
        pos=st.integers(0, 5),
        zero_loss=st.booleans(),
    )
    def step(self, inject, leaf, pos, zero_loss):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = self.model(self.x)
            loss = F.mse_loss(out, self.y)
        if zero_loss:
            # Zero gradients never overflow: lets scales near the float32 max reach a growth
            # step, where torch refuses a non-finite grown scale.
            loss = loss * 0.0
        assert out.dtype == torch.float16
        scaled = self.gs.scale(loss)
        ours_scaled = funcamp.scale(self.state, loss.detach())
        assert same_bits(scaled.detach(), ours_scaled)
        scaled.backward()
        grads = dict(self.model.named_parameters())
        if inject is not None:
            g = grads[leaf].grad
            g.view(-1)[pos % g.numel()] = inject
        ours_grads = {k: p.grad.detach().clone() for k, p in grads.items()}

        self.gs.unscale_(self.opt)
        found = self.gs._per_optimizer_states[id(self.opt)]["found_inf_per_device"]
        torch_found = bool(sum(v.item() for v in found.values()))
        unscaled, _ = funcamp.unscale(self.state, ours_grads)
        for k, p in grads.items():
            assert torch.equal(unscaled[k].nan_to_num(), p.grad.nan_to_num())
        self.gs.step(self.opt)
        self.gs.update()

        self.params, self.opt_state, info = funcamp.unscale_and_step(
            self.state, self.sgd, ours_grads, self.opt_state, self.params
        )
        self.state = funcamp.update(self.state, info.found_inf)
        self.skipped += torch_found
        assert bool(info.found_inf) == torch_found

    @invariant()
    def scaler_matches(self):
        if not hasattr(self, "gs") or self.gs._scale is None:
            return
        assert same_bits(self.state.scale, self.gs._scale)
        assert same_bits(self.state.growth_tracker, self.gs._growth_tracker)
        assert int(self.state.skipped) == self.skipped
        for k, p in self.model.named_parameters():
            torch.testing.assert_close(self.params[k], p.detach(), rtol=1e-5, atol=1e-7)


TestGradScalerMachine = GradScalerMachine.TestCase
TestGradScalerMachine.pytestmark = [pytest.mark.slow]  # a long stateful run
TestGradScalerMachine.settings = settings(
    max_examples=200,
    stateful_step_count=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_own_grads_through_func_grad_match_torch():
    """funcamp computing its own scaled grads with torch.func.grad under float16 autocast follows
    GradScaler step for step (inf injected at fixed steps)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    state = funcamp.ScalerState.dynamic(2.0**10, growth_interval=3)
    sgd = funcamp.sgd(LR)
    opt_state = sgd.init(params)

    def scaled_loss(p, scaler):
        with torch.autocast("cpu", dtype=torch.float16):
            out = torch.func.functional_call(model, p, (x,))
            loss = F.mse_loss(out, y)
        return funcamp.scale(scaler, loss)

    for i in range(10):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        gs.scale(loss).backward()
        grads = torch.func.grad(scaled_loss)(params, state)
        if i in (2, 6):
            model.weight.grad[0, 0] = math.inf
            grads["weight"] = (
                grads["weight"]
                .clone()
                .index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(math.inf))
            )
        gs.unscale_(opt)
        gs.step(opt)
        gs.update()
        params, opt_state, info = funcamp.unscale_and_step(state, sgd, grads, opt_state, params)
        state = funcamp.update(state, info.found_inf)
        assert bool(info.found_inf) == (i in (2, 6))
        assert same_bits(state.scale, gs._scale)
        assert same_bits(state.growth_tracker, gs._growth_tracker)
        for k, p in model.named_parameters():
            torch.testing.assert_close(params[k], p.detach(), rtol=1e-5, atol=1e-7)
    assert int(state.skipped) == 2


def test_update_matches_notes_reference_trace():
    """The reference GradScaler trace in NOTES.md (init 2**16, interval 3, inf on steps 2, 7)."""
    expected = [
        (65536, 1),
        (32768, 0),
        (32768, 1),
        (32768, 2),
        (65536, 0),
        (65536, 1),
        (32768, 0),
        (32768, 1),
        (32768, 2),
        (65536, 0),
        (65536, 1),
        (65536, 2),
    ]
    state = funcamp.ScalerState.dynamic(2.0**16, growth_interval=3)
    for step, (scale, tracker) in enumerate(expected, start=1):
        state = funcamp.update(state, torch.tensor(step in (2, 7)))
        assert (float(state.scale), int(state.growth_tracker)) == (scale, tracker)


@settings(max_examples=150, deadline=None)
@given(
    init=init_scales,
    growth=growth_factors,
    backoff=backoff_factors,
    interval=st.integers(1, 10),
    flags=st.lists(st.booleans(), min_size=1, max_size=30),
)
def test_update_bit_identical_to_kernel(init, growth, backoff, interval, flags):
    """Eagerly update runs torch's kernel itself (on copies); under a transform (here vmap over
    a batch of one flag, as under torch.compile) it runs pure ops: both follow the kernel bit for
    bit, and the hysteresis tracker keeps its bookkeeping (0 after an overflow, 1 again when the
    scale grows)."""
    state = funcamp.ScalerState.dynamic(init, growth, backoff, interval)
    traced = state
    vupdate = torch.func.vmap(funcamp.update, in_dims=(None, 0))
    s, t = state.scale.clone(), state.growth_tracker.clone()
    h = 1
    for flag in flags:
        grew = not flag and int(t) + 1 == interval
        torch._amp_update_scale_(s, t, torch.tensor(float(flag)), growth, backoff, interval)
        h = 0 if flag else (1 if grew else h)
        state = funcamp.update(state, torch.tensor(flag))
        traced = optree.tree_map(
            lambda x: x[0], vupdate(traced, torch.tensor([flag])), namespace=NAMESPACE
        )
        for got in (state, traced):
            assert same_bits(got.scale, s)
            assert same_bits(got.growth_tracker, t)
            assert int(got.hysteresis_tracker) == h
