"""A compiled train step kept on disk: ``funcamp.Compile(cache_dir=...)``.

torch's compile caches skip code generation in a second process, but dynamo still traces the
whole step, most of a warm start. This module also saves dynamo's output with torch's AOT
precompile (``aot_compile``, ``load_compiled_function``): a later process traces nothing.

A saved step must never run where it no longer fits. Dynamo specialises the graph on what the
step reads besides its inputs (the model's attributes, closure constants, globals, the code),
which neither a funcamp step nor the loaded one re-checks on every call. So each entry carries:

- a *key*: funcamp, torch and Python versions, the machine, the compile options and the torch
  compiler configs, the step's options, the loss function's code, and the inputs' structure,
  shapes, strides, dtypes and devices (one file per key: new input shapes add an entry).
- torch's record of every function the trace inlined, with a checksum of its source lines.
- *specialisation checks*: every guard dynamo made on anything but the inputs' tensors, re-read
  from the new process's objects and compared as the guard compares (a guard on an object known
  only by its type, or on unmodelled torch state, refuses the save).

A mismatch or a failed load compiles the step afresh and replaces the entry. Entries are
pickles, as torch's own artifacts are: load only cache directories you trust.

Workaround of torch internals (docs/upstream.md#step-cache):

- Root cause: AOT precompile re-checks nothing besides a loaded step's inputs.
- Upstream: none filed; the write-up is docs/upstream.md#step-cache.
- Why it is safe: the checks above re-check the rest; one that cannot be read refuses the save.
- Tested on: torch 2.13 and 2.14 (CPU).
- Delete when: torch.compile ships a guard-checked cache of whole compiled functions.
"""

from __future__ import annotations

import builtins
import contextlib
import glob
import hashlib
import importlib
import inspect
import io
import linecache
import os
import pickle
import re
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.variables import builtin as dynamo_builtin
from torch._dynamo.variables import functions as dynamo_functions
from torch._dynamo.variables import nn_module as dynamo_nn_module
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
from funcamp._core.context import in_transform, transform_while_tracing
from funcamp._core.guard_sources import is_mode_flag
from funcamp._core.progress import COMPILING, logger
from funcamp.stepcache.files import (
    changed_file,
    file_digest,
    modified,
    module_files,
    note_unsaved,
    unsaved_reason,
)
from funcamp.stepcache.key import (
    CACHE_FORMAT,
    CONTEXT_GUARDS,
    NO_PARAM,
    OPAQUE_OK,
    PORTABLE,
    SAME,
    SUFFIX,
    UNSAVED_SUFFIX,
    check_source,
    describe_value,
    first_change,
    guard_views,
    input_structure,
    is_opaque,
    on_inputs,
    read_source,
    same_object,
    same_param,
    shorten,
    step_key,
    where_defined,
)

__all__ = ["CachedStep"]


