"""Python copies of torch's C++ composites, so the amp mode sees the ops they are made of.

torch.autocast applies its lists at the aten level. Some C++ composites are not on a list
(``einsum``, ``tensordot``, ``cov``, ``linalg.matrix_power``, ``linalg.pinv``, ``bilinear``,
``F.pad``'s reflect mode, the RNN cells ...). When one calls a listed op inside its kernel
(``bmm``, ``mm``, ``matmul``, ``reflection_pad2d``), autocast casts that inner call and nothing
else. A :class:`torch.overrides.TorchFunctionMode` sees the composite only from outside.

Each copy here makes the calls the C++ kernel of torch 2.13 makes, one torch call at a time
(same ops, same shapes, same order). So the amp mode, re-entering a copy, casts exactly what
autocast casts. When nothing is cast, a copy is bit-identical to the C++ composite. When the
table is torch's list, it is bit-identical to torch.autocast. ``tests/test_opinfo.py`` pins both
over torch's OpInfo samples.

A copy returns ``NotImplemented`` before making any torch call when its inputs are outside what
it reproduces. That is: no float16/bfloat16/float32 tensor to cast, an ``out=`` tensor, or
arguments the C++ kernel would refuse. The mode then runs the op as called, and torch raises its
own error. ``REACHES`` names the listed ops each copy may call. The mode re-enters a copy only
under a table that lists one of them.

Workaround of torch internals (docs/upstream.md#cpp-composites):

- Root cause: torch.autocast casts at the aten level, so a C++ composite (einsum, tensordot,
  cov, the RNN cells) has its inner listed calls cast. A TorchFunctionMode sees only the outer
  call.
- Upstream: none; a function mode cannot see inside C++ composites by design. The write-up is
  docs/upstream.md#cpp-composites.
- Why it is safe: each copy makes the calls torch 2.13's C++ kernel makes, and returns
  NotImplemented outside what it reproduces. tests/test_opinfo.py pins both the uncast and the
  autocast results.
- Tested on: torch 2.13 and 2.14 (the OpInfo suite runs on both in CI).
- Delete when: torch offers a Python-visible decomposition hook for those composites under a
  function mode, or funcamp casts at the dispatcher level.

"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from funcamp.casting.cpp_einsum import (
    all_strided,
    castable,
    einsum,
    einsum_public,
    sumproduct_pair,
)

__all__ = ["CPP_COMPOSITES", "REACHES"]

_VF = torch._C._VariableFunctions


# -- tensordot and inner -------------------------------------------------------------------------
def _wrapped(dims: Sequence[int], ndim: int) -> list[int] | None:
    out = [d + ndim if d < 0 else d for d in dims]
    if any(not 0 <= d < ndim for d in out) or len(set(out)) != len(out):
        return None
    return out


def tensordot(a: Any, b: Any, dims_a: Any, dims_b: Any, *, out: Any = None) -> Any:
    """``torch._C._VariableFunctions.tensordot``: what ``torch.tensordot`` calls."""
    if out is not None or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return NotImplemented
    if not (castable(a) or castable(b)) or a.dtype != b.dtype or not all_strided(a, b):
        return NotImplemented
    dims_a, dims_b = list(dims_a), list(dims_b)
    wrapped_a, wrapped_b = _wrapped(dims_a, a.dim()), _wrapped(dims_b, b.dim())
    if len(dims_a) != len(dims_b) or wrapped_a is None or wrapped_b is None:
        return NotImplemented
    for da, db in zip(wrapped_a, wrapped_b):
        if a.size(da) != 1 and b.size(db) != 1 and a.size(da) != b.size(db):
            return NotImplemented
    csize = 1
    t1, t2 = a, b
    for da, db in zip(dims_a, dims_b):
        s1, s2 = a.size(da), b.size(db)
        if s2 == 1:  # broadcast dimensions are summed right away
            t1 = t1.sum(da, True, dtype=t1.dtype)
        elif s1 == 1:
            t2 = t2.sum(db, True, dtype=t2.dtype)
        else:
            csize *= s1
    kept_a = [i for i in range(a.dim()) if i not in wrapped_a]
    kept_b = [i for i in range(b.dim()) if i not in wrapped_b]
    size1 = size2 = 1
    for i in kept_a:
        size1 *= t1.size(i)
    for i in kept_b:
        size2 *= t2.size(i)
    rsizes = [t1.size(i) for i in kept_a] + [t2.size(i) for i in kept_b]
    t1 = t1.permute(kept_a + dims_a)
    t2 = t2.permute(dims_b + kept_b)
    if size1 != 1 or size2 != 1:
        return torch.mm(t1.reshape(size1, csize), t2.reshape(csize, size2)).reshape(rsizes)
    if t1.is_contiguous() and t2.is_contiguous():
        return torch.dot(t1.flatten(), t2.flatten()).reshape(rsizes)
    return (t1.squeeze() * t2.squeeze()).sum(dtype=t1.dtype).reshape(rsizes)


def tensordot_public(a: Any, b: Any, dims: Any = 2, out: Any = None) -> Any:
    """``torch.tensordot``: ``dims`` parsed as ``torch.functional.tensordot`` does, then
    :func:`tensordot` (a tensor ``dims`` is declined)."""
    if out is not None or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return NotImplemented
    if isinstance(dims, (tuple, list)) and len(dims) == 2:
        dims_a, dims_b = dims
    elif isinstance(dims, int) and not isinstance(dims, bool):
        if dims < 0 or dims > min(a.dim(), b.dim()):
            return NotImplemented
        dims_a, dims_b = list(range(-dims, 0)), list(range(dims))
    else:
        return NotImplemented
    if not all(isinstance(d, int) for d in (*dims_a, *dims_b)):
        return NotImplemented
    return tensordot(a, b, dims_a, dims_b)


def inner(self: Any, other: Any, *, out: Any = None) -> Any:
    """``torch.inner`` / ``Tensor.inner``: a product with a 0-d operand, else a tensordot."""
    if out is not None or not (isinstance(self, torch.Tensor) and isinstance(other, torch.Tensor)):
        return NotImplemented
    if not (castable(self) or castable(other)) or not all_strided(self, other):
        return NotImplemented
    if self.dim() == 0 or other.dim() == 0:
        return torch.mul(self, other)
    if self.size(-1) != other.size(-1):
        return NotImplemented
    return torch.tensordot(self, other, ([-1], [-1]))


# -- bilinear (through _trilinear's loop) ---------------------------------------------------------
def bilinear(input1: Any, input2: Any, weight: Any, bias: Any = None) -> Any:
    """``torch.bilinear`` (``F.bilinear``): ``_trilinear``'s unrolled loop of two ``bmm`` pairs
    per output feature, accumulated into a zero tensor of the input dtype, then the bias."""
    tensors = [input1, input2, weight] + ([bias] if bias is not None else [])
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not all_strided(*tensors):
        return NotImplemented
    if not castable(input1) or any(t.dtype != input1.dtype for t in tensors):
        return NotImplemented
    if input1.dim() != input2.dim() or input1.dim() < 1 or weight.dim() != 3:
        return NotImplemented
    if input1.shape[:-1] != input2.shape[:-1] or (input1.size(-1), input2.size(-1)) != (
        weight.size(1),
        weight.size(2),
    ):
        return NotImplemented
    if bias is not None and (bias.dim() != 1 or bias.size(0) != weight.size(0)):
        return NotImplemented
    features = weight.size(0)
    i1 = input1.reshape(-1, input1.size(-1)).unsqueeze(1).unsqueeze(3)  # [B, 1, I, 1]
    i2 = weight.unsqueeze(0)  # [1, O, I, J]
    i3 = input2.reshape(-1, input2.size(-1)).unsqueeze(1).unsqueeze(2)  # [B, 1, 1, J]
    batch = i1.size(0)
    output = torch.zeros([batch, features, 1, 1], dtype=i1.dtype, device=i1.device)
    if i1.numel() != 0 and i2.numel() != 0 and i3.numel() != 0 and features > 0:
        parts = []
        for k in range(features):
            buf = sumproduct_pair(i1, i2.narrow(1, k, 1), [2])
            buf = sumproduct_pair(buf, i3, [3])
            parts.append(output.narrow(1, k, 1).add(buf))  # add_ into the zeros, out of place
        output = torch.cat(parts, 1)
    result = output.squeeze(3).squeeze(2).reshape([*input1.shape[:-1], features])
    return result + bias if bias is not None else result


# -- cov and corrcoef ------------------------------------------------------------------------------
def _weights_ok(w: Any, integral: bool, num_observations: int) -> bool:
    if not isinstance(w, torch.Tensor) or w.dim() > 1 or w.numel() != num_observations:
        return False
    is_integral = not (w.is_floating_point() or w.is_complex() or w.dtype == torch.bool)
    return is_integral if integral else w.is_floating_point()


def _check_nonnegative(w: torch.Tensor, name: str, num_observations: int) -> None:
    if num_observations != 0 and not bool(w.min().ge(0)):
        raise RuntimeError(f"cov(): {name} cannot be negative")


_COV_DOF = (
    "cov(): degrees of freedom is <= 0. Correction should be strictly less than the number of "
    "observations."
)


def _cov_norm_factor(
    w: Any, w_sum: Any, correction: int, fweights: Any, aweights: Any, n: int, device: Any
) -> torch.Tensor:
    if w is None:  # known without looking at a tensor: no host sync, and dynamo traces it
        if n - correction <= 0:
            warnings.warn(_COV_DOF, UserWarning, stacklevel=3)
        return torch.scalar_tensor(max(n - correction, 0), dtype=torch.long, device=device)
    if correction == 0:
        norm_factor = w_sum
    elif aweights is None:
        norm_factor = w_sum - correction
    elif fweights is None and n == 1 and correction == 1:
        norm_factor = torch.scalar_tensor(0, dtype=torch.long, device=device)
    else:
        norm_factor = w_sum - correction * (w * aweights).sum() / w_sum
    if bool(norm_factor.le(0)):
        warnings.warn(_COV_DOF, UserWarning, stacklevel=3)
        norm_factor.zero_()
    return norm_factor


def cov(input: Any, *, correction: Any = 1, fweights: Any = None, aweights: Any = None) -> Any:
    """``torch.cov`` / ``Tensor.cov``: weighted mean, then ``mm`` of the centred observations."""
    if not castable(input) or input.dim() > 2 or not all_strided(input, fweights, aweights):
        return NotImplemented
    if not isinstance(correction, int) or isinstance(correction, bool):
        return NotImplemented
    x = input.view(1, -1) if input.dim() < 2 else input
    n = x.size(1)
    if fweights is not None and not _weights_ok(fweights, True, n):
        return NotImplemented
    if aweights is not None and not _weights_ok(aweights, False, n):
        return NotImplemented
    w = None
    if fweights is not None:
        _check_nonnegative(fweights, "fweights", n)
        w = fweights
    if aweights is not None:
        _check_nonnegative(aweights, "aweights", n)
        w = aweights if w is None else w * aweights
    if w is None:
        w_sum = torch.scalar_tensor(n, dtype=torch.long, device=x.device)
    else:
        w_sum = w.sum()
        if not bool(w_sum.ne(0)):
            raise RuntimeError("cov(): weights sum to zero, can't be normalized")
    avg = (x * w if w is not None else x).sum(1) / w_sum
    norm_factor = _cov_norm_factor(w, w_sum, correction, fweights, aweights, n, x.device)
    if n == 1 and (fweights is not None) != (aweights is not None):
        x.zero_()  # as torch does: the input minus its one-observation mean is zero
    else:
        x = x - avg.unsqueeze(1)
    c = torch.mm(x, (x * w if w is not None else x).t().conj())
    return torch.true_divide(c, norm_factor).squeeze()


def corrcoef(input: Any) -> Any:
    """``torch.corrcoef`` / ``Tensor.corrcoef``: ``cov`` normalized by its diagonal."""
    if not castable(input) or input.dim() > 2 or not all_strided(input):
        return NotImplemented
    c = torch.cov(input)
    if c.dim() == 0:
        return c / c  # nan for nan, inf or 0, else 1
    stddev = torch.sqrt(c.diagonal())
    c = c / stddev.view(-1, 1)
    c = c / stddev.view(1, -1)
    return c.clip(-1, 1)


# -- matrix_power --------------------------------------------------------------------------------
def matrix_power(input: Any, n: Any, *, out: Any = None) -> Any:
    """``torch.linalg.matrix_power`` / ``torch.matrix_power`` / ``Tensor.matrix_power``:
    ``matmul`` by binary decomposition of ``n`` (an inverse first for ``n < 0``)."""
    if out is not None or not castable(input) or not isinstance(n, int) or isinstance(n, bool):
        return NotImplemented
    if input.dim() < 2 or input.size(-1) != input.size(-2) or not all_strided(input):
        return NotImplemented
    if n == 0:  # the identity, through a clone of the input (kept in the autograd graph)
        eye = torch.eye(input.size(-2), dtype=input.dtype, device=input.device)
        return input.clone(memory_format=torch.contiguous_format).copy_(eye)
    if n == 1:
        return input.clone(memory_format=torch.contiguous_format)
    if n == -1:
        return torch.linalg.inv(input)
    a = torch.linalg.inv(input) if n < 0 else input
    n = abs(n)
    if n == 2:
        return torch.matmul(a, a)
    if n == 3:
        return torch.matmul(torch.matmul(a, a), a)
    z: torch.Tensor | None = None
    result: torch.Tensor | None = None
    while n > 0:
        bit, n = n % 2, n // 2
        z = a if z is None else torch.matmul(z, z)
        if bit:
            result = z if result is None else torch.matmul(result, z)
    return result


# -- pinv ------------------------------------------------------------------------------------------
def _pinv_tolerances(input: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """(atol, rtol, hermitian) as float64 tensors, resolving linalg_pinv's overloads; or None."""
    names = set(kwargs) - {"hermitian"}
    if len(args) > 2 or (args and names):
        return None
    hermitian = args[1] if len(args) > 1 else kwargs.get("hermitian", False)
    if not isinstance(hermitian, bool):
        return None
    f64 = {"dtype": torch.float64, "device": input.device}
    if args or "rcond" in names:  # linalg_pinv(input, rcond): rcond is the relative tolerance
        if names - {"rcond"}:
            return None
        rcond = args[0] if args else kwargs["rcond"]
        if isinstance(rcond, torch.Tensor):
            return torch.zeros((), **f64), rcond, hermitian
        if not isinstance(rcond, (int, float)) or isinstance(rcond, bool):
            return None
        return torch.full((), 0.0, **f64), torch.full((), float(rcond), **f64), hermitian
    if names - {"atol", "rtol"}:
        return None
    atol, rtol = kwargs.get("atol"), kwargs.get("rtol")
    default_rtol = torch.finfo(input.dtype).eps * max(input.size(-1), input.size(-2))
    if isinstance(atol, torch.Tensor) or isinstance(rtol, torch.Tensor):
        if not all(t is None or isinstance(t, torch.Tensor) for t in (atol, rtol)):
            return None
        atol_t = atol if atol is not None else torch.zeros((), **f64)
        if rtol is None:
            rtol = torch.full((), default_rtol, **f64)
            if atol is not None:
                rtol = torch.where(atol > 0, torch.zeros((), **f64), rtol)
        return atol_t, rtol, hermitian
    if not all(t is None or isinstance(t, (int, float)) for t in (atol, rtol)):
        return None
    if rtol is None:
        rtol = 0.0 if atol is not None and atol > 0.0 else default_rtol
    atol = 0.0 if atol is None else atol
    return torch.full((), float(atol), **f64), torch.full((), float(rtol), **f64), hermitian


