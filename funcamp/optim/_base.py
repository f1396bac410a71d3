"""The optimizer value, its declared capabilities, the update leaves and :func:`chain`."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.checks import any_flag
from funcamp._core.numerics import as_dtype, is_half
from funcamp._core.rounding import round_nearest
from funcamp._core.tree import (
    NAMESPACE,
    describe,
    flatten,
    leaf_path,
    self_overlapping,
    spec_text,
    storage_key,
    unflatten,
)

__all__ = [
    "Capabilities",
    "Optimizer",
    "SetParam",
    "apply_updates",
    "apply_updates_owned",
    "chain",
    "exclusive",
    "learning_rate",
    "update_tensors",
]

PyTree = Any
#: ``preflight(grads, state, params) -> Tensor | None``.
Preflight = Callable[[PyTree, PyTree, PyTree], "torch.Tensor | None"]
#: ``update_owned(grads, state, params, owned) -> (updates, state)``.
UpdateOwned = Callable[[PyTree, PyTree, PyTree, Sequence[torch.Tensor]], tuple[PyTree, PyTree]]
#: ``update_donated(grads, state, params, owned, found_inf) -> (updates, state)``.
UpdateDonated = Callable[
    [PyTree, PyTree, PyTree, Sequence[torch.Tensor], torch.Tensor], tuple[PyTree, PyTree]
]
#: ``fused_step(grad_leaves, state, params, found_inf) -> new_state | None``.
FusedStep = Callable[[list[torch.Tensor], PyTree, PyTree, torch.Tensor], Any]
#: ``learning_rate(state) -> Tensor | dict[str, Tensor] | None``.
LearningRate = Callable[[PyTree], Any]


#: The ``update`` functions of :func:`funcamp.clip_by_global_norm` (and of chains holding one)
#: and of :func:`funcamp.accumulate` (and of chains holding one): :func:`chain` refuses a clip
#: in front of an accumulation, which would clip each micro-batch.
CLIPS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
ACCUMULATES: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an :class:`Optimizer` declares about itself so that :func:`funcamp.unscale_and_step`
    can take its fast paths. All optional: a plain ``Optimizer(init, update)`` declares nothing
    and runs on the pure path, with the same results. :func:`funcamp.chain`,
    :func:`funcamp.accumulate`, :func:`funcamp.masked` and :func:`funcamp.multi_transform` derive
    their own capabilities from their parts.

    Attributes:
        preflight: ``(grads, state, params) -> Tensor | None``: checks ``state`` against the
            grads and params (metadata only) and evaluates the learning rate, raising before
            anything is computed or written; returns a 0-d bool tensor, True when this step's
            learning rate is unusable (NaN, infinite, negative), or None.
        fresh: ``update`` returns only tensors it made itself or leaves of its inputs (never a
            tensor held elsewhere: a closure constant, a cache), so the calling step may reuse
            the new tensors in place.
        update_owned: ``(grads, state, params, owned) -> (updates, state)``: ``update``, allowed
            to overwrite the grad tensors in ``owned`` (temporaries of the caller that nobody
            else sees). Called in plain eager only.
        fused_step: ``(grad_leaves, state, params, found_inf) -> new_state | None``: apply the
            update to ``params`` (and the state's buffers) in place, or nothing where
            ``found_inf``, with ``update``'s results (torch's fused kernels); None when it does
            not apply to these inputs. Called with ``donate_state=True`` on plain tensors only,
            in eager code or compiled (where it must trace as ops inductor can call: torch's
            fused kernels are wrapped as funcamp custom ops for that).
        learning_rate: ``state -> lr``: the learning rate the next ``update`` from ``state``
            applies (a 0-d tensor; a dict by label for :func:`funcamp.multi_transform`), or
            None. Read by :func:`funcamp.optim.learning_rate` and the train step's
            ``metrics["lr"]``.
        update_donated: ``(grads, state, params, owned, found_inf) -> (updates, state)``:
            ``update_owned`` on a donated state: each new state buffer is written into the
            buffer of ``state`` it replaces as soon as it is known --
            ``where(found_inf, old, new)``, bit for bit the old values on a skipped step --
            after everything that can raise, and returned in the new state; the updates are
            applied by the caller only where not ``found_inf``. This is how torch.optim's
            in-place memory is reached without a host sync. Called in plain eager with
            ``donate_state=True`` only.

    Example:
        >>> import funcamp
        >>> caps = funcamp.sgd(0.1).capabilities
        >>> caps.fresh, caps.fused_step is not None
        (True, True)
        >>> funcamp.adam(0.1).capabilities.update_donated is not None
        True
        >>> funcamp.chain(funcamp.clip_by_global_norm(1.0), funcamp.sgd(0.1)).capabilities.fresh
        True
    """

    preflight: Preflight | None = None
    fresh: bool = False
    update_owned: UpdateOwned | None = None
    fused_step: FusedStep | None = None
    learning_rate: LearningRate | None = None
    update_donated: UpdateDonated | None = None  # last: positional construction keeps working


