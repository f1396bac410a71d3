"""Compiling a step, the funcamp way, and the one wrapper every train step runs in.

:func:`compile_fn` is ``torch.compile(fullgraph=True)``, with every guard dynamo makes (a
value the loss reads from a closure, a global or a module attribute that changes recompiles the
step, as ``torch.compile`` does) or, with ``specialize=True``, only the guards on the step's
inputs and on modules' ``training`` flags (the step is then specialised on everything else it
closes over, as with ``jax.jit``). :func:`run_compiled` calls a compiled
function and turns a dynamo failure into one paragraph (:mod:`funcamp.train.errors`), or switches a step
whose model ``torch.func`` refuses to gradients from ``torch.autograd`` in the same graph.
:func:`wrap_step` is the wrapper of the train step -- one process, data parallel or sharded: the
first-call and per-call checks, the parallel piece's view of the state, the compile notice and
the on-disk cache (``cache_dir``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.progress import announce_first_call
from funcamp._core.tree import NAMESPACE, describe
from funcamp.compiler import hooks as compiler_hooks
from funcamp.compiler.gate import Choice, decide
from funcamp.scaling.state import ScalerState
from funcamp.train.cache import CachedStep
from funcamp.train.describe import (
    GLOBAL_STATE_SOURCES,
    STEP_INPUTS,
    cache_support,
    describe_value,
    is_mode_flag,
    source_root,
)
from funcamp.train.errors import explain
from funcamp.train.loss import Engine, clone_buffers
from funcamp.train.parallel import Parallel
from funcamp.train.state import TrainState, check_donation, check_train_state

__all__ = ["check_cache_dir", "compile_fn", "fresh_code", "run_compiled", "wrap_step"]

PyTree = Any


def input_guards_only(entries: list[Any]) -> list[bool]:
    """The guard filter of ``specialize=True``: keep the guards on the step's inputs (``state``, ``batch``), on
    tensors anywhere, on global torch state (grad mode, default device, ...) and on modules'
    ``training`` flags (so the step follows ``train()``/``eval()``); drop those on closures,
    globals and captured modules, which the step is specialised on (as with ``jax.jit``). A
    guard whose origin cannot be read is kept."""
    keep = []
    for entry in entries:
        try:
            source = entry.orig_guard.originating_source
            if is_mode_flag(source):
                keep.append(True)
                continue
            root = source_root(source)
            kind = type(root).__name__
            if kind == "LocalSource":
                keep.append(root.local_name in STEP_INPUTS)
            else:
                keep.append(entry.guard_type == "TENSOR_MATCH" or kind in GLOBAL_STATE_SOURCES)
        except AttributeError:
            keep.append(True)
    return keep


_STEP_IDS = itertools.count()


def fresh_code(code: types.CodeType) -> types.CodeType:
    suffix = f"_{next(_STEP_IDS)}"
    name = code.co_name + suffix
    if sys.version_info >= (3, 11):
        return code.replace(co_name=name, co_qualname=code.co_qualname + suffix)
    return code.replace(co_name=name)  # pragma: no cover - Python 3.10


#: Inductor options a train step compiled for the CPU gets unless the caller sets them. The
#: search for fusions that reordering a node's loops would allow ("loop ordering after fusion")
#: tries the step's update nodes against the backward's, whose gradients arrive in other loop
#: orders; on the CPU it found nothing to fuse in the real-model suite (the same output code on
#: all nine models, docs/benchmarks.md) and cost up to 2.6 s of a 26-97 s first call.
#: With funcamp's compiler patches on (:mod:`funcamp.compiler`), a CPU step also gets
#: :class:`~funcamp.compiler.layouts.ChannelsLastConvBackward` as ``post_grad_custom_post_pass``
#: (:func:`funcamp.compiler.hooks.inductor_options`).
CPU_STEP_OPTIONS = {"loop_ordering_after_fusion": False}


def step_options_for(device_type: str | None, backend: Any) -> dict[str, Any]:
    """The inductor options funcamp adds for a step on ``device_type`` (see
    :data:`CPU_STEP_OPTIONS`); none for another backend or an option this torch lacks."""
    if backend != "inductor" or device_type != "cpu":
        return {}
    config = torch._inductor.config
    return {k: v for k, v in CPU_STEP_OPTIONS.items() if hasattr(config, k)}


def state_device_type(state: TrainState) -> str:
    """The device type of the first tensor among the params ("cpu" when there is none)."""
    return first_device_type(state.params)


def first_device_type(tree: PyTree) -> str:
    """The device type of the first tensor in ``tree`` ("cpu" when there is none)."""
    for x in optree.tree_leaves(tree, namespace=NAMESPACE):
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cpu"


class Patches(NamedTuple):
    """funcamp's compiler patches for one compiled step: whether inductor's are ``on`` (see
    :func:`patches_for`) and the caller's ``choice`` (which the dynamo routing of in-graph
    ``CrossEntropyLoss`` follows, on every backend)."""

    on: bool = False
    choice: Choice = "auto"


NO_PATCHES = Patches()


def patches_for(choice: Choice, device_type: str, options: dict[str, Any]) -> Patches:
    """funcamp's compiler patches for a step on ``device_type`` compiled with ``options``:
    inductor's are on as :func:`funcamp.compiler.decide` says (off for another backend)."""
    inductor = options.get("backend", "inductor") == "inductor"
    return Patches(inductor and decide(choice, device_type), choice)


