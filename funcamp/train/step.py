"""The train step: one algorithm, composed from public pieces.

``build_train_step`` makes ``step(state, batch) -> (state, metrics)``, the whole mixed-precision
pipeline as one pure function, compiled whole with ``torch.compile(fullgraph=True)``:

1. forward and backward of the scaled loss: :func:`funcamp.amp` of the loss, then
   :func:`funcamp.scaled_grad_and_value`. The delayed-FP8 state is differentiated too; its
   "gradient" is the step's amaxes.
2. the exchange between ranks of the parallel piece. There is none for one process
   (:class:`~funcamp.train.parallel.SingleProcess`). Data parallel all-reduces; sharded
   exchanges the gradients of replicated leaves.
3. :func:`funcamp.unscale_and_step` (unscale, optimizer, skip on overflow), then
   :func:`funcamp.update` of the scaler; the new buffers, and the metrics.

The same algorithm runs for every parallelism, in the one wrapper of
:func:`funcamp.train.wrapper.wrap_step`. Options that a parallel piece does not compose with are
refused in one place, :func:`check_step_options`, with the piece's reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp._core import donation
from funcamp._core.checks import check_flag
from funcamp._core.context import compiling
from funcamp._core.hints import optimizer_type_error
from funcamp._core.tree import (
    PyTree,
    describe,
    flatten,
    plan_write,
    storage_key,
    tree_select,
    unflatten,
)
from funcamp.casting.amp import amp_keeping, recompute_under
from funcamp.casting.fp8 import needs_state, with_fp8_state
from funcamp.compiler.gate import check_choice
from funcamp.optim._accumulate import accumulation_window
from funcamp.optim._base import Optimizer, learning_rate
from funcamp.policy.policy import Policy, as_policy
from funcamp.scaling.headroom import headroom_dtype, headroom_of
from funcamp.scaling.ops import update
from funcamp.scaling.skip import Skip
from funcamp.scaling.state import ScalerState
from funcamp.scaling.step import unscale_and_step
from funcamp.train.compiling import rounds_casts
from funcamp.train.config import Compile, check_combinations, resolve_compile, unchecked
from funcamp.train.loss import GradMethod, forward_backward, restore_buffers
from funcamp.train.parallel import SingleProcess
from funcamp.train.state import TrainState
from funcamp.train.wrapper import check_cache_dir, wrap_step

__all__ = ["StepOptions", "build_train_step", "check_step_options"]
Metrics = dict[str, Any]
StepFn = Callable[[TrainState, Any], tuple[TrainState, Metrics]]

API = "make_train_step"


class StepOptions(NamedTuple):
    """``make_train_step``'s keyword options, as given (checked by :func:`check_step_options`)."""

    has_aux: Any = False
    returns_buffers: Any = False
    compile: Any = True
    donate_state: Any = True
    headroom: Any = False
    grad_norm: Any = True
    cache_dir: Any = None
    specialize: Any = False
    compiler_patches: Any = "auto"


class _Checked(NamedTuple):
    policy: Policy
    headroom_dtype: torch.dtype | None
    headroom_include: Callable[[str], bool] | None
    cache_dir: str | None


def _as_config(opts: StepOptions, compile_options: dict[str, Any]) -> Compile | None:
    """The step's compile settings as one :class:`Compile` (None: an eager step)."""
    if not opts.compile:
        if opts.specialize or opts.cache_dir is not None:
            from_legacy = {"specialize": opts.specialize, "cache_dir": opts.cache_dir}
            resolve_compile(API, False, {k: v for k, v in from_legacy.items() if v})
        return None
    return unchecked(
        **compile_options,
        cache_dir=opts.cache_dir,
        specialize=opts.specialize,
        compiler_patches=opts.compiler_patches,
    )


