"""Collectives for funcamp's step: gradient averaging and ``found_inf`` consensus.

Built on ``torch.distributed._functional_collectives``, so they return new tensors (the inputs are
never modified), need no host sync and trace into a single graph under
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from funcamp._tree import NAMESPACE, _describe

__all__ = ["all_reduce_grads", "any_across"]

PyTree = Any


def _group(api: str, group: Any) -> Any:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"funcamp.distributed.{api}: torch.distributed must be initialized "
            "(torch.distributed.init_process_group) before use"
        )
    return dist.group.WORLD if group is None else group


def any_across(flag: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Return True on every rank when ``flag`` is True on any rank of ``group``.

    This is the ``found_inf`` consensus of a data-parallel step: if one rank saw an inf or nan,
    every rank skips the step, so replicas never diverge.

    Args:
        flag: a 0-d bool tensor.
        group: a process group (default: the world group).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import funcamp.distributed as fd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> fd.any_across(torch.tensor(True))
        tensor(True)
        >>> dist.destroy_process_group()
    """
    if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool or flag.dim() != 0:
        raise TypeError(
            f"funcamp.distributed.any_across: `flag` must be a 0-d bool tensor, got "
            f"{_describe(flag)}"
        )
    pg = _group("any_across", group)
    return funcol.all_reduce(flag.to(torch.int32), "max", pg) > 0


def all_reduce_grads(grads: PyTree, group: Any = None) -> PyTree:
    """Average the floating tensor leaves of ``grads`` over the ranks of ``group``.

    Leaves are packed into one flat buffer per (device, dtype), so a step issues one all-reduce
    per dtype rather than one per leaf; the sum is divided by the world size (a Python constant
    fixed when the function is traced). Non-floating and non-tensor leaves pass through.

    Args:
        grads: a pytree of gradients with the same structure and shapes on every rank.
        group: a process group (default: the world group).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import funcamp.distributed as fd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> fd.all_reduce_grads({"w": torch.tensor([1.0, 2.0])})
        {'w': tensor([1., 2.])}
        >>> dist.destroy_process_group()
    """
    pg = _group("all_reduce_grads", group)
    world_size = dist.get_world_size(pg)
    leaves, spec = optree.tree_flatten(grads, namespace=NAMESPACE)
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            buckets.setdefault((x.device, x.dtype), []).append(i)
    out = list(leaves)
    for idx in buckets.values():
        flat = torch.cat([leaves[i].reshape(-1) for i in idx])
        reduced = funcol.all_reduce(flat, "sum", pg) / world_size
        for i, chunk in zip(idx, reduced.split([leaves[i].numel() for i in idx])):
            out[i] = chunk.view(leaves[i].shape)
    return optree.tree_unflatten(spec, out)