def learning_rate(optimizer: Optimizer, opt_state: PyTree) -> Any:
    """The learning rate the next ``optimizer.update`` from ``opt_state`` applies.

    A schedule's value at the state's step count (the count of updates applied so far, which
    skipped steps do not advance), as a 0-d tensor: no host sync, so it can be logged from a
    compiled step (:func:`funcamp.make_train_step` reports it as ``metrics["lr"]``). Through
    :func:`funcamp.chain` (the last part that has one), :func:`funcamp.accumulate` and
    :func:`funcamp.masked` it is the inner optimizer's; :func:`funcamp.multi_transform` gives a
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
    rate = optimizer.capabilities.learning_rate
    return None if rate is None else rate(opt_state)


class Optimizer(NamedTuple):
    """A pair of pure functions: ``init(params) -> state`` and
    ``update(grads, state, params) -> (updates, state)``, plus the :class:`Capabilities` it
    declares (none by default).

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
    capabilities: Capabilities = Capabilities()


class SetParam(NamedTuple):
    """An update leaf that sets a low-precision param to ``value`` (already rounded, in the
    param's dtype). Produced by the low-precision modes; :func:`funcamp.apply_updates` installs it.

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

    A tensor update is added in float32 (float64 for float64 params) and rounded once, to
    nearest-even, into the param's dtype — on the bit pattern, so eager and compiled agree.
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

    ``owned(t)``: the caller owns update tensor ``t`` exclusively; a plain delta of the param's
    dtype, device and layout then receives the new param in place (the same ``p + u`` kernel,
    no fresh allocation), after ``skip_mask(u)`` -- when given -- has had the chance to rewrite
    the delta in place (it returns True if it did: the skip-step select is then done).

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
    return value


def chain(*transforms: Optimizer) -> Optimizer:
    """Compose transforms left to right: each one's updates are the next one's grads.

    The state is a tuple of the transforms' states. A low-precision mode optimizer (whose
    updates may hold :class:`funcamp.optim.SetParam` leaves) must come last. The chain keeps
    its parts' fast paths (:class:`funcamp.optim.Capabilities`): it checks every state up front,
    it is ``fresh`` when every part is, and its first part may overwrite grads its caller owns,
    each later part the fresh outputs of the one before.

    A clip in front of :func:`funcamp.accumulate` (``chain(clip_by_global_norm(c),
    accumulate(opt, k))``) would clip each micro-batch, not the accumulated gradient that
    ``clip_grad_norm_`` clips after the last backward: it is refused, and
    ``accumulate(chain(clip_by_global_norm(c), opt), k)`` is the composition to use.

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

    def run(
        grads: PyTree,
        state: tuple[PyTree, ...],
        params: PyTree,
        owned: Sequence[torch.Tensor],
        found_inf: torch.Tensor | None = None,
    ) -> tuple[PyTree, tuple[PyTree, ...]]:
        check(state)
        new_states = []
        for i, (t, s) in enumerate(zip(transforms, state)):
            caps = t.capabilities
            # only the last part writes its donated state early: after it nothing can raise
            if found_inf is not None and i == n - 1 and caps.update_donated is not None:
                out, s = caps.update_donated(grads, s, params, owned, found_inf)
            elif owned and caps.update_owned is not None:
                out, s = caps.update_owned(grads, s, params, owned)
            else:
                out, s = t.update(grads, s, params)
            new_states.append(s)
            if i < n - 1:
                leaves = optree.tree_leaves(out, is_leaf=is_set_param, namespace=NAMESPACE)
                if any(isinstance(x, SetParam) for x in leaves):
                    raise ValueError(
                        f"funcamp.chain: `transforms[{i}]` uses a low-precision mode and must "
                        f"be the last transform, got it at position {i} of {n}"
                    )
                owned = _owned_outputs(caps.fresh, grads, out, s, params, owned) if owned else ()
            grads = out
        return grads, tuple(new_states)

    def update(
        grads: PyTree, state: tuple[PyTree, ...], params: PyTree = None
    ) -> tuple[PyTree, tuple[PyTree, ...]]:
        return run(grads, state, params, ())

    def preflight(grads: PyTree, state: tuple[PyTree, ...], params: PyTree = None) -> Any:
        check(state)
        flags = []
        for t, s in zip(transforms, state):
            if t.capabilities.preflight is not None:
                flags.append(t.capabilities.preflight(grads, s, params))
        return any_flag(flags)

    def rate(state: tuple[PyTree, ...]) -> Any:
        check(state)
        found = None
        for t, s in zip(transforms, state):
            if t.capabilities.learning_rate is not None:
                found = t.capabilities.learning_rate(s)
        return found

    caps = [t.capabilities for t in transforms]
    fresh = all(c.fresh for c in caps)
    for kind in (CLIPS, ACCUMULATES):
        if any(t.update in kind for t in transforms):
            kind.add(update)
    return Optimizer(
        init,
        update,
        Capabilities(
            preflight=preflight,
            fresh=fresh,
            update_owned=run if fresh else None,
            update_donated=run if fresh and caps and caps[-1].update_donated else None,
            learning_rate=rate if any(c.learning_rate is not None for c in caps) else None,
        ),
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