def check_step_options(
    loss_fn: Any,
    optimizer: Any,
    policy: Any,
    parallel: SingleProcess,
    opts: StepOptions,
    compile_options: dict[str, Any],
) -> _Checked:
    """Every argument check of a train step, and the one rule for what does not compose.

    An option the parallel piece lists in ``refuses`` is refused here, with its reason.
    """
    if not callable(loss_fn):
        raise TypeError(f"funcamp.{API}: `loss_fn` must be callable, got {describe(loss_fn)}")
    if not isinstance(optimizer, Optimizer):
        raise optimizer_type_error(API, optimizer)
    pol = as_policy(policy, API)
    for name in (
        "has_aux",
        "returns_buffers",
        "compile",
        "donate_state",
        "grad_norm",
        "specialize",
    ):
        check_flag(API, name, getattr(opts, name))
    check_choice(API, opts.compiler_patches)
    if not (isinstance(opts.headroom, bool) or callable(opts.headroom)):
        raise TypeError(
            f"funcamp.{API}: `headroom` must be a bool or a callable of the leaf path, got "
            f"{describe(opts.headroom)}"
        )
    if compile_options and not opts.compile:
        raise TypeError(
            f"funcamp.{API}: compile options {sorted(compile_options)} must not be given with "
            "compile=False"
        )
    check_combinations(
        API,
        _as_config(opts, compile_options),
        parallel=parallel,
        headroom=opts.headroom,
        delayed_fp8=needs_state(pol),
        donate_state=opts.donate_state,
    )
    cache_dir = check_cache_dir(API, opts.cache_dir, opts.compile, compile_options)
    return _Checked(
        pol,
        headroom_dtype(pol) if opts.headroom is not False else None,
        opts.headroom if callable(opts.headroom) else None,
        cache_dir,
    )


def _metrics(
    loss: torch.Tensor,
    grad_norm: Any,
    scaler: ScalerState,
    found_inf: torch.Tensor,
    new_scaler: ScalerState,
    aux: Any,
    has_aux: bool,
    room: Any,
    lr: Any,
) -> Metrics:
    """The step's metrics: tensors only (no host sync)."""
    metrics: Metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "scale": scaler.scale,
        "found_inf": found_inf,
        "skipped": new_scaler.skipped,
        "lr": lr,
    }
    if grad_norm is None:  # grad_norm=False
        del metrics["grad_norm"]
    if lr is None:  # an optimizer without a learning rate
        del metrics["lr"]
    if has_aux:
        metrics["aux"] = aux
    if room is not None:
        metrics["headroom"] = room.summary()
    return metrics


def _own_aux(aux: Any, state: TrainState, returns_buffers: bool) -> Any:
    """``aux`` with every tensor that shares memory with the state's params (or, with
    ``returns_buffers``, its buffers: ``loss_fn`` saw them) copied: a donated step writes them,
    so an aux that is a param, or a view of one, would change with every later step.
    Compiled, every aux tensor is copied (the aliasing is not known in Python; in the graph a
    copy of a computed value fuses with it); eager, only those that share memory."""
    leaves, spec = flatten(aux)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        return aux
    if compiling():
        return unflatten(spec, [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves])
    trees = (state.params, state.buffers) if returns_buffers else (state.params,)
    owned = {storage_key(x) for x in flatten(trees)[0] if isinstance(x, torch.Tensor)}
    return unflatten(
        spec,
        [
            x.clone()
            if isinstance(x, torch.Tensor) and storage_key(x) in owned and x.numel()
            else x
            for x in leaves
        ],
    )


class _Plan(NamedTuple):
    """What the step's second half reads: fixed when the step is built."""

    optimizer: Optimizer
    parallel: SingleProcess
    opts: StepOptions
    checked: _Checked
    fp8_stateful: bool


