"""The step algorithm: :func:`unscale_and_step`.

It unscales, runs the optimizer, and skips an overflowed step. It has an eager fast path and a
traced (pure) path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp._core.checks import check_flag, check_grads_match
from funcamp._core.collectives import Across, any_across, summing_across
from funcamp._core.context import compiling, plain_eager_tensors
from funcamp._core.donation import writing
from funcamp._core.numerics import as_dtype
from funcamp._core.tree import (
    PyTree,
    describe,
    insertion_order,
    plan_write,
    sharing_memory,
    storage_key,
    unflatten,
)
from funcamp.optim._accumulate import accumulation_window, close_window, reporting_accumulated
from funcamp.optim._base import (
    Optimizer,
    Prepared,
    Writes,
    apply_updates,
    apply_updates_owned,
    check_optimizer,
    exclusive,
    prepare_update,
    update_tensors,
)
from funcamp.scaling.ops import (
    disjoint,
    floating_leaves,
    fused_unscale,
    refill,
    unscale_leaves,
)
from funcamp.scaling.skip import Skip, check_condition
from funcamp.scaling.state import ScalerState, check_scaler

__all__ = ["StepInfo", "unscale_and_step"]


class StepInfo(NamedTuple):
    """What :func:`unscale_and_step` learned about the step, as tensors (no host sync).

    Attributes:
        found_inf: 0-d bool, True when the scaled gradients had an inf or nan and the step was
            skipped.
        grad_norm: 0-d float32, the global L2 norm of the unscaled gradients, summed in the
            grads dict's order (as ``clip_grad_norm_``). ``None`` with ``grad_norm=False``.
        user_skip: 0-d bool, the answer of ``skip_if``: True when it skipped the step (False
            without ``skip_if``).

    Example:
        >>> import torch, funcamp
        >>> info = funcamp.StepInfo(torch.tensor(False), torch.tensor(1.5))
        >>> info.found_inf, info.grad_norm
        (tensor(False), tensor(1.5000))
    """

    found_inf: torch.Tensor
    grad_norm: torch.Tensor | None
    user_skip: torch.Tensor | None = None


def _in_order(grads: Any, idx: list[int], out: list[torch.Tensor]) -> list[torch.Tensor]:
    """``out`` (the grads' floating leaves ``idx``) in the grads dict's insertion order, the
    order torch's ``clip_grad_norm_`` sums ``model.parameters()`` in."""
    order = insertion_order(grads)
    if order is None:
        return out
    pos = {i: j for j, i in zip(range(len(idx)), idx)}
    return [out[pos[i]] for i in order if i in pos]


def _global_norm(leaves: list[torch.Tensor], device: torch.device, eager: bool) -> torch.Tensor:
    if not leaves:
        return torch.zeros((), dtype=torch.float32, device=device)
    if eager:
        norms = list(torch._foreach_norm(leaves))
    else:
        norms = [torch.linalg.vector_norm(x) for x in leaves]
    norms = [as_dtype(n if n.device == device else n.to(device), torch.float32) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms))