def compile_fn(
    fn: Callable[..., Any],
    options: dict[str, Any],
    device_type: str | None = None,
    *,
    specialize: bool = False,
    patches: bool = False,
) -> Callable[..., Any]:
    """``torch.compile(fn, fullgraph=True, ...)``, with :func:`input_guards_only` as the guard
    filter when ``specialize`` (and the caller gives none); ``device_type`` (the step's device,
    when known) adds :func:`step_options_for` under the caller's options, and ``patches`` (on
    for this compile: :func:`patches_for`) the compiler patches' inductor options
    (:func:`funcamp.compiler.hooks.inductor_options`)."""
    opts = dict(options)
    backend = opts.pop("backend", "inductor")
    mode = opts.pop("mode", None)
    inner = dict(opts.pop("options", None) or {})
    fullgraph = opts.pop("fullgraph", True)
    if "guard_filter_fn" in opts:
        inner["guard_filter_fn"] = opts.pop("guard_filter_fn")
    if specialize:
        inner.setdefault("guard_filter_fn", input_guards_only)
    if inner.get("guard_filter_fn", 0) is None:
        del inner["guard_filter_fn"]
    if mode is not None:
        # torch.compile takes `mode` or `options`, not both: spell the mode out as options.
        if backend == "inductor":
            inner = {**torch._inductor.list_mode_options(mode), **inner}
            mode = None
        elif inner:
            # other backends ignore inductor options; only the guard filter matters.
            pass
    if mode is not None and inner:
        inner = {}
    # a mode is left only for another backend, which gets no inductor options
    patched = compiler_hooks.inductor_options(patches and backend == "inductor", device_type, inner)
    inner = {**step_options_for(device_type, backend), **patched, **inner}
    if "post_grad_custom_pre_pass" in patched:  # the patches' cache key, around the caller's
        inner["post_grad_custom_pre_pass"] = patched["post_grad_custom_pre_pass"]
    return torch.compile(
        fn, fullgraph=fullgraph, backend=backend, mode=mode, options=inner or None, **opts
    )


_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


def _drop(record: logging.LogRecord) -> bool:
    return False


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Any:
    """Hold back what ``logger`` itself logs. A filter, not ``setLevel``: this runs on every
    call of a compiled step, and each ``setLevel`` clears the level cache of every logger
    (~0.2 ms with torch's loggers)."""
    logger.addFilter(_drop)
    try:
        yield
    finally:
        logger.removeFilter(_drop)


def describe_option(value: Any) -> Any:
    return describe_value(value) if callable(value) else value


