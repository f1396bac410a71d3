"""One C++ build for a compiled step's CPU kernels, instead of one build per kernel.

Inductor builds every CPU kernel of a graph as a Python extension of its own. That is one ``g++``
process per kernel, each of which loads the precompiled ``cpp_prefix.h`` and links against
libtorch. That fixed part dominates the build of a small kernel. So a train step of a few dozen
kernels spends most of its C++ compile time on it. The same kernels built as a few translation
units take a fraction of it (docs/benchmarks.md has the numbers).

While :func:`bundling` is active, the kernels of a graph are built in *units*. A unit is
consecutive kernels in the graph's order, cut once their sources reach :data:`UNIT_BYTES`. Each
kernel sits in a namespace of its own, behind one Python extension per unit with one function per
kernel.

A unit starts building as soon as inductor has generated its kernels (seen where it writes them
into the graph's Python module). It builds in inductor's compile pool, while inductor generates the
rest of the graph on the other core. The last, partial unit starts when the graph's module asks for
its kernels (``async_compile.wait``). The code of every kernel, the compiler, its flags, the
precompiled header and the on-disk cache are inductor's own
(``CppPythonBindingsCodeCache.load_async``; the cache is keyed by the unit's source). So the
kernels compute the same bits. The cuts depend only on the kernels' order and sizes. So a later
process that loads the graph from inductor's cache makes the same units, and finds them built.

Some kernels are built the usual way: those whose source is not the plain shape this relies on.
(That shape is one ``extern "C" void kernel(`` after the ``cpp_prefix.h`` include, and no other
preprocessor lines but ``#pragma``.) Everything is built the usual way when this torch's binding
scheme is not the one mirrored here.

Upstream: no PyTorch issue asks for this yet. (The nearest, pytorch/pytorch#147323, is about the
opposite problem of one huge ``cpp_wrapper`` file.) This module would be unnecessary if inductor
built a graph's CPU kernels in a few translation units itself. (``cpp_wrapper=True`` builds one
file per graph, but it should keep the Python wrapper and build in parallel.) Scope: on only inside
:func:`bundling`, in the thread that entered it (funcamp's own compiles, chosen by
:mod:`funcamp.compiler.gate`). It is installed once, under a lock, the first time it is entered.

Workaround of torch internals (docs/upstream.md#cpp-bundle):

- Root cause: inductor builds each CPU kernel as its own Python extension, one g++ process each.
  The fixed cost (prefix header, libtorch link) dominates small kernels.
- Upstream: none asks for this; the write-up is docs/upstream.md#cpp-bundle (nearest:
  pytorch/pytorch#147323, the opposite problem).
- Why it is safe: the kernels' source, compiler, flags and cache are inductor's own, so the bits
  are the same (tested). A kernel of another shape is built the usual way.
- Tested on: torch 2.13 and 2.14 on the CPU (funcamp.compiler.ALLOWLIST); off elsewhere unless
  asked for.
- Delete when: inductor builds a graph's CPU kernels in a few translation units itself, or the
  allowlist has no release left that needs it.

"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import re
import threading
from collections.abc import Iterator
from typing import Any

from funcamp._core.progress import logger
from funcamp.compiler.switch import acted, install_once, switched_on

__all__ = ["bundling", "supported"]

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("funcamp_cpp_bundle", default=False)

_PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>"
_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(')
_DIRECTIVE = re.compile(r"^\s*#\s*(\w+)", re.M)

try:  # inductor's async compile, C++ code cache and wrapper (torch builds with inductor)
    from torch._inductor import async_compile as _async_compile
    from torch._inductor import codecache as _codecache
    from torch._inductor.codegen import wrapper as _wrapper
except Exception:  # pragma: no cover - torch without inductor
    _async_compile = _codecache = _wrapper = None


@functools.cache
def supported() -> bool:
    """Whether this torch builds CPU kernels the way this module mirrors.

    That means ``cpp_pybinding`` on ``AsyncCompile``, and Python bindings that read tensors
    through ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``.
    """
    if _async_compile is None or _codecache is None:
        return False
    cache = getattr(_codecache, "CppPythonBindingsCodeCache", None)
    template = getattr(cache, "suffix_template", "")
    return (
        hasattr(getattr(_async_compile, "AsyncCompile", None), "cpp_pybinding")
        and hasattr(_codecache, "LambdaFuture")
        and hasattr(cache, "load_async")
        and getattr(cache, "entry_function", None) == "kernel"
        and "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR" in template
        and "parse_arg" in template
    )


def _plain(source: str) -> bool:
    """A kernel source of the shape bundling relies on."""
    if not source.lstrip().startswith(_PREFIX):
        return False
    body = source.replace(_PREFIX, "", 1)
    if len(_ENTRY.findall(body)) != 1 or "PyInit_" in body:
        return False
    return all(d == "pragma" for d in _DIRECTIVE.findall(body))


_ARG_TYPE = re.compile(r"^(const\s+)?[A-Za-z_][\w:]*(\s*\*)?$")


def _plain_args(argtypes: Any) -> bool:
    return isinstance(argtypes, (list, tuple)) and all(
        isinstance(t, str) and _ARG_TYPE.match(t.strip()) for t in argtypes
    )


# The bindings: inductor's per-kernel suffix (CppPythonBindingsCodeCache.suffix_template),
# with one function per kernel in one module.
_HEAD = """
// Python bindings to call the kernels of this unit (funcamp: one build for many kernels)
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sstream>
#include <cstdlib>
#include <cerrno>