def pinv(input: Any, *args: Any, out: Any = None, **kwargs: Any) -> Any:
    """``torch.linalg.pinv``: the SVD (or ``eigh``), singular values below the tolerance
    dropped, then a ``matmul`` of the factors."""
    if out is not None or not isinstance(input, torch.Tensor) or input.dtype != torch.float32:
        return NotImplemented
    if input.dim() < 2 or not all_strided(input):
        return NotImplemented
    tolerances = _pinv_tolerances(input, args, kwargs)
    if tolerances is None:
        return NotImplemented
    atol, rtol, hermitian = tolerances
    if input.numel() == 0:
        u, s, v = input.svd()
        return torch.matmul(v * s.reciprocal().unsqueeze(-2), u.mH)
    if not hermitian:
        u, s, v = input.svd()
        largest = torch.narrow(s, -1, 0, 1)  # singular values come sorted, largest first
        tol = torch.max(atol.unsqueeze(-1), rtol.unsqueeze(-1) * largest)
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        s_inv = torch.where(s > tol, s.reciprocal(), zero).to(input.dtype)
        return torch.matmul(v * s_inv.unsqueeze(-2), u.mH)
    s, u = torch.linalg.eigh(input)
    s_abs = s.abs()
    tol = torch.max(atol.unsqueeze(-1), rtol.unsqueeze(-1) * s_abs.amax(-1, True))
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    s_inv = torch.where(s_abs > tol, s.reciprocal(), zero).to(input.dtype)
    return torch.matmul(u * s_inv.unsqueeze(-2), u.mH)


