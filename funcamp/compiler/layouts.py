"""An inductor graph pass for a train step on convolutions: saved activations stay channels-last.

A compiled train step is one graph holding the forward *and* the backward (``torch.func.grad``
traced inline). Inductor compiles it as an inference graph. With its layout optimization on (the
default for graphs with convolutions), inductor runs the convolutions channels-last. But some
tensors are read by several ops, including ``convolution_backward``. Inductor fixes their layout to
the tensor's *traced* strides: contiguous (NCHW) for a model fed NCHW images. So each activation
the backward needs (a ReLU's output, a pooled residual) is stored twice. It is stored once NCHW for
the backward, and once channels-last for the next convolution. The backward's elementwise kernels
then mix NCHW with channels-last gradients: tiled transposes, slow to generate and to run. torch's
own training path escapes this by compiling the backward as a separate graph, whose saved inputs
arrive channels-last.

:class:`ChannelsLastConvBackward` records channels-last strides on exactly those tensors before
inductor lowers the graph. It does so only where inductor's layout optimization will run the
convolutions channels-last anyway. The activation is then stored once, channels-last, and read as
it is by both. The same kernels compute the same values. Only layouts change, with fewer tiled
transposes in the generated code.

A tensor is left as traced when any op that reads it takes its traced strides as a constraint:

* a custom op of fixed stride order or exact strides (``torch._C.Tag.needs_fixed_stride_order``,
  ``needs_exact_strides``, or the custom-op default, which inductor enforces with
  ``constrain_to_fx_strides``);
* an op inductor lowers with a layout constraint of its own (a collective);
* anything that is not an ATen operator overload (a higher-order op).

Upstream: pytorch/pytorch#189239 (inductor's layout optimization and ``convolution_backward``)
covers the separate backward graphs of torch's training path. This pass would be unnecessary if
inductor chose the layout of a tensor read by both a convolution and its backward in *one* graph.
It reaches inductor through its public ``post_grad_custom_post_pass`` option, keyed by a digest of
this file (:meth:`ChannelsLastConvBackward.uuid`).

Workaround of torch internals (docs/upstream.md#layouts):

- Root cause: in one forward-and-backward graph, inductor fixes a tensor read by a
  convolution's backward to its traced (NCHW) strides. So activations are stored twice.
- Upstream: pytorch/pytorch#189239 covers torch's separate backward graphs. The one-graph case
  is written up in docs/upstream.md#layouts.
- Why it is safe: it is a public extension point (post_grad_custom_post_pass, keyed by this
  file's digest). Only layouts change; the values are the same (tested). Fixed-stride ops are
  left alone.
- Tested on: torch 2.13 and 2.14 on the CPU (funcamp.compiler.ALLOWLIST); off elsewhere unless
  asked for.
- Delete when: inductor chooses the layout of a tensor read by both a convolution and its
  backward in one graph.

"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor import lowering as _lowering
from torch._inductor.graph import GraphLowering
from torch._library.utils import get_layout_constraint_tag

try:  # a pass inductor's FX graph cache can key on (torch >= 2.5)
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - older torch
    CustomGraphPass = object  # type: ignore[assignment,misc]
try:
    from torch._inductor.custom_graph_pass import get_hash_for_files
except ImportError:  # pragma: no cover - older torch
    get_hash_for_files = None

__all__ = ["ChannelsLastConvBackward", "channels_last_strides"]

_CONV_BACKWARD = torch.ops.aten.convolution_backward.default
_AS_STRIDED = (torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default)
# Their layout constraints follow inductor's layout optimization (no constraint while it is on).
_CONVOLUTIONS = (torch.ops.aten.convolution.default, _CONV_BACKWARD)
_FIXED = tuple(
    getattr(torch._C.Tag, name)
    for name in ("needs_fixed_stride_order", "needs_exact_strides")
    if hasattr(torch._C.Tag, name)
)


def channels_last_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a dense 4-d tensor of ``shape`` in channels-last order."""
    return torch.empty(shape, device="meta").contiguous(memory_format=torch.channels_last).stride()


