"""The optimizer value, its one fast-path hook, the update leaves and :func:`chain`."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import optree
import torch

from funcamp._core.checks import any_flag
from funcamp._core.numerics import as_dtype, is_half
from funcamp._core.rounding import round_nearest
from funcamp._core.tree import (
    NAMESPACE,
    PyTree,
    describe,
    flatten,
    leaf_path,
    self_overlapping,
    spec_text,
    storage_key,
    unflatten,
)

__all__ = [
    "Optimizer",
    "Prepared",
    "SetParam",
    "SkipWrites",
    "NewParams",
    "Writes",
    "apply_updates",
    "apply_updates_owned",
    "chain",
    "exclusive",
    "learning_rate",
    "prepare_around",
    "prepare_update",
    "update_tensors",
]


#: The ``update`` functions of :func:`funcamp.clip_by_global_norm` (and of chains holding one)
#: and of :func:`funcamp.accumulate` (and of chains holding one): :func:`chain` refuses a clip
#: in front of an accumulation, which would clip each micro-batch.
CLIPS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
ACCUMULATES: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


class SkipWrites(Protocol):
    """What an optimizer may ask of the step's skip (``funcamp.scaling.skip.Skip``, the one
    owner of "keep the old value where the step overflowed")."""

    found_inf: torch.Tensor

    def advance(self, count: torch.Tensor) -> torch.Tensor: ...

    def write(self, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> Any: ...

    def flag(self, device: torch.device) -> torch.Tensor: ...


class Writes(NamedTuple):
    """What a prepared update may write (the eager and donated paths of
    :func:`funcamp.unscale_and_step`); the default writes nothing.

    Attributes:
        owned: grad tensors the caller owns: the update may overwrite them.
        skip: the state is donated: each new buffer may be written into the one it replaces
            with ``skip.write(old, new)`` once nothing can raise. None: write no state.
        kernels: with ``skip``, torch's fused kernels may update the params and state in place.
        new_params: the caller installs the updates into the params: an update whose
            algorithm computed the new params itself may return them as :class:`SetParam`
            leaves, bit for bit. False: plain deltas.

    Example:
        >>> import funcamp
        >>> funcamp.optim.Writes()
        Writes(owned=(), skip=None, kernels=False, new_params=False)
    """

    owned: Sequence[torch.Tensor] = ()
    skip: SkipWrites | None = None
    kernels: bool = False
    new_params: bool = False


class Prepared(NamedTuple):
    """One update, checked before anything is computed or written (see
    :attr:`Optimizer.prepare`).

    Attributes:
        unusable_lr: 0-d bool, True when this step's learning rate is NaN, infinite or
            negative (the step is then skipped like an overflow); or None.
        run: ``run(grads, writes) -> (updates, state)``: the update on ``grads`` (same
            structure as the prepared ones), writing only what :class:`Writes` allows.
            ``updates`` is None when a fused kernel already updated the params in place.
        fresh: ``run`` returns only tensors it made or leaves of its inputs, so the caller
            may reuse the new tensors in place.

    Example:
        >>> import torch, funcamp
        >>> opt, params = funcamp.sgd(0.5), {"w": torch.ones(2)}
        >>> grads = {"w": torch.ones(2)}
        >>> prepared = funcamp.optim.prepare_update(opt, grads, opt.init(params), params)
        >>> updates, _ = prepared.run(grads, funcamp.optim.Writes())
        >>> updates
        {'w': tensor([-0.5000, -0.5000])}
    """

    unusable_lr: torch.Tensor | None
    run: Callable[[PyTree, Writes], tuple[PyTree | None, PyTree]]
    fresh: bool = True


#: ``prepare(grads, state, params) -> Prepared``.
Prepare = Callable[[PyTree, PyTree, PyTree], Prepared]


def prepare_update(optimizer: Optimizer, grads: PyTree, state: PyTree, params: PyTree) -> Prepared:
    """``optimizer.prepare(grads, state, params)``, or the plain ``update`` behind the same
    interface for an optimizer without the hook (it writes nothing and is not ``fresh``).

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.Optimizer(lambda p: (), lambda g, s, p=None: (g, s))
        >>> prepared = funcamp.optim.prepare_update(opt, {"w": torch.ones(1)}, (), None)
        >>> prepared.fresh, prepared.run({"w": torch.ones(1)}, funcamp.optim.Writes())[0]
        (False, {'w': tensor([1.])})
    """
    if optimizer.prepare is not None:
        return optimizer.prepare(grads, state, params)

    def run(grads: PyTree, writes: Writes) -> tuple[PyTree, PyTree]:
        return optimizer.update(grads, state, params)

    return Prepared(None, run, fresh=False)


def prepare_around(
    optimizer: Optimizer,
    update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]],
    inner_state: Callable[[PyTree], PyTree],
) -> Prepare:
    """The ``prepare`` hook of a wrapper whose ``update`` calls ``optimizer.update`` inside.

    It prepares ``optimizer`` on ``inner_state(state)`` (its checks, its learning-rate flag) and
    runs the wrapper's plain ``update``, whose results are as fresh as the inner optimizer's.
    """

    def prepare(grads: PyTree, state: PyTree, params: PyTree = None) -> Prepared:
        inner = prepare_update(optimizer, grads, inner_state(state), params)
        return Prepared(inner.unusable_lr, lambda g, writes: update(g, state, params), inner.fresh)

    return prepare


def learning_rate(optimizer: Optimizer, opt_state: PyTree) -> Any:
    """The learning rate the next ``optimizer.update`` from ``opt_state`` applies.

    It is the schedule's value at the state's step count, as a 0-d tensor. The count is the
    number of updates applied so far; skipped steps do not advance it. Reading it does not sync
    with the host, so it can be logged from a compiled step (:func:`funcamp.make_train_step`
    reports it as ``metrics["lr"]``).

    Through :func:`funcamp.chain` (the last part that has one), :func:`funcamp.accumulate` and
    :func:`funcamp.masked` it is the inner optimizer's. :func:`funcamp.multi_transform` gives a
    dict from each label to its optimizer's. None for an optimizer without a learning rate
    (:func:`funcamp.clip_by_global_norm`, or one that declares none).

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.adamw(funcamp.linear_schedule(1.0, 0.0, 10))
        >>> params = {"w": torch.zeros(1)}
        >>> state = opt.init(params)
        >>> _, state = opt.update({"w": torch.ones(1)}, state, params)
        >>> funcamp.optim.learning_rate(opt, state)
        tensor(0.9000, dtype=torch.float64)
    """
    check_optimizer("optim.learning_rate", "optimizer", optimizer)
    rate = optimizer.learning_rate
    return None if rate is None else rate(opt_state)


class Optimizer(NamedTuple):
    """A pair of pure functions: ``init(params) -> state`` and
    ``update(grads, state, params) -> (updates, state)``.

    Two fields are optional. ``prepare`` is the one fast-path hook,
    ``prepare(grads, state, params) -> Prepared``. It checks the inputs first, then runs the
    update, writing what :class:`funcamp.optim.Writes` allows. ``learning_rate`` is
    ``state -> lr``, what :func:`funcamp.optim.learning_rate` reports. An optimizer without them
    runs on the pure path, with the same results.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.sgd(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([0.9000, 0.9000])}
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
    prepare: Prepare | None = None
    learning_rate: Callable[[PyTree], Any] | None = None


