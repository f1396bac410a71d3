"""The kernel path: a compiled step calls torch's multi-tensor kernels as they are.

Under ``torch.compile``, on plain CPU tensors outside ``torch.func`` transforms,
:func:`funcamp.unscale_and_step` runs the fused unscale-and-check (torch's kernel, through
``funcamp::unscale``) and ``_foreach_norm`` as calls in the graph: inductor then generates no
C++ for them. The results are the eager step's, bit for bit. ``funcamp::unscale`` keeps the
gradients in their traced layout, so a CNN's weight gradients reach the update in the params'
layout although inductor runs the convolutions channels-last.
"""

from __future__ import annotations

import pytest
import torch
from exhaustive import exhaustive
from tiny_step import batches, cnn_step, model_step, recording_backend

import funcamp
from funcamp._core.context import plain_tensors
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


# Donation changes how the step writes its outputs, not the update each optimizer traces: every
# optimizer donated (the default), and two of them (one with a clip in its chain) not donated.
KERNEL_CASES = [(name, True) for name in OPTIMIZERS] + [
    pytest.param(
        "adamw", False, marks=exhaustive
    ),  # AdamW's trace: donated; not donated: clip_adam
    ("clip_adam", False),
]


@pytest.mark.parametrize(("name", "donate_state"), KERNEL_CASES)
def test_compiled_step_calls_the_kernels_and_matches_eager(name, donate_state):
    seen: list[str] = []
    compiled, state = model_step(
        OPTIMIZERS[name](),
        funcamp.Compile(backend=recording_backend(seen)),
        donate_state=donate_state,
    )
    got, got_metrics = _run(compiled, state)
    eager, state = model_step(OPTIMIZERS[name](), False, donate_state=donate_state)
    want, want_metrics = _run(eager, state)
    assert_trees_equal(got.params, want.params)
    assert_trees_equal(got.opt_state, want.opt_state)
    assert_trees_equal(got_metrics, want_metrics)
    assert sum("funcamp.unscale" in s for s in seen) == 1, seen
    assert sum("_foreach_norm" in s for s in seen) == 1, seen


def test_transforms_and_autograd_take_the_traced_path():
    x = torch.ones(3)
    assert plain_tensors([x])
    assert not plain_tensors([x.requires_grad_()])
    seen = []
    torch.func.vmap(lambda y: seen.append(plain_tensors([y])) or y)(torch.ones(2, 3))
    assert seen == [False]

    @torch.compile(backend="eager", fullgraph=True)
    def inside(y):
        return y * 2 if plain_tensors([y]) else y

    assert torch.equal(inside(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(torch.compile(torch.func.vmap(inside), backend="eager")(torch.ones(2, 2)),
                       torch.ones(2, 2))  # fmt: skip

    # A compiled grad through it: dynamo reports requires_grad=False inside torch.func.grad,
    # so the transform itself is asked (once, a constant of the graph).
    def through(y):
        return (y * 2 if plain_tensors([y]) else y * 3).sum()

    grad = torch.compile(torch.func.grad(through), backend="eager", fullgraph=True)
    assert torch.equal(grad(torch.ones(2)), torch.full((2,), 3.0))
    assert torch.equal(inside(torch.ones(2)), torch.full((2,), 2.0))  # plain again


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
    assert "torch.ops.funcamp.unscale.default(" in code
    assert "aten._foreach_norm" in code
    want, _ = eager(state2, batch)
    torch.testing.assert_close(new.params, want.params, rtol=1e-5, atol=1e-7)


def test_cnn_gradients_reach_the_update_in_the_params_layout():
    """Inductor lays a CNN's convolutions out channels-last, and their weight gradients with
    them; through torch's functional unscale (an op of flexible layout) they reached the update
    channels-last against contiguous params and moments, and inductor generated each such
    leaf's update as tiled transposes (ResNet's AdamW kernel: 193 KB of C++ against 136 KB).
    ``funcamp::unscale`` asks for the traced strides: every gradient it returns is contiguous,
    as its param. (Measured without it: the first conv's gradient came back with strides
    (27, 1, 9, 3), and the step's C++ held 38 tiled transposes against 18.)"""
    import re

    from torch import nn
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 4),
    )  # fmt: skip
    params = dict(model.named_parameters())
    step, fresh_state = cnn_step(model)
    eager, _ = cnn_step(model, compile=False)
    batch = (torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4,)))
    (_, metrics), codes = run_and_get_code(step, fresh_state(), batch)
    want = eager(fresh_state(), batch)[1]
    assert not metrics["found_inf"]
    torch.testing.assert_close(metrics["loss"], want["loss"], rtol=1e-4, atol=0)
    layouts = re.findall(
        # torch <= 2.13: assert_size_stride(buf, size, stride, 'op'); torch 2.14 checks the
        # dtype too: assert_tensor_metadata(buf, size, stride, torch.float32, 'op')
        r"assert_(?:size_stride|tensor_metadata)\(\w+, \(([\d, ]*)\), \(([\d, ]*)\), "
        r"(?:torch\.\w+, )?'torch\.ops\.funcamp\.unscale",
        "\n".join(codes),
    )
    sizes = {tuple(p.shape) for p in params.values()}
    seen = set()
    for size_text, stride_text in layouts:
        size = tuple(int(v) for v in size_text.replace(" ", "").split(",") if v)
        stride = tuple(int(v) for v in stride_text.replace(" ", "").split(",") if v)
        assert stride == torch.empty(size).stride(), (size, stride)
        seen.add(size)
    assert sizes <= seen, (sizes, seen)  # every gradient, the conv weights among them
