"""What a compiled step reads besides its inputs -- a global, a closure cell, a module attribute
-- is never silently frozen: by default a change recompiles the step (torch.compile's guards);
``specialize=True`` is the explicit, documented JAX-style choice that fixes them at the first
call. The same for the eval step and for a step kept on disk (``cache_dir``)."""

from __future__ import annotations

import logging

import pytest
import torch

import funcamp
from funcamp.stepcache.key import cache_support

SCALE = 1.0

torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
MODEL.loss_weight = 1.0
BATCH = (torch.randn(16, 4), torch.randn(16, 1))


def _loss_fn(params, buffers, batch):
    x, y = batch
    out = torch.func.functional_call(MODEL, (params, buffers), (x,))
    return torch.nn.functional.mse_loss(out, y) * SCALE * MODEL.loss_weight


def _losses(step, changes):
    """The loss after each change (from SCALE = loss_weight = 1): ``changes`` are callables
    run before each step."""
    _set_scale(1.0)()
    _set_weight(1.0)()
    params, buffers = funcamp.params_and_buffers(MODEL)
    state = funcamp.TrainState.create(params, funcamp.sgd(0.0), "float32", buffers=buffers)
    out = []
    for change in changes:
        change()
        state, metrics = step(state, BATCH)
        out.append(float(metrics["loss"]))
    return out


@pytest.fixture
def restore():
    global SCALE
    yield
    SCALE = 1.0
    MODEL.loss_weight = 1.0


def _set_scale(v):
    def run():
        global SCALE
        SCALE = v

    return run


def _set_weight(v):
    def run():
        MODEL.loss_weight = v

    return run


CHANGES = [lambda: None, _set_scale(10.0), _set_weight(3.0)]


def _make(**compile_options):
    opt = funcamp.sgd(0.0)  # lr 0: the params never move, so only the factors change the loss
    return funcamp.make_train_step(
        _loss_fn,
        opt,
        "float32",
        donate_state=False,
        compile=funcamp.Compile(backend="aot_eager", **compile_options),
    )


def test_a_changed_global_or_module_attribute_recompiles_the_step(restore):
    eager = _losses(
        funcamp.make_train_step(_loss_fn, funcamp.sgd(0.0), "float32", compile=False), CHANGES
    )
    assert eager[1] == pytest.approx(10 * eager[0]) and eager[2] == pytest.approx(30 * eager[0])
    assert _losses(_make(), CHANGES) == pytest.approx(eager, rel=1e-6)


def test_specialize_fixes_them_at_the_first_call(restore):
    """The explicit JAX-style option: the first call's values stay (documented)."""
    frozen = _losses(_make(specialize=True), CHANGES)
    assert frozen == pytest.approx([frozen[0]] * 3, rel=1e-6)


def test_a_changed_closure_cell_recompiles():
    weight = [1.0]

    def make_loss(w):
        def loss(params, buffers, batch):
            return _loss_fn(params, buffers, batch) * w[0]

        return loss

    loss = make_loss(weight)
    step = funcamp.make_train_step(
        loss,
        funcamp.sgd(0.0),
        "float32",
        donate_state=False,
        compile=funcamp.Compile(backend="aot_eager"),
    )
    params, buffers = funcamp.params_and_buffers(MODEL)
    state = funcamp.TrainState.create(params, funcamp.sgd(0.0), "float32", buffers=buffers)
    _, a = step(state, BATCH)
    weight[0] = 2.0
    _, b = step(state, BATCH)
    assert float(b["loss"]) == pytest.approx(2 * float(a["loss"]), rel=1e-6)


def test_the_eval_step_too(restore):
    def fn(params, buffers, batch):
        return _loss_fn(params, buffers, batch)

    params, buffers = funcamp.params_and_buffers(MODEL)
    state = funcamp.TrainState.create(params, funcamp.sgd(0.0), "float32", buffers=buffers)
    follows = funcamp.make_eval_step(fn, "float32", compile=funcamp.Compile(backend="aot_eager"))
    fixed = funcamp.make_eval_step(
        fn, "float32", compile=funcamp.Compile(backend="aot_eager", specialize=True)
    )
    a, fa = float(follows(state, BATCH)), float(fixed(state, BATCH))
    _set_scale(4.0)()
    assert float(follows(state, BATCH)) == pytest.approx(4 * a, rel=1e-6)
    assert float(fixed(state, BATCH)) == pytest.approx(fa, rel=1e-6)


def test_specialize_is_checked():
    opt = funcamp.sgd(0.1)
    with pytest.raises(ValueError, match=r"give `specialize=True` or a `guard_filter_fn`"):
        funcamp.make_train_step(
            _loss_fn,
            opt,
            "float32",
            compile=funcamp.Compile(specialize=True, guard_filter_fn=lambda g: g),
        )
    with pytest.raises(TypeError, match=r"`specialize` must be a bool"):
        funcamp.make_train_step(_loss_fn, opt, "float32", compile=funcamp.Compile(specialize="yes"))


@pytest.mark.skipif(cache_support() is not None, reason=f"no AOT precompile: {cache_support()}")
def test_a_step_loaded_from_cache_dir_sees_the_change(restore, tmp_path, caplog):
    """The saved step checks what it is specialised on at every call (unless specialize=True):
    a global that changes after the first call compiles the step again, and says why."""
    with caplog.at_level(logging.INFO, logger="funcamp"):
        follows = _losses(_make(cache_dir=tmp_path), CHANGES)
    eager = _losses(
        funcamp.make_train_step(_loss_fn, funcamp.sgd(0.0), "float32", compile=False), CHANGES
    )
    assert follows == pytest.approx(eager, rel=1e-6)
    said = [r.getMessage() for r in caplog.records if "compiles again" in r.getMessage()]
    assert any("SCALE" in m for m in said), said
    frozen = _losses(_make(cache_dir=tmp_path, specialize=True), CHANGES)
    assert frozen == pytest.approx([frozen[0]] * 3, rel=1e-6)