class NewParams(NamedTuple):
    """An algorithm's result when it computed the new params itself (see
    :func:`funcamp.optim.elementwise`): torch.optim's last in-place op on the param
    (``p.add_(d, alpha=-lr)``, ``p.mul_(1 - lr * wd)``) rounds once, which no delta added back
    reproduces in every case.

    Example:
        >>> import torch
        >>> from funcamp.optim import NewParams
        >>> NewParams([torch.zeros(1)]).values
        [tensor([0.])]
    """

    values: list[torch.Tensor]


class SetParam(NamedTuple):
    """An update leaf that sets a param to ``value`` (already rounded, in the param's dtype).

    Produced by the low-precision modes, and by an update told that its caller installs new
    params (:class:`funcamp.optim.Writes`). :func:`funcamp.apply_updates` installs it.

    Example:
        >>> import torch, funcamp
        >>> from funcamp.optim import SetParam
        >>> p = {"w": torch.ones(2, dtype=torch.bfloat16)}
        >>> funcamp.apply_updates(p, {"w": SetParam(torch.zeros(2, dtype=torch.bfloat16))})
        {'w': tensor([0., 0.], dtype=torch.bfloat16)}
    """

    value: torch.Tensor


def is_set_param(x: Any) -> bool:
    return isinstance(x, SetParam)


