"""Pytree helpers on optree: casting, finiteness checks and leaf-wise selection.

Workaround of torch internals (docs/internals.md#workarounds):

- Root cause: whether a tensor's elements overlap in memory (an expanded view, which an in-place
  write would corrupt) has no public query; torch._debug_has_internal_overlap answers it.
- Upstream: none filed.
- Why it is safe: a read-only query of sizes and strides, asked of non-contiguous tensors only.
- Tested on: torch 2.13 and 2.14.
- Delete when: torch exposes the overlap check publicly.

"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

from funcamp._core.context import compiling
from funcamp._core.numerics import spread
from funcamp._core.specs import (  # noqa: F401 (re-exported: the pytree helpers' home)
    NAMESPACE,
    DictSpec,
    NestedSpec,
    PyTree,
    flatten,
    spec_text,
    unflatten,
)

__all__ = [
    "NAMESPACE",
    "all_finite",
    "describe",
    "dotted_path",
    "leaf_path",
    "leaf_paths",
    "map_tensors",
    "path_str",
    "tree_cast",
    "tree_select",
]


def _write_into(new: PyTree, old: PyTree) -> PyTree:
    """``new`` with each tensor leaf written into the matching leaf of ``old`` (same shape, dtype
    and device), which takes its place: the step's results live in the old state's memory.
    Compiled, inductor stores the results straight into those buffers (no fresh allocations);
    leaves that do not match are returned as they are."""
    return plan_write(new, old)()


def plan_write(new: PyTree, old: PyTree) -> Callable[[], PyTree]:
    """:func:`_write_into` in two phases, for an all-or-nothing donated step.

    The structure of ``new`` is checked against ``old`` now, raising before anything is
    written. The returned function does the writes (plain copies between matched tensors) and
    returns the tree.
    """
    if isinstance(old, (dict, list, tuple)) and not old:  # no buffers (dynamo: no {} specs)
        return lambda: new
    old_leaves, spec = flatten(old)
    try:
        new_leaves = spec.flatten_up_to(new)  # the optimizer keeps its state's structure
    except (ValueError, TypeError):
        raise ValueError(
            "funcamp: a donated state must keep its structure to be written into; expected "
            f"{spec_text(spec)}, got {spec_text(flatten(new)[1])}"
        ) from None

    def commit() -> PyTree:
        out = []
        for n, o in zip(new_leaves, old_leaves):
            # a tensor that can take n's place: checked inline, not in a helper (dynamo traces
            # this loop for every leaf of the state, and inlines a call per leaf)
            if (
                isinstance(n, torch.Tensor)
                and isinstance(o, torch.Tensor)
                and n is not o
                and n.shape == o.shape
                and n.dtype == o.dtype
                and n.device == o.device
            ):
                o.copy_(n)
                n = o
            out.append(n)
        return unflatten(spec, out)

    return commit


def plan_select_write(pred: torch.Tensor, new: PyTree, old: PyTree) -> Callable[[], PyTree]:
    """``tree_select(pred, old, new)`` written into the tensors of ``old``, in two phases.

    The trees are matched and checked now, raising before anything is written (with
    :func:`tree_select`'s messages). The returned function writes ``where(pred, o, n)`` into
    each old tensor ``o`` whose new value ``n`` is another tensor. It returns ``old`` itself,
    whose tensors now hold the selection.

    This is the traced donated step's select and write, in one pass over flat leaves. Compiled,
    it replaces a select over both trees, a flatten of the selection and a rebuild. (Dynamo
    traces every leaf of each, and a train step's state has a few hundred.)
    """
    if isinstance(old, (dict, list, tuple)) and not old:  # no leaves (dynamo: no {} specs)
        return lambda: old
    old_leaves, spec = flatten(old)
    try:
        new_leaves = spec.flatten_up_to(new)
    except (ValueError, TypeError):
        raise _structure_mismatch(spec, flatten(new)[1]) from None
    olds: list[torch.Tensor] = []
    news: list[torch.Tensor] = []
    for i, o, n in zip(range(len(old_leaves)), old_leaves, new_leaves):
        if isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor):
            if n is o:
                continue
            if n.shape != o.shape or n.dtype != o.dtype:
                raise _leaf_mismatch(old, i, o, n)
            olds.append(o)
            news.append(n)
        elif isinstance(o, torch.Tensor) or isinstance(n, torch.Tensor) or o != n:
            raise _leaf_mismatch(old, i, o, n)

    def commit() -> PyTree:
        for o, n, p in zip(olds, news, spread(pred, len(olds))):
            o.copy_(torch.where(p, o, n))
        return old

    return commit


def storage_key(x: torch.Tensor) -> int | None:
    """An id of the memory behind ``x`` (shared by all its views); None for empty tensors."""
    if x.numel() == 0:
        return None
    return x.untyped_storage().data_ptr()


def self_overlapping(x: torch.Tensor, certain: bool = False) -> bool:
    """Whether elements of ``x`` share memory.

    Such a tensor is an expanded one, like the grad of ``w.sum()`` from ``torch.func.grad`` (all
    strides 0). Torch refuses to write into it in place, so it is never donated or owned. This
    is torch's own test. "Too hard to tell" counts as overlapping (a sliding window view, but
    also a step slice such as ``x[::2]``). Such a tensor is copied, not written. With
    ``certain``, only a tensor torch is sure overlaps counts.
    """
    if x.is_contiguous():
        return False
    overlap = torch._debug_has_internal_overlap(x)  # 0: no, 1: yes, 2: too hard to tell
    return overlap == 1 if certain else overlap != 0


def _leaf_name(name: str, tree: PyTree, index: int) -> str:
    """``name`` plus the path of leaf ``index`` of ``tree`` (just ``name`` for a bare tensor)."""
    path = leaf_path(tree, index)
    return name + ("" if path == "<root>" else path)


def first_leaf(trees: dict[str, PyTree], bad: Callable[[Any], bool]) -> str | None:
    """The name (tree name + leaf path) of the first leaf of ``trees`` for which ``bad`` holds.

    None when there is none. Paths are made only for the answer, since this runs on every eager
    step.
    """
    for name, tree in trees.items():
        for i, x in enumerate(optree.tree_leaves(tree, namespace=NAMESPACE)):
            if bad(x):
                return _leaf_name(name, tree, i)
    return None


def sharing_memory(trees: dict[str, PyTree]) -> tuple[str, str] | None:
    """The names (tree name + leaf path) of the first two tensor leaves that share memory.

    None when there are none. Paths are made only for the answer, since this runs on every eager
    step.
    """
    seen: dict[int, tuple[str, PyTree, int]] = {}
    for name, tree in trees.items():
        for i, x in enumerate(optree.tree_leaves(tree, namespace=NAMESPACE)):
            key = storage_key(x) if isinstance(x, torch.Tensor) else None
            if key is None:
                continue
            if key in seen:
                return _leaf_name(*seen[key]), _leaf_name(name, tree, i)
            seen[key] = (name, tree, i)
    return None


def _flatten_with_path(tree: PyTree) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    paths, leaves, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return [path_str(p) for p in paths], leaves, spec


def insertion_order(tree: PyTree) -> list[int] | None:
    """The leaf indices of ``tree`` in the order its dicts iterate (None: flatten order).

    Flatten order sorts dict keys. Iteration order is a model's ``named_parameters()`` order
    for a params dict. Reductions over the params follow it, as torch's do over
    ``model.parameters()``: a float sum depends on its order.
    """
    if type(tree) is dict and all(type(k) is str for k in tree):
        keys = list(tree)
        if all(not isinstance(v, (dict, list, tuple)) for v in tree.values()):  # flat: fast
            ordered = sorted(keys)
            if ordered == keys:
                return None
            index = {k: i for i, k in zip(range(len(ordered)), ordered)}
            return [index[k] for k in keys]
    paths = optree.tree_paths(tree, namespace=NAMESPACE)
    index = {p: i for i, p in zip(range(len(paths)), paths)}
    out: list[int] = []

    def walk(node: Any, prefix: tuple[Any, ...]) -> None:
        if prefix in index:
            out.append(index[prefix])
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*prefix, k))
        elif isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            for i, v in zip(range(len(node)), node):
                walk(v, (*prefix, i))
        else:  # another node type: its own leaf order
            out.extend(i for p, i in index.items() if p[: len(prefix)] == prefix)

    walk(tree, ())
    if len(out) != len(paths) or sorted(out) != list(range(len(paths))):
        return None  # a tree this walk does not read: the flatten order
    return None if out == list(range(len(paths))) else out


def path_str(path: tuple[Any, ...]) -> str:
    """A readable pytree leaf path: ``['layer']['weight']`` (``<root>`` for the root)."""
    if not path:
        return "<root>"
    return "".join(f"[{k!r}]" for k in path)


def leaf_path(tree: PyTree, index: int) -> str:
    """The readable path of leaf ``index`` of ``tree``, for an error message.

    Checks flatten without paths and call this only when they fail. Under ``torch.compile``
    dynamo traces optree's flattening in Python, and the paths cost as much again.
    """
    return path_str(optree.tree_flatten_with_path(tree, namespace=NAMESPACE)[0][index])


def dotted_path(path: tuple[Any, ...]) -> str:
    """A leaf path as module names read: ``layer.weight`` (``<root>`` for the root)."""
    return ".".join(str(k) for k in path) if path else "<root>"


def leaf_paths(tree: PyTree) -> list[str]:
    """Return a readable path (``['layer']['weight']``) for every leaf of ``tree``, in leaf order."""
    return _flatten_with_path(tree)[0]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor in it, looking into every common container.

    The containers are optree's pytrees (dicts, lists, tuples, NamedTuples, funcamp's states),
    types registered with torch's pytree (Hugging Face's ``ModelOutput``), dataclasses and other
    mappings. A container in which nothing changed is returned as it is. What a function or a
    module returns is cast through this. So an output cast misses no tensor a user can see.
    """
    leaves, spec = flatten(tree)
    new = [_map_leaf(fn, x) for x in leaves]
    for a, b in zip(new, leaves):  # a loop, not all(): dynamo traces all() in Python
        if a is not b:
            return unflatten(spec, new)
    return tree


def _map_leaf(fn: Callable[[torch.Tensor], Any], x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) in torch_pytree.SUPPORTED_NODES:  # ModelOutput: an OrderedDict dataclass
        return torch_pytree.tree_map(lambda y: _map_leaf(fn, y), x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changed = {}
        for field in dataclasses.fields(x):
            if field.init:
                value = getattr(x, field.name)
                new = map_tensors(fn, value)
                if new is not value:
                    changed[field.name] = new
        return dataclasses.replace(x, **changed) if changed else x
    if isinstance(x, Mapping):
        items = {k: map_tensors(fn, v) for k, v in x.items()}
        if all(items[k] is v for k, v in x.items()):
            return x
        if isinstance(x, MutableMapping):
            new = copy.copy(x)
            for k, v in items.items():
                new[k] = v
            return new
        if type(x) is types.MappingProxyType:
            return types.MappingProxyType(items)
        raise TypeError(
            f"funcamp: cannot rebuild a {type(x).__qualname__} (a read-only mapping) with its "
            "tensors cast; return a dict, a dataclass or a NamedTuple instead"
        )
    return x


def tree_cast(tree: PyTree, dtype: torch.dtype, *, only_floating: bool = True) -> PyTree:
    """Cast the tensor leaves of a pytree to ``dtype``.

    Args:
        tree: any pytree (dicts, lists, tuples, NamedTuples, funcamp states).
        dtype: the target dtype.
        only_floating: when True (default) only floating-point tensors are cast; integer,
            bool and complex tensors pass through. When False every tensor leaf is cast.

    Non-tensor leaves always pass through untouched. Leaves already in ``dtype`` are returned as
    they are (no copy). Besides optree's pytrees, the tensors inside dataclasses, mappings and
    types registered with torch's pytree (Hugging Face's ``ModelOutput``) are cast too.

    Example:
        >>> import torch, funcamp
        >>> tree = {"w": torch.ones(2), "step": torch.tensor(3), "name": "fc"}
        >>> out = funcamp.tree_cast(tree, torch.bfloat16)
        >>> out["w"].dtype, out["step"].dtype, out["name"]
        (torch.bfloat16, torch.int64, 'fc')
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"funcamp.tree_cast: `dtype` must be a torch.dtype, got {dtype!r}")

    def cast(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == dtype or (only_floating and not x.is_floating_point()):
            return x
        return x.to(dtype)

    return map_tensors(cast, tree)


def all_finite(tree: PyTree) -> torch.Tensor:
    """Return a 0-d bool tensor: True when every floating tensor leaf is free of inf and nan.

    Non-floating and non-tensor leaves are ignored; an empty tree gives True. No host sync.

    Example:
        >>> import torch, funcamp
        >>> funcamp.all_finite({"a": torch.ones(3), "b": torch.tensor([1.0, float("inf")])})
        tensor(False)
        >>> funcamp.all_finite({})
        tensor(True)
    """
    leaves = [
        x
        for x in optree.tree_leaves(tree, namespace=NAMESPACE)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
    ]
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    device = leaves[0].device
    flags = [
        torch.isfinite(x).all() if x.numel() else torch.ones((), dtype=torch.bool, device=x.device)
        for x in leaves
    ]
    return torch.stack([f.to(device) for f in flags]).all()


def tree_select(pred: torch.Tensor, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Leaf-wise ``torch.where(pred, on_true, on_false)`` over two pytrees of one structure.

    ``pred`` is a 0-d bool tensor (a host-sync-free condition). Tensor leaves are selected with
    :func:`torch.where`, which keeps each leaf's dtype bit-exactly. Non-tensor leaves must be equal
    in both trees, and are kept.

    Example:
        >>> import torch, funcamp
        >>> new, old = {"w": torch.tensor([2.0])}, {"w": torch.tensor([1.0])}
        >>> funcamp.tree_select(torch.tensor(False), new, old)
        {'w': tensor([1.])}
    """
    return select_into(pred, on_true, on_false, None)


def _select_same_layout(pred: torch.Tensor, on_true: PyTree, on_false: PyTree) -> PyTree | None:
    """:func:`tree_select` when the two trees have one structure and tensors of the same shapes
    and dtypes (non-tensor leaves equal); None otherwise (the full path then checks and names
    what differs). Used under ``torch.compile``: dynamo maps dicts, lists, tuples and
    NamedTuples with ``optree.tree_map`` itself instead of tracing optree's flattening (a few
    instructions against some 350 a leaf). Like optree's ``flatten_up_to`` it takes a dict,
    ``OrderedDict`` or ``defaultdict`` with the same keys as one another, which the eager check
    refuses."""

    leaves: list[Any] = []
    optree.tree_map(leaves.append, on_true, namespace=NAMESPACE)  # a count, mapped natively
    preds = iter(spread(pred, len(leaves)))  # a copy of the flag for every few leaves
    same = [True]

    def pick(a: Any, b: Any) -> Any:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape == b.shape and a.dtype == b.dtype:
                return torch.where(next(preds), a, b)
        elif not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b:
            return a
        same[0] = False
        return a

    try:
        out = optree.tree_map(pick, on_true, on_false, namespace=NAMESPACE)
    except (ValueError, TypeError):
        return None
    return out if same[0] else None


def select_into(
    pred: torch.Tensor,
    on_true: PyTree,
    on_false: PyTree,
    writable: Callable[[torch.Tensor], bool] | None,
    done: Callable[[torch.Tensor], bool] | None = None,
) -> PyTree:
    """:func:`tree_select`, writing into the ``on_false`` leaves it may write.

    An ``on_false`` leaf for which ``writable(leaf)`` is True receives the result in place
    (``torch.where(..., out=leaf)``). It is a temporary the caller owns and nobody else sees.
    One for which ``done(leaf)`` is True already holds the selected value. A leaf that is the
    very same tensor in both trees is returned as is.
    """
    if not isinstance(pred, torch.Tensor) or pred.dtype != torch.bool or pred.dim() != 0:
        raise TypeError(
            f"funcamp.tree_select: `pred` must be a 0-d bool tensor, got {describe(pred)}"
        )
    if writable is None and compiling():  # without flattening either tree
        fast = _select_same_layout(pred, on_true, on_false)
        if fast is not None:
            return fast
    true_leaves, spec = flatten(on_true)
    false_leaves, false_spec = flatten(on_false)
    if spec != false_spec:
        raise _structure_mismatch(spec, false_spec)
    out = []
    masks: dict[torch.dtype, torch.Tensor] = {}
    for i, a, b in zip(range(len(true_leaves)), true_leaves, false_leaves):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise _leaf_mismatch(on_true, i, a, b)
            if writable is None:
                out.append(torch.where(pred, a, b))
            elif a is b:
                out.append(a)
            elif done is not None and done(b):
                out.append(b)
            elif a.stride() == b.stride() and a.device == b.device and writable(b):
                out.append(where_into(pred, a, b, masks))
            else:
                out.append(torch.where(pred, a, b))
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            raise _leaf_mismatch(on_true, i, a, b)
        else:
            out.append(a)
    return unflatten(spec, out)


def _structure_mismatch(spec: Any, other: Any) -> ValueError:
    """:func:`tree_select`'s error for trees of two structures."""
    return ValueError(
        "funcamp.tree_select: `on_true` and `on_false` must have the same structure, got "
        f"{spec_text(spec)} and {spec_text(other)}"
    )


def _leaf_mismatch(tree: PyTree, i: int, a: Any, b: Any) -> Exception:
    """:func:`tree_select`'s error for leaf ``i`` of ``tree``, which the other tree's ``b``
    cannot be selected against: tensors of another shape or dtype, a tensor against a
    non-tensor, or unequal non-tensor leaves. Made only to be raised."""
    path = leaf_path(tree, i)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return ValueError(
            f"funcamp.tree_select: leaf {path} differs in shape or dtype: "
            f"{tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
        )
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return TypeError(f"funcamp.tree_select: leaf {path} is a tensor in only one tree")
    return ValueError(f"funcamp.tree_select: non-tensor leaf {path} differs: {a!r} vs {b!r}")


#: The integer dtype holding each floating dtype's bits (the same size, for ``Tensor.view``).
BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
#: From this many elements on, a CPU select by bit operations beats torch.where (measured on one
#: thread; the gap grows with the size).
_BIT_SELECT_MIN = 16384


def where_into(
    pred: torch.Tensor, a: torch.Tensor, b: torch.Tensor, masks: dict[torch.dtype, torch.Tensor]
) -> torch.Tensor:
    """``torch.where(pred, a, b, out=b)`` for a ``b`` the caller owns.

    On CPU torch's ``where`` with a 0-d condition runs a scalar loop. For large float leaves the
    same bits come from three vectorized in-place passes over ``b``'s integer view:
    ``b ^= a; b &= k; b ^= a``. ``k`` is all zeros where ``pred`` holds (giving ``a``) and all
    ones where not (giving ``b``). ``masks`` caches ``k`` per integer dtype for one select over
    a tree.
    """
    bits = BITS.get(b.dtype)
    if bits is None or not (b.is_cpu and pred.is_cpu) or b.numel() < _BIT_SELECT_MIN:
        return torch.where(pred, a, b, out=b)
    k = masks.get(bits)
    if k is None:
        k = masks[bits] = torch.where(pred, 0, -1).to(bits)
    a_bits, b_bits = a.view(bits), b.view(bits)
    b_bits.bitwise_xor_(a_bits).bitwise_and_(k).bitwise_xor_(a_bits)
    return b


def describe(x: Any) -> str:
    """A short description of a value for error messages.

    For a tensor, its dtype and shape. Else its type and at most 80 characters of its repr.
    """
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    text = repr(x)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(x).__name__} {text}"
