"""The execution context, decided here and nowhere else.

funcamp runs the same pure functions in three contexts, and a few fast paths and graph-shaping
hints depend on which:

* *compiling*: dynamo is tracing (``torch.compile``);
* *inside a torch.func transform*: ``grad``, ``vmap``, ``jvp`` (functorch wrapper tensors);
* *plain eager*.

Every question about the context goes through the functions below.
``torch.compiler.is_compiling()`` is called in this module only.

``import funcamp`` does not import dynamo, nor, through it, any inductor module. funcamp's own
code needs one mark from dynamo at definition time, :func:`constant_result`. It is set without
importing dynamo, on the torch releases where that is what dynamo's decorator does.

Workaround of torch internals (docs/internals.md#workarounds):

- Root cause: torch.func has no public question for the active transform, its level, or
  whether a tensor is a functorch wrapper or a BatchedTensor; the answers are in
  torch._C._functorch and in the interpreter stack of torch._functorch.pyfunctorch, which dynamo
  keeps while it traces.
- Upstream: none filed.
- Why it is safe: read-only queries; tests/test_func_transforms.py runs the steps under grad,
  vmap and jvp, eager and compiled.
- Tested on: torch 2.13 and 2.14.
- Delete when: torch.func exposes the current transform and is_batched publicly.

"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from funcamp._core.version import torch_release

__all__ = [
    "batched_below",
    "compiling",
    "constant_result",
    "dual_level_active",
    "plain_eager_tensors",
    "in_transform",
    "is_batched",
    "plain_tensors",
    "marking_inputs",
    "plain_eager",
    "tracks_grad",
    "transform_level",
    "transform_while_tracing",
]

F = TypeVar("F", bound=Callable[..., Any])


#: torch releases whose ``torch.compiler.assume_constant_result(fn)`` only sets
#: ``fn._dynamo_marked_constant = True`` (the attribute dynamo reads when it meets ``fn``):
#: tests/test_context.py checks it on the torch it runs with.
MARK_RELEASES = frozenset({"2.13", "2.14"})


def constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``: under ``torch.compile``, a call of ``fn``
    is run at trace time and its result is a constant of the graph.

    On :data:`MARK_RELEASES` the mark is set as torch's decorator sets it. So defining a marked
    function does not import dynamo (and inductor modules with it) at ``import funcamp``. On any
    other release torch's decorator itself runs.

    Example:
        >>> import torch
        >>> from funcamp._core.context import constant_result
        >>> @constant_result
        ... def two() -> int:
        ...     return 2
        >>> torch.compile(lambda x: x * two(), backend="eager", fullgraph=True)(torch.ones(1))
        tensor([2.])
    """
    if torch_release() in MARK_RELEASES:
        fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
        return fn
    return torch.compiler.assume_constant_result(fn)  # type: ignore[no-any-return]


def compiling() -> bool:
    """Whether dynamo is tracing the caller (``torch.compile``)."""
    return torch.compiler.is_compiling()


def transform_level() -> int | None:
    """The level of the innermost active ``torch.func`` transform, or None outside any."""
    return torch._C._functorch.maybe_current_level()


