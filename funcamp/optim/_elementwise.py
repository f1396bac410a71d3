"""From an algorithm to an :class:`~funcamp.Optimizer`: everything around the math, once.

:func:`elementwise` takes an optimizer's algorithm, a short function of lists of tensors. It adds
what every funcamp optimizer needs:

* validation of the inputs, and of the state against them;
* the learning rate: a float, a tensor or a schedule of the step count (an unusable value skips
  the step);
* the step count and the empty-grads case;
* the state's buffers and the low-precision modes (master weights, Kahan, stochastic rounding);
* the execution path (:mod:`funcamp.optim._paths`) and its fast path
  (:attr:`~funcamp.Optimizer.prepare`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.checks import (
    HyperFn,
    any_flag,
    check_count,
    check_state_like,
    flatten_grads,
    flatten_params,
    learning_rate_fn,
    state_leaves,
)
from funcamp._core.context import compiling, in_transform, is_batched, plain_tensors
from funcamp._core.donation import not_written, writing
from funcamp._core.numerics import math_dtype
from funcamp._core.tree import (
    PyTree,
    describe,
    flatten,
    leaf_path,
    self_overlapping,
    unflatten,
)
from funcamp.optim._base import Optimizer, Prepared, SetParam, Writes
from funcamp.optim._masks import check_selects, leaf_values
from funcamp.optim._modes import check_mode_state, init_mode, math_params, select_mode, to_updates
from funcamp.optim._paths import Ops, choose_ops

__all__ = ["FusedUpdate", "Step", "elementwise", "mask_flags"]
Tensors = list[torch.Tensor]
#: ``step(ops, grads, params, buffers, lr, count) -> (deltas, new_buffers)``.
Step = Callable[..., tuple[Tensors, dict[str, Tensors]]]
#: ``kernel(param_leaves, grad_leaves, state, lr, skip, mask) -> new_state | None``: an
#: in-place fused kernel for float32 params on one CPU/CUDA device, run on a donated state
#: (:class:`~funcamp.optim.Writes` with ``kernels``); ``skip``: the step's skip, whose
#: ``flag`` the kernel reads; ``mask``: the weight-decay mask's flags per leaf, or None.
FusedKernel = Callable[[Tensors, Tensors, Any, Any, torch.Tensor, Any], Any]
#: ``update(param_leaves, grad_leaves, state, lr, mask) -> (new param leaves, new state)``: an
#: optimizer whose update *is* a fused kernel (``adamw(fused=True)``), run on copies.
FusedUpdate = Callable[[Tensors, Tensors, Any, Any, Any], tuple[Tensors, Any]]


def elementwise(
    name: str,
    state: type,
    step: Step,
    learning_rate: Any,
    *,
    buffers: Sequence[str] | None = None,
    needs_params: bool = False,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
    fused_kernel: FusedKernel | None = None,
    mask: Any = None,
    fused_update: FusedUpdate | None = None,
    fill: Mapping[str, float] | None = None,
    scalars: Mapping[str, float] | None = None,
    hyper: Mapping[str, HyperFn] | None = None,
) -> Optimizer:
    """Build an :class:`~funcamp.Optimizer` from an elementwise algorithm, written once.

    The algorithm is ``step(ops, grads, params, buffers, lr, count) -> (deltas, new_buffers)``.
    It returns the deltas to add to the params and the new buffers. It receives lists of tensors,
    one per param leaf, in the math dtype (float32, or float64 for float64 params):

    * ``grads``;
    * ``params``: the float32 masters in master-weights mode. None when ``update`` got no params
      and ``needs_params`` is False;
    * ``buffers``: a dict from each buffer name to its list;
    * ``lr``: a float or a 0-d tensor. It is 0 where a tensor value was unusable, and the step
      is then skipped;
    * ``count``: the 0-d int32 number of updates applied before this one.

    All arithmetic goes through ``ops`` (:class:`~funcamp.optim.Ops`), which runs it on the eager
    or the traced path. A Python scalar is rounded to float32 as torch's kernels round it.
    ``ops.kept(xs)`` marks a list that goes into the new state. ``ops.kept(xs, replaces=buf)``
    makes it the new value of buffer ``buf``, written into it at once on a donated eager step;
    ``buf`` holds the new values afterwards on every path.
    ``into=xs`` lets an op reuse a dead list's memory.

    The fast path: ``unscale_and_step`` and the train step run ``fused_kernel`` in place of
    ``step`` where they donate the state and every param and buffer is a contiguous float32
    tensor on one device. The kernel reads the skip flag itself and must give the algorithm's
    numbers (see the guide to writing an optimizer).

    Args:
        name: the optimizer's name in error messages (``funcamp.<name>: ...``).
        state: a NamedTuple class whose fields are ``count``, the buffer names, and ``low``
            (the low-precision mode's state, ``()`` without one).
        step: the algorithm.
        learning_rate: a float, a 0-d tensor or a schedule ``count -> lr``.
        buffers: the buffer fields in use (default: all between ``count`` and ``low``); the
            others hold ``()``. Buffers start at zero, in the math dtype, shaped like the params.
        needs_params: ``step`` reads ``params`` (weight decay): ``update`` then requires them.
        master_weights: keep float32 copies of half params.
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.
        fill: a buffer's initial value where it is not zero (Adagrad's
            ``initial_accumulator_value``).
        scalars: state fields holding one 0-d float32 tensor for all leaves, by name, with
            their initial value (NAdam's ``mu_product``). ``step`` receives and returns each in
            ``buffers`` as the tensor itself.
        fused_kernel: the fast path's in-place kernel, or None: ``kernel(params, grads,
            state, lr, skip, mask) -> new_state | None`` on a donated state (None: the leaves
            do not fit it; the algorithm runs instead). Not used with a low-precision mode.
        mask: a weight-decay mask (a pytree of bools, or a callable; see :func:`mask_flags`).
            ``step`` then also gets ``mask=``: one bool per leaf, None without params.
        fused_update: the update *is* this kernel, run on copies (float32 params, no
            ``torch.func`` transforms; its update leaves are :class:`SetParam`).
        hyper: scheduled hyperparameters, name -> ``count -> (value, bad)``. ``step`` then also
            gets ``hyper=``: each one's 0-d float64 value this step; a bad value skips the step,
            as an unusable learning rate does.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a ``state``, with its fast path
        (``prepare``: checks first, then owned grads and a donated state) and learning rate.

    Example:
        >>> import torch, funcamp
        >>> from typing import NamedTuple
        >>> class SignSgdState(NamedTuple):
        ...     count: torch.Tensor
        ...     low: tuple
        >>> def sign_sgd_step(ops, grads, params, buffers, lr, count):
        ...     return ops.mul(ops.sign(grads), ops.scalar(-lr)), {}
        >>> opt = funcamp.optim.elementwise("sign_sgd", SignSgdState, sign_sgd_step, 0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([3.0, -0.5])}, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates), state.count
        ({'w': tensor([-0.1000,  0.1000])}, tensor(1, dtype=torch.int32))
    """
    api, state_type = name, state
    if not isinstance(api, str) or not api:
        raise TypeError(f"funcamp.optim.elementwise: `name` must be a non-empty str, got {api!r}")
    if not callable(step):
        raise TypeError(f"funcamp.{api}: `step` must be callable, got {describe(step)}")
    names, filled, extra = _state_fields(api, state_type, buffers, fill, scalars)
    mode = select_mode(api, master_weights, kahan, stochastic_rounding, seed)
    cfg = _Config(
        api,
        state_type,
        names,
        step,
        learning_rate_fn(api, learning_rate),
        mode,
        needs_params or mode is not None,
        seed,
        mask,
        fused_update,
        filled,
        extra,
        tuple((hyper or {}).items()),
    )

    def init(params: PyTree) -> Any:
        return _init(cfg, params)

    def update(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        return _run(cfg, grads, state, params, Writes())

    def prepare(grads: PyTree, state: Any, params: PyTree = None) -> Prepared:
        if compiling():
            # run() runs the same checks while dynamo traces, so they still raise before
            # anything runs; tracing them twice was a measurable part of a GPT step's trace
            # (docs/benchmarks.md, "Compile time").
            _check_state_type(cfg, state)
        else:
            _flattened(cfg, grads, state, params)

        def run(grads: PyTree, writes: Writes) -> tuple[PyTree | None, Any]:
            if writes.kernels and writes.skip is not None and kernel is not None:
                new_state = _fused(cfg, kernel, grads, state, params, writes.skip)
                if new_state is not None:
                    return None, new_state
            return _run(cfg, grads, state, params, writes)

        return Prepared(_unusable(cfg, state.count), run)

    def rate(state: Any) -> torch.Tensor:
        _check_state_type(cfg, state)
        return _as_rate(cfg.lr_fn(state.count)[0], state.count.device)

    kernel = fused_kernel if mode is None and not cfg.hyper else None
    return Optimizer(init, update, prepare, rate)


def _unusable(cfg: _Config, count: torch.Tensor) -> torch.Tensor | None:
    """This step's flag: its learning rate, or a scheduled hyperparameter, is unusable."""
    flag = cfg.lr_fn(count)[1]
    if not cfg.hyper:
        return flag
    return any_flag([flag, *(fn(count)[1] for _, fn in cfg.hyper)])


