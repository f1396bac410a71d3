"""Masks and labels of param leaves, one convention for every optimizer and combinator.

A mask (:func:`funcamp.masked`, ``adamw(mask=)``, ``lion(mask=)``) or a label tree
(:func:`funcamp.multi_transform`) is either

* a pytree with the params' structure, or a prefix of it (a value then covers a whole
  subtree), or
* a callable of the dotted leaf path (``"encoder.0.weight"``) returning the leaf's value, or
* a callable of the params returning such a pytree (optax's convention).

A callable is first called with each leaf's path; if that raises or gives a value of another
kind, it is called with the params. If neither works, the error says what was tried.
"""

from __future__ import annotations

from typing import Any

import optree

from funcamp._core.tree import NAMESPACE, PyTree, describe, dotted_path, flatten, path_str

__all__ = ["check_selects", "leaf_values", "name_of"]

_PLURAL = {bool: "bools", str: "strings"}


def name_of(fn: Any) -> str:
    """How an error names a mask or label callable: its name and where it is defined."""
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    if code is not None:
        return f"{name} ({code.co_filename}:{code.co_firstlineno})"
    return describe(fn)[:120]


def leaf_values(
    api: str,
    arg: str,
    spec: Any,
    params: PyTree,
    kinds: tuple[type, ...],
    *,
    strict: bool = False,
) -> list[Any]:
    """One value of ``kinds`` per leaf of ``params``, from ``spec`` (see the module docstring).

    The pytree is read along each param leaf's path (plain lookups, which dynamo folds while it
    traces; optree cannot flatten a constant dict there). ``strict`` (``init``, eager) also
    checks that the pytree has nothing the params lack."""
    paths = optree.tree_flatten_with_path(params, namespace=NAMESPACE)[0]
    want = " or ".join(k.__name__ for k in kinds)
    plural = " or ".join(_PLURAL.get(k, k.__name__) for k in kinds)
    tree = spec
    bad: Any = None
    if callable(spec) and not isinstance(spec, type):
        try:
            out = [spec(dotted_path(p)) for p in paths]
        except Exception as e:  # not a callable of the path: try the params
            by_path: Exception | None = e
        else:
            bad = next((v for v in out if not isinstance(v, kinds)), None)
            if bad is None:
                return out
            by_path = None
        try:
            tree = spec(params)
        except Exception as e:
            tried = (
                f"called with a leaf path it raised {type(by_path).__name__}: {by_path}"
                if by_path is not None
                else f"called with a leaf path it returned {describe(bad)}"
            )
            raise TypeError(
                f"funcamp.{api}: `{arg}` {name_of(spec)} must be a callable of the dotted leaf "
                f"path (e.g. lambda path: path.endswith('weight')) returning a {want}, or of the "
                f"params returning a pytree of them; {tried}, and called with the params it "
                f"raised {type(e).__name__}: {e}"
            ) from e
    if strict:
        try:
            optree.tree_broadcast_prefix(tree, params, namespace=NAMESPACE)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"funcamp.{api}: `{arg}` must be a pytree of {plural} with the tree "
                f"structure of the params {flatten(params)[1]} or a prefix of it (or a callable "
                f"of the leaf path or of the params), got "
                f"{optree.tree_structure(tree, namespace=NAMESPACE)}"
            ) from e
    out = []
    for path in paths:
        node = tree
        for key in path:
            if isinstance(node, kinds):
                break
            node = _child(api, arg, node, key, path)
        if not isinstance(node, kinds):
            raise TypeError(
                f"funcamp.{api}: `{arg}` must hold Python {plural} (a {want} for each param "
                f"leaf), got {describe(node)} at {path_str(path)}"
            )
        out.append(node)
    return out


def _child(api: str, arg: str, node: Any, key: Any, path: tuple[Any, ...]) -> Any:
    if isinstance(node, dict) and key in node:
        return node[key]
    if isinstance(node, (list, tuple)) and isinstance(key, int) and 0 <= key < len(node):
        return node[key]
    if isinstance(key, str) and hasattr(node, key):
        return getattr(node, key)
    raise ValueError(
        f"funcamp.{api}: `{arg}` must have the tree structure of the params or a prefix of it "
        f"(or be a callable of the leaf path or of the params): it has no {key!r} on the way "
        f"to the param at {path_str(path)}"
    )


def check_selects(
    api: str, arg: str, spec: Any, params: PyTree, chosen: list[bool], hint: str
) -> None:
    """Refuse a mask that selects none of the param leaves (a typo in a path test trains
    nothing, silently), naming the mask and the paths it was given."""
    if not chosen or any(chosen):
        return
    keys = [dotted_path(p) for p in optree.tree_flatten_with_path(params, namespace=NAMESPACE)[0]]
    shown = ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
    what = name_of(spec) if callable(spec) else describe(spec)[:120]
    raise ValueError(
        f"funcamp.{api}: `{arg}` {what} selects none of the {len(keys)} param leaves it was "
        f"given ({shown}); check it against these paths, or {hint}"
    )