def in_transform() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...) is active."""
    return transform_level() is not None


@constant_result
def transform_while_tracing() -> bool:
    """:func:`in_transform`, asked while dynamo traces: its answer becomes a constant of the graph.

    Dynamo cannot put the functorch level in a graph. A graph traced under a transform is only
    ever run under it, since dynamo guards on the functorch stack. A step saved to disk is run
    only outside transforms (see funcamp/stepcache/cache.py).
    """
    return torch._C._functorch.maybe_current_level() is not None


def marking_inputs() -> bool:
    """Whether ``torch.func`` itself is marking its inputs for differentiation right now.

    Inside a transform, torch refuses ``tensor.requires_grad_()`` except where torch.func
    allows it for its own call (``_set_tensor_requires_grad`` under
    ``enable_inplace_requires_grad(True)``): the flag read here. A model's own call inside a
    transform (a hook) runs with the flag off.
    """
    if compiling():
        return _marking_while_tracing()
    return torch._C._functorch.get_inplace_requires_grad_allowed()


@constant_result
def _marking_while_tracing() -> bool:
    """:func:`marking_inputs` asked while dynamo traces: dynamo sets the flag at trace time as
    it enters torch.func's context (and records the same toggle in the graph), and cannot trace
    the getter itself."""
    return torch._C._functorch.get_inplace_requires_grad_allowed()


def is_batched(xs: Iterable[Any]) -> bool:
    """Whether any tensor of ``xs`` is batched by the innermost ``vmap``.

    Such a tensor is a functorch ``BatchedTensor`` itself, not under another transform's
    wrapper. Dynamo folds each answer to a constant of the graph.
    """
    for x in xs:  # noqa: SIM110 -- a loop, not any(): dynamo traces any() in Python
        if isinstance(x, torch.Tensor) and torch._C._functorch.is_batchedtensor(x):
            return True
    return False


def batched_below(xs: Iterable[Any]) -> bool:
    """Whether any tensor of ``xs`` is batched by a ``vmap`` under another transform's wrapper
    (``vmap(grad(f))``: a ``GradTrackingTensor`` around a ``BatchedTensor``).

    Compiled, the answer is a constant of the graph: whether a ``vmap`` is active under the
    innermost transform (dynamo cannot unwrap a ``GradTrackingTensor``) and ``xs`` holds a
    tensor.
    """
    if compiling():
        for x in xs:  # noqa: SIM110 -- a loop, not any(): dynamo traces any() in Python
            if isinstance(x, torch.Tensor) and _vmap_below_while_tracing():
                return True
        return False
    functorch = torch._C._functorch
    for x in xs:
        while isinstance(x, torch.Tensor) and functorch.is_functorch_wrapped_tensor(x):
            if functorch.is_batchedtensor(x):
                return True
            x = functorch.get_unwrapped(x)
    return False


@constant_result
def _vmap_below_while_tracing() -> bool:
    """Whether a ``vmap`` is active under the innermost transform, asked while dynamo traces
    (dynamo keeps torch.func's interpreter stack as it traces the transforms)."""
    interpreters = retrieve_all_functorch_interpreters()
    vmap = torch._C._functorch.TransformType.Vmap
    return any(i.key() == vmap for i in interpreters[:-1])


def plain_eager() -> bool:
    """Neither compiling nor inside a ``torch.func`` transform.

    It asks about the context alone. :func:`plain_eager_tensors` and :func:`plain_tensors` also
    ask about tensors.
    """
    return not compiling() and not in_transform()


def dual_level_active() -> bool:
    """Whether forward-mode AD (``torch.autograd.forward_ad.dual_level``) is on: tensors may
    carry tangents that in-place work would not propagate."""
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


def tracks_grad(xs: Iterable[Any]) -> bool:
    """Whether autograd (or ``torch.func.grad``) differentiates through any of these tensors."""
    if not torch.is_grad_enabled():
        return False
    for x in xs:  # noqa: SIM110 -- a loop, not any(): dynamo traces any() in Python
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return True
    return False


def _plain_untracked(xs: Sequence[Any]) -> bool:
    """Every tensor of ``xs`` a plain ``torch.Tensor`` on CPU/CUDA that autograd does not
    track."""
    grad_on = torch.is_grad_enabled()
    traced = compiling()
    for x in xs:
        if not isinstance(x, torch.Tensor):
            continue
        if type(x) is not torch.Tensor:
            return False
        # Eager, is_cpu/is_cuda: reading x.device.type costs ~8x as much, and this runs per
        # tensor; traced, the device is a constant to dynamo, while is_cpu is a graph node.
        if not (x.device.type in ("cpu", "cuda") if traced else (x.is_cpu or x.is_cuda)):
            return False
        if grad_on and x.requires_grad:
            return False
    return True


def plain_eager_tensors(xs: Sequence[Any]) -> bool:
    """:func:`plain_eager` and :func:`plain_tensors`, both.

    Plain eager, and every tensor of ``xs`` a plain ``torch.Tensor`` on CPU/CUDA that autograd
    does not track. It is the one predicate behind every eager fast path: foreach kernels,
    in-place writes into owned temporaries, the fused unscale kernel, torch's fused optimizer
    kernels.
    """
    return plain_eager() and _plain_untracked(xs)


def plain_tensors(xs: Sequence[Any]) -> bool:
    """Whether torch's multi-tensor kernels may run on ``xs``.

    Those are the fused unscale, ``_foreach_norm`` and torch's fused optimizer kernels. Every
    tensor of ``xs`` must be a plain ``torch.Tensor`` on CPU/CUDA that autograd does not track.
    The context must be outside any ``torch.func`` transform, in plain eager
    (:func:`plain_eager_tensors`) or while dynamo traces. Compiled, inductor calls such a kernel
    as it is (an extern kernel) instead of generating code for it. On the CPU every generated
    kernel is a C++ build on the first call.

    Traced, the transform is asked once, as a constant of the graph. So a compiled ``grad``,
    ``vmap`` or ``jvp`` through the update takes the per-leaf ops. Foreach kernels have no vmap
    rule and the fused unscale has no derivative. Inside a traced ``torch.func.grad``, dynamo
    reports ``requires_grad=False``.
    """
    # Asking each tensor is_batchedtensor instead put a graph node per tensor in the step and
    # let a compiled grad through the update reach the kernels.
    if not compiling():
        return plain_eager_tensors(xs)
    return not transform_while_tracing() and _plain_untracked(xs)
