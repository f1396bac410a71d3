"""Describing what a compiled step depends on, so two processes can tell whether they match.

It describes values (:func:`describe_value`), the step's settings, code digests, the machine,
torch's context, the inputs' structure, and the step's key (:func:`step_key`). It also reads
dynamo's guards back: which a saved step checks on every call, and the views a guard compares.
:mod:`funcamp._core.guard_sources` reads the guard sources themselves.

Workaround of torch internals (docs/upstream.md#step-cache):

- Root cause: as for funcamp/stepcache/cache.py. Deciding whether a saved step still fits needs
  dynamo's guards, read back through private structures.
- Upstream: see docs/upstream.md#step-cache.
- Why it is safe: a guard it cannot read refuses the save. The step then compiles as usual.
- Tested on: torch 2.13 and 2.14.
- Delete when: as for funcamp/stepcache/cache.py.

"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import math
import platform
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from funcamp._core.context import transform_level
from funcamp._core.guard_sources import GLOBAL_STATE_SOURCES, STEP_INPUTS, source_root
from funcamp._core.tree import NAMESPACE
from funcamp._core.version import __version__

__all__ = [
    "cache_support",
    "describe_settings",
    "describe_value",
    "internals",
    "step_key",
]

CACHE_FORMAT = 2  # 2: entries record the training flags they follow

SUFFIX = ".funcamp-step"
#: Beside the entries: a step that cannot be saved, and why (so that later processes do not
#: precompile it only to find that out again; they compile it as usual, on torch's caches).
UNSAVED_SUFFIX = ".funcamp-unsaved"


@functools.cache
def internals(name: str) -> Any:
    """torch's module ``name``, imported when a step is first keyed, saved or loaded.

    These are dynamo's AOT precompile, its guards, and AOTAutograd's utilities. They import
    dynamo, which ``import funcamp`` does not. So this module, which the train step's guard
    filter reads, stays light. None where this torch has no such module.
    """
    try:
        return importlib.import_module(name)
    except ImportError:  # pragma: no cover - other torch versions
        return None


def cache_support() -> str | None:
    """``None`` when this torch can save and load compiled steps, else why not."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return (
            f"torch {torch.__version__} has no torch.compiler.load_compiled_function "
            "(AOT precompile)"
        )
    if internals("torch._dynamo.aot_compile") is None:  # pragma: no cover - no AOT precompile
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile"
    return None


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


def where_defined(obj: Any) -> tuple[str, str]:
    return (
        str(getattr(obj, "__module__", None)),
        str(getattr(obj, "__qualname__", getattr(obj, "__name__", None))),
    )


_PLAIN = (type(None), bool, int, str, bytes)

_DEPTH = 6  # how deep containers are described; deeper is opaque