class _Recorder:
    """The saved step's guard filter: it keeps what the step can check on every call in
    another process (torch's portable guards -- tensor metadata, global state, shapes -- on
    the inputs) and records every other guard, by source, as a check for load time."""

    def __init__(self) -> None:
        # source name -> ({guard kind: [its attributes or keys]}, the value dynamo saw or
        # NO_PARAM): one dict may be guarded to contain several keys
        self.dropped: dict[str, tuple[dict[str, list[Any]], Any]] = {}
        self.same: list[tuple[str, str | None]] = []  # DUPLICATE_INPUT: two sources, one object
        self.modes: dict[str, bool] = {}  # source of a module's `training` flag -> its value

    def __call__(self, entries: list[Any]) -> list[bool]:
        out = []
        for entry in entries:
            ok = (
                entry.guard_type in PORTABLE
                and not entry.is_global
                and on_inputs(entry.orig_guard.originating_source)
            )
            if not ok:
                name = entry.orig_guard.originating_source.name
                seen = entry.value if entry.has_value else NO_PARAM
                if is_mode_flag(entry.orig_guard.originating_source) and isinstance(seen, bool):
                    self.modes[name] = seen
                kinds, _ = self.dropped.setdefault(name, ({}, seen))
                keywords = getattr(entry.orig_guard.create_fn, "keywords", None) or {}
                param = keywords.get("attr", keywords.get("key", NO_PARAM))
                params = kinds.setdefault(entry.guard_type, [])
                if not any(same_param(p, param) for p in params):
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
    """``train_step`` compiled once per input signature and kept in ``directory``.

    A matching, still valid entry is loaded, with no trace. Anything else is compiled with
    torch's AOT precompile and saved. Dispatch between entries is by the inputs' structure and
    their tensor guards. ``fallback`` (the step compiled as usual) takes over past torch's
    recompile limit, and for inputs holding objects known only by their type.
    """

    def __init__(
        self,
        train_step: Callable[..., Any],
        compile_with: Callable[[Callable[[list[Any]], list[bool]]], Any],
        fallback: Callable[..., Any],
        directory: str,
        loss_fn: Callable[..., Any],
        settings: str,
        options: dict[str, Any],
        *,
        specialize: bool = False,
    ) -> None:
        self.train_step = train_step
        self.compile_with = compile_with  # guard filter -> torch.compile(train_step, ...)
        self.fallback = fallback
        self.directory = directory
        self.loss_fn = loss_fn
        self.settings = settings
        self.options = options
        self.specialize = specialize
        # [structure, compiled, proven, modes, checks]: the saved guards check the input
        # tensors (shape, strides, dtype, device) in C++; the structure is compared here. A
        # loaded entry is proven by its first call. Unless the step is specialised, the
        # entry's specialisation checks (what dynamo guarded besides the inputs: closures,
        # globals, module attributes) are compared on every call too, as dynamo's guards would
        # be, so a value that changed compiles the step again instead of going unseen.
        self.entries: list[list[Any]] = []
        self.broken = False
        self.said_uncached = False

    def _external(self) -> dict[str, Any]:
        code = self.train_step.__code__
        cells = self.train_step.__closure__ or ()
        return {f"closure:{n}": c.cell_contents for n, c in zip(code.co_freevars, cells)}

    def __call__(self, state: Any, batch: Any) -> Any:
        if in_transform():  # saved steps are traced outside torch.func transforms
            return self.fallback(state, batch)
        structure = input_structure(state, batch)
        if structure is None:
            if not self.said_uncached:
                self.said_uncached = True
                logger.warning(
                    "funcamp: cache_dir: the state or batch holds an object other than tensors "
                    "and plain constants; a saved step could only compare its type, so this "
                    "step compiles as usual (unsaved) for such inputs"
                )
            return self.fallback(state, batch)
        changed = None
        for entry in self.entries:
            if (
                entry[0] == structure
                and all(m.training is flag for m, flag in entry[3])
                and entry[1].guard_check(state, batch)
            ):
                changed = None if self.specialize else self._changed(entry, state, batch)
                if changed is None:
                    return self._run(entry, state, batch)
        if changed is not None:
            logger.info("funcamp: the train step compiles again: %s", changed)
        if self.broken or len(self.entries) >= torch._dynamo.config.recompile_limit:
            return self.fallback(state, batch)
        compiled, modes, checks, loaded = self._load_or_compile(state, batch)
        if compiled is not None and checks is None and not self.specialize:
            # compiled but not saved: what it is specialised on was not all recorded, so it
            # could not be checked on every call; the step compiled as usual can
            logger.info(
                "funcamp: cache_dir: the unsaved step is compiled again as usual, with its "
                "guards (specialize=True would keep this one)"
            )
            compiled = None
        if compiled is None:
            self.broken = True
            return self.fallback(state, batch)
        entry = [structure, compiled, not loaded, modes, checks]
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
            compiled, modes, checks = self._compile(*self._key_and_stem(state, batch), state, batch)
            if compiled is None or (checks is None and not self.specialize):
                self.broken = True
                return self.fallback(state, batch)
            entry = [entry[0], compiled, True, modes, checks]
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
        name = "".join(c if c.isalnum() else "_" for c in where_defined(self.loss_fn)[1])[:40]
        return key, os.path.join(self.directory, f"{name}-{digest}")

    def _changed(self, entry: list[Any], state: Any, batch: Any) -> str | None:
        """What changed among the things the entry's step is specialised on, or None."""
        return first_change(entry[4], _scope(entry[1], self.train_step, state, batch))

    def _load_or_compile(self, state: Any, batch: Any) -> tuple[Any, Any, Any, bool]:
        key, stem = self._key_and_stem(state, batch)
        paths = glob.glob(glob.escape(stem) + "*" + SUFFIX)
        for path in sorted(paths, key=modified, reverse=True):
            start = time.perf_counter()
            compiled, modes, checks, why = self._load(path, key, state, batch)
            if compiled is not None:
                logger.info(
                    "funcamp: loaded the compiled train step from %s in %.1f s (no trace)",
                    path,
                    time.perf_counter() - start,
                )
                return compiled, modes, checks, True
            logger.info("funcamp: not using the cached train step %s: %s", path, why)
        unsaved = unsaved_reason(stem)
        if unsaved is not None:
            # torch's precompile misses its own compile caches: an unsaveable step compiled
            # that way again would cost a whole cold compile in every process.
            logger.info(
                "funcamp: cache_dir: compiling this step as usual, not saved: an earlier process "
                "found that it cannot be saved (%s; delete %s to try again)",
                unsaved,
                stem + UNSAVED_SUFFIX,
            )
            return None, (), None, False
        return (*self._compile(key, stem, state, batch), False)

    def _load(self, path: str, key: Any, state: Any, batch: Any) -> tuple[Any, Any, Any, str]:
        """``(compiled, its mode flags, its checks, "")`` of a saved entry that still fits, else
        ``(None, (), None, why not)``."""
        try:
            with open(path, "rb") as f:
                record = pickle.load(f)
            if not isinstance(record, dict) or record.get("format") != CACHE_FORMAT:
                return None, (), None, "written by another funcamp version"
            if record["key"] != key:
                return None, (), None, "its key differs (a hash collision or an edited file)"
            changed = changed_file(record["files"])
            if changed is not None:
                return None, (), None, changed
            with _guard_loading():
                compiled = torch.compiler.load_compiled_function(
                    io.BytesIO(record["artifact"]),
                    f_globals=self.train_step.__globals__,
                    external_data=self._external(),
                )
        except Exception as e:
            return None, (), None, f"it cannot be read ({type(e).__name__}: {e})"
        changed = _source_changes(compiled)
        if changed is not None:
            return None, (), None, changed
        scope = _scope(compiled, self.train_step, state, batch)
        changed = first_change(record["checks"], scope)
        if changed is not None:
            return None, (), None, changed
        if not compiled.guard_check(state, batch):
            return None, (), None, "its guards reject this state and batch"
        modes = _mode_flags(record["modes"], scope)
        if modes is None:
            return None, (), None, "a module whose training flag it follows cannot be read"
        return compiled, modes, record["checks"], ""

    def _compile(self, key: Any, stem: str, state: Any, batch: Any) -> tuple[Any, Any, Any]:
        """``(compiled, its mode flags, its checks)``, saved under ``stem`` when it can be (the
        checks are None when it was not); ``(None, (), None)`` when torch cannot precompile
        the step."""
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
            note_unsaved(stem, f"torch could not precompile it: {type(e).__name__}: {e}")
            return None, (), None
        elapsed = time.perf_counter() - start
        scope = _scope(compiled, self.train_step, state, batch)
        flags = sorted((_portable(n, scope["G"]), v) for n, v in recorder.modes.items())
        modes = _mode_flags(flags, scope)
        if modes is None:
            module = next((n for n, _ in flags if n is not None), "a module")
            logger.warning(
                "funcamp: cache_dir: the step follows a module's training flag that cannot be "
                "read back (%s); it is compiled as usual and not saved",
                module,
            )
            note_unsaved(stem, f"it follows a training flag that cannot be read back ({module})")
            return None, (), None
        path = stem + _modes_tag(flags) + SUFFIX
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
            checks = self._save(compiled, recorder, key, path, scope, flags)
        except Exception as e:
            logger.warning(
                "funcamp: compiled the train step in %.1f s but did not save it to %s (%s)",
                elapsed,
                path,
                e,
            )
            note_unsaved(stem, str(e))
            return compiled, modes, None
        with contextlib.suppress(OSError):  # saved after all (another mode, an edit undone)
            os.remove(stem + UNSAVED_SUFFIX)
        logger.info("funcamp: compiled the train step in %.1f s and saved it to %s", elapsed, path)
        return compiled, modes, checks

    def _save(
        self,
        compiled: Any,
        recorder: _Recorder,
        key: Any,
        path: str,
        scope: dict[str, Any],
        modes: list[tuple[str, bool]],
    ) -> list[Any]:
        """Save the entry to ``path``; returns its specialisation checks."""
        checks = []
        for traced, (kinds, seen) in sorted(recorder.dropped.items()):
            if not traced:  # torch's global state: the key and every call compare _context()
                unknown = sorted(set(kinds) - CONTEXT_GUARDS)
                if unknown:
                    raise RuntimeError(
                        f"the step depends on torch state funcamp cannot compare ({unknown[0]})"
                    )
                continue
            name = _portable(traced, scope["G"])
            if name is None:
                continue
            params = [p for ps in kinds.values() for p in ps if p is not NO_PARAM]
            if any(is_opaque(describe_value(p)) for p in params):
                raise RuntimeError(f"a guard on {name} tests an object funcamp cannot save")
            now = check_source(name, kinds, scope)
            if seen is not NO_PARAM and now != guard_views(kinds, seen):
                raise RuntimeError(
                    f"the guard source {name} cannot be re-read ({shorten(now)}, dynamo saw "
                    f"{shorten(guard_views(kinds, seen))}), so a later process could not check it"
                )
            for kind, view in now if now[0] != "error" else ():
                if is_opaque(view) and kind not in OPAQUE_OK:
                    raise RuntimeError(
                        f"the step is specialised on {name} ({kind}), which holds an object "
                        "another process can only compare by its type"
                    )
            checks.append((name, kinds, now))
        for a, b in recorder.same:
            names = (_portable(a, scope["G"]), _portable(b, scope["G"]) if b else None)
            if None in names or not same_object(*names, scope):
                raise RuntimeError(
                    f"the step is specialised on {a} being {b}, which cannot be re-read"
                )
            checks.append((names, None, SAME))
        files = [(name, path, file_digest(path)) for name, path in module_files()]
        buf = io.BytesIO()
        artifact = type(compiled).serialize(compiled, self._external()).serialized_data
        pickle.dump(
            {
                "format": CACHE_FORMAT,
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
        return checks


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
        ok, module = read_source(name[: -len(".training")], scope)
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


@contextlib.contextmanager
def _constant_results() -> Any:
    """Collect the functions marked ``torch._dynamo.assume_constant_result`` that the trace
    called: their results are folded into the graph and never checked again. funcamp's own
    question whether a ``torch.func`` transform is active (``plain_tensors``) is not collected:
    a saved step is only run outside transforms (:meth:`CachedStep.__call__`)."""
    called: list[str] = []
    original = dynamo_functions.invoke_and_store_as_constant

    def record(tx: Any, fn: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if fn is not transform_while_tracing:
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
