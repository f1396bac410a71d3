"""Collectives for a step: gradient averaging, ``found_inf`` consensus and the global norm
of gradients held as shards.

They are built on ``torch.distributed._functional_collectives``. So they return new tensors (the
inputs are never modified), need no host sync, and trace into a single graph under
``torch.compile(fullgraph=True)``. :func:`all_reduce_step` packs everything a data-parallel step
exchanges into one flat buffer per gradient dtype: the gradients, the loss, a non-finite flag and
rank 0's buffers. So a float32-gradient step costs one all-reduce. :class:`Across` describes
gradients held as shards, each rank holding a different part of some leaves. While
:func:`funcamp.unscale_and_step` runs with one, norms and ``found_inf`` are global.
(:func:`active_across` gives it; :func:`funcamp.clip_by_global_norm` reads it too.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from funcamp._core.stack import Pushing
from funcamp._core.tree import NAMESPACE, PyTree, describe, insertion_order, unflatten

__all__ = [
    "Across",
    "Reduced",
    "all_reduce_grads",
    "all_reduce_step",
    "any_across",
    "active_across",
    "global_norm",
    "in_params_order",
    "summing_across",
]


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
            f"{describe(flag)}"
        )
    pg = _group("any_across", group)
    return funcol.all_reduce(flag.to(torch.int32), "max", pg) > 0


def all_reduce_grads(grads: PyTree, group: Any = None) -> PyTree:
    """Average the floating tensor leaves of ``grads`` over the ranks of ``group``.

    Leaves are packed into one flat buffer per (device, dtype), so a step issues one all-reduce per
    dtype rather than one per leaf. Each rank divides its gradients by the world size *before* the
    sum, as DDP does. (The world size is a Python constant, fixed when the function is traced.) So
    a float16 sum cannot overflow where the mean would not. With a power-of-two world size the
    division is exact. Non-floating and non-tensor leaves pass through.

    Args:
        grads: a pytree of gradients with the same structure and shapes on every rank.
        group: a process group (default: the world group).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import funcamp.distributed as fd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> fd.all_reduce_grads({"w": torch.tensor([1.0, 2.0]), "step": 3})
        {'w': tensor([1., 2.]), 'step': 3}
        >>> dist.destroy_process_group()
    """
    pg = _group("all_reduce_grads", group)
    return all_reduce_step(grads, None, None, pg, world_size=dist.get_world_size(pg), rank=0).grads


# ---------------------------------------------------------------------------- the packed step


class Reduced(NamedTuple):
    """What :func:`all_reduce_step` returns.

    It holds the mean gradients, the mean loss, the non-finite consensus and rank 0's buffers.
    The consensus is True on every rank when any rank's gradients held an inf or nan.

    Example:
        >>> import torch, funcamp.distributed as fd
        >>> fd.Reduced(grads={"w": torch.ones(1)}, loss=None, nonfinite=None, buffers={}).grads
        {'w': tensor([1.])}
    """

    grads: PyTree
    loss: torch.Tensor | None
    nonfinite: torch.Tensor | None
    buffers: PyTree


def _encode(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 values that survive a sum with ``-0.0`` bit for bit.

    float32/float16/bfloat16 convert exactly; one-byte types and bool are small integers; every
    other dtype (int64, float64, ...) is split into its 16-bit words, each exact in float32.
    """
    if x.dtype in (torch.float32, torch.float16, torch.bfloat16) or x.element_size() == 1:
        return x.reshape(-1).to(torch.float32)
    return x.reshape(-1).view(torch.int16).to(torch.float32)


def _encoded_size(x: torch.Tensor) -> int:
    if x.dtype in (torch.float32, torch.float16, torch.bfloat16) or x.element_size() == 1:
        return x.numel()
    return x.numel() * x.element_size() // 2


