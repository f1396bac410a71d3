"""A compiled train step kept on disk: ``make_train_step(..., cache_dir=...)``.

torch's compile caches (inductor's FX graph cache, AOTAutograd's cache) make a second process
skip code generation, but dynamo still traces the whole step again in every new process: about
10 s of a GPT step's 13 s warm start here. This module saves what dynamo produced too (torch's
AOT precompile: ``torch.compile(fn).aot_compile`` and ``torch.compiler.load_compiled_function``),
so a later process loads the step in a couple of seconds without tracing anything.

A saved step must never run where it no longer fits. dynamo specialises the graph on what the
step reads besides its inputs (the model's attributes, closure constants, globals, the code
itself); a funcamp step, like ``jax.jit``, does not re-check those on every call, and neither
does the loaded one. So each entry carries:

- a *key*: funcamp, torch and Python versions, the machine, the compile options and the torch
  compiler configs, the step's options, the loss function's code, and the inputs' structure,
  shapes, strides, dtypes and devices (one file per key: new input shapes add an entry);
- torch's record of every function the trace inlined, with a checksum of its source lines,
  compared with the files as they are now;
- *specialisation checks*: every guard dynamo made on something other than the inputs'
  tensors (which the step checks on every call), re-read from the new process's objects and
  compared with what dynamo saw, the way the guard compares it (a type guard by type, a value
  guard by value: constants by value, tensors by metadata, functions by their code, classes,
  modules and torch ops by name, containers element by element); a value guard on an object
  known only by its type, or on torch state funcamp does not model, refuses the save.

Anything that does not match, or any error while loading, compiles the step afresh (and
replaces the entry). See docs/internals.md for the details. Entries are pickles, as torch's own
artifacts are: load only cache directories you trust.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import functools
import glob
import hashlib
import importlib
import inspect
import io
import linecache
import math
import os
import pickle
import platform
import re
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch._dynamo.variables import builtin as dynamo_builtin
from torch._dynamo.variables import functions as dynamo_functions
from torch._dynamo.variables import nn_module as dynamo_nn_module
from torch._functorch._aot_autograd.utils import top_saved_tensors_hooks
from torch._guards import TracingContext, tracing

try:  # torch's AOT precompile and its source record (torch >= 2.10)
    from torch._dynamo import aot_compile as _aot_compile
    from torch._dynamo.package import SourceInfo, _hash_sourcelines
except ImportError:  # pragma: no cover - an older torch: cache_dir is ignored with a warning
    _aot_compile = SourceInfo = _hash_sourcelines = None
try:  # the helpers dynamo's guard sources read (G, L, __load_module, ...)
    from torch._dynamo.guards import _get_closure_vars
except ImportError:  # pragma: no cover - other torch versions
    _get_closure_vars = None

from funcamp._core.atomic import atomic_write
from funcamp._core.progress import COMPILING, logger
from funcamp._core.tree import NAMESPACE
from funcamp._core.version import __version__

__all__ = ["cache_support", "CachedStep"]

_FORMAT = 2  # 2: entries record the training flags they follow
_SUFFIX = ".funcamp-step"


def cache_support() -> str | None:
    """``None`` when this torch can save and load compiled steps, else why not."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return (
            f"torch {torch.__version__} has no torch.compiler.load_compiled_function "
            "(AOT precompile)"
        )
    if _aot_compile is None:  # pragma: no cover - torch without AOT precompile
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile"
    return None


# ---------------------------------------------------------------------------------------------
# Describing values, so that two processes can tell whether they hold "the same" thing.


def _code_digest(code: types.CodeType, h: Any, depth: int = 0) -> None:
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if depth < 8:
                _code_digest(const, h, depth + 1)
        else:  # a frozenset constant (`x in {"a", "b"}`) reprs in a per-process order
            h.update(_stable_repr(const).encode())


def _code_hex(code: types.CodeType | None) -> str:
    h = hashlib.sha256()
    if code is not None:
        _code_digest(code, h)
    return h.hexdigest()[:32]


