"""Transforms and wrappers: gradient clipping, accumulation and parameter groups."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.checks import (
    any_flag,
    check_count,
    check_int,
    check_number,
    check_state_like,
    flatten_grads,
    flatten_params,
    state_leaves,
)
from funcamp._core.collectives import active_across
from funcamp._core.numerics import hoist_scalar, math_dtype
from funcamp._core.tree import NAMESPACE, describe, dotted_path, path_str, tree_select, unflatten
from funcamp.optim._base import (
    ACCUMULATES,
    CLIPS,
    Capabilities,
    Optimizer,
    SetParam,
    check_optimizer,
    is_set_param,
    learning_rate,
)
from funcamp.optim._paths import choose_ops

__all__ = [
    "AccumulateState",
    "AccumulationWindow",
    "MaskedState",
    "MultiTransformState",
    "accumulate",
    "accumulate_applies",
    "accumulation_window",
    "clip_by_global_norm",
    "close_window",
    "masked",
    "multi_transform",
    "reporting_accumulated",
]

PyTree = Any
Tensors = list[torch.Tensor]


class AccumulateState(NamedTuple):
    """State of :func:`funcamp.accumulate`: ``micro_step`` (0-d int32, micro-batches summed so
    far), ``applies`` (0-d bool, whether the next update applies), ``grad_sum`` (params-shaped
    float32 sums), ``inner`` (the wrapped optimizer's state) and ``overflowed`` (0-d bool, a
    micro-batch of this window had an inf or nan gradient: the window's update will be
    skipped; kept by :func:`funcamp.unscale_and_step`).

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


class MaskedState(NamedTuple):
    """State of :func:`funcamp.masked`: ``inner``, the wrapped optimizer's state for the masked
    leaves (a dict keyed by their dotted paths).

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.masked(funcamp.sgd(0.1, momentum=0.9), {"w": True, "b": False})
        >>> opt.init({"w": torch.zeros(1), "b": torch.zeros(1)}).inner.momentum
        {'w': tensor([0.])}
    """

    inner: PyTree


class MultiTransformState(NamedTuple):
    """State of :func:`funcamp.multi_transform`: ``inner``, a dict from each label to its
    optimizer's state (for its leaves, a dict keyed by their dotted paths).

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.multi_transform({"a": funcamp.sgd(0.1), "b": funcamp.adam(0.1)},
        ...                               {"w": "a", "v": "b"})
        >>> sorted(opt.init({"w": torch.zeros(1), "v": torch.zeros(1)}).inner)
        ['a', 'b']
    """

    inner: dict[str, PyTree]


# --------------------------------------------------------------------------------------------
# clip_by_global_norm


