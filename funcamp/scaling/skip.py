"""Skipping a step: :class:`Skip`, the one place funcamp keeps the old values.

A step is skipped where its gradients overflowed, or where the caller's own condition holds
(``skip_if``, checked by :func:`check_condition`). Every path of :func:`funcamp.unscale_and_step`
skips through one :class:`Skip`:

* the pure path selects trees;
* the eager path masks its deltas and selects into its temporaries;
* a donated state has each new buffer written into the old one;
* torch's fused kernels read the flag themselves;
* the train step keeps its FP8 state with it.

Optimizers receive it through :class:`funcamp.optim.Writes`, and never read ``found_inf``
themselves. Changing how a step is skipped means changing this file.

Where the flag lives on the CPU and the step runs eagerly, the decision is read once, as torch's
``GradScaler.step`` reads it: the CPU holds the value, so no device is waited for. A skipped step
then does no work at all, and an applied one writes its results without a select
(:attr:`Skip.decided`). Everywhere else -- CUDA, compiled, under ``torch.func`` transforms --
nothing reads it, and the old values are kept with selects.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from funcamp._core.context import plain_eager_tensors
from funcamp._core.tree import (
    BITS,
    PyTree,
    describe,
    plan_select_write,
    plan_write,
    select_into,
    where_into,
)
from funcamp.scaling.state import check_found_inf

__all__ = ["Skip", "check_condition", "device_path"]

#: Whether a CPU eager step reads its skip flag on the host (see :func:`device_path`).
_READS_CPU_FLAG: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "funcamp_reads_cpu_flag", default=True
)


@contextlib.contextmanager
def device_path() -> Iterator[None]:
    """Run steps as on a device: nothing reads the skip flag, even on the CPU.

    A CPU eager step reads its flag once (:attr:`Skip.decided`); a CUDA step never does. Inside
    this block the CPU runs the CUDA step's sync-free path (selects), so that it can be tested
    and timed without a GPU.
    """
    token = _READS_CPU_FLAG.set(False)
    try:
        yield
    finally:
        _READS_CPU_FLAG.reset(token)


def check_condition(api: str, value: Any) -> torch.Tensor:
    """``value``, the answer of a ``skip_if`` condition, checked: a 0-d bool tensor.

    The check reads metadata only: the answer stays on its device, and nothing waits for it.
    """
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or value.dim() != 0:
        raise TypeError(
            f"funcamp.{api}: `skip_if` must return a 0-d bool tensor, such as "
            f"`metrics['grad_norm'] > 10.0`, got {describe(value)}; a Python bool would read "
            "the device's value on the host (a sync)"
        )
    return value


_TINY = float.fromhex("0x1p-1074")  # the smallest float64 subnormal
_NEGATIVE_ZERO = -0.0


def _adds_negative_zero_exactly() -> bool:
    """False when the CPU flushes subnormals (``torch.set_flush_denormal(True)`` sets the
    thread's DAZ/FTZ flags, which Python's own float arithmetic obeys too), where ``p + -0.0`` is
    not ``p``. Plain Python floats held in variables: no tensor, no host sync, no constant
    folding."""
    return _TINY + _NEGATIVE_ZERO != 0.0


class Skip:
    """Keep the old value where the step is skipped, else the new one.

    ``found_inf`` is a 0-d bool tensor; nothing here syncs with the host. Each method is one
    way of applying that rule; all give the old values bit for bit on a skipped step.

    Args:
        found_inf: 0-d bool tensor, True when the step is skipped (an overflow, or the
            caller's ``skip_if``).

    Example:
        >>> import torch
        >>> from funcamp.scaling.skip import Skip
        >>> skip = Skip(torch.tensor(True))
        >>> skip.select({"w": torch.zeros(2)}, {"w": torch.ones(2)})
        {'w': tensor([0., 0.])}
        >>> old = [torch.zeros(2)]
        >>> skip.write(old, [torch.ones(2)])[0]
        tensor([0., 0.])
    """

    def __init__(self, found_inf: torch.Tensor) -> None:
        check_found_inf("Skip", found_inf)
        self.found_inf = found_inf
        self._applies: torch.Tensor | None = None
        self._masks: dict[torch.dtype, torch.Tensor] = {}
        self._caps: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._cpu_exact: bool | None = None
        self._decided: bool | None = None
        self._read = False

    @property
    def decided(self) -> bool | None:
        """Whether the step is skipped, known on the host: a Python bool where ``found_inf`` is
        a plain CPU tensor in plain eager code (read once, as ``GradScaler.step`` reads it: no
        device to wait for); None everywhere else (CUDA, compiled, ``torch.func``), where
        nothing reads it."""
        if not self._read:
            self._read = True
            flag = self.found_inf
            # plain eager first: nothing else is asked while dynamo traces
            if plain_eager_tensors([flag]) and flag.device.type == "cpu" and _READS_CPU_FLAG.get():
                self._decided = bool(flag)
        return self._decided

    def also(self, flag: torch.Tensor) -> Skip:
        """A skip of this step where ``found_inf`` or ``flag`` holds (a condition known only
        after the update ran)."""
        return Skip(self.found_inf | flag.to(self.found_inf.device))

    def advance(self, count: torch.Tensor) -> torch.Tensor:
        """The count of updates applied after this step: ``count + 1``, or ``count`` where
        skipped. (An optimizer that writes its state itself asks; a returned state's count is
        selected with the rest of the tree.)"""
        new = count + 1
        decided = self.decided
        if decided is not None:
            return count if decided else new
        return torch.where(self.found_inf.to(count.device), count, new)

    def select(
        self,
        old: PyTree,
        new: PyTree,
        writable: Callable[[torch.Tensor], bool] | None = None,
        done: Callable[[torch.Tensor], bool] | None = None,
    ) -> PyTree:
        """Two trees of one structure, leaf by leaf (:func:`funcamp.tree_select`).

        A ``new`` leaf for which ``writable`` holds (a temporary of the caller) receives the
        result in place. One for which ``done`` holds already holds it. Decided on the host,
        the tree is chosen whole (the trees are still checked against each other).
        """
        decided = self.decided
        if decided is not None:
            select_into(self.found_inf, old, new, lambda x: False, lambda x: True)  # checks
            return old if decided else new
        return select_into(self.found_inf, old, new, writable, done)

    def write(self, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> Any:
        """Into each old tensor, now: ``old = where(found_inf, old, new)``. Returns ``olds``."""
        decided = self.decided
        if decided is not None:
            if not decided:
                for old, new in zip(olds, news):
                    if new is not old:
                        old.copy_(new)
            return olds
        if self._applies is None:
            self._applies = ~self.found_inf
        for old, new in zip(olds, news):
            where_into(self._applies.to(old.device), new, old, self._masks)
        return olds

    def plan_write(self, old: PyTree, new: PyTree) -> Callable[[], PyTree]:
        """:meth:`write` over two trees, in two phases.

        The trees are checked now, raising before anything is written. The returned function
        writes, and returns ``old``.
        """
        decided = self.decided
        if decided is None:
            return plan_select_write(self.found_inf, new, old)
        write = plan_write(old if decided else new, old)
        return write

    def flag(self, device: torch.device) -> torch.Tensor:
        """``found_inf`` as torch's fused kernels read it (float32 on ``device``).

        The kernels skip by themselves.
        """
        return self.found_inf.to(device=device, dtype=torch.float32)

    def mask_delta(self, delta: torch.Tensor) -> bool:
        """Turn an owned float32/float64 delta into ``-0.0`` everywhere on a skipped step, in place.

        Then ``p + delta`` is ``p`` bit for bit, signed zeros and infinities included. It takes
        ``min(bits, cap)`` on the integer view. The 0-d ``cap`` is the bits of ``-0.0`` when
        skipped, and the largest integer otherwise. That is one vectorized pass instead of a
        ``torch.where`` over both trees (a scalar loop on CPU). It returns False for other
        dtypes, and the caller then selects. It also returns False on CPU while subnormals are
        flushed, where ``p + -0.0`` is not ``p``. A signaling-NaN param (torch never makes one)
        would come back quiet from a skipped step.
        """
        decided = self.decided
        if decided is not None and not decided:
            return True  # applied: the delta stays as it is
        int_dtype = BITS.get(delta.dtype)
        if int_dtype is None or int_dtype == torch.int16:
            return False
        if delta.device.type == "cpu":
            if self._cpu_exact is None:
                self._cpu_exact = _adds_negative_zero_exactly()
            if not self._cpu_exact:
                return False
        key = (delta.device, int_dtype)
        cap = self._caps.get(key)
        if cap is None:
            info = torch.iinfo(int_dtype)
            found = self.found_inf.to(delta.device)
            cap = self._caps[key] = torch.where(found, info.min, info.max).to(int_dtype)
        delta.view(int_dtype).clamp_max_(cap)
        return True
