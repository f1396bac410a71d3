"""The FP8 matmul ``amp`` runs for an FP8 call site's ``linear`` or ``addmm``.

The operands are quantized with their scales (current or delayed, :mod:`funcamp.casting.fp8`).
``torch._scaled_mm`` runs forward and backward. Calls FP8 cannot run fall back to the policy.

Workaround of torch internals (docs/internals.md#workarounds):

- Root cause: the FP8 matmul with per-tensor scales is torch._scaled_mm, as torchao calls it.
- Upstream: torch 2.13 also has torch.nn.functional.scaled_mm, whose scaling-recipe arguments
  differ; none filed.
- Why it is safe: called only with the shapes, dtypes and layouts it accepts; other calls fall
  back to the policy (tests/test_fp8.py).
- Tested on: torch 2.13 and 2.14.
- Delete when: the call moves to torch.nn.functional.scaled_mm, tested bit for bit.

"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp.casting.fp8 import (
    current_scale,
    delayed_update,
    inverse_scale,
    quantize,
    site_state,
    tensor_amax,
)
from funcamp.policy.fp8 import E4M3, E5M2, Fp8Config

__all__ = ["FP8_OPS", "Fp8Fallback", "Fp8Record", "prepare_trace", "run_fp8", "scaled_mm"]


def _pad_to_16(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Zero-pad an FP8 matrix so that ``dims`` are multiples of 16 (what CUDA's
    ``_scaled_mm`` needs); the zero byte is +0.0 in both FP8 formats."""
    pad = [0, 0, 0, 0]
    for d in dims:
        extra = -t.shape[d] % 16
        pad[2 * (1 - d) + 1] = extra
    if not any(pad):
        return t
    return torch.nn.functional.pad(t.view(torch.uint8), pad).view(t.dtype)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a @ b) * inv_a * inv_b`` for FP8 ``a`` (m, k) and ``b`` (k, n) via ``torch._scaled_mm``.

    ``a`` is row-major and ``b`` column-major; both are padded to multiples of 16 on CUDA.
    """
    m, n = a.shape[0], b.shape[1]
    if a.is_cuda:
        a = _pad_to_16(a.contiguous(), (1,))
        b = _pad_to_16(b.t().contiguous(), (0, 1)).t()
    else:
        a = a.contiguous()
        b = b.t().contiguous().t()
    out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)
    return out[:m, :n] if out.shape != (m, n) else out


class _CurrentLinear(torch.autograd.Function):
    """``x @ w.T`` in FP8 with current scaling; backward quantizes the output gradient to e5m2
    with its own scale. Returns ``(out, xq, wq)``; the FP8 operands are kept for the backward
    pass (as TransformerEngine and torchao keep them)."""

    @staticmethod
    def forward(
        x: torch.Tensor, w: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, out_dtype: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xq, wq = quantize(x, sx, E4M3), quantize(w, sw, E4M3)
        return scaled_mm(xq, wq.t(), inverse_scale(sx), inverse_scale(sw), out_dtype), xq, wq

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, sx, sw, out_dtype = inputs
        _, xq, wq = output
        ctx.mark_non_differentiable(xq, wq)
        ctx.save_for_backward(xq, wq, sx, sw)
        ctx.dtypes = (x.dtype, w.dtype, out_dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        xq, wq, sx, sw = ctx.saved_tensors
        x_dtype, w_dtype, out_dtype = ctx.dtypes
        g = g.detach()
        sg = current_scale(tensor_amax(g), E5M2)
        dx, dw = _backward_mms(g, sg, xq, wq, sx, sw, out_dtype)
        return dx.to(x_dtype), dw.to(w_dtype), None, None, None


class _DelayedLinear(torch.autograd.Function):
    """``x @ w.T`` in FP8 with delayed scaling; the "gradient" of ``(history, scale)`` is the
    call site's new state (overwrite with gradient). Returns ``(out, xq, wq)``."""

    @staticmethod
    def forward(
        x: torch.Tensor,
        w: torch.Tensor,
        history: torch.Tensor,
        scale: torch.Tensor,
        out_dtype: Any,
        margin: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xq, wq = quantize(x, scale[0], E4M3), quantize(w, scale[1], E4M3)
        out = scaled_mm(xq, wq.t(), inverse_scale(scale[0]), inverse_scale(scale[1]), out_dtype)
        return out, xq, wq

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, history, scale, out_dtype, margin = inputs
        _, xq, wq = output
        ctx.mark_non_differentiable(xq, wq)
        amax = torch.stack([tensor_amax(x), tensor_amax(w)])
        ctx.save_for_backward(xq, wq, amax, history.detach(), scale.detach())
        ctx.dtypes = (x.dtype, w.dtype, out_dtype)
        ctx.margin = margin

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        xq, wq, amax, history, scale = ctx.saved_tensors
        x_dtype, w_dtype, out_dtype = ctx.dtypes
        g = g.detach()
        dx, dw = _backward_mms(g, scale[2], xq, wq, scale[0], scale[1], out_dtype)
        amaxes = torch.cat([amax, tensor_amax(g)[None]])
        new_history, new_scale = delayed_update(history, scale, amaxes, ctx.margin)
        return dx.to(x_dtype), dw.to(w_dtype), new_history, new_scale, None, None


def _backward_mms(
    g: torch.Tensor,
    sg: torch.Tensor,
    xq: torch.Tensor,
    wq: torch.Tensor,
    sx: torch.Tensor,
    sw: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    gq = quantize(g, sg, E5M2)
    inv_g = inverse_scale(sg)
    dx = scaled_mm(gq, wq, inv_g, inverse_scale(sw), out_dtype)  # (m, n) @ (n, k)
    dw = scaled_mm(gq.t(), xq, inv_g, inverse_scale(sx), out_dtype)  # (n, m) @ (m, k)
    return dx, dw


# dynamo inlines an autograd.Function's forward under torch.func.grad and drops its backward
# (silently wrong gradients: pytorch/pytorch#193279); called through allow_in_graph functions,
# the Function reaches AOT autograd whole and its backward is kept (measured, eager and
# inductor). Marked by prepare_trace, not here: allow_in_graph imports dynamo.
def _current_linear(
    x: torch.Tensor, w: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    return _CurrentLinear.apply(x, w, sx, sw, out_dtype)  # (out, xq, wq)


def _delayed_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    history: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype,
    margin: int,
) -> tuple[torch.Tensor, ...]:
    return _DelayedLinear.apply(x, w, history, scale, out_dtype, margin)  # (out, xq, wq)


_MARKED: list[bool] = []
_MARK_LOCK = threading.Lock()


def prepare_trace() -> None:
    """Have dynamo put the FP8 linears in a graph whole (``torch.compiler.allow_in_graph``).

    Called when a policy with FP8 is first given to :func:`funcamp.amp`, so before anything can
    trace an FP8 call. Not at import, since ``allow_in_graph`` imports dynamo. Once per process,
    under a lock.
    """
    with _MARK_LOCK:
        if not _MARKED:
            torch.compiler.allow_in_graph(_current_linear)
            torch.compiler.allow_in_graph(_delayed_linear)
            _MARKED.append(True)


class Fp8Record(NamedTuple):
    """One linear or addmm call that ran in FP8, as :func:`funcamp.trace` records it.

    :func:`funcamp.trace` lists them as ``AmpTrace.fp8``. ``trace[record.index].op`` says which
    op.

    Attributes:
        site: the module path of the call site.
        index: index of the call's :class:`funcamp.OpRecord` in the trace.
        recipe: ``"current"`` or ``"delayed"``.
        input_scale: the float32 scale the input was quantized with.
        weight_scale: the float32 scale the weight was quantized with.
        grad_scale: the output gradient's scale (delayed), or None (current). A current scale
            is computed in the backward pass from the gradient's own amax.
        input_amax: amax of the input (in the compute dtype).
        weight_amax: amax of the weight.
        output_dtype: dtype of the result.

    Example:
        >>> import torch, funcamp
        >>> model = torch.nn.Linear(16, 16)
        >>> policy = funcamp.get_policy("mixed_bfloat16").with_fp8(funcamp.Fp8Recipe.current())
        >>> t = funcamp.trace(lambda x: model(x), policy)(torch.ones(2, 16))
        >>> r = t.fp8[0]
        >>> r.site, r.recipe, float(r.input_scale), t[r.index].input_dtypes
        ('', 'current', 448.0, (torch.float8_e4m3fn, torch.float8_e4m3fn))
    """

    site: str
    index: int
    recipe: str
    input_scale: torch.Tensor
    weight_scale: torch.Tensor
    grad_scale: torch.Tensor | None
    input_amax: torch.Tensor
    weight_amax: torch.Tensor
    output_dtype: torch.dtype


class Fp8Fallback(NamedTuple):
    """A linear or addmm call of an FP8 call site that ran under the policy instead, and why.

    :func:`funcamp.trace` lists them as ``AmpTrace.fp8_fallbacks``. Some calls of a selected
    module cannot be expressed by the scaled FP8 matmul: float64 or integer operands, ``addmm``
    with ``beta``/``alpha`` other than 1, a bias that is not 1-D, ``out=``. Such a call runs by
    the policy's rule for its op, as it would without ``with_fp8``.

    Attributes:
        site: the module path of the call site.
        index: index of the call's :class:`funcamp.OpRecord` in the trace.
        op: ``"linear"`` or ``"addmm"``.
        reason: why it did not run in FP8.

    Example:
        >>> import torch, funcamp
        >>> class Scaled(torch.nn.Module):  # addmm with alpha=0.5: not a plain x @ w + b
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w, self.b = torch.nn.Parameter(torch.ones(4, 2)), torch.nn.Parameter(torch.zeros(2))
        ...     def forward(self, x):
        ...         return torch.addmm(self.b, x, self.w, alpha=0.5)
        >>> m = Scaled()
        >>> policy = funcamp.get_policy("mixed_bfloat16").with_fp8(
        ...     funcamp.Fp8Recipe.current(), modules=(Scaled,))
        >>> t = funcamp.trace(lambda x: m(x), policy)(torch.ones(3, 4))
        >>> t.fp8, t.fp8_fallbacks[0].reason
        ([], 'addmm with beta or alpha other than 1 (FP8 runs input + mat1 @ mat2 only)')
        >>> t[t.fp8_fallbacks[0].index].input_dtypes      # the policy's COMPUTE rule instead
        (torch.bfloat16, torch.bfloat16, torch.bfloat16)
    """

    site: str
    index: int
    op: str
    reason: str


_OPERANDS = {"linear": ("input", "weight", "bias"), "addmm": ("input", "mat1", "mat2")}

_OPTIONS = {"linear": (), "addmm": ("beta", "alpha", "out")}


def _bind(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | str:
    """The arguments of ``op`` by name, or why they are not ones the FP8 matmul takes."""
    names, options = _OPERANDS[op], _OPTIONS[op]
    if len(args) > len(names):
        return f"{op} called with {len(args)} positional arguments"
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if (key in names and key not in bound) or key in options:
            bound[key] = value
        else:
            return f"{op} called with the argument `{key}`"
    return bound


def _is_one(value: Any) -> bool:
    return type(value) in (int, float) and value == 1


def _operands(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any] | str:
    """``(x, w, b)`` of a linear or addmm call as ``F.linear`` takes them (``w`` of shape
    ``(out, in)``: addmm's ``mat2`` transposed, a view), or why the call cannot run in FP8."""
    bound = _bind(op, args, kwargs)
    if isinstance(bound, str):
        return bound
    x: Any
    w: Any
    b: Any
    if op == "linear":
        x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    else:
        if bound.get("out") is not None:
            return "addmm with out= (a call with out= is never cast)"
        if not (_is_one(bound.get("beta", 1)) and _is_one(bound.get("alpha", 1))):
            return "addmm with beta or alpha other than 1 (FP8 runs input + mat1 @ mat2 only)"
        x, w, b = bound.get("mat1"), bound.get("mat2"), bound.get("input")
        if b is None:
            return "addmm without `input`"
    if not (_eligible(x) and _eligible(w) and (b is None or _eligible(b))):
        return (
            f"{op} with an operand that is not a float16, bfloat16 or float32 tensor (float64 "
            "and integer calls run by the policy)"
        )
    if op == "linear":
        if w.dim() != 2 or x.dim() < 1:
            return "linear with a weight that is not 2-D"
        return x, w, b
    if x.dim() != 2 or w.dim() != 2:
        return "addmm with `mat1` or `mat2` not 2-D"
    if b.dim() != 1:
        return (
            f"addmm with a {b.dim()}-D `input` (FP8 takes a 1-D bias, added to every row, as "
            "Conv1D's)"
        )
    return x, w.t(), b


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64


FP8_OPS = frozenset(_OPERANDS)  # the ops an FP8 call site runs in FP8


def run_fp8(
    op: str,
    config: Fp8Config,
    site: str,
    compute_dtype: torch.dtype,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_record: Callable[[tuple[torch.Tensor, ...], torch.Tensor, Fp8Record], None] | None = None,
) -> Any:
    """Run an FP8 call site's ``linear`` or ``addmm`` (``op``) as the scaled FP8 matmul.

    ``addmm(b, x, w)`` is ``linear(x, w.T, b)``, with the same quantization, matmuls and state.
    (``w``'s per-tensor scale does not depend on its layout.) When the call cannot run in FP8,
    it returns an :class:`Fp8Fallback` (``index`` -1), so that the policy's rule applies.
    ``on_record(operands, out, record)`` is called when ``trace`` records.
    """
    operands = _operands(op, args, kwargs)
    if isinstance(operands, str):
        return Fp8Fallback(site, -1, op, operands)
    x, w, b = operands
    x = x.to(compute_dtype)
    x2 = x.reshape(-1, x.shape[-1])
    recipe = config.recipe
    if recipe.stateful:
        history, scale = site_state(site)
        out, xq, wq = _delayed_linear(x2, w, history, scale, compute_dtype, recipe.margin)
        scales = (scale[0].detach(), scale[1].detach(), scale[2].detach())
    else:
        sx = current_scale(tensor_amax(x2), E4M3)
        sw = current_scale(tensor_amax(w), E4M3)
        out, xq, wq = _current_linear(x2, w, sx, sw, compute_dtype)
        scales = (sx, sw, None)
    out = out.reshape(*x.shape[:-1], w.shape[0])
    if b is not None:
        out = out + b.to(compute_dtype)
    if on_record is not None:
        record = Fp8Record(
            site, -1, recipe.kind, *scales, tensor_amax(x2), tensor_amax(w), compute_dtype
        )
        on_record((xq, wq), out, record)
    return out
