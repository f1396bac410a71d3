"""Data parallel: the :class:`DataParallel` piece of the one step algorithm.

Every rank runs the step on its own shard of the batch, and ends with the same state, as with
DDP.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist

from funcamp._core.collectives import all_reduce_step
from funcamp._core.tree import PyTree, describe
from funcamp.casting.fp8 import Fp8State, all_reduce_amax
from funcamp.distributed.agree import start_together
from funcamp.train.parallel import SingleProcess

__all__ = ["DataParallel", "check_group"]


def check_group(api: str, group: Any) -> tuple[Any, int, int]:
    """``(group, world_size, rank)``, read once, when the step is built."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"funcamp.{api}: `group` needs torch.distributed initialized "
            "(torch.distributed.init_process_group) before the step is built"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"funcamp.{api}: `group` must be a torch.distributed.ProcessGroup (for example "
            f"torch.distributed.group.WORLD), got {describe(group)}"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"funcamp.{api}: this process is not a member of `group`")
    return group, dist.get_world_size(group), rank


class DataParallel(SingleProcess):
    """The ranks of ``group`` each run the step on their own equal shard of the batch.

    After the backward pass, one all-reduce per gradient dtype (:func:`all_reduce_step`)
    carries four things:

    * the scaled gradients, averaged over the ranks;
    * the loss (the mean over ranks is reported);
    * a non-finite flag: any rank's inf/nan skips the step on every rank;
    * rank 0's new buffers (DDP's ``broadcast_buffers``).

    Delayed-FP8 amaxes are max-reduced over the ranks.

    On its first call (only) the step checks that every rank built it alike -- the policy, the
    optimizer's hyperparameters, the scaler's settings, the options and the state's structure
    -- and refuses a difference on every rank with a ``ValueError`` that names the field and
    the ranks. Then every rank starts from rank 0's state (params, buffers, optimizer, scaler
    and FP8 state, frozen params), broadcast as DDP broadcasts rank 0's params and buffers when
    it is built. Later calls run no collective and no host sync for either.

    Example:
        >>> import torch, torch.distributed as dist, funcamp
        >>> import funcamp.distributed as fd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> fd.DataParallel(dist.group.WORLD).name
        'parallel=DataParallel(group) (1 ranks)'
        >>> dist.destroy_process_group()
    """

    refuses: ClassVar[dict[str, str]] = {
        "cache_dir": "the compiled graph holds collectives bound to this process's group, "
        "which a saved step cannot rebind; drop `cache_dir` (torch's compile caches still apply)"
    }

    def __init__(self, group: Any, *, margin: int = 0, api: str = "make_train_step") -> None:
        self.group, self.world, self.rank = check_group(api, group)
        self.margin = margin  # the delayed-FP8 recipe's margin
        self.name = f"parallel=DataParallel(group) ({self.world} ranks)"

    def agree(self, api: str, state: Any, settings: dict[str, Any], in_place: bool) -> Any:
        """On the first call: the ranks agree on ``settings`` and the state's structure, and
        every rank starts from rank 0's state, whole (:func:`start_together`)."""
        return start_together(api, self, state, settings, in_place=in_place)

    def exchange(
        self, grads: PyTree, loss: torch.Tensor, buffers: PyTree
    ) -> tuple[PyTree, torch.Tensor, PyTree, torch.Tensor | None]:
        got = all_reduce_step(
            grads, loss, buffers, self.group, world_size=self.world, rank=self.rank
        )
        return got.grads, got.loss, got.buffers, got.nonfinite

    def fp8_reduce(self, state: Fp8State, grads: Fp8State) -> Fp8State:
        return all_reduce_amax(state, grads, self.margin, self.group)
