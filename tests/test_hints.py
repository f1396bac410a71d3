"""Errors that name the fix: a torch.optim optimizer where a funcamp one is needed."""

from __future__ import annotations

import logging

import pytest
import torch

import funcamp
from funcamp._core.progress import COMPILING


def _loss(params, buffers, batch):
    return (params["w"] * batch).sum()


def _model():
    return torch.nn.Linear(3, 2)


@pytest.mark.parametrize("api", ["make_train_step", "TrainState.create"])
def test_torch_adamw_names_funcamp_adamw_with_its_values(api):
    opt = torch.optim.AdamW(
        _model().parameters(), lr=3e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1
    )
    with pytest.raises(TypeError) as info:
        if api == "make_train_step":
            funcamp.make_train_step(_loss, opt, "bf16-mixed", donate_state=False)
        else:
            funcamp.TrainState.create({"w": torch.ones(2)}, opt, "bf16-mixed")
    msg = str(info.value)
    assert msg.startswith(f"funcamp.{api}: `optimizer` must be a funcamp.Optimizer")
    assert "got a torch.optim.AdamW" in msg
    assert "funcamp.adamw(0.0003, b1=0.8, b2=0.95, eps=1e-06, weight_decay=0.1)" in msg
    assert "funcamp.adamw(lr, b1, b2, eps, weight_decay)" in msg
    assert "\n" not in msg and "Parameter Group" not in msg  # not the optimizer's repr
    # and the named call is a working equivalent
    assert isinstance(
        funcamp.adamw(0.0003, b1=0.8, b2=0.95, eps=1e-06, weight_decay=0.1), funcamp.Optimizer
    )


def test_torch_adam_and_sgd_are_mapped():
    params = list(_model().parameters())
    with pytest.raises(
        TypeError, match=r"funcamp.adam\(0.01, b1=0.9, b2=0.999, eps=1e-08, weight_decay=0.001\)"
    ):
        funcamp.make_train_step(
            _loss,
            torch.optim.Adam(params, lr=0.01, weight_decay=1e-3),
            "float32",
            donate_state=False,
        )
    with pytest.raises(TypeError, match=r"amsgrad=True has no funcamp equivalent"):
        funcamp.make_train_step(
            _loss, torch.optim.Adam(params, amsgrad=True), "float32", donate_state=False
        )
    decoupled = torch.optim.Adam(params, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)
    with pytest.raises(TypeError, match=r"funcamp.adamw\(0.01, "):
        funcamp.make_train_step(_loss, decoupled, "float32", donate_state=False)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    with pytest.raises(
        TypeError,
        match=r"funcamp.sgd\(0.1, momentum=0.9, nesterov=True, weight_decay=0.0001, dampening=0\)",
    ):
        funcamp.make_train_step(_loss, sgd, "float32", donate_state=False)


def test_param_groups_and_unsupported_optimizers():
    m = _model()
    groups = [{"params": [m.weight], "lr": 0.1}, {"params": [m.bias], "lr": 0.01}]
    with pytest.raises(TypeError, match=r"funcamp.sgd\(0.1, .*it has 2 param groups"):
        funcamp.make_train_step(
            _loss, torch.optim.SGD(groups, lr=1.0), "float32", donate_state=False
        )
    with pytest.raises(
        TypeError, match=r"got a torch.optim.RMSprop; funcamp has no RMSprop: use funcamp.sgd"
    ):
        funcamp.make_train_step(
            _loss, torch.optim.RMSprop(m.parameters()), "float32", donate_state=False
        )
    with pytest.raises(
        TypeError,
        match=r"`optimizer` must be a funcamp.Optimizer \(e.g. funcamp.adamw\(1e-3\)\), got str",
    ):
        funcamp.make_train_step(_loss, "adamw", "float32", donate_state=False)


def test_first_compiled_call_says_it_compiles(caplog):
    step = funcamp.make_train_step(
        _loss,
        funcamp.sgd(0.1),
        "float32",
        compile=funcamp.Compile(backend="eager"),
        donate_state=False,
    )
    state = funcamp.TrainState.create({"w": torch.ones(2)}, funcamp.sgd(0.1), "float32")
    with caplog.at_level(logging.INFO, logger="funcamp"):
        state, _ = step(state, torch.ones(2))
        first = [r.getMessage() for r in caplog.records if r.name == "funcamp"]
        caplog.clear()
        state, _ = step(state, torch.ones(2))
        second = [r.getMessage() for r in caplog.records if r.name == "funcamp"]
    assert len(first) == 2
    assert first[0] == COMPILING
    assert first[1].startswith("funcamp: compiled the train step in ")
    assert second == []


def test_eager_step_logs_nothing(caplog):
    step = funcamp.make_train_step(
        _loss, funcamp.sgd(0.1), "float32", compile=False, donate_state=False
    )
    state = funcamp.TrainState.create({"w": torch.ones(2)}, funcamp.sgd(0.1), "float32")
    with caplog.at_level(logging.INFO, logger="funcamp"):
        step(state, torch.ones(2))
    assert [r for r in caplog.records if r.name == "funcamp"] == []