static void* (*_torchinductor_pyobject_tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T parse_arg(PyObject* args, size_t n) {
    static_assert(std::is_pointer_v<T>, "arg type must be pointer or long");
    return static_cast<T>(_torchinductor_pyobject_tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t parse_arg<int64_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if(result == -1 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return result;
}
template <> inline uintptr_t parse_arg<uintptr_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if(result == reinterpret_cast<void*>(-1) && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return reinterpret_cast<uintptr_t>(result);
}
template <> inline float parse_arg<float>(PyObject* args, size_t n) {
    auto result = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if(result == -1.0 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected float arg");
    return static_cast<float>(result);
}
"""

_FUNCTION = """
static PyObject* kernel_{i}_py(PyObject* self, PyObject* args) {{
    try {{
        if(!PyTuple_CheckExact(args)) [[unlikely]]
            throw std::runtime_error("tuple args required");
        if(PyTuple_GET_SIZE(args) != {n}) [[unlikely]]
            throw std::runtime_error("requires {n} args");
        funcamp_k{i}::kernel({parsed}); Py_RETURN_NONE;
    }} catch(std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch(...) {{
        PyErr_SetString(PyExc_RuntimeError, "unhandled error");
        return nullptr;
    }}
}}
"""

_TAIL = """
static PyMethodDef py_methods[] = {{
{methods}
    {{NULL, NULL, 0, NULL}}}};

static struct PyModuleDef py_module =
    {{PyModuleDef_HEAD_INIT, "kernel", NULL, -1, py_methods}};

PyMODINIT_FUNC PyInit_kernel(void) {{
    const char* str_addr = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if(!str_addr) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must be set");
        return nullptr;
    }}
    char* endptr = nullptr;
    errno = 0;
    uintptr_t addr = std::strtoull(str_addr, &endptr, 10);
    if(errno != 0 || endptr == str_addr || addr == 0) {{
        PyErr_SetString(PyExc_RuntimeError, "Failed to parse _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
        return nullptr;
    }}
    _torchinductor_pyobject_tensor_data_ptr =
        reinterpret_cast<decltype(_torchinductor_pyobject_tensor_data_ptr)>(addr);
    PyObject* module = PyModule_Create(&py_module);
    if (module == NULL) {{
        return NULL;
    }}
    #ifdef Py_GIL_DISABLED
        PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED);
    #endif
    return module;
}}
"""


def unit_source(kernels: list[tuple[list[str], str]]) -> str:
    """The C++ source of one unit.

    ``kernels`` are ``(argtypes, source)`` pairs, each of :func:`_plain` shape. They go in
    namespaces ``funcamp_k<i>``. A module ``kernel`` has a function ``kernel_<i>`` that calls
    the i-th.
    """
    parts = [_PREFIX + "\n"]
    functions, methods = [], []
    for i, (argtypes, source) in enumerate(kernels):
        body = _ENTRY.sub("void kernel(", source.replace(_PREFIX, "", 1), count=1)
        parts.append(f"namespace funcamp_k{i} {{\n{body}\n}}  // namespace funcamp_k{i}\n")
        parsed = ", ".join(
            f"parse_arg<{t.replace('const ', '').strip()}>(args, {n})"
            for n, t in enumerate(argtypes)
        )
        functions.append(_FUNCTION.format(i=i, n=len(argtypes), parsed=parsed))
        methods.append(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},')
    return "".join(parts) + _HEAD + "".join(functions) + _TAIL.format(methods="\n".join(methods))


#: A unit is cut once the sources held for it reach this many bytes: big enough that the fixed
#: cost of a build (the precompiled header and linking: docs/benchmarks.md) is shared by
#: several kernels, small enough that units build while inductor still generates
#: the rest of the graph.
UNIT_BYTES = 48 * 1024


class _Slot:
    """One held-back kernel, and where its function will be."""

    def __init__(self, argtypes: list[str], source: str) -> None:
        self.argtypes = argtypes
        self.source = source
        self.unit: Any = None  # () -> the unit's module, once the unit is submitted
        self.name = ""

    def get(self) -> Any:
        if self.unit is None:
            _build()
        if self.unit is None:  # held no more (a graph generated but never loaded): alone
            _submit([self])
        try:
            module = self.unit()
        except Exception as e:  # a unit that does not build: its kernels one by one, as usual
            if not _FAILED:
                _FAILED.append(e)
                logger.warning(
                    "funcamp: building a graph's CPU kernels together failed (%s: %s); they "
                    "are built one by one, as torch does",
                    type(e).__name__,
                    str(e).strip().splitlines()[0] if str(e).strip() else "",
                )
            return _codecache.CppPythonBindingsCodeCache.load_pybinding(self.argtypes, self.source)
        return getattr(module, self.name)


_LOCK = threading.Lock()
_HELD: list[_Slot] = []  # the kernels of the unit being filled
_EARLY: dict[str, _Slot] = {}  # kernels met while inductor generated code, by source
_FAILED: list[BaseException] = []  # the first failed unit (warned once)


def _submit(slots: list[_Slot]) -> None:
    """Build ``slots`` as one unit, in inductor's compile pool."""
    threads = _async_compile.get_compile_threads()
    submit = _async_compile.AsyncCompile.submit if threads > 1 else None
    code = unit_source([(slot.argtypes, slot.source) for slot in slots])
    unit = _codecache.CppPythonBindingsCodeCache.load_async(code, "cpu", submit_fn=submit)
    for j, slot in enumerate(slots):
        slot.unit, slot.name = unit, f"kernel_{j}"


def _add(slot: _Slot) -> None:
    """Hold ``slot`` for the unit being filled; submit the unit once it reaches
    :data:`UNIT_BYTES`. The cuts depend only on the kernels' order and sizes, so a process that
    loads the graph from inductor's cache (no code generation) makes the same units as the one
    that generated it, and finds them built on disk."""
    with _LOCK:
        _HELD.append(slot)
        full = sum(len(s.source) for s in _HELD) >= UNIT_BYTES
        slots = list(_HELD) if full else []
        if full:
            _HELD.clear()
    if slots:
        _submit(slots)


def _build() -> None:
    """Submit the unit being filled (the graph's last kernels: its module waits for them)."""
    with _LOCK:
        slots = list(_HELD)
        _HELD.clear()
    if slots:
        _submit(slots)


def _parse(kernel_body: str) -> tuple[list[str], str] | None:
    """``(argtypes, source)`` of a kernel definition in inductor's Python wrapper
    (``async_compile.cpp_pybinding([...], r'''...''')``), read as Python reads it; None for
    anything else."""
    text = kernel_body.strip()
    if not text.startswith("async_compile.cpp_pybinding("):
        return None
    try:
        node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or len(node.args) != 2 or node.keywords:
            return None
        argtypes, source = ast.literal_eval(node.args[0]), ast.literal_eval(node.args[1])
    except (SyntaxError, ValueError):
        return None
    if not isinstance(source, str) or not _plain_args(argtypes) or not _plain(source):
        return None
    return list(argtypes), source


_ORIGINAL: Any = None


def _install() -> None:
    """Route ``AsyncCompile.cpp_pybinding`` (and the wrapper's ``define_kernel``, where inductor
    writes a kernel into the graph's module as it generates it) through this module (once in the
    process, under the switch's lock: two threads entering :func:`bundling` at once install it
    once). Outside :func:`bundling` both run inductor's own code only."""
    install_once("cpp_bundle", _patch)


def _patch() -> bool:
    global _ORIGINAL
    cls = _async_compile.AsyncCompile
    _ORIGINAL = original = cls.cpp_pybinding

    def cpp_pybinding(self: Any, argtypes: list[str], source_code: str) -> Any:
        if not _ACTIVE.get():
            return original(self, argtypes, source_code)
        with _LOCK:  # a kernel met while generating code was checked then
            slot = _EARLY.pop(source_code, None)
        if slot is None:
            if not (_plain_args(argtypes) and _plain(source_code)):
                return original(self, argtypes, source_code)
            slot = _Slot(list(argtypes), source_code)
            _add(slot)
        acted("cpp_bundle")
        log = getattr(_async_compile, "kernel_code_log", None)
        if log is not None:
            log.info("CPP+Bindings Kernel (funcamp bundle):\n%s", source_code)
        if _async_compile.get_compile_threads() <= 1:  # inductor's `wait` resolves no future
            return slot.get()  # then: the kernel itself, as inductor's own single-thread path
        return _codecache.LambdaFuture(slot.get)

    cpp_pybinding.__wrapped__ = original  # type: ignore[attr-defined]
    cls.cpp_pybinding = cpp_pybinding

    wrapper = getattr(_wrapper, "PythonWrapperCodegen", None) if _wrapper is not None else None
    define = getattr(wrapper, "define_kernel", None)
    if define is None:  # pragma: no cover - another torch: units start when the graph loads
        return True

    def define_kernel(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = define(self, *args, **kwargs)
        if _ACTIVE.get():
            body = args[1] if len(args) > 1 else kwargs.get("kernel_body")
            parsed = _parse(body) if isinstance(body, str) else None
            if parsed is not None:
                slot = _Slot(*parsed)
                with _LOCK:
                    fresh = parsed[1] not in _EARLY
                    if fresh:
                        _EARLY[parsed[1]] = slot
                if fresh:
                    _add(slot)
        return out

    define_kernel.__wrapped__ = define  # type: ignore[attr-defined]
    wrapper.define_kernel = define_kernel
    return True


@contextlib.contextmanager
def bundling(enabled: bool | None = None) -> Iterator[None]:
    """Build inductor's CPU kernels together while this is active (see the module docstring).

    It acts when ``enabled``, on a torch this module supports. A kernel held back is built when
    it is first needed, inside or after the block. ``enabled=None`` means on, unless the
    environment sets ``FUNCAMP_CPP_BUNDLE=0``. (That gives torch's one build per kernel, for
    comparison or debugging.)
    """
    on = False
    try:
        with switched_on(_ACTIVE, "FUNCAMP_CPP_BUNDLE", enabled, supported, _install) as on:
            yield
    finally:
        if on and _EARLY and not _ACTIVE.get():  # (on every step's call: no lock when empty)
            with _LOCK:
                _EARLY.clear()  # generated but not loaded in the block: loaded later, if ever
