"""Frozen parameters (``TrainState.frozen``): passed to the model, never differentiated or updated.

torch.optim trains what it is given and skips a parameter whose ``grad`` is ``None``. So a
parameter with ``requires_grad=False`` never moves and holds no optimizer state (a frozen
embedding, the base weights of a ``peft`` LoRA model). funcamp keeps that distinction in the
state, as equinox's ``partition``/``combine`` does. :meth:`funcamp.TrainState.create` splits the
params in two:

* ``state.params``: differentiated, updated, with optimizer state;
* ``state.frozen``: passed to ``loss_fn`` merged with the params. Never differentiated, never
  written; no optimizer state, no weight decay, no all-reduce.

Which params are frozen (``trainable=`` of :meth:`~funcamp.TrainState.create`):

* ``None`` (default): what the module says. :func:`funcamp.params_and_buffers` hands a parameter
  with ``requires_grad=False`` over as a (detached) ``torch.nn.Parameter`` with
  ``requires_grad=False``, and such a leaf is frozen. Every other leaf is trained (a plain
  tensor, as a hand-written params dict holds).
* ``True``: every leaf is trained, whatever the module says.
* a glob pattern (``"*.lora_*"``) or a sequence of them: the leaves whose dotted path
  (``"layer.0.weight"``) matches one are trained, the others frozen. A pattern that matches
  nothing is an error.
* a callable ``path -> bool`` of the dotted path: True for the leaves to train.

Frozen leaves must sit in dicts (as ``params_and_buffers`` gives them, or nested dicts), so that
the two parts can be merged back by key.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from funcamp._core.tree import NAMESPACE, PyTree, describe, dotted_path

__all__ = ["combine", "is_frozen_parameter", "split_trainable", "trainable_flags"]
Trainable = None | bool | str | Sequence[str] | Callable[[str], bool]


def is_frozen_parameter(x: Any) -> bool:
    """A leaf the module froze: a ``torch.nn.Parameter`` with ``requires_grad=False``."""
    return isinstance(x, torch.nn.Parameter) and not x.requires_grad


def trainable_flags(api: str, params: PyTree, trainable: Trainable) -> list[bool]:
    """One bool per leaf of ``params``: True where the leaf is trained (see the module)."""
    paths, leaves, _ = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
    if trainable is None:
        return [not is_frozen_parameter(x) for x in leaves]
    if trainable is True:
        return [True] * len(leaves)
    dotted = [dotted_path(p) for p in paths]
    if isinstance(trainable, str) or (
        isinstance(trainable, Sequence) and all(isinstance(t, str) for t in trainable)
    ):
        patterns = [trainable] if isinstance(trainable, str) else list(trainable)
        if not patterns:
            raise ValueError(
                f"funcamp.{api}: `trainable` must name at least one pattern, got an empty "
                "sequence (every parameter would be frozen)"
            )
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(p, pattern) for p in dotted):
                raise ValueError(
                    f"funcamp.{api}: `trainable` pattern {pattern!r} matches no parameter; the "
                    f"params' paths are {_some(dotted)}"
                )
        return [any(fnmatch.fnmatchcase(p, pat) for pat in patterns) for p in dotted]
    if callable(trainable) and not isinstance(trainable, bool):
        flags = []
        for p in dotted:
            flag = trainable(p)
            if not isinstance(flag, bool):
                raise TypeError(
                    f"funcamp.{api}: `trainable` must return a bool for each parameter path, "
                    f"got {describe(flag)} for {p!r}"
                )
            flags.append(flag)
        return flags
    raise TypeError(
        f"funcamp.{api}: `trainable` must be None (what the module says: parameters with "
        "requires_grad=False are frozen), True (train everything), a glob pattern or a "
        f"sequence of them, or a callable of the parameter path, got {describe(trainable)}"
    )


def _some(paths: list[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:6])
    return f"[{shown}{', ...' if len(paths) > 6 else ''}] ({len(paths)} in all)"


def split_trainable(api: str, params: PyTree, flags: list[bool]) -> tuple[PyTree, PyTree]:
    """``(trainable, frozen)``: ``params`` cut by ``flags`` (one per leaf).

    With nothing frozen, it is ``(params, {})``. Otherwise the frozen leaves must sit in dicts.
    Both parts are then dicts holding only their own leaves (empty sub-dicts dropped).
    """
    if all(flags):
        return params, {}
    paths, leaves, _ = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
    train: dict[Any, Any] = {}
    frozen: dict[Any, Any] = {}
    for path, leaf, flag in zip(paths, leaves, flags):
        _check_dict_path(api, params, path)
        node = train if flag else frozen
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return _with_order(params, train), _with_order(params, frozen)


def _check_dict_path(api: str, params: PyTree, path: tuple[Any, ...]) -> None:
    node = params
    for key in path:
        if not isinstance(node, dict):
            raise TypeError(
                f"funcamp.{api}: frozen parameters must sit in dicts (as params_and_buffers "
                f"gives them) so that they can be kept apart by name, but the leaf "
                f"{dotted_path(path)!r} is inside a {type(node).__name__}; use dicts of "
                "tensors, or pass trainable=True to train every leaf"
            )
        node = node[key]
    if not path:
        raise TypeError(
            f"funcamp.{api}: `params` must be a dict of tensors to freeze some of them, got "
            f"{describe(params)}"
        )


def _with_order(template: dict[Any, Any], part: dict[Any, Any]) -> dict[Any, Any]:
    """``part`` with its keys in ``template``'s order and ``template``'s dict type."""
    out = {}
    for key, value in template.items():
        if key in part:
            got = part[key]
            out[key] = _with_order(value, got) if isinstance(value, dict) else got
    return out if type(template) is dict else type(template)(out)


def combine(params: PyTree, frozen: PyTree) -> PyTree:
    """The params ``loss_fn`` runs on: ``params`` with the ``frozen`` leaves merged in by key
    (``params`` itself when nothing is frozen)."""
    if not frozen:
        return params
    out = dict(params)
    for key, value in frozen.items():
        mine = out.get(key)
        out[key] = combine(mine, value) if isinstance(mine, dict) else value
    return out


def check_frozen(api: str, params: PyTree, frozen: PyTree) -> None:
    """``frozen`` must be a (nested) dict of tensors whose paths are not among the params'."""
    if isinstance(frozen, dict) and not frozen:
        return
    paths, leaves, _ = optree.tree_flatten_with_path(frozen, namespace=NAMESPACE)
    if not isinstance(frozen, dict):
        raise TypeError(
            f"funcamp.{api}: `state.frozen` must be a dict of tensors (TrainState.create builds "
            f"it), got {describe(frozen)}"
        )
    own = {dotted_path(p) for p in optree.tree_flatten_with_path(params, namespace=NAMESPACE)[0]}
    for path, leaf in zip(paths, leaves):
        _check_dict_path(api, frozen, path)
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"funcamp.{api}: `state.frozen` leaf {dotted_path(path)!r} must be a tensor, got "
                f"{describe(leaf)}"
            )
        if dotted_path(path) in own:
            raise ValueError(
                f"funcamp.{api}: {dotted_path(path)!r} is both in `state.params` and in "
                "`state.frozen`; a parameter is either trained or frozen (TrainState.create "
                "splits them)"
            )
