"""Treespecs made without optree while dynamo traces.

:class:`DictSpec` is for a flat ``str``-keyed dict of tensors. :class:`NestedSpec` is for a tree
of dicts, lists, tuples, NamedTuples and None. :func:`flatten`/:func:`unflatten` use them under
``torch.compile``, and optree's C++ flatten otherwise.

Workaround of torch internals (docs/upstream.md#specs):

- Root cause: dynamo runs optree's flatten as Python polyfills, whose tracing time grows with
  the bytecode they execute.
- Upstream: none; see docs/upstream.md#specs.
- Why it is safe: the specs are used only while dynamo traces and are checked against optree's
  by tests/test_tree.py.
- Tested on: torch 2.13 and 2.14.
- Delete when: dynamo traces optree's C++ flatten natively.

"""

from __future__ import annotations

from typing import Any

import optree
import torch

from funcamp._core.context import compiling

__all__ = ["DictSpec", "NestedSpec", "flatten", "spec_text", "unflatten"]

#: optree namespace under which funcamp registers its own pytree node types.
NAMESPACE = "funcamp"

PyTree = Any


class DictSpec:
    """The treespec of a plain ``dict`` of tensors with ``str`` keys, made without optree.

    Such a dict is a model's params, their grads, or an optimizer buffer. Dynamo traces optree's
    flattening in Python, about 350 bytecode instructions a leaf. A train step flattens such
    dicts a dozen times. This spec is built from the sorted keys in a few instructions a leaf.
    It orders, compares and rebuilds exactly as optree's treespec of the same dict does. Leaves
    come in sorted key order. It is equal to a spec of the same keys in any order. It rebuilds
    in the flattened dict's key order. :func:`flatten` makes it only while compiling; eager code
    keeps optree's C++ treespec.
    """

    __slots__ = ("keys", "order")

    def __init__(self, keys: tuple[str, ...], order: tuple[str, ...]) -> None:
        self.keys = keys  # sorted: the leaf order
        self.order = order  # the dict's own key order: the order of the rebuilt dict

    @classmethod
    def of(cls, tree: dict[str, Any]) -> DictSpec:
        """The spec of ``tree``, a dict whose keys are all ``str``."""
        order = tuple(tree)
        return cls(tuple(sorted(order)), order)

    def flatten_up_to(self, tree: PyTree) -> list[Any]:
        """The values of ``tree`` (a dict, ``OrderedDict`` or ``defaultdict`` with these keys,
        as optree's ``flatten_up_to`` takes) in leaf order; ValueError otherwise."""
        # Checked before any lookup, and the message names no value: raised while dynamo
        # traces, a KeyError or a tensor's repr would end the trace instead of being caught.
        if isinstance(tree, dict) and len(tree) == len(self.keys):
            for k in self.keys:
                if k not in tree:
                    break
            else:
                return [tree[k] for k in self.keys]
        raise ValueError(
            f"expected a dict with the keys {list(self.keys)}, got a {type(tree).__name__} with "
            "other keys"
        )

    def unflatten(self, leaves: Any) -> dict[str, Any]:
        leaves = list(leaves)
        if len(leaves) != len(self.keys):
            raise ValueError(f"expected {len(self.keys)} leaves, got {len(leaves)}")
        by_key = {k: v for k, v in zip(self.keys, leaves)}  # not dict(zip()): traced in Python
        return by_key if self.order == self.keys else {k: by_key[k] for k in self.order}

    def treespec(self) -> Any:
        """optree's treespec of the same dict (for messages and comparisons with one)."""
        return optree.tree_structure(dict.fromkeys(self.order, 0), namespace=NAMESPACE)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DictSpec):
            return self.keys == other.keys
        return self.treespec() == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.keys)

    def __repr__(self) -> str:
        return "PyTreeSpec({" + ", ".join(f"{k!r}: *" for k in self.keys) + "})"


