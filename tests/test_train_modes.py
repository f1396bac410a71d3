"""A compiled train step follows the modules' ``train()`` / ``eval()`` mode as the eager step does.

The model has both kinds of mode-dependent layer: ``Dropout`` (random in training, the identity in
evaluation) and ``BatchNorm1d`` (batch statistics and running-stat updates in training, the
running statistics in evaluation). Each step is checked against the eager step run from the same
state with the same seed, in both directions (train -> eval -> train and eval -> train -> eval),
for the plain compiled step, the step kept on disk (``cache_dir``), the data-parallel step
(``group``) and the sharded step (``mesh``). ``aot_eager`` draws dropout's random numbers as eager
does, so there the whole state is compared bit for bit; inductor draws its own, so there the
evaluation steps (no randomness) and the running statistics (taken before the dropout) are.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from exhaustive import exhaustive
from torch._dynamo.utils import counters
from torch.func import functional_call

import funcamp
import funcamp.distributed as fd
from tests.bitwise import assert_bitwise

TRAIN_EVAL = ("train", "eval", "train", "eval")
EVAL_TRAIN = ("eval", "train", "eval", "train")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1)
    )


def _loss(model: nn.Module):
    def loss_fn(params, buffers, batch):
        x, y = batch
        return nn.functional.mse_loss(functional_call(model, (params, buffers), (x,)), y)

    return loss_fn


OPT = funcamp.sgd(0.1)


def _state(model: nn.Module) -> funcamp.TrainState:
    params, buffers = funcamp.params_and_buffers(model)
    params = {k: v.clone() for k, v in params.items()}
    buffers = {k: v.clone() for k, v in buffers.items()}
    return funcamp.TrainState.create(params, OPT, "float32", buffers=buffers)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def _run(model, step, state, modes):
    """One step per mode, each from a fixed seed; ``(states, losses)`` after each step."""
    states, losses = [], []
    for i, mode in enumerate(modes):
        getattr(model, mode)()
        torch.manual_seed(100 + i)
        state, metrics = step(state, _batch(i))
        states.append(state)
        losses.append(metrics["loss"])
    return states, losses


def _check_modes(model, states, losses, modes, start):
    """What the mode means, whatever the step: an evaluation step leaves the running statistics
    as they were, a training step moves them."""
    before = start
    for state, mode in zip(states, modes):
        moved = not torch.equal(state.buffers["1.running_mean"], before.buffers["1.running_mean"])
        assert moved == (mode == "train"), mode
        before = state


@pytest.mark.slow
@pytest.mark.parametrize(
    "modes",
    # eval first: in the suite through test_data_parallel_step_follows_the_mode
    [TRAIN_EVAL, pytest.param(EVAL_TRAIN, marks=exhaustive)],
    ids=["train-first", "eval-first"],
)
def test_compiled_step_follows_the_mode_bit_for_bit(modes):
    model = _model()
    loss_fn = _loss(model)
    eager = funcamp.make_train_step(loss_fn, OPT, "float32", compile=False, donate_state=False)
    compiled = funcamp.make_train_step(
        loss_fn, OPT, "float32", compile=funcamp.Compile(backend="aot_eager"), donate_state=False
    )
    want_states, want = _run(model, eager, _state(model), modes)
    counters.clear()
    got_states, got = _run(model, compiled, _state(model), modes * 2)
    # one graph per mode; switching back selects the graph already compiled
    assert counters["stats"]["unique_graphs"] == 2
    assert_bitwise(funcamp.state_dict(got_states[3]), funcamp.state_dict(want_states[3]))
    assert [float(x) for x in got[:4]] == [float(x) for x in want]
    _check_modes(model, got_states, got, modes * 2, _state(model))


@pytest.mark.slow
def test_inductor_step_follows_the_mode():
    """The default backend: evaluation losses equal eager's, running statistics move only in
    training (and as eager moves them); a training loss differs from the evaluation loss of the
    same batch (dropout is on)."""
    model = _model()
    loss_fn = _loss(model)
    eager = funcamp.make_train_step(loss_fn, OPT, "float32", compile=False, donate_state=False)
    compiled = funcamp.make_train_step(loss_fn, OPT, "float32", donate_state=False)
    modes = ("train", "eval", "train", "eval")
    state = _state(model)
    for i, mode in enumerate(modes):
        getattr(model, mode)()
        new, m = compiled(state, _batch(i))
        ref, mr = eager(state, _batch(i))
        stats = ("1.running_mean", "1.running_var")
        for k in stats:
            torch.testing.assert_close(new.buffers[k], ref.buffers[k], rtol=1e-6, atol=1e-7)
            assert torch.equal(new.buffers[k], state.buffers[k]) == (mode == "eval")
        if mode == "eval":
            torch.testing.assert_close(m["loss"], mr["loss"], rtol=1e-6, atol=1e-7)
        else:
            model.eval()
            _, me = eager(state, _batch(i))
            model.train()
            assert not torch.equal(m["loss"], me["loss"])
        state = ref


@pytest.mark.slow
def test_step_on_disk_follows_the_mode(tmp_path, caplog):
    """``cache_dir``: an entry per mode on disk, each checked on every call; a new step (as in
    a new process) loads the entry of the mode the model is in."""
    model = _model()
    loss_fn = _loss(model)
    eager = funcamp.make_train_step(loss_fn, OPT, "float32", compile=False, donate_state=False)
    want_states, want = _run(model, eager, _state(model), TRAIN_EVAL)

    def cached():
        return funcamp.make_train_step(
            loss_fn,
            OPT,
            "float32",
            compile=funcamp.Compile(backend="aot_eager", cache_dir=tmp_path),
            donate_state=False,
        )

    got_states, got = _run(model, cached(), _state(model), TRAIN_EVAL)
    assert [float(x) for x in got] == [float(x) for x in want]
    assert_bitwise(funcamp.state_dict(got_states[-1]), funcamp.state_dict(want_states[-1]))
    assert len(list(tmp_path.glob("*.funcamp-step"))) == 2
    for modes in (EVAL_TRAIN[:2], TRAIN_EVAL[:2]):
        want_states, want = _run(model, eager, _state(model), modes)
        with caplog.at_level(logging.INFO, logger="funcamp"):
            caplog.clear()
            got_states, got = _run(model, cached(), _state(model), modes)
        assert [float(x) for x in got] == [float(x) for x in want]
        assert sum("loaded the compiled train step" in r.message for r in caplog.records) == 2
        assert not any("compiling" in r.message for r in caplog.records)


@pytest.mark.slow
def test_data_parallel_step_follows_the_mode(single_rank_group):
    model = _model()
    loss_fn = _loss(model)
    eager = funcamp.make_train_step(loss_fn, OPT, "float32", compile=False, donate_state=False)
    step = funcamp.make_train_step(
        loss_fn,
        OPT,
        "float32",
        parallel=funcamp.distributed.DataParallel(single_rank_group),
        compile=funcamp.Compile(backend="aot_eager"),
        donate_state=False,
    )
    want_states, want = _run(model, eager, _state(model), EVAL_TRAIN)
    got_states, got = _run(model, step, _state(model), EVAL_TRAIN)
    assert [float(x) for x in got] == [float(x) for x in want]
    assert_bitwise(funcamp.state_dict(got_states[-1]), funcamp.state_dict(want_states[-1]))


@pytest.mark.slow
def test_sharded_step_follows_the_mode(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    model = _model()
    loss_fn = _loss(model)
    eager = funcamp.make_train_step(loss_fn, OPT, "float32", compile=False, donate_state=False)
    step = funcamp.make_train_step(
        loss_fn,
        OPT,
        "float32",
        parallel=funcamp.distributed.Sharded(mesh),
        compile=funcamp.Compile(backend="aot_eager"),
        donate_state=False,
    )
    _, want = _run(model, eager, _state(model), TRAIN_EVAL)
    _, got = _run(model, step, fd.shard(_state(model), mesh), TRAIN_EVAL)
    assert [float(x) for x in got] == [float(x) for x in want]


# ------------------------------------------------------------------------------- the eval step
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_eval_step_follows_the_mode_and_changes_nothing(backend):
    """The eval step is the model's functional call under amp without gradients: in eval mode
    the same output every call (eager amp's, within inductor's rounding), float32 under a mixed
    policy; in training mode dropout and batch statistics are on, yet the state's running
    statistics are not touched. One graph per mode."""
    model = _model()
    state = _state(model)

    def logits(params, buffers, batch):
        return functional_call(model, (params, buffers), (batch[0],))

    compiled = funcamp.make_eval_step(
        logits, "mixed_bfloat16", compile=funcamp.Compile(backend=backend)
    )
    eager = funcamp.make_eval_step(logits, "mixed_bfloat16", compile=False)
    x = _batch(0)
    before = {k: v.clone() for k, v in state.buffers.items()}
    counters.clear()
    for mode in ("eval", "train", "eval", "train"):
        getattr(model, mode)()
        out = compiled(state, x)
        assert out.dtype == torch.float32 and not out.requires_grad
        if mode == "eval":
            want = funcamp.amp(logits, "mixed_bfloat16")(state.params, state.buffers, x)
            torch.testing.assert_close(out, want, rtol=1e-2 if backend == "inductor" else 0, atol=0)
            assert torch.equal(compiled(state, x), out)
            assert torch.equal(eager(state, x), want)
        else:
            assert not torch.equal(compiled(state, x), out)  # dropout on
    assert counters["stats"]["unique_graphs"] == 2
    for k, v in before.items():  # training-mode batch statistics did not reach the state
        assert torch.equal(state.buffers[k], v)
    model.eval()  # a (params, buffers) pair is evaluated as the state is
    assert torch.equal(eager((state.params, state.buffers), x), eager(state, x))


def test_eval_step_checks_its_state():
    step = funcamp.make_eval_step(lambda p, b, batch: batch, "float32", compile=False)
    with pytest.raises(TypeError, match=r"`state` must be a funcamp\.TrainState or a"):
        step({"w": torch.ones(1)}, torch.ones(1))
    with pytest.raises(TypeError, match="`fn` must be callable"):
        funcamp.make_eval_step(3, "float32")
