"""One C++ build for a compiled step's CPU kernels, instead of one build per kernel.

Inductor builds every CPU kernel of a graph as a Python extension of its own: one ``g++``
process per kernel, each of which loads the precompiled ``cpp_prefix.h`` (~150 MB) and links
against libtorch. That fixed part dominates: 1.3 s for a kernel of 5 KB, 2.1 s for one of 130 KB
on a 2-core AMD EPYC (torch 2.13); a train step's 28 kernels (GPT-2 of the real-model suite) spend
35 s of compiler time, 17 s of wall time on two compile threads. The same 28 kernels built as two
translation units, one per compile thread, take 3.5 s (docs/benchmarks.md, "One build for a
graph's kernels").

While :func:`bundling` is active, each kernel source that inductor hands to
``AsyncCompile.cpp_pybinding`` is held back, and the first time one of them is needed (inductor's
``async_compile.wait`` at the end of loading a graph) all held kernels are built together: in as
many translation units as inductor has compile threads, each kernel in a namespace of its own,
behind one Python extension per unit with one function per kernel. The code of every kernel, the
compiler, its flags, the precompiled header and the on-disk cache (keyed by the unit's source) are
inductor's own (``CppPythonBindingsCodeCache.load_async``), so the kernels compute the same bits
and a later process that compiles the same graph finds the built units on disk.

A kernel whose source is not the plain shape this relies on (one ``extern "C" void kernel(``
after the ``cpp_prefix.h`` include, no other preprocessor lines but ``#pragma``) is built the
usual way, as is everything when this torch's binding scheme is not the one mirrored here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from funcamp._core.progress import logger

__all__ = ["bundling", "supported"]

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("funcamp_cpp_bundle", default=False)

_PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>"
_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(')
_DIRECTIVE = re.compile(r"^\s*#\s*(\w+)", re.M)

try:  # inductor's async compile and C++ code cache (torch builds with inductor)
    from torch._inductor import async_compile as _async_compile
    from torch._inductor import codecache as _codecache
except Exception:  # pragma: no cover - torch without inductor
    _async_compile = _codecache = None


@functools.cache
def supported() -> bool:
    """Whether this torch builds CPU kernels the way this module mirrors: ``cpp_pybinding`` on
    ``AsyncCompile`` and Python bindings that read tensors through
    ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``."""
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
    """The C++ source of one unit: ``kernels`` (``(argtypes, source)``, each of :func:`_plain`
    shape) in namespaces ``funcamp_k<i>``, and a module ``kernel`` whose function
    ``kernel_<i>`` calls the i-th."""
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


def _split(sizes: list[int], parts: int) -> list[list[int]]:
    """Indices ``0..len(sizes)-1`` in ``parts`` groups of about equal total size (largest
    first, each to the lightest group); each group in index order. Deterministic, so that the
    same graph makes the same units (and finds them in the on-disk cache)."""
    groups: list[list[int]] = [[] for _ in range(max(1, min(parts, len(sizes))))]
    loads = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = loads.index(min(loads))
        groups[g].append(i)
        loads[g] += sizes[i]
    return [sorted(g) for g in groups if g]


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
_HELD: list[_Slot] = []  # the kernels held back since the last build
_FAILED: list[BaseException] = []  # the first failed unit (warned once)


def _build() -> None:
    """Build every held-back kernel: in as many units as inductor has compile threads,
    submitted to its compile pool together."""
    with _LOCK:
        slots, _HELD[:] = list(_HELD), []
    if not slots:
        return
    threads = _async_compile.get_compile_threads()
    submit = _async_compile.AsyncCompile.submit if threads > 1 else None
    cache = _codecache.CppPythonBindingsCodeCache
    for group in _split([len(slot.source) for slot in slots], threads):
        members = [slots[i] for i in group]
        code = unit_source([(slot.argtypes, slot.source) for slot in members])
        unit = cache.load_async(code, "cpu", submit_fn=submit)
        for j, slot in enumerate(members):
            slot.unit, slot.name = unit, f"kernel_{j}"


def _hold(argtypes: list[str], source_code: str) -> Any:
    slot = _Slot(list(argtypes), source_code)
    with _LOCK:
        _HELD.append(slot)
    return _codecache.LambdaFuture(slot.get)


_ORIGINAL: Any = None


def _install() -> None:
    """Route ``AsyncCompile.cpp_pybinding`` through :func:`_cpp_pybinding` (once). Outside
    :func:`bundling` it calls inductor's own, unchanged."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return
    cls = _async_compile.AsyncCompile
    _ORIGINAL = cls.cpp_pybinding

    def cpp_pybinding(self: Any, argtypes: list[str], source_code: str) -> Any:
        if _ACTIVE.get() and _plain_args(argtypes) and _plain(source_code):
            log = getattr(_async_compile, "kernel_code_log", None)
            if log is not None:
                log.info("CPP+Bindings Kernel (funcamp bundle):\n%s", source_code)
            return _hold(argtypes, source_code)
        return _ORIGINAL(self, argtypes, source_code)

    cpp_pybinding.__wrapped__ = _ORIGINAL  # type: ignore[attr-defined]
    cls.cpp_pybinding = cpp_pybinding


@contextlib.contextmanager
def bundling(enabled: bool | None = None) -> Iterator[None]:
    """While active (and ``enabled`` on a torch this module supports), inductor's CPU kernels
    are built together (see the module's docstring). A kernel held back is built when it is
    first needed, inside or after the block. ``enabled=None``: on unless the environment sets
    ``FUNCAMP_CPP_BUNDLE=0`` (torch's one build per kernel, for comparison or debugging)."""
    if enabled is None:
        enabled = os.environ.get("FUNCAMP_CPP_BUNDLE", "1") != "0"
    if not enabled or not supported():
        yield
        return
    _install()
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
