"""Python twins of torch's C++ composites, so the amp mode sees the ops they are made of.

torch.autocast applies its lists at the aten level: when a C++ composite that is not on a list
(``einsum``, ``tensordot``, ``cov``, ``linalg.matrix_power``, ``linalg.pinv``, ``bilinear``,
``F.pad``'s reflect mode ...) calls a listed op inside its kernel (``bmm``, ``mm``, ``matmul``,
``reflection_pad2d``), autocast casts that inner call and nothing else. A
:class:`torch.overrides.TorchFunctionMode` sees the composite only from outside. Each twin here
makes, one torch call at a time, the calls the C++ kernel of torch 2.13 makes (same ops, same
shapes, same order), so the amp mode, re-entering a twin, casts exactly what autocast casts:
bit-identical to the C++ composite when nothing is cast, and to torch.autocast when the table
is torch's list (``tests/test_opinfo.py`` pins both over torch's OpInfo samples).

A twin returns ``NotImplemented`` before making any torch call when its inputs are outside what
it reproduces (no float16/bfloat16/float32 tensor to cast, an ``out=`` tensor, arguments the
C++ kernel would refuse): the mode then runs the op as called, and torch raises its own error.
``REACHES`` names the listed ops each twin may call: the mode re-enters a twin only under a
table that lists one of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.backends.opt_einsum

__all__ = ["REACHES", "TWINS"]

_VF = torch._C._VariableFunctions
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)
_LETTERS = 26


def _castable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _CASTABLE


def _strided(*xs: Any) -> bool:
    return all(x.layout == torch.strided for x in xs if isinstance(x, torch.Tensor))


# -- sumproduct_pair: einsum's and _trilinear's pairwise contraction ----------------------------
def _sumproduct_pair(left: torch.Tensor, right: torch.Tensor, sum_dims: list[int]) -> torch.Tensor:
    """``(left * right).sum(sum_dims, keepdim=True)`` through one ``bmm``, as ATen's
    ``sumproduct_pair``."""
    if not sum_dims:
        return torch.mul(left, right)
    ndim = left.dim()
    summed = set(sum_dims)
    lro: list[int] = []
    lo: list[int] = []
    ro: list[int] = []
    lro_size = lo_size = ro_size = sum_size = 1
    for i in range(ndim):
        sl, sr = left.size(i) != 1, right.size(i) != 1
        if i in summed:
            if sl and sr:
                sum_size *= left.size(i)
            elif sl:
                left = left.sum(i, True)
            elif sr:
                right = right.sum(i, True)
        elif sl and sr:
            lro.append(i)
            lro_size *= left.size(i)
        elif sl:
            lo.append(i)
            lo_size *= left.size(i)
        else:
            ro.append(i)
            ro_size *= right.size(i)
    out_size = [left.size(d) for d in lro] + [left.size(d) for d in lo]
    out_size += [1] * len(sum_dims) + [right.size(d) for d in ro]
    order = lro + lo + sum_dims + ro
    inverse = [0] * len(order)
    for position, d in enumerate(order):
        inverse[d] = position
    left = left.permute(order).reshape(lro_size, lo_size, sum_size)
    right = right.permute(lro + sum_dims + ro + lo).reshape(lro_size, sum_size, ro_size)
    return torch.bmm(left, right).view(out_size).permute(inverse)


# -- einsum --------------------------------------------------------------------------------------
_ELLIPSIS = 2 * _LETTERS


def _subscript(label: str) -> int | None:
    if "A" <= label <= "Z":
        return ord(label) - ord("A")
    if "a" <= label <= "z":
        return ord(label) - ord("a") + _LETTERS
    return None


def _einsum_labels(lhs: str, num_ops: int) -> list[list[int]] | None:
    """The subscripts of each operand (``_ELLIPSIS`` for ``...``), or None if malformed."""
    labels: list[list[int]] = [[] for _ in range(num_ops)]
    current, ellipsis, i = 0, False, 0
    while i < len(lhs):
        char = lhs[i]
        if char == ".":
            if ellipsis or lhs[i : i + 3] != "..." or i + 2 >= len(lhs):
                return None
            labels[current].append(_ELLIPSIS)
            ellipsis, i = True, i + 2
        elif char == ",":
            current += 1
            if current >= num_ops:
                return None
            ellipsis = False
        elif char != " ":
            label = _subscript(char)
            if label is None:
                return None
            labels[current].append(label)
        i += 1
    return labels if current == num_ops - 1 else None


class _EinsumPlan:
    """Where each label goes in the aligned shape, and how many operands have it (non-1)."""

    def __init__(self) -> None:
        self.perm_index: list[int] = [-1] * (2 * _LETTERS)
        self.out_dims = 0
        self.total_dims = 0
        self.ell_index = 0
        self.ell_dims = 0
        self.counts: list[int] = []
        # per operand: the diagonals to take, then the permutation (with unsqueezes)
        self.steps: list[tuple[list[tuple[int, int]], list[int], list[int]]] = []


def _einsum_output(plan: _EinsumPlan, rhs: str | None, label_count: list[int]) -> bool:
    index = 0
    ell_out = False
    if rhs is None:  # implicit output: the ellipsis, then the labels seen once, sorted
        index, ell_out = plan.ell_dims, True
        for label in range(2 * _LETTERS):
            if label_count[label] == 1:
                plan.perm_index[label] = index
                index += 1
    else:
        i = 0
        while i < len(rhs):
            char = rhs[i]
            if char == ".":
                if ell_out or rhs[i : i + 3] != "..." or i + 2 >= len(rhs):
                    return False
                plan.ell_index, index, ell_out, i = index, index + plan.ell_dims, True, i + 2
            elif char != " ":
                label = _subscript(char)
                if label is None or label_count[label] == 0 or plan.perm_index[label] != -1:
                    return False
                plan.perm_index[label] = index
                index += 1
            i += 1
    plan.out_dims = index
    if not ell_out:
        plan.ell_index, index = index, index + plan.ell_dims
    for label in range(2 * _LETTERS):
        if label_count[label] > 0 and plan.perm_index[label] == -1:
            plan.perm_index[label] = index
            index += 1
    plan.total_dims = index
    return True


def _einsum_align(plan: _EinsumPlan, labels: list[list[int]], shapes: list[list[int]]) -> bool:
    """Per operand: diagonals for repeated labels and the aligning permutation (shapes only)."""
    label_size = [1] * (2 * _LETTERS)
    ell_sizes = [1] * plan.ell_dims
    plan.counts = [0] * plan.total_dims
    for op_labels, shape in zip(labels, shapes):
        ndim = len(shape) - (len(op_labels) - 1)
        permutation = [-1] * plan.total_dims
        diagonals: list[tuple[int, int]] = []
        dim = 0
        for s in op_labels:
            if s == _ELLIPSIS:
                for j in range(plan.ell_dims - ndim, plan.ell_dims):
                    if shape[dim] != 1:
                        if ell_sizes[j] not in (1, shape[dim]):
                            return False
                        ell_sizes[j] = shape[dim]
                        plan.counts[plan.ell_index + j] += 1
                    permutation[plan.ell_index + j] = dim
                    dim += 1
            elif permutation[plan.perm_index[s]] == -1:
                if shape[dim] != 1:
                    if label_size[s] not in (1, shape[dim]):
                        return False
                    label_size[s] = shape[dim]
                    plan.counts[plan.perm_index[s]] += 1
                permutation[plan.perm_index[s]] = dim
                dim += 1
            else:  # a repeated label: its diagonal replaces dimension `dim`
                previous = permutation[plan.perm_index[s]]
                if shape[dim] != shape[previous]:
                    return False
                diagonals.append((previous, dim))
                del shape[dim]
        unsqueezed: list[int] = []
        for k, value in enumerate(permutation):
            if value == -1:
                unsqueezed.append(dim)
                permutation[k] = dim
                dim += 1
        plan.steps.append((diagonals, unsqueezed, permutation))
    return True


def _einsum_plan(equation: str, operands: Sequence[torch.Tensor]) -> _EinsumPlan | None:
    arrow = equation.find("->")
    lhs = equation if arrow < 0 else equation[:arrow]
    labels = _einsum_labels(lhs, len(operands))
    if labels is None:
        return None
    plan = _EinsumPlan()
    label_count = [0] * (2 * _LETTERS)
    for op_labels, operand in zip(labels, operands):
        named = len(op_labels) - (_ELLIPSIS in op_labels)
        if _ELLIPSIS in op_labels:
            plan.ell_dims = max(plan.ell_dims, operand.dim() - named)
        if named > operand.dim() or (_ELLIPSIS not in op_labels and named != operand.dim()):
            return None
        for label in op_labels:
            if label != _ELLIPSIS:
                label_count[label] += 1
    if not _einsum_output(plan, None if arrow < 0 else equation[arrow + 2 :], label_count):
        return None
    if not _einsum_align(plan, labels, [list(op.shape) for op in operands]):
        return None
    return plan


def _einsum_contract(
    plan: _EinsumPlan, ops: list[torch.Tensor], path: Sequence[int] | None
) -> torch.Tensor:
    counts = list(plan.counts)
    num_ops = len(ops)
    step = 0
    while len(ops) > 1:
        i, j = 0, 1
        if path is not None:
            i, j = sorted((path[step], path[step + 1]))
            step += 2
        a, b = ops[i], ops[j]
        del ops[j]
        del ops[i]
        sum_dims: list[int] = []
        a_sum: list[int] = []
        b_sum: list[int] = []
        for dim in range(plan.out_dims, plan.total_dims):
            if a.size(dim) != 1 and b.size(dim) != 1:
                counts[dim] -= 1
                if counts[dim] == 1:
                    sum_dims.append(dim)
                    counts[dim] = 0
            elif counts[dim] == 1:
                if a.size(dim) != 1:
                    a_sum.append(dim)
                    counts[dim] = 0
                elif b.size(dim) != 1:
                    b_sum.append(dim)
                    counts[dim] = 0
        if a_sum:
            a = a.sum(a_sum, True)
        if b_sum:
            b = b.sum(b_sum, True)
        pair = _sumproduct_pair(a, b, sum_dims)
        if path is not None:
            ops.append(pair)
        else:
            ops.insert(0, pair)
    if plan.total_dims > plan.out_dims:
        if num_ops > 1:
            return ops[0].view(list(ops[0].shape)[: plan.out_dims])
        return ops[0].sum(list(range(plan.out_dims, plan.total_dims)))
    return ops[0]


def einsum(equation: Any, operands: Any, *, path: Any = None) -> Any:
    """``torch._C._VariableFunctions.einsum``: what ``torch.einsum`` calls after parsing."""
    if (
        not isinstance(equation, str)
        or not isinstance(operands, (list, tuple))
        or not operands
        or not all(isinstance(op, torch.Tensor) for op in operands)
        or not any(_castable(op) for op in operands)
        or not _strided(*operands)
    ):
        return NotImplemented
    if path is not None:
        remaining = len(operands)
        if len(path) != (1 if remaining == 1 else 2 * (remaining - 1)):
            return NotImplemented
        for k in range(0, len(path) - 1, 2):
            i, j = path[k], path[k + 1]
            if i == j or min(i, j) < 0 or max(i, j) >= remaining:
                return NotImplemented
            remaining -= 1
    plan = _einsum_plan(equation, operands)
    if plan is None:
        return NotImplemented
    ops: list[torch.Tensor] = []
    for operand, (diagonals, unsqueezed, permutation) in zip(operands, plan.steps):
        op = operand
        for previous, dim in diagonals:
            op = op.diagonal(0, previous, dim).movedim(-1, previous)
        for dim in unsqueezed:
            op = op.unsqueeze(dim)
        ops.append(op.permute(permutation))
    return _einsum_contract(plan, ops, path)


def _sublist_subscript(n: Any) -> str | None:
    if n is Ellipsis:
        return "..."
    if isinstance(n, int) and 0 <= n < _LETTERS:
        return chr(ord("A") + n)
    if isinstance(n, int) and _LETTERS <= n < 2 * _LETTERS:
        return chr(ord("a") + n - _LETTERS)
    return None


def _sublist_equation(args: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]] | None:
    """``einsum(op0, sub0, op1, sub1, ..., [out])`` as ``(equation, operands)``."""
    subscripts = [[_sublist_subscript(n) for n in sub] for sub in args[1::2]]
    if len(args) % 2 == 1:
        subscripts.append([_sublist_subscript(n) for n in args[-1]])
    if any(c is None for sub in subscripts for c in sub):
        return None
    inputs = subscripts[: len(args) // 2]
    equation = ",".join("".join(sub) for sub in inputs)  # type: ignore[arg-type]
    if len(args) % 2 == 1:
        equation += "->" + "".join(subscripts[-1])  # type: ignore[arg-type]
        return equation, args[:-1:2]
    return equation, args[::2]


def einsum_public(*args: Any) -> Any:
    """``torch.einsum``: the equation (or sublist) parsed as ``torch.functional.einsum`` does,
    then :func:`einsum`. With opt_einsum installed, three or more operands are declined (their
    contraction order is opt_einsum's path search)."""
    if len(args) < 2:
        return NotImplemented
    if isinstance(args[0], torch.Tensor):
        parsed = _sublist_equation(args)
        if parsed is None:
            return NotImplemented
        equation, operands = parsed
    else:
        equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    opt = torch.backends.opt_einsum
    if len(operands) > 2 and opt.enabled and opt.is_available():
        return NotImplemented
    return einsum(equation, operands)


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
    if not (_castable(a) or _castable(b)) or a.dtype != b.dtype or not _strided(a, b):
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
    if not (_castable(self) or _castable(other)) or not _strided(self, other):
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
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not _strided(*tensors):
        return NotImplemented
    if not _castable(input1) or any(t.dtype != input1.dtype for t in tensors):
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
            buf = _sumproduct_pair(i1, i2.narrow(1, k, 1), [2])
            buf = _sumproduct_pair(buf, i3, [3])
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
    if not _castable(input) or input.dim() > 2 or not _strided(input, fweights, aweights):
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
    if not _castable(input) or input.dim() > 2 or not _strided(input):
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
    if out is not None or not _castable(input) or not isinstance(n, int) or isinstance(n, bool):
        return NotImplemented
    if input.dim() < 2 or input.size(-1) != input.size(-2) or not _strided(input):
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
    if input.dim() < 2 or not _strided(input):
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
    if mode not in ("reflect", "replicate") or not _castable(input) or not _strided(input):
        return NotImplemented
    if value not in (None, 0) or not isinstance(pad, (list, tuple)) or len(pad) % 2:
        return NotImplemented
    k = len(pad) // 2
    kernel = _PAD_KERNELS.get((mode, k))
    if kernel is None or input.dim() not in (k + 1, k + 2):
        return NotImplemented
    return kernel(input, pad)


# -- registry ------------------------------------------------------------------------------------
_MM = frozenset({"mm", "matmul", "bmm", "dot", "tensordot"})

#: twin -> the entry points (as the mode sees them) it stands for
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
}

#: twin -> the listed ops (canonical names) it may call; the mode re-enters a twin only under
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
}

#: (``__module__``, ``__name__``) of each entry point, as the mode reads them -> twin
TWINS: dict[tuple[str | None, str], Callable[..., Any]] = {
    (getattr(fn, "__module__", None), fn.__name__): twin
    for twin, fns in _ENTRY_POINTS.items()
    for fn in fns
}
