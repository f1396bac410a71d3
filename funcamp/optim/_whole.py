"""Optimizers whose step needs whole leaves (Muon's Newton-Schulz of a matrix, Adafactor's
row and column means and RMS norms), on the shards of a sharded step.

``make_train_step(..., parallel=Sharded(mesh))`` runs the optimizer on each rank's local shards
as plain tensors (:mod:`funcamp.distributed.shard`). An elementwise step is right on a shard;
these are not: each rank would orthogonalise its own block of rows, or average over its own
rows only. While :func:`funcamp.unscale_and_step` runs the update it holds a
:class:`funcamp.distributed.Across` (:func:`funcamp._core.collectives.active_across`) whose
``layout`` gives each param's shard dimension and global shape by its dotted path:
:func:`shard_layouts` reads it for a grads tree, :func:`gather_whole` all-gathers shards into
whole tensors (Muon), :func:`sum_across` all-reduces partial sums (Adafactor). Both are
``torch.distributed`` functional collectives: no host sync, traced into the compiled step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed._functional_collectives as funcol

from funcamp._core.collectives import Across, active_across
from funcamp._core.tree import NAMESPACE, dotted_path

__all__ = ["Layout", "gather_packed", "gather_whole", "local_part", "shard_layouts", "sum_across"]


class Layout(NamedTuple):
    """One leaf on the shards: ``dim`` it is cut along (None: replicated, whole on every
    rank) and its ``shape`` whole."""

    dim: int | None
    shape: tuple[int, ...]


def _refuse(api: str, what: str, world: int, why: str) -> ValueError:
    return ValueError(
        f"funcamp.{api}: {what}, and under parallel=Sharded(mesh) each of the {world} ranks "
        f"holds only a shard of them; {why}: train it with data parallelism "
        "(parallel=funcamp.distributed.DataParallel(group)), which holds them whole, or call "
        "its update on DTensor params (DTensor's collectives gather what it needs)"
    )


def shard_layouts(api: str, what: str, tree: Any) -> tuple[Across, list[Layout]] | None:
    """``(across, one Layout per leaf of tree)`` when this update runs on shards of more than
    one rank (None otherwise: the leaves are whole). A leaf is found by its dotted path among
    the sharded step's params; one that is not (an optimizer called on another tree) is
    refused, as is one sharded along a dimension ``api`` does not handle (``what``: a
    clause saying what the step needs whole)."""
    across = active_across()
    if across is None or not any(across.sharded) or across.world <= 1:
        return None
    if across.layout is None:
        raise _refuse(api, what, across.world, "the shards' layout is unknown")
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    out = []
    for path, x in zip(paths, leaves):
        key = dotted_path(path)
        got = across.layout.get(key)
        if got is None or (isinstance(x, torch.Tensor) and x.dim() != len(got[1])):
            raise _refuse(
                api, what, across.world, f"the leaf {key} is not one of the step's params"
            )
        out.append(Layout(*got))
    return across, out


def sum_across(across: Across, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``parts`` summed over the ranks of ``across``: one all-reduce of them all,
    packed in their widest dtype (float32 at least), on the first part's device."""
    if not parts:
        return []
    dtype = torch.float32
    for x in parts:
        dtype = torch.promote_types(dtype, x.dtype)
    device = parts[0].device
    flat = torch.cat([x.reshape(-1).to(device, dtype) for x in parts])
    got = funcol.wait_tensor(funcol.all_reduce(flat, "sum", across.group))
    sizes = [x.numel() for x in parts]
    return [y.view(x.shape).to(x.dtype) for x, y in zip(parts, got.split(sizes))]


def gather_whole(
    across: Across, xs: list[torch.Tensor], layouts: list[Layout]
) -> list[torch.Tensor]:
    """The whole tensors of the shards ``xs``: the sharded ones packed (padded to the chunk
    ``torch.chunk`` cuts, as DTensor does) into one flat buffer per dtype and all-gathered;
    replicated ones as they are."""

    def all_gather(flat: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_gather_single(flat, 0, across.group))

    return gather_packed(xs, layouts, across.world, all_gather)


def gather_packed(
    xs: list[torch.Tensor],
    layouts: Sequence[Layout],
    world: int,
    all_gather: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """:func:`gather_whole` with the collective given: ``all_gather`` takes one flat buffer and
    returns the ``world`` ranks' buffers one after the other (the sharded step passes one whose
    backward is a reduce-scatter)."""
    out = list(xs)
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (x, lay) in enumerate(zip(xs, layouts)):
        if lay.dim is not None:
            buckets.setdefault((x.device, x.dtype), []).append(i)
    for idx in buckets.values():
        pieces, blocks = [], []
        for i in idx:
            d, shape = layouts[i].dim, layouts[i].shape
            chunk = -(-shape[d] // world)
            x = xs[i].movedim(d, 0)
            if x.shape[0] < chunk:  # an uneven split: pad to the chunk
                x = torch.cat([x, x.new_zeros((chunk - x.shape[0], *x.shape[1:]))])
            pieces.append(x.reshape(-1))
            blocks.append((chunk, x.shape[1:]))
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        full = all_gather(flat).view(world, -1)
        offset = 0
        for i, (chunk, rest) in zip(idx, blocks):
            d, shape = layouts[i].dim, layouts[i].shape
            size = chunk * rest.numel()
            block = full[:, offset : offset + size].reshape(world * chunk, *rest)
            out[i] = block[: shape[d]].movedim(0, d)
            offset += size
    return out


def local_part(across: Across, whole: torch.Tensor, lay: Layout) -> torch.Tensor:
    """This rank's shard of ``whole`` (laid out as ``lay``): the rows ``torch.chunk`` gives
    it along ``lay.dim`` (none for a trailing rank of an uneven split)."""
    if lay.dim is None:
        return whole
    size = lay.shape[lay.dim]
    chunk = -(-size // across.world)
    start = min(across.rank * chunk, size)
    stop = min(start + chunk, size)
    return whole.narrow(lay.dim, start, stop - start)
