"""Loss scaling as pure functions over a :class:`~funcamp.ScalerState`.

The functions are :func:`scale`, :func:`unscale` and :func:`update`. :func:`update` reproduces
``torch._amp_update_scale_`` bit for bit: the products are computed in float64 and rounded to
float32, as torch's kernel does. It adds ``min_scale``/``max_scale`` clamps and Megatron-LM's
hysteresis. Nothing on the step path syncs with the host.

Workaround of torch internals (docs/internals.md#workarounds):

- Root cause: GradScaler's kernels (torch._amp_foreach_non_finite_check_and_unscale_,
  torch._amp_update_scale_) have no public functional entry.
- Upstream: none filed.
- Why it is safe: called as GradScaler calls them, on copies; bit-identical to the traced path
  and to GradScaler (tests/test_scaler_vs_torch.py).
- Tested on: torch 2.13 and 2.14.
- Delete when: torch.amp exposes a functional unscale and update.

"""

from __future__ import annotations

from typing import Any

import optree
import torch

from funcamp._core.checks import check_flag
from funcamp._core.context import compiling, plain_eager_tensors, plain_tensors
from funcamp._core.numerics import hoist_scalar, math_dtype, spread
from funcamp._core.tree import (
    NAMESPACE,
    PyTree,
    flatten,
    self_overlapping,
    storage_key,
    unflatten,
)
from funcamp.scaling.state import ScalerState, check_found_inf, check_scaler

__all__ = ["scale", "unscale", "update"]