def _as_rate(lr: Any, device: torch.device) -> torch.Tensor:
    """The learning rate as a 0-d tensor: a Python float as float64 (torch's lr, a double)."""
    return (
        lr if isinstance(lr, torch.Tensor) else torch.tensor(lr, dtype=torch.float64, device=device)
    )


def _state_fields(
    api: str,
    state_type: type,
    buffers: Sequence[str] | None,
    fill: Mapping[str, float] | None,
    scalars: Mapping[str, float] | None,
) -> tuple[tuple[str, ...], tuple[tuple[str, float], ...], tuple[tuple[str, float], ...]]:
    """The buffers in use, each with its initial value, and the 0-d fields with theirs,
    checked against the fields of ``state_type``."""
    fields = getattr(state_type, "_fields", None)
    if (
        not isinstance(state_type, type)
        or not fields
        or fields[0] != "count"
        or fields[-1] != "low"
    ):
        raise TypeError(
            f"funcamp.{api}: `state` must be a NamedTuple class with fields (count, <buffers>, "
            f"low), got {describe(state_type)}"
        )
    names = tuple(fields[1:-1]) if buffers is None else tuple(buffers)
    extra = dict(scalars or {})
    unknown = [b for b in (*names, *extra) if b not in fields[1:-1]]
    unknown += [b for b in (fill or {}) if b not in names]
    if unknown:
        raise ValueError(
            f"funcamp.{api}: `buffers` must be fields of {state_type.__name__} between count "
            f"and low (`scalars` too; `fill` names buffers in use), got {unknown}"
        )
    filled = tuple((b, float((fill or {}).get(b, 0.0))) for b in names)
    return names, filled, tuple((b, float(v)) for b, v in extra.items())