def unscale_and_step(
    state: ScalerState,
    optimizer: Optimizer,
    grads: PyTree,
    opt_state: PyTree,
    params: PyTree,
    *,
    group: Any = None,
    donate_grads: bool = False,
    donate_state: bool = False,
    grad_norm: bool = True,
    across: Across | None = None,
    skip_if: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[PyTree, PyTree, StepInfo]:
    """Unscale ``grads``, apply ``optimizer``, and skip the step if the grads overflowed.

    Runs :func:`unscale`, then ``optimizer.update(grads, opt_state, params)`` and
    :func:`funcamp.apply_updates`. Where ``found_inf`` is True, the old ``params`` and
    ``opt_state`` are returned bit-identical. (They are selected leaf-wise with
    :func:`funcamp.tree_select`, with no host sync.) Call :func:`update` with ``info.found_inf``
    afterwards.

    The inputs are checked first: trees, shapes, the optimizer state against the params, the
    learning rate. That happens before the grads are touched or anything is written. So a refused
    call changes nothing, donated or not. A tensor learning rate that is NaN, infinite or negative
    at run time skips the step like an overflow (``found_inf`` is True).

    With :func:`funcamp.accumulate` in ``optimizer``, a window of ``every`` calls is
    ``torch.amp.GradScaler``'s optimizer step. ``found_inf`` is the window's: an inf or nan in any
    of its micro-batches so far. Where the window closes with ``found_inf``, its update is skipped
    whole, and the inner optimizer's state stays as it was. The next window then starts.
    ``grad_norm`` is the accumulated gradient's, on the call that closes the window. Call
    :func:`update` only where ``funcamp.accumulate_applies(opt_state)`` held before the call (the
    train step does). That matches GradScaler's ``update()``, which runs once per optimizer step.

    Donated states: with ``donate_state=True`` the new values are written into the tensors of
    ``params`` and ``opt_state``, which are returned. (Compiled, inductor stores straight into
    them.) Some optimizers run torch's fused kernel on plain float32 tensors: :func:`funcamp.sgd`
    without momentum, and ``adam``/``adamw`` with ``fused=True``. The kernel skips on ``found_inf``
    by itself. That is one pass over the params, and ``torch.optim``'s fused results bit for bit.
    The other built-in optimizers write each new buffer into the old one as soon as it is known,
    selected on ``found_inf``. Tensors of ``params``/``opt_state`` that share memory are refused.

    Args:
        state: the scaler state the loss was scaled with.
        optimizer: a :class:`funcamp.Optimizer`.
        grads: scaled gradients, with the structure and shapes of ``params``.
        opt_state: the optimizer state.
        params: the parameters.
        group: optional process group. When given, ``found_inf`` is OR-ed across its ranks
            (:func:`funcamp.distributed.any_across`), so every rank skips together.
        donate_grads: for callers that never use ``grads`` again. In plain eager their memory
            may then be reused for the results, with identical values. Default False: no
            argument is ever modified.
        donate_state: write the new params and optimizer state into the tensors of
            ``params`` and ``opt_state``, as ``torch.optim`` does. For callers that keep only
            the returned ones. See "Donated states" above.
        grad_norm: compute ``info.grad_norm``, the global L2 norm of the unscaled gradients
            (default True): one more pass over every gradient. ``False``: ``None``.
        across: gradients held as shards (:class:`funcamp.distributed.Across`). Then
            ``found_inf`` and the norm cover every rank, and so does
            :func:`funcamp.clip_by_global_norm` inside ``optimizer``.
        skip_if: ``(grad_norm) -> 0-d bool tensor``, a condition of your own on
            ``info.grad_norm``. Where it holds, the step is skipped as on an overflow, but
            ``found_inf`` stays False, so the scaler does not back off.

    Returns:
        ``(params, opt_state, StepInfo(found_inf, grad_norm, user_skip))``. ``grad_norm`` is the
        global L2 norm of the unscaled gradients (float32), or ``None`` with ``grad_norm=False``.

    Example:
        >>> import torch, funcamp
        >>> s, opt = funcamp.ScalerState.dynamic(init_scale=4.0), funcamp.sgd(0.5)
        >>> params = {"w": torch.tensor([1.0, 1.0])}
        >>> opt_state = opt.init(params)
        >>> grads = {"w": torch.tensor([4.0, 0.0])}
        >>> new, opt_state, info = funcamp.unscale_and_step(s, opt, grads, opt_state, params)
        >>> new["w"], info.found_inf, info.grad_norm
        (tensor([0.5000, 1.0000]), tensor(False), tensor(1.))
        >>> bad = {"w": torch.tensor([float("nan"), 0.0])}
        >>> funcamp.unscale_and_step(s, opt, bad, opt_state, new)[0]["w"]
        tensor([0.5000, 1.0000])

        Donating grads that nobody else holds (here made on the spot) skips their copy:

        >>> new, opt_state, info = funcamp.unscale_and_step(
        ...     s, opt, {"w": torch.tensor([4.0, 0.0])}, opt_state, new, donate_grads=True
        ... )
        >>> new["w"]
        tensor([0., 1.])
    """
    api = "unscale_and_step"
    flat = _check_step_args(api, state, optimizer, grads, params, donate_grads, donate_state)
    check_flag(api, "grad_norm", grad_norm)
    _check_skip_if(api, skip_if, grad_norm)
    # Everything that can refuse these inputs runs before the grads are touched (donated grads
    # are unscaled in place) and before anything is written (donate_state): the optimizer
    # prepares its update here (its state checked against the params, its learning rate read).
    prepared = prepare_update(optimizer, grads, opt_state, params)
    bad_lr = prepared.unusable_lr
    if donate_state and not compiling():
        shared = sharing_memory({"params": params, "opt_state": opt_state})
        if shared is not None:
            raise ValueError(
                f"funcamp.{api}: with donate_state=True the new values are written into the "
                f"tensors of `params` and `opt_state`, but {shared[0]} and {shared[1]} share "
                "memory; give each its own tensor (clone) or pass donate_state=False"
            )
    # funcamp.accumulate: read before the step writes a donated state (see _window_flags)
    window = accumulation_window(optimizer, opt_state)
    leaves, spec, idx = floating_leaves(grads, flat)
    floating = [leaves[i] for i in idx]
    # The execution path, chosen once: eager (torch's fused unscale kernel, in-place reuse of
    # this step's temporaries, the optimizer's fused kernel on a donated state) or traced (pure
    # ops; under compile inductor fuses the whole step anyway). Results are identical.
    # (Under torch.compile the answer is "traced" without looking at the inputs.)
    traced = compiling()
    if traced:
        # Compiled, the step still calls torch's multi-tensor kernels (the fused unscale,
        # _foreach_norm, the optimizer's fused kernel) where the tensors are plain: inductor
        # calls them as they are rather than generating C++ for a check, a multiply, a norm
        # and an update per leaf -- most of a step's first-call compile on the CPU.
        # The grads decide the unscale and the norm (the params' own check, a few graph nodes
        # a leaf while dynamo traces, is asked only for the optimizer's fused kernel, below).
        inputs = []
        kernels = fused_unscale(floating)
    else:
        inputs = update_tensors(params) + update_tensors(opt_state) + update_tensors(state)
        kernels = fused_unscale(floating + inputs)
    eager = kernels and not traced
    taken: set[int | None] = set()
    donate = False
    if eager:
        taken = {storage_key(x) for x in inputs}
        donate = donate_grads and disjoint(floating, taken)
        if not donate:
            taken.update(storage_key(x) for x in floating)
    norm = None
    if _checked_by_norm(state, eager, donate, grad_norm, across, floating):
        # Nothing to unscale: the grads are the unscaled ones, and the norm the step reports
        # is finite exactly when they are (or finite enough to sum their squares), the check
        # clip_grad_norm_(error_if_nonfinite=True) makes: no pass of its own.
        out = floating
        norm = _global_norm(_in_order(grads, idx, out), state.scale.device, kernels)
        found_inf = ~torch.isfinite(norm)
    else:
        out, found_inf = unscale_leaves(floating, state.scale, kernels, donate=donate)
    unscaled = unflatten(spec, refill(leaves, idx, out))
    if group is not None:
        found_inf = any_across(found_inf, group)
    if bad_lr is not None:  # a NaN/inf/negative tensor learning rate: the step is skipped
        found_inf = found_inf | bad_lr.to(found_inf.device)
    # Before the optimizer: on the eager path it may overwrite the unscaled grads in place.
    if across is not None:  # shards: the flag and the norm over every rank, in one all-reduce
        found_inf, total = across.reduce(found_inf, [x.float().square().sum() for x in out])
        norm = total.sqrt() if grad_norm else None
    elif grad_norm and norm is None:
        norm = _global_norm(_in_order(grads, idx, out), state.scale.device, kernels)
    # The step is skipped where `skip`: found_inf, or, under funcamp.accumulate, the window's,
    # or where the caller's skip_if holds (which found_inf, and so the scaler, never sees).
    skip, found_inf, accumulated = _window_flags(window, found_inf)
    asked = _Asked(api, skip_if, window)
    if skip_if is not None and window is None:
        skip = skip | asked(norm)
    report = None
    if accumulated is not None and grad_norm:

        def report(avg: list[torch.Tensor]) -> None:  # the accumulated gradient's norm
            if across is not None:
                flag = torch.zeros((), dtype=torch.bool, device=state.scale.device)
                total = across.reduce(flag, [x.float().square().sum() for x in avg])[1]
                accumulated.append(total.sqrt())
            else:
                accumulated.append(_global_norm(avg, state.scale.device, kernels))

    params_out, opt_state_out = _step(
        prepared, unscaled, opt_state, params, Skip(skip), out, taken,
        kernels=kernels, eager=eager, donate_state=donate_state, across=across,
        report=report, late=asked.late(norm, accumulated),
    )  # fmt: skip
    if window is not None:
        if skip_if is not None:  # the window's flag, with the condition asked after the update
            skip = skip | asked.late(norm, accumulated)()  # type: ignore[misc]
        opt_state_out = close_window(opt_state_out, window, skip, found_inf, donate_state)
        if accumulated:  # the accumulated gradient's norm on the micro-step that applies
            norm = torch.where(window.applies.to(norm.device), accumulated[0], norm)
    user_skip = asked.answer if asked.answer is not None else torch.zeros_like(found_inf)
    return params_out, opt_state_out, StepInfo(found_inf, norm, user_skip)


class _Asked:
    """The caller's ``skip_if``, asked once a step, and its answer.

    Without :func:`funcamp.accumulate` it is asked before the update, with the step's norm.
    With it, the update it decides is the window's, whose gradient (the accumulated one) is
    known only inside the update: it is asked after, and only the micro-step that closes the
    window can be skipped by it (:func:`_step`, ``late``).
    """

    def __init__(self, api: str, skip_if: Any, window: Any) -> None:
        self.api, self.skip_if, self.window = api, skip_if, window
        self.answer: torch.Tensor | None = None

    def __call__(self, norm: torch.Tensor) -> torch.Tensor:
        if self.answer is None:
            answer = check_condition(self.api, self.skip_if(norm)).to(norm.device)
            if self.window is not None:  # only the update that closes the window is skipped
                answer = answer & self.window.applies.to(answer.device)
            self.answer = answer
        return self.answer

    def late(
        self, norm: torch.Tensor | None, accumulated: list[torch.Tensor] | None
    ) -> Callable[[], torch.Tensor] | None:
        """Under :func:`funcamp.accumulate`, the condition on the accumulated gradient's norm
        (on a step skipped before its update, the step's own norm); else None."""
        if self.skip_if is None or self.window is None:
            return None
        return lambda: self(accumulated[0] if accumulated else norm)  # type: ignore[arg-type]


def _check_skip_if(api: str, skip_if: Any, grad_norm: bool) -> None:
    if skip_if is None:
        return
    if not callable(skip_if):
        raise TypeError(
            f"funcamp.{api}: `skip_if` must be callable (the gradient norm -> a 0-d bool "
            f"tensor) or None, got {describe(skip_if)}"
        )
    if not grad_norm:
        raise ValueError(
            f"funcamp.{api}: `skip_if` is asked with the step's gradient norm, which "
            "grad_norm=False leaves out; drop one of the two"
        )


def _checked_by_norm(
    state: ScalerState,
    eager: bool,
    donate: bool,
    grad_norm: bool,
    across: Any,
    floating: list[torch.Tensor],
) -> bool:
    """Whether the overflow check is the gradient norm's finiteness: a ``noop`` scaler (scale
    1, nothing to unscale) on the eager path, with donated grads already in their math dtype
    and the norm asked for anyway."""
    if state.kind != "noop" or not (eager and donate and grad_norm) or across is not None:
        return False
    return all(x.dtype in (torch.float32, torch.float64) for x in floating)


def _window_flags(
    window: Any, found_inf: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
    """``(skip, found_inf, accumulated)``: without :func:`funcamp.accumulate`, the step is
    skipped where ``found_inf``. With it, ``torch.amp.GradScaler``'s optimizer step: an inf or
    nan in any micro-batch of the window (``found_inf`` becomes the window's so far) skips the
    window's update, on its last micro-step (the others apply nothing); ``accumulated`` receives
    the accumulated gradient's norm."""
    if window is None:
        return found_inf, found_inf, None
    found_inf = found_inf | window.overflowed.to(found_inf.device)
    return found_inf & window.applies.to(found_inf.device), found_inf, []


def _step(
    prepared: Prepared,
    unscaled: PyTree,
    opt_state: PyTree,
    params: PyTree,
    skip: Skip,
    out: list[torch.Tensor],
    taken: set[int | None],
    *,
    kernels: bool,
    eager: bool,
    donate_state: bool,
    across: Across | None,
    report: Callable[[list[torch.Tensor]], None] | None,
    late: Callable[[], torch.Tensor] | None = None,
) -> tuple[PyTree, PyTree]:
    """The update on the path chosen, skipped through ``skip``: ``(params, opt_state)``.

    Eager, the unscaled grads ``out`` are this step's own (or donated): the update may
    overwrite them, and a ``fresh`` update's new tensors are reused in place. With
    ``donate_state`` the update may write its new buffers into the old ones (and torch's fused
    kernels the params too, on plain tensors); the rest is selected and written here, both
    trees matched before either is written: all or nothing. ``late`` (a condition known only
    after the update runs) adds to ``skip`` then; the update writes nothing through it."""
    if skip.decided and report is None:  # known on the host (the CPU's eager path): skipped
        return params, opt_state  # (an accumulated norm to report still runs the update)
    # the optimizer's fused kernel checks its own params (only an optimizer with one pays)
    writes = Writes(
        out if eager else (),
        skip if donate_state and late is None else None,
        kernels and donate_state and late is None,
        new_params=True,  # installed below: an update may give the new params bit for bit
    )
    with summing_across(across), reporting_accumulated(report):
        updates, new_opt_state = prepared.run(unscaled, writes)
    if late is not None:
        skip = skip.also(late())
        if skip.decided:
            return params, opt_state
    if updates is None:  # a fused kernel updated the donated params and state in place
        return params, new_opt_state
    if not eager:
        new_params = apply_updates(params, updates)
        if donate_state:
            write_params = skip.plan_write(params, new_params)
            write_opt_state = skip.plan_write(opt_state, new_opt_state)
            return write_params(), write_opt_state()
        return skip.select(params, new_params), skip.select(opt_state, new_opt_state)
    owned = None
    if prepared.fresh:  # each new tensor that shares memory with no input is ours to reuse
        made = update_tensors(updates) + update_tensors(new_opt_state)
        if plain_eager_tensors(made):
            ours = {id(x) for x, ok in zip(made, exclusive(made, [])) if ok}

            def owned(x: torch.Tensor) -> bool:
                return id(x) in ours and storage_key(x) not in taken

    # a delta receives its new param after the skip's mask, a new state leaf its selection
    new_params, fresh, done = apply_updates_owned(
        params, updates, owned, skip.mask_delta if owned is not None else None
    )
    params_out = skip.select(params, new_params, lambda x: id(x) in fresh, lambda x: id(x) in done)
    opt_state_out = skip.select(opt_state, new_opt_state, owned or (lambda x: False))
    if donate_state:
        write_params = plan_write(params_out, params)
        write_opt_state = plan_write(opt_state_out, opt_state)
        writing()
        params_out, opt_state_out = write_params(), write_opt_state()
    return params_out, opt_state_out


def _check_step_args(
    api: str,
    state: Any,
    optimizer: Any,
    grads: PyTree,
    params: PyTree,
    donate_grads: Any,
    donate_state: Any,
) -> tuple[list[Any], Any]:
    """Validate :func:`unscale_and_step`'s arguments; returns the grads flattened (leaves,
    treespec)."""
    check_scaler(api, state)
    check_optimizer(api, "optimizer", optimizer)
    check_flag(api, "donate_grads", donate_grads)
    check_flag(api, "donate_state", donate_state)
    return check_grads_match(api, grads, params)