def _apply_step(
    plan: _Plan,
    state: TrainState,
    grads: PyTree,
    loss: Any,
    aux: Any,
    new_buffers: PyTree,
    new_fp8: Any,
) -> tuple[TrainState, Metrics]:
    """The step's second half, after the backward pass: the exchange between ranks, then
    :func:`funcamp.unscale_and_step`, :func:`funcamp.update` and the metrics."""
    optimizer, parallel, opts, checked, fp8_stateful = plan
    # Always checked (a rebound or added key would change the state's structure), and
    # before anything is written into a donated state.
    new_buffers = restore_buffers(API, new_buffers, state.buffers, opts.returns_buffers)
    grads, loss, new_buffers, nonfinite = parallel.exchange(grads, loss, new_buffers)
    # Donated state, all or nothing: every check and every computation that can fail runs
    # before the first write; the buffers are written last, by plain copies.
    write_buffers = plan_write(new_buffers, state.buffers) if opts.donate_state else None
    room = None
    if checked.headroom_dtype is not None:  # on the scaled grads, before they are unscaled
        room = headroom_of(
            grads,
            state.scaler.scale,
            checked.headroom_dtype,
            scaled=True,
            leaves=False,
            include=checked.headroom_include,
        )
    lr = learning_rate(optimizer, state.opt_state)  # before a donated count is overwritten
    if opts.has_aux and opts.donate_state:  # before the writes: an aux param would change
        aux = _own_aux(aux, state, opts.returns_buffers)
    window = accumulation_window(optimizer, state.opt_state)  # funcamp.accumulate: None without it
    # The grads are this step's own: donating them lets the eager path unscale in place.
    params, opt_state, info = unscale_and_step(
        state.scaler,
        optimizer,
        grads,
        state.opt_state,
        state.params,
        donate_grads=True,
        donate_state=opts.donate_state,
        grad_norm=opts.grad_norm,
        across=parallel.across(),
    )
    # A rank's inf/nan gradient makes the exchanged gradient inf/nan on every rank, so the
    # step is skipped wherever `nonfinite` is set; OR-ing ties the flag reported and the
    # scaler update to the consensus all the same.
    found_inf = info.found_inf if nonfinite is None else info.found_inf | nonfinite
    new_scaler = update(state.scaler, found_inf)
    if window is not None:  # GradScaler's recipe: one update per optimizer step, not micro-step
        new_scaler = tree_select(window.applies, new_scaler, state.scaler)
    if fp8_stateful:  # a skipped step keeps the FP8 state, as it keeps the params
        new_fp8 = Skip(found_inf).select(state.fp8, new_fp8)
    if write_buffers is not None:
        if not compiling():  # each first write marks the state the wrapper armed
            donation.writing()  # (compiled: marked before the call)
        new_buffers = write_buffers()
    metrics = _metrics(
        loss, info.grad_norm, state.scaler, found_inf, new_scaler, aux, opts.has_aux, room, lr
    )
    # The frozen params are the input's own: the wrapper puts them back (no graph output).
    return TrainState(params, new_buffers, opt_state, new_scaler, new_fp8), metrics


def build_train_step(
    loss_fn: Callable[..., Any],
    optimizer: Optimizer,
    policy: Policy | str,
    *,
    parallel: SingleProcess | None = None,
    step_options: StepOptions | None = None,
    **compile_options: Any,
) -> StepFn:
    """``step(state, batch) -> (state, metrics)``: :func:`funcamp.make_train_step`'s step.

    ``parallel`` spreads it over processes (default: one process). See ``make_train_step`` for
    the options.
    """
    parallel = SingleProcess() if parallel is None else parallel
    opts = StepOptions() if step_options is None else step_options
    checked = check_step_options(loss_fn, optimizer, policy, parallel, opts, compile_options)
    pol = checked.policy
    run_loss = with_fp8_state(amp_keeping(loss_fn, pol, keep=(1,)))  # buffers: not cast at entry
    fp8_stateful = needs_state(pol)
    grad_method = GradMethod(
        pieces=bool(opts.compile) and compile_options.get("fullgraph", True) is False,
        compiled=bool(opts.compile),
        fp8_stateful=fp8_stateful,
        backward=lambda: recompute_under(pol),
    )
    plan = _Plan(optimizer, parallel, opts, checked, fp8_stateful)

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        grads, loss, aux, new_buffers, new_fp8 = forward_backward(
            API,
            run_loss,
            state,
            batch,
            has_aux=opts.has_aux,
            returns_buffers=opts.returns_buffers,
            fp8_stateful=fp8_stateful,
            grad_and_value=grad_method(),
            gather=parallel.gather,
            fp8_reduce=parallel.fp8_reduce,
        )
        # The update needs no autograd: under no_grad nothing it makes carries a graph (params
        # that require grad included), and the traced optimizer asks no tensor whether it does.
        with torch.no_grad():
            return _apply_step(plan, state, grads, loss, aux, new_buffers, new_fp8)

    settings = (
        pol,
        opts.has_aux,
        opts.returns_buffers,
        opts.donate_state,
        opts.headroom,
        opts.grad_norm,
        opts.compiler_patches,
    )
    step = wrap_step(
        API,
        train_step,
        optimizer=optimizer,
        parallel=parallel,
        grad_method=grad_method,
        compile=opts.compile,
        compile_options=compile_options,
        donate_state=opts.donate_state,
        specialize=opts.specialize,
        cache=None if checked.cache_dir is None else (checked.cache_dir, loss_fn, settings),
        compiler_patches=opts.compiler_patches,
        eager_casts=rounds_casts(pol),
        policy=pol,
        settings={
            "policy": pol,
            "optimizer": optimizer,
            "options": {**opts._asdict(), **compile_options},
        },
    )
    step.__doc__ = (
        f"A funcamp train step ({'compiled' if opts.compile else 'eager'}, policy {pol}, "
        f"{parallel.name})."
    )
    return step
