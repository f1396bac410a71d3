"""Casting under torch.func transforms, where torch.autocast sees what a function mode does not.

A product with a bias under ``vmap``:

Under ``vmap`` functorch's batching runs before torch.autocast's kernel. So ``linear``,
``addmm``, ``baddbmm`` and ``addbmm`` with a batched argument decompose into a product
(``mm``/``bmm``) and a bias added to it. Autocast casts the product but not the addition. The
bias is added in float32 to the compute-dtype product, and the result is float32. Unbatched,
autocast casts the whole call (bias included), and the result is in the compute dtype. The mode
follows autocast in both places (docs/differences.md says why).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from funcamp._core.context import batched_below, is_batched

__all__ = ["BIAS_PRODUCTS", "cast_with_tangent", "vmapped_bias_product"]

#: The ops whose vmap decomposition leaves the bias outside the cast product.
BIAS_PRODUCTS = frozenset({"linear", "addmm", "baddbmm", "addbmm"})


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype is not torch.float64:
        return x.to(dtype)
    return x


def _addbmm_product(b1: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    return torch.bmm(b1, b2).sum(0)


_PRODUCTS = {"addmm": torch.mm, "baddbmm": torch.bmm, "addbmm": _addbmm_product}


def _decomposed_linear(x: Any, w: Any, b: Any) -> bool:
    """Whether torch.autocast sees this ``linear`` after a decomposition that adds the bias
    apart: batched by the innermost ``vmap``, or under ``grad`` above a ``vmap`` with a 1-d
    input (the only input linear's own C++ body splits into ``matmul`` + ``add``; with more
    dimensions it becomes one ``addmm``, which autocast casts whole, bias included)."""
    if is_batched((x, w, b)):
        return True
    return isinstance(x, torch.Tensor) and x.dim() == 1 and batched_below((x, w, b))


def vmapped_bias_product(
    name: str, dtype: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``name(*args, **kwargs)`` as torch.autocast runs it under ``vmap``, or None.

    None means the call is not such a product with a bias, and the caller casts it as a whole.
    That is the case when it is not decomposed: nothing batched at the innermost ``vmap``, or
    addmm-type ops under ``grad`` above it. It is also the case with no bias, ``beta=0`` or
    unexpected arguments.
    """
    if name == "linear":
        if len(args) + len(kwargs) > 3 or set(kwargs) - {"input", "weight", "bias"}:
            return None
        names = ("input", "weight", "bias")
        full = dict(zip(names, args, strict=False)) | kwargs
        x, w, b = full.get("input"), full.get("weight"), full.get("bias")
        if not isinstance(b, torch.Tensor) or not _decomposed_linear(x, w, b):
            return None
        return torch.add(F.linear(_cast(x, dtype), _cast(w, dtype)), b)
    if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
        return None
    bias, m1, m2 = args
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if beta == 0 or not isinstance(bias, torch.Tensor) or not is_batched(args):
        return None
    product = _PRODUCTS[name](_cast(m1, dtype), _cast(m2, dtype))
    if beta != 1:
        bias = bias * beta
    if name == "addmm" and alpha != 1:
        # functorch's addmm decomposition scales the product inside a float32 add
        # (one rounding); baddbmm's and addbmm's scale it first, in the compute dtype.
        return torch.add(bias, product, alpha=alpha)
    if alpha != 1:
        product = product * alpha
    return torch.add(bias, product)


def cast_with_tangent(x: Any, dtype: torch.dtype) -> Any:
    """The mode's cast under forward-mode AD (``jvp``, ``jacfwd``, ``hessian``, ``linearize``).

    A tensor already in ``dtype`` is copied, so that its tangent is cast too. torch.autocast
    casts the ops of the tangent formulas as well. A primal in ``dtype`` can carry a float32
    tangent (layer_norm's, from a bf16 input and float32 weight). That tangent would meet a bf16
    operand in the next matmul's tangent formula (``expected m1 and m2 to have the same
    dtype``).
    """
    if isinstance(x, torch.Tensor) and x.dtype is dtype and x.is_floating_point():
        return x.to(dtype, copy=True)
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        return type(x)(cast_with_tangent(e, dtype) for e in x)
    return _cast(x, dtype)