class _Config(NamedTuple):
    """An elementwise optimizer, as :func:`elementwise` checked it (plain values: a compiled step is
    specialised on them, and a step kept on disk compares them when it is loaded)."""

    api: str
    state_type: type
    names: tuple[str, ...]  # the buffers in use
    step: Step
    lr_fn: Callable[..., Any]  # count -> (lr, unusable flag)
    mode: Any  # the low-precision mode, or None
    need_params: bool
    seed: int
    mask: Any  # the weight-decay mask, or None
    fused_update: FusedUpdate | None  # the update is this kernel (``fused=True``)
    fill: tuple[tuple[str, float], ...] = ()  # each buffer's initial value
    scalars: tuple[tuple[str, float], ...] = ()  # the 0-d float32 fields, initial values
    hyper: tuple[tuple[str, HyperFn], ...] = ()  # the scheduled hyperparameters


def _init(cfg: _Config, params: PyTree) -> Any:
    leaves, spec = flatten_params(cfg.api, params)
    if cfg.fused_update is not None:
        _check_fused(cfg, leaves, spec, "params")
    if cfg.mask is not None:
        mask_flags(cfg.api, cfg.mask, params, strict=True)  # a mask that does not fit fails here
    device = leaves[0].device if leaves else torch.device("cpu")
    state = {f: () for f in cfg.state_type._fields}
    for b, value in cfg.fill:
        state[b] = unflatten(
            spec, [torch.full_like(p, value, dtype=math_dtype(p.dtype)) for p in leaves]
        )
    for b, value in cfg.scalars:
        state[b] = torch.full((), value, dtype=torch.float32, device=device)
    state["count"] = torch.zeros((), dtype=torch.int32, device=device)
    state["low"] = init_mode(cfg.mode, leaves, spec, cfg.seed)
    return cfg.state_type(**state)


