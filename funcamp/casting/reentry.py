"""What the amp mode re-enters, so the calls made inside a composite reach it too.

Python composites (``torch.nn.functional``, ``torch.functional``, a few ``Tensor`` methods) are
re-entered as *unchecked copies* (:func:`_unchecked_copies`). C++ composites are re-entered
through their Python copies (``funcamp/casting/cpp_composites.py``). :func:`reentered` chooses,
once per op table, which of them may reach a listed op. The mode re-enters those and runs every
other call as called.

Workaround of torch internals (docs/upstream.md#reentry):

- Root cause: while a mode's __torch_function__ runs, the mode is off. A Python composite's own
  has_torch_function check sends a naive re-entry straight back to the mode.
- Upstream: none; the write-up is docs/upstream.md#reentry.
- Why it is safe: the unchecked copies are the composites' own code with only the entry check
  skipped. tests/test_opinfo.py compares every op with torch.autocast.
- Tested on: torch 2.13 and 2.14.
- Delete when: torch lets a mode re-enter for the body of a composite (a 'run with this mode,
  skip the entry dispatch' primitive).

"""

from __future__ import annotations

import dis
import types
from typing import Any, NamedTuple

import torch
from torch.nn.modules import utils as _nn_utils

from funcamp.casting.cpp_composites import CPP_COMPOSITES, REACHES
from funcamp.policy.ops import python_composites

__all__ = ["COMPOSITES", "backward_entries", "reentered"]


def _no_torch_function(*args: Any) -> bool:
    return False


_UNCHECKED_GLOBALS = {
    "has_torch_function": _no_torch_function,
    "has_torch_function_unary": _no_torch_function,
    "has_torch_function_variadic": _no_torch_function,
}


def _copy(fn: types.FunctionType, globals_: dict[str, Any] | None = None) -> types.FunctionType:
    """A copy of ``fn`` with its own identity: the same code, defaults and closure, and the same
    globals unless ``globals_`` are given."""
    namespace = fn.__globals__ if globals_ is None else globals_
    clone = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone.__qualname__ = fn.__qualname__
    clone.__wrapped__ = fn  # type: ignore[attr-defined]
    return clone


# Helpers that dynamo puts into the graph as torch functions (its trace rules list them) although
# they return Python values: ``_list_with_default(1, x.size())`` returns the int 1, a "torch.*
# op returned non-Tensor" graph break inside a re-entered ``F.adaptive_avg_pool2d(x, 1)`` (not
# re-entered, dynamo puts the whole pool into the graph and never sees the helper). Under their
# own identity dynamo traces their few lines like any Python function. A re-entered composite's
# namespace holds these copies.
_INLINED_HELPERS = {"_list_with_default": _copy(_nn_utils._list_with_default)}


def _unchecked_copies(functions: frozenset[Any]) -> dict[Any, types.FunctionType]:
    """Copies of Python composites whose ``has_torch_function*`` entry checks say no.

    Calling a composite itself with the mode active would dispatch straight back to the mode
    from its entry check and recurse forever. Each copy shares the original's code, defaults
    and closure; only the three check functions are swapped in its globals (one patched copy of
    each defining module's namespace), so its body runs as written and every torch call it
    makes reaches the mode. In that namespace the module's private helpers are their unchecked
    copies too: a helper's check reports the public function that called it (``_meshgrid``
    reports ``meshgrid``), and re-entering that function from inside itself never ends. Built
    once, eagerly, so dynamo only ever sees finished functions.
    """
    namespaces: dict[int, dict[str, Any]] = {}
    copies: dict[tuple[str, str], types.FunctionType] = {}
    by_original: dict[Any, types.FunctionType] = {}
    for fn in functions:
        globals_ = namespaces.get(id(fn.__globals__))
        if globals_ is None:
            globals_ = {**fn.__globals__, **_UNCHECKED_GLOBALS}
            for name, helper in _INLINED_HELPERS.items():
                if globals_.get(name) is helper.__wrapped__:  # type: ignore[attr-defined]
                    globals_[name] = helper
            namespaces[id(fn.__globals__)] = globals_
        clone = _copy(fn, globals_)
        key = (fn.__module__, fn.__name__)
        if key in copies and copies[key].__wrapped__ is not fn:  # type: ignore[attr-defined]
            raise AssertionError(f"two composites share the name {key}")
        copies[key] = clone
        by_original[fn] = clone
    for globals_ in namespaces.values():
        for name, value in list(globals_.items()):
            if name.startswith("_") and not name.startswith("__") and value in by_original:
                globals_[name] = by_original[value]
    return copies


def _tensor_unflatten(self: torch.Tensor, dim: Any, sizes: Any) -> torch.Tensor:
    # Stand-in for Tensor.unflatten, whose Python body calls ``super().unflatten`` (dynamo
    # cannot trace that from inside a mode handler). torch.unflatten is the same op.
    return torch.unflatten(self, dim, sizes)


