"""Data-parallel and sharded training on ``torch.distributed``.

This package holds the collectives a step uses, and the pieces that make a step parallel.

- :func:`any_across`, :func:`all_reduce_grads`, :func:`all_reduce_step`: functional collectives
  (no host sync; they trace into one graph). :func:`all_reduce_step` packs everything a
  data-parallel step exchanges into one flat buffer per gradient dtype. That is the gradients,
  the loss, a non-finite flag and rank 0's buffers. So a float32-gradient step costs one
  all-reduce.
- :func:`shard` turns a state into DTensors sharded on a 1-D device mesh, for the sharded step
  ``make_train_step(..., parallel=Sharded(mesh))``. Params and optimizer state are split across
  the ranks.
- :class:`Across`: gradients held as shards, for :func:`funcamp.unscale_and_step`'s global
  norm and ``found_inf``.
- :class:`DataParallel`, :class:`Sharded`: the pieces ``make_train_step(parallel=...)`` plugs
  into the one step algorithm. They are public, for steps written by hand (see the guide "A
  train step by hand").
"""

from funcamp._core.collectives import (
    Across,
    Reduced,
    all_reduce_grads,
    all_reduce_step,
    any_across,
)
from funcamp.distributed.data_parallel import DataParallel
from funcamp.distributed.shard import Sharded, shard

__all__ = [
    "Across",
    "DataParallel",
    "Reduced",
    "Sharded",
    "all_reduce_grads",
    "all_reduce_step",
    "any_across",
    "shard",
]
