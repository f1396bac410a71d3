"""Checkpoints written by earlier funcamp releases still load, with their values intact.

The files in tests/data/old_checkpoints/ were written by funcamp at the revisions below (see
make.py there) from the run that :func:`run` repeats here with the current code; loading them
into a current template must give that run's state bit for bit. A release that changes the
state's structure (as TrainState.fp8, added after these) must keep them loading or fail here.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import optree
import pytest
import torch

import funcamp

DATA = Path(__file__).resolve().parent / "data" / "old_checkpoints"
# revision -> how it was written: before funcamp.save existed, state_dict + torch.save.
REVISIONS = {"f723750": "state_dict", "619895d": "save"}


def run(fc: ModuleType = funcamp) -> tuple[Any, Any]:
    """Two AdamW steps of a tiny linear model, bf16 compute, dynamic loss scaling."""
    params = {
        "w": torch.linspace(-1.0, 1.0, 12).reshape(4, 3),
        "b": torch.tensor([0.5, -0.25, 0.125]),
    }
    x = torch.linspace(-2.0, 2.0, 20).reshape(5, 4)
    y = torch.linspace(1.0, -1.0, 15).reshape(5, 3)

    def loss_fn(p: Any, buffers: Any, batch: Any) -> torch.Tensor:
        xb, yb = batch
        return torch.nn.functional.mse_loss(xb @ p["w"] + p["b"], yb)

    opt = fc.adamw(1e-2, weight_decay=0.1)
    state = fc.TrainState.create(params, opt, "mixed_bfloat16", scaler=fc.ScalerState.dynamic())
    step = fc.make_train_step(loss_fn, opt, "mixed_bfloat16", compile=False, donate_state=False)
    for _ in range(2):
        state, _ = step(state, (x, y))
    return state, opt


def _assert_same(a: Any, b: Any) -> None:
    la, sa = optree.tree_flatten(a, namespace="funcamp")
    lb, sb = optree.tree_flatten(b, namespace="funcamp")
    assert sa == sb
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


@pytest.fixture(scope="module")
def expected() -> Any:
    return run()[0]


@pytest.mark.parametrize("rev", sorted(REVISIONS))
def test_old_checkpoint_loads_into_the_current_state(rev: str, expected: Any) -> None:
    template = funcamp.TrainState.create(
        {k: torch.zeros_like(v) for k, v in expected.params.items()},
        funcamp.adamw(1e-2, weight_decay=0.1),
        "mixed_bfloat16",
        scaler=funcamp.ScalerState.dynamic(),
    )
    if REVISIONS[rev] == "state_dict":
        sd = torch.load(DATA / f"{rev}.state_dict.pt", weights_only=True)
        assert "fp8" not in sd  # written before TrainState had the field
        state = funcamp.load_state_dict(template, sd)
    else:
        info = funcamp.checkpoint_info(DATA / f"{rev}.save.pt")
        assert info.metadata == {"step": 2}
        assert info.policy_spec is None  # written before funcamp stored the whole policy
        state, same = funcamp.load(
            DATA / f"{rev}.save.pt", template, policy="mixed_bfloat16", with_info=True
        )
        assert same == info
        with pytest.raises(ValueError, match=r"first difference: policy: "):
            funcamp.load(DATA / f"{rev}.save.pt", template, policy="mixed_float16")
    assert state.fp8 == funcamp.Fp8State()
    _assert_same(state, expected)


def test_a_missing_field_that_holds_tensors_still_fails() -> None:
    # Only a field whose current value holds no tensors may be absent (nothing is lost).
    policy = funcamp.get_policy("mixed_bfloat16").with_fp8(funcamp.Fp8Recipe.delayed(4))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    params, _ = funcamp.params_and_buffers(model)
    template = funcamp.TrainState.create(params, funcamp.sgd(0.1), policy, model=model)
    assert template.fp8.scale  # a delayed-FP8 state has tensors
    sd = funcamp.state_dict(template)
    del sd["fp8"]
    with pytest.raises(ValueError, match=r"missing key at \['fp8'\]"):
        funcamp.load_state_dict(template, sd)
