"""Learning-rate schedules: pure functions of the step count, returning a 0-d float64 tensor.

The count is a tensor, so a changing learning rate never recompiles a compiled step. It is the
number of updates applied before this one (0 on the first step, as in optax). Schedules compute
in float64 and return the value unrounded. Torch's learning rate is a Python float (a double).
funcamp's optimizers compute their step sizes from it in float64 and round once, as torch.optim
does (``lr / bias_correction1`` for Adam).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from numbers import Real

import torch

from funcamp._core.checks import check_int, check_real

__all__ = [
    "Schedule",
    "chained_lr",
    "constant_schedule",
    "cosine_decay_schedule",
    "join_schedules",
    "linear_schedule",
    "linear_warmup_cosine_decay",
]

#: A schedule maps the step count (0-d integer tensor) to a 0-d floating tensor (float64 for
#: funcamp's own).
Schedule = Callable[[torch.Tensor], torch.Tensor]


def _as_f64(count: torch.Tensor, api: str = "schedule") -> torch.Tensor:
    if not isinstance(count, torch.Tensor):
        if isinstance(count, bool) or not isinstance(count, Real):
            raise TypeError(
                f"funcamp.{api}: `count` must be the step count (a 0-d integer tensor or an "
                f"int), got {type(count).__name__} {count!r}"
            )
        count = torch.as_tensor(count)
    elif count.dtype == torch.bool or count.is_complex():
        raise TypeError(
            f"funcamp.{api}: `count` must be the step count (a 0-d integer tensor or an int), "
            f"got a {count.dtype} tensor"
        )
    return count.to(torch.float64)


def constant_schedule(value: float) -> Schedule:
    """A schedule that always returns ``value``.

    Args:
        value: the learning rate.

    Example:
        >>> import torch, funcamp
        >>> funcamp.constant_schedule(0.1)(torch.tensor(7))
        tensor(0.1000, dtype=torch.float64)
    """
    value = check_real("constant_schedule", "value", value)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        return torch.full_like(_as_f64(count, "constant_schedule"), value)

    return schedule


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Linear interpolation from ``init_value`` to ``end_value`` (optax's ``linear_schedule``).

    The value is ``init_value`` until ``transition_begin``, moves linearly over
    ``transition_steps`` steps and stays at ``end_value`` afterwards.

    Args:
        init_value: value at count ``transition_begin`` and before.
        end_value: value from count ``transition_begin + transition_steps`` on.
        transition_steps: length of the ramp (> 0).
        transition_begin: count at which the ramp starts (>= 0).

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.linear_schedule(0.0, 1.0, transition_steps=4)
        >>> [round(s(torch.tensor(i)).item(), 2) for i in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    api = "linear_schedule"
    init_value = check_real(api, "init_value", init_value)
    end_value = check_real(api, "end_value", end_value)
    transition_steps = check_int(api, "transition_steps", transition_steps, minimum=1)
    transition_begin = check_int(api, "transition_begin", transition_begin, minimum=0)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        t = torch.clamp(_as_f64(count, api) - transition_begin, 0.0, float(transition_steps))
        frac = t / transition_steps
        return init_value + (end_value - init_value) * frac

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` steps.

    This is optax's ``cosine_decay_schedule``. For ``exponent=1`` it is torch's
    ``CosineAnnealingLR`` with ``eta_min = alpha * lr``.

    Args:
        init_value: value at count 0.
        decay_steps: number of steps to decay over (> 0). The value stays at the end afterwards.
        alpha: final value as a fraction of ``init_value`` (>= 0).
        exponent: power applied to the cosine factor (> 0).

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.cosine_decay_schedule(1.0, decay_steps=4)
        >>> [round(s(torch.tensor(i)).item(), 4) for i in range(5)]
        [1.0, 0.8536, 0.5, 0.1464, 0.0]
    """
    api = "cosine_decay_schedule"
    init_value = check_real(api, "init_value", init_value)
    decay_steps = check_int(api, "decay_steps", decay_steps, minimum=1)
    alpha = check_real(api, "alpha", alpha, low=0.0)
    exponent = check_real(api, "exponent", exponent)
    if exponent <= 0:
        raise ValueError(f"funcamp.{api}: `exponent` must be > 0, got {exponent!r}")

    def schedule(count: torch.Tensor) -> torch.Tensor:
        t = torch.clamp(_as_f64(count, api), 0.0, float(decay_steps))
        cosine = 0.5 * (1.0 + torch.cos(t * (math.pi / decay_steps)))
        decayed = (1.0 - alpha) * cosine**exponent + alpha
        return init_value * decayed

    return schedule


