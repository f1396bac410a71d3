"""The kernel path: a compiled step calls torch's multi-tensor kernels as they are.

Under ``torch.compile``, on plain CPU tensors outside ``torch.func`` transforms,
:func:`funcamp.unscale_and_step` runs the fused unscale-and-check and ``_foreach_norm`` (and, on
the CPU, the optimizer's own eager update through ``funcamp::eager_update_``) as calls in the
graph: inductor then generates no C++ for them. The results are the eager step's, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from tiny_step import batches, model_step, recording_backend

import funcamp
from funcamp._core.context import kernel_path
from funcamp.testing import assert_trees_equal


def _run(step, state):
    history = []
    for batch in batches():
        state, metrics = step(state, batch)
        history.append({k: v.clone() for k, v in metrics.items()})
    return state, history


OPTIMIZERS = {
    "adamw": lambda: funcamp.adamw(1e-2, weight_decay=0.1),
    "adamw_mask_schedule": lambda: funcamp.adamw(
        funcamp.linear_schedule(1e-2, 1e-3, 3),
        weight_decay=0.1,
        mask=lambda ps: {k: v.ndim > 1 for k, v in ps.items()},
    ),
    "sgd": lambda: funcamp.sgd(0.1),
    "sgd_momentum": lambda: funcamp.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: funcamp.lion(1e-3, weight_decay=0.1),
    "clip_adam": lambda: funcamp.chain(funcamp.clip_by_global_norm(0.5), funcamp.adam(1e-2)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("donate_state", [True, False])
def test_compiled_step_calls_the_kernels_and_matches_eager(name, donate_state):
    seen: list[str] = []
    compiled, state = model_step(
        OPTIMIZERS[name](), True, donate_state=donate_state, backend=recording_backend(seen)
    )
    got, got_metrics = _run(compiled, state)
    eager, state = model_step(OPTIMIZERS[name](), False, donate_state=donate_state)
    want, want_metrics = _run(eager, state)
    assert_trees_equal(got.params, want.params)
    assert_trees_equal(got.opt_state, want.opt_state)
    assert_trees_equal(got_metrics, want_metrics)
    assert sum("_amp_foreach_non_finite_check_and_unscale_" in s for s in seen) == 1, seen
    assert sum("_foreach_norm" in s for s in seen) == 1, seen


def test_transforms_and_autograd_take_the_traced_path():
    x = torch.ones(3)
    assert kernel_path([x])
    assert not kernel_path([x.requires_grad_()])
    seen = []
    torch.func.vmap(lambda y: seen.append(kernel_path([y])) or y)(torch.ones(2, 3))
    assert seen == [False]

    @torch.compile(backend="eager", fullgraph=True)
    def inside(y):
        return y * 2 if kernel_path([y]) else y

    assert torch.equal(inside(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(torch.compile(torch.func.vmap(inside), backend="eager")(torch.ones(2, 2)),
                       torch.ones(2, 2))  # fmt: skip


def test_inductor_calls_the_unscale_kernel():
    """Inductor calls the fused unscale-and-check as an extern kernel (no generated check and
    multiply per leaf); the step is the eager one's up to inductor's own rounding of the forward
    and backward (fused bfloat16 kernels)."""
    from torch._inductor.utils import run_and_get_code

    step, state = model_step(funcamp.adamw(1e-2, weight_decay=0.1), True)
    eager, state2 = model_step(funcamp.adamw(1e-2, weight_decay=0.1), False)
    batch = batches()[0]
    (new, _), codes = run_and_get_code(step, state, batch)
    code = "\n".join(codes)
    assert "aten._amp_foreach_non_finite_check_and_unscale.default(" in code
    assert "aten._foreach_norm" in code
    want, _ = eager(state2, batch)
    torch.testing.assert_close(new.params, want.params, rtol=1e-5, atol=1e-7)