def clip_by_global_norm(max_norm: float) -> Optimizer:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_``: ``g * min(1, max_norm / (norm + 1e-6))``,
    the norm computed in float32. Half-precision grads come back in float32 (not rounded
    again); the state is ``()``.

    Args:
        max_norm: the largest global norm (> 0).

    Example:
        >>> import torch, funcamp
        >>> clip = funcamp.clip_by_global_norm(1.0)
        >>> g, _ = clip.update({"w": torch.tensor([3.0, 4.0])}, clip.init({}), None)
        >>> g
        {'w': tensor([0.6000, 0.8000])}
    """
    api = "clip_by_global_norm"
    max_norm = check_number(api, "max_norm", max_norm)
    if max_norm <= 0:
        raise ValueError(f"funcamp.{api}: `max_norm` must be > 0, got {max_norm!r}")

    def init(params: PyTree) -> tuple[()]:
        return ()

    def run(
        grads: PyTree, state: tuple[()], params: PyTree, owned: Sequence[torch.Tensor]
    ) -> tuple[PyTree, tuple[()]]:
        gs, _, spec = flatten_grads(api, grads, params, need_params=False)
        if not gs:
            return grads, state
        ops = choose_ops(gs, owned=owned)
        g = ops.to_math(gs)
        norms = [torch.linalg.vector_norm(x) for x in g]
        across = active_across()
        if across is None:
            total = torch.linalg.vector_norm(torch.stack([n.to(torch.float32) for n in norms]))
        else:  # a sharded step: these are local shards, the norm is global
            flag = torch.zeros((), dtype=torch.bool, device=norms[0].device)
            total = across.reduce(flag, [n.to(torch.float32).square() for n in norms])[1].sqrt()
        coef = hoist_scalar(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return unflatten(spec, ops.mul(g, coef, into=g)), state

    def update(grads: PyTree, state: tuple[()], params: PyTree = None) -> tuple[PyTree, Any]:
        return run(grads, state, params, ())

    CLIPS.add(update)
    return Optimizer(init, update, Capabilities(fresh=True, update_owned=run))


# --------------------------------------------------------------------------------------------
# accumulate


def accumulate(optimizer: Optimizer, every: int) -> Optimizer:
    """Gradient accumulation over ``every`` micro-steps.

    Each call adds the grads (in float32) to a running sum. On micro-steps 1 … ``every - 1``
    the updates are zero and the inner optimizer's state is untouched; on the ``every``-th the
    averaged grads ``sum / every`` go through ``optimizer`` and its updates are returned, and the
    sum resets. With equal micro-batches and a mean loss this is one step on the concatenated
    batch (torch's recipe divides each micro-batch's loss by ``every`` instead: the same
    average). The inner update is computed on every micro-step and selected with ``torch.where``
    (no host sync), so each micro-step costs one inner update.

    Under a loss scaler (:func:`funcamp.unscale_and_step`, the train step) the window is
    ``torch.amp.GradScaler``'s optimizer step: an inf or nan gradient in any micro-batch skips
    the whole update (the inner state, and the count schedules see, stay as they were; the
    window starts afresh), and the train step updates the scaler once per window, on the
    micro-step that applies (``growth_interval`` counts optimizer steps). Clip inside:
    ``accumulate(chain(clip_by_global_norm(c), opt), every)`` clips the accumulated gradient;
    :func:`funcamp.chain` refuses a clip in front of ``accumulate`` (it would clip each
    micro-batch).

    Use :func:`accumulate_applies` on the state *before* an update to learn whether that update
    applies (for example to all-reduce grads only then). Called directly, outside
    ``unscale_and_step``, it knows nothing of overflows: a caller that keeps the old state on a
    bad micro-batch (``tree_select``) drops that micro-batch, and the next one takes its place.

    Args:
        optimizer: the inner :class:`Optimizer`.
        every: number of micro-steps per update (>= 1).

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
    inner_caps = optimizer.capabilities

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
        if not isinstance(state, AccumulateState):
            raise TypeError(
                f"funcamp.{api}: `state` must be a AccumulateState from this optimizer's init, "
                f"got {type(state).__name__}"
            )
        gs, ps, spec = flatten_grads(api, grads, params, need_params=False)
        check_count(api, "micro_step", state.micro_step)
        check_count(api, "applies", state.applies, torch.bool)
        check_count(api, "overflowed", state.overflowed, torch.bool)
        if gs:
            sums = state_leaves(api, "grad_sum", state.grad_sum, spec)
            dtypes = [math_dtype(r.dtype) for r in (ps if ps is not None else gs)]
            check_state_like(api, "grad_sum", sums, gs, dtypes, grads)
        return gs, ps, spec

    def preflight(grads: PyTree, state: AccumulateState, params: PyTree = None) -> Any:
        checked(grads, state, params)
        if inner_caps.preflight is None:
            return None
        bad = inner_caps.preflight(grads, state.inner, params)
        return None if bad is None else bad & state.applies.to(bad.device)

    def run(
        grads: PyTree, state: AccumulateState, params: PyTree, owned: Sequence[torch.Tensor]
    ) -> tuple[PyTree, AccumulateState]:
        gs, ps, spec = checked(grads, state, params)
        return _accumulate(optimizer, every, grads, state, params, owned, gs, ps, spec)

    def update(grads: PyTree, state: AccumulateState, params: PyTree = None) -> Any:
        return run(grads, state, params, ())

    def rate(state: AccumulateState) -> Any:
        return learning_rate(optimizer, state.inner)

    ACCUMULATES.add(update)
    return Optimizer(
        init,
        update,
        Capabilities(
            preflight=preflight,
            fresh=inner_caps.fresh,
            update_owned=run,
            learning_rate=rate if inner_caps.learning_rate is not None else None,
        ),
    )


