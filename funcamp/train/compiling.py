"""Compiling a step, the funcamp way.

:func:`compile_fn` is ``torch.compile(fullgraph=True)`` with three additions:

* the guards. By default it keeps every guard dynamo makes: a value the loss reads from a
  closure, a global or a module attribute recompiles the step when it changes, as with
  ``torch.compile``. With ``specialize=True`` it keeps only the guards on the step's inputs and
  on modules' ``training`` flags (:func:`input_guards_only`). The step is then specialised on
  everything else it closes over, as with ``jax.jit``.
* the inductor options of a step on its device (:func:`step_options_for`);
* funcamp's compiler patches, where they are on (:func:`patches_for`, :mod:`funcamp.compiler`).

:func:`run_compiled` calls a compiled function and turns a dynamo failure into one paragraph
(:mod:`funcamp.train.errors`). When ``torch.func`` refuses the model, it switches the step to
gradients from ``torch.autograd`` in the same graph; when the loss breaks the graph, a step
with ``fullgraph="auto"`` switches to its pieces (:mod:`funcamp.train.pieces`).

Workaround of torch internals (docs/internals.md#workarounds):

- Root cause: the settings a step compiles with (inductor's loop_ordering_after_fusion and
  emulate_precision_casts, dynamo's ignore_logging_functions and
  skip_fwd_side_effects_in_bwd_under_checkpoint, a mode's options) are torch._inductor.config
  and torch._dynamo.config, which torch.compile's options reach only in part; a failed trace
  can leave saved-tensor hooks off, and only torch._C._autograd turns them back on.
- Upstream: none filed.
- Why it is safe: set only for funcamp's own compiles and restored after; options= overrides
  the inductor ones; an option this torch lacks is left out.
- Tested on: torch 2.13 and 2.14.
- Delete when: torch.compile takes these as options, or their defaults change.

"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.guard_sources import GLOBAL_STATE_SOURCES, STEP_INPUTS, is_mode_flag, source_root
from funcamp._core.tree import NAMESPACE, PyTree
from funcamp.compiler import hooks as compiler_hooks
from funcamp.compiler.gate import Choice, patches_on
from funcamp.policy.policy import Policy
from funcamp.train.errors import explain
from funcamp.train.loss import GradMethod
from funcamp.train.state import TrainState

__all__ = [
    "CPU_STEP_OPTIONS",
    "EAGER_CASTS_OPTIONS",
    "FP8_STEP_OPTIONS",
    "compile_fn",
    "fresh_code",
    "input_guards_only",
    "patches_for",
    "rounds_casts",
    "run_compiled",
    "state_device_type",
    "step_options_for",
]


def input_guards_only(entries: list[Any]) -> list[bool]:
    """The guard filter of ``specialize=True``.

    It keeps the guards on the step's inputs (``state``, ``batch``) and on tensors anywhere. It
    keeps those on global torch state (grad mode, default device, ...) and on modules'
    ``training`` flags, so the step follows ``train()``/``eval()``. It drops those on closures,
    globals and captured modules, which the step is specialised on (as with ``jax.jit``). A
    guard whose origin cannot be read is kept.
    """
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
#: all nine models) and cost a few percent of a first call (docs/benchmarks.md).
#: With funcamp's compiler patches on (:mod:`funcamp.compiler`), a CPU step also gets
#: :class:`~funcamp.compiler.layouts.ChannelsLastConvBackward` as ``post_grad_custom_post_pass``
#: (:func:`funcamp.compiler.hooks.inductor_options`).
CPU_STEP_OPTIONS = {"loop_ordering_after_fusion": False}

#: Inductor options a step (train or eval, any device) gets unless the caller sets them when
#: its policy computes, stores or returns float16 or bfloat16 values, or runs FP8 linears
#: (:func:`rounds_casts`), or its state carries a loss scaler: every cast to a lower-precision
#: dtype rounds, as in eager code. By default inductor lets a fused reader of a float16 or
#: bfloat16 result see its unrounded float32 value. A float16 gradient that overflows in eager
#: code then stays finite in the compiled step, which applies an update that eager funcamp and
#: ``torch.amp.GradScaler`` skip, and keeps a loss scale they halve; quantized to FP8, such values
#: land on other codes than eager code's (a compiled FP8 step drifted about 1 % from the eager
#: one in 10 steps). With this option the compiled step's found-inf, skips, scales and params
#: equal the eager step's (tests/test_compiled_scaling.py, tests/test_device_parity.py). A
#: float32 graph holds no such cast: the option changes nothing there, and it is left off.
EAGER_CASTS_OPTIONS = {"emulate_precision_casts": True}

#: The name :data:`EAGER_CASTS_OPTIONS` had while only FP8 policies got them.
FP8_STEP_OPTIONS = EAGER_CASTS_OPTIONS

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def rounds_casts(policy: Policy) -> bool:
    """Whether a step under ``policy`` compiles with :data:`EAGER_CASTS_OPTIONS`: one of its
    dtypes (or a module policy's) is float16 or bfloat16, or it runs FP8 linears."""
    if policy.fp8 is not None:
        return True
    dtypes = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    if any(d in _LOW_PRECISION for d in dtypes):
        return True
    return any(rounds_casts(p) for _, p in policy.module_policies)


def step_options_for(
    device_type: str | None, backend: Any, eager_casts: bool = False
) -> dict[str, Any]:
    """The inductor options funcamp adds for a step on ``device_type``.

    They are :data:`CPU_STEP_OPTIONS` for the device. With ``eager_casts`` (a step that rounds to
    float16, bfloat16 or FP8) they include :data:`EAGER_CASTS_OPTIONS`. There are none for
    another backend, or for an option this torch lacks.
    """
    if backend != "inductor":
        return {}
    options = dict(CPU_STEP_OPTIONS) if device_type == "cpu" else {}
    if eager_casts:
        options.update(EAGER_CASTS_OPTIONS)
    config = torch._inductor.config
    return {k: v for k, v in options.items() if hasattr(config, k)}


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
    """funcamp's compiler patches for one compiled step.

    ``on`` says whether inductor's are on (see :func:`patches_for`). ``choice`` is the caller's
    choice, which the dynamo routing of in-graph ``CrossEntropyLoss`` follows on every backend.
    """

    on: bool = False
    choice: Choice = "auto"


NO_PATCHES = Patches()


def patches_for(choice: Choice, device_type: str, options: dict[str, Any]) -> Patches:
    """funcamp's compiler patches for a step on ``device_type`` compiled with ``options``:
    inductor's are on as :func:`funcamp.compiler.patches_on` says (off for another backend)."""
    inductor = options.get("backend", "inductor") == "inductor"
    return Patches(inductor and patches_on(choice, device_type), choice)


def compile_fn(
    fn: Callable[..., Any],
    options: dict[str, Any],
    device_type: str | None = None,
    *,
    specialize: bool = False,
    patches: bool = False,
    eager_casts: bool = False,
) -> Callable[..., Any]:
    """``torch.compile(fn, fullgraph=True, ...)``, with funcamp's guards and options.

    With ``specialize`` (and no filter from the caller), :func:`input_guards_only` is the guard
    filter. ``device_type`` (the step's device, when known) and ``eager_casts`` (the step rounds
    to float16, bfloat16 or FP8) add :func:`step_options_for` under the caller's options.
    ``patches`` (on for this compile: :func:`patches_for`) adds the compiler patches' inductor
    options (:func:`funcamp.compiler.hooks.inductor_options`).
    """
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
    inner = {**step_options_for(device_type, backend, eager_casts), **patched, **inner}
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
    (torch has many)."""
    logger.addFilter(_drop)
    try:
        yield
    finally:
        logger.removeFilter(_drop)


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


@contextlib.contextmanager
def _rng_kept() -> Any:
    """torch's global random state put back afterwards: the eager re-run after a failed trace
    runs only for its error (or a model's first-call setup), so the run's dropout masks stay
    those of the same run without it (tests/test_graph_breaks.py)."""
    cuda = torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else []):
        yield


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
    grad_method: GradMethod | None = None,
    first: bool = False,
    patches: Patches = NO_PATCHES,
    marks: tuple[Callable[[], None], Callable[[], None]] | None = None,
    pieces: Callable[[BaseException], Callable[..., Any] | None] | None = None,
) -> Any:
    """``run(*args)`` (a compiled function), with a dynamo failure explained.

    A model torch.func refuses is traced again with torch.autograd (``grad_method``). Otherwise
    ``eagerly()`` re-runs the same computation with compilation off. So an error of the model
    itself is raised plainly. On the ``first`` call the trace is tried once more after that
    eager run. A model may set itself up on its first call in a way dynamo cannot trace, and
    then compile. (transformers installs the hooks that record a model's outputs, such as
    Mixtral's router logits, under a lock.) A failure only the compiler has becomes one
    paragraph naming the way out.

    ``patches`` says funcamp's compiler patches are on for this compile
    (:func:`funcamp.compiler.hooks.running`). ``marks`` is ``(begin, undo)`` for a donated state.
    ``begin()`` runs just before each call of ``run``, whose graph writes the state. ``undo()``
    runs when dynamo failed before the graph ran (:mod:`funcamp._core.donation`).
    ``pieces(error)`` is the step compiled in pieces when a graph break calls for it
    (:class:`funcamp.train.pieces.Pieces`), else None; it is asked after the first call's retry.
    """
    tracing = grad_method.tracing() if grad_method is not None else contextlib.nullcontext()
    hooks = _saved_tensors_hooks_state()
    try:
        # A failing op on fake tensors is logged at ERROR with its whole stack before dynamo
        # raises; the eager re-run gives the plain error, so that log is held back.
        with _quiet(_FAKE_TENSOR_LOG), tracing, compiler_hooks.running(*patches), _tracing_config():
            if marks is not None:
                marks[0]()
            return run(*args)
    except torch._dynamo.exc.TorchDynamoException as e:
        if marks is not None:
            marks[1]()
        _restore_saved_tensors_hooks(hooks)
        if grad_method is not None and grad_method.switch(e):
            return run_compiled(api, run, args, eagerly, grad_method, first, patches, marks, pieces)
        split = None if first or pieces is None else pieces(e)
        if split is not None:
            return run_compiled(api, split, args, eagerly, grad_method, False, patches, marks)

        def rerun() -> None:
            with torch.compiler.set_stance("force_eager"), _rng_kept():
                try:
                    eagerly()
                except Exception as refusal:
                    # dynamo failed before reaching what torch.func refuses (transformers'
                    # one-time warning ahead of a checkpointed layer): the eager run says it
                    if grad_method is None or not grad_method.switch(refusal):
                        raise
                    _restore_saved_tensors_hooks(hooks)
                    eagerly()

        failure = explain(api, e, rerun)  # raises the model's own error, if it has one
        if first:
            try:
                return run_compiled(
                    api, run, args, eagerly, grad_method, False, patches, marks, pieces
                )
            except RuntimeError as again:
                if again.__cause__ is None:  # not the paragraph: raise it as it came
                    raise
        raise failure from e
