"""search_policy: finds the modules that must stay float32, measures honestly, costs what it
says, is deterministic. Tiny models: float16 matmuls are slow on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from amp_zoo import one_thread  # noqa: F401 (autouse fixture)
from torch import nn
from torch.func import functional_call

import funcamp
from funcamp import OpRule

F16, F32 = torch.float16, torch.float32


def _gain_model(gain: float = 1e6) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)
    )
    with torch.no_grad():
        model[2].weight.mul_(gain)  # activations past float16's 65504
    return model


def _loss(model: nn.Module):
    def loss(p, x, y):
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    return loss


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.rand(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)


def _errors(loss, params, policy, x, y, scale):
    """Independent measurement: relative loss and gradient errors of ``policy`` vs float32."""

    def run(fn, p):
        def scaled(q):
            out = fn(q, x, y).float()
            return out * scale, out.detach()

        grads, value = torch.func.grad(scaled, has_aux=True)(p)
        return value, torch.cat([g.reshape(-1).float() / scale for g in grads.values()])

    ref_loss, ref_g = run(loss, params)
    got_loss, got_g = run(funcamp.amp(loss, policy), params)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    return rel(got_loss.reshape(1), ref_loss.reshape(1)), rel(got_g, ref_g)


def test_keeps_the_overflowing_module_in_float32() -> None:
    model = _gain_model()
    params = dict(model.named_parameters())
    loss = _loss(model)
    x, y = _batch()
    assert not torch.isfinite(funcamp.amp(loss, "mixed_float16")(params, x, y))  # it NaNs

    policy, report = funcamp.search_policy(loss, params, x, y)
    assert report.unsafe == ["2"]
    assert [d.candidate for d in report.decisions] == ["0", "2", "4"]  # what the trace saw
    assert [d.precision for d in report.decisions] == ["compute", "float32", "compute"]
    assert math.isinf(report.decisions[1].loss_error)  # alone in float16 it overflows
    assert report.within_tolerance and report.base_loss_error == math.inf
    assert len(policy.module_policies) == 1
    key, sub = policy.module_policies[0]
    assert key == "2" and sub.compute_dtype == F32 and sub.output_dtype == F32
    assert str(policy) == (
        "params=float32,compute=float16,output=float32,"
        "module:2=(params=float32,compute=float32,output=float32)"
    )
    # cost: reference, base, 3 alone, the 2 passing together = 6 (<= 2n + 2), one trace
    assert report.runs == 6 and report.traced == 1
    # the reported errors are what an independent measurement finds
    loss_err, grad_err = _errors(loss, params, policy, x, y, report.loss_scale)
    assert loss_err == pytest.approx(report.loss_error, rel=1e-6, abs=1e-12)
    assert grad_err == pytest.approx(report.grad_error, rel=1e-6, abs=1e-12)
    assert max(loss_err, grad_err) <= 1e-2
    # and the policy really runs module "2" in float32, the others in float16
    t = funcamp.trace(loss, policy)(params, x, y)
    dtypes = {r.module: r.output_dtypes[0] for r in t if r.op == "linear"}
    assert dtypes == {"0": F16, "2": F32, "4": F16}
    text = str(report)
    assert "1 of 3 candidates in float32" in text and "over tolerance alone" in text


def test_deterministic_and_rng_untouched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    params = dict(model.named_parameters())
    x, y = _batch()
    state = torch.get_rng_state()
    first = funcamp.search_policy(_loss(model), params, x, y, tolerance=1e-5)
    assert torch.equal(torch.get_rng_state(), state)
    second = funcamp.search_policy(_loss(model), params, x, y, tolerance=1e-5)
    assert first[0] == second[0]
    assert first[1] == second[1]  # every measured error identical, dropout included


def test_base_within_tolerance_costs_two_runs() -> None:
    model = _gain_model(gain=1.0)
    params = dict(model.named_parameters())
    policy, report = funcamp.search_policy(_loss(model), params, *_batch(), tolerance=0.05)
    assert policy == funcamp.get_policy("mixed_float16")
    assert report.runs == 2 and report.unsafe == [] and report.within_tolerance
    assert all(math.isnan(d.loss_error) for d in report.decisions)
    assert report.loss_error == report.base_loss_error <= 0.05


def test_tolerance_zero_puts_everything_in_float32() -> None:
    """Nothing in float16 is exact: every candidate fails alone; with all of them in float32
    only the float32 ops remain, which is exact."""
    model = _gain_model(gain=1.0)
    params = dict(model.named_parameters())
    policy, report = funcamp.search_policy(_loss(model), params, *_batch(), tolerance=0.0)
    assert report.unsafe == ["0", "2", "4"] and len(policy.module_policies) == 3
    assert report.within_tolerance and report.loss_error == 0.0 and report.grad_error == 0.0
    # reference, base, 3 alone, the empty set = 6
    assert report.runs == 6


def test_greedy_when_passing_alone_is_not_passing_together() -> None:
    """Each linear alone in float16 is within the tolerance, all three together are not: the
    greedy step keeps them from the smallest error up while the policy stays within it."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )
    params = dict(model.named_parameters())
    loss, (x, y) = _loss(model), _batch()
    _, strict = funcamp.search_policy(loss, params, x, y, tolerance=0.0)
    alone = {d.candidate: max(d.loss_error, d.grad_error) for d in strict.decisions}
    tol = max(alone.values())
    assert max(strict.base_loss_error, strict.base_grad_error) > tol  # deterministic setup
    policy, report = funcamp.search_policy(loss, params, x, y, tolerance=tol)
    assert report.within_tolerance and max(report.loss_error, report.grad_error) <= tol
    kept = [d.candidate for d in report.decisions if d.precision == "compute"]
    smallest = min(alone, key=alone.get)
    assert smallest in kept and 0 < len(report.unsafe) < 3
    assert any("not with the ones kept" in d.reason for d in report.decisions)
    # reference, base (= all passing), 3 alone, then one new greedy trial: {smallest, second}
    assert report.runs == 6
    assert max(_errors(loss, params, policy, x, y, report.loss_scale)) <= tol