def spec_text(spec: Any) -> str:
    """A treespec as optree prints it, for error messages. While dynamo traces, formatting a
    :class:`DictSpec` itself would print dynamo's own name for the object."""
    if isinstance(spec, DictSpec):
        return DictSpec.__repr__(spec)
    if isinstance(spec, NestedSpec):
        return NestedSpec.__repr__(spec)
    return str(spec)


#: optree's registry of node types (private; when a later optree lacks it, NamedTuples are not
#: taken by :class:`NestedSpec`): a NamedTuple class registered there flattens its own way.
_REGISTRY: Any = getattr(getattr(optree, "registry", None), "_NODETYPE_REGISTRY", None)


def _plain_namedtuple(cls: type) -> bool:
    """Whether optree flattens ``cls`` (a tuple subclass) as a NamedTuple: its fields in order."""
    return (
        _REGISTRY is not None
        and isinstance(getattr(cls, "_fields", None), tuple)
        and hasattr(cls, "_make")
        and (NAMESPACE, cls) not in _REGISTRY
        and cls not in _REGISTRY
    )


class NestedSpec:
    """The treespec of a tree of containers with tensor leaves, made without optree.

    The nodes are ``dict`` (``str`` keys), ``list``, ``tuple``, NamedTuple and ``None``: an
    optimizer's state, a train state. It is to such a tree what :class:`DictSpec` is to a flat
    dict. Dynamo traces optree's flattening in Python, some 350 bytecode instructions a leaf.
    Leaves come in optree's order: dict keys sorted, NamedTuple fields in order, ``None`` a node
    without children. ``flatten_up_to`` takes what optree's takes: for a dict node a dict,
    ``OrderedDict`` or ``defaultdict`` with the same keys; for other nodes their own type. The
    spec compares equal to optree's treespec of the same tree.
    """

    __slots__ = ("children", "kind", "meta")

    def __init__(self, kind: str, meta: Any, children: tuple[Any, ...]) -> None:
        self.kind = kind  # "dict", "list", "tuple", "nt" (a NamedTuple), "none"
        self.meta = meta  # "dict": its DictSpec (keys, order); "nt": the class
        self.children = children  # a child spec, or None for a leaf

    def flatten_up_to(self, tree: PyTree) -> list[Any]:
        """The subtrees of ``tree`` at this spec's leaves; ValueError where a node differs."""
        out: list[Any] = []
        self._up_to(tree, out)
        return out

    def _up_to(self, tree: PyTree, out: list[Any]) -> None:
        # Messages name no value: raised while dynamo traces, a tensor's repr would end the trace
        # instead of being caught.
        kind = self.kind
        if kind == "dict":
            subtrees = self.meta.flatten_up_to(tree)
        elif kind == "none":
            if tree is not None:
                raise ValueError("expected None")
            return
        else:
            want = list if kind == "list" else tuple if kind == "tuple" else self.meta
            if type(tree) is not want or len(tree) != len(self.children):
                raise ValueError(f"expected a {want.__name__} of {len(self.children)}")
            subtrees = list(tree)
        for child, sub in zip(self.children, subtrees):
            if child is None:
                out.append(sub)
            else:
                child._up_to(sub, out)

    def unflatten(self, leaves: Any) -> PyTree:
        leaves = list(leaves)
        if len(leaves) != self._count():
            raise ValueError(f"expected {self._count()} leaves, got {len(leaves)}")
        return self._build(iter(leaves))

    def _count(self) -> int:
        n = 0
        for child in self.children:
            n += 1 if child is None else child._count()
        return n

    def _build(self, leaves: Any) -> PyTree:
        if self.kind == "none":
            return None
        values = [
            next(leaves) if child is None else child._build(leaves) for child in self.children
        ]
        if self.kind == "dict":
            return self.meta.unflatten(values)
        if self.kind == "list":
            return values
        if self.kind == "tuple":
            return tuple(values)
        return self.meta(*values)

    def _key(self) -> Any:
        meta = self.meta.keys if self.kind == "dict" else self.meta
        children = tuple(None if c is None else c._key() for c in self.children)
        return (self.kind, meta, children)

    def _example(self) -> PyTree:
        return self._build(iter([0] * self._count()))

    def treespec(self) -> Any:
        """optree's treespec of the same tree (for messages and comparisons with one)."""
        return optree.tree_structure(self._example(), namespace=NAMESPACE)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NestedSpec):
            return self._key() == other._key()
        if isinstance(other, DictSpec):
            return self.treespec() == other.treespec()
        return self.treespec() == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"PyTreeSpec({self._text()})"

    def _text(self) -> str:
        parts = ["*" if c is None else c._text() for c in self.children]
        if self.kind == "dict":
            return "{" + ", ".join(f"{k!r}: {p}" for k, p in zip(self.meta.keys, parts)) + "}"
        if self.kind == "list":
            return "[" + ", ".join(parts) + "]"
        if self.kind == "tuple":
            return "(" + ", ".join(parts) + (",)" if len(parts) == 1 else ")")
        if self.kind == "none":
            return "None"
        fields = self.meta._fields
        return f"{self.meta.__name__}(" + ", ".join(f"{f}={p}" for f, p in zip(fields, parts)) + ")"