def _function_digest(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    if code is None and not isinstance(fn, type):  # a callable object: its class's __call__
        code = getattr(type(fn).__call__, "__code__", None)
    return _code_hex(code if isinstance(code, types.CodeType) else None)


def _where(obj: Any) -> tuple[str, str]:
    return (
        str(getattr(obj, "__module__", None)),
        str(getattr(obj, "__qualname__", getattr(obj, "__name__", None))),
    )


_PLAIN = (type(None), bool, int, str, bytes)
_DEPTH = 6  # how deep containers are described; deeper is opaque
_TORCH_PLAIN = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def describe_value(value: Any, depth: int = 0) -> tuple[Any, ...]:
    """A picklable description of ``value`` that another process can reproduce from its own
    object: plain constants by value (floats by their bits), tensors by type, shape, strides,
    dtype, device, layout and requires_grad, functions by name and code, classes, modules and
    torch ops by name, sequences, sets and dicts element by element. Anything else is
    *opaque* (``("o", module, class)``): only its type can be compared across processes, which
    is enough for a guard on its type and never enough for a guard on its value."""
    if isinstance(value, _PLAIN):
        return ("v", type(value).__name__, value)
    if isinstance(value, float):
        return ("f", type(value).__name__, "nan" if math.isnan(value) else value.hex())
    if isinstance(value, complex):
        return ("c", repr(value))
    if isinstance(value, _TORCH_PLAIN):
        return ("t", type(value).__name__, str(value))
    if isinstance(value, enum.Enum):
        return ("e", *_where(type(value)), value.name)
    if isinstance(value, torch.Tensor):
        try:
            stride: Any = tuple(value.stride())
        except RuntimeError:  # sparse and other layouts without strides
            stride = None
        return (
            "T",
            *_where(type(value)),
            tuple(value.shape),
            stride,
            str(value.dtype),
            str(value.device),
            str(value.layout),
            bool(value.requires_grad),
        )
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return ("op", type(value).__name__, str(value))
    if isinstance(value, types.FunctionType):
        return ("fn", *_where(value), _function_digest(value))
    if isinstance(value, types.CodeType):
        return ("code", getattr(value, "co_qualname", value.co_name), _code_hex(value))
    if isinstance(value, types.MethodType):
        return ("m", describe_value(value.__func__, depth), *_where(type(value.__self__)))
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        owner = getattr(value, "__self__", None)
        kind = _where(owner) if isinstance(owner, (type, types.ModuleType)) else _where(type(owner))
        return ("b", str(getattr(value, "__name__", None)), *kind)
    if isinstance(value, type):
        return ("cls", *_where(value))
    if isinstance(value, types.ModuleType):
        return ("mod", value.__name__)
    if depth >= _DEPTH:
        return ("o", *_where(type(value)))
    if isinstance(value, functools.partial):
        parts = (value.func, value.args, value.keywords)
        return ("p", *(describe_value(x, depth + 1) for x in parts))
    if isinstance(value, (tuple, list)):
        return ("s", *_where(type(value)), tuple(describe_value(v, depth + 1) for v in value))
    if isinstance(value, (set, frozenset)):
        items = sorted((describe_value(v, depth + 1) for v in value), key=repr)
        return ("u", *_where(type(value)), tuple(items))
    if isinstance(value, dict):  # by key, sorted: a dict built by iterating a set is ordered
        # differently in each process (string hashing is salted per process)
        items = sorted(
            (
                (describe_value(k, depth + 1), describe_value(v, depth + 1))
                for k, v in value.items()
            ),
            key=lambda kv: repr(kv[0]),
        )
        return ("d", *_where(type(value)), tuple(items))
    return ("o", *_where(type(value)))


def _opaque(desc: Any) -> bool:
    """Whether a description holds an object known only by its type."""
    if not isinstance(desc, tuple) or not desc:
        return False
    return desc[0] == "o" or any(_opaque(x) for x in desc if isinstance(x, tuple))


def _short(desc: Any, limit: int = 160) -> str:
    text = repr(desc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SAME = ("same object",)


def _same_object(a: str, b: str, scope: dict[str, Any]) -> bool:
    (ok_a, value_a), (ok_b, value_b) = _read(a, scope), _read(b, scope)
    return ok_a and ok_b and value_a is value_b


def _failure(error: BaseException) -> tuple[str, str]:
    return ("error", type(error).__name__)


# ---------------------------------------------------------------------------------------------
# The key.


def _stable_repr(value: Any) -> str:
    """``repr`` with sets and dicts in a fixed order (their order varies between processes)."""
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, dict):
        items = sorted((_stable_repr(k), _stable_repr(v)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "(" + ",".join(_stable_repr(v) for v in value) + ")"
    return repr(value)


def _config_text(module_name: str) -> str:
    try:
        module = importlib.import_module(module_name)
        portable = module.save_config_portable()  # type: ignore[attr-defined]
        return repr(sorted((k, _stable_repr(v)) for k, v in portable.items()))
    except Exception:  # pragma: no cover - a torch without save_config_portable
        return "?"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _machine(leaves: list[Any]) -> tuple[Any, ...]:
    """The hardware compiled code is made for: inductor builds its C++ for this CPU's vector
    ISA (``-march=native``) and its CUDA kernels for this GPU."""
    devices = sorted({str(x.device) for x in leaves if isinstance(x, torch.Tensor)})
    cuda: Any = None
    if any(d.startswith("cuda") for d in devices) and torch.cuda.is_available():
        cuda = (
            torch.version.cuda,
            torch.cuda.get_device_name(),
            torch.cuda.get_device_capability(),
        )
    cpu = (_cpu_name(), torch.backends.cpu.get_cpu_capability())
    return (platform.machine(), platform.system(), cpu, tuple(devices), cuda)


def _options_text(options: dict[str, Any]) -> str:
    def text(v: Any) -> str:
        if callable(v):
            module, name = _where(v)
            return f"{module}.{name}:{_function_digest(v)}"
        if isinstance(v, dict):
            return "{" + ",".join(f"{k!r}:{text(x)}" for k, x in sorted(v.items())) + "}"
        return repr(v)

    return text(options)


def step_key(
    loss_fn: Callable[..., Any],
    settings: str,
    options: dict[str, Any],
    state: Any,
    batch: Any,
) -> tuple[Any, ...]:
    """Everything an entry is filed under (see the module docstring)."""
    leaves, spec = optree.tree_flatten((state, batch), namespace=NAMESPACE)
    signature = _signature(leaves, spec)
    if signature is None:  # CachedStep runs such inputs uncached, never asking for a key
        raise ValueError("inputs holding objects known only by their type have no key")
    return (
        _FORMAT,
        __version__,
        torch.__version__,
        str(getattr(torch.version, "git_version", "")),
        sys.version,
        _machine(leaves),
        _options_text(options),
        _config_text("torch._inductor.config"),
        _config_text("torch._functorch.config"),
        _config_text("torch._dynamo.config"),
        settings,
        (*_where(loss_fn), _function_digest(loss_fn)),
        str(spec),
        tuple(describe_value(x) for x in leaves if isinstance(x, torch.Tensor)),
        signature[1:],  # constants, tensors passed twice, torch's context
        _folded(),
    )


def _folded() -> tuple[Any, ...]:
    """What dynamo folds into a graph as a constant *without a guard* (its
    ``constant_fold_functions``): read here so that a process where they differ (another rank
    or world size, autocast dtypes, a GPU that is or is not there) gets another key."""
    dist = torch.distributed
    ranks: Any = None
    if dist.is_available() and dist.is_initialized():
        ranks = (dist.get_rank(), dist.get_world_size())
    accelerator = getattr(torch, "accelerator", None)
    return (
        torch._C._get_cublas_allow_tf32(),
        torch._C._is_any_autocast_enabled(),
        torch.is_autocast_cache_enabled(),
        tuple(str(torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
        str(torch.get_default_dtype()),
        torch.cuda.is_available(),
        bool(accelerator.is_available()) if accelerator is not None else None,
        dist.is_available(),
        dist.is_available() and dist.is_initialized(),
        ranks,
    )


# ---------------------------------------------------------------------------------------------
# Saving and loading.


#: The step's arguments; guards rooted in them (or in torch's global state) are the ones a
#: step checks on every call -- here and in funcamp.train.step's default guard filter.
STEP_INPUTS = ("state", "batch")
GLOBAL_STATE_SOURCES = ("GlobalStateSource", "ShapeEnvSource")


def source_root(source: Any) -> Any:
    """The source a dynamo guard source is read from (``L['state']`` for
    ``L['state'].params['w']``)."""
    while getattr(source, "base", None) is not None:
        source = source.base
    return source


def is_mode_flag(source: Any) -> bool:
    """Whether a guard source reads a module's ``training`` flag (``....training``): the flag
    ``model.train()`` / ``model.eval()`` sets, which a compiled step must follow."""
    return type(source).__name__ == "AttrSource" and getattr(source, "member", None) == "training"


# What torch.compiler.keep_portable_guards_unsafe keeps: with only these, torch's saved guard
# state holds no reference to the closure (its dict-key-order and global scopes are pruned), so
# another process can rebuild it.
_PORTABLE = ("TENSOR_MATCH", "GLOBAL_STATE", "SHAPE_ENV")


def _on_inputs(source: Any) -> bool:
    """A guard source rooted in the step's inputs or in torch's global state: what the saved
    step checks on every call. Guards rooted elsewhere (closures, globals) cannot be rebuilt
    in another process from torch's saved guard state; they become load-time checks."""
    root = source_root(source)
    kind = type(root).__name__
    if kind == "LocalSource":
        return root.local_name in STEP_INPUTS
    return kind in GLOBAL_STATE_SOURCES


def _structure(state: Any, batch: Any) -> tuple[Any, ...] | None:
    """What the saved step's tensor guards do not see, compared on every call: the inputs'
    treespec, their non-tensor leaves (by value), which tensor leaves are the same tensor
    (dynamo's duplicate-input guard), and the torch state a trace depends on (function modes,
    the default device, a functorch transform, saved-tensor hooks). None when a leaf is an
    object only known by its type (the step then runs uncached)."""
    return _signature(*optree.tree_flatten((state, batch), namespace=NAMESPACE))


def _signature(leaves: list[Any], spec: Any) -> tuple[Any, ...] | None:
    constants = []
    ids: dict[int, int] = {}
    same = []
    for i, x in zip(range(len(leaves)), leaves):
        if isinstance(x, torch.Tensor):
            first = ids.setdefault(id(x), i)
            if first != i:
                same.append((i, first))
        else:
            desc = describe_value(x)
            if _opaque(desc):
                return None
            constants.append((i, desc))
    return spec, tuple(constants), tuple(same), _context()


def _context() -> tuple[Any, ...]:
    hooks = top_saved_tensors_hooks()
    return (
        tuple(_where(type(m)) for m in torch.overrides._get_current_function_mode_stack()),
        torch._C._is_torch_function_enabled(),
        str(getattr(torch.utils._device, "CURRENT_DEVICE", None)),
        torch._C._functorch.maybe_current_level(),
        None if hooks is None else tuple(describe_value(h) for h in hooks),
    )


# Guards on torch's global state that _context() stands for, or that the kept GLOBAL_STATE
# guard checks (grad mode, deterministic algorithms, FSDP's training state: no-ops of their
# own in dynamo); any other guard with no source (dynamo may add kinds) makes an entry
# unsaveable.
_CONTEXT_GUARDS = frozenset(
    (
        "TORCH_FUNCTION_STATE",
        "DEFAULT_DEVICE",
        "FUNCTORCH_STACK_MATCH",
        "AUTOGRAD_SAVED_TENSORS_HOOKS",
        "GRAD_MODE",
        "DETERMINISTIC_ALGORITHMS",
        "FSDP_TRAINING_STATE",
    )
)
_TYPE_KINDS = frozenset(
    ("TYPE_MATCH", "FAKE_SCRIPT_TYPE_MATCH", "WEAKREF_ALIVE", "DUPLICATE_INPUT")
)
_LEN_KINDS = frozenset(
    (
        "LENGTH_CHECK",
        "SEQUENCE_LENGTH",
        "DICT_LENGTH",
        "TUPLE_ITERATOR_LEN",
        "EMPTY_NN_MODULE_HOOKS_DICT",
    )
)
_KEYS_KINDS = frozenset(("DICT_KEYS_MATCH", "MAPPING_KEYS_CHECK"))
_CONTAINS_KINDS = frozenset(
    ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS", "SET_NOT_CONTAINS")
)
# Value guards may see an object known only by its type where the value is a dict that
# dynamo watches for mutation (DICT_VERSION): compared by content, values by type.
_OPAQUE_OK = frozenset(("DICT_VERSION",))


def _view(kind: str, param: Any, value: Any) -> tuple[Any, ...]:
    """What the guard ``kind`` (with its parameter: an attribute or a key) looks at in
    ``value``, as a description another process can compare: the type for a type guard, the
    length for a length guard, the keys for a keys guard, a membership for a contains guard,
    and the whole value (:func:`describe_value`) for a value guard (ID_MATCH, CONSTANT_MATCH,
    FUNCTION_MATCH, TENSOR_MATCH, ... and any kind not named here)."""
    if kind in _TYPE_KINDS:
        return ("type", *_where(type(value)))
    if kind in ("NONE_MATCH", "NOT_NONE_MATCH"):
        return ("none", value is None)
    if kind == "HASATTR" and isinstance(param, str):
        return ("hasattr", param, hasattr(value, param))
    if kind == "NOT_PRESENT_IN_GENERIC_DICT" and isinstance(param, str):
        return ("in __dict__", param, param in getattr(value, "__dict__", {}))
    if kind in _LEN_KINDS:
        return ("len", len(value))
    if kind in _KEYS_KINDS:
        return ("keys", tuple(describe_value(k, _DEPTH - 1) for k in value))
    if kind in _CONTAINS_KINDS and param is not _NO_PARAM:
        return ("contains", describe_value(param), param in value)
    return describe_value(value)


_NO_PARAM = object()


def _views(kinds: dict[str, list[Any]], value: Any) -> tuple[Any, ...]:
    out = []
    for kind, params in sorted(kinds.items()):
        for param in params:
            try:
                out.append((kind, _view(kind, param, value)))
            except Exception as e:
                out.append((kind, _failure(e)))
    return tuple(out)


def _read(name: str, scope: dict[str, Any]) -> tuple[bool, Any]:
    """``(True, value)`` of a guard source in ``scope``, or ``(False, the exception)``."""
    try:
        helpers = dict(_get_closure_vars()) if _get_closure_vars is not None else {}
    except AttributeError:  # pragma: no cover - other torch versions
        helpers = {}
    helpers["__load_module"] = importlib.import_module
    try:
        return True, eval(name, scope, helpers)
    except Exception as e:
        return False, e


def _check(name: str, kinds: dict[str, Any], scope: dict[str, Any]) -> tuple[Any, ...]:
    ok, value = _read(name, scope)
    return _views(kinds, value) if ok else ("error", type(value).__name__)


def _same_param(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a tensor key, say
        return False


class _Recorder:
    """The saved step's guard filter: it keeps what the step can check on every call in
    another process (torch's portable guards -- tensor metadata, global state, shapes -- on
    the inputs) and records every other guard, by source, as a check for load time."""

    def __init__(self) -> None:
        # source name -> ({guard kind: [its attributes or keys]}, the value dynamo saw or
        # _NO_PARAM): one dict may be guarded to contain several keys
        self.dropped: dict[str, tuple[dict[str, list[Any]], Any]] = {}
        self.same: list[tuple[str, str | None]] = []  # DUPLICATE_INPUT: two sources, one object
        self.modes: dict[str, bool] = {}  # source of a module's `training` flag -> its value

    def __call__(self, entries: list[Any]) -> list[bool]:
        out = []
        for entry in entries:
            ok = (
                entry.guard_type in _PORTABLE
                and not entry.is_global
                and _on_inputs(entry.orig_guard.originating_source)
            )
            if not ok:
                name = entry.orig_guard.originating_source.name
                seen = entry.value if entry.has_value else _NO_PARAM
                if is_mode_flag(entry.orig_guard.originating_source) and isinstance(seen, bool):
                    self.modes[name] = seen
                kinds, _ = self.dropped.setdefault(name, ({}, seen))
                keywords = getattr(entry.orig_guard.create_fn, "keywords", None) or {}
                param = keywords.get("attr", keywords.get("key", _NO_PARAM))
                params = kinds.setdefault(entry.guard_type, [])
                if not any(_same_param(p, param) for p in params):
                    params.append(param)
                if entry.guard_type == "DUPLICATE_INPUT":
                    other = keywords.get("source_b")
                    self.same.append((name, getattr(other, "name", None)))
            out.append(ok)
        return out


def _scope(compiled: Any, fn: Callable[..., Any], state: Any, batch: Any) -> dict[str, Any]:
    """What dynamo's guard sources read: ``L`` the step's inputs and closure, ``G`` its globals
    (the module's and those the compiled bytecode uses)."""
    return {
        "L": compiled.prepare_f_locals(state, batch),
        "G": {**fn.__globals__, **compiled.fn.__globals__},
        "__builtins__": builtins.__dict__,
    }


_GLOBAL_ROOT = re.compile(r"G\['([^']+)'\]")


def _portable(name: str, globals_: dict[str, Any]) -> str | None:
    """``name`` with each global that dynamo installed while tracing (named by an id or a
    counter in this process: an imported module, the builtins dict) spelt so another process
    can read it; None for a namespace of code a class made with exec (a NamedTuple's
    ``__new__``): named by its id here, fixed by the class definition, so not checked."""
    if "G['___unnamed_scope_" in name:
        return None

    def spell(match: re.Match[str]) -> str:
        value = globals_.get(match.group(1))
        if isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value:
            return f"__load_module({value.__name__!r})"
        if value is builtins.__dict__:
            return "__builtins__"
        return match.group(0)

    return _GLOBAL_ROOT.sub(spell, name)


def _source_changes(compiled: Any) -> str | None:
    """The first inlined function whose source lines changed since the entry was made."""
    if _hash_sourcelines is None:  # pragma: no cover - other torch versions
        return "this torch cannot check the entry's sources"
    for source in sorted(
        compiled.source_info().inlined_sources, key=lambda s: (s.module, s.firstlineno)
    ):
        module = sys.modules.get(source.module)
        try:
            if module is None:
                module = importlib.import_module(source.module)
            linecache.checkcache(getattr(module, "__file__", None) or "")
            same = _hash_sourcelines(module, source.firstlineno, source.lastlineno)
        except Exception as e:
            return f"{source.module} cannot be read ({type(e).__name__})"
        if same != source.checksum:
            return f"{source.module} changed (lines {source.firstlineno}-{source.lastlineno})"
    return None


@contextlib.contextmanager
def _guard_loading() -> Any:
    """Unpickling a guard on an imported module's global installs a guard on the module, which
    needs a tracing context; it is thrown away."""
    with tracing(TracingContext(None)):
        yield


class CachedStep:
    """``train_step`` compiled once per input signature and kept in ``directory``: a matching,
    still valid entry is loaded (no trace), anything else is compiled with torch's AOT
    precompile and saved. Dispatch between entries is by the inputs' structure and their
    tensor guards; past torch's recompile limit, and for inputs holding objects known only by
    their type, ``fallback`` (the step compiled as usual) takes over."""

    def __init__(
        self,
        train_step: Callable[..., Any],
        compile_with: Callable[[Callable[[list[Any]], list[bool]]], Any],
        fallback: Callable[..., Any],
        directory: str,
        loss_fn: Callable[..., Any],
        settings: str,
        options: dict[str, Any],
    ) -> None:
        self.train_step = train_step
        self.compile_with = compile_with  # guard filter -> torch.compile(train_step, ...)
        self.fallback = fallback
        self.directory = directory
        self.loss_fn = loss_fn
        self.settings = settings
        self.options = options
        # [structure, compiled, proven]: the saved guards check the input tensors (shape,
        # strides, dtype, device) in C++; the structure is compared here. A loaded entry is
        # proven by its first call.
        self.entries: list[list[Any]] = []
        self.broken = False
        self.said_uncached = False

    def _external(self) -> dict[str, Any]:
        code = self.train_step.__code__
        cells = self.train_step.__closure__ or ()
        return {f"closure:{n}": c.cell_contents for n, c in zip(code.co_freevars, cells)}

    def __call__(self, state: Any, batch: Any) -> Any:
        structure = _structure(state, batch)
        if structure is None:
            if not self.said_uncached:
                self.said_uncached = True
                logger.warning(
                    "funcamp: cache_dir: the state or batch holds an object other than tensors "
                    "and plain constants; a saved step could only compare its type, so this "
                    "step compiles as usual (unsaved) for such inputs"
                )
            return self.fallback(state, batch)
        for entry in self.entries:
            if (
                entry[0] == structure
                and all(m.training is flag for m, flag in entry[3])
                and entry[1].guard_check(state, batch)
            ):
                return self._run(entry, state, batch)
        if self.broken or len(self.entries) >= torch._dynamo.config.recompile_limit:
            return self.fallback(state, batch)
        compiled, modes, loaded = self._load_or_compile(state, batch)
        if compiled is None:
            self.broken = True
            return self.fallback(state, batch)
        entry = [structure, compiled, not loaded, modes]
        self.entries.append(entry)
        return self._run(entry, state, batch)

    def _run(self, entry: list[Any], state: Any, batch: Any) -> Any:
        if entry[2]:
            return entry[1].fn(state, batch)
        try:  # a loaded entry's first call: if it cannot run here, compile instead
            out = entry[1].fn(state, batch)
        except Exception as e:
            self.entries.remove(entry)
            logger.warning(
                "funcamp: the loaded train step failed on its first call (%s: %s); compiling",
                type(e).__name__,
                e,
            )
            compiled, modes = self._compile(*self._key_and_stem(state, batch), state, batch)
            if compiled is None:
                self.broken = True
                return self.fallback(state, batch)
            entry = [entry[0], compiled, True, modes]
            self.entries.append(entry)
            return compiled.fn(state, batch)
        entry[2] = True
        return out

    def _key_and_stem(self, state: Any, batch: Any) -> tuple[Any, str]:
        """The entry's key and its files' common path: one file per set of modules' training
        flags the step was specialised on (``model.train()`` / ``model.eval()``), which only
        the trace tells, so the flags' digest ends the file name."""
        key = step_key(self.loss_fn, self.settings, self.options, state, batch)
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:40]
        name = "".join(c if c.isalnum() else "_" for c in _where(self.loss_fn)[1])[:40]
        return key, os.path.join(self.directory, f"{name}-{digest}")

    def _load_or_compile(self, state: Any, batch: Any) -> tuple[Any, Any, bool]:
        key, stem = self._key_and_stem(state, batch)
        paths = glob.glob(glob.escape(stem) + "*" + _SUFFIX)
        for path in sorted(paths, key=_modified, reverse=True):
            start = time.perf_counter()
            compiled, modes, why = self._load(path, key, state, batch)
            if compiled is not None:
                logger.info(
                    "funcamp: loaded the compiled train step from %s in %.1f s (no trace)",
                    path,
                    time.perf_counter() - start,
                )
                return compiled, modes, True
            logger.info("funcamp: not using the cached train step %s: %s", path, why)
        return (*self._compile(key, stem, state, batch), False)

    def _load(self, path: str, key: Any, state: Any, batch: Any) -> tuple[Any, Any, str]:
        """``(compiled, its mode flags, "")`` of a saved entry that still fits, else
        ``(None, (), why not)``."""
        try:
            with open(path, "rb") as f:
                record = pickle.load(f)
            if not isinstance(record, dict) or record.get("format") != _FORMAT:
                return None, (), "written by another funcamp version"
            if record["key"] != key:
                return None, (), "its key differs (a hash collision or an edited file)"
            changed = _changed_file(record["files"])
            if changed is not None:
                return None, (), changed
            with _guard_loading():
                compiled = torch.compiler.load_compiled_function(
                    io.BytesIO(record["artifact"]),
                    f_globals=self.train_step.__globals__,
                    external_data=self._external(),
                )
        except Exception as e:
            return None, (), f"it cannot be read ({type(e).__name__}: {e})"
        changed = _source_changes(compiled)
        if changed is not None:
            return None, (), changed
        scope = _scope(compiled, self.train_step, state, batch)
        for name, kinds, expected in record["checks"]:
            if expected == _SAME:
                if not _same_object(*name, scope):
                    return None, (), f"{name[0]} is no longer {name[1]}"
                continue
            now = _check(name, kinds, scope)
            if now != expected:
                return None, (), f"{name} is {_short(now)}, was {_short(expected)}"
        if not compiled.guard_check(state, batch):
            return None, (), "its guards reject this state and batch"
        modes = _mode_flags(record["modes"], scope)
        if modes is None:
            return None, (), "a module whose training flag it follows cannot be read"
        return compiled, modes, ""

    def _compile(self, key: Any, stem: str, state: Any, batch: Any) -> tuple[Any, Any]:
        """``(compiled, its mode flags)``, saved under ``stem`` when it can be; ``(None, ())``
        when torch cannot precompile the step."""
        logger.info(COMPILING)
        start = time.perf_counter()
        recorder = _Recorder()
        try:
            with _without_source() as unchecked, _constant_results() as folded:
                compiled = self.compile_with(recorder).aot_compile(((state, batch), {}))
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.TorchRuntimeError):
            raise  # the step's own handler explains these
        except Exception as e:
            logger.warning(
                "funcamp: cache_dir: torch could not precompile this step (%s: %s); it is "
                "compiled as usual and not saved",
                type(e).__name__,
                e,
            )
            return None, ()
        elapsed = time.perf_counter() - start
        scope = _scope(compiled, self.train_step, state, batch)
        flags = sorted((_portable(n, scope["G"]), v) for n, v in recorder.modes.items())
        modes = _mode_flags(flags, scope)
        if modes is None:
            logger.warning(
                "funcamp: cache_dir: the step follows a module's training flag that cannot be "
                "read back (%s); it is compiled as usual and not saved",
                next((n for n, _ in flags if n is not None), "a module"),
            )
            return None, ()
        path = stem + _modes_tag(flags) + _SUFFIX
        try:
            if folded:
                raise RuntimeError(
                    f"the step folded the result of {folded[0]} (torch._dynamo."
                    "assume_constant_result) into its graph, which a later process cannot check"
                )
            if unchecked:
                raise RuntimeError(
                    f"the step runs code with no source file to check it against later "
                    f"({unchecked[0]}: made by exec, typed in a notebook, or from a module "
                    "not in sys.modules)"
                )
            self._save(compiled, recorder, key, path, scope, flags)
        except Exception as e:
            logger.warning(
                "funcamp: compiled the train step in %.1f s but did not save it to %s (%s)",
                elapsed,
                path,
                e,
            )
            return compiled, modes
        logger.info("funcamp: compiled the train step in %.1f s and saved it to %s", elapsed, path)
        return compiled, modes

    def _save(
        self,
        compiled: Any,
        recorder: _Recorder,
        key: Any,
        path: str,
        scope: dict[str, Any],
        modes: list[tuple[str, bool]],
    ) -> None:
        checks = []
        for traced, (kinds, seen) in sorted(recorder.dropped.items()):
            if not traced:  # torch's global state: the key and every call compare _context()
                unknown = sorted(set(kinds) - _CONTEXT_GUARDS)
                if unknown:
                    raise RuntimeError(
                        f"the step depends on torch state funcamp cannot compare ({unknown[0]})"
                    )
                continue
            name = _portable(traced, scope["G"])
            if name is None:
                continue
            params = [p for ps in kinds.values() for p in ps if p is not _NO_PARAM]
            if any(_opaque(describe_value(p)) for p in params):
                raise RuntimeError(f"a guard on {name} tests an object funcamp cannot save")
            now = _check(name, kinds, scope)
            if seen is not _NO_PARAM and now != _views(kinds, seen):
                raise RuntimeError(
                    f"the guard source {name} cannot be re-read ({_short(now)}, dynamo saw "
                    f"{_short(_views(kinds, seen))}), so a later process could not check it"
                )
            for kind, view in now if now[0] != "error" else ():
                if _opaque(view) and kind not in _OPAQUE_OK:
                    raise RuntimeError(
                        f"the step is specialised on {name} ({kind}), which holds an object "
                        "another process can only compare by its type"
                    )
            checks.append((name, kinds, now))
        for a, b in recorder.same:
            names = (_portable(a, scope["G"]), _portable(b, scope["G"]) if b else None)
            if None in names or not _same_object(*names, scope):
                raise RuntimeError(
                    f"the step is specialised on {a} being {b}, which cannot be re-read"
                )
            checks.append((names, None, _SAME))
        files = [(name, path, _file_digest(path)) for name, path in _module_files()]
        buf = io.BytesIO()
        artifact = type(compiled).serialize(compiled, self._external()).serialized_data
        pickle.dump(
            {
                "format": _FORMAT,
                "key": key,
                "checks": checks,
                "modes": modes,
                "files": files,
                "artifact": artifact,
            },
            buf,
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        os.makedirs(self.directory, exist_ok=True)
        atomic_write(path, lambda f: f.write(buf.getbuffer()))


def _modified(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _modes_tag(flags: list[tuple[str, bool]]) -> str:
    """The part of an entry's file name that tells its modules' training flags apart."""
    if not flags:
        return ""
    return "-" + hashlib.sha256(repr(flags).encode()).hexdigest()[:12]


def _mode_flags(
    flags: list[tuple[str | None, bool]], scope: dict[str, Any]
) -> tuple[tuple[Any, bool], ...] | None:
    """``(module, training flag)`` for each guard source ``<module>.training`` the step was
    specialised on, read in ``scope`` (checked on every call, as dynamo's guard would be), or
    None when one cannot be read."""
    out = []
    for name, flag in flags:
        if name is None or not name.endswith(".training"):
            return None
        ok, module = _read(name[: -len(".training")], scope)
        if not ok or not isinstance(getattr(module, "training", None), bool):
            return None
        out.append((module, flag))
    return tuple(out)


def _generated(code: types.CodeType) -> bool:
    """Code of the standard library: frozen modules (``collections.abc``: their source is
    the Python build, which is in the key) and the methods it writes with exec for a class (a
    NamedTuple's ``__new__``, a dataclass's ``__init__``/``__eq__``/...: written from the
    class's field definitions; the class is checked by name)."""
    if code.co_filename.startswith("<frozen "):  # the standard library, part of the key
        return True
    if code.co_filename != "<string>":
        return False
    if code.co_name == "<lambda>" and code.co_varnames[:1] == ("_cls",):
        return "_tuple_new" in code.co_names  # collections.namedtuple
    return getattr(code, "co_qualname", "").startswith("__create_fn__.<locals>.")


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))
_SITE = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _module_files() -> list[tuple[str, str]]:
    """The source files of the Python modules loaded now, except the standard library, torch
    (both pinned by version in the key) and ``__main__`` (checked line by line where the step
    traced it): code that runs while compiling without being traced (a kernel written in
    Python, a ``nonstrict_trace`` helper, a tensor subclass) is in one of them."""
    out = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name == "__main__" or not isinstance(path, str) or not path.endswith(".py"):
            continue
        path = os.path.abspath(path)
        if path.startswith(_TORCH_DIR + os.sep):
            continue
        if path.startswith(_STDLIB_DIR + os.sep) and not any(
            part in path[len(_STDLIB_DIR) :] for part in _SITE
        ):
            continue
        out.append((name, path))
    return sorted(out)


def _file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _changed_file(files: list[tuple[str, str, str | None]]) -> str | None:
    for name, path, digest in files:
        if _file_digest(path) != digest:
            return f"{name} ({path}) changed"
    return None


@contextlib.contextmanager
def _constant_results() -> Any:
    """Collect the functions marked ``torch._dynamo.assume_constant_result`` that the trace
    called: their results are folded into the graph and never checked again."""
    called: list[str] = []
    original = dynamo_functions.invoke_and_store_as_constant

    def record(tx: Any, fn: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        called.append(str(name))
        return original(tx, fn, name, *args, **kwargs)

    modules = [
        m
        for m in (dynamo_functions, dynamo_builtin, dynamo_nn_module)
        if hasattr(m, "invoke_and_store_as_constant")
    ]
    for m in modules:
        m.invoke_and_store_as_constant = record  # type: ignore[attr-defined]
    try:
        yield called
    finally:
        for m in modules:
            m.invoke_and_store_as_constant = original  # type: ignore[attr-defined]


@contextlib.contextmanager
def _without_source() -> Any:
    """Collect the traced code torch's source record skips (code whose module it cannot find:
    exec, notebook cells, a module not in sys.modules): such code cannot be checked later."""
    missing: list[str] = []
    if SourceInfo is None:  # pragma: no cover - other torch versions
        missing.append("this torch keeps no source record")
        yield missing
        return
    original = SourceInfo.add_code

    def add_code(self: Any, code: types.CodeType) -> None:
        if inspect.getmodule(code) is None and not _generated(code):
            missing.append(f"{code.co_qualname} in {code.co_filename}")
        original(self, code)

    SourceInfo.add_code = add_code  # type: ignore[method-assign]
    try:
        yield missing
    finally:
        SourceInfo.add_code = original  # type: ignore[method-assign]
