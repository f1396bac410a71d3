"""Gradient accumulation (:func:`accumulate`) and its window under a loss scaler.

:func:`funcamp.unscale_and_step` reads and closes the window, so that a window of micro-steps
is ``torch.amp.GradScaler``'s optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.checks import (
    check_count,
    check_flag,
    check_int,
    check_state_like,
    check_state_type,
    flatten_grads,
    flatten_params,
    state_leaves,
)
from funcamp._core.numerics import math_dtype
from funcamp._core.stack import Pushing
from funcamp._core.tree import NAMESPACE, PyTree, tree_select, unflatten
from funcamp.optim._base import (
    ACCUMULATES,
    Optimizer,
    Prepared,
    SetParam,
    Writes,
    check_optimizer,
    is_set_param,
    learning_rate,
    prepare_update,
)
from funcamp.optim._paths import choose_ops

__all__ = [
    "AccumulateState",
    "AccumulationWindow",
    "accumulate",
    "accumulate_applies",
    "accumulation_window",
    "close_window",
    "reporting_accumulated",
]
Tensors = list[torch.Tensor]


class AccumulateState(NamedTuple):
    """State of :func:`funcamp.accumulate`.

    Attributes:
        micro_step: 0-d int32, the micro-batches summed so far.
        applies: 0-d bool, whether the next update applies.
        grad_sum: params-shaped float32 sums.
        inner: the wrapped optimizer's state.
        overflowed: 0-d bool, True when a micro-batch of this window had an inf or nan
            gradient. The window's update will then be skipped. Kept by
            :func:`funcamp.unscale_and_step`.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.accumulate(funcamp.sgd(0.1), every=2).init({"w": torch.zeros(1)})
        >>> s.micro_step, s.applies, s.grad_sum, s.overflowed
        (tensor(0, dtype=torch.int32), tensor(False), {'w': tensor([0.])}, tensor(False))
    """

    micro_step: torch.Tensor
    applies: torch.Tensor
    grad_sum: PyTree
    inner: PyTree
    overflowed: torch.Tensor


# --------------------------------------------------------------------------------------------
# accumulate


def accumulate(optimizer: Optimizer, every: int, *, average: bool = True) -> Optimizer:
    """Gradient accumulation over ``every`` micro-steps.

    Each call adds the grads (in float32) to a running sum. On micro-steps 1 … ``every - 1`` the
    updates are zero, and the inner optimizer's state is untouched. On the ``every``-th, the
    averaged grads ``sum / every`` go through ``optimizer``. Its updates are returned, and the sum
    resets. With equal micro-batches and a mean loss, this is one step on the concatenated batch.
    Torch's recipe divides each micro-batch's loss by ``every`` instead and sums the gradients:
    the same average, rounded otherwise. ``average=False`` is that recipe: divide the loss by
    ``every`` in ``loss_fn``, and the summed gradients reach ``optimizer`` as they are, bit for
    bit ``backward``'s accumulation into ``.grad``. The inner update is computed on every
    micro-step and selected with ``torch.where``, with no host sync. So each micro-step costs one
    inner update.

    Under a loss scaler (:func:`funcamp.unscale_and_step`, the train step), the window is
    ``torch.amp.GradScaler``'s optimizer step. An inf or nan gradient in any micro-batch skips the
    whole update. The inner state and the count that schedules see stay as they were, and the
    window starts afresh. The train step updates the scaler once per window, on the micro-step that
    applies (``growth_interval`` counts optimizer steps).

    To clip, clip inside: ``accumulate(chain(clip_by_global_norm(c), opt), every)`` clips the
    accumulated gradient. :func:`funcamp.chain` refuses a clip in front of ``accumulate``, which
    would clip each micro-batch.

    Use :func:`accumulate_applies` on the state *before* an update to learn whether that update
    applies (for example, to all-reduce grads only then). Called directly, outside
    ``unscale_and_step``, it knows nothing of overflows. A caller that keeps the old state on a bad
    micro-batch (``tree_select``) drops that micro-batch, and the next one takes its place.

    Args:
        optimizer: the inner :class:`Optimizer`.
        every: number of micro-steps per update (>= 1).
        average: divide the summed gradients by ``every`` (default); False passes the sum on
            (torch's recipe, whose loss is divided by ``every``).

    Returns:
        An :class:`Optimizer` whose state is a :class:`funcamp.optim.AccumulateState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.accumulate(funcamp.sgd(1.0), every=2)
        >>> params = {"w": torch.zeros(1)}
        >>> state = opt.init(params)
        >>> u1, state = opt.update({"w": torch.tensor([1.0])}, state, params)
        >>> funcamp.accumulate_applies(state)
        tensor(True)
        >>> u2, state = opt.update({"w": torch.tensor([3.0])}, state, params)
        >>> u1, u2
        ({'w': tensor([0.])}, {'w': tensor([-2.])})
    """
    api = "accumulate"
    check_optimizer(api, "optimizer", optimizer)
    check_int(api, "every", every, minimum=1)
    check_flag(api, "average", average)
    divisor = every if average else 1

    def init(params: PyTree) -> AccumulateState:
        leaves, spec = flatten_params(api, params)
        sums = [torch.zeros_like(p, dtype=math_dtype(p.dtype)) for p in leaves]
        device = leaves[0].device if leaves else torch.device("cpu")
        count = torch.zeros((), dtype=torch.int32, device=device)
        return AccumulateState(
            count,
            torch.full_like(count, every == 1, dtype=torch.bool),
            unflatten(spec, sums),
            optimizer.init(params),
            torch.zeros((), dtype=torch.bool, device=device),
        )

    def checked(
        grads: PyTree, state: AccumulateState, params: PyTree
    ) -> tuple[Tensors, Tensors | None, Any]:
        """Flatten the inputs, checking the state against them (metadata only)."""
        check_state_type(api, state, AccumulateState, "an")
        gs, ps, spec = flatten_grads(api, grads, params, need_params=False)
        check_count(api, "micro_step", state.micro_step)
        check_count(api, "applies", state.applies, torch.bool)
        check_count(api, "overflowed", state.overflowed, torch.bool)
        if gs:
            sums = state_leaves(api, "grad_sum", state.grad_sum, spec)
            dtypes = [math_dtype(r.dtype) for r in (ps if ps is not None else gs)]
            check_state_like(api, "grad_sum", sums, gs, dtypes, grads)
        return gs, ps, spec

    def update(grads: PyTree, state: AccumulateState, params: PyTree = None) -> Any:
        gs, ps, spec = checked(grads, state, params)
        plain = Prepared(None, lambda avg, writes: optimizer.update(avg, state.inner, params))
        return _accumulate(optimizer, every, divisor, grads, state, params, (), gs, ps, spec, plain)

    def prepare(grads: PyTree, state: AccumulateState, params: PyTree = None) -> Prepared:
        checked(grads, state, params)
        inner = prepare_update(optimizer, grads, state.inner, params)
        bad = inner.unusable_lr
        flag = None if bad is None else bad & state.applies.to(bad.device)

        def run(grads: PyTree, writes: Writes) -> tuple[PyTree, AccumulateState]:
            gs, ps, spec = checked(grads, state, params)
            owned = writes.owned
            return _accumulate(
                optimizer,
                every,
                divisor,
                grads,
                state,
                params,
                owned,
                gs,
                ps,
                spec,
                inner,
                writes.new_params,
            )

        return Prepared(flag, run, inner.fresh)

    def rate(state: AccumulateState) -> Any:
        return learning_rate(optimizer, state.inner)

    ACCUMULATES.add(update)
    has_rate = optimizer.learning_rate is not None
    return Optimizer(init, update, prepare, rate if has_rate else None)


def _accumulate(
    optimizer: Optimizer,
    every: int,
    divisor: int,
    grads: PyTree,
    state: AccumulateState,
    params: PyTree,
    owned: Sequence[torch.Tensor],
    gs: Tensors,
    ps: Tensors | None,
    spec: Any,
    inner_update: Prepared,
    new: bool = False,
) -> tuple[PyTree, AccumulateState]:
    """One micro-step of :func:`accumulate` (its inputs checked and flattened): add the grads
    to the sums and, on the step that applies, run ``optimizer`` (prepared as
    ``inner_update``) on their sum divided by ``divisor``."""
    api = "accumulate"
    apply = state.applies
    micro = torch.where(apply, 0, state.micro_step + 1).to(torch.int32)
    if not gs:
        inner_updates, inner = optimizer.update(grads, state.inner, params)
        inner = tree_select(apply, inner, state.inner)
        return inner_updates, AccumulateState(
            micro, micro == every - 1, state.grad_sum, inner, state.overflowed
        )
    sums = state_leaves(api, "grad_sum", state.grad_sum, spec)
    ops = choose_ops([*gs, *sums], owned=owned)
    sums = ops.add(sums, ops.to_math(gs))
    new_sums = [torch.where(apply, torch.zeros_like(s), s) for s in sums]
    avg = ops.div(sums, float(divisor)) if divisor > 1 else sums
    del sums
    if _REPORTS:  # before the inner optimizer, which may overwrite avg in place
        _REPORTS[-1](avg)
    avg_tree = unflatten(spec, avg)
    # avg: this update's temporaries, which the inner optimizer may overwrite
    inner_updates, inner = inner_update.run(avg_tree, Writes(avg if owned else (), new_params=new))
    inner = tree_select(apply, inner, state.inner)
    ups, uspec = optree.tree_flatten(inner_updates, is_leaf=is_set_param, namespace=NAMESPACE)
    if len(ups) != len(gs):
        raise ValueError(
            f"funcamp.{api}: the inner optimizer's updates must have the grads' structure, "
            f"got {uspec}"
        )
    out = []
    for u, p in zip(ups, ps if ps is not None else [None] * len(ups)):
        if isinstance(u, SetParam):
            out.append(SetParam(torch.where(apply, u.value, p)))
        else:
            out.append(torch.where(apply, u, torch.zeros_like(u)))
    return unflatten(uspec, out), AccumulateState(
        micro, micro == every - 1, unflatten(spec, new_sums), inner, state.overflowed
    )


def accumulate_applies(opt_state: PyTree) -> torch.Tensor:
    """Return a 0-d bool tensor: True when the next ``update`` with ``opt_state`` applies.

    An update applies on the last micro-step of :func:`accumulate`. ``opt_state`` may be an
    :class:`funcamp.optim.AccumulateState` or contain one (e.g. inside a :func:`chain`'s tuple).
    Without one every step applies, and the result is True.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.accumulate(funcamp.sgd(0.1), every=3)
        >>> funcamp.accumulate_applies(opt.init({"w": torch.zeros(1)}))
        tensor(False)
        >>> funcamp.accumulate_applies(funcamp.sgd(0.1).init({"w": torch.zeros(1)}))
        tensor(True)
    """
    found = [
        x
        for x in optree.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, AccumulateState), namespace=NAMESPACE
        )
        if isinstance(x, AccumulateState)
    ]
    if not found:
        return torch.ones((), dtype=torch.bool)
    out = found[0].applies
    for f in (s.applies for s in found[1:]):
        out = out & f.to(out.device)
    return out


# --------------------------------------------------------------------------------------------
# accumulation under a loss scaler: GradScaler's optimizer step (read by unscale_and_step)

_REPORTS: list[Callable[[Tensors], None]] = []


class reporting_accumulated(Pushing):
    """Make :func:`accumulate` updates report their averaged grads while this is active.

    Inside ``with reporting_accumulated(report): ...``, an update calls
    ``report(averaged_grads)`` before its inner optimizer runs. The leaves are float32, not to be
    kept or written. :func:`funcamp.unscale_and_step` takes the accumulated gradient's norm
    there.
    """

    def __init__(self, report: Callable[[Tensors], None] | None) -> None:
        super().__init__(_REPORTS, report)


def _accumulate_states(opt_state: PyTree) -> list[AccumulateState]:
    return [
        x
        for x in optree.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, AccumulateState), namespace=NAMESPACE
        )
        if isinstance(x, AccumulateState)
    ]


class AccumulationWindow(NamedTuple):
    """The window of the :func:`accumulate` states in an optimizer state, read before an update.

    ``applies``: the update closes the window. ``overflowed``: a micro-batch of the window so
    far had an inf or nan gradient. Each state also keeps its own ``applies``.
    """

    applies: torch.Tensor
    overflowed: torch.Tensor
    each: tuple[torch.Tensor, ...]


def accumulation_window(optimizer: Optimizer, opt_state: PyTree) -> AccumulationWindow | None:
    """The :class:`AccumulationWindow` of ``opt_state``.

    None when ``optimizer`` neither is nor holds an :func:`accumulate`. Each flag is copied,
    since the step overwrites a donated state. Whether an optimizer holds one is known when it
    is built (:func:`funcamp.chain`, :func:`masked` and :func:`multi_transform` pass it on). So
    an optimizer without one pays no search of its state.
    """
    if optimizer.update not in ACCUMULATES:
        return None
    found = _accumulate_states(opt_state)
    if not found:
        return None
    each = tuple(s.applies.clone() for s in found)
    applies, overflowed = each[0], found[0].overflowed
    for s, a in zip(found[1:], each[1:]):
        applies = applies & a.to(applies.device)
        overflowed = overflowed | s.overflowed.to(overflowed.device)
    return AccumulationWindow(applies, overflowed.clone(), each)


def close_window(
    opt_state: PyTree,
    window: AccumulationWindow,
    skipped: torch.Tensor,
    window_inf: torch.Tensor,
    in_place: bool,
) -> PyTree:
    """The optimizer state after a micro-step under a loss scaler.

    Each :class:`AccumulateState` records whether its window overflowed (``window_inf``, until
    the window closes). Where the window's update was ``skipped``, it starts a new window. (A
    skipped step kept the old state: its sums and its last micro-step.) With ``in_place``, the
    result is written into the state's tensors (a donated state).
    """
    each = iter(window.each)

    def close(s: Any) -> Any:
        if not isinstance(s, AccumulateState):
            return s
        was_applying = next(each)
        overflowed = window_inf.to(s.overflowed.device) & ~was_applying
        skip = skipped.to(s.micro_step.device)
        # the old state's last micro-step is every - 1: every == 1 when it is 0
        applies = torch.where(skip, s.micro_step == 0, s.applies)
        micro = torch.where(skip, torch.zeros_like(s.micro_step), s.micro_step)
        if in_place:
            s.applies.copy_(applies)
            s.micro_step.copy_(micro)
            s.overflowed.copy_(overflowed)
            for x in optree.tree_leaves(s.grad_sum, namespace=NAMESPACE):
                x.masked_fill_(skip.to(x.device), 0)
            return s
        sums = optree.tree_map(
            lambda x: torch.where(skip.to(x.device), torch.zeros_like(x), x),
            s.grad_sum,
            namespace=NAMESPACE,
        )
        return AccumulateState(micro, applies, sums, s.inner, overflowed)

    return optree.tree_map(
        close, opt_state, is_leaf=lambda x: isinstance(x, AccumulateState), namespace=NAMESPACE
    )
