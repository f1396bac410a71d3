"""Stop a run whose loss scale has collapsed: :class:`ScaleCollapseGuard`.

A dynamic scaler backs off on every overflow. Sometimes the gradients are non-finite whatever the
scale (a nan in the data or the model, a diverged run). The scale then falls to ``min_scale``, and
every later step is skipped. The run goes on forever without learning, and nothing says so.
DeepSpeed stops such a run ("Current loss scale already at minimum"). This guard does the same
without a host sync on the step. It reads the ``found_inf`` and ``scale`` metrics only where the
loop reads its metrics anyway (every N steps, once per epoch). It reads them from the per-step
metric tensors collected in between.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from funcamp._core.tree import describe
from funcamp.scaling.state import ScalerState

__all__ = ["ScaleCollapseError", "ScaleCollapseGuard"]


class ScaleCollapseError(RuntimeError):
    """Raised by :meth:`ScaleCollapseGuard.check` when the loss scale has collapsed.

    A ``RuntimeError``: catch it to save what you need before the run ends.

    Example:
        >>> import torch, funcamp
        >>> guard = funcamp.ScaleCollapseGuard(patience=1)
        >>> skipped = {"found_inf": torch.tensor(True), "scale": torch.tensor(1.0)}
        >>> try:
        ...     guard.check(funcamp.ScalerState.noop(), [skipped])
        ... except funcamp.ScaleCollapseError as e:
        ...     print(str(e)[:60])
        funcamp.ScaleCollapseGuard: the last 1 steps were all skippe
    """

    __module__ = "funcamp"  # tracebacks name it by its public path


class ScaleCollapseGuard:
    """Stop training when the scaler sits at its floor and keeps skipping steps.

    A step *counts* when it was skipped (``metrics["found_inf"]``) and the scale it used
    (``metrics["scale"]``) was already at the floor. The floor is the scaler's ``min_scale``. A
    ``dynamic`` scaler without ``min_scale`` has no floor (it would back off towards 0). ``static``
    and ``noop`` scalers never change. So for them every skipped step counts. When ``patience``
    consecutive steps count, :meth:`check` raises :class:`ScaleCollapseError` with the numbers. Any
    step that is not skipped resets the count. So does a step skipped above the floor (the scaler
    still searching for its level).

    The guard holds the count between calls. It is host-side bookkeeping, not training state:
    nothing is added to :class:`~funcamp.TrainState`. It reads the metrics only when :meth:`check`
    is called. Pass it the metrics of *every* step since the previous call, in order, where the
    loop reads its metrics anyway. That is one host read per call, and none on the step.

    Args:
        patience: how many consecutive counted steps stop the run (default 100).

    Example:
        >>> import torch, funcamp
        >>> guard = funcamp.ScaleCollapseGuard(patience=3)
        >>> scaler = funcamp.ScalerState.dynamic(init_scale=4.0, min_scale=1.0)
        >>> ok = {"found_inf": torch.tensor(False), "scale": torch.tensor(4.0)}
        >>> guard.check(scaler, [ok, ok])  # nothing skipped
        >>> at_floor = {"found_inf": torch.tensor(True), "scale": torch.tensor(1.0)}
        >>> guard.check(scaler, [at_floor, at_floor])  # 2 in a row: not yet
        >>> guard.check(scaler, [at_floor])
        Traceback (most recent call last):
        ...
        funcamp.ScaleCollapseError: funcamp.ScaleCollapseGuard: the last 3 steps were all skipped with the loss scale at its floor 1 (min_scale 1); ...
    """

    def __init__(self, patience: int = 100) -> None:
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(
                "funcamp.ScaleCollapseGuard: `patience` must be a positive int (a number of "
                f"consecutive steps), got {describe(patience)}"
            )
        self.patience = patience
        self.count = 0  # consecutive counted steps so far
        self.steps = 0  # steps seen

    def __repr__(self) -> str:
        return f"ScaleCollapseGuard(patience={self.patience}, count={self.count})"

    def check(
        self,
        scaler: ScalerState | Any,
        metrics: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    ) -> None:
        """Count the skipped steps at the floor among ``metrics``; raise when there are too many.

        Args:
            scaler: the :class:`~funcamp.ScalerState`, whose ``kind`` and ``min_scale`` say
                where the floor is. Or a state with a ``scaler`` field (a
                :class:`~funcamp.TrainState`).
            metrics: the metrics of every step since the previous call, in order. A list of
                ``make_train_step`` metrics dicts (only ``found_inf`` and ``scale`` are read),
                one such dict, or a dict of 1-d tensors stacked over the steps.

        Raises:
            ScaleCollapseError: ``patience`` consecutive steps were skipped at the floor.
        """
        state = scaler
        if not isinstance(state, ScalerState):
            state = getattr(scaler, "scaler", None)
        if not isinstance(state, ScalerState):
            raise TypeError(
                "funcamp.ScaleCollapseGuard.check: `scaler` must be a funcamp.ScalerState or a "
                f"TrainState, got {describe(scaler)}"
            )
        found_inf, scales = _stack(metrics)
        if found_inf.numel() == 0:
            return
        # One host read for all the steps since the last call.
        rows = torch.stack([found_inf.to(torch.float64), scales.to(torch.float64)]).tolist()
        floor = state.min_scale if state.kind == "dynamic" else None
        for skipped, used in zip(*rows):
            self.steps += 1
            at_floor = floor is None or used <= floor
            self.count = self.count + 1 if skipped and at_floor else 0
            if self.count >= self.patience:
                raise ScaleCollapseError(_message(self, state, used))


def _stack(metrics: Any) -> tuple[torch.Tensor, torch.Tensor]:
    api = "funcamp.ScaleCollapseGuard.check"
    if isinstance(metrics, Mapping):
        rows = [metrics]
    elif isinstance(metrics, Sequence) and not isinstance(metrics, (str, bytes)):
        rows = list(metrics)
    else:
        raise TypeError(
            f"{api}: `metrics` must be a metrics dict or a list of them, got {describe(metrics)}"
        )
    found, scales = [], []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or "found_inf" not in row or "scale" not in row:
            raise TypeError(
                f"{api}: `metrics[{i}]` must be a make_train_step metrics dict with 'found_inf' "
                f"and 'scale', got {describe(row)}"
            )
        found.append(torch.as_tensor(row["found_inf"]).reshape(-1))
        scales.append(torch.as_tensor(row["scale"]).reshape(-1).to(torch.float64))
    if not rows:
        return torch.zeros(0, dtype=torch.bool), torch.zeros(0)
    found_inf = torch.cat([f.to(scales[0].device) for f in found])
    scale = torch.cat([s.to(scales[0].device) for s in scales])
    if found_inf.shape != scale.shape:
        raise ValueError(f"{api}: `metrics` must hold as many 'found_inf' as 'scale' values")
    return found_inf, scale


def _message(guard: ScaleCollapseGuard, state: ScalerState, scale: float) -> str:
    if state.kind == "dynamic" and state.min_scale is not None:
        where = f"with the loss scale at its floor {scale:g} (min_scale {state.min_scale:g})"
    elif state.kind == "dynamic":
        where = f"(the loss scale backed off to {scale:g}; this scaler has no min_scale)"
    else:
        where = f"(a {state.kind} scaler: its scale {scale:g} never changes)"
    return (
        f"funcamp.ScaleCollapseGuard: the last {guard.count} steps were all skipped {where}; "
        "the gradients are non-finite whatever the scale, so training has stopped making "
        "progress. Look for inf/nan in the data or the loss (funcamp.trace shows which op ran "
        "in which dtype), lower the learning rate, or resume from an earlier checkpoint; raise "
        "`patience` if this is expected"
    )
