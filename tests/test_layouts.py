"""The channels-last pass of a compiled train step (``funcamp/compiler/layouts.py``).

A train step is one graph (forward and backward), in which inductor fixes every tensor that
``convolution_backward`` and other ops both read to its traced, NCHW, strides, although it runs
the convolutions channels-last: activations are stored twice and the backward's kernels
transpose. :class:`ChannelsLastConvBackward` records channels-last strides on exactly those
tensors. The step's results stay the same bits; its generated code transposes less.
"""

from __future__ import annotations

import torch
from tiny_step import cnn_step
from torch import nn

import funcamp
from funcamp.compiler.layouts import ChannelsLastConvBackward, channels_last_strides
from funcamp.testing import assert_trees_equal


class Recording(ChannelsLastConvBackward):
    """The pass, recording which nodes it moved (and never cached: ``uuid`` None)."""

    def __init__(self) -> None:
        self.moved: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.calls = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.calls += 1
        before = {
            n: n.meta["val"].stride()
            for n in graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)
        }
        super().__call__(graph)
        for n, stride in before.items():
            if n.meta["val"].stride() != stride:
                self.moved.append((n.name, stride, n.meta["val"].stride()))

    def uuid(self) -> None:  # type: ignore[override]
        return None


def _two_convs(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(nn.functional.conv2d(x, w1, padding=1))  # read by conv 2 and its backward
    return nn.functional.conv2d(h, w2, padding=1).square().mean()


def test_moves_only_activations_the_conv_backward_shares():
    torch.manual_seed(0)
    w1, w2, x = torch.randn(8, 3, 3, 3), torch.randn(8, 8, 3, 3), torch.randn(2, 3, 10, 10)
    want = torch.func.grad(_two_convs, argnums=(0, 1))(w1, w2, x)
    recording = Recording()
    f = torch.compile(
        torch.func.grad(_two_convs, argnums=(0, 1)),
        fullgraph=True,
        options={"post_grad_custom_post_pass": recording},
    )
    got = f(w1, w2, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert recording.calls == 1
    # one activation: the ReLU's output, NCHW as traced, now channels-last; nothing returned
    # (the grads) and no graph input (x) is touched
    assert len(recording.moved) == 1, recording.moved
    _, before, after = recording.moved[0]
    assert before == torch.empty(2, 8, 10, 10).stride()
    assert after == channels_last_strides(torch.Size([2, 8, 10, 10]))
    assert all(g.is_contiguous() for g in got)


def test_dynamic_shapes_are_left_as_traced():
    recording = Recording()
    w1, w2 = torch.randn(8, 3, 3, 3), torch.randn(8, 8, 3, 3)
    f = torch.compile(
        torch.func.grad(_two_convs, argnums=(0, 1)),
        fullgraph=True,
        dynamic=True,
        options={"post_grad_custom_post_pass": recording},
    )
    for n in (2, 3):
        x = torch.randn(n, 3, 10, 10)
        got = f(w1, w2, x)
        want = torch.func.grad(_two_convs, argnums=(0, 1))(w1, w2, x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert recording.calls >= 1 and recording.moved == []


def test_does_nothing_where_inductor_keeps_nchw():
    # config.patch, not monkeypatch.setattr: pytest >= 9.1 restores a module attribute from the
    # module's __dict__, where a torch ConfigModule keeps nothing, so its undo *deletes* the
    # option (ConfigModule.__delattr__ hides it) and every later compile in the process fails
    # with "torch._inductor.config.layout_optimization does not exist".
    torch._dynamo.reset()
    recording = Recording()
    w1, w2, x = torch.randn(8, 3, 3, 3), torch.randn(8, 8, 3, 3), torch.randn(2, 3, 10, 10)
    with torch._inductor.config.patch(layout_optimization=False):
        f = torch.compile(
            torch.func.grad(_two_convs, argnums=(0, 1)),
            fullgraph=True,
            options={"post_grad_custom_post_pass": recording},
        )
        f(w1, w2, x)
    torch._dynamo.reset()
    assert recording.calls == 1 and recording.moved == []


def _cnn_step(**options):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip
    step, fresh_state = cnn_step(model, **options)
    batch = (torch.randn(4, 3, 12, 12), torch.randint(0, 4, (4,)))
    state, _ = step(fresh_state(), batch)
    return step(state, batch)


def test_a_cnn_step_keeps_its_bits():
    """Two steps of a conv-BN-ReLU CNN with the pass (recording what it moves) and with the
    compiler patches off: the same params, state and metrics bit for bit, and the pass did move
    activations (which is what makes the generated code transpose less: docs/benchmarks.md)."""
    recording = Recording()
    with_pass, metrics = _cnn_step(
        compile=funcamp.Compile(options={"post_grad_custom_post_pass": recording})
    )
    without, metrics_without = _cnn_step(compile=funcamp.Compile(compiler_patches=False))
    assert_trees_equal(with_pass.params, without.params)
    assert_trees_equal(with_pass.opt_state, without.opt_state)
    assert_trees_equal(metrics, metrics_without)
    assert recording.moved
