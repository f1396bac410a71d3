"""The training step: :class:`TrainState`, :func:`params_and_buffers` and :func:`make_train_step`.

One step is the whole mixed-precision pipeline — ``amp`` → ``grad_and_value`` of the scaled loss →
:func:`funcamp.unscale_and_step` → :func:`funcamp.update` — as one pure function of
``(state, batch)``, compiled whole with ``torch.compile(fullgraph=True)``. Nothing on the step path
syncs with the host: skipped steps are selected with ``torch.where`` and every metric is a tensor.

Buffers (BatchNorm running statistics and the like)
---------------------------------------------------
``loss_fn(params, buffers, batch)`` receives *fresh copies* of the state's buffers on every
step, and whatever it writes into them in place becomes the new state's buffers. So the usual
``torch.func.functional_call(model, (params, buffers), x)`` of a module in training mode just
works: BatchNorm updates its running stats in the copies, and they come out of the step
functionally (the input state is never modified). Alternatively, with
``returns_buffers=True``, ``loss_fn`` returns the new buffers explicitly (the pure, JAX-style
way): ``(loss, new_buffers)``, or ``(loss, aux, new_buffers)`` with ``has_aux=True``; it then
receives the state's buffers themselves and must not modify them. Either way buffers are
updated on every step, including skipped ones (as with ``torch.amp.GradScaler``: the forward
pass ran), and keep their dtypes (``amp``'s output cast does not apply to them).

Guards and recompiles
---------------------
Like ``jax.jit``, a compiled step is specialised on everything ``loss_fn`` closes over: the
module's structure and attributes, Python hyperparameters, the policy and the optimizer are read
once, when the step is traced. By default only the guards on the step's *inputs* (the state's
and the batch's tensors: shapes, dtypes, devices, strides) and on the modules' ``training`` flags
are kept, because dynamo's guards on a captured ``nn.Module`` cost about as much as the optimizer
itself on a small model. So the step follows ``model.train()`` / ``model.eval()`` as the eager
step does (the first call in a new mode compiles a graph for it; later switches reuse it); build
a new step after any other change to the module (a new hook, an attribute, ...), or pass your own
``options={"guard_filter_fn": ...}`` (or ``guard_filter_fn=None`` to keep every guard).

A batch whose *structure* (containers, keys, number of leaves) differs from the first batch's
raises ``ValueError``; a batch with new *shapes* or dtypes recompiles once (dynamo then marks the
changed dimensions dynamic), so a smaller last batch costs one recompile.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from funcamp._amp import _as_policy, amp
from funcamp._checks import check_flag, flatten_params
from funcamp._compile_errors import explain, refuses_torch_func, user_frame
from funcamp._fp8 import Fp8State, all_reduce_amax, fp8_update, needs_state, with_fp8_state
from funcamp._headroom import _headroom, _headroom_dtype
from funcamp._hints import optimizer_type_error
from funcamp._policy import Policy
from funcamp._progress import announce_first_call, logger
from funcamp._scaler import ScalerState, scale, unscale_and_step, update
from funcamp._step_cache import (
    GLOBAL_STATE_SOURCES,
    STEP_INPUTS,
    CachedStep,
    cache_support,
    describe_value,
    is_mode_flag,
    source_root,
)
from funcamp._tree import (
    NAMESPACE,
    _first_leaf,
    _plan_write,
    _sharing_memory,
    describe,
    path_str,
    tree_select,
    unflatten,
)
from funcamp.distributed import _reduce_step
from funcamp.optim._base import Optimizer, learning_rate
from funcamp.optim._modes import init_from_exact

__all__ = [
    "TrainState",
    "load_into_module",
    "make_eval_step",
    "make_train_step",
    "params_and_buffers",
]

PyTree = Any
Batch = Any
Metrics = dict[str, Any]
StepFn = Callable[["TrainState", Batch], tuple["TrainState", Metrics]]

_API = "make_train_step"


class TrainState(NamedTuple):
    """Everything a training step reads and writes, as one pytree.

    Attributes:
        params: the parameters (a pytree of floating tensors, in the policy's ``param_dtype``).
        buffers: non-trained state passed to ``loss_fn`` (BatchNorm running stats); ``{}`` if
            none.
        opt_state: the optimizer's state.
        scaler: the :class:`funcamp.ScalerState` (its ``skipped`` leaf counts skipped steps).
        fp8: the delayed-scaling :class:`funcamp.Fp8State` (amax histories and scales of the
            FP8 call sites); empty (the default) without a delayed FP8 recipe.

    Being a NamedTuple it flattens with optree and ``torch.utils._pytree``, compiles, and
    checkpoints with :func:`funcamp.state_dict`.

    Example:
        >>> import torch, funcamp
        >>> state = funcamp.TrainState.create({"w": torch.ones(2)}, funcamp.sgd(0.1), "float32")
        >>> state.params, state.buffers, state.scaler.kind
        ({'w': tensor([1., 1.])}, {}, 'noop')
    """

    params: PyTree
    buffers: PyTree
    opt_state: PyTree
    scaler: ScalerState
    fp8: Fp8State = Fp8State()

    @classmethod
    def create(
        cls,
        params: PyTree,
        optimizer: Optimizer,
        policy: Policy | str,
        *,
        buffers: PyTree = None,
        scaler: ScalerState | None = None,
        model: torch.nn.Module | None = None,
    ) -> TrainState:
        """Build the initial state: optimizer state, params (and buffers) cast to
        ``param_dtype``, scaler.

        The optimizer state is built for the params in ``param_dtype`` (so a low-precision mode
        allocates what it needs), and with ``master_weights=True`` the float32 masters are then
        taken from the params *as given*, before the cast: master weights start exact, not
        rounded through the half dtype.

        Args:
            params: a pytree of floating tensors, usually float32 (see
                :func:`params_and_buffers`).
            optimizer: a :class:`funcamp.Optimizer`.
            policy: a :class:`funcamp.Policy` or a policy string.
            buffers: optional pytree of buffers; floating ones are cast to ``param_dtype``,
                as ``module.to(dtype)`` would (BatchNorm needs its stats in the params' dtype);
                default ``{}``.
            scaler: the loss scaler; default ``ScalerState.for_policy(policy)`` (dynamic for a
                float16 policy, noop otherwise) on the params' device.
            model: the root module ``loss_fn`` runs; with a delayed FP8 policy
                (``policy.with_fp8(Fp8Recipe.delayed(...))``) the :class:`funcamp.Fp8State` is
                built for its FP8 call sites (:meth:`funcamp.Fp8State.init`). Ignored when the
                policy needs no such state.

        Returns:
            A :class:`TrainState`.

        Example:
            >>> import torch, funcamp
            >>> opt = funcamp.adam(1e-3, master_weights=True)
            >>> state = funcamp.TrainState.create({"w": torch.tensor([1.001])}, opt, "bf16-true")
            >>> state.params["w"].dtype, state.opt_state.low.master["w"]
            (torch.bfloat16, tensor([1.0010]))
        """
        api = "TrainState.create"
        pol = _as_policy(policy, api)
        if not isinstance(optimizer, Optimizer):
            raise optimizer_type_error(api, optimizer)
        leaves = _check_params(api, params)
        _check_float64_params(api, params, pol)
        if buffers is None:
            buffers = {}
        if scaler is None:
            device = leaves[0].device if leaves else None
            scaler = ScalerState.for_policy(pol, device=device)
        elif not isinstance(scaler, ScalerState):
            raise TypeError(
                f"funcamp.{api}: `scaler` must be a funcamp.ScalerState, got {describe(scaler)}"
            )
        cast = pol.cast_to_param(params)
        # The optimizer state is built for the params in param_dtype (a mode allocates what it
        # needs), with float32 masters taken from the params as given: exact, not rounded.
        opt_state = init_from_exact(optimizer, cast, params)
        fp8 = Fp8State()
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"funcamp.{api}: `model` must be the torch.nn.Module loss_fn runs, got "
                f"{describe(model)}"
            )
        if needs_state(pol):
            if model is None:
                raise ValueError(
                    f"funcamp.{api}: the policy's delayed FP8 recipe keeps state per call site; "
                    "pass `model=` (the root module loss_fn runs) to build it"
                )
            fp8 = Fp8State.init(model, pol, device=leaves[0].device if leaves else None)
        return cls(cast, pol.cast_to_param(buffers), opt_state, scaler, fp8)


def _check_params(api: str, params: PyTree) -> list[torch.Tensor]:
    return flatten_params(api, params)[0]


def _check_float64_params(api: str, params: PyTree, pol: Policy) -> None:
    """float64 tensors are never cast (as in torch), so a float64 param under a policy whose
    ``param_dtype`` is not float64 would stay float64 and meet compute-dtype activations in its
    first matmul (``Half != double``): refuse it here instead."""
    if pol.param_dtype == torch.float64:
        return
    paths, leaves, _ = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
    for path, p in zip(paths, leaves):
        if isinstance(p, torch.Tensor) and p.dtype == torch.float64:
            raise TypeError(
                f"funcamp.{api}: `params` leaf {path_str(path)} must not be float64 under policy "
                f"{pol} (float64 tensors are never cast, so it would stay float64 and fail in "
                "the first op that meets a compute-dtype input), got a float64 tensor; cast the "
                "params first (funcamp.tree_cast(params, torch.float32)) or use a float64 policy"
            )


def params_and_buffers(
    module: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Return ``(params, buffers)``: detached ``{name: tensor}`` dicts of a module's state.

    The tensors share storage with the module (no copy); funcamp never modifies them. Pass them
    to ``torch.func.functional_call(module, (params, buffers), args)``.

    Example:
        >>> import torch, funcamp
        >>> params, buffers = funcamp.params_and_buffers(torch.nn.BatchNorm1d(3))
        >>> sorted(params), sorted(buffers)
        (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
        >>> params["weight"].requires_grad
        False
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"funcamp.params_and_buffers: `module` must be a torch.nn.Module, got "
            f"{describe(module)}"
        )
    params = {k: v.detach() for k, v in module.named_parameters()}
    buffers = {k: v.detach() for k, v in module.named_buffers()}
    return params, buffers


def load_into_module(
    module: torch.nn.Module,
    state: TrainState | PyTree,
    buffers: PyTree = None,
) -> torch.nn.Module:
    """Write trained params and buffers back into ``module``, in place, and return it.

    The inverse of :func:`params_and_buffers`: for inference, export, ``torch.save`` of the
    module or Hugging Face's ``save_pretrained``. Each value is copied into the module's own
    tensor (``copy_`` under ``no_grad``), so the module keeps its dtypes, devices and tensor
    identities (an optimizer or hook holding them stays valid), and tied weights stay tied: a
    parameter shared by several names (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``)
    is one tensor, named once in ``params_and_buffers``'s dict and written once. Params kept in
    a lower precision (``"bf16-true"``) are widened into float32 module tensors exactly; call
    ``module.to(torch.bfloat16)`` first to keep the module in bfloat16. Sharded leaves
    (``funcamp.distributed.shard``) are gathered first (every rank must call).

    Args:
        module: the module the params came from.
        state: a :class:`TrainState` (its ``params`` and ``buffers`` are written), or a dict of
            params ``{name: tensor}`` as :func:`params_and_buffers` gives.
        buffers: with a params dict, an optional dict of buffers to write too.

    Returns:
        ``module``.

    Raises:
        ValueError: a name the module does not have, a parameter (or a given buffer dict's
            buffer) of the module missing from ``state``, or a value whose shape differs from
            the module's tensor -- nothing is written then.

    Example:
        >>> import torch, funcamp
        >>> model = torch.nn.Linear(2, 1)
        >>> params, buffers = funcamp.params_and_buffers(model)
        >>> trained = {k: torch.zeros_like(v) for k, v in params.items()}
        >>> funcamp.load_into_module(model, trained)(torch.ones(1, 2))
        tensor([[0.]], grad_fn=<AddmmBackward0>)
    """
    api = "load_into_module"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"funcamp.{api}: `module` must be a torch.nn.Module, got {describe(module)}"
        )
    if isinstance(state, TrainState):
        if buffers is not None:
            raise TypeError(
                f"funcamp.{api}: `buffers` must not be given with a TrainState (its buffers "
                "are written); pass the params dict instead to choose the buffers"
            )
        params, buffers = state.params, state.buffers
    else:
        params = state
    targets = [("`state` params", params, dict(module.named_parameters()))]
    if buffers is not None:
        targets.append(
            (
                "`buffers`" if state is params else "`state` buffers",
                buffers,
                dict(module.named_buffers()),
            )
        )
    writes = []
    for what, given, own in targets:
        if not isinstance(given, dict):
            raise TypeError(
                f"funcamp.{api}: {what} must be a dict {{name: tensor}} as params_and_buffers "
                f"gives, got {describe(given)}"
            )
        unknown = sorted(set(given) - set(own))
        missing = sorted(set(own) - set(given))
        if unknown or missing:
            names = ", ".join(repr(n) for n in (unknown or missing)[:3])
            raise ValueError(
                f"funcamp.{api}: {what} must name exactly the module's tensors (as "
                f"params_and_buffers gives them): {'unknown' if unknown else 'missing'} "
                f"{names}; nothing was written"
            )
        for name, target in own.items():
            value = given[name]
            if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                raise ValueError(
                    f"funcamp.{api}: {what} {name!r} must be a tensor of shape "
                    f"{tuple(target.shape)}, got {describe(value)}; nothing was written"
                )
            writes.append((target, value))
    with torch.no_grad():
        for target, value in writes:
            if hasattr(value, "full_tensor"):  # a DTensor from funcamp.distributed.shard
                value = value.full_tensor()
            target.copy_(value)
    return module


# ---------------------------------------------------------------------------------- the step


def _split_output(out: Any, has_aux: bool, returns_buffers: bool) -> tuple[Any, Any, Any]:
    """``loss_fn``'s output as ``(loss, aux, new_buffers)``, with clear errors."""
    if not has_aux and not returns_buffers:
        return out, None, None
    want = (
        "(loss, aux, new_buffers)"
        if has_aux and returns_buffers
        else "(loss, aux)"
        if has_aux
        else "(loss, new_buffers)"
    )
    n = 3 if has_aux and returns_buffers else 2
    if not isinstance(out, tuple) or len(out) != n:
        flags = ", ".join(
            f
            for f, on in (("has_aux=True", has_aux), ("returns_buffers=True", returns_buffers))
            if on
        )
        raise TypeError(
            f"funcamp.{_API}: `loss_fn` must return a tuple {want} with {flags}, got "
            f"{describe(out)}"
        )
    if has_aux and returns_buffers:
        return out
    if has_aux:
        return out[0], out[1], None
    return out[0], None, out[1]


def _check_loss(loss: Any) -> torch.Tensor:
    if isinstance(loss, (tuple, list)):
        raise TypeError(
            f"funcamp.{_API}: `loss_fn` must return a 0-d floating tensor as the loss, got a "
            f"{type(loss).__name__} of {len(loss)} items; if it returns (loss, aux), build the "
            "step with has_aux=True (and returns_buffers=True if it returns new buffers)"
        )
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        raise TypeError(
            f"funcamp.{_API}: `loss_fn` must return a 0-d floating tensor as the loss, got "
            f"{describe(loss)}"
        )
    return loss


def _restore_buffers(new: PyTree, old: PyTree, returned: bool = True) -> PyTree:
    """Check ``new`` against ``old`` and give every leaf its old dtype back. ``returned``: the
    new buffers were returned by ``loss_fn`` (``returns_buffers=True``); otherwise they are the
    copies it was given, which it may update in place but must not rebind or extend."""
    what = (
        "`loss_fn` must return new buffers"
        if returned
        else "`loss_fn` must update its buffers in place only (not add, remove or rebind keys)"
    )
    if isinstance(old, (dict, list, tuple)) and not old:  # no buffers (dynamo: no {} specs)
        if type(new) is type(old) and not new:
            return new
        got = sorted(map(str, new)) if isinstance(new, dict) else describe(new)
        raise TypeError(
            f"funcamp.{_API}: {what} with the structure of the state's buffers (none: "
            f"{old!r}), got {got}; keep new values out of the buffers (return them as aux with "
            "has_aux=True) or add them to the state's buffers"
        )
    paths, old_leaves, spec = optree.tree_flatten_with_path(old, namespace=NAMESPACE)
    try:
        new_leaves = spec.flatten_up_to(new)
    except (ValueError, TypeError):
        raise TypeError(
            f"funcamp.{_API}: {what} with the structure of the state's buffers {spec}, got "
            f"{optree.tree_structure(new, namespace=NAMESPACE)}; keep new values out of the "
            "buffers (return them as aux with has_aux=True) or add them to the state's buffers"
        ) from None
    out = []
    for path, o, n in zip(paths, old_leaves, new_leaves):
        if isinstance(o, torch.Tensor):
            if not isinstance(n, torch.Tensor) or n.shape != o.shape:
                raise TypeError(
                    f"funcamp.{_API}: {what} shaped like the old; buffer {path_str(path)} "
                    f"should be a tensor of shape {tuple(o.shape)}, got {describe(n)}"
                )
            if n.is_complex() and not o.is_complex():
                raise TypeError(
                    f"funcamp.{_API}: {what} of the old dtypes; buffer {path_str(path)} "
                    f"should be {o.dtype}, got {describe(n)}"
                )
            n = n.to(o.dtype)
        out.append(n)
    return unflatten(spec, out)


def _check_train_state(state: TrainState, optimizer: Optimizer) -> None:
    """First-call check: ``opt_state`` must be what ``optimizer.init(params)`` builds (its
    structure and shapes, computed on the meta device, so nothing is allocated)."""
    _check_params(_API, state.params)
    if not isinstance(state.scaler, ScalerState):
        raise TypeError(
            f"funcamp.{_API}: `state.scaler` must be a funcamp.ScalerState, got "
            f"{describe(state.scaler)}"
        )
    if not isinstance(state.fp8, Fp8State):
        raise TypeError(
            f"funcamp.{_API}: `state.fp8` must be a funcamp.Fp8State (TrainState.create builds "
            f"it), got {describe(state.fp8)}"
        )
    meta = optree.tree_map(
        lambda p: torch.empty_like(p, device="meta"), state.params, namespace=NAMESPACE
    )
    try:
        want_paths, want, want_spec = optree.tree_flatten_with_path(
            optimizer.init(meta), namespace=NAMESPACE
        )
    except Exception:  # an optimizer that cannot init on meta: leave the checks to it
        return
    _, got, got_spec = optree.tree_flatten_with_path(state.opt_state, namespace=NAMESPACE)
    hint = "build it with optimizer.init(params) or TrainState.create"
    if got_spec != want_spec:
        raise ValueError(
            f"funcamp.{_API}: `state.opt_state` must match `state.params` and the optimizer "
            f"({hint}): expected structure {want_spec}, got {got_spec}"
        )
    for path, w, g in zip(want_paths, want, got):
        if isinstance(w, torch.Tensor) and (
            not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype
        ):
            raise ValueError(
                f"funcamp.{_API}: `state.opt_state` leaf {path_str(path)} must be a "
                f"{w.dtype} tensor of shape {tuple(w.shape)} to match `state.params` ({hint}), "
                f"got {describe(g)}"
            )


def _clone_buffers(buffers: PyTree) -> PyTree:
    return optree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, buffers, namespace=NAMESPACE
    )


def _check_donation(state: TrainState) -> None:
    """With ``donate_state=True``: no two state tensors may share memory (one write would
    clobber the other), and none may need grad."""
    trees = {
        "state.params": state.params,
        "state.buffers": state.buffers,
        "state.opt_state": state.opt_state,
    }
    grad_leaf = _first_leaf(trees, lambda x: isinstance(x, torch.Tensor) and x.requires_grad)
    if grad_leaf is not None:
        raise ValueError(
            f"funcamp.{_API}: with donate_state=True the state's tensors are written in "
            f"place, but {grad_leaf} requires grad; detach it (params_and_buffers does)"
        )
    shared = _sharing_memory(trees)
    if shared is not None:
        raise ValueError(
            f"funcamp.{_API}: with donate_state=True the state's tensors are written in "
            f"place, but {shared[0]} and {shared[1]} share memory; give each its own tensor "
            "(clone one) or build the step with donate_state=False"
        )


def _describe_option(value: Any) -> Any:
    return describe_value(value) if callable(value) else value


def _check_cache_dir(cache_dir: Any, opts: StepOptions, mesh: Any) -> str | None:
    """``cache_dir`` as a path, or None when unset (or when this torch cannot save steps:
    a warning says so and the step compiles as usual)."""
    if cache_dir is None:
        return None
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(
            f"funcamp.{_API}: `cache_dir` must be a directory path (str or os.PathLike) or "
            f"None, got {describe(cache_dir)}"
        )
    path = os.fspath(cache_dir)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"funcamp.{_API}: `cache_dir` must be a directory, but {path!r} is a file; give "
            "a directory (it is created if missing)"
        )
    if not opts.compile:
        raise ValueError(
            f"funcamp.{_API}: `cache_dir` keeps the compiled step on disk, but compile=False "
            "builds an eager step; drop `cache_dir` or compile the step"
        )
    if opts.compile_options.get("fullgraph", True) is False:
        raise ValueError(
            f"funcamp.{_API}: `cache_dir` saves the step as one compiled graph; a step "
            "compiled in pieces (fullgraph=False) cannot be saved: drop one of the two"
        )
    options = opts.compile_options
    if "guard_filter_fn" in options or "guard_filter_fn" in (options.get("options") or {}):
        raise ValueError(
            f"funcamp.{_API}: `cache_dir` and `guard_filter_fn` do not go together: a saved "
            "step checks its inputs' tensors on every call and everything else it depends on "
            "when it is loaded, whatever a guard filter would keep; drop one of the two"
        )
    if not isinstance(options.get("backend", "inductor"), str):
        raise ValueError(
            f"funcamp.{_API}: `cache_dir` needs the compile backend by name (such as "
            f"'inductor' or 'aot_eager'), got {describe(options['backend'])}: a backend object "
            "cannot be told apart from another across processes"
        )
    if opts.group is not None or mesh is not None:
        raise ValueError(
            f"funcamp.{_API}: `cache_dir` is not supported for data-parallel or sharded "
            "steps yet (`group`/`mesh`): their graphs hold collectives bound to this "
            "process's group; drop `cache_dir` (the compile caches still apply)"
        )
    why = cache_support()
    if why is not None:
        warnings.warn(
            f"funcamp.{_API}: `cache_dir` is ignored: {why}; the step compiles as usual "
            "(torch's compile caches still apply)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return path


def _input_guards_only(entries: list[Any]) -> list[bool]:
    """Default guard filter: keep the guards on the step's inputs (``state``, ``batch``), on
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


def _fresh_code(code: types.CodeType) -> types.CodeType:
    suffix = f"_{next(_STEP_IDS)}"
    name = code.co_name + suffix
    if sys.version_info >= (3, 11):
        return code.replace(co_name=name, co_qualname=code.co_qualname + suffix)
    return code.replace(co_name=name)  # pragma: no cover - Python 3.10


def _compile(fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    opts = dict(options)
    backend = opts.pop("backend", "inductor")
    mode = opts.pop("mode", None)
    inner = dict(opts.pop("options", None) or {})
    fullgraph = opts.pop("fullgraph", True)
    if "guard_filter_fn" in opts:
        inner["guard_filter_fn"] = opts.pop("guard_filter_fn")
    inner.setdefault("guard_filter_fn", _input_guards_only)
    if inner["guard_filter_fn"] is None:
        del inner["guard_filter_fn"]
    if mode is not None:
        # torch.compile takes `mode` or `options`, not both: spell the mode out as options.
        if backend == "inductor":
            from torch._inductor import list_mode_options

            inner = {**list_mode_options(mode), **inner}
            mode = None
        elif inner:
            # other backends ignore inductor options; only the guard filter matters.
            pass
    if mode is not None and inner:
        inner = {}
    return torch.compile(
        fn, fullgraph=fullgraph, backend=backend, mode=mode, options=inner or None, **opts
    )


_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")
# dynamo traces torch.autograd.grad into a graph only with this option (torch >= 2.7)
_CAN_TRACE_AUTOGRAD = hasattr(torch._dynamo.config, "trace_autograd_ops")


def _tracing_autograd(on: bool) -> Any:
    """While dynamo traces a step that takes its gradients from torch.autograd in one graph."""
    if not on:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(trace_autograd_ops=True)


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Any:
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _autograd_grad_and_value(
    fn: Callable[..., Any], *, argnums: int | tuple[int, ...], has_aux: bool
) -> Callable[..., Any]:
    """``torch.func.grad_and_value(fn, argnums, has_aux=True)`` computed by torch.autograd on
    leaf copies of the differentiated arguments (grads of unused leaves are zeros, as there)."""
    assert has_aux

    def run(*args: Any) -> tuple[Any, tuple[torch.Tensor, Any]]:
        nums = argnums if isinstance(argnums, tuple) else (argnums,)
        args = list(args)
        specs = []
        for i in nums:
            leaves, spec = optree.tree_flatten(args[i], namespace=NAMESPACE)
            leaves = [x.detach().requires_grad_(True) for x in leaves]
            specs.append((leaves, spec))
            args[i] = unflatten(spec, leaves)
        with torch.enable_grad():
            out, aux = fn(*args)
        flat = [x for leaves, _ in specs for x in leaves]
        if out.requires_grad:
            grads = list(torch.autograd.grad(out, flat, allow_unused=True, materialize_grads=True))
        else:  # a loss that does not depend on the params: zero grads, as torch.func gives
            grads = [torch.zeros_like(x) for x in flat]
        trees = []
        for leaves, spec in specs:
            trees.append(unflatten(spec, grads[: len(leaves)]))
            grads = grads[len(leaves) :]
        result = tuple(trees) if isinstance(argnums, tuple) else trees[0]
        aux = optree.tree_map(
            lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux, namespace=NAMESPACE
        )
        return result, (out.detach(), aux)

    return run


def _data_parallel(group: Any) -> tuple[Any, int, int] | None:
    """``(group, world_size, rank)`` read once, when the step is built; None without a group."""
    if group is None:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"funcamp.{_API}: `group` needs torch.distributed initialized "
            "(torch.distributed.init_process_group) before the step is built"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"funcamp.{_API}: `group` must be a torch.distributed.ProcessGroup (for example "
            f"torch.distributed.group.WORLD), got {describe(group)}"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"funcamp.{_API}: this process is not a member of `group`")
    return group, dist.get_world_size(group), rank


class StepOptions(NamedTuple):
    """:func:`make_train_step`'s keyword options, as given: checked by
    :func:`_validate_step_args`, read by the plain and the sharded step builders."""

    has_aux: Any
    returns_buffers: Any
    compile: Any
    group: Any
    donate_state: Any
    headroom: Any
    grad_norm: Any
    compile_options: dict[str, Any]


def _validate_step_args(
    loss_fn: Any, optimizer: Any, policy: Any, opts: StepOptions
) -> tuple[Policy, Any, Any, Any]:
    """:func:`make_train_step`'s argument checks; returns ``(policy, headroom dtype or None,
    headroom leaf predicate or None, data-parallel setup or None)``."""
    has_aux, returns_buffers, compile, group, donate_state, headroom, grad_norm, compile_options = (
        opts
    )
    if not callable(loss_fn):
        raise TypeError(f"funcamp.{_API}: `loss_fn` must be callable, got {describe(loss_fn)}")
    if not isinstance(optimizer, Optimizer):
        raise optimizer_type_error(_API, optimizer)
    pol = _as_policy(policy, _API)
    for name, flag in (
        ("has_aux", has_aux),
        ("returns_buffers", returns_buffers),
        ("compile", compile),
        ("donate_state", donate_state),
        ("grad_norm", grad_norm),
    ):
        check_flag(_API, name, flag)
    if not (isinstance(headroom, bool) or callable(headroom)):
        raise TypeError(
            f"funcamp.{_API}: `headroom` must be a bool or a callable of the leaf path, got "
            f"{describe(headroom)}"
        )
    headroom_dtype = _headroom_dtype(pol) if headroom is not False else None
    headroom_include = headroom if callable(headroom) else None
    data_parallel = _data_parallel(group)
    if compile_options and not compile:
        raise TypeError(
            f"funcamp.{_API}: compile options {sorted(compile_options)} must not be given with "
            "compile=False"
        )
    return pol, headroom_dtype, headroom_include, data_parallel


def _forward_backward(
    run_loss: Callable[..., Any],
    state: TrainState,
    batch: Batch,
    has_aux: bool,
    returns_buffers: bool,
    fp8_stateful: bool,
    grad_and_value: Callable[..., Any],
    fp8_reduce: Callable[[Fp8State, Fp8State], Fp8State] | None,
    gather: Callable[[PyTree], PyTree] | None = None,
) -> tuple[PyTree, torch.Tensor, Any, PyTree, Fp8State]:
    """The loss under ``amp``, scaled, and its gradients: ``(scaled grads, loss (float32,
    unscaled), aux, new buffers, new FP8 state)``. ``grad_and_value`` is torch.func's, or
    torch.autograd's for a step compiled in pieces; ``fp8_reduce`` combines the delayed-FP8
    "gradient" across data-parallel ranks; ``gather`` makes the loss's params from the
    differentiated ones (the sharded step's all-gather of its local shards)."""
    scaler = state.scaler

    def scaled_loss(params: PyTree, fp8: Fp8State) -> tuple[torch.Tensor, tuple[Any, ...]]:
        if gather is not None:
            params = gather(params)
        # Copies made inside the transform, so in-place buffer updates are allowed.
        buffers = state.buffers if returns_buffers else _clone_buffers(state.buffers)
        loss, aux, new_buffers = _split_output(
            run_loss(fp8, params, buffers, batch), has_aux, returns_buffers
        )
        loss = _check_loss(loss).to(torch.float32)
        if not returns_buffers:
            new_buffers = buffers
        return scale(scaler, loss), (loss.detach(), aux if has_aux else (), new_buffers)

    argnums = (0, 1) if fp8_stateful else 0
    grads, (_, (loss, aux, new_buffers)) = grad_and_value(
        scaled_loss, argnums=argnums, has_aux=True
    )(state.params, state.fp8)
    new_fp8 = state.fp8
    if fp8_stateful:
        grads, fp8_grads = grads
        if fp8_reduce is not None:  # every rank scales with the amaxes of all ranks
            fp8_grads = fp8_reduce(state.fp8, fp8_grads)
        new_fp8 = fp8_update(state.fp8, fp8_grads)
    return grads, loss, aux, new_buffers, new_fp8


def _metrics(
    loss: torch.Tensor,
    grad_norm: Any,
    scaler: ScalerState,
    found_inf: torch.Tensor,
    new_scaler: ScalerState,
    aux: Any,
    has_aux: bool,
    room: Any,
    lr: Any = None,
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
    if grad_norm is None:  # make_train_step(grad_norm=False)
        del metrics["grad_norm"]
    if lr is None:  # an optimizer without a learning rate
        del metrics["lr"]
    if has_aux:
        metrics["aux"] = aux
    if room is not None:
        metrics["headroom"] = room.summary()
    return metrics


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: Optimizer,
    policy: Policy | str,
    *,
    has_aux: bool = False,
    returns_buffers: bool = False,
    compile: bool = True,
    group: Any = None,
    donate_state: bool = False,
    headroom: bool | Callable[[str], bool] = False,
    grad_norm: bool = True,
    mesh: Any = None,
    cache_dir: str | os.PathLike[str] | None = None,
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
    whether a micro-step applies is a device-side value (skipped micro-steps do not count), and
    a collective issued only on that step needs its value on the host -- a host sync
    (``torch.cond`` reads it with ``.item()``). See the data-parallel guide.

    Sharded (``mesh=mesh``, a 1-D ``DeviceMesh``): the state's params and optimizer state are
    ``DTensor`` s made by :func:`funcamp.distributed.shard` (large leaves split along one
    dimension, so each rank holds about ``1/N`` of them; small ones replicated), and every rank
    runs the step on its own equal shard of the batch, as with ``group=``. The step works on the
    local shards: the sharded params are all-gathered (one packed all-gather per dtype) for the
    forward and their gradients reduce-scattered in the backward; one all-reduce carries the
    replicated leaves' gradients, the loss, rank 0's buffers and each rank's squared gradient
    norm and overflow flag, so ``loss``, ``grad_norm`` and ``found_inf`` are global (no rank
    steps when any rank overflowed); unscale, the optimizer and the skip then run on the local
    shards, and the new state comes back as DTensors with the same placements.
    :func:`funcamp.clip_by_global_norm` (chained at the top level) gets the global norm.
    Compiles as one graph per rank with the collectives inside. Not yet with ``mesh``:
    ``donate_state``, ``headroom``, a delayed FP8 recipe. See the sharded-training guide.

    Donating the state (``donate_state=True``): the returned state's params, buffers and
    optimizer-state tensors are the input state's own tensors, overwritten with the new values
    (as ``torch.optim`` updates in place), so the compiled step allocates no new memory for
    them and writes its results straight into it -- faster, and half the memory. The input state
    must not be used afterwards (keep only the returned one: ``state, m = step(state, batch)``);
    anything sharing memory with it changes too, such as a module's parameters when the params
    came from :func:`params_and_buffers` (they then follow training, as with ``torch.optim``).
    No two state tensors may share memory (checked on every call: a clear error). The scaler
    state (a few scalars) is always returned fresh. All or nothing: every check and every
    computation that can fail runs before the first write, so a step that raises leaves the
    state as it was.

    The first call of a compiled step traces and compiles it -- a minute or more on a small CPU
    (measured times per model in docs/benchmarks.md), much less with warm compile caches -- and
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
            below). Default ``False``: the input state is never modified.
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
            that builds the same step loads it without dynamo's trace (a GPT 4x256 step's
            restart: 2.4 s of overhead instead of 13.2 s on a 2-core CPU). An entry is used only
            while it fits: filed under the versions, machine, options, loss code and input
            shapes, and checked on load against the current source files and everything the
            step is specialised on (model attributes, closure constants, globals); anything
            else compiles afresh and replaces it; a step specialised on something that cannot
            be compared across processes is not saved (a warning). Needs a torch with AOT
            precompile (else a warning, and the step compiles as usual); not with
            ``compile=False``, ``fullgraph=False``, ``group``, ``mesh``, ``guard_filter_fn``
            or a backend object (give it by name). See the warm-starts guide.
        **compile_options: passed to ``torch.compile`` (``backend=``, ``mode=``,
            ``options=``, ``dynamic=``); ``guard_filter_fn=`` replaces the default filter that
            keeps only the guards on the step's inputs (``None`` keeps every guard).
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
    opts = StepOptions(
        has_aux, returns_buffers, compile, group, donate_state, headroom, grad_norm, compile_options
    )
    pol, headroom_dtype, headroom_include, data_parallel = _validate_step_args(
        loss_fn, optimizer, policy, opts
    )
    cache_dir = _check_cache_dir(cache_dir, opts, mesh)
    if mesh is not None:  # sharded params and optimizer state: funcamp/_shard.py
        from funcamp._shard import make_sharded_step

        return make_sharded_step(loss_fn, optimizer, pol, mesh, opts)
    run_loss = with_fp8_state(amp(loss_fn, pol))
    # dynamo cannot resume a frame inside torch.func.grad after a graph break (the resumed
    # frame's inputs are functorch-wrapped tensors it fails to fake), so a step compiled in
    # pieces takes its gradients from torch.autograd instead, as torch.compile(model) does.
    pieces = compile and compile_options.get("fullgraph", True) is False
    fp8_stateful = needs_state(pol)  # delayed FP8: the state's gradient is its new value

    # Set when torch.func refuses to differentiate the model (an autograd function written the
    # old way, a custom op's registered formula): the step then takes its gradients from
    # torch.autograd, traced into the same graph (dynamo's trace_autograd_ops).
    autograd_in_graph = [False]

    def gradients() -> Callable[..., Any]:
        """torch.func's grad_and_value, except in pieces (above), where torch.func refuses the
        model, and in plain eager, where torch.autograd on leaf copies gives the same bits about
        15 % faster (an MLP step): not under torch.compile or a torch.func transform, and
        without delayed FP8 state."""
        if pieces or autograd_in_graph[0]:
            return _autograd_grad_and_value
        if (
            not compile
            and not fp8_stateful
            and not torch.compiler.is_compiling()
            and torch._C._functorch.maybe_current_level() is None
        ):
            return _autograd_grad_and_value
        return torch.func.grad_and_value

    fp8_reduce = None
    if data_parallel is not None:
        margin = pol.fp8.recipe.margin if pol.fp8 is not None else 0

        def fp8_reduce(state: Fp8State, grads: Fp8State) -> Fp8State:
            return all_reduce_amax(state, grads, margin, data_parallel[0])

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        scaler = state.scaler
        grads, loss, aux, new_buffers, new_fp8 = _forward_backward(
            run_loss,
            state,
            batch,
            has_aux,
            returns_buffers,
            fp8_stateful,
            gradients(),
            fp8_reduce,
        )
        # The update needs no autograd: under no_grad nothing it makes carries a graph (params
        # that require grad included), and the traced optimizer asks no tensor whether it does.
        with torch.no_grad():
            # Always checked (in-place updates too: a rebound or added key would change the state's
            # structure), and before anything is written into a donated state.
            new_buffers = _restore_buffers(new_buffers, state.buffers, returns_buffers)
            nonfinite = None
            if data_parallel is not None:
                # One all-reduce per gradient dtype (one in all for float32 grads): the mean of the
                # scaled grads, the mean loss, the non-finite consensus and rank 0's buffers.
                pg, world_size, rank = data_parallel
                grads, loss, nonfinite, new_buffers = _reduce_step(
                    grads, loss, new_buffers, pg, world_size, rank == 0
                )
            # Donated state, all or nothing: every check and every computation that can fail runs
            # before the first write. The buffers are matched now; unscale_and_step checks the
            # optimizer state and the learning rate before it touches anything and writes params
            # and optimizer state last; the buffers are written after it, by plain copies.
            write_buffers = _plan_write(new_buffers, state.buffers) if donate_state else None
            # Measured on the scaled grads, before unscale_and_step may unscale them in place.
            room = None
            if headroom_dtype is not None:
                room = _headroom(
                    grads,
                    scaler.scale,
                    headroom_dtype,
                    scaled=True,
                    leaves=False,
                    include=headroom_include,
                )
            # The rate this step applies, read before a donated state's count is overwritten.
            lr = learning_rate(optimizer, state.opt_state)
            # The grads are this step's own (made by grad_and_value above): donating them lets the
            # eager path unscale in place and reuse their memory (ignored under compile).
            params, opt_state, info = unscale_and_step(
                scaler,
                optimizer,
                grads,
                state.opt_state,
                state.params,
                donate_grads=True,
                donate_state=donate_state,
                grad_norm=grad_norm,
            )
            found_inf = info.found_inf
            if nonfinite is not None:
                # A rank's inf/nan gradient makes the summed gradient inf/nan on every rank, so
                # unscale_and_step already skipped wherever `nonfinite` is set; OR-ing keeps the
                # reported flag and the scaler update tied to the consensus all the same.
                found_inf = found_inf | nonfinite
            new_scaler = update(scaler, found_inf)
            if fp8_stateful:  # a skipped step keeps the FP8 state, as it keeps the params
                new_fp8 = tree_select(found_inf, state.fp8, new_fp8)
            if write_buffers is not None:
                new_buffers = write_buffers()
            metrics = _metrics(
                loss, info.grad_norm, scaler, found_inf, new_scaler, aux, has_aux, room, lr
            )
            return TrainState(params, new_buffers, opt_state, new_scaler, new_fp8), metrics

    # Dynamo caches compiled code per code object, and the default guard filter drops the
    # guards on closures: a code object of its own keeps each step's graph to that step.
    train_step.__code__ = _fresh_code(train_step.__code__)
    if not compile:
        run = train_step
    elif cache_dir is None:
        run = announce_first_call(_compile(train_step, compile_options))
    else:
        settings = repr(
            (pol, has_aux, returns_buffers, donate_state, _describe_option(headroom), grad_norm)
        )
        run = CachedStep(
            train_step,
            lambda keep: _compile(train_step, {**compile_options, "guard_filter_fn": keep}),
            announce_first_call(_compile(train_step, compile_options)),
            cache_dir,
            loss_fn,
            settings,
            compile_options,
        )
    expected: list[Any] = []

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"funcamp.{_API}: `state` must be a funcamp.TrainState (see "
                f"TrainState.create), got {describe(state)}"
            )
        structure = optree.tree_structure(batch, namespace=NAMESPACE)
        if not expected:
            _check_train_state(state, optimizer)
            expected.append(structure)
        elif structure != expected[0]:
            raise ValueError(
                f"funcamp.{_API}: `batch` must keep the structure of the first batch "
                f"{expected[0]}, got {structure}; build another step for batches of another "
                "structure (new shapes or dtypes only recompile)"
            )
        if donate_state:
            _check_donation(state)
        if run is train_step:
            return train_step(state, batch)
        try:
            # A failing op on fake tensors is logged at ERROR with its whole stack before dynamo
            # raises; the eager re-run below gives the plain error, so that log is held back.
            with _quiet(_FAKE_TENSOR_LOG), _tracing_autograd(autograd_in_graph[0]):
                return run(state, batch)
        except torch._dynamo.exc.TorchDynamoException as e:
            if (
                not pieces
                and not autograd_in_graph[0]
                and refuses_torch_func(e)
                and _CAN_TRACE_AUTOGRAD
            ):
                autograd_in_graph[0] = True
                logger.info(
                    "funcamp: torch.func cannot differentiate %s (an autograd function without "
                    "setup_context, such as a custom op's registered formula); the step takes "
                    "its gradients from torch.autograd, in the same graph",
                    user_frame(e) or "the model",
                )
                return step(state, batch)
            # dynamo reports an exception raised while tracing (a bad `loss_fn` output, trees
            # that do not match, a shape mismatch on fake tensors) wrapped in its own logs; run
            # the step eagerly to raise it plainly. A donated state is re-run on copies: this
            # run is only for the error message. If the eager step runs, the model itself does
            # something dynamo cannot put in one graph: say so in one paragraph.
            rerun = _clone_buffers(state) if donate_state else state

            def eagerly() -> None:
                with torch.compiler.set_stance("force_eager"):
                    train_step(rerun, batch)

            raise explain(_API, e, eagerly) from e

    step.__doc__ = f"A funcamp train step ({'compiled' if compile else 'eager'}, policy {pol})."
    step.train_step = train_step  # type: ignore[attr-defined]
    return step