def pinverse(input: Any, rcond: Any = 1e-15) -> Any:
    """``torch.pinverse`` / ``Tensor.pinverse``: ``linalg.pinv`` with ``rcond`` relative."""
    if not isinstance(rcond, (int, float)) or isinstance(rcond, bool):
        return NotImplemented
    return torch.linalg.pinv(input, float(rcond), False)


# -- pad -----------------------------------------------------------------------------------------
_PAD_KERNELS = {
    ("reflect", 1): torch._C._nn.reflection_pad1d,
    ("reflect", 2): torch._C._nn.reflection_pad2d,
    ("reflect", 3): torch._C._nn.reflection_pad3d,
    ("replicate", 1): torch._C._nn.replication_pad1d,
    ("replicate", 2): torch._C._nn.replication_pad2d,
    ("replicate", 3): torch._C._nn.replication_pad3d,
}


def pad(input: Any, pad: Any, mode: Any = "constant", value: Any = None) -> Any:
    """``torch._C._nn.pad`` (what ``F.pad`` calls): reflect and replicate go to their kernels."""
    if mode not in ("reflect", "replicate") or not castable(input) or not all_strided(input):
        return NotImplemented
    if value not in (None, 0) or not isinstance(pad, (list, tuple)) or len(pad) % 2:
        return NotImplemented
    k = len(pad) // 2
    kernel = _PAD_KERNELS.get((mode, k))
    if kernel is None or input.dim() not in (k + 1, k + 2):
        return NotImplemented
    return kernel(input, pad)


