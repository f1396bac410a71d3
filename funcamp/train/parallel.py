"""How a train step is spread over processes: one piece, plugged into the one step algorithm.

:func:`funcamp.make_train_step` runs the same algorithm whatever the parallelism:
forward and backward of the scaled loss, an exchange between the ranks, then
:func:`funcamp.unscale_and_step` and :func:`funcamp.update`. It asks its parallel piece for the
few places where processes differ. The base piece, :class:`SingleProcess`, is one process alone
(every hook is the identity). :class:`funcamp.distributed.DataParallel` averages gradients over
a process group. :class:`funcamp.distributed.Sharded` trains on shards of the params and
optimizer state.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from funcamp._core.collectives import Across
from funcamp._core.tree import PyTree
from funcamp.casting.fp8 import Fp8State

__all__ = ["SingleProcess"]


class SingleProcess:
    """One process alone; the base of the pieces that spread a step over several.

    Attributes:
        name: how error messages name the piece (``"parallel=Sharded(mesh) (2 ranks)"``).
        refuses: options the piece does not compose with, each with the reason
            (``{"cache_dir": "..."}``); :func:`~funcamp.train.config.check_combinations`
            refuses them in one place, with that reason.
    """

    name = "one process"
    refuses: ClassVar[dict[str, str]] = {}

    def local(self, api: str, state: Any) -> Any:
        """The state the compiled step works on (the sharded piece: DTensors' local shards),
        checked; called outside the compiled step, on every call."""
        return state

    def agree(self, api: str, state: Any, settings: dict[str, Any], in_place: bool) -> Any:
        """The state the first call starts from, once the ranks agreed on ``settings`` (what the
        step was built with: policy, optimizer, options) and the state's structure; called
        outside the compiled step, on the first call only. ``in_place``: the state is donated,
        its tensors may be overwritten. One process: ``state`` as it is."""
        return state

    def wrap(self, new: Any) -> Any:
        """The new state as the caller gets it back (the sharded piece: DTensors again)."""
        return new

    def gather(self, params: PyTree) -> PyTree:
        """The params the loss runs on, made from the differentiated ones (inside the grad)."""
        return params

    def exchange(
        self, grads: PyTree, loss: torch.Tensor, buffers: PyTree
    ) -> tuple[PyTree, torch.Tensor, PyTree, torch.Tensor | None]:
        """``(grads, loss, buffers, nonfinite)`` after the ranks exchange what they computed.

        The gradients are still scaled. ``loss`` is the loss reported and ``buffers`` the
        buffers kept. ``nonfinite`` is a non-finite consensus flag (None: nothing to add to
        ``found_inf``).
        """
        return grads, loss, buffers, None

    def across(self) -> Across | None:
        """How the gradients are held across ranks (for global norms and ``found_inf``), or
        None when every rank holds them whole."""
        return None

    def fp8_reduce(self, state: Fp8State, grads: Fp8State) -> Fp8State:
        """The delayed-FP8 "gradient" (this step's amaxes) combined across the ranks."""
        return grads