def make_eval_step(
    fn: Callable[..., Any],
    policy: Policy | str,
    *,
    compile: bool = True,
    **compile_options: Any,
) -> Callable[[Any, Batch], Any]:
    """Build ``eval_step(state, batch) -> fn(params, buffers, batch)``: evaluation under the
    policy, compiled, without gradients.

    ``fn`` runs under ``funcamp.amp(fn, policy)`` and ``torch.no_grad()``: ops cast as the policy
    says and every floating tensor it returns (a loss, logits, a dict of metrics, a Hugging Face
    ``ModelOutput``) in the policy's output dtype. ``state`` is a :class:`TrainState` (its
    ``params``, ``buffers`` and delayed-FP8 scales are read) or a ``(params, buffers)`` pair;
    nothing in it is modified (``fn`` gets copies of the buffers, so a module left in training
    mode cannot update its running statistics). The compiled step, like the train step, follows
    the modules' ``train()``/``eval()`` mode (call ``model.eval()`` first: dropout off,
    BatchNorm's running statistics used) and says on stderr that it compiles on its first call
    and how long it took; a failure to compile is one paragraph naming the way out.

    Args:
        fn: ``(params, buffers, batch) -> anything``, e.g. the train step's ``loss_fn``.
        policy: a :class:`funcamp.Policy` or a policy string.
        compile: compile with ``torch.compile(fullgraph=True)`` (default); ``False`` runs eagerly.
        **compile_options: passed to ``torch.compile`` as for :func:`make_train_step`.

    Returns:
        ``eval_step(state, batch)``.

    Example:
        >>> import torch, funcamp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Dropout(0.5))
        >>> def logits(params, buffers, batch):
        ...     return torch.func.functional_call(model, (params, buffers), (batch,))
        >>> state = funcamp.TrainState.create(
        ...     funcamp.params_and_buffers(model)[0], funcamp.sgd(0.1), "mixed_bfloat16")
        >>> evaluate = funcamp.make_eval_step(logits, "mixed_bfloat16", compile=False)
        >>> out = evaluate(state, torch.ones(3, 4))  # linear in bfloat16, output cast back
        >>> out.dtype, out.requires_grad, torch.equal(out, evaluate(state, torch.ones(3, 4)))
        (torch.float32, False, False)
        >>> _ = model.eval()  # dropout off: the same output every call
        >>> torch.equal(evaluate(state, torch.ones(3, 4)), evaluate(state, torch.ones(3, 4)))
        True
    """
    api = "make_eval_step"
    if not callable(fn):
        raise TypeError(f"funcamp.{api}: `fn` must be callable, got {describe(fn)}")
    pol = _as_policy(policy, api)
    check_flag(api, "compile", compile)
    if compile_options and not compile:
        raise TypeError(
            f"funcamp.{api}: compile options {sorted(compile_options)} must not be given with "
            "compile=False"
        )
    run_fn = with_fp8_state(amp(fn, pol))
    fp8_stateful = needs_state(pol)

    def eval_step(params: PyTree, buffers: PyTree, fp8: Fp8State, batch: Batch) -> Any:
        with torch.no_grad():
            return run_fn(fp8, params, _clone_buffers(buffers), batch)

    eval_step.__code__ = _fresh_code(eval_step.__code__)
    run = (
        announce_first_call(_compile(eval_step, compile_options), "eval step")
        if compile
        else eval_step
    )

    def step(state: Any, batch: Batch) -> Any:
        if isinstance(state, TrainState):
            params, buffers, fp8 = state.params, state.buffers, state.fp8
        elif isinstance(state, tuple) and len(state) == 2 and not fp8_stateful:
            (params, buffers), fp8 = state, Fp8State()
        else:
            pair = "" if fp8_stateful else " or a (params, buffers) pair"
            raise TypeError(
                f"funcamp.{api}: `state` must be a funcamp.TrainState{pair}, got {describe(state)}"
            )
        _check_params(api, params)
        if run is eval_step:
            return eval_step(params, buffers, fp8, batch)
        try:
            with _quiet(_FAKE_TENSOR_LOG):
                return run(params, buffers, fp8, batch)
        except torch._dynamo.exc.TorchDynamoException as e:

            def eagerly() -> None:
                with torch.compiler.set_stance("force_eager"):
                    eval_step(params, buffers, fp8, batch)

            raise explain(api, e, eagerly) from e

    step.__doc__ = f"A funcamp eval step ({'compiled' if compile else 'eager'}, policy {pol})."
    return step
