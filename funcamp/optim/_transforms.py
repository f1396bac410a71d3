"""Transforms and wrappers: gradient clipping and parameter groups.

Accumulation lives in :mod:`funcamp.optim._accumulate` and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.checks import (
    any_flag,
    check_number,
    check_state_type,
    flatten_grads,
    flatten_params,
)
from funcamp._core.collectives import global_norm
from funcamp._core.numerics import hoist_scalar, math_dtype
from funcamp._core.tree import NAMESPACE, PyTree, describe, dotted_path, unflatten
from funcamp.optim._accumulate import AccumulateState, accumulate, accumulate_applies
from funcamp.optim._base import (
    ACCUMULATES,
    CLIPS,
    Optimizer,
    Prepared,
    Writes,
    check_optimizer,
    learning_rate,
    prepare_update,
)
from funcamp.optim._masks import check_selects, leaf_values
from funcamp.optim._paths import Ops
from funcamp.optim._shared import _stateless

__all__ = [
    "AccumulateState",
    "MaskedState",
    "MultiTransformState",
    "accumulate",
    "accumulate_applies",
    "clip_by_global_norm",
    "masked",
    "multi_transform",
]
Tensors = list[torch.Tensor]


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

    def clip(ops: Ops, gs: Tensors, grads: PyTree, params: PyTree) -> Tensors:
        g = ops.to_math(gs)
        norms = [torch.linalg.vector_norm(x) for x in g]
        total = global_norm(norms, grads if params is None else params)
        coef = hoist_scalar(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return ops.mul(g, coef, into=g)

    opt = _stateless(api, clip)
    CLIPS.add(opt.update)
    return opt


# --------------------------------------------------------------------------------------------
# parameter groups: masked and multi_transform


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
    check: Callable[[PyTree, list[str | None]], None] | None = None,
) -> Optimizer:
    """Param groups: ``assign`` gives each leaf its group's label (None: frozen). ``single``: the
    one group whose learning rate is the optimizer's (``masked``), else a dict by label.
    ``check(params, labels)`` runs at ``init`` (a mask that selects nothing is refused there)."""

    def keys_and_groups(tree: PyTree) -> tuple[Any, list[str], list[str | None]]:
        paths, _, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
        return spec, [dotted_path(p) for p in paths], assign(tree)

    def init(params: PyTree) -> Any:
        flatten_params(api, params)
        _, keys, owner = keys_and_groups(params)
        if check is not None:
            check(params, owner)
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
        grads: PyTree,
        state: Any,
        params: PyTree,
        prepared: dict[str, Prepared] | None,
        owned: Sequence[torch.Tensor],
        new: bool = False,
    ) -> tuple[PyTree, Any]:
        gs, spec, keys, owner, inner = parts(grads, state, params)
        out: list[Any] = [None] * len(gs)
        new_inner = {}
        for name, opt in transforms.items():
            chosen = [o == name for o in owner]
            sub_g, sub_p = _group(grads, keys, chosen), _group(params, keys, chosen)
            if prepared is None:
                ups, new_inner[name] = opt.update(sub_g, inner[name], sub_p)
            else:
                ups, new_inner[name] = prepared[name].run(sub_g, Writes(owned, new_params=new))
            flat = _group_updates(api, name, ups, [k for k, c in zip(keys, chosen) if c])
            for i, c in enumerate(chosen):
                if c:
                    out[i] = flat[keys[i]]
        for i, g in enumerate(gs):
            if owner[i] is None:
                out[i] = torch.zeros_like(g, dtype=math_dtype(g.dtype))
        return unflatten(spec, out), wrap(new_inner)

    def update(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        return run(grads, state, params, None, ())

    def prepare(grads: PyTree, state: Any, params: PyTree = None) -> Prepared:
        _, _, keys, owner, inner = parts(grads, state, params)
        prepared = {}
        for name, opt in transforms.items():
            chosen = [o == name for o in owner]
            sub_g, sub_p = _group(grads, keys, chosen), _group(params, keys, chosen)
            prepared[name] = prepare_update(opt, sub_g, inner[name], sub_p)

        def go(grads: PyTree, writes: Writes) -> tuple[PyTree, Any]:
            return run(grads, state, params, prepared, writes.owned, writes.new_params)

        flag = any_flag([p.unusable_lr for p in prepared.values()])
        return Prepared(flag, go, all(p.fresh for p in prepared.values()))

    def rate(state: Any) -> Any:
        inner = unwrap(state)
        rates = {name: learning_rate(opt, inner[name]) for name, opt in transforms.items()}
        rates = {name: r for name, r in rates.items() if r is not None}
        return rates.get(single) if single is not None else rates or None

    has_rate = any(t.learning_rate is not None for t in transforms.values())
    if any(t.update in ACCUMULATES for t in transforms.values()):
        ACCUMULATES.add(update)
    return Optimizer(init, update, prepare, rate if has_rate else None)


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

    Their updates are then their gradients, bit for bit. For weight decay on some leaves only,
    ``funcamp.adamw(..., mask=)`` and ``funcamp.lion(..., mask=)`` take optax's mask.

    The masked leaves reach ``optimizer`` as a dict keyed by their dotted paths
    (``"encoder.weight"``), so its state (and a checkpoint of it) names them. Combine several
    with :func:`funcamp.chain`, or use :func:`multi_transform` for param groups with their own
    settings.

    Args:
        optimizer: the :class:`Optimizer` for the masked leaves (any low-precision mode).
        mask: a pytree of Python bools with the params' structure (or a prefix of it). Or a
            callable of the dotted leaf path returning a bool, or of the params returning such
            a pytree. It must select at least one leaf (checked by ``init``).

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
        flags = leaf_values(api, "mask", mask, tree, (bool,))
        return ["masked" if f else None for f in flags]

    return _param_groups(
        api,
        {"masked": optimizer},
        assign,
        lambda d: MaskedState(d["masked"]),
        _unwrap_masked,
        single="masked",
        check=lambda params, owner: check_selects(
            api, "mask", mask, params, [o is not None for o in owner], "freeze the params"
        ),
    )


def _unwrap_masked(state: Any) -> dict[str, PyTree]:
    return {"masked": check_state_type("masked", state, MaskedState).inner}


def multi_transform(
    transforms: Mapping[str, Optimizer], labels: PyTree | Callable[[str], str]
) -> Optimizer:
    """Parameter groups: each param leaf gets the optimizer of its label.

    This is optax's ``multi_transform`` and torch.optim's ``param_groups``. Each optimizer sees
    its leaves as a dict keyed by their dotted paths. It keeps its own state: its own step
    count, moments and low-precision mode. So ``multi_transform({"decay": adamw(lr,
    weight_decay=0.1), "no_decay": adamw(lr, weight_decay=0.0)}, labels)`` is
    ``torch.optim.AdamW`` with two param groups.

    Args:
        transforms: a dict from label to :class:`Optimizer`.
        labels: a pytree of labels with the params' structure (or a prefix), a callable of
            the dotted leaf path (``"encoder.bias"``), or of the params. Each label is a key of
            ``transforms``, and each transform gets at least one leaf.

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
        out = leaf_values(api, "labels", labels, tree, (str,))
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

    def check(params: PyTree, owner: list[str | None]) -> None:
        for name in transforms:
            chosen = [o == name for o in owner]
            check_selects(api, "labels", labels, params, chosen, f"drop {name!r}: no leaf gets it")

    return _param_groups(api, transforms, assign, MultiTransformState, unwrap, check=check)
