"""``remat``: activation checkpointing as a function transform, JAX's ``jax.checkpoint``.

``remat(fn, policy)`` returns ``fn`` whose intermediate activations are recomputed in the
backward pass instead of kept (except those ``policy`` saves): less memory for more compute. It is
``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)``. A policy that saves some
ops' outputs uses torch's selective activation checkpointing
(``create_selective_checkpoint_contexts``). So it composes with everything torch's checkpoint
composes with:

* :func:`funcamp.amp`: the recomputation runs under the same policy. Eagerly it runs inside
  :func:`funcamp.recompute_under`, which :func:`funcamp.make_train_step` enters; compiled, in the
  graph. So the values and gradients are bit for bit those without ``remat``.
* ``torch.compile(fullgraph=True)``: dynamo records the region, and the graph recomputes it.
  :func:`funcamp.make_train_step`'s compiled step then takes its gradients from torch.autograd in
  the graph. (torch.func supports no saved-tensor hooks: pytorch issues 122729, 141845.)
* ``torch.func.grad``/``vjp``/``vmap`` in eager code: ``fn`` runs as it is, with the same values.
  Nothing is saved or recomputed, since torch.func has no saved-tensor hooks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as _ckpt

from funcamp._core.context import compiling, in_transform
from funcamp._core.tree import describe

__all__ = ["MATMUL_OPS", "remat"]

F = TypeVar("F", bound=Callable[..., Any])

_aten = torch.ops.aten

#: The ops whose outputs ``policy="matmuls"`` saves (JAX's ``dots_saveable``): matrix
#: products, convolutions and attention.
MATMUL_OPS = frozenset(
    op
    for op in (
        getattr(_aten, "mm", None),
        getattr(_aten, "addmm", None),
        getattr(_aten, "bmm", None),
        getattr(_aten, "baddbmm", None),
        getattr(_aten, "convolution", None),
        getattr(_aten, "_scaled_mm", None),
        getattr(_aten, "_scaled_dot_product_flash_attention", None),
        getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        getattr(_aten, "_scaled_dot_product_efficient_attention", None),
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
    )
    if op is not None
)

_POLICIES = ("nothing", "matmuls", "everything")


def _saves(policy: Any) -> Callable[[Any], bool] | None:
    """The predicate ``op -> save its output?`` of a policy (None: save nothing)."""
    if policy == "nothing":
        return None
    if policy == "matmuls":
        return lambda op: getattr(op, "overloadpacket", op) in MATMUL_OPS
    return policy


def _sac_policy(saves: Callable[[Any], bool]) -> Callable[..., Any]:
    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        keep = saves(op)
        if not isinstance(keep, bool):
            raise TypeError(
                f"funcamp.remat: `policy` must return a bool for each op (True: save its "
                f"output), got {describe(keep)} for {op}"
            )
        return _ckpt.CheckpointPolicy.MUST_SAVE if keep else _ckpt.CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


def remat(fn: F, policy: str | Callable[[Any], bool] = "nothing") -> F:
    """Recompute ``fn``'s activations in the backward pass instead of keeping them.

    Policies: ``"nothing"`` keeps only ``fn``'s inputs (JAX's ``nothing_saveable``).
    ``"matmuls"`` keeps the outputs of matrix products, convolutions and attention (JAX's
    ``dots_saveable``), which are cheap to keep next to the pointwise work they feed.
    ``"everything"`` runs ``fn`` as it is, to switch ``remat`` off without editing a model. A
    callable gets the aten op (``torch.ops.aten.mm.default``) and is True where its output is
    kept.

    Args:
        fn: the function (a block of a model, or a whole loss) whose activations to recompute.
        policy: what is kept anyway: ``"nothing"`` (default), ``"matmuls"`` (:data:`MATMUL_OPS`'
            outputs), ``"everything"`` (no checkpointing), or a callable ``op -> bool`` of the
            aten op. See "Policies" above.

    Returns:
        ``fn`` with the same signature; its keyword arguments pass through.

    Example:
        >>> import torch, funcamp
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> f = funcamp.amp(lambda x: funcamp.remat(block, "matmuls")(x).sum(), "mixed_bfloat16")
        >>> with funcamp.recompute_under("mixed_bfloat16"):
        ...     f(x).backward()
        >>> plain = x.grad.clone(); x.grad = None
        >>> with funcamp.recompute_under("mixed_bfloat16"):
        ...     funcamp.amp(lambda x: block(x).sum(), "mixed_bfloat16")(x).backward()
        >>> torch.equal(plain, x.grad)  # the same gradients, bit for bit
        True
    """
    if not callable(fn):
        raise TypeError(f"funcamp.remat: `fn` must be callable, got {describe(fn)}")
    if isinstance(policy, str):
        if policy not in _POLICIES:
            raise ValueError(
                f"funcamp.remat: `policy` must be one of {list(_POLICIES)} or a callable "
                f"op -> bool, got {policy!r}"
            )
    elif not callable(policy):
        raise TypeError(
            f"funcamp.remat: `policy` must be one of {list(_POLICIES)} or a callable op -> "
            f"bool, got {describe(policy)}"
        )
    if policy == "everything":
        return fn
    saves = _saves(policy)
    context_fn = (
        _ckpt.noop_context_fn
        if saves is None
        else functools.partial(_ckpt.create_selective_checkpoint_contexts, _sac_policy(saves))
    )

    @functools.wraps(fn)
    def rematerialized(*args: Any, **kwargs: Any) -> Any:
        if not compiling() and in_transform():
            return fn(*args, **kwargs)  # torch.func has no saved-tensor hooks: nothing to save
        return _ckpt.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return rematerialized  # type: ignore[return-value]