def linear_warmup_cosine_decay(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    init_value: float = 0.0,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``
    (optax's ``warmup_cosine_decay_schedule``).

    Args:
        peak_value: value reached at count ``warmup_steps``.
        warmup_steps: length of the linear warmup (>= 0).
        decay_steps: total length of the schedule *including* the warmup (>= 1). From count
            ``max(decay_steps, warmup_steps)`` on, the value is ``end_value``. A run may be
            shorter than its warmup (no cosine then), as nanoGPT allows.
        init_value: value at count 0.
        end_value: final value.
        exponent: power applied to the cosine factor (> 0).

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.linear_warmup_cosine_decay(1.0, warmup_steps=2, decay_steps=6)
        >>> [round(s(torch.tensor(i)).item(), 3) for i in range(7)]
        [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0]
    """
    api = "linear_warmup_cosine_decay"
    peak_value = check_real(api, "peak_value", peak_value)
    warmup_steps = check_int(api, "warmup_steps", warmup_steps, minimum=0)
    decay_steps = check_int(api, "decay_steps", decay_steps, minimum=1)
    init_value = check_real(api, "init_value", init_value)
    end_value = check_real(api, "end_value", end_value)
    exponent = check_real(api, "exponent", exponent)
    if exponent <= 0:
        raise ValueError(f"funcamp.{api}: `exponent` must be > 0, got {exponent!r}")
    cosine_steps = decay_steps - warmup_steps  # <= 0: the warmup ends at end_value

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = _as_f64(count, api)
        if warmup_steps > 0:
            frac = torch.clamp(c, 0.0, float(warmup_steps)) / warmup_steps
            warm = init_value + (peak_value - init_value) * frac
        else:
            warm = torch.full_like(c, peak_value)
        if cosine_steps > 0:
            t = torch.clamp(c - warmup_steps, 0.0, float(cosine_steps))
            cosine = (0.5 * (1.0 + torch.cos(t * (math.pi / cosine_steps)))) ** exponent
            decay = end_value + (peak_value - end_value) * cosine
        else:
            decay = torch.full_like(c, end_value)
        return torch.where(c < warmup_steps, warm, decay)

    return schedule


def _mark(schedule: Callable[[torch.Tensor], torch.Tensor], base: float) -> Schedule:
    """Record the base learning rate (torch's ``initial_lr``) for :func:`chained_lr`."""
    schedule.base_lr = base  # type: ignore[attr-defined]
    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Join schedules at step boundaries.

    This is optax's ``join_schedules`` and torch's ``SequentialLR(schedulers, milestones)``.
    From ``boundaries[i]`` on, the value is ``schedules[i + 1](count - boundaries[i])``. So each
    schedule starts from its own count 0.

    Args:
        schedules: the schedules, one more than ``boundaries``.
        boundaries: increasing step counts (ints >= 0).

    Example:
        >>> import torch, funcamp
        >>> warm = funcamp.optim.linear_lr(1.0, start_factor=0.5, total_iters=2)
        >>> decay = funcamp.optim.exponential_lr(1.0, gamma=0.5)
        >>> s = funcamp.optim.join_schedules([warm, decay], [2])
        >>> [s(torch.tensor(i)).item() for i in range(5)]
        [0.5, 0.75, 1.0, 0.5, 0.25]
    """
    api = "optim.join_schedules"
    schedules = list(schedules)
    bounds = [check_int(api, "boundaries[i]", b, minimum=0) for b in boundaries]
    if len(schedules) != len(bounds) + 1:
        raise ValueError(
            f"funcamp.{api}: `schedules` must hold one more schedule than `boundaries`, got "
            f"{len(schedules)} schedules and {len(bounds)} boundaries"
        )
    for i, s in enumerate(schedules):
        if not callable(s):
            raise TypeError(f"funcamp.{api}: `schedules[{i}]` must be a schedule, got {s!r}")
    if any(a > b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"funcamp.{api}: `boundaries` must be increasing, got {bounds}")

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = count if isinstance(count, torch.Tensor) else torch.as_tensor(count)
        out = schedules[0](c)
        for b, s in zip(bounds, schedules[1:]):
            value = s(torch.clamp(c - b, min=0))
            out = torch.where(c >= b, value.to(out.dtype), out)
        return out

    base = getattr(schedules[0], "base_lr", None)
    return schedule if base is None else _mark(schedule, base)


def chained_lr(*schedules: Schedule) -> Schedule:
    """torch's ``ChainedScheduler``, or several schedulers stepped on one optimizer.

    Each scheduler multiplies the learning rate by its own factor. So the value is the base
    learning rate times the product of each schedule's ``value / base``.

    Args:
        *schedules: schedules from this module (each knows its base learning rate), with the
            same base (torch's ``initial_lr``, shared by the schedulers of one param group).

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.chained_lr(
        ...     funcamp.optim.constant_lr(1.0, factor=0.5, total_iters=2),
        ...     funcamp.optim.exponential_lr(1.0, gamma=0.5),
        ... )
        >>> [s(torch.tensor(i)).item() for i in range(4)]
        [0.5, 0.25, 0.25, 0.125]
    """
    api = "optim.chained_lr"
    if not schedules:
        raise ValueError(f"funcamp.{api}: `schedules` must hold at least one schedule, got none")
    bases = []
    for i, s in enumerate(schedules):
        base = getattr(s, "base_lr", None)
        if base is None:
            raise TypeError(
                f"funcamp.{api}: `schedules[{i}]` must be a schedule of funcamp.optim (one that "
                f"knows its base learning rate), got {s!r}"
            )
        bases.append(base)
    if any(b != bases[0] for b in bases):
        raise ValueError(
            f"funcamp.{api}: the schedules must share one base learning rate (the param "
            f"group's lr), got {bases}"
        )
    base = bases[0]

    def schedule(count: torch.Tensor) -> torch.Tensor:
        out = schedules[0](count)
        for s in schedules[1:]:
            out = out * (s(count) / base) if base != 0 else out * 0
        return out

    return _mark(schedule, base)