def _decode(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dtype in (torch.float32, torch.float16, torch.bfloat16) or like.element_size() == 1:
        return v.to(like.dtype).view(like.shape)
    return v.to(torch.int16).view(like.dtype).view(like.shape)


def all_reduce_step(
    grads: PyTree,
    loss: torch.Tensor | None = None,
    buffers: PyTree = None,
    group: Any = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
) -> Reduced:
    """Everything a data-parallel step exchanges, in one all-reduce per gradient dtype.

    Returns :class:`Reduced`. It holds the mean of ``grads`` over the ranks of ``group`` (default:
    the world) and the mean ``loss``. ``nonfinite`` is True on every rank when any rank's gradients
    held an inf or nan (None without a loss). ``buffers`` is rank 0's, on every rank.
    ``world_size`` and ``rank`` are read from ``group`` unless given. (A step reads them once, when
    it is built.)

    Gradients are grouped by (device, dtype) and concatenated. Each rank's are divided by
    ``world_size`` before the sum, so the result is their mean. The float32 buffer on the loss's
    device also carries three more things. (It is made for the purpose if no float32 gradients live
    there.)

    * The loss, divided too, so the result is the mean loss.
    * This rank's non-finite flag: 1.0 when one of its gradients is inf or nan. The sum is > 0 when
      any rank's is.
    * The tensor leaves of ``buffers``, encoded with :func:`_encode`. Rank 0 sends them, and every
      other rank sends ``-0.0``. ``x + -0.0 == x`` bit for bit for every float32 ``x`` (nan and
      ``-0.0`` included). So the sum is rank 0's buffers exactly: a broadcast, without another
      collective.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import funcamp.distributed as fd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> got = fd.all_reduce_step({"w": torch.tensor([2.0, float("inf")])}, torch.tensor(0.5))
        >>> got.grads, got.loss, got.nonfinite
        ({'w': tensor([2., inf])}, tensor(0.5000), tensor(True))
        >>> dist.destroy_process_group()
    """
    group = _group("all_reduce_step", group)
    world_size = dist.get_world_size(group) if world_size is None else world_size
    is_src = (dist.get_rank(group) if rank is None else rank) == 0
    leaves, spec = optree.tree_flatten(grads, namespace=NAMESPACE)
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            buckets.setdefault((x.device, x.dtype), []).append(i)
    # Under dynamo (torch 2.13, optree 0.20) tree_flatten fails to trace a tree holding an empty
    # dict, and `buffers` is usually `{}`: flatten it only when it holds a tensor.
    buf_leaves: list[Any] = []
    buf_spec = None
    if any(isinstance(x, torch.Tensor) for x in optree.tree_leaves(buffers, namespace=NAMESPACE)):
        buf_leaves, buf_spec = optree.tree_flatten(buffers, namespace=NAMESPACE)
    buf_idx = [i for i, x in enumerate(buf_leaves) if isinstance(x, torch.Tensor)]
    carrier = None
    if loss is not None or buf_idx:
        device = loss.device if loss is not None else buf_leaves[buf_idx[0]].device
        carrier = (device, torch.float32)
        buckets.setdefault(carrier, [])

    flats = {}
    for key, idx in buckets.items():
        parts = [leaves[i].reshape(-1) for i in idx]
        flats[key] = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else None
    out, out_buf = list(leaves), list(buf_leaves)
    mean_loss = nonfinite = None
    for key, idx in buckets.items():
        flat = flats[key]
        pieces = [] if flat is None else [flat / world_size]
        if key == carrier and loss is not None:
            bad = [~torch.isfinite(f).all() for f in flats.values() if f is not None]
            flag = torch.stack(bad).any() if bad else torch.zeros((), dtype=torch.bool)
            pieces += [loss.reshape(1).to(key[1]) / world_size, flag.reshape(1).to(key[1])]
        if key == carrier:
            for i in buf_idx:
                code = _encode(buf_leaves[i]).to(key[0])
                pieces.append(code if is_src else torch.full_like(code, -0.0))
        send = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        got = funcol.wait_tensor(funcol.all_reduce(send, "sum", group))
        pos = 0
        if flat is not None:
            sizes = [leaves[i].numel() for i in idx]
            for i, chunk in zip(idx, got[: flat.numel()].split(sizes)):
                out[i] = chunk.view(leaves[i].shape)
            pos = flat.numel()
        if key == carrier and loss is not None:
            mean_loss, nonfinite = got[pos], got[pos + 1] > 0
            pos += 2
        if key == carrier:
            for i in buf_idx:
                like, size = buf_leaves[i], _encoded_size(buf_leaves[i])
                out_buf[i] = _decode(got[pos : pos + size], like).to(like.device)
                pos += size
    # (Only rebuild what changed: under dynamo, unflattening an empty dict fails to trace.)
    return Reduced(
        unflatten(spec, out) if any(buckets.values()) else grads,
        mean_loss,
        nonfinite,
        unflatten(buf_spec, out_buf) if buf_idx else buffers,
    )


# ------------------------------------------------------------------- gradients held as shards


class Across(NamedTuple):
    """Gradients held across the ranks of ``group``.

    There is one flag for each floating gradient leaf, in flattening order. ``True`` means each
    rank holds a different shard of it, so squared norms are summed over the ranks. ``False``
    means every rank holds the same values, counted once.

    ``layout`` maps each leaf's dotted path (``layer.weight``, as :func:`funcamp.masked` and
    :func:`funcamp.multi_transform` key their groups) to ``(dim, global shape)``: the dimension
    it is sharded along (None: replicated) and its shape whole. Optimizers whose step needs
    whole leaves (:func:`funcamp.muon`, :func:`funcamp.adafactor`) read it to gather or reduce
    what they need; ``rank`` is this rank's index in ``group``, ``world`` its size.

    Example:
        >>> import funcamp.distributed as fd
        >>> fd.Across(group=None, sharded=(True, False)).sharded
        (True, False)
    """

    group: Any
    sharded: tuple[bool, ...]
    layout: dict[str, tuple[int | None, tuple[int, ...]]] | None = None
    rank: int = 0
    world: int = 1

    def reduce(self, flag: torch.Tensor, sq: Sequence[torch.Tensor]) -> tuple[Any, Any]:
        """``(flag OR-ed over the ranks, the global sum of squares)`` of this rank's non-finite
        flag and per-leaf squared norms, in one all-reduce."""
        if len(sq) != len(self.sharded):
            raise NotImplementedError(
                "funcamp: under a sharded step a global norm must see every gradient leaf "
                f"({len(self.sharded)}), got {len(sq)}; chain clip_by_global_norm at the top "
                "level (chain(clip_by_global_norm(c), ...)), not inside masked/multi_transform"
            )
        device = flag.device
        zero = torch.zeros((), dtype=torch.float32, device=device)
        mine = [s.to(device=device, dtype=torch.float32) for s, d in zip(sq, self.sharded) if d]
        same = [s.to(device=device, dtype=torch.float32) for s, d in zip(sq, self.sharded) if not d]
        local = torch.stack(mine).sum() if mine else zero
        send = torch.stack([flag.to(torch.float32), local])
        got = funcol.wait_tensor(funcol.all_reduce(send, "sum", self.group))
        total = got[1] + (torch.stack(same).sum() if same else zero)
        return got[0] > 0, total


_ACROSS: list[Across] = []


class summing_across(Pushing):
    """Make :func:`active_across` return ``across`` while this is active.

    Use it as ``with summing_across(across): ...``; ``None`` changes nothing.
    :func:`funcamp.unscale_and_step` enters it around the optimizer's update. So
    :func:`funcamp.clip_by_global_norm` clips by the global norm of sharded gradients.
    """

    def __init__(self, across: Across | None) -> None:
        super().__init__(_ACROSS, across)


def active_across() -> Across | None:
    """The :class:`Across` of the innermost :class:`summing_across` block, or None."""
    return _ACROSS[-1] if _ACROSS else None


def in_params_order(tree: Any, xs: list[Any]) -> list[Any]:
    """``xs`` (one per leaf of ``tree``, in flatten order) in the order ``tree``'s dicts iterate.

    Flatten order sorts dict keys. Iteration order is ``model.parameters()`` order for a params
    dict. It is the order in which torch's ``clip_grad_norm_`` sums a global norm, and a float
    sum depends on its order.
    """
    order = insertion_order(tree)
    return xs if order is None else [xs[i] for i in order]


def global_norm(norms: list[torch.Tensor], tree: Any = None) -> torch.Tensor:
    """The L2 norm of per-leaf norms (one per leaf of ``tree``, in flatten order), in float32.

    When ``tree`` is given, the sum runs in ``tree``'s dict order (:func:`in_params_order`). In
    a sharded step it runs across the ranks (:func:`active_across`). The norms are then those of
    the local shards, in flatten order, as :meth:`Across.reduce` pairs them with its leaves.
    """
    across = active_across()
    if across is None:
        ordered = norms if tree is None else in_params_order(tree, norms)
        return torch.linalg.vector_norm(torch.stack([n.to(torch.float32) for n in ordered]))
    flag = torch.zeros((), dtype=torch.bool, device=norms[0].device)
    return across.reduce(flag, [n.to(torch.float32).square() for n in norms])[1].sqrt()
