"""The entry point that knows every option: :func:`make_train_step`.

It sits above every layer because its ``group=`` and ``mesh=`` options choose a piece of the
distributed layer; everything else is :func:`funcamp.train.step.build_train_step`, the one step
algorithm, which takes the piece.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

from funcamp.distributed.data_parallel import DataParallel
from funcamp.distributed.shard import Sharded
from funcamp.optim._base import Optimizer
from funcamp.policy.policy import Policy, as_policy
from funcamp.train.step import StepFn, StepOptions, build_train_step

__all__ = ["make_train_step"]

API = "make_train_step"


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: Optimizer,
    policy: Policy | str,
    *,
    has_aux: bool = False,
    returns_buffers: bool = False,
    compile: bool = True,
    group: Any = None,
    donate_state: bool = True,
    headroom: bool | Callable[[str], bool] = False,
    grad_norm: bool = True,
    mesh: Any = None,
    cache_dir: str | os.PathLike[str] | None = None,
    specialize: bool = False,
    compiler_patches: bool | Literal["auto"] = "auto",
    **compile_options: Any,
) -> StepFn:
    """Build ``step(state, batch) -> (state, metrics)``: one pure, host-sync-free train step.

    Inside: ``funcamp.amp(loss_fn, policy)``; ``torch.func.grad_and_value`` of the loss scaled by
    ``state.scaler`` (a plain eager step, ``compile=False`` outside any transform and without
    delayed FP8, takes the same gradients, bit for bit, from ``torch.autograd`` on leaf copies,
    which is faster in eager); :func:`funcamp.unscale_and_step` (a step whose scaled gradients hold an
    inf or nan is skipped: params and optimizer state come back bit-identical); and
    :func:`funcamp.update` of the scaler.

    ``loss_fn(params, buffers, batch)`` returns the loss (a 0-d floating tensor), or
    ``(loss, aux)`` with ``has_aux=True``. ``buffers`` is a fresh copy of ``state.buffers``:
    in-place updates (BatchNorm's running stats under ``functional_call``) become the new
    state's buffers. With ``returns_buffers=True`` it gets the buffers themselves and returns
    the new ones instead: ``(loss, new_buffers)`` or ``(loss, aux, new_buffers)``.

    ``metrics`` is a dict of tensors: ``loss`` (unscaled, float32), ``grad_norm`` (of the
    unscaled gradients), ``scale`` (the loss scale this step used), ``found_inf`` (this step was
    skipped), ``skipped`` (running total of skipped steps, from the scaler state) and ``lr`` (the
    learning rate this step applied, :func:`funcamp.optim.learning_rate`: a schedule's value at
    the count of updates applied before it; a dict by label under
    :func:`funcamp.multi_transform`; absent for an optimizer without one), plus
    ``aux`` with ``has_aux=True``, and with ``headroom=True`` ``headroom``: the summary of
    :func:`funcamp.headroom` of this step's gradients at the scale it used (a dict of 0-d
    tensors: ``underflow``, ``subnormal``, ``overflow``, ``amax``, ``log2_scale_min``,
    ``log2_scale_max``), measured against the policy's compute dtype (float16 when that is not
    a half dtype). Given a callable of the leaf path (``"mix.weight"``) instead of ``True``,
    only the leaves it accepts are measured (leave out those a float32 module policy computes).

    With :func:`funcamp.accumulate` each call is one micro-batch, and a window of ``every``
    calls is ``torch.amp.GradScaler``'s optimizer step: an inf or nan in any micro-batch skips
    the window's update whole, the scaler updates once per window (on the call that applies),
    ``found_inf`` is the window's so far, ``skipped`` counts skipped windows, and ``grad_norm``
    on the applying call is the accumulated gradient's norm (``clip_grad_norm_``'s after
    ``unscale_``).

    Data parallel (``group=pg``): every rank of ``pg`` runs the step on its own shard of the
    batch (shards of equal size) and ends with the same state, as with DDP. The world size and
    this process's rank are read when the step is built. After the backward pass one all-reduce
    per gradient dtype (one in all when the gradients are float32, as under the ``mixed_*``
    policies; when none is float32, as under ``bf16-true``, a small float32 all-reduce is
    added for the loss, flag and buffers) carries the *scaled* gradients averaged over the ranks, the loss (``metrics["loss"]``
    is the mean over ranks), a non-finite flag (any rank's inf/nan skips the step on every rank,
    so the scaler states stay equal) and rank 0's new buffers (DDP's ``broadcast_buffers``: every
    rank holds rank 0's, bit for bit). ``grad_norm`` is the norm of the averaged gradients;
    ``aux`` stays this rank's own. With :func:`funcamp.accumulate` the gradients are averaged
    on *every* micro-step, not only on the one that applies the update (DDP's ``no_sync``):
    whether a micro-step applies is a device-side value (kept in the optimizer state), and
    a collective issued only on that step needs its value on the host -- a host sync
    (``torch.cond`` reads it with ``.item()``). See the data-parallel guide.

    Sharded (``mesh=mesh``, a 1-D ``DeviceMesh``): the state's params and optimizer state are
    ``DTensor`` s made by :func:`funcamp.distributed.shard` (large leaves split along one
    dimension, so each rank holds about ``1/N`` of them; small ones replicated), and every rank
    runs the step on its own equal shard of the batch, as with ``group=``. The step works on the
    local shards: the sharded params are all-gathered (one packed all-gather per dtype) for the
    forward and their gradients reduce-scattered in the backward; one all-reduce carries the
    replicated leaves' gradients, the loss and rank 0's buffers, and one more (inside
    :func:`funcamp.unscale_and_step`, with :class:`funcamp.distributed.Across`) each rank's
    squared gradient norm and overflow flag, so ``loss``, ``grad_norm`` and ``found_inf`` are
    global (no rank steps when any rank overflowed); unscale, the optimizer and the skip run on
    the local shards, and the new state comes back as DTensors with the same placements.
    :func:`funcamp.clip_by_global_norm` (chained at the top level) gets the global norm, and
    delayed-FP8 amaxes are max-reduced over the ranks. Compiles as one graph per rank with the
    collectives inside. See the sharded-training guide.

    Data parallel, sharded and one process run the same step algorithm in the same wrapper
    (``funcamp.distributed.DataParallel`` and ``Sharded`` are the pieces that differ). Options a
    piece cannot compose with are refused in one place with the reason: ``cache_dir`` with
    ``group`` or ``mesh`` (their graphs hold collectives bound to this process's group) and
    ``headroom`` with ``mesh`` (each rank holds only its shards of the gradients).

    The state is donated by default (``donate_state=True``, as ``jax.jit(step,
    donate_argnums=0)``): the returned state's params, buffers and optimizer-state tensors are
    the input state's own tensors, overwritten with the new values (as ``torch.optim`` updates in
    place), so the step allocates no new memory for them and writes its results straight into
    them -- the peak memory of torch.amp's in-place step instead of two whole training states
    (docs/benchmarks.md, "Memory"). Keep only the returned state: ``state, m = step(state,
    batch)``. Passing a donated state to a train step again is an error naming the fix, after
    any number of steps, as JAX refuses a donated buffer (a donated state is known by its
    scaler state object, weakly referenced: nothing is kept alive). Anything sharing
    memory with the state changes too, such as a module's parameters when the params came from
    :func:`params_and_buffers` with a float32 ``param_dtype`` (the module then follows training,
    as with ``torch.optim``). No two state tensors may share memory and none may require grad
    (checked on every call: a clear error). The scaler state (a few scalars) is always returned
    fresh. All or nothing: every check and every computation that can fail runs before the first
    write, so a step that raises leaves the state as it was. ``donate_state=False`` builds the
    pure step, which never modifies its input (the caller then holds two states at the step
    boundary).

    The first call of a compiled step traces and compiles it -- on a CPU up to minutes for a real
    model, less than torch.compile of the model and of ``optimizer.step`` (the same work) where
    funcamp's compiler patches are on, seconds with ``cache_dir`` (measured in
    docs/benchmarks.md, "First calls on real models") -- and
    says so on stderr by default, with the time it took (``FUNCAMP_QUIET=1`` or the
    ``"funcamp"`` logger's level silences it; with logging configured the lines go through your
    handlers). With ``cache_dir`` a later process loads the compiled step instead of tracing it
    again (and says that it did, or why it could not).

    Args:
        loss_fn: ``(params, buffers, batch) -> loss | tuple`` as above; run under ``amp``.
        optimizer: a :class:`funcamp.Optimizer`.
        policy: a :class:`funcamp.Policy` or a policy string.
        has_aux: ``loss_fn`` returns auxiliary outputs (returned as ``metrics["aux"]``).
        returns_buffers: ``loss_fn`` returns the new buffers (see above).
        compile: compile the step with ``torch.compile(fullgraph=True)`` (default); ``False``
            returns the same step, eager.
        group: a ``torch.distributed`` process group for data-parallel training (see below);
            ``None`` (default) trains in this process alone.
        donate_state: let the step write the new params, buffers and optimizer state into the
            tensors of the state it is given, like ``jax.jit(..., donate_argnums=0)`` (see
            below). Default ``True``; ``False`` builds the pure step: the input state is never
            modified.
        headroom: add ``metrics["headroom"]`` (see above): a few reductions over the gradients;
            ``True`` for every gradient leaf, or a predicate of the leaf path.
        grad_norm: report ``metrics["grad_norm"]`` (default True). ``False`` leaves the
            metric out and saves the step its pass over every gradient (see
            :func:`funcamp.unscale_and_step`); global-norm clipping computes its own norm.
        mesh: a 1-D ``torch.distributed.device_mesh.DeviceMesh`` for sharded training (see
            above; the state must come from :func:`funcamp.distributed.shard`); ``None``
            (default) keeps params and optimizer state whole. Not together with ``group``.
        cache_dir: a directory to keep the compiled step in (created if missing): the first
            call compiles it with torch's AOT precompile and saves it there; a later process
            that builds the same step loads it without dynamo's trace (docs/benchmarks.md, "Warm
            start"). An entry is used only
            while it fits: filed under the versions, machine, options, loss code and input
            shapes, and checked on load against the current source files and everything the
            step is specialised on (model attributes, closure constants, globals); anything
            else compiles afresh and replaces it; a step specialised on something that cannot
            be compared across processes is not saved (a warning). Needs a torch with AOT
            precompile (else a warning, and the step compiles as usual); not with
            ``compile=False``, ``fullgraph=False``, ``group``, ``mesh``, ``guard_filter_fn``
            or a backend object (give it by name). See the warm-starts guide.
        specialize: specialise the compiled step on everything it reads besides its inputs,
            as ``jax.jit`` does: only the guards on ``state`` and ``batch`` (tensor metadata,
            structure) and on modules' ``training`` flags are kept, so a closure, a global or a
            module attribute that the loss reads (a loss weight, ``model.config`` flags) is
            fixed at its first-call value and a later change is *not* seen. Default ``False``:
            every guard dynamo makes is kept, and such a change recompiles the step as
            ``torch.compile`` does (on torch 2.13 the guards cost no measurable time per call:
            docs/benchmarks.md). Not with ``compile=False`` or a ``guard_filter_fn``.
        compiler_patches: funcamp's changes to inductor for a compiled step (see
            ``compile_options`` and :mod:`funcamp.compiler`): ``"auto"`` (default) turns them on
            only for a torch release and device on :data:`funcamp.compiler.ALLOWLIST` (where the
            test suite ran with them: torch 2.13 and 2.14 on the CPU) and says once that they are off
            elsewhere; ``True`` turns them on anywhere, ``False`` compiles with torch's
            compiler untouched. They change no result bit (each is tested so), only compile
            time and layouts.
        **compile_options: passed to ``torch.compile`` (``backend=``, ``mode=``,
            ``options=``, ``dynamic=``); ``guard_filter_fn=`` filters dynamo's guards (see
            ``specialize``). A step compiled by inductor for the CPU turns inductor's
            ``loop_ordering_after_fusion`` off (the same output code on the real-model suite,
            a shorter first call) unless ``options=`` sets it. With ``compiler_patches`` on
            (:mod:`funcamp.compiler`), it also keeps the activations a convolution's backward
            shares with other ops channels-last (inductor's ``post_grad_custom_post_pass``: the
            same bits, fewer transposes, a shorter first call on a CNN; unless ``options=``
            sets that pass), builds its CPU kernels in a few C++ units instead of one build per
            kernel (the same code and bits; ``FUNCAMP_CPP_BUNDLE=0`` in the environment gives
            torch's builds back), and, where the step writes its state in place, keeps
            inductor from storing the update's dead intermediates before those writes (the
            same kernels, less scheduling time; ``FUNCAMP_LIVE_READS=0`` gives inductor's
            own lowering back); which of them are on enters inductor's FX graph cache key.
            Each is measured in docs/benchmarks.md ("First calls on real models").
            ``fullgraph=False`` compiles a ``loss_fn`` with graph breaks in pieces: the
            gradients then come from ``torch.autograd.grad`` (dynamo cannot resume a frame
            inside ``torch.func.grad``), the rest of the step is unchanged.

    Returns:
        ``step(state, batch) -> (new_state, metrics)``.

    Example:
        >>> import torch, funcamp
        >>> def loss_fn(params, buffers, batch):
        ...     x, y = batch
        ...     return torch.nn.functional.mse_loss(x @ params["w"], y)
        >>> opt = funcamp.sgd(0.1)
        >>> scaler = funcamp.ScalerState.dynamic(init_scale=2.0**10)
        >>> params = {"w": torch.zeros(2, 1)}
        >>> state = funcamp.TrainState.create(params, opt, "mixed_float16", scaler=scaler)
        >>> step = funcamp.make_train_step(loss_fn, opt, "mixed_float16", compile=False)
        >>> batch = (torch.ones(4, 2), torch.ones(4, 1))
        >>> state, metrics = step(state, batch)
        >>> metrics["loss"], metrics["scale"], metrics["found_inf"], state.params["w"].flatten()
        (tensor(1.), tensor(1024.), tensor(False), tensor([0.2000, 0.2000]))
        >>> bad = (torch.full((4, 2), float("inf")), torch.ones(4, 1))
        >>> state, metrics = step(state, bad)  # skipped: params kept, scale backs off
        >>> metrics["found_inf"], metrics["skipped"], state.params["w"].flatten()
        (tensor(True), tensor(1, dtype=torch.int32), tensor([0.2000, 0.2000]))
        >>> float(state.scaler.scale)
        512.0
    """
    options = StepOptions(
        has_aux,
        returns_buffers,
        compile,
        donate_state,
        headroom,
        grad_norm,
        cache_dir,
        specialize,
        compiler_patches,
    )
    if group is not None and mesh is not None:
        raise ValueError(
            f"funcamp.{API}: give `mesh` or `group`, not both: a sharded step is also data "
            "parallel over the mesh's ranks (its process group)"
        )
    pol = as_policy(policy, API)
    margin = pol.fp8.recipe.margin if pol.fp8 is not None else 0
    parallel = None
    if group is not None:
        parallel = DataParallel(group, margin=margin, api=API)
    elif mesh is not None:
        parallel = Sharded(mesh, margin=margin, api=API)
    return build_train_step(
        loss_fn, optimizer, pol, parallel=parallel, step_options=options, **compile_options
    )