def _check_state_type(cfg: _Config, state: Any) -> None:
    if not isinstance(state, cfg.state_type):
        raise TypeError(
            f"funcamp.{cfg.api}: `state` must be a {cfg.state_type.__name__} from this "
            f"optimizer's init, got {type(state).__name__}"
        )


def _flattened(
    cfg: _Config, grads: PyTree, state: Any, params: PyTree
) -> tuple[Tensors, Tensors | None, Any]:
    """Flatten the inputs, checking the state against them (metadata only)."""
    api = cfg.api
    _check_state_type(cfg, state)
    gs, ps, spec = flatten_grads(api, grads, params, need_params=cfg.need_params)
    if ps is not None:
        _check_grads_not_wider(api, gs, ps, grads)
    check_count(api, "count", state.count)
    for b, _ in cfg.scalars:
        check_count(api, b, getattr(state, b), torch.float32)
    if gs and cfg.names:
        dtypes = [math_dtype(r.dtype) for r in (ps if ps is not None else gs)]
        for b in cfg.names:
            leaves = state_leaves(api, b, getattr(state, b), spec)
            check_state_like(api, b, leaves, gs, dtypes, grads)
    if ps is not None:
        check_mode_state(api, cfg.mode, state.low, ps, spec, grads)
    return gs, ps, spec


def _run(
    cfg: _Config,
    grads: PyTree,
    state: Any,
    params: PyTree,
    writes: Writes,
) -> tuple[PyTree, Any]:
    """``update``, writing what ``writes`` allows (the eager path may overwrite its owned
    grads; with a skip, the donated state's buffers receive their new values as the algorithm
    keeps them)."""
    api = cfg.api
    gs, ps, spec = _flattened(cfg, grads, state, params)
    count = state.count
    if not gs:
        return unflatten(spec, []), state._replace(count=count + 1)
    lr = cfg.lr_fn(count)[0]
    if cfg.fused_update is not None:  # the update is a kernel on copies: it writes nothing
        return _run_fused(cfg, gs, ps, spec, state, params, lr)
    bufs = {b: state_leaves(api, b, getattr(state, b), spec) for b in cfg.names}
    low_leaves = optree.tree_leaves(state.low)
    buf_leaves = [x for v in bufs.values() for x in v]
    scalars = [getattr(state, b) for b, _ in cfg.scalars]
    hyper = {name: fn(count)[0] for name, fn in cfg.hyper}
    pm = math_params(api, cfg.mode, state.low, ps, spec) if ps is not None else None
    # The params too, where the caller installs new params: a float32 param that is its own
    # math param may then receive them in place (with a donated state the step applies).
    own_params = [p for p, m in zip(ps, pm) if p is m] if writes.new_params and pm else []
    ops: Ops = choose_ops(
        [*gs, *(ps or ()), *buf_leaves, *low_leaves, *scalars, count, lr, *hyper.values()],
        owned=_owned_grads(gs, writes.owned),
        device=gs[0].device,
        donated=buf_leaves + (own_params if len(own_params) == len(ps or ()) else []),
        skip=writes.skip,
    )
    g = ops.to_math(gs, ps)
    bufs.update((b, x) for (b, _), x in zip(cfg.scalars, scalars))
    flags = None
    if cfg.mask is not None and ps is not None:  # a callable mask raises here, before the step
        flags = mask_flags(api, cfg.mask, params)
    extra: dict[str, Any] = {}
    if cfg.mask is not None:
        extra["mask"] = flags
    if cfg.hyper:
        extra["hyper"] = hyper
    deltas, new_bufs = cfg.step(ops, g, pm, bufs, lr, count, **extra)
    updates, low = to_updates(
        api, cfg.mode, state.low, count, deltas, ps, spec, new_params=writes.new_params
    )
    new_state = {b: unflatten(spec, new_bufs[b]) for b in cfg.names}
    new_state.update((b, new_bufs[b]) for b, _ in cfg.scalars)
    return updates, state._replace(count=count + 1, low=low, **new_state)


