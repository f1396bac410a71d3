"""Numerics shared by every optimizer: float32 scalars, math dtypes and two custom ops.

torch.optim's CPU kernels round ``add(alpha=)``, ``lerp`` and ``addcmul`` once (a fused
multiply-add). Torch's eager float32 ``sqrt`` is one ulp off in about 0.5 % of elements, while
inductor's is correctly rounded. The two ops defined here give the same bits in eager and compiled
code:

* ``funcamp::fma``: ``a * b + c`` rounded once. Inductor lowers it to the hardware instruction;
  every other backend runs torch's fused ``addcmul``.
* ``funcamp::sqrt``: correctly rounded. As a kernel it takes the root in float64 and rounds once;
  compiled, it is inductor's own exact ``sqrt``.

Both are differentiable and have vmap rules. The execution path (:mod:`funcamp.optim._paths`)
decides which of them an update uses, never this module.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from typing import Any

import torch

from funcamp._core.context import dual_level_active, plain_eager_tensors

__all__ = ["EXACT_SQRT", "FUSED_FMA", "exact_sqrt", "plain_exact_sqrt"]


# --------------------------------------------------------------------------------------------
# funcamp::fma and funcamp::sqrt


# Inductor (its decompositions, and prims.fma, registered by inductor_prims) is imported when a
# trace first meets one of the ops below, not at `import funcamp`: each op's fake kernel, which
# dynamo runs before inductor decomposes the graph, puts the pending lowerings in the table.
_INDUCTOR_SPEC = importlib.util.find_spec("torch._inductor")  # found, not imported
_INDUCTOR = _INDUCTOR_SPEC is not None
# prims.fma is registered by inductor_prims; `find_spec` of that submodule would import its parent
_INDUCTOR_PRIMS = _INDUCTOR_SPEC is not None and any(
    os.path.exists(os.path.join(where, "inductor_prims.py"))
    for where in _INDUCTOR_SPEC.submodule_search_locations or ()
)
_PENDING: dict[Any, Any] = {}  # op -> its lowering, until the first trace
_PENDING_LOCK = threading.Lock()


def _inductor_decompositions() -> dict[Any, Any] | None:
    if not _INDUCTOR:  # pragma: no cover - torch builds without inductor
        return None
    importlib.import_module("torch._inductor.inductor_prims")
    return importlib.import_module("torch._inductor.decomposition").decompositions


def _register_lowerings() -> None:
    """Put the pending lowerings in inductor's decomposition table (once)."""
    if not _PENDING:
        return
    with _PENDING_LOCK:
        if not _PENDING:
            return
        table = _inductor_decompositions()
        if table is not None:
            table.update(_PENDING)
            cached = sys.modules["torch._inductor.decomposition"].fast_random_decomps
            getattr(cached, "cache_clear", lambda: None)()  # a copy of the table, cached
        _PENDING.clear()


def _registering(fake: Any) -> Any:
    def registering_fake(*args: Any) -> Any:
        _register_lowerings()
        return fake(*args)

    return registering_fake


def _batch_elementwise(op: Any) -> Any:
    """A vmap rule for an elementwise op with broadcasting: each batch dim to the front."""

    def rule(info: Any, in_dims: Any, *args: Any) -> Any:
        rank = max(x.dim() - (d is not None) for x, d in zip(args, in_dims))
        moved = []
        for x, d in zip(args, in_dims):
            if d is not None:
                x = x.movedim(d, 0)
                x = x.reshape((x.shape[0],) + (1,) * (rank + 1 - x.dim()) + x.shape[1:])
            moved.append(x)
        return op(*moved), 0

    return rule


def _define_op(name: str, kernel: Any, fake: Any, setup: Any, backward: Any, lowering: Any) -> Any:
    """``funcamp::<name>``: an elementwise custom op with ``kernel`` as its eager kernel, an
    autograd formula, a vmap rule, and ``lowering`` in inductor's decomposition table (so
    inductor compiles it as ``lowering`` while other backends run ``kernel``). None on a torch
    without inductor."""
    if not _INDUCTOR:  # pragma: no cover - torch builds without inductor
        return None
    try:
        return getattr(torch.ops.funcamp, name).default  # already defined (a reimported module)
    except (AttributeError, RuntimeError):
        pass
    op_def = torch.library.custom_op(f"funcamp::{name}", kernel, mutates_args=())
    op_def.register_fake(_registering(fake))
    # Differentiable like the ops it stands for (unrolled optimization, learned optimizers).
    op_def.register_autograd(backward, setup_context=setup)
    op = getattr(torch.ops.funcamp, name).default
    # Without a batching rule vmap would run the eager kernel, which inductor compiles as is.
    op_def.register_vmap(_batch_elementwise(op))
    _PENDING[op] = lowering
    return op