def check_specialize(
    api: str, specialize: bool, compile: bool, compile_options: dict[str, Any]
) -> None:
    """``specialize=True`` chooses the guards of a compiled step: not without compiling, and
    not together with a guard filter of the caller's."""
    if not specialize:
        return
    if not compile:
        raise ValueError(
            f"funcamp.{api}: specialize=True fixes what a compiled step reads besides its "
            "inputs at its first call, but compile=False builds an eager step, which reads them "
            "on every call; drop `specialize` or compile the step"
        )
    inner = compile_options.get("options") or {}
    if "guard_filter_fn" in compile_options or "guard_filter_fn" in inner:
        raise ValueError(
            f"funcamp.{api}: give `specialize=True` or a `guard_filter_fn`, not both: both "
            "choose which of dynamo's guards the step keeps"
        )


def check_cache_dir(
    api: str, cache_dir: Any, compile: bool, compile_options: dict[str, Any]
) -> str | None:
    """``cache_dir`` as a path, or None when unset (or when this torch cannot save steps:
    a warning says so and the step compiles as usual)."""
    if cache_dir is None:
        return None
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(
            f"funcamp.{api}: `cache_dir` must be a directory path (str or os.PathLike) or "
            f"None, got {describe(cache_dir)}"
        )
    path = os.fspath(cache_dir)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"funcamp.{api}: `cache_dir` must be a directory, but {path!r} is a file; give "
            "a directory (it is created if missing)"
        )
    if not compile:
        raise ValueError(
            f"funcamp.{api}: `cache_dir` keeps the compiled step on disk, but compile=False "
            "builds an eager step; drop `cache_dir` or compile the step"
        )
    if compile_options.get("fullgraph", True) is False:
        raise ValueError(
            f"funcamp.{api}: `cache_dir` saves the step as one compiled graph; a step "
            "compiled in pieces (fullgraph=False) cannot be saved: drop one of the two"
        )
    options = compile_options
    if "guard_filter_fn" in options or "guard_filter_fn" in (options.get("options") or {}):
        raise ValueError(
            f"funcamp.{api}: `cache_dir` and `guard_filter_fn` do not go together: a saved "
            "step checks its inputs' tensors on every call and everything else it depends on "
            "when it is loaded, whatever a guard filter would keep; drop one of the two"
        )
    if not isinstance(options.get("backend", "inductor"), str):
        raise ValueError(
            f"funcamp.{api}: `cache_dir` needs the compile backend by name (such as "
            f"'inductor' or 'aot_eager'), got {describe(options['backend'])}: a backend object "
            "cannot be told apart from another across processes"
        )
    why = cache_support()
    if why is not None:
        warnings.warn(
            f"funcamp.{api}: `cache_dir` is ignored: {why}; the step compiles as usual "
            "(torch's compile caches still apply)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return path


# The states donated to train steps (their tensors now hold newer states), known by their
# scaler state objects: handed to a train step again, they are refused, as JAX refuses a
# donated buffer, after any number of steps. The returned state shares the donated one's
# tensors (written in place) and even its containers, but its ScalerState is always a new
# object (TrainState.create gives each state its own), and a ScalerState can be weakly
# referenced: the set holds no state alive, and costs nothing once the old state is gone.
_DONATED: weakref.WeakSet[ScalerState] = weakref.WeakSet()


def check_not_donated(api: str, state: TrainState) -> None:
    """Refuse a state an earlier call donated (``donate_state=True``, the default)."""
    try:
        donated = state.scaler in _DONATED
    except TypeError:  # not a ScalerState (refused by the state checks that follow)
        donated = False
    if donated:
        raise ValueError(
            f"funcamp.{api}: `state` was donated to an earlier train step: its tensors now "
            "hold the state that call returned. Keep only the returned state "
            "(`state, metrics = step(state, batch)`), or build the step with "
            "donate_state=False to keep the input state unchanged"
        )


_HOOKS = torch._C._autograd
_UNKNOWN = object()


def _saved_tensors_hooks_state() -> Any:
    """Whether saved-tensor hooks are allowed on this thread (None) or the message that
    refuses them; ``_UNKNOWN`` on a torch without the accessor."""
    get = getattr(_HOOKS, "_saved_tensors_hooks_get_disabled_error_message", None)
    return _UNKNOWN if get is None else get()


def _restore_saved_tensors_hooks(state: Any) -> None:
    """Put back what a failed compile left behind. A trace that fails inside a ``torch.func``
    transform (activation checkpointing under ``torch.func.grad``: torch 2.13 CPU, measured)
    leaves saved-tensor hooks disabled on the thread, so every later eager checkpoint fails
    with torch.func's message, although no transform is active."""
    if state is _UNKNOWN or _saved_tensors_hooks_state() == state:
        return
    if state is None:
        _HOOKS._saved_tensors_hooks_enable()
    else:
        _HOOKS._saved_tensors_hooks_disable(state)


def _tracing_config() -> Any:
    """dynamo's own settings while it traces a step (``torch._dynamo.config``, scoped to it):

    * ``ignore_logging_functions``: the ``logging.Logger`` methods that log a message once
      (transformers adds ``warning_once``, ``info_once``, ``warning_advice``; a checkpointed
      layer warns with one that it sets ``use_cache=False``) are left out of the graph instead
      of breaking it; the model's values do not depend on them;
    * ``skip_fwd_side_effects_in_bwd_under_checkpoint``: a Python side effect in a
      checkpointed region (transformers' output collector) is applied once, in the forward,
      as a step without checkpointing applies it; eager checkpointing replays it in the
      backward, which dynamo otherwise refuses to trace."""
    config = torch._dynamo.config
    changes: dict[str, Any] = {}
    once = {
        f
        for name in ("warning_once", "info_once", "warning_advice")
        if (f := getattr(logging.Logger, name, None)) is not None
    }
    if once and hasattr(config, "ignore_logging_functions"):
        changes["ignore_logging_functions"] = set(config.ignore_logging_functions) | once
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        changes["skip_fwd_side_effects_in_bwd_under_checkpoint"] = True
    return config.patch(**changes) if changes else contextlib.nullcontext()


def run_compiled(
    api: str,
    run: Callable[..., Any],
    args: tuple[Any, ...],
    eagerly: Callable[[], Any],
    engine: Engine | None = None,
    first: bool = False,
    patches: Patches = NO_PATCHES,
) -> Any:
    """``run(*args)`` (a compiled function), with a dynamo failure explained: a model torch.func
    refuses is traced again with torch.autograd (``engine``); otherwise ``eagerly()`` re-runs the
    same computation with compilation off, so an error of the model itself is raised plainly.
    On the ``first`` call the trace is tried once more after that eager run: a model may set
    itself up on its first call in a way dynamo cannot trace (transformers installs the hooks
    that record a model's outputs -- Mixtral's router logits -- under a lock), and then
    compiles. A failure only the compiler has becomes one paragraph naming the way out.
    ``patches``: funcamp's compiler patches are on for this compile
    (:func:`funcamp.compiler.hooks.running`)."""
    tracing = engine.tracing() if engine is not None else contextlib.nullcontext()
    hooks = _saved_tensors_hooks_state()
    try:
        # A failing op on fake tensors is logged at ERROR with its whole stack before dynamo
        # raises; the eager re-run gives the plain error, so that log is held back.
        with _quiet(_FAKE_TENSOR_LOG), tracing, compiler_hooks.running(*patches), _tracing_config():
            return run(*args)
    except torch._dynamo.exc.TorchDynamoException as e:
        _restore_saved_tensors_hooks(hooks)
        if engine is not None and engine.switch(e):
            return run_compiled(api, run, args, eagerly, engine, first, patches)

        def rerun() -> None:
            with torch.compiler.set_stance("force_eager"):
                try:
                    eagerly()
                except Exception as refusal:
                    # dynamo failed before reaching what torch.func refuses (transformers'
                    # one-time warning ahead of a checkpointed layer): the eager run says it
                    if engine is None or not engine.switch(refusal):
                        raise
                    _restore_saved_tensors_hooks(hooks)
                    eagerly()

        failure = explain(api, e, rerun)  # raises the model's own error, if it has one
        if first:
            try:
                return run_compiled(api, run, args, eagerly, engine, patches=patches)
            except RuntimeError as again:
                if again.__cause__ is None:  # not the paragraph: raise it as it came
                    raise
        raise failure from e


def wrap_step(
    api: str,
    train_step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]],
    *,
    optimizer: Any,
    parallel: Parallel,
    engine: Engine,
    compile: bool,
    compile_options: dict[str, Any],
    donate_state: bool,
    specialize: bool = False,
    cache: tuple[str, Callable[..., Any], str] | None = None,
    compiler_patches: Choice = "auto",
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """``step(state, batch)``: ``train_step`` compiled (or eager), as every funcamp train step
    runs -- one process, data parallel or sharded alike.

    On every call: ``state`` must be a :class:`TrainState`; the parallel piece gives the state
    the compiled step works on (and takes the new one back); the batch keeps the first batch's
    structure; a donated state shares no memory. On the first call the optimizer state is
    checked against the params. ``specialize``: keep only the guards on the inputs
    (:func:`input_guards_only`). ``cache``, ``(directory, loss_fn, settings)``, keeps the
    compiled step on disk (:class:`funcamp.train.cache.CachedStep`). ``compiler_patches``:
    ``make_train_step``'s choice of funcamp's compiler patches (:func:`patches_for`)."""
    train_step.__code__ = fresh_code(train_step.__code__)
    patched: list[Patches] = []

    def compiled_for(device_type: str) -> Callable[..., Any]:
        # Built on the first call, when the state's device is known (see step_options_for).
        on = patches_for(compiler_patches, device_type, compile_options)
        patched.append(on)
        compiled = announce_first_call(
            compile_fn(
                train_step, compile_options, device_type, specialize=specialize, patches=on.on
            )
        )
        if cache is None:
            return compiled
        directory, loss_fn, settings = cache
        return CachedStep(
            train_step,
            lambda keep: compile_fn(
                train_step, {**compile_options, "guard_filter_fn": keep}, device_type, patches=on.on
            ),
            compiled,
            directory,
            loss_fn,
            settings,
            compile_options,  # the device's options are in the key already: its tensors' device
            specialize=specialize,
        )

    runs: list[Callable[..., Any]] = []
    expected: list[Any] = []

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"funcamp.{api}: `state` must be a funcamp.TrainState (see "
                f"TrainState.create), got {describe(state)}"
            )
        check_not_donated(api, state)
        local = parallel.local(api, state)
        structure = optree.tree_structure(batch, namespace=NAMESPACE)
        if not expected:
            check_train_state(api, local, optimizer)
            expected.append(structure)
        elif structure != expected[0]:
            raise ValueError(
                f"funcamp.{api}: `batch` must keep the structure of the first batch "
                f"{expected[0]}, got {structure}; build another step for batches of another "
                "structure (new shapes or dtypes only recompile)"
            )
        if donate_state:
            check_donation(api, local)
        if not compile:
            new, metrics = train_step(local, batch)
        else:
            if not runs:
                runs.append(compiled_for(state_device_type(local)))
            run = runs[0]
            # A failed trace re-runs the step eagerly, only for the error message: a donated
            # state on copies (made then: a failed trace wrote nothing, and copying the whole
            # state on every call cost 0.5 ms of a 3 ms step).
            new, metrics = run_compiled(
                api,
                run,
                (local, batch),
                lambda: train_step(clone_buffers(local) if donate_state else local, batch),
                engine,
                first=len(expected) == 1,
                patches=patched[0],
            )
            if len(expected) == 1:  # the first compiled call: free what its trace still holds
                expected.append("compiled")
                gc.collect()
        if donate_state:
            _DONATED.add(state.scaler)
        return parallel.wrap(new._replace(frozen=local.frozen)), metrics

    step.train_step = train_step  # type: ignore[attr-defined]
    return step
