"""torch.optim.lr_scheduler's schedules as functions of the step count.

Each function here is the schedule of one ``torch.optim.lr_scheduler`` class. Its value at count
``t`` is the learning rate that class reports (``scheduler.get_last_lr()``) after ``t`` calls of
``scheduler.step()``. That is the learning rate of optimizer step ``t + 1``. (Count ``t`` is the
number of updates applied before this one, as every funcamp schedule receives.) They compute in
float64 from torch's closed forms, operation for operation where torch has one. They return a 0-d
float64 tensor. Torch's learning rate is a Python float (a double), and funcamp's optimizers
compute their step sizes from it in float64 and round once, as torch.optim does.

Several classes step *recursively* (``lr = lr * ratio``; torch's "chainable form"). Over a long run
this accumulates a rounding error of a few double ulps that the closed form lacks. The values agree
to ~1e-13 relative. Rounded to float32 they almost always agree bit for bit.
:func:`lambda_lr`/:func:`multiplicative_lr` with ``total_steps`` tabulate a Python function in
Python doubles, exactly as torch calls it, and index the table by the count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcamp._core.checks import check_int, check_real
from funcamp.optim._schedules import Schedule, _as_f64, _mark

__all__ = [
    "constant_lr",
    "cosine_annealing_lr",
    "cosine_annealing_warm_restarts",
    "cyclic_lr",
    "exponential_lr",
    "lambda_lr",
    "linear_lr",
    "multi_step_lr",
    "multiplicative_lr",
    "one_cycle_lr",
    "polynomial_lr",
    "step_lr",
]


def _lr(api: str, lr: Any) -> float:
    return check_real(api, "lr", lr, low=0.0)


def _positive(api: str, name: str, value: Any) -> float:
    value = check_real(api, name, value)
    if value <= 0:
        raise ValueError(f"funcamp.{api}: `{name}` must be > 0, got {value!r}")
    return value


def step_lr(lr: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """``torch.optim.lr_scheduler.StepLR``: ``lr * gamma ** (count // step_size)``.

    Args:
        lr: the initial learning rate (the optimizer's ``lr``).
        step_size: steps between decays (>= 1).
        gamma: the decay factor.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.step_lr(1.0, step_size=2, gamma=0.5)
        >>> [s(torch.tensor(i)).item() for i in range(5)]
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    api = "optim.step_lr"
    lr = _lr(api, lr)
    step_size = check_int(api, "step_size", step_size, minimum=1)
    gamma = check_real(api, "gamma", gamma)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = _as_f64(count, api)
        return lr * gamma ** torch.floor(c / step_size)

    return _mark(schedule, lr)


def multi_step_lr(lr: float, milestones: Sequence[int], gamma: float = 0.1) -> Schedule:
    """``torch.optim.lr_scheduler.MultiStepLR``: ``lr`` times ``gamma`` once for each milestone
    reached (a milestone given twice counts twice, as torch's ``Counter`` does).

    Args:
        lr: the initial learning rate.
        milestones: step counts of the decays (ints >= 0, any order).
        gamma: the decay factor.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.multi_step_lr(1.0, milestones=[1, 3], gamma=0.5)
        >>> [s(torch.tensor(i)).item() for i in range(5)]
        [1.0, 0.5, 0.5, 0.25, 0.25]
    """
    api = "optim.multi_step_lr"
    lr = _lr(api, lr)
    if isinstance(milestones, (str, bytes)) or not isinstance(milestones, Sequence):
        raise TypeError(f"funcamp.{api}: `milestones` must be a list of ints, got {milestones!r}")
    points = sorted(check_int(api, "milestones[i]", m, minimum=0) for m in milestones)
    gamma = check_real(api, "gamma", gamma)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = _as_f64(count, api)
        n = torch.zeros_like(c)
        for m in points:
            n = n + (c >= m).to(torch.float64)
        return lr * gamma**n

    return _mark(schedule, lr)


def exponential_lr(lr: float, gamma: float) -> Schedule:
    """``torch.optim.lr_scheduler.ExponentialLR``: ``lr * gamma ** count``.

    Args:
        lr: the initial learning rate.
        gamma: the decay factor per step.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.exponential_lr(1.0, gamma=0.5)
        >>> [s(torch.tensor(i)).item() for i in range(3)]
        [1.0, 0.5, 0.25]
    """
    api = "optim.exponential_lr"
    lr = _lr(api, lr)
    gamma = check_real(api, "gamma", gamma)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        return lr * gamma ** _as_f64(count, api)

    return _mark(schedule, lr)


def cosine_annealing_lr(lr: float, T_max: int, eta_min: float = 0.0) -> Schedule:
    """``torch.optim.lr_scheduler.CosineAnnealingLR``:
    ``eta_min + (lr - eta_min) * (1 + cos(pi * count / T_max)) / 2``.

    As torch's, the cosine goes on past ``T_max`` (back up to ``lr`` at ``2 * T_max``); for a
    schedule that stays at its end use :func:`funcamp.cosine_decay_schedule`.

    Args:
        lr: the initial learning rate.
        T_max: half period, in steps (>= 1).
        eta_min: the minimum learning rate.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.cosine_annealing_lr(1.0, T_max=2)
        >>> [round(s(torch.tensor(i)).item(), 6) for i in range(5)]
        [1.0, 0.5, 0.0, 0.5, 1.0]
    """
    api = "optim.cosine_annealing_lr"
    lr = _lr(api, lr)
    T_max = check_int(api, "T_max", T_max, minimum=1)
    eta_min = check_real(api, "eta_min", eta_min, low=0.0)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = _as_f64(count, api)
        return eta_min + (lr - eta_min) * (1 + torch.cos(math.pi * c / T_max)) / 2

    return _mark(schedule, lr)


def cosine_annealing_warm_restarts(
    lr: float,
    T_0: int,
    T_mult: int = 1,
    eta_min: float = 0.0,
) -> Schedule:
    """``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts`` (SGDR; optax's
    ``sgdr_schedule``): a cosine from ``lr`` to ``eta_min`` over ``T_0`` steps, restarted,
    each cycle ``T_mult`` times longer than the one before.

    Args:
        lr: the initial learning rate.
        T_0: steps of the first cycle (>= 1).
        T_mult: growth factor of the cycles (an int >= 1).
        eta_min: the minimum learning rate.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.cosine_annealing_warm_restarts(1.0, T_0=2, T_mult=2)
        >>> [round(s(torch.tensor(i)).item(), 4) for i in range(7)]
        [1.0, 0.5, 1.0, 0.8536, 0.5, 0.1464, 1.0]
    """
    api = "optim.cosine_annealing_warm_restarts"
    lr = _lr(api, lr)
    T_0 = check_int(api, "T_0", T_0, minimum=1)
    T_mult = check_int(api, "T_mult", T_mult, minimum=1)
    eta_min = check_real(api, "eta_min", eta_min, low=0.0)
    # the cycles' first counts and lengths, exactly, up to 2**53
    starts, lengths = [0], [T_0]
    if T_mult > 1:
        while starts[-1] + lengths[-1] < 2**53:
            starts.append(starts[-1] + lengths[-1])
            lengths.append(lengths[-1] * T_mult)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = _as_f64(count, api)
        if T_mult == 1:
            t_cur, t_i = torch.remainder(c, T_0), torch.full_like(c, float(T_0))
        else:
            t_cur, t_i = c, torch.full_like(c, float(T_0))
            for s, n in zip(starts[1:], lengths[1:]):
                after = c >= s
                t_cur = torch.where(after, c - s, t_cur)
                t_i = torch.where(after, torch.full_like(c, float(n)), t_i)
        return eta_min + (lr - eta_min) * (1 + torch.cos(math.pi * t_cur / t_i)) / 2

    return _mark(schedule, lr)


def linear_lr(
    lr: float, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5
) -> Schedule:
    """``torch.optim.lr_scheduler.LinearLR``: ``lr`` times a factor going linearly from
    ``start_factor`` to ``end_factor`` over ``total_iters`` steps, then ``end_factor``.

    Args:
        lr: the initial learning rate.
        start_factor: the factor at count 0, in (0, 1].
        end_factor: the factor from count ``total_iters`` on, in [0, 1].
        total_iters: steps of the ramp (>= 0; 0: ``end_factor`` from the start).

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.linear_lr(1.0, start_factor=0.5, total_iters=2)
        >>> [s(torch.tensor(i)).item() for i in range(4)]
        [0.5, 0.75, 1.0, 1.0]
    """
    api = "optim.linear_lr"
    lr = _lr(api, lr)
    start_factor = check_real(api, "start_factor", start_factor, high=1.0)
    if start_factor <= 0:
        raise ValueError(f"funcamp.{api}: `start_factor` must be in (0, 1], got {start_factor}")
    end_factor = check_real(api, "end_factor", end_factor, low=0.0, high=1.0)
    total_iters = check_int(api, "total_iters", total_iters, minimum=0)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = _as_f64(count, api)
        if total_iters == 0:
            return torch.full_like(c, lr * end_factor)
        t = torch.clamp(c, max=float(total_iters))
        return lr * (start_factor + (end_factor - start_factor) * t / total_iters)

    return _mark(schedule, lr)


def constant_lr(lr: float, factor: float = 1.0 / 3, total_iters: int = 5) -> Schedule:
    """``torch.optim.lr_scheduler.ConstantLR``: ``lr * factor`` for the first ``total_iters``
    steps, ``lr`` afterwards.

    Args:
        lr: the initial learning rate.
        factor: the factor, in [0, 1].
        total_iters: steps at the lowered rate (>= 0).

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.constant_lr(1.0, factor=0.5, total_iters=2)
        >>> [s(torch.tensor(i)).item() for i in range(4)]
        [0.5, 0.5, 1.0, 1.0]
    """
    api = "optim.constant_lr"
    lr = _lr(api, lr)
    factor = check_real(api, "factor", factor, low=0.0, high=1.0)
    total_iters = check_int(api, "total_iters", total_iters, minimum=0)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = _as_f64(count, api)
        return torch.where(c < total_iters, lr * factor, lr + 0 * c)

    return _mark(schedule, lr)


def polynomial_lr(lr: float, total_iters: int = 5, power: float = 1.0) -> Schedule:
    """``torch.optim.lr_scheduler.PolynomialLR``:
    ``lr * (1 - min(count, total_iters) / total_iters) ** power``.

    Args:
        lr: the initial learning rate.
        total_iters: steps to reach 0 (>= 1).
        power: the polynomial's power.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.polynomial_lr(1.0, total_iters=4, power=2.0)
        >>> [s(torch.tensor(i)).item() for i in range(5)]
        [1.0, 0.5625, 0.25, 0.0625, 0.0]
    """
    api = "optim.polynomial_lr"
    lr = _lr(api, lr)
    total_iters = check_int(api, "total_iters", total_iters, minimum=1)
    power = check_real(api, "power", power)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        t = torch.clamp(_as_f64(count, api), max=float(total_iters))
        return lr * (1.0 - t / total_iters) ** power

    return _mark(schedule, lr)


def _tabulate(api: str, values: list[float]) -> Callable[[torch.Tensor], torch.Tensor]:
    table = torch.tensor(values, dtype=torch.float64)
    last = len(values) - 1

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = _as_f64(count, api)
        i = torch.clamp(c, 0, last).to(torch.int64)
        return torch.index_select(table.to(c.device), 0, i.reshape(1)).reshape(())

    return schedule


def lambda_lr(
    lr: float, lr_lambda: Callable[[Any], Any], total_steps: int | None = None
) -> Schedule:
    """``torch.optim.lr_scheduler.LambdaLR``: ``lr * lr_lambda(count)``.

    With ``total_steps``, ``lr_lambda`` is called once, when the schedule is built, on the Python
    ints ``0 … total_steps`` (as torch calls it). The values are Python doubles, torch's numbers
    exactly, looked up by the count. Past ``total_steps`` the last one holds. Without
    ``total_steps``, ``lr_lambda`` receives the count as a 0-d float64 tensor on every call. It
    must then compute with tensor operations, so that it traces (no ``float()``/``if`` on the
    value).

    Args:
        lr: the initial learning rate.
        lr_lambda: the factor as a function of the step count.
        total_steps: tabulate ``lr_lambda`` over this many steps (>= 1), or None.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.lambda_lr(0.5, lambda t: 0.9**t, total_steps=100)
        >>> [round(s(torch.tensor(i)).item(), 3) for i in range(3)]
        [0.5, 0.45, 0.405]
        >>> s = funcamp.optim.lambda_lr(0.5, lambda t: 1 / (1 + t))
        >>> s(torch.tensor(3)).item()
        0.125
    """
    api = "optim.lambda_lr"
    lr = _lr(api, lr)
    if not callable(lr_lambda):
        raise TypeError(f"funcamp.{api}: `lr_lambda` must be callable, got {lr_lambda!r}")
    if total_steps is not None:
        total_steps = check_int(api, "total_steps", total_steps, minimum=1)
        return _mark(_tabulate(api, [lr * lr_lambda(t) for t in range(total_steps + 1)]), lr)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        factor = lr_lambda(_as_f64(count, api))
        return lr * torch.as_tensor(factor, dtype=torch.float64)

    return _mark(schedule, lr)


def multiplicative_lr(lr: float, lr_lambda: Callable[[int], float], total_steps: int) -> Schedule:
    """``torch.optim.lr_scheduler.MultiplicativeLR``: the learning rate multiplied by
    ``lr_lambda(t)`` at each step ``t = 1, 2, ...``.

    A running product has no closed form. So ``lr_lambda`` is called once, when the schedule is
    built, on the Python ints ``1 … total_steps``. The products are taken in Python doubles, in
    torch's order, so they are torch's numbers exactly. They are looked up by the count. Past
    ``total_steps`` the last one holds.

    Args:
        lr: the initial learning rate.
        lr_lambda: the factor of step ``t`` (a Python int).
        total_steps: the steps to tabulate (>= 1).

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.multiplicative_lr(1.0, lambda t: 0.5, total_steps=10)
        >>> [s(torch.tensor(i)).item() for i in range(3)]
        [1.0, 0.5, 0.25]
    """
    api = "optim.multiplicative_lr"
    lr = _lr(api, lr)
    if not callable(lr_lambda):
        raise TypeError(f"funcamp.{api}: `lr_lambda` must be callable, got {lr_lambda!r}")
    total_steps = check_int(api, "total_steps", total_steps, minimum=1)
    values = [lr]
    for t in range(1, total_steps + 1):
        values.append(values[-1] * lr_lambda(t))
    return _mark(_tabulate(api, values), lr)


def cyclic_lr(
    base_lr: float,
    max_lr: float,
    step_size_up: int = 2000,
    step_size_down: int | None = None,
    mode: str = "triangular",
    gamma: float = 1.0,
    scale_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    scale_mode: str = "cycle",
) -> Schedule:
    """``torch.optim.lr_scheduler.CyclicLR``'s learning rate: cycles between ``base_lr`` and
    ``max_lr``, ``step_size_up`` steps up and ``step_size_down`` down.

    torch's class also cycles the optimizer's momentum (``cycle_momentum=True``, its default)
    from ``max_momentum`` down to ``base_momentum``. That is
    ``cyclic_lr(max_momentum, base_momentum, ...)``, passed as the optimizer's ``momentum``
    (``b1`` for Adam), the same doubles as torch's.

    Args:
        base_lr: the lowest learning rate.
        max_lr: the highest learning rate.
        step_size_up: steps of the rising half (>= 1).
        step_size_down: steps of the falling half (default ``step_size_up``).
        mode: ``"triangular"``, ``"triangular2"`` (the amplitude halves each cycle) or
            ``"exp_range"`` (scaled by ``gamma ** count``); ignored with ``scale_fn``.
        gamma: the ``"exp_range"`` base.
        scale_fn: a custom amplitude scaling, a function of a 0-d float64 tensor written
            with tensor operations.
        scale_mode: ``"cycle"`` (``scale_fn`` of the cycle number) or ``"iterations"``.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.cyclic_lr(0.0, 1.0, step_size_up=2)
        >>> [s(torch.tensor(i)).item() for i in range(6)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.5]
    """
    api = "optim.cyclic_lr"
    base_lr = check_real(api, "base_lr", base_lr, low=0.0)
    max_lr = check_real(api, "max_lr", max_lr, low=0.0)
    up = float(check_int(api, "step_size_up", step_size_up, minimum=1))
    down = (
        up
        if step_size_down is None
        else float(check_int(api, "step_size_down", step_size_down, minimum=1))
    )
    total = up + down
    ratio = up / total
    gamma = check_real(api, "gamma", gamma)
    if scale_fn is None:
        if mode not in ("triangular", "triangular2", "exp_range"):
            raise ValueError(
                f"funcamp.{api}: `mode` must be 'triangular', 'triangular2' or 'exp_range' "
                f"(or pass scale_fn), got {mode!r}"
            )
        fns: dict[str, tuple[Callable[[torch.Tensor], Any], str]] = {
            "triangular": (lambda x: 1.0, "cycle"),
            "triangular2": (lambda x: 1 / (2.0 ** (x - 1)), "cycle"),
            "exp_range": (lambda x: gamma**x, "iterations"),
        }
        fn, scale_mode = fns[mode]
    else:
        if not callable(scale_fn):
            raise TypeError(f"funcamp.{api}: `scale_fn` must be callable, got {scale_fn!r}")
        if scale_mode not in ("cycle", "iterations"):
            raise ValueError(
                f"funcamp.{api}: `scale_mode` must be 'cycle' or 'iterations', got {scale_mode!r}"
            )
        fn = scale_fn

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = _as_f64(count, api)
        cycle = torch.floor(1 + c / total)
        x = 1.0 + c / total - cycle
        scale = torch.where(x <= ratio, x / ratio, (x - 1) / (ratio - 1))
        height = (max_lr - base_lr) * scale
        return base_lr + height * fn(cycle if scale_mode == "cycle" else c)

    return _mark(schedule, base_lr)


def one_cycle_lr(
    max_lr: float,
    total_steps: int,
    pct_start: float = 0.3,
    anneal_strategy: str = "cos",
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    three_phase: bool = False,
) -> Schedule:
    """``torch.optim.lr_scheduler.OneCycleLR``'s learning rate: from ``max_lr / div_factor``
    up to ``max_lr`` over ``pct_start`` of the run, then down to
    ``max_lr / div_factor / final_div_factor`` (three phases with ``three_phase``).

    torch's ``epochs * steps_per_epoch`` is ``total_steps`` here; torch raises past
    ``total_steps``, this schedule holds its value at ``total_steps``. The momentum that
    torch's class cycles (``cycle_momentum=True``) is translated by
    :func:`funcamp.optim.from_torch`, which records both from the scheduler itself.

    Args:
        max_lr: the peak learning rate.
        total_steps: the length of the run (>= 1).
        pct_start: the fraction of the run spent rising, in [0, 1].
        anneal_strategy: ``"cos"`` or ``"linear"``.
        div_factor: ``max_lr / div_factor`` is the start.
        final_div_factor: the end is the start divided by it.
        three_phase: fall back to the start symmetrically before the final decay.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.optim.one_cycle_lr(1.0, total_steps=5, pct_start=0.4, div_factor=10)
        >>> [round(s(torch.tensor(i)).item(), 4) for i in range(5)]
        [0.1, 1.0, 0.75, 0.25, 0.0]
    """
    api = "optim.one_cycle_lr"
    max_lr = check_real(api, "max_lr", max_lr, low=0.0)
    total_steps = check_int(api, "total_steps", total_steps, minimum=1)
    pct_start = check_real(api, "pct_start", pct_start, low=0.0, high=1.0)
    if anneal_strategy not in ("cos", "linear"):
        raise ValueError(
            f"funcamp.{api}: `anneal_strategy` must be 'cos' or 'linear', got {anneal_strategy!r}"
        )
    div_factor = _positive(api, "div_factor", div_factor)
    final_div_factor = _positive(api, "final_div_factor", final_div_factor)
    initial = max_lr / div_factor
    minimum = initial / final_div_factor
    if three_phase:
        phases = [
            (float(pct_start * total_steps) - 1, initial, max_lr),
            (float(2 * pct_start * total_steps) - 2, max_lr, initial),
            (total_steps - 1, initial, minimum),
        ]
    else:
        phases = [
            (float(pct_start * total_steps) - 1, initial, max_lr),
            (total_steps - 1, max_lr, minimum),
        ]
    return _mark(phased(api, phases, anneal_strategy, total_steps), initial)


def phased(
    api: str, phases: list[tuple[float, float, float]], anneal_strategy: str, total_steps: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """OneCycleLR's phases ``(end_step, start_lr, end_lr)``, as its ``get_lr`` walks them."""

    def anneal(start: float, end: float, pct: torch.Tensor) -> torch.Tensor:
        if anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = torch.clamp(_as_f64(count, api), max=float(total_steps))
        out = None
        start_step = 0.0
        taken = torch.zeros_like(c, dtype=torch.bool)
        for i, (end_step, lo, hi) in enumerate(phases):
            here = ~taken & ((c <= end_step) if i < len(phases) - 1 else torch.ones_like(taken))
            span = end_step - start_step
            # torch divides by zero here too (a phase of no steps never applies to a count)
            pct = (c - start_step) / span if span != 0 else torch.zeros_like(c)
            value = anneal(lo, hi, pct)
            out = value if out is None else torch.where(here, value, out)
            taken = taken | here
            start_step = end_step
        assert out is not None
        return out

    return schedule
