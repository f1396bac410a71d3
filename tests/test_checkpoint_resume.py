"""Resuming from a checkpoint in a fresh process continues training bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optree
import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

import funcamp

#: The optree namespace funcamp documents for its state types (docs/concepts.md).
NAMESPACE = "funcamp"

POLICY = "mixed_float16"


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    schedule = funcamp.cosine_decay_schedule(3e-2, 30, 0.1)
    opt = funcamp.adamw(schedule, weight_decay=1e-2)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return nn.functional.cross_entropy(functional_call(model, (params, buffers), (x,)), y)

    params, buffers = funcamp.params_and_buffers(model)
    scaler = funcamp.ScalerState.dynamic(2.0**14, growth_interval=3)  # overflows now and then
    state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers, scaler=scaler)
    step = funcamp.make_train_step(loss_fn, opt, POLICY, compile=False, donate_state=False)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(30):
        batches.append((torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)))
    return state, step, batches


def resume(checkpoint: str, out: str) -> None:
    """Run in a fresh process: load, 15 more steps, save the final state."""
    template, step, batches = _setup()
    state = funcamp.load_state_dict(template, torch.load(checkpoint, weights_only=True))
    for b in batches[15:]:
        state, _ = step(state, b)
    torch.save(funcamp.state_dict(state), out)


@pytest.mark.slow
def test_resume_in_fresh_process_is_bit_identical(tmp_path: Path):
    state, step, batches = _setup()
    straight = state
    for b in batches:
        straight, _ = step(straight, b)
    half = state
    for b in batches[:15]:
        half, _ = step(half, b)
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "final.pt"
    torch.save(funcamp.state_dict(half), ckpt)

    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import test_checkpoint_resume as t; t.resume(sys.argv[2], sys.argv[3])"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), str(ckpt), str(out)],
        check=True,
        env=env,
        timeout=300,
    )
    resumed = funcamp.load_state_dict(state, torch.load(out, weights_only=True))

    # the scale grows every 3 steps until it overflows: skipped steps on both sides
    assert 0 < int(half.scaler.skipped) < int(straight.scaler.skipped)
    for part in ("params", "buffers", "opt_state", "scaler"):
        a = optree.tree_leaves(getattr(straight, part), namespace=NAMESPACE)
        b = optree.tree_leaves(getattr(resumed, part), namespace=NAMESPACE)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and torch.equal(x, y), part
    assert resumed.scaler.growth_interval == 3 and resumed.scaler.kind == "dynamic"