def test_class_candidates_and_bfloat16_base() -> None:
    model = _gain_model()
    params = dict(model.named_parameters())
    loss, (x, y) = _loss(model), _batch()
    policy, report = funcamp.search_policy(loss, params, x, y, candidates=[nn.Linear, nn.LayerNorm])
    assert report.traced == 0 and report.loss_scale > 1  # float16: a scale from the headroom
    assert report.unsafe == [nn.Linear]  # the norm is fine once every Linear is float32
    assert [k for k, _ in policy.module_policies] == [nn.Linear]
    assert report.within_tolerance
    # bfloat16 has float32's range: nothing overflows, the base passes (with bfloat16's 8-bit
    # significand the gradients are off by about 1.6% here), unscaled
    policy, report = funcamp.search_policy(
        loss, params, x, y, base="mixed_bfloat16", tolerance=0.05
    )
    assert report.loss_scale == 1.0 and report.unsafe == [] and report.runs == 2
    assert policy == funcamp.get_policy("mixed_bfloat16")


def test_nested_candidate_stays_in_compute_under_a_float32_parent() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            h = self.inner(x)
            logits = h @ h.T * 1e5  # an unnormalized logit path in the block itself
            return torch.softmax(logits, -1) @ h

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.block(x))

    torch.manual_seed(0)
    model = Net()
    params = dict(model.named_parameters())
    loss = _loss(model)
    x, y = _batch()
    policy, report = funcamp.search_policy(loss, params, x, y)
    assert [d.candidate for d in report.decisions] == ["block.inner", "block", "head"]
    assert report.unsafe == ["block"] and report.within_tolerance
    t = funcamp.trace(loss, policy)(params, x, y)
    seen = {(r.module, r.op): r.output_dtypes[0] for r in t if r.rule is OpRule.COMPUTE}
    assert seen[("block.inner", "linear")] == F16  # explicitly kept in compute
    assert seen[("block", "matmul")] == F32
    assert seen[("head", "linear")] == F16


def test_errors() -> None:
    model = _gain_model(gain=1.0)
    params = dict(model.named_parameters())
    loss, (x, y) = _loss(model), _batch()
    with pytest.raises(ValueError, match=r"funcamp.search_policy: `tolerance` must be a finite"):
        funcamp.search_policy(loss, params, x, y, tolerance=-1.0)
    with pytest.raises(TypeError, match=r"funcamp.search_policy: `candidates` must be a list"):
        funcamp.search_policy(loss, params, x, y, candidates="0")
    with pytest.raises(ValueError, match=r"`candidates` lists '0' twice"):
        funcamp.search_policy(loss, params, x, y, candidates=["0", "0"])
    with pytest.raises(TypeError, match=r"funcamp.search_policy: `params` leaf .* floating"):
        funcamp.search_policy(loss, {**params, "n": torch.tensor(1)}, x, y)
    with pytest.raises(TypeError, match=r"funcamp.search_policy: `fn` must be callable"):
        funcamp.search_policy(None, params, x, y)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"the float32 loss or gradients are not finite"):
        funcamp.search_policy(lambda p, x, y: loss(p, x, y) * math.inf, params, x, y)
    with pytest.raises(TypeError, match=r"`loss_fn` must return a 0-d floating tensor"):
        funcamp.search_policy(lambda p, x, y: (loss(p, x, y),), params, x, y)