def _fused(
    cfg: _Config,
    kernel: FusedKernel,
    grads: PyTree,
    state: Any,
    params: PyTree,
    skip: Any,
) -> Any:
    """The fused in-place kernel, where it applies: contiguous float32 params and buffers of
    the params' shapes on one device (checked per step, after the caller's checks, so cheap;
    compiled, on the traced metadata, where ``prepare`` does not check the state's
    shapes: a kernel reading flat arrays must never see a short buffer); None elsewhere. The
    grads are inputs only: a non-contiguous one (``torch.func.grad`` of ``x @ w.t()``) is read
    through a contiguous copy. Compiled, the params must be plain tensors too (no torch.func
    wrappers), as the eager caller's are."""
    ps, grads = flatten(params)[0], flatten(grads)[0]
    if not ps or len(grads) != len(ps) or (compiling() and not plain_tensors(ps)):
        return None
    for x in ps:  # a float32 tensor is a floating one
        if type(x) is not torch.Tensor or x.dtype != torch.float32 or not x.is_contiguous():
            return None
    device = ps[0].get_device()
    for p in ps:  # x.device costs more, per leaf
        if p.get_device() != device:
            return None
    for p, g in zip(ps, grads):
        if (
            not isinstance(g, torch.Tensor)
            or g.dtype != torch.float32
            or g.shape != p.shape
            or g.get_device() != device
        ):
            return None
    for name in cfg.names:  # the kernel writes the buffers too
        leaves = flatten(getattr(state, name))[0]
        if len(leaves) != len(ps):
            return None
        for p, x in zip(ps, leaves):
            if x.dtype != torch.float32 or x.shape != p.shape or not x.is_contiguous():
                return None
            if x.get_device() != device:
                return None
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    mask = None if cfg.mask is None else mask_flags(cfg.api, cfg.mask, params)
    lr = cfg.lr_fn(state.count)[0]
    # the kernel writes the donated state (funcamp._core.donation); one that declines the
    # leaves (returns None) wrote nothing, and the mark is taken back
    mark = None if compiling() else writing()
    new_state = kernel(ps, grads, state, lr, skip, mask)
    if new_state is None:
        not_written(mark)
    return new_state


def _check_fused(cfg: _Config, leaves: Tensors, spec: Any, what: str) -> int | None:
    """``fused=True``: contiguous float32 plain tensors on one device, outside ``torch.func``
    transforms, or a clear refusal (the kernel has no other dtype's rounding here, reads flat
    arrays, and has no derivative and no batching rule); returns the device index (None for no
    leaves)."""
    api = cfg.api
    if (not compiling() and in_transform()) or is_batched(leaves):
        raise ValueError(
            f"funcamp.{api}: `fused=True` runs torch's fused kernel, which torch.func "
            "transforms (grad, vmap, jvp) cannot trace; build the optimizer with fused=False"
        )
    devices = set()
    for i, x in zip(range(len(leaves)), leaves):
        plain = type(x) is torch.Tensor or type(x) is torch.nn.Parameter
        if not plain or x.dtype != torch.float32 or not x.is_contiguous():
            kind = (
                type(x).__name__
                if not plain
                else f"{'non-contiguous ' if x.dtype == torch.float32 else ''}{x.dtype} tensor"
            )
            raise ValueError(
                f"funcamp.{api}: `fused=True` needs contiguous float32 {what} (plain "
                f"torch.Tensor); {leaf_path(unflatten(spec, leaves), i)} is a {kind} (use "
                "fused=False, with master_weights=True for half params)"
            )
        devices.add(x.get_device())
    if len(devices) > 1:
        raise ValueError(
            f"funcamp.{api}: `fused=True` needs every param on one device; use fused=False"
        )
    return devices.pop() if devices else None


