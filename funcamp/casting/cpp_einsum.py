"""The Python copy of ``einsum`` (and the pairwise ``bmm`` contraction ``bilinear`` shares).

See ``funcamp/casting/cpp_composites.py``. The copy makes the calls ATen's ``einsum`` kernel
makes. Labels are aligned by permutation, with diagonals for repeated labels. Dimensions only one
operand has are summed first. Then comes one ``bmm`` per pair of operands (or a ``mul`` when
nothing is contracted). So the amp mode casts the ``bmm`` calls, and only them, as torch.autocast
casts them.

Workaround of torch internals (docs/upstream.md#cpp-composites):

- Root cause: as for funcamp/casting/cpp_composites.py. ATen's einsum calls bmm inside its C++
  kernel, which a function mode cannot see.
- Upstream: none; see docs/upstream.md#cpp-composites.
- Why it is safe: the copy makes the calls ATen's kernel makes, so the bits match
  (tests/test_opinfo.py, tests/test_cpp_composites.py).
- Tested on: torch 2.13 and 2.14.
- Delete when: as for funcamp/casting/cpp_composites.py.

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.backends.opt_einsum

__all__ = ["all_strided", "castable", "einsum", "einsum_public", "sumproduct_pair"]

_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)
_LETTERS = 26


def castable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _CASTABLE


def all_strided(*xs: Any) -> bool:
    return all(x.layout == torch.strided for x in xs if isinstance(x, torch.Tensor))


# -- sumproduct_pair: einsum's and _trilinear's pairwise contraction ----------------------------
def sumproduct_pair(left: torch.Tensor, right: torch.Tensor, sum_dims: list[int]) -> torch.Tensor:
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
        pair = sumproduct_pair(a, b, sum_dims)
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
        or not any(castable(op) for op in operands)
        or not all_strided(*operands)
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
    """``torch.einsum``: the equation (or sublist) parsed as ``torch.functional.einsum`` does.

    Then it calls :func:`einsum`. With opt_einsum installed, three or more operands are declined,
    since their contraction order is opt_einsum's path search.
    """
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