def _fma_kernel(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(c, a, b)


def _fma_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    a, b, c = inputs
    ctx.save_for_backward(a, b)
    ctx.shapes = (a.shape, b.shape, c.shape)


def _fma_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a, b = ctx.saved_tensors
    sa, sb, sc = ctx.shapes
    return (grad * b).sum_to_size(sa), (grad * a).sum_to_size(sb), grad.sum_to_size(sc)


def _define_fma() -> Any:
    """``funcamp::fma(a, b, c)``: ``a * b + c`` rounded once, as one op that inductor turns into
    the hardware fused multiply-add (``at::vec::fmadd`` on CPU, ``tl.fma`` on CUDA).

    Inductor lowers ``torch.ops.prims.fma`` to that instruction, but on CPU it lowers
    ``add(alpha=)``/``addcmul``/``lerp`` unfused, and the prim's own eager kernel (run by the
    ``eager``/``aot_eager`` backends) rounds twice. So this op runs ``torch.addcmul`` (fused in
    torch's CPU kernel) wherever it runs as a kernel, and inductor's decomposition table maps it
    to the prim. None on a torch without the prim (the traced path then emulates in float64).
    """
    if not _INDUCTOR_PRIMS:  # pragma: no cover
        return None  # torch builds without inductor (prims.fma is registered by inductor_prims)
    return _define_op(
        "fma",
        _fma_kernel,
        _fma_kernel,
        _fma_setup,
        _fma_backward,
        lambda a, b, c: torch.ops.prims.fma(a, b, c),
    )


def _sqrt_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(output)


def _sqrt_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (out,) = ctx.saved_tensors
    return grad / (2 * out)


#: Elements per chunk of :func:`exact_sqrt` on CPU: a 2 MB float64 scratch (the scratch is
#: the only memory the eager donated Adam step holds beyond torch.optim's; measured as fast as
#: 2**20 elements, faster than 2**16 and than a whole 4M-element leaf at once).
_SQRT_CHUNK = 1 << 18


def _plain_cpu(x: torch.Tensor) -> bool:
    """A plain eager dense CPU tensor nothing differentiates or transforms: in-place float64
    work on a copy of it (rsqrt, reciprocal, a copy into ``out``) is then invisible to
    everything."""
    return (
        plain_eager_tensors([x])
        and x.is_cpu
        and x.layout == torch.strided  # not sparse (rsqrt_ has no sparse kernel)
        and not x.is_nested
        and not dual_level_active()
    )


def exact_sqrt(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The correctly rounded square root of ``x``.

    For float32 it is the root in float64, rounded once. Other dtypes use torch's ``sqrt``.
    ``out`` is a tensor of ``x``'s dtype and shape to write the result into (eager only).
    """
    # Why float64 is enough: a float32 rounding boundary (the midpoint of two float32 neighbours)
    # is at least 2**-51 of sqrt(x) away from it (x - m*m is a nonzero multiple of m's half-ulp
    # squared), and a float64 root within that rounds like the exact one. On CPU torch's float64
    # sqrt kernel is slower than its rsqrt; 1 / (1 / sqrt(x)) (rsqrt then reciprocal, three
    # float64 roundings, within 3 * 2**-53) rounds the same and is faster (checked on all 2**32
    # float32 bit patterns; the NaN of a negative input then has its sign bit set, as the
    # hardware square root inductor uses gives it). A contiguous CPU tensor of more than 2**18
    # elements goes through one 2 MB float64 scratch in chunks, so the root never holds a float64
    # copy of a whole large leaf. Anything but a plain eager dense CPU tensor (one autograd
    # differentiates, under torch.func transforms or torch.compile, sparse or nested, on CUDA)
    # takes torch's float64 sqrt: its derivative, batching rule and layouts are sqrt's.
    if x.dtype != torch.float32:
        return torch.sqrt(x) if out is None else torch.sqrt(x, out=out)
    if not _plain_cpu(x):
        root = torch.sqrt(x.to(torch.float64))
        return root.to(torch.float32) if out is None else out.copy_(root)
    return plain_exact_sqrt(x, out)


def plain_exact_sqrt(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`exact_sqrt` of a float32 tensor the caller knows is a plain eager CPU tensor
    (the eager optimizer path checks that once for all its leaves)."""
    n = x.numel()
    if n > _SQRT_CHUNK and x.is_contiguous() and (out is None or out.is_contiguous()):
        # in chunks through one float64 scratch: a float64 copy of a large leaf would double
        # its memory for a moment (and be mapped in page by page)
        out = torch.empty_like(x) if out is None else out
        flat_x, flat_out = x.view(-1), out.view(-1)
        scratch = torch.empty(_SQRT_CHUNK, dtype=torch.float64)
        for i in range(0, n, _SQRT_CHUNK):
            j = min(i + _SQRT_CHUNK, n)
            part = scratch[: j - i].copy_(flat_x[i:j]).rsqrt_().reciprocal_()
            flat_out[i:j].copy_(part)
        return out
    # In place on `wide`, a fresh float64 copy of ours, then rounded once into float32 (a
    # float32 `out=` of a float64 op would take a float64 temporary of its own: torch's
    # TensorIterator computes in the common dtype, then casts into `out`).
    wide = x.to(torch.float64)
    wide.rsqrt_().reciprocal_()
    return wide.to(torch.float32) if out is None else out.copy_(wide)


def _sqrt_kernel(x: torch.Tensor) -> torch.Tensor:
    return exact_sqrt(x)  # the op's schema: one tensor in, a new one out


def _define_sqrt() -> Any:
    """``funcamp::sqrt(x)``: :func:`exact_sqrt` as a kernel; inductor's decomposition table maps
    it to its own, already exact, ``sqrt``."""
    return _define_op(
        "sqrt",
        _sqrt_kernel,
        torch.empty_like,
        _sqrt_setup,
        _sqrt_backward,
        torch.ops.aten.sqrt.default,
    )


#: ``funcamp::fma`` (None on a torch without inductor's ``prims.fma``).
FUSED_FMA = _define_fma()
#: ``funcamp::sqrt`` (None on a torch without inductor).
EXACT_SQRT = _define_sqrt()
