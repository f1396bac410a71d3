"""A tiny compiled train step for the kernel-path and fused-optimizer tests: a 6-16-3 MLP under
``mixed_bfloat16`` with a dynamic scaler, four batches (the third overflows), and a dynamo
backend that records the graph's calls; and a small CNN's step (:func:`cnn_step`)."""

from __future__ import annotations

import copy

import torch

import funcamp


def model_step(opt, compile, **kw):
    """``(make_train_step(...), its TrainState)`` for ``opt``; ``kw`` go to make_train_step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    params, buffers = funcamp.params_and_buffers(model)

    def loss_fn(p, b, batch):
        x, y = batch
        out = torch.func.functional_call(model, (p, b), (x,))
        return torch.nn.functional.mse_loss(out.float(), y)

    policy = funcamp.get_policy("mixed_bfloat16")
    scaler = funcamp.ScalerState.dynamic(init_scale=2.0**8, growth_interval=1)
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers, scaler=scaler)
    return funcamp.make_train_step(loss_fn, opt, policy, compile=compile, **kw), state


def batches():
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(4)]
    out[2] = (out[2][0], torch.full((4, 3), 1e30))  # the scaled grads overflow: skipped
    return out


def recording_backend(seen: list[str]):
    """A dynamo backend that appends the target of every call in the graph to ``seen``."""

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    return backend


def cnn_step(model, **kw):
    """``(make_train_step(...), fresh_state)`` for a classifier ``model`` fed ``(x, y)``:
    cross-entropy under ``mixed_bfloat16``, AdamW, a dynamic scaler; ``fresh_state()`` builds
    a new TrainState from a copy of ``model`` (a donated step consumes the state it is given);
    ``kw`` go to make_train_step."""
    opt = funcamp.adamw(1e-3, weight_decay=0.01)
    policy = funcamp.get_policy("mixed_bfloat16")

    def loss_fn(p, b, batch):
        x, y = batch
        out = torch.func.functional_call(model, (p, b), (x,))
        return torch.nn.functional.cross_entropy(out.float(), y)

    def fresh_state():
        p, b = funcamp.params_and_buffers(copy.deepcopy(model))
        return funcamp.TrainState.create(
            p, opt, policy, buffers=b, scaler=funcamp.ScalerState.dynamic()
        )

    return funcamp.make_train_step(loss_fn, opt, policy, **kw), fresh_state