def _nested(tree: PyTree, leaves: list[Any]) -> Any:
    """The :class:`NestedSpec` of ``tree`` (its tensor leaves appended to ``leaves``), None for a
    tensor, or False where another node or leaf type asks for optree."""
    if isinstance(tree, torch.Tensor):
        leaves.append(tree)
        return None
    cls = type(tree)
    if cls is dict:
        for k in tree:
            if type(k) is not str:
                return False
        meta: Any = DictSpec.of(tree)
        kind, subtrees = "dict", [tree[k] for k in meta.keys]
    elif cls is list or cls is tuple:
        kind, meta, subtrees = ("list" if cls is list else "tuple"), None, tree
    elif tree is None:
        return NestedSpec("none", None, ())
    elif isinstance(tree, tuple) and _plain_namedtuple(cls):
        kind, meta, subtrees = "nt", cls, tree
    else:
        return False
    children = []
    for sub in subtrees:
        if isinstance(sub, torch.Tensor):  # a leaf, without a call (dynamo inlines each call)
            leaves.append(sub)
            children.append(None)
            continue
        child = _nested(sub, leaves)
        if child is False:
            return False
        children.append(child)
    return NestedSpec(kind, meta, tuple(children))


def flatten(tree: PyTree) -> tuple[list[Any], Any]:
    """``optree.tree_flatten(tree, namespace=NAMESPACE)``, with funcamp's specs under compile.

    Under ``torch.compile`` a plain dict of tensors with str keys gets a :class:`DictSpec`
    instead (same leaves, same order). A tree of dicts, lists, tuples, NamedTuples and None with
    tensor leaves gets a :class:`NestedSpec`. Rebuild with :func:`unflatten`. The specs have
    ``flatten_up_to`` and compare like treespecs.
    """
    if compiling():
        if type(tree) is dict:
            for k, v in tree.items():  # a loop, not all(): dynamo traces all() in Python
                if type(k) is not str or not isinstance(v, torch.Tensor):
                    break
            else:
                flat = DictSpec.of(tree)
                return [tree[k] for k in flat.keys], flat
        if not isinstance(tree, torch.Tensor):
            leaves: list[Any] = []
            spec = _nested(tree, leaves)
            if spec is not False:
                return leaves, spec
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def unflatten(spec: Any, leaves: Any) -> PyTree:
    """The tree of ``spec`` (from :func:`flatten`) with these leaves."""
    if isinstance(spec, (DictSpec, NestedSpec)):
        return spec.unflatten(leaves)
    return optree.tree_unflatten(spec, leaves)