def _run_fused(
    cfg: _Config,
    gs: Tensors,
    ps: Tensors | None,
    spec: Any,
    state: Any,
    params: PyTree,
    lr: Any,
) -> tuple[PyTree, Any]:
    """``update`` of a ``fused=True`` optimizer: the kernel on copies of the params and the
    buffers; the update leaves are the new params (:class:`SetParam`), installed as they are."""
    assert cfg.fused_update is not None and ps is not None  # needs_params: checked by the caller
    device = _check_fused(cfg, ps, spec, "params")
    # the grads are inputs only: a non-contiguous one is read through a contiguous copy
    gs = [g if g.is_contiguous() else g.contiguous() for g in gs]
    used = {device, _check_fused(cfg, gs, spec, "grads")}
    for name in cfg.names:  # the kernel reads and writes them as flat arrays too
        leaves = state_leaves(cfg.api, name, getattr(state, name), spec)
        used.add(_check_fused(cfg, leaves, spec, name))
    if len(used - {None}) > 1:
        raise ValueError(
            f"funcamp.{cfg.api}: `fused=True` needs the params, grads and optimizer state on one "
            "device; move them there or use fused=False"
        )
    mask = None if cfg.mask is None else mask_flags(cfg.api, cfg.mask, params)
    with torch.no_grad():  # as torch.optim's step: the kernel has no derivative
        new_ps, new_state = cfg.fused_update(ps, gs, state, lr, mask)
    return unflatten(spec, [SetParam(p) for p in new_ps]), new_state


def mask_flags(api: str, mask: Any, params: PyTree, *, strict: bool = False) -> list[bool]:
    """One Python bool per leaf of ``params``, from a mask (see :mod:`funcamp.optim._masks`).

    A mask is a pytree of bools with the params' structure or a prefix of it (a bool then covers
    a whole subtree). It may also be a callable of the dotted leaf path returning a bool, or a
    callable of the params returning a pytree (optax's ``mask``). ``strict`` (``init``, eager)
    also checks that the mask has nothing the params lack and selects at least one leaf.
    """
    flags = leaf_values(api, "mask", mask, params, (bool,), strict=strict)
    if strict:
        check_selects(api, "mask", mask, params, flags, "drop the mask (or weight_decay=0.0)")
    return flags


def _check_grads_not_wider(api: str, gs: Tensors, ps: Tensors, grads: PyTree) -> None:
    """A grad wider than its param's math dtype (float64 grads for float32 params) would make
    the new state and updates wider than the state: refused, naming the leaf."""
    for i, g, p in zip(range(len(gs)), gs, ps):
        if g.dtype == p.dtype:  # the common case, without the lookups below
            continue
        md = math_dtype(p.dtype)
        if torch.promote_types(g.dtype, md) != md:
            raise TypeError(
                f"funcamp.{api}: `grads` leaf {leaf_path(grads, i)} is {g.dtype} but its param "
                f"is {p.dtype} (the optimizer's math and state are {md}); cast the grads to "
                f"{md}, or give the param a {g.dtype} dtype"
            )


def _owned_grads(gs: Tensors, owned: Sequence[torch.Tensor]) -> Tensors:
    """The grad leaves the caller owns (may be overwritten in place; an expanded one cannot)."""
    if not owned:
        return []
    ids = {id(o) for o in owned}
    return [g for g in gs if id(g) in ids and not self_overlapping(g)]