# -- RNN cells -------------------------------------------------------------------------------------
def _cell_ok(
    input: Any, hx: Any, w_ih: Any, w_hh: Any, biases: tuple[Any, ...], gates: int
) -> bool:
    """Whether the cell's arguments are the 2-d CPU tensors its CPU kernel takes."""
    tensors = (input, hx, w_ih, w_hh)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in tensors):
        return False
    if not all(b is None or isinstance(b, torch.Tensor) for b in biases):
        return False
    if input.is_cuda or not all_strided(*tensors, *biases) or not castable(input):
        return False
    hidden = w_hh.size(1)
    return (
        input.size(1) == w_ih.size(1)
        and input.size(0) == hx.size(0)
        and hx.size(1) == hidden
        and w_ih.size(0) == w_hh.size(0) == gates * hidden
    )


def gru_cell(input: Any, hx: Any, w_ih: Any, w_hh: Any, b_ih: Any = None, b_hh: Any = None) -> Any:
    """``torch.gru_cell`` (``nn.GRUCell``) on CPU: two ``linear`` calls, then the gates, in
    place on the chunks of the linears' outputs as ATen's ``GRUCell`` does."""
    if not _cell_ok(input, hx, w_ih, w_hh, (b_ih, b_hh), 3):
        return NotImplemented
    igates = F.linear(input, w_ih, b_ih).unsafe_chunk(3, 1)
    hgates = F.linear(hx, w_hh, b_hh).unsafe_chunk(3, 1)
    reset_gate = hgates[0].add_(igates[0]).sigmoid_()
    input_gate = hgates[1].add_(igates[1]).sigmoid_()
    new_gate = igates[2].add(hgates[2].mul_(reset_gate)).tanh_()
    return (hx - new_gate).mul_(input_gate).add_(new_gate)


