"""Numerics every layer uses: float32 scalars, math dtypes, and two hints for inductor.

The hints (:func:`hoist_scalar`, :func:`spread`) shape what inductor makes of a per-step scalar.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from funcamp._core.context import compiling

__all__ = [
    "HALF_DTYPES",
    "LEAVES_PER_COPY",
    "f32",
    "hoist_scalar",
    "is_half",
    "math_dtype",
    "spread",
]

#: The half-precision dtypes the low-precision modes and FP8 treat as "half".
HALF_DTYPES = (torch.float16, torch.bfloat16)


def f32(value: float) -> float:
    """A Python float rounded to float32, as torch's kernels round a scalar operand (plain
    Python, so dynamo folds it to a constant)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's range: rounds to an infinity
        return math.copysign(math.inf, value)


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype optimizer math and unscaling run in: float64 for float64, else float32.

    Float16 and bfloat16 values are upcast. GradScaler unscales float64 grads in float64 too.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, returning a tensor already of ``dtype`` without a call.

    The result is the same tensor either way. But dynamo records every ``to`` in its graph even
    when it is a no-op: a node and a fake-tensor run each, per leaf of a train step's trees.
    """
    return x if x.dtype == dtype else x.to(dtype)


def is_half(p: torch.Tensor) -> bool:
    """Whether ``p`` is float16 or bfloat16 (a low-precision mode acts on it)."""
    return p.dtype in HALF_DTYPES


def hoist_scalar(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, marked so that inductor computes it once per step.

    ``x`` is a 0-d step scalar (an unscale factor, a bias-corrected step size). Without the mark
    inductor inlines it into every element's loop. A per-step scalar made of
    ``pow``/``sqrt``/float64 divisions is then recomputed for every vector of every leaf. Its
    CPU heuristic computes a value once when the expression holds a costly op such as ``exp``;
    the never-taken branch below adds one. Outside compilation, off the CPU (a GPU thread
    recomputes a scalar for free) and for non-floating values, ``x`` is returned as is.
    """
    if not compiling() or not x.is_floating_point() or x.device.type != "cpu":
        return x
    return torch.where(torch.isnan(x) & (x > 0), torch.exp(x), x)


# --------------------------------------------------------------------------------------------
# funcamp::copies: step scalars spread over the leaves


def _define_copies() -> Any:
    """``funcamp::copies(x, n)``: ``n`` fresh copies of ``x``, an op inductor cannot see into
    (see :func:`spread`). It has a vmap rule; it is never differentiated (``spread`` keeps a
    tensor that autograd tracks as it is)."""
    try:
        return torch.ops.funcamp.copies.default  # already defined (a reimported module)
    except (AttributeError, RuntimeError):
        pass

    def kernel(x: torch.Tensor, n: int) -> list[torch.Tensor]:
        return [x.clone() for _ in range(n)]

    def fake(x: torch.Tensor, n: int) -> list[torch.Tensor]:
        return [torch.empty_like(x) for _ in range(n)]

    op_def = torch.library.custom_op("funcamp::copies", kernel, mutates_args=())
    op_def.register_fake(fake)
    op = torch.ops.funcamp.copies.default

    def batched(info: Any, in_dims: Any, x: torch.Tensor, n: int) -> Any:
        return list(op(x, n)), [in_dims[0]] * n

    op_def.register_vmap(batched)
    return op


_COPIES = _define_copies()

#: The leaves (consecutive, in flattening order) that share one copy of a step scalar.
LEAVES_PER_COPY = 4


def spread(x: Any, n: int) -> list[Any]:
    """``x`` for each of ``n`` leaves, in a list: ``[x] * n``, with one exception.

    While compiling, a 0-d CPU tensor is copied once for every :data:`LEAVES_PER_COPY` leaves,
    by one ``funcamp::copies`` call. Such a tensor is a step scalar: the unscale factor, the
    skip flag, a learning rate. Values and results are unchanged. Off the CPU (where each copy
    would be a kernel launch), in eager code, for few leaves and for a tensor that autograd
    tracks, ``x`` is shared as is.
    """
    # Why: inductor's fusion search pairs each node with up to 64 later nodes that read a buffer
    # it reads (max_fusion_buffer_group_pairwise_attempts), each pair scored for memory. When
    # every leaf's three or so update kernels read one shared scalar, that is some 3n x 64 pairs
    # in each of the fusion rounds: most of a compiled optimizer step's scheduling time (see
    # docs/internals.md, "Compile time"). A copy per few leaves keeps the search to neighbours;
    # the leaf's own kernels still fuse through the leaf's own buffers. Inductor cannot look
    # through the op, so the copies stay separate buffers; they cost a clone of a 0-d tensor
    # each per step.
    if (
        n <= LEAVES_PER_COPY
        or not isinstance(x, torch.Tensor)
        or not compiling()
        or x.dim() != 0
        or x.device.type != "cpu"
        or (x.requires_grad and torch.is_grad_enabled())
    ):
        return [x] * n
    copies = _COPIES(x, -(-n // LEAVES_PER_COPY))
    return [copies[i // LEAVES_PER_COPY] for i in range(n)]