def _accumulate(
    optimizer: Optimizer,
    every: int,
    grads: PyTree,
    state: AccumulateState,
    params: PyTree,
    owned: Sequence[torch.Tensor],
    gs: Tensors,
    ps: Tensors | None,
    spec: Any,
) -> tuple[PyTree, AccumulateState]:
    """One micro-step of :func:`accumulate` (its inputs checked and flattened): add the grads
    to the sums and, on the step that applies, run ``optimizer`` on their average."""
    api = "accumulate"
    inner_caps = optimizer.capabilities
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
    avg = ops.div(sums, float(every)) if every > 1 else sums
    del sums
    if _REPORTS:  # before the inner optimizer, which may overwrite avg in place
        _REPORTS[-1](avg)
    avg_tree = unflatten(spec, avg)
    if owned and inner_caps.update_owned is not None:  # avg: this update's temporaries
        inner_updates, inner = inner_caps.update_owned(avg_tree, state.inner, params, avg)
    else:
        inner_updates, inner = optimizer.update(avg_tree, state.inner, params)
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
    """Return a 0-d bool tensor: True when the next ``update`` with ``opt_state`` applies an
    update (the last micro-step of :func:`accumulate`).

    ``opt_state`` may be an :class:`funcamp.optim.AccumulateState` or contain one (e.g. inside
    a :func:`chain`'s tuple); without one every step applies, and the result is True.

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


class reporting_accumulated:
    """While it is active (``with reporting_accumulated(report): ...``), an :func:`accumulate`
    update calls ``report(averaged_grads)`` (float32 leaves, not to be kept or written) before
    its inner optimizer runs: :func:`funcamp.unscale_and_step` takes the accumulated gradient's
    norm there."""

    def __init__(self, report: Callable[[Tensors], None] | None) -> None:
        self.report = report

    def __enter__(self) -> None:
        if self.report is not None:
            _REPORTS.append(self.report)

    def __exit__(self, *exc: Any) -> None:
        if self.report is not None:
            _REPORTS.pop()


def _accumulate_states(opt_state: PyTree) -> list[AccumulateState]:
    return [
        x
        for x in optree.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, AccumulateState), namespace=NAMESPACE
        )
        if isinstance(x, AccumulateState)
    ]


class AccumulationWindow(NamedTuple):
    """The window of the :func:`accumulate` states in an optimizer state, read before an
    update: ``applies`` (the update closes the window), ``overflowed`` (a micro-batch of the
    window so far had an inf or nan gradient), and each state's own ``applies``."""

    applies: torch.Tensor
    overflowed: torch.Tensor
    each: tuple[torch.Tensor, ...]


def accumulation_window(optimizer: Optimizer, opt_state: PyTree) -> AccumulationWindow | None:
    """The :class:`AccumulationWindow` of ``opt_state``, or None when ``optimizer`` is not, and
    does not hold, an :func:`accumulate` (each flag copied: a donated state is overwritten by
    the step). Whether it does is known when it is built (:func:`funcamp.chain`,
    :func:`masked` and :func:`multi_transform` pass it on), so an optimizer without one pays
    no search of its state."""
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
    """The optimizer state after a micro-step under a loss scaler: each :class:`AccumulateState`
    records whether its window overflowed (``window_inf``, until the window closes) and, where the
    window's update was ``skipped`` (the step kept the old state: its sums, its last micro-step),
    starts a new window. ``in_place``: written into the state's tensors (a donated state)."""
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


# --------------------------------------------------------------------------------------------
# parameter groups: masked and multi_transform


def _leaf_labels(api: str, arg: str, labels: Any, params: PyTree, kinds: tuple[type, ...]) -> list:
    """One label per param leaf: ``labels`` is a pytree with the params' structure, or a
    callable of the dotted leaf path (``"encoder.weight"``)."""
    paths, _, spec = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
    if callable(labels):
        out = [labels(dotted_path(p)) for p in paths]
    else:
        try:
            out = spec.flatten_up_to(labels)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"funcamp.{api}: `{arg}` must have the tree structure of the params {spec} (or "
                f"be a callable of the leaf path), got "
                f"{optree.tree_structure(labels, namespace=NAMESPACE)}"
            ) from e
    for path, label in zip(paths, out):
        if not isinstance(label, kinds):
            want = " or ".join(k.__name__ for k in kinds)
            raise TypeError(
                f"funcamp.{api}: `{arg}` must give a {want} for each param leaf, got "
                f"{describe(label)} at {path_str(path)}"
            )
    return out


def _group(tree: PyTree, keys: list[str], chosen: list[bool]) -> dict[str, Any] | None:
    """The chosen leaves of ``tree`` as a dict keyed by their dotted paths (None for None)."""
    if tree is None:
        return None
    leaves = optree.tree_leaves(tree, namespace=NAMESPACE)
    return {k: x for k, x, c in zip(keys, leaves, chosen) if c}


