"""Optimizers whose step needs whole leaves (Muon's Newton-Schulz of a matrix, Adafactor's
row and column means and RMS norms): refused in a step on shards of more than one rank.

``make_train_step(..., parallel=Sharded(mesh))`` runs the optimizer on each rank's local shards
as plain tensors (:mod:`funcamp.distributed.shard`). An elementwise step is right on a shard;
these are not: each rank would orthogonalise its own block of rows, or average over its own
rows only, and the numbers would be wrong without an error. While
:func:`funcamp.unscale_and_step` runs such a step it holds a
:class:`funcamp.distributed.Across` (:func:`funcamp._core.collectives.active_across`), which
says the gradients are shards.
"""

from __future__ import annotations

from funcamp._core.collectives import active_across

__all__ = ["check_whole_leaves"]


def check_whole_leaves(api: str, what: str) -> None:
    """Raise if this update runs on shards held by more than one rank; ``what``: what the
    step needs whole (a clause)."""
    across = active_across()
    if across is None or not any(across.sharded):
        return
    world = across.group.size()
    if world > 1:
        raise ValueError(
            f"funcamp.{api}: {what}, and under parallel=Sharded(mesh) each of the {world} "
            "ranks holds only a shard of them: train it with data parallelism "
            "(parallel=funcamp.distributed.DataParallel(group)), which holds them whole, or "
            "call its update on DTensor params (DTensor's collectives gather what it needs)"
        )