COMPOSITES = _unchecked_copies(python_composites())
_UNFLATTEN = (torch.Tensor.unflatten.__module__, torch.Tensor.unflatten.__name__)
COMPOSITES[_UNFLATTEN] = _tensor_unflatten  # type: ignore[assignment]
# A copy at a Python entry point (torch.einsum, torch.tensordot: torch.functional, which dynamo
# does not trace into) takes the place of that composite's re-entry.
COMPOSITES.update(CPP_COMPOSITES)  # type: ignore[arg-type]


_OPERATOR_OPCODES = frozenset(
    {"BINARY_MATRIX_MULTIPLY", "INPLACE_MATRIX_MULTIPLY", "BINARY_POWER", "INPLACE_POWER"}
)
_OPERATOR_ARGS = frozenset({"@", "@=", "**", "**="})
_OPERATOR_NAMES = ("__matmul__", "__rmatmul__", "__imatmul__", "__pow__", "__rpow__", "__ipow__")
# The __torch_function__ plumbing at a composite's entry: never reached in the unchecked copies.
_PLUMBING = frozenset({"handle_torch_function", *_UNCHECKED_GLOBALS})
_ALWAYS_REENTERED = frozenset({_UNFLATTEN})


def _code_names(code: types.CodeType) -> tuple[set[str], bool]:
    """Names a code object (and the code nested in it) refers to; whether it uses ``@``/``**``."""
    names = set(code.co_names)
    operator = any(
        ins.opname in _OPERATOR_OPCODES
        or (ins.opname == "BINARY_OP" and ins.argrepr in _OPERATOR_ARGS)
        for ins in dis.get_instructions(code)
    )
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner, inner_operator = _code_names(const)
            names |= inner
            operator = operator or inner_operator
    return names, operator


class _Body(NamedTuple):
    """What a composite's body may call."""

    names: frozenset[str]  # the names it uses (globals, attributes)
    operator: bool  # whether it uses ``@`` or ``**``
    unknown: bool  # re-entered whatever the table (a helper funcamp knows nothing about, ...)
    helpers: tuple[tuple[str, str], ...]  # the composites it calls by global name


def _body(key: tuple[str, str]) -> _Body:
    original = getattr(COMPOSITES[key], "__wrapped__", None)
    if not isinstance(original, types.FunctionType) or key in _ALWAYS_REENTERED:
        return _Body(frozenset(), False, True, ())
    names, operator = _code_names(original.__code__)
    helpers: list[tuple[str, str]] = []
    unknown = False
    for name in names:
        value = original.__globals__.get(name)
        if value is original or name in _PLUMBING or not isinstance(value, types.FunctionType):
            continue  # an attribute named like the function itself (torch.relu), or plumbing
        sub = (value.__module__, value.__name__)
        helper = COMPOSITES.get(sub)
        if helper is None or getattr(helper, "__wrapped__", None) is not value:
            unknown = True  # a Python helper we know nothing about
        else:
            helpers.append(sub)
    return _Body(frozenset(names), operator, unknown, tuple(helpers))


def reentered(table: dict[Any, Any]) -> dict[tuple[str, str], Any]:
    """The Python composites and the copies of C++ composites whose body may reach an op of ``table``.

    Re-entering a composite costs a second trip through the mode for every torch call inside it. So
    a thin wrapper such as ``F.relu`` runs as called instead, when its body names no listed op,
    calls no ``@``/``**`` and calls no other Python function that might. The result is the same:
    its inner ops are run as called either way.

    A copy is re-entered when an op it may call is listed (``REACHES``). A composite naming a
    re-entered copy's entry point is re-entered too (``F.pad`` calls ``torch._C._nn.pad``). A
    composite is re-entered when any composite it calls, directly or through others, is. Any Python
    helper other than a known composite makes it re-entered (conservative). A cycle alone does not:
    ``meshgrid`` and ``_meshgrid`` name each other and reach nothing listed.
    """
    if any(not isinstance(key, str) for key in table):
        return dict(COMPOSITES)  # ops given as callables: match them wherever they are called
    listed = set(table)
    copies = {key: copy for key, copy in CPP_COMPOSITES.items() if REACHES[copy] & listed}
    listed |= {name for _, name in copies}
    operator_listed = any(name in listed for name in _OPERATOR_NAMES)

    reaching = {
        key
        for key, body in _BODIES.items()
        if body.unknown or body.names & listed or (body.operator and operator_listed)
    }
    changed = True
    while changed:  # callers of a reaching composite reach too (least fixed point)
        changed = False
        for key, body in _BODIES.items():
            if key not in reaching and any(h in reaching for h in body.helpers):
                reaching.add(key)
                changed = True
    found = {key: COMPOSITES[key] for key in _BODIES if key in reaching}
    return {**found, **copies}


_BODIES = {key: _body(key) for key in COMPOSITES if key not in CPP_COMPOSITES}


def backward_entries() -> dict[Any, types.FunctionType]:
    """``torch.autograd.grad``, ``torch.autograd.backward`` and ``Tensor.backward`` -> their copies.

    The copies are unchecked. A backward pass started while a mode is active dispatches to the
    mode first. The mode runs the copy with the mode on (for :func:`funcamp.recompute_under`).
    """
    originals = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)
    copies = _unchecked_copies(frozenset(originals))
    return {fn: copies[(fn.__module__, fn.__name__)] for fn in originals}