def _param_groups(
    api: str,
    transforms: Mapping[str, Optimizer],
    assign: Callable[[PyTree], list[str | None]],
    wrap: Callable[[dict[str, PyTree]], Any],
    unwrap: Callable[[Any], dict[str, PyTree]],
    single: str | None = None,
) -> Optimizer:
    """Param groups: ``assign`` gives each leaf its group's label (None: frozen). ``single``: the
    one group whose learning rate is the optimizer's (``masked``), else a dict by label."""

    def keys_and_groups(tree: PyTree) -> tuple[Any, list[str], list[str | None]]:
        paths, _, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
        return spec, [dotted_path(p) for p in paths], assign(tree)

    def init(params: PyTree) -> Any:
        flatten_params(api, params)
        _, keys, owner = keys_and_groups(params)
        return wrap(
            {
                name: opt.init(_group(params, keys, [o == name for o in owner]))
                for name, opt in transforms.items()
            }
        )

    def parts(grads: PyTree, state: Any, params: PyTree) -> Any:
        """``(grad leaves, treespec, dotted keys, each leaf's group, inner states)``."""
        gs, _, spec = flatten_grads(api, grads, params, need_params=False)
        _, keys, owner = keys_and_groups(params if params is not None else grads)
        return gs, spec, keys, owner, unwrap(state)

    def run(
        grads: PyTree, state: Any, params: PyTree, owned: Sequence[torch.Tensor]
    ) -> tuple[PyTree, Any]:
        gs, spec, keys, owner, inner = parts(grads, state, params)
        out: list[Any] = [None] * len(gs)
        new_inner = {}
        for name, opt in transforms.items():
            chosen = [o == name for o in owner]
            sub_g, sub_p = _group(grads, keys, chosen), _group(params, keys, chosen)
            caps = opt.capabilities
            if owned and caps.update_owned is not None:
                ups, new_inner[name] = caps.update_owned(sub_g, inner[name], sub_p, owned)
            else:
                ups, new_inner[name] = opt.update(sub_g, inner[name], sub_p)
            flat = _group_updates(api, name, ups, [k for k, c in zip(keys, chosen) if c])
            for i, c in enumerate(chosen):
                if c:
                    out[i] = flat[keys[i]]
        for i, g in enumerate(gs):
            if owner[i] is None:
                out[i] = torch.zeros_like(g, dtype=math_dtype(g.dtype))
        return unflatten(spec, out), wrap(new_inner)

    def update(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        return run(grads, state, params, ())

    def preflight(grads: PyTree, state: Any, params: PyTree = None) -> Any:
        _, _, keys, owner, inner = parts(grads, state, params)
        flags = []
        for name, opt in transforms.items():
            if opt.capabilities.preflight is not None:
                chosen = [o == name for o in owner]
                sub_g, sub_p = _group(grads, keys, chosen), _group(params, keys, chosen)
                flags.append(opt.capabilities.preflight(sub_g, inner[name], sub_p))
        return any_flag(flags)

    def rate(state: Any) -> Any:
        inner = unwrap(state)
        rates = {name: learning_rate(opt, inner[name]) for name, opt in transforms.items()}
        rates = {name: r for name, r in rates.items() if r is not None}
        return rates.get(single) if single is not None else rates or None

    fresh = all(t.capabilities.fresh for t in transforms.values())
    has_rate = any(t.capabilities.learning_rate is not None for t in transforms.values())
    if any(t.update in ACCUMULATES for t in transforms.values()):
        ACCUMULATES.add(update)
    return Optimizer(
        init,
        update,
        Capabilities(
            preflight=preflight,
            fresh=fresh,
            update_owned=run if fresh else None,
            learning_rate=rate if has_rate else None,
        ),
    )


def _group_updates(api: str, name: str, updates: Any, keys: list[str]) -> dict[str, Any]:
    if not isinstance(updates, dict) or sorted(updates) != sorted(keys):
        raise ValueError(
            f"funcamp.{api}: the optimizer of group {name!r} must return updates for exactly "
            f"its leaves {keys}, got {describe(updates)}"
        )
    return updates


def masked(optimizer: Optimizer, mask: PyTree | Callable[[str], bool]) -> Optimizer:
    """Apply ``optimizer`` where ``mask`` is True; masked-off leaves are frozen (zero updates).

    The masked-off leaves get zero updates and no optimizer state: they stay where they are.
    This differs from optax's ``masked``, which passes their gradients through unchanged (for a
    transform later in a chain to act on). To get optax's behaviour, give the masked-off leaves
    the identity, ``funcamp.chain()``, with :func:`multi_transform`::

        funcamp.multi_transform(
            {"on": optimizer, "off": funcamp.chain()},
            lambda path: "on" if mask_fn(path) else "off",
        )

    (their updates are then their gradients, bit for bit). For weight decay on some leaves
    only, ``funcamp.adamw(..., mask=)`` and ``funcamp.lion(..., mask=)`` take optax's mask.

    The masked leaves reach ``optimizer`` as a dict keyed by their dotted paths
    (``"encoder.weight"``), so its state (and a checkpoint of it) names them. Combine several
    with :func:`funcamp.chain`, or use :func:`multi_transform` for param groups with their own
    settings.

    Args:
        optimizer: the :class:`Optimizer` for the masked leaves (any low-precision mode).
        mask: a pytree of Python bools with the params' structure, or a callable of the dotted
            leaf path returning a bool.

    Returns:
        An :class:`Optimizer` whose state is a :class:`funcamp.optim.MaskedState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.masked(funcamp.sgd(1.0), lambda path: not path.endswith("bias"))
        >>> params = {"weight": torch.ones(2), "bias": torch.ones(2)}
        >>> grads = {"weight": torch.ones(2), "bias": torch.ones(2)}
        >>> updates, _ = opt.update(grads, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'weight': tensor([0., 0.]), 'bias': tensor([1., 1.])}
    """
    api = "masked"
    check_optimizer(api, "optimizer", optimizer)
    if not callable(mask):
        optree.tree_structure(mask, namespace=NAMESPACE)  # a pytree

    def assign(tree: PyTree) -> list[str | None]:
        flags = _leaf_labels(api, "mask", mask, tree, (bool,))
        return ["masked" if f else None for f in flags]

    return _param_groups(
        api,
        {"masked": optimizer},
        assign,
        lambda d: MaskedState(d["masked"]),
        _unwrap_masked,
        single="masked",
    )


def _unwrap_masked(state: Any) -> dict[str, PyTree]:
    if not isinstance(state, MaskedState):
        raise TypeError(
            f"funcamp.masked: `state` must be a MaskedState from this optimizer's init, got "
            f"{type(state).__name__}"
        )
    return {"masked": state.inner}


def multi_transform(
    transforms: Mapping[str, Optimizer], labels: PyTree | Callable[[str], str]
) -> Optimizer:
    """Parameter groups: each param leaf gets the optimizer of its label (optax's
    ``multi_transform``, torch.optim's ``param_groups``).

    Each optimizer sees its leaves as a dict keyed by their dotted paths and keeps its own
    state (its own step count, moments and low-precision mode), so
    ``multi_transform({"decay": adamw(lr, weight_decay=0.1), "no_decay": adamw(lr,
    weight_decay=0.0)}, labels)`` is ``torch.optim.AdamW`` with two param groups.

    Args:
        transforms: a dict from label to :class:`Optimizer`.
        labels: a pytree of labels (strings) with the params' structure, or a callable of the
            dotted leaf path (``"encoder.bias"``) returning the label. Every label must be a key
            of ``transforms``.

    Returns:
        An :class:`Optimizer` whose state is a :class:`funcamp.optim.MultiTransformState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.multi_transform(
        ...     {"decay": funcamp.adamw(0.1, weight_decay=0.5), "no_decay": funcamp.adam(0.1)},
        ...     lambda path: "no_decay" if path.endswith("bias") else "decay",
        ... )
        >>> params = {"weight": torch.ones(1), "bias": torch.ones(1)}
        >>> grads = {"weight": torch.zeros(1), "bias": torch.zeros(1)}
        >>> updates, _ = opt.update(grads, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'weight': tensor([0.9500]), 'bias': tensor([1.])}
    """
    api = "multi_transform"
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"funcamp.{api}: `transforms` must be a non-empty dict from label to Optimizer, "
            f"got {describe(transforms)}"
        )
    for name, opt in transforms.items():
        if not isinstance(name, str):
            raise TypeError(f"funcamp.{api}: `transforms` keys must be str labels, got {name!r}")
        check_optimizer(api, f"transforms[{name!r}]", opt)
    transforms = dict(transforms)

    def assign(tree: PyTree) -> list[str | None]:
        out = _leaf_labels(api, "labels", labels, tree, (str,))
        unknown = sorted({x for x in out if x not in transforms})
        if unknown:
            raise ValueError(
                f"funcamp.{api}: `labels` must be keys of `transforms` {sorted(transforms)}, "
                f"got {unknown}"
            )
        return out

    def unwrap(state: Any) -> dict[str, PyTree]:
        if (
            not isinstance(state, MultiTransformState)
            or not isinstance(state.inner, dict)
            or (sorted(state.inner) != sorted(transforms))
        ):
            raise TypeError(
                f"funcamp.{api}: `state` must be a MultiTransformState with the labels "
                f"{sorted(transforms)} from this optimizer's init, got {describe(state)}"
            )
        return state.inner

    return _param_groups(api, transforms, assign, MultiTransformState, unwrap)
