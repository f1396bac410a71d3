"""ScaleCollapseGuard: stop a run whose scaler sits at its floor and keeps skipping."""

from __future__ import annotations

import math

import pytest
import torch

import funcamp


def _loss(params, buffers, batch):
    return torch.nn.functional.mse_loss(batch @ params["w"], torch.zeros(batch.shape[0], 1))


def _run(scaler, batches, guard, every):
    """Train on ``batches``, giving the guard the metrics of the last ``every`` steps at a
    time (as a loop that reads its metrics every N steps). Returns the number of steps run."""
    opt = funcamp.sgd(0.01)
    state = funcamp.TrainState.create({"w": torch.ones(2, 1)}, opt, "float32", scaler=scaler)
    step = funcamp.make_train_step(_loss, opt, "float32", compile=False, donate_state=False)
    pending, done = [], 0
    for x in batches:
        state, metrics = step(state, x)
        pending.append(metrics)
        done += 1
        if len(pending) == every:
            guard.check(state, pending)
            pending = []
    return done


def _good():
    return torch.ones(3, 2)


def _nan():
    return torch.full((3, 2), math.nan)


def test_stops_after_patience_skips_at_min_scale():
    scaler = funcamp.ScalerState.dynamic(init_scale=16.0, min_scale=1.0)
    guard = funcamp.ScaleCollapseGuard(patience=5)
    with pytest.raises(funcamp.ScaleCollapseError) as info:
        _run(scaler, [_good()] * 2 + [_nan()] * 40, guard, every=3)
    # 16, 8, 4, 2 are the scaler searching; steps 7..11 (scale 1) are the 5 at the floor, and
    # the check after step 12 sees them.
    assert guard.count == 5 and guard.steps == 11
    msg = str(info.value)
    assert msg.startswith("funcamp.ScaleCollapseGuard: the last 5 steps were all skipped")
    assert "loss scale at its floor 1 (min_scale 1)" in msg
    assert "raise `patience`" in msg


def test_a_good_step_or_a_skip_above_the_floor_resets_the_count():
    scaler = funcamp.ScalerState.dynamic(init_scale=2.0, min_scale=1.0)
    guard = funcamp.ScaleCollapseGuard(patience=4)
    # 4 skips in a row, but the first at scale 2 (above the floor): 3 count; then a good step
    # and 3 more skips at the floor, twice: never 4 in a row at the floor
    batches = [_nan()] + ([_nan()] * 3 + [_good()]) * 3
    assert _run(scaler, batches, guard, every=5) == len(batches)
    assert guard.steps == 10 and guard.count == 1  # the last 3 steps were never checked


def test_skips_above_min_scale_do_not_count():
    # min_scale far below: 10 consecutive skips only bring 2**20 down to 2**10
    scaler = funcamp.ScalerState.dynamic(init_scale=2.0**20, min_scale=1.0)
    guard = funcamp.ScaleCollapseGuard(patience=3)
    assert _run(scaler, [_nan()] * 10, guard, every=2) == 10
    assert guard.count == 0


@pytest.mark.parametrize(
    "scaler, words",
    [
        (funcamp.ScalerState.dynamic(init_scale=2.0**20), "backed off to"),
        (funcamp.ScalerState.noop(), "a noop scaler"),
        (funcamp.ScalerState.static(64.0), "a static scaler: its scale 64"),
    ],
)
def test_without_a_floor_every_consecutive_skip_counts(scaler, words):
    guard = funcamp.ScaleCollapseGuard(patience=6)
    with pytest.raises(funcamp.ScaleCollapseError, match=words):
        _run(scaler, [_good()] + [_nan()] * 10, guard, every=1)
    assert guard.steps == 7


def test_accepts_stacked_metrics_and_a_scaler_state():
    scaler = funcamp.ScalerState.dynamic(min_scale=1.0)
    guard = funcamp.ScaleCollapseGuard(patience=3)
    guard.check(
        scaler, {"found_inf": torch.tensor([True, True]), "scale": torch.tensor([1.0, 1.0])}
    )
    assert guard.count == 2
    guard.check(scaler, [])  # nothing new
    with pytest.raises(funcamp.ScaleCollapseError):
        guard.check(scaler, {"found_inf": torch.tensor(True), "scale": torch.tensor(1.0)})


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"`patience` must be a positive int"):
        funcamp.ScaleCollapseGuard(patience=0)
    guard = funcamp.ScaleCollapseGuard()
    with pytest.raises(TypeError, match=r"`scaler` must be a funcamp.ScalerState or a TrainState"):
        guard.check(None, [])
    with pytest.raises(TypeError, match=r"`metrics\[0\]` must be a make_train_step metrics dict"):
        guard.check(funcamp.ScalerState.noop(), [{"loss": torch.tensor(1.0)}])
