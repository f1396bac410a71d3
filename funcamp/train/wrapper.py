"""The one wrapper every train step runs in, and the checks of its options and calls.

:func:`wrap_step` wraps the train step -- one process, data parallel or sharded alike: the
first-call and per-call checks, the parallel piece's view of the state, the compile notice, the
compiled (or eager) call through :func:`funcamp.train.compiling.run_compiled` and the on-disk
step cache (``cache_dir``: :mod:`funcamp.stepcache`, imported only when a step is built with
it: it imports dynamo's internals, which ``import funcamp`` does not). A donated state is recorded here (:func:`check_not_donated` refuses it when it comes
back), as are the checks of ``specialize`` and ``cache_dir`` that ``make_train_step`` and
``make_eval_step`` share.
"""

from __future__ import annotations

import gc
import importlib
import os
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import optree

from funcamp._core.progress import announce_first_call
from funcamp._core.tree import NAMESPACE, describe
from funcamp.compiler.gate import Choice
from funcamp.scaling.state import ScalerState
from funcamp.train.compiling import (
    Patches,
    compile_fn,
    fresh_code,
    patches_for,
    run_compiled,
    state_device_type,
)
from funcamp.train.loss import Engine, clone_buffers
from funcamp.train.parallel import Parallel
from funcamp.train.state import TrainState, check_donation, check_train_state

__all__ = [
    "check_cache_dir",
    "check_not_donated",
    "check_specialize",
    "wrap_step",
]


def _stepcache(module: str) -> types.ModuleType:
    """``funcamp.stepcache.<module>``, imported when a step is built with ``cache_dir=``: the
    step cache imports dynamo's internals, which ``import funcamp`` does not."""
    return importlib.import_module(f"funcamp.stepcache.{module}")


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
    why = _stepcache("key").cache_support()
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
    cache: tuple[str, Callable[..., Any], tuple[Any, ...]] | None = None,
    compiler_patches: Choice = "auto",
    eager_casts: bool = False,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """``step(state, batch)``: ``train_step`` compiled (or eager), as every funcamp train step
    runs -- one process, data parallel or sharded alike.

    On every call: ``state`` must be a :class:`TrainState`; the parallel piece gives the state
    the compiled step works on (and takes the new one back); the batch keeps the first batch's
    structure; a donated state shares no memory. On the first call the optimizer state is
    checked against the params. ``specialize``: keep only the guards on the inputs
    (:func:`input_guards_only`). ``cache``, ``(directory, loss_fn, settings)``, keeps the
    compiled step on disk (:class:`funcamp.stepcache.cache.CachedStep`; ``settings``, what the
    step was built with, enter its key). ``compiler_patches``:
    ``make_train_step``'s choice of funcamp's compiler patches (:func:`patches_for`). ``eager_casts``:
    the policy rounds to float16, bfloat16 or FP8 (:func:`funcamp.train.compiling.rounds_casts`);
    a state with a loss scaler (not ``noop``) asks for the same inductor options
    (:func:`step_options_for`): its found-inf must be eager code's."""
    train_step.__code__ = fresh_code(train_step.__code__)
    patched: list[Patches] = []

    def compiled_for(device_type: str, scaled: bool) -> Callable[..., Any]:
        # Built on the first call, when the state's device is known (see step_options_for).
        on = patches_for(compiler_patches, device_type, compile_options)
        patched.append(on)
        compiled = announce_first_call(
            compile_fn(
                train_step,
                compile_options,
                device_type,
                specialize=specialize,
                patches=on.on,
                eager_casts=eager_casts or scaled,
            )
        )
        if cache is None:
            return compiled
        directory, loss_fn, settings = cache
        return _stepcache("cache").CachedStep(
            train_step,
            lambda keep: compile_fn(
                train_step,
                {**compile_options, "guard_filter_fn": keep},
                device_type,
                patches=on.on,
                eager_casts=eager_casts or scaled,
            ),
            compiled,
            directory,
            loss_fn,
            _stepcache("key").describe_settings(settings),
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
                runs.append(compiled_for(state_device_type(local), local.scaler.kind != "noop"))
            run = runs[0]
            # A failed trace re-runs the step eagerly, only for the error message: a donated
            # state on copies (made then: a failed trace wrote nothing, and copying the whole
            # state on every call would cost a sizeable part of a small step).
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