def scale(state: ScalerState, tree: PyTree) -> PyTree:
    """Multiply the floating tensor leaves of ``tree`` (usually the loss) by the scale.

    The product is computed in float32. Float16/bfloat16 leaves are upcast first, so a scaled
    float16 loss cannot overflow. Float64 leaves stay float64, as with ``GradScaler.scale``.
    Integer, bool and non-tensor leaves pass through.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.ScalerState.dynamic(init_scale=8.0)
        >>> funcamp.scale(s, torch.tensor(0.5, dtype=torch.float16))
        tensor(4.)
    """
    check_scaler("scale", state)

    def mul(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        return x.to(math_dtype(x.dtype)) * state.scale.to(x.device)

    return optree.tree_map(mul, tree, namespace=NAMESPACE)


def fused_unscale(leaves: list[torch.Tensor]) -> bool:
    """Whether unscaling runs torch's fused kernel on copies of the leaves.

    The kernel is ``_amp_foreach_non_finite_check_and_unscale_``: one pass for the check and the
    multiply. It runs on :func:`~funcamp._core.context.plain_tensors`: plain eager, or compiled.
    Compiled, inductor calls it (inside ``funcamp::unscale``) instead of generating a check and
    a multiply per leaf. It has no autograd formula and no vmap rule. So under functorch
    transforms and autograd the traced path's pure ops run, with identical results.
    """
    return hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_") and plain_tensors(leaves)


def floating_leaves(
    grads: PyTree, flat: tuple[list[Any], Any] | None = None
) -> tuple[list[Any], Any, list[int]]:
    """``(leaves, treespec, indices of the floating tensor leaves)`` of ``grads``.

    ``flat`` is its leaves and treespec, when the caller has them.
    """
    leaves, spec = flatten(grads) if flat is None else flat
    idx = [
        i
        for i, x in zip(range(len(leaves)), leaves)  # dynamo traces enumerate in Python
        if isinstance(x, torch.Tensor) and x.is_floating_point()
    ]
    return leaves, spec, idx


def refill(leaves: list[Any], idx: list[int], out: list[torch.Tensor]) -> list[Any]:
    """``leaves`` with the floating ones (at ``idx``) replaced by ``out``."""
    new_leaves = list(leaves)
    for i, x in zip(idx, out):
        new_leaves[i] = x
    return new_leaves


def _unscale_fused(
    leaves: list[torch.Tensor], inv_scale: torch.Tensor, donate: bool
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """torch's fused ``_amp_foreach_non_finite_check_and_unscale_`` on fresh copies of the
    leaves (the caller's tensors only when donated, and then only those already in the
    unscaled dtype), grouped by device and dtype as the kernel requires; it writes 1.0 into
    ``found`` (a float, per device) on inf/nan. Returns ``(unscaled, found_inf)``, the flag a
    0-d bool on ``inv_scale``'s device (the scale's)."""
    out = [
        x if donate and x.dtype == math_dtype(x.dtype) else x.to(math_dtype(x.dtype), copy=True)
        for x in leaves
    ]
    groups: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for x in out:  # get_device (-1 on the CPU): reading x.device costs more, per leaf
        groups.setdefault((x.get_device(), x.dtype), []).append(x)
    flags = []
    for group in groups.values():
        device = group[0].device
        found = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale.to(device))
        flags.append(found.to(inv_scale.device))
    found_inf = torch.stack(flags).sum() > 0 if len(flags) > 1 else flags[0] > 0
    return out, found_inf


def _define_unscale() -> Any:
    """``funcamp::unscale(leaves, inv_scale) -> [*unscaled, found_inf]``: :func:`_unscale_fused`
    as an op for compiled steps, in place of the kernel's functional form.

    Why an op of our own: its inputs keep their traced (eager) strides. Inductor lays a CNN's
    convolutions out channels-last, and the weight gradients with them; through torch's
    functional unscale (an op of flexible layout) they reached the optimizer's update
    channels-last while the params and moments are contiguous, and inductor generated each such
    leaf's update as a tiled transpose, twice the code (ResNet's AdamW kernel: 193 KB of C++,
    136 KB through this op, torch's compiled AdamW 132 KB; code generation, the largest part of
    a CPU compile, grows with it). With ``needs_fixed_stride_order`` inductor writes the
    gradients in the params' order where it casts them (one transposed copy, which it made
    anyway) and everything after reads plain loops. Same kernel, same bits. It has no autograd formula and no vmap rule
    (:func:`fused_unscale` keeps functorch transforms and autograd on the pure ops)."""
    try:
        return torch.ops.funcamp.unscale.default  # already defined (a reimported module)
    except (AttributeError, RuntimeError):
        pass

    def kernel(leaves: list[torch.Tensor], inv_scale: torch.Tensor) -> list[torch.Tensor]:
        out, found_inf = _unscale_fused(leaves, inv_scale, donate=False)
        return [*out, found_inf]

    def fake(leaves: list[torch.Tensor], inv_scale: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(x, dtype=math_dtype(x.dtype)) for x in leaves]
        return [*out, torch.empty((), dtype=torch.bool, device=inv_scale.device)]

    try:
        op_def = torch.library.custom_op(
            "funcamp::unscale",
            kernel,
            mutates_args=(),
            tags=(torch.Tag.needs_fixed_stride_order,),
        )
    except TypeError:  # pragma: no cover - a torch whose custom_op takes no tags (custom
        # ops there keep their traced stride order by default)
        op_def = torch.library.custom_op("funcamp::unscale", kernel, mutates_args=())
    op_def.register_fake(fake)
    return torch.ops.funcamp.unscale.default


_UNSCALE = _define_unscale()


def unscale_leaves(
    leaves: list[torch.Tensor], scale_tensor: torch.Tensor, fused: bool, *, donate: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor]:
    # torch's rule: the reciprocal is taken in float64, then rounded to float32.
    inv_scale = hoist_scalar(scale_tensor.double().reciprocal().float())
    if not leaves:
        return [], torch.zeros((), dtype=torch.bool, device=scale_tensor.device)
    if fused:
        if compiling():
            *out, found_inf = _UNSCALE(leaves, inv_scale)
            return out, found_inf
        return _unscale_fused(leaves, inv_scale, donate)
    finite = [torch.isfinite(x).all().to(scale_tensor.device) for x in leaves]
    found_inf = ~torch.stack(finite).all()
    out = [
        x.to(math_dtype(x.dtype)) * inv.to(x.device)
        for x, inv in zip(leaves, spread(inv_scale, len(leaves)))
    ]
    return out, found_inf


def unscale(
    state: ScalerState, grads: PyTree, *, donate_grads: bool = False
) -> tuple[PyTree, torch.Tensor]:
    """Divide scaled gradients by the scale and check them for inf/nan.

    Floating leaves are returned in float32; float64 stays float64. Float16 and bfloat16 grads are
    unscaled in float32, which ``GradScaler.unscale_`` refuses to do for float16. They are
    multiplied by ``float32(1 / float64(scale))``, exactly as ``GradScaler`` does. ``found_inf`` is
    a 0-d bool tensor, True when any *scaled* gradient is inf or nan (torch's rule). Integer and
    non-tensor leaves pass through. The input tensors are never modified; no host sync.

    Plain CPU/CUDA tensors use torch's fused ``_amp_foreach_non_finite_check_and_unscale_`` on
    fresh copies. They do so in eager code and under ``torch.compile``, where inductor calls it
    inside the ``funcamp::unscale`` op. Under ``torch.func`` transforms or autograd, a pure-torch
    path with bit-identical results runs instead.

    Args:
        state: the scaler state the loss was scaled with.
        grads: scaled gradients (any pytree).
        donate_grads: for callers that never use ``grads`` again. In plain eager, float32 and
            float64 leaves are then unscaled in place, saving a copy. Default False: ``grads``
            are never modified.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.ScalerState.dynamic(init_scale=4.0)
        >>> grads, found_inf = funcamp.unscale(s, {"w": torch.tensor([8.0, 2.0])})
        >>> grads, found_inf
        ({'w': tensor([2.0000, 0.5000])}, tensor(False))
        >>> funcamp.unscale(s, {"w": torch.tensor([float("inf")])})[1]
        tensor(True)
        >>> mine = {"w": torch.tensor([8.0, 2.0])}  # donated: unscaled in place, then reused
        >>> funcamp.unscale(s, mine, donate_grads=True)[0]["w"] is mine["w"]
        True
    """
    check_scaler("unscale", state)
    check_flag("unscale", "donate_grads", donate_grads)
    leaves, spec, idx = floating_leaves(grads)
    floating = [leaves[i] for i in idx]
    fused = fused_unscale(floating)
    donate = donate_grads and fused and not compiling() and disjoint(floating, set())
    out, found_inf = unscale_leaves(floating, state.scale, fused, donate=donate)
    return unflatten(spec, refill(leaves, idx, out)), found_inf


def update(state: ScalerState, found_inf: torch.Tensor) -> ScalerState:
    """Return the next scaler state after a step whose overflow flag is ``found_inf``.

    ``skipped`` counts up on every overflow, for every kind. ``static`` and ``noop`` scalers keep
    their scale. A ``dynamic`` scaler follows ``torch._amp_update_scale_`` bit for bit (float64
    products rounded to float32). On overflow the scale is multiplied by ``backoff_factor``, and
    the growth tracker resets. Otherwise the tracker counts up. When it reaches
    ``growth_interval``, it resets, and the scale is multiplied by ``growth_factor`` (unless the
    grown value is not finite). Then ``min_scale``/``max_scale`` clamp the backed-off or grown
    value.

    With ``hysteresis=h`` (Megatron-LM's ``DynamicGradScaler``), each overflow also decrements a
    hysteresis tracker that starts at ``h``. The scale backs off only when that tracker reaches 0,
    and on every overflow while it stays 0. The tracker returns to ``h`` at each growth step
    (``growth_interval`` clean steps in a row). ``h=1`` is torch's rule.

    Args:
        state: the current state.
        found_inf: 0-d bool tensor, True when this step's gradients overflowed.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.ScalerState.dynamic(init_scale=16.0, growth_interval=2)
        >>> for flag in [False, False, True]:
        ...     s = funcamp.update(s, torch.tensor(flag))
        ...     print(float(s.scale), int(s.growth_tracker))
        16.0 1
        32.0 0
        16.0 0
    """
    check_scaler("update", state)
    check_found_inf("update", found_inf)
    found_inf = found_inf.to(state.scale.device)
    skipped = state.skipped + found_inf.to(state.skipped.dtype)
    if state.kind != "dynamic":
        return state._with_leaves(
            state.scale, state.growth_tracker, state.hysteresis_tracker, skipped
        )

    if _kernel_updates(state, found_inf):
        return _update_with_kernel(state, found_inf, skipped)

    current = state.scale
    as_f64 = current.double()
    backed_off = (as_f64 * state.backoff_factor).float()
    grown = (as_f64 * state.growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, current)
    if state.min_scale is not None:
        backed_off = torch.clamp_min(backed_off, state.min_scale)
    if state.max_scale is not None:
        grown = torch.clamp_max(grown, state.max_scale)

    tracker = state.growth_tracker
    zero = torch.zeros_like(tracker)
    successful = tracker + 1
    grow_now = successful == state.growth_interval
    clean_scale = torch.where(grow_now, grown, current)
    clean_tracker = torch.where(grow_now, zero, successful)

    hysteresis = state.hysteresis_tracker
    if state.hysteresis == 1:
        # torch's rule; the tracker still follows Megatron's bookkeeping (0 after an overflow,
        # back to 1 when the scale grows).
        overflow_scale = backed_off
        overflow_hysteresis = torch.zeros_like(hysteresis)
    else:
        overflow_hysteresis = torch.clamp_min(hysteresis - 1, 0)
        overflow_scale = torch.where(overflow_hysteresis <= 0, backed_off, current)
    clean_hysteresis = torch.where(
        grow_now, torch.full_like(hysteresis, state.hysteresis), hysteresis
    )

    return state._with_leaves(
        torch.where(found_inf, overflow_scale, clean_scale),
        torch.where(found_inf, zero, clean_tracker),
        torch.where(found_inf, overflow_hysteresis, clean_hysteresis),
        skipped,
    )


def _kernel_updates(state: ScalerState, found_inf: torch.Tensor) -> bool:
    """Whether :func:`update` of this dynamic scaler runs torch's own kernel: torch's rule (no
    hysteresis, no min/max scale), on the eager path (see
    :func:`funcamp._core.context.plain_eager_tensors`), with a float32 scale and an int32
    tracker, which ``torch._amp_update_scale_`` requires."""
    return (
        state.hysteresis == 1
        and state.min_scale is None
        and state.max_scale is None
        and hasattr(torch, "_amp_update_scale_")
        and state.scale.dtype == torch.float32
        and state.growth_tracker.dtype == torch.int32
        and plain_eager_tensors(
            [state.scale, state.growth_tracker, state.hysteresis_tracker, found_inf]
        )
    )


def _update_with_kernel(
    state: ScalerState, found_inf: torch.Tensor, skipped: torch.Tensor
) -> ScalerState:
    """:func:`update` where :func:`_kernel_updates` holds: torch's
    ``_amp_update_scale_`` (the rule GradScaler runs, which the traced path reproduces bit for
    bit) on copies, in one kernel instead of some twenty small ops."""
    scale, tracker = state.scale.clone(), state.growth_tracker.clone()
    torch._amp_update_scale_(
        scale,
        tracker,
        found_inf.to(torch.float32),
        state.growth_factor,
        state.backoff_factor,
        state.growth_interval,
    )
    # The hysteresis tracker's bookkeeping for h=1 (as the traced path): 0 after an overflow,
    # 1 again at each growth step. The growth tracker is 0 after exactly those two events.
    hysteresis = state.hysteresis_tracker
    hysteresis = torch.where(tracker == 0, (~found_inf).to(hysteresis.dtype), hysteresis)
    return state._with_leaves(scale, tracker, hysteresis, skipped)


def disjoint(leaves: list[torch.Tensor], taken: set[int | None]) -> bool:
    """Whether ``leaves`` are free of shared memory.

    No two of them may share memory, none with ``taken``, and none with itself (an expanded
    grad).
    """
    seen: set[int | None] = set()
    for x in leaves:
        key = storage_key(x)
        if key is not None and (key in seen or key in taken or self_overlapping(x)):
            return False
        seen.add(key)
    return True