def _layout_optimized(gm: Any) -> bool:
    """Whether inductor will run this graph's convolutions channels-last (its own decision)."""
    try:
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=True))
    except Exception:  # another torch: leave the graph as it is
        return False


def _reads_traced_strides(user: torch.fx.Node) -> bool:
    """Whether inductor gives ``user`` its inputs in their traced strides (or order): a custom
    op of fixed stride order or exact strides, an op with a layout constraint, or anything but
    an ATen operator overload. The convolutions follow inductor's layout optimization."""
    target = user.target
    if user.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return True
    if target in _CONVOLUTIONS:
        return False
    constraints = getattr(_lowering, "maybe_layout_constraints", None)
    if constraints is None:  # another inductor: leave the tensor as traced
        return True
    if constraints(target) is not None:
        return True
    return get_layout_constraint_tag(target, with_default=True) in _FIXED


def _movable(node: torch.fx.Node) -> bool:
    """A tensor whose layout inductor fixes from its traced strides only because
    ``convolution_backward`` reads it: computed here (not a graph input), read by several ops,
    dense, 4-d of static shape and contiguous, not a view, not returned, not the source of an
    ``as_strided`` and read by no op that takes the traced strides (:func:`_reads_traced_strides`)."""
    val = node.meta.get("val")
    if (
        node.op != "call_function"
        or len(node.users) < 2
        or not isinstance(val, torch.Tensor)
        or val.dim() != 4
        or not all(isinstance(d, int) for d in val.shape)  # dynamic shapes: left as traced
        or not val.is_contiguous()
        or val._is_view()
        or node.meta.get("inductor_realize_to_strides", False)
    ):
        return False
    return all(
        u.op != "output" and u.target not in _AS_STRIDED and not _reads_traced_strides(u)
        for u in node.users
    )


class ChannelsLastConvBackward(CustomGraphPass):  # type: ignore[misc]
    """Inductor's ``post_grad_custom_post_pass`` for a train step's graph (see the module).

    A no-op where inductor's layout optimization is off, and on graphs without
    ``convolution_backward``.

    Example:
        >>> import torch
        >>> from funcamp.compiler.layouts import ChannelsLastConvBackward
        >>> conv = torch.nn.Conv2d(3, 8, 3)
        >>> def grads(w, x):
        ...     y = torch.relu(torch.nn.functional.conv2d(x, w))
        ...     return torch.nn.functional.conv2d(y, w[:, :1].expand(8, 8, 3, 3)).sum()
        >>> f = torch.compile(torch.func.grad(grads), backend="inductor",
        ...                   options={"post_grad_custom_post_pass": ChannelsLastConvBackward()})
        >>> f(conv.weight.detach(), torch.randn(2, 3, 12, 12)).shape
        torch.Size([8, 3, 3, 3])
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        nodes = [n for n in graph.nodes if n.target is _CONV_BACKWARD]
        if not nodes or gm is None or not _layout_optimized(gm):
            return
        seen: set[torch.fx.Node] = set()
        for conv in nodes:
            for arg in conv.args[:2]:  # grad_output, input
                if not isinstance(arg, torch.fx.Node) or arg in seen or not _movable(arg):
                    continue
                seen.add(arg)
                val = arg.meta["val"]
                mode = getattr(val, "fake_mode", None)
                if mode is None:  # post-grad values are fake tensors; anything else: leave it
                    continue
                with mode:
                    arg.meta["val"] = torch.empty_strided(
                        val.shape,
                        channels_last_strides(val.shape),
                        dtype=val.dtype,
                        device=val.device,
                    )

    def uuid(self) -> Any:
        """The pass's identity in inductor's FX graph cache key: a digest of this file."""
        if get_hash_for_files is None:  # pragma: no cover - older torch
            return "funcamp.ChannelsLastConvBackward/1"
        return get_hash_for_files((__file__,))
