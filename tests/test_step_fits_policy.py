"""A train step refuses, on its first call, a state built for another policy: params in another
dtype, or no loss scaler where the policy computes in float16. The message names both."""

from __future__ import annotations

import pytest
import torch

import funcamp
import funcamp.train.state


def _loss(params, buffers, batch):
    return (params["w"].float() * batch).sum()


def _step(policy, **kwargs):
    opt = funcamp.sgd(0.1)
    return opt, funcamp.make_train_step(_loss, opt, policy, compile=False, **kwargs)


def test_a_bf16_true_step_refuses_a_float32_state():
    opt, step = _step("bf16-true")
    state = funcamp.TrainState.create({"w": torch.ones(3)}, opt, "float32")
    with pytest.raises(
        ValueError,
        match=r"policy 'params=bfloat16,compute=bfloat16,output=bfloat16' keeps params in "
        r"torch.bfloat16, but state.params\['w'\] is torch.float32",
    ):
        step(state, torch.ones(3))
    assert torch.equal(state.params["w"], torch.ones(3))  # refused before any write


def test_a_float16_step_refuses_a_state_without_a_loss_scaler():
    opt, step = _step("mixed_float16")
    state = funcamp.TrainState.create({"w": torch.ones(3)}, opt, "float32")
    assert state.scaler.kind == "noop"
    with pytest.raises(
        ValueError,
        match=r"policy 'params=float32,compute=float16,output=float32' runs in float16 and "
        r"needs a loss scaler .* but state.scaler is a 'noop' one",
    ):
        step(state, torch.ones(3))


@pytest.mark.parametrize(
    ("state_policy", "step_policy", "scaler"),
    [
        ("mixed_float16", "mixed_float16", None),
        ("float32", "mixed_float16", funcamp.ScalerState.static(8.0)),  # a scaler given
        ("float32", "bf16-mixed", None),  # float32 params: what bf16-mixed keeps
        ("bf16-mixed", "float32", funcamp.ScalerState.dynamic()),  # a scaler more than needed
        ("bf16-true", "bf16-true", None),
        ("16-true", "16-true", None),
    ],
)
def test_states_that_fit_are_accepted(state_policy, step_policy, scaler):
    opt, step = _step(step_policy, donate_state=False)
    state = funcamp.TrainState.create({"w": torch.ones(3)}, opt, state_policy, scaler=scaler)
    step(state, torch.ones(3))


def test_frozen_params_are_not_refused():
    opt, step = _step("bf16-true", donate_state=False)
    params = {"w": torch.ones(3), "e": torch.ones(2)}
    state = funcamp.TrainState.create(params, opt, "bf16-true", trainable=lambda p: p != "e")
    state = state._replace(frozen={"e": torch.ones(2)})  # a float32 frozen param: not trained
    step(state, torch.ones(3))


def test_the_check_runs_on_the_first_call_only(monkeypatch):
    calls = []
    real = funcamp.train.state.check_fits_policy
    monkeypatch.setattr(
        funcamp.train.state, "check_fits_policy", lambda *a: calls.append(1) or real(*a)
    )
    opt, step = _step("mixed_float16")
    state = funcamp.TrainState.create({"w": torch.ones(3)}, opt, "mixed_float16")
    for _ in range(3):
        state, _ = step(state, torch.ones(3))
    assert len(calls) == 1
