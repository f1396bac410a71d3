"""The train step: one algorithm, composed from public pieces, and its front door.

:func:`make_train_step` makes ``step(state, batch) -> (state, metrics)``, the whole
mixed-precision pipeline as one pure function, compiled whole with ``torch.compile``:

1. forward and backward of the scaled loss: :func:`funcamp.amp` of the loss, then
   :func:`funcamp.scaled_grad_and_value`. The delayed-FP8 state is differentiated too; its
   "gradient" is the step's amaxes.
2. the exchange between ranks of the parallel piece. There is none for one process
   (:class:`~funcamp.train.parallel.SingleProcess`). Data parallel all-reduces; sharded
   exchanges the gradients of replicated leaves.
3. :func:`funcamp.unscale_and_step` (unscale, optimizer, skip on overflow), then
   :func:`funcamp.update` of the scaler; the new buffers, and the metrics.

The same algorithm runs for every parallelism, in the one wrapper of
:func:`funcamp.train.wrapper.wrap_step`. The parallel piece is an object the caller passes
(``parallel=``), so this layer needs none of :mod:`funcamp.distributed`. Every keyword option
is a field of :class:`~funcamp.train.config.StepOptions`, which declares its check and whether
it enters the step cache's key. A loss that cannot be one graph runs in two parts, 1 and 2-3
(:mod:`funcamp.train.pieces`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp._core import donation
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
from funcamp.optim._accumulate import accumulation_window
from funcamp.optim._base import Optimizer, learning_rate
from funcamp.policy.policy import Policy, as_policy
from funcamp.scaling.headroom import headroom_dtype, headroom_of
from funcamp.scaling.ops import update
from funcamp.scaling.skip import Skip, check_condition
from funcamp.scaling.state import ScalerState
from funcamp.scaling.step import unscale_and_step
from funcamp.train.compiling import rounds_casts
from funcamp.train.config import Compile, StepOptions, build, key_items
from funcamp.train.loss import GradMethod, forward_backward, restore_buffers
from funcamp.train.parallel import SingleProcess
from funcamp.train.pieces import Halves
from funcamp.train.state import TrainState
from funcamp.train.wrapper import check_cache_dir, wrap_step

__all__ = ["cache_settings", "make_train_step"]
Metrics = dict[str, Any]
StepFn = Callable[[TrainState, Any], tuple[TrainState, Metrics]]

API = "make_train_step"


class _Checked(NamedTuple):
    headroom_dtype: torch.dtype | None
    headroom_include: Callable[[str], bool] | None


def _bound(parallel: SingleProcess | None, policy: Policy) -> SingleProcess:
    """The parallel piece of this step: a copy of the one given (one process: a new
    :class:`SingleProcess`). The delayed-FP8 margin comes from the policy, and a piece that
    keeps per-state layouts (sharded) keeps them per step."""
    if parallel is None:
        return SingleProcess()
    piece = copy.copy(parallel)
    piece.margin = policy.fp8.recipe.margin if policy.fp8 is not None else 0  # type: ignore[attr-defined]
    return piece


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
    user_skip: torch.Tensor | None,
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
    if user_skip is not None:  # skip_if=
        metrics["user_skip"] = user_skip
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
    skip_if = None
    if opts.skip_if is not None:  # the user's condition, on the step's own metrics
        user_condition = opts.skip_if

        def skip_if(norm: torch.Tensor) -> torch.Tensor:
            return check_condition(API, user_condition({"loss": loss, "grad_norm": norm}))

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
        skip_if=skip_if,
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
        loss,
        info.grad_norm,
        state.scaler,
        found_inf,
        new_scaler,
        aux,
        opts.has_aux,
        room,
        lr,
        info.user_skip if opts.skip_if is not None else None,
    )
    # The frozen params are the input's own: the wrapper puts them back (no graph output).
    return TrainState(params, new_buffers, opt_state, new_scaler, new_fp8), metrics


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: Optimizer,
    policy: Policy | str,
    *,
    has_aux: bool = False,
    returns_buffers: bool = False,
    donate_state: bool = True,
    grad_norm: bool = True,
    skip_if: Callable[[dict[str, Any]], torch.Tensor] | None = None,
    headroom: bool | Callable[[str], bool] = False,
    parallel: SingleProcess | None = None,
    compile: bool | Compile = True,
) -> StepFn:
    """Build ``step(state, batch) -> (state, metrics)``: one pure, host-sync-free train step.

    The step runs ``funcamp.amp(loss_fn, policy)``, takes gradients of the scaled loss, calls
    :func:`funcamp.unscale_and_step` and :func:`funcamp.update`. A step whose scaled gradients
    overflow is skipped: the state comes back bit-identical, except the scaler. By default the
    step writes the new state into the tensors of the one it is given, as ``torch.optim`` does;
    keep only the returned state. The docs' "The train step" page says the rest.

    Args:
        loss_fn: ``(params, buffers, batch) -> loss``, or ``(loss, aux)`` with ``has_aux``.
        optimizer: a :class:`funcamp.Optimizer`.
        policy: a :class:`funcamp.Policy` or a policy string.
        has_aux: ``loss_fn`` also returns ``aux``, reported as ``metrics["aux"]``.
        returns_buffers: ``loss_fn`` gets the buffers themselves and returns the new ones last.
        donate_state: write the new state into the given one (default). ``False`` builds
            the pure step, which never modifies its input.
        grad_norm: report ``metrics["grad_norm"]`` (default). ``False`` saves its pass.
        skip_if: ``{"loss", "grad_norm"} -> 0-d bool tensor``: skip the step where it holds, as
            on an overflow, without backing off the scale (``metrics["user_skip"]``).
        headroom: add ``metrics["headroom"]`` (:func:`funcamp.headroom`); a predicate of
            the leaf path measures only the leaves it accepts.
        parallel: ``funcamp.distributed.DataParallel(group)`` or ``Sharded(mesh)``; ``None``
            trains in this process alone.
        compile: ``True`` (default) is ``funcamp.Compile()``: one graph, or the loss in pieces
            where it cannot be one (said on stderr); ``False`` runs eagerly.

    Returns:
        ``step(state, batch) -> (new_state, metrics)``. ``metrics`` holds ``loss``,
        ``grad_norm``, ``scale``, ``found_inf``, ``skipped`` and ``lr`` as tensors.

    Example:
        >>> import torch, funcamp
        >>> def loss_fn(params, buffers, x):
        ...     return (x @ params["w"]).square().mean()
        >>> opt, params = funcamp.sgd(0.1), {"w": torch.ones(2, 1)}
        >>> scaler = funcamp.ScalerState.dynamic(init_scale=1024.0)
        >>> state = funcamp.TrainState.create(params, opt, "mixed_float16", scaler=scaler)
        >>> step = funcamp.make_train_step(loss_fn, opt, "mixed_float16", compile=False)
        >>> state, metrics = step(state, torch.ones(4, 2))
        >>> state, metrics = step(state, torch.full((4, 2), float("inf")))  # skipped
        >>> metrics["found_inf"], metrics["skipped"], float(state.scaler.scale)
        (tensor(True), tensor(1, dtype=torch.int32), 512.0)
    """
    if not callable(loss_fn):
        raise TypeError(f"funcamp.{API}: `loss_fn` must be callable, got {describe(loss_fn)}")
    if not isinstance(optimizer, Optimizer):
        raise optimizer_type_error(API, optimizer)
    pol = as_policy(policy, API)
    # every keyword is a field of StepOptions, which checks it: read by name from the call
    opts = build(StepOptions, API, locals(), delayed_fp8=needs_state(pol))
    return _build(loss_fn, optimizer, pol, opts)


def fingerprint_options(opts: StepOptions) -> dict[str, Any]:
    """The options every rank of a parallel step must build alike, by name: each field but the
    parallel piece itself, the compile settings field by field."""
    out = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    del out["parallel"], out["compile"]
    cfg = opts.compiled
    out.update({"compile": False} if cfg is None else dataclasses.asdict(cfg))
    return out


def cache_settings(policy: Policy, opts: StepOptions) -> tuple[Any, ...]:
    """What a step's build settings enter the step cache's key as
    (:func:`funcamp.stepcache.key.describe_settings`): the policy, then every option that
    enters it (:func:`~funcamp.train.config.key_items`)."""
    return (policy, *key_items(opts))


def _build(
    loss_fn: Callable[..., Any], optimizer: Optimizer, pol: Policy, opts: StepOptions
) -> StepFn:
    cfg = opts.compiled
    cache_dir = None if cfg is None else check_cache_dir(API, cfg.cache_dir)
    parallel = _bound(opts.parallel, pol)
    checked = _Checked(
        headroom_dtype(pol) if opts.headroom is not False else None,
        opts.headroom if callable(opts.headroom) else None,
    )
    run_loss = with_fp8_state(amp_keeping(loss_fn, pol, keep=(1,)))  # buffers: not cast at entry
    fp8_stateful = needs_state(pol)
    grad_method = GradMethod(
        pieces=False,  # a step in pieces sets it (funcamp.train.pieces)
        compiled=cfg is not None,
        fp8_stateful=fp8_stateful,
        backward=lambda: recompute_under(pol),
    )
    plan = _Plan(optimizer, parallel, opts, checked, fp8_stateful)

    def forward(run: Callable[..., Any], state: TrainState, batch: Any) -> tuple[Any, ...]:
        return forward_backward(
            API,
            run,
            state,
            batch,
            has_aux=opts.has_aux,
            returns_buffers=opts.returns_buffers,
            fp8_stateful=fp8_stateful,
            grad_and_value=grad_method(),
            gather=parallel.gather,
            fp8_reduce=parallel.fp8_reduce,
        )

    def update_half(state: TrainState, batch: tuple[Any, ...]) -> tuple[TrainState, Metrics]:
        # The update needs no autograd: under no_grad nothing it makes carries a graph (params
        # that require grad included), and the traced optimizer asks no tensor whether it does.
        with torch.no_grad():
            return _apply_step(plan, state, *batch)

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        return update_half(state, forward(run_loss, state, batch))

    step = wrap_step(
        API,
        train_step,
        halves=Halves(run_loss, forward, update_half),
        optimizer=optimizer,
        parallel=parallel,
        grad_method=grad_method,
        cfg=cfg,
        donate_state=opts.donate_state,
        cache=None if cache_dir is None else (cache_dir, loss_fn, cache_settings(pol, opts)),
        eager_casts=rounds_casts(pol),
        policy=pol,
        settings={
            "policy": pol,
            "optimizer": optimizer,
            "options": fingerprint_options(opts),
        },
    )
    step.__doc__ = (
        f"A funcamp train step ({'eager' if cfg is None else 'compiled'}, policy {pol}, "
        f"{parallel.name})."
    )
    return step