def lstm_cell(input: Any, hx: Any, w_ih: Any, w_hh: Any, b_ih: Any = None, b_hh: Any = None) -> Any:
    """``torch.lstm_cell`` (``nn.LSTMCell``) on CPU: the hidden and input ``linear`` calls
    summed in place, then the gates; the cell state stays in its own dtype."""
    if not isinstance(hx, (list, tuple)) or len(hx) != 2:
        return NotImplemented
    h, c = hx
    if not _cell_ok(input, h, w_ih, w_hh, (b_ih, b_hh), 4):
        return NotImplemented
    if not isinstance(c, torch.Tensor) or c.shape != h.shape or not all_strided(c):
        return NotImplemented
    gates = F.linear(h, w_hh, b_hh).add_(F.linear(input, w_ih, b_ih))
    ingate, forgetgate, cellgate, outgate = gates.unsafe_chunk(4, 1)
    ingate, forgetgate = ingate.sigmoid_(), forgetgate.sigmoid_()
    cellgate, outgate = cellgate.tanh_(), outgate.sigmoid_()
    cy = (forgetgate * c).add_(ingate * cellgate)
    return outgate * cy.tanh(), cy


def _simple_cell(activation: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    def cell(input: Any, hx: Any, w_ih: Any, w_hh: Any, b_ih: Any = None, b_hh: Any = None) -> Any:
        if not _cell_ok(input, hx, w_ih, w_hh, (b_ih, b_hh), 1):
            return NotImplemented
        return activation(F.linear(hx, w_hh, b_hh).add_(F.linear(input, w_ih, b_ih)))

    return cell


#: ``torch.rnn_tanh_cell`` / ``torch.rnn_relu_cell`` (``nn.RNNCell``) on CPU
rnn_tanh_cell = _simple_cell(torch.tanh)
rnn_relu_cell = _simple_cell(torch.relu)
rnn_tanh_cell.__name__ = rnn_tanh_cell.__qualname__ = "rnn_tanh_cell"
rnn_relu_cell.__name__ = rnn_relu_cell.__qualname__ = "rnn_relu_cell"


# -- registry ------------------------------------------------------------------------------------
_MM = frozenset({"mm", "matmul", "bmm", "dot", "tensordot"})
_CELL = frozenset({"linear", "addmm", "sigmoid", "tanh", "relu", "mul", "add", "sub"})

#: copy -> the entry points (as the mode sees them) it stands for
_ENTRY_POINTS: dict[Callable[..., Any], tuple[Any, ...]] = {
    einsum: (_VF.einsum,),
    einsum_public: (torch.einsum,),
    tensordot: (_VF.tensordot,),
    tensordot_public: (torch.tensordot,),
    inner: (torch.inner, torch.Tensor.inner),
    bilinear: (torch.bilinear,),
    cov: (torch.cov, torch.Tensor.cov),
    corrcoef: (torch.corrcoef, torch.Tensor.corrcoef),
    matrix_power: (torch.linalg.matrix_power, torch.matrix_power, torch.Tensor.matrix_power),
    pinv: (torch.linalg.pinv,),
    pinverse: (torch.pinverse, torch.Tensor.pinverse),
    pad: (torch._C._nn.pad,),
    gru_cell: (torch.gru_cell,),
    lstm_cell: (torch.lstm_cell,),
    rnn_tanh_cell: (torch.rnn_tanh_cell,),
    rnn_relu_cell: (torch.rnn_relu_cell,),
}

#: copy -> the listed ops (canonical names) it may call; the mode re-enters a copy only under
#: a table listing one of them.
REACHES: dict[Callable[..., Any], frozenset[str]] = {
    einsum: frozenset({"bmm", "mul", "sum"}),
    einsum_public: frozenset({"bmm", "mul", "sum"}),
    tensordot: frozenset({"mm", "dot", "sum"}),
    tensordot_public: frozenset({"mm", "dot", "sum"}),
    inner: frozenset({"tensordot", "mm", "dot", "sum", "mul"}),
    bilinear: frozenset({"bmm", "mul", "sum", "cat"}),
    cov: frozenset({"mm", "sum", "true_divide"}),
    corrcoef: frozenset({"cov", "mm", "sum"}),
    matrix_power: _MM | {"linalg_inv"},
    pinv: _MM | {"svd", "linalg_eigh"},
    pinverse: _MM | {"svd", "linalg_eigh", "linalg_pinv"},
    pad: frozenset(f"{kind}_pad{k}d" for kind in ("reflection", "replication") for k in (1, 2, 3)),
    gru_cell: _CELL,
    lstm_cell: _CELL,
    rnn_tanh_cell: _CELL,
    rnn_relu_cell: _CELL,
}

#: (``__module__``, ``__name__``) of each entry point, as the mode reads them -> copy
CPP_COMPOSITES: dict[tuple[str | None, str], Callable[..., Any]] = {
    (getattr(fn, "__module__", None), fn.__name__): copy
    for copy, fns in _ENTRY_POINTS.items()
    for fn in fns
}