_TORCH_PLAIN = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def describe_value(value: Any, depth: int = 0) -> tuple[Any, ...]:
    """A picklable description of ``value`` that another process can reproduce from its own object.

    * plain constants: by value (floats by their bits);
    * tensors: by type, shape, strides, dtype, device, layout and requires_grad;
    * functions: by name and code;
    * classes, modules and torch ops: by name;
    * sequences, sets and dicts: element by element.

    Anything else is *opaque* (``("o", module, class)``). Only its type can be compared across
    processes. That is enough for a guard on its type, and never enough for a guard on its
    value.
    """
    if isinstance(value, _PLAIN):
        return ("v", type(value).__name__, value)
    if isinstance(value, float):
        return ("f", type(value).__name__, "nan" if math.isnan(value) else value.hex())
    if isinstance(value, complex):
        return ("c", repr(value))
    if isinstance(value, _TORCH_PLAIN):
        return ("t", type(value).__name__, str(value))
    if isinstance(value, enum.Enum):
        return ("e", *where_defined(type(value)), value.name)
    if isinstance(value, torch.Tensor):
        try:
            stride: Any = tuple(value.stride())
        except RuntimeError:  # sparse and other layouts without strides
            stride = None
        return (
            "T",
            *where_defined(type(value)),
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
        return ("fn", *where_defined(value), _function_digest(value))
    if isinstance(value, types.CodeType):
        return ("code", getattr(value, "co_qualname", value.co_name), _code_hex(value))
    if isinstance(value, types.MethodType):
        return ("m", describe_value(value.__func__, depth), *where_defined(type(value.__self__)))
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        owner = getattr(value, "__self__", None)
        kind = (
            where_defined(owner)
            if isinstance(owner, (type, types.ModuleType))
            else where_defined(type(owner))
        )
        return ("b", str(getattr(value, "__name__", None)), *kind)
    if isinstance(value, type):
        return ("cls", *where_defined(value))
    if isinstance(value, types.ModuleType):
        return ("mod", value.__name__)
    if depth >= _DEPTH:
        return ("o", *where_defined(type(value)))
    if isinstance(value, functools.partial):
        parts = (value.func, value.args, value.keywords)
        return ("p", *(describe_value(x, depth + 1) for x in parts))
    if isinstance(value, (tuple, list)):
        return (
            "s",
            *where_defined(type(value)),
            tuple(describe_value(v, depth + 1) for v in value),
        )
    if isinstance(value, (set, frozenset)):
        items = sorted((describe_value(v, depth + 1) for v in value), key=repr)
        return ("u", *where_defined(type(value)), tuple(items))
    if isinstance(value, dict):  # by key, sorted: a dict built by iterating a set is ordered
        # differently in each process (string hashing is salted per process)
        items = sorted(
            (
                (describe_value(k, depth + 1), describe_value(v, depth + 1))
                for k, v in value.items()
            ),
            key=lambda kv: repr(kv[0]),
        )
        return ("d", *where_defined(type(value)), tuple(items))
    if isinstance(value, torch.nn.Module) and _stateless(value):
        # a module holding no tensors, submodules or hooks, only code (transformers' kernel
        # wrappers of a function, made when the model's module is imported): by its type and
        # its own attributes
        own = {k: v for k, v in vars(value).items() if k not in _MODULE_FIELDS}
        return ("nm", *where_defined(type(value)), value.training, describe_value(own, depth + 1))
    return ("o", *where_defined(type(value)))


_MODULE_FIELDS = frozenset(vars(torch.nn.Module()))


def _stateless(module: torch.nn.Module) -> bool:
    """No parameters, buffers, submodules or hooks: what it does is its class's code."""
    return not any(
        v for k, v in vars(module).items() if k in _MODULE_FIELDS and isinstance(v, dict)
    )


def _setting(value: Any) -> Any:
    if callable(value):
        return describe_value(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_setting(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((repr(k), _setting(v)) for k, v in value.items()))
    return value


def describe_settings(settings: tuple[Any, ...]) -> str:
    """The text a step's build settings enter its key as.

    ``settings`` is the policy, then ``(name, value)`` for every option that enters the key
    (:func:`funcamp.train.config.key_items`: a :class:`funcamp.Compile` as its own items). It
    enters as its ``repr``, tuples and mappings item by item (a mapping in sorted order). A
    callable among them (a ``headroom=`` filter, an inductor pass in ``options``) is described
    by :func:`describe_value` (its code and what it reads), not by its address.
    """
    return repr(_setting(tuple(settings)))


def is_opaque(desc: Any) -> bool:
    """Whether a description holds an object known only by its type."""
    if not isinstance(desc, tuple) or not desc:
        return False
    return desc[0] == "o" or any(is_opaque(x) for x in desc if isinstance(x, tuple))


def shorten(desc: Any, limit: int = 160) -> str:
    text = repr(desc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


SAME = ("same object",)


def same_object(a: str, b: str, scope: dict[str, Any]) -> bool:
    (ok_a, value_a), (ok_b, value_b) = read_source(a, scope), read_source(b, scope)
    return ok_a and ok_b and value_a is value_b


def _failure(error: BaseException) -> tuple[str, str]:
    return ("error", type(error).__name__)


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
            module, name = where_defined(v)
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
        CACHE_FORMAT,
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
        (*where_defined(loss_fn), _function_digest(loss_fn)),
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


# What torch.compiler.keep_portable_guards_unsafe keeps: with only these, torch's saved guard
# state holds no reference to the closure (its dict-key-order and global scopes are pruned), so
# another process can rebuild it.
PORTABLE = ("TENSOR_MATCH", "GLOBAL_STATE", "SHAPE_ENV")


def on_inputs(source: Any) -> bool:
    """Whether a guard source is rooted in the step's inputs or in torch's global state.

    Those are what the saved step checks on every call. Guards rooted elsewhere (closures,
    globals) cannot be rebuilt in another process from torch's saved guard state. They become
    load-time checks.
    """
    root = source_root(source)
    kind = type(root).__name__
    if kind == "LocalSource":
        return root.local_name in STEP_INPUTS
    return kind in GLOBAL_STATE_SOURCES


def input_structure(state: Any, batch: Any) -> tuple[Any, ...] | None:
    """What the saved step's tensor guards do not see, compared on every call.

    That is the inputs' treespec and their non-tensor leaves (by value). It is which tensor
    leaves are the same tensor (dynamo's duplicate-input guard). It is also the torch state a
    trace depends on: function modes, the default device, a functorch transform, saved-tensor
    hooks. None when a leaf is an object known only by its type; the step then runs uncached.
    """
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
            if is_opaque(desc):
                return None
            constants.append((i, desc))
    return spec, tuple(constants), tuple(same), _context()


def _context() -> tuple[Any, ...]:
    hooks = internals("torch._functorch._aot_autograd.utils").top_saved_tensors_hooks()
    return (
        tuple(where_defined(type(m)) for m in torch.overrides._get_current_function_mode_stack()),
        torch._C._is_torch_function_enabled(),
        str(getattr(torch.utils._device, "CURRENT_DEVICE", None)),
        transform_level(),
        None if hooks is None else tuple(describe_value(h) for h in hooks),
    )


# Guards on torch's global state that _context() stands for, or that the kept GLOBAL_STATE
# guard checks (grad mode, deterministic algorithms, FSDP's training state: no-ops of their
# own in dynamo); any other guard with no source (dynamo may add kinds) makes an entry
# unsaveable.
CONTEXT_GUARDS = frozenset(
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
OPAQUE_OK = frozenset(("DICT_VERSION",))


def _view(kind: str, param: Any, value: Any) -> tuple[Any, ...]:
    """What the guard ``kind`` (with its parameter: an attribute or a key) looks at in
    ``value``, as a description another process can compare: the type for a type guard, the
    length for a length guard, the keys for a keys guard, a membership for a contains guard,
    and the whole value (:func:`describe_value`) for a value guard (ID_MATCH, CONSTANT_MATCH,
    FUNCTION_MATCH, TENSOR_MATCH, ... and any kind not named here)."""
    if kind in _TYPE_KINDS:
        return ("type", *where_defined(type(value)))
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
    if kind in _CONTAINS_KINDS and param is not NO_PARAM:
        return ("contains", describe_value(param), param in value)
    return describe_value(value)


NO_PARAM = object()


def guard_views(kinds: dict[str, list[Any]], value: Any) -> tuple[Any, ...]:
    out = []
    for kind, params in sorted(kinds.items()):
        for param in params:
            try:
                out.append((kind, _view(kind, param, value)))
            except Exception as e:
                out.append((kind, _failure(e)))
    return tuple(out)


@functools.cache
def _source_helpers() -> dict[str, Any]:
    """The helper functions dynamo's guard source names call (``___odict_getitem``, ...)."""
    try:
        closure_vars = getattr(internals("torch._dynamo.guards"), "_get_closure_vars", None)
        helpers = dict(closure_vars()) if closure_vars is not None else {}
    except AttributeError:  # pragma: no cover - other torch versions
        helpers = {}
    helpers["__load_module"] = importlib.import_module
    return helpers


@functools.lru_cache(maxsize=4096)
def _source_code(name: str) -> types.CodeType:
    return compile(name, "<guard source>", "eval")


def read_source(name: str, scope: dict[str, Any]) -> tuple[bool, Any]:
    """``(True, value)`` of a guard source in ``scope``, or ``(False, the exception)``.

    It is read on every call of a cached step (its specialisation checks), so the name is
    compiled once.
    """
    try:
        return True, eval(_source_code(name), scope, dict(_source_helpers()))
    except Exception as e:
        return False, e


def check_source(name: str, kinds: dict[str, Any], scope: dict[str, Any]) -> tuple[Any, ...]:
    ok, value = read_source(name, scope)
    return guard_views(kinds, value) if ok else ("error", type(value).__name__)


def same_param(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a tensor key, say
        return False


def first_change(checks: list[Any], scope: dict[str, Any]) -> str | None:
    """The first of an entry's specialisation checks that no longer holds in ``scope``."""
    for name, kinds, expected in checks:
        if expected == SAME:
            if not same_object(*name, scope):
                return f"{name[0]} is no longer {name[1]}"
            continue
        now = check_source(name, kinds, scope)
        if now != expected:
            return f"{name} is {shorten(now)}, was {shorten(expected)}"
    return None