def update_tensors(tree: PyTree) -> list[torch.Tensor]:
    """The tensors of an updates or state tree (a :class:`SetParam`'s value included: a
    NamedTuple, it flattens to its value). Runs on every eager step: no per-node ``is_leaf``
    callback, which doubles optree's cost."""
    return [x for x in optree.tree_leaves(tree, namespace=NAMESPACE) if isinstance(x, torch.Tensor)]


def exclusive(candidates: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> list[bool]:
    """For each candidate: whether its memory is shared with no other candidate, none of
    ``others``, and not between its own elements."""
    taken = {storage_key(x) for x in others}
    keys = [storage_key(x) for x in candidates]
    counts: dict[int | None, int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    return [
        k is not None and k not in taken and counts[k] == 1 and not self_overlapping(x)
        for k, x in zip(keys, candidates)
    ]


# --------------------------------------------------------------------------------------------
# apply_updates


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """Return the params after ``updates``, leaf by leaf.

    A tensor update is added in float32 (float64 for float64 params). The sum is rounded once,
    to nearest-even, into the param's dtype. The rounding works on the bit pattern, so eager and
    compiled agree.
    A :class:`funcamp.optim.SetParam` update (from a low-precision mode) replaces the param
    with its value.

    Args:
        params: a pytree of floating tensors.
        updates: a pytree of the same structure from an optimizer's ``update``.

    Returns:
        The new params, same structure and dtypes as ``params``.

    Example:
        >>> import torch, funcamp
        >>> funcamp.apply_updates({"w": torch.zeros(2)}, {"w": torch.ones(2)})
        {'w': tensor([1., 1.])}
    """
    return apply_updates_owned(params, updates)[0]


def apply_updates_owned(
    params: PyTree,
    updates: PyTree,
    owned: Callable[[torch.Tensor], bool] | None = None,
    skip_mask: Callable[[torch.Tensor], bool] | None = None,
) -> tuple[PyTree, set[int], set[int]]:
    """:func:`apply_updates` for a step that owns some of the update tensors (the eager path of
    :func:`funcamp.unscale_and_step`).

    ``owned(t)`` says the caller owns update tensor ``t`` exclusively. A plain delta of the
    param's dtype, device and layout then receives the new param in place (the same ``p + u``
    kernel, no fresh allocation). Before that, ``skip_mask(u)`` (when given) may rewrite the
    delta in place. It returns True if it did, and the skip-step select is then done.

    Returns the new params, the ids of the new leaves that are fresh tensors nobody else holds,
    and the ids of those that ``skip_mask`` already handled.
    """
    leaves, spec = flatten(params)
    try:
        ups = spec.flatten_up_to(updates)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "funcamp.apply_updates: `updates` must have the tree structure of `params` "
            f"{spec_text(spec)}, got {spec_text(flatten(updates)[1])}"
        ) from e
    out, fresh, done = [], set(), set()
    for i, p, u in zip(range(len(leaves)), leaves, ups):  # not enumerate: see _paths
        if (
            owned is not None
            and isinstance(p, torch.Tensor)
            and type(u) is torch.Tensor
            and not is_half(p)
            and u.dtype == p.dtype == torch.promote_types(p.dtype, torch.float32)
            and u.shape == p.shape
            and u.stride() == p.stride()
            and u.device == p.device
            and owned(u)
        ):
            if skip_mask is not None and skip_mask(u):
                done.add(id(u))
            v = torch.add(p, u, out=u)  # == (p.to(md) + u.to(md)).to(p.dtype) for these dtypes
        else:
            v = _apply_leaf(params, i, p, u)
        out.append(v)
        if isinstance(p, torch.Tensor) and (
            not isinstance(u, SetParam) or (owned is not None and owned(v))
        ):
            fresh.add(id(v))
    return unflatten(spec, out), fresh, done


def _check_update_target(params: PyTree, i: int, p: torch.Tensor, u: Any) -> None:
    """A param that receives an update must be floating (an integer param would truncate a
    float update silently), and a tensor update must be real and not bool."""
    if not p.is_floating_point():
        raise TypeError(
            f"funcamp.apply_updates: `params` leaf {leaf_path(params, i)} must be a floating tensor "
            f"to receive an update, got {describe(p)} (adding a float update would truncate "
            "it); keep integer state out of the params (in buffers) or give it a floating dtype"
        )
    if isinstance(u, torch.Tensor) and (u.dtype == torch.bool or u.is_complex()):
        raise TypeError(
            f"funcamp.apply_updates: `updates` leaf {leaf_path(params, i)} must be a real floating "
            f"tensor, got {describe(u)}"
        )


def _apply_leaf(params: PyTree, i: int, p: Any, u: Any) -> Any:
    """One leaf of :func:`apply_updates` (leaf ``i`` of ``params``)."""
    if not isinstance(p, torch.Tensor):
        return p
    _check_update_target(params, i, p, u)
    if isinstance(u, SetParam):
        v = u.value
        if not isinstance(v, torch.Tensor) or v.dtype != p.dtype or v.shape != p.shape:
            raise ValueError(
                f"funcamp.apply_updates: SetParam at {leaf_path(params, i)} must hold a tensor "
                f"like the param ({p.dtype}, {tuple(p.shape)}), got {describe(v)}"
            )
        return v
    if not isinstance(u, torch.Tensor) or u.shape != p.shape:
        raise ValueError(
            f"funcamp.apply_updates: `updates` leaf {leaf_path(params, i)} must be a tensor of "
            f"shape {tuple(p.shape)}, got {describe(u)}"
        )
    if is_half(p):
        return round_nearest(p.to(torch.float32) + u.to(torch.float32), p.dtype).to(p.dtype)
    md = torch.promote_types(p.dtype, torch.float32)
    return as_dtype(as_dtype(p, md) + as_dtype(u, md), p.dtype)


# --------------------------------------------------------------------------------------------
# chain


def check_optimizer(api: str, name: str, value: Any) -> Optimizer:
    if not isinstance(value, Optimizer):
        raise TypeError(f"funcamp.{api}: `{name}` must be an Optimizer, got {describe(value)}")
    if value.prepare is not None and not callable(value.prepare):
        raise TypeError(
            f"funcamp.{api}: `{name}.prepare` must be callable or None, got "
            f"{describe(value.prepare)} (Optimizer's third field is the prepare hook, "
            "prepare(grads, state, params) -> funcamp.optim.Prepared)"
        )
    return value


def chain(*transforms: Optimizer) -> Optimizer:
    """Compose transforms left to right: each one's updates are the next one's grads.

    The state is a tuple of the transforms' states. A low-precision mode optimizer (whose
    updates may hold :class:`funcamp.optim.SetParam` leaves) must come last.

    The chain keeps its parts' fast path. It prepares every part up front, so each check runs
    before anything is written. Its first part may overwrite grads its caller owns; each later
    part may overwrite the fresh outputs of the one before. Only its last part writes a donated
    state.

    A clip in front of :func:`funcamp.accumulate` is refused:
    ``chain(clip_by_global_norm(c), accumulate(opt, k))`` would clip each micro-batch. Torch's
    ``clip_grad_norm_`` clips the accumulated gradient after the last backward. Use
    ``accumulate(chain(clip_by_global_norm(c), opt), k)`` instead.

    Args:
        *transforms: :class:`Optimizer` values.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.chain(funcamp.clip_by_global_norm(1.0), funcamp.sgd(1.0))
        >>> params = {"w": torch.zeros(2)}
        >>> updates, _ = opt.update({"w": torch.tensor([3.0, 4.0])}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([-0.6000, -0.8000])}
    """
    for i, t in enumerate(transforms):
        check_optimizer("chain", f"transforms[{i}]", t)
    _check_clip_order(transforms)
    n = len(transforms)

    def check(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != n:
            raise TypeError(
                f"funcamp.chain: `state` must be a tuple of {n} states from init, got "
                f"{type(state).__name__}"
            )

    def init(params: PyTree) -> tuple[PyTree, ...]:
        return tuple(t.init(params) for t in transforms)

    def prepare(grads: PyTree, state: tuple[PyTree, ...], params: PyTree = None) -> Prepared:
        check(state)
        parts = [prepare_update(t, grads, s, params) for t, s in zip(transforms, state)]

        def run(grads: PyTree, writes: Writes) -> tuple[PyTree, tuple[PyTree, ...]]:
            owned, new_states = writes.owned, []
            for i, part in enumerate(parts):
                last = i == n - 1
                # only the last part writes a donated state: after it nothing can raise
                out, s = part.run(
                    grads,
                    Writes(
                        owned, writes.skip if last else None, new_params=last and writes.new_params
                    ),
                )
                new_states.append(s)
                if not last:
                    _refuse_set_param(out, i, n)
                    owned = (
                        _owned_outputs(part.fresh, grads, out, s, params, owned) if owned else ()
                    )
                grads = out
            return grads, tuple(new_states)

        flag = any_flag([p.unusable_lr for p in parts])
        return Prepared(flag, run, fresh=all(p.fresh for p in parts))

    def update(
        grads: PyTree, state: tuple[PyTree, ...], params: PyTree = None
    ) -> tuple[PyTree, tuple[PyTree, ...]]:
        check(state)
        new_states = []
        for i, (t, s) in enumerate(zip(transforms, state)):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
            if i < n - 1:
                _refuse_set_param(grads, i, n)
        return grads, tuple(new_states)

    def rate(state: tuple[PyTree, ...]) -> Any:
        check(state)
        found = None
        for t, s in zip(transforms, state):
            if t.learning_rate is not None:
                found = t.learning_rate(s)
        return found

    for kind in (CLIPS, ACCUMULATES):
        if any(t.update in kind for t in transforms):
            kind.add(update)
    has_rate = any(t.learning_rate is not None for t in transforms)
    return Optimizer(init, update, prepare, rate if has_rate else None)


def _refuse_set_param(out: PyTree, i: int, n: int) -> None:
    """A low-precision mode's updates (new params) can only come from a chain's last part."""
    leaves = optree.tree_leaves(out, is_leaf=is_set_param, namespace=NAMESPACE)
    if any(isinstance(x, SetParam) for x in leaves):
        raise ValueError(
            f"funcamp.chain: `transforms[{i}]` uses a low-precision mode and must be the last "
            f"transform, got it at position {i} of {n}"
        )


def _check_clip_order(transforms: Sequence[Optimizer]) -> None:
    """Refuse a clip in front of an accumulation (see :func:`chain`)."""
    for j, t in enumerate(transforms):
        if t.update not in ACCUMULATES:
            continue
        for i in range(j):
            if transforms[i].update in CLIPS:
                raise ValueError(
                    f"funcamp.chain: `transforms[{i}]` clips the gradient in front of "
                    f"`transforms[{j}]`, which accumulates micro-batches, so each micro-batch "
                    "would be clipped on its own; clip the accumulated gradient (what "
                    "clip_grad_norm_ after the last backward clips) with "
                    "accumulate(chain(clip_by_global_norm(max_norm), optimizer), every)"
                )


def _owned_outputs(
    fresh: bool,
    grads: PyTree,
    out: PyTree,
    state: PyTree,
    params: PyTree,
    owned: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """The outputs of a ``fresh`` transform that the next one may overwrite: new tensors
    (not its inputs, unless the caller owned them) whose memory nothing else holds."""
    if not fresh:
        return []
    outs = update_tensors(out)
    owned_ids = {id(x) for x in owned}
    inputs = [g for g in update_tensors(grads) if id(g) not in owned_ids]
    others = update_tensors(state) + update_tensors(params) + inputs
    return [x for x, ok in zip(outs, exclusive(outs, others)) if ok]
