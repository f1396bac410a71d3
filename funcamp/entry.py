"""The front door: :func:`make_train_step`.

It turns the old spelling of its options (``group=``, ``mesh=``, ``cache_dir=``, ``backend=``,
...) into the new one (``parallel=``, ``compile=funcamp.Compile(...)``) with a warning. That
translation is why this module sits above the distributed layer; it goes with the old spelling.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

from funcamp.distributed.data_parallel import DataParallel
from funcamp.distributed.shard import Sharded
from funcamp.optim._base import Optimizer
from funcamp.policy.policy import Policy, as_policy
from funcamp.train.config import Compile, new_spelling, resolve_compile
from funcamp.train.parallel import SingleProcess
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
    donate_state: bool = True,
    grad_norm: bool = True,
    headroom: bool | Callable[[str], bool] = False,
    parallel: SingleProcess | None = None,
    compile: bool | Compile = True,
    **deprecated: Any,
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
        headroom: add ``metrics["headroom"]`` (:func:`funcamp.headroom`); a predicate of
            the leaf path measures only the leaves it accepts.
        parallel: ``funcamp.distributed.DataParallel(group)`` or ``Sharded(mesh)``; ``None``
            trains in this process alone.
        compile: ``True`` (default) compiles with ``torch.compile(fullgraph=True)``; ``False``
            runs eagerly; a :class:`funcamp.Compile` says how to compile.
        **deprecated: the old spelling (``group=``, ``mesh=``, ``cache_dir=``, ``specialize=``,
            ``compiler_patches=``, ``backend=``, ...): translated with a ``FutureWarning``.

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
    pol = as_policy(policy, API)
    parallel = _translate_parallel(parallel, deprecated)
    if deprecated:
        warnings.warn(
            f"funcamp.{API}: {', '.join(f'{k}=' for k in deprecated)} is the old spelling; "
            f"pass {new_spelling(deprecated, _parallel_spelling(deprecated))} instead",
            FutureWarning,
            stacklevel=2,
        )
    legacy = {k: v for k, v in deprecated.items() if k not in ("group", "mesh")}
    cfg = resolve_compile(API, compile, legacy)
    if parallel is not None:
        parallel = _bound(parallel, pol)
    options = StepOptions(
        has_aux,
        returns_buffers,
        cfg is not None,
        donate_state,
        headroom,
        grad_norm,
        None if cfg is None else cfg.cache_dir,
        cfg is not None and cfg.specialize,
        "auto" if cfg is None else cfg.compiler_patches,
    )
    compile_options = {} if cfg is None else cfg.torch_options()
    return build_train_step(
        loss_fn, optimizer, pol, parallel=parallel, step_options=options, **compile_options
    )


def _parallel_spelling(deprecated: dict[str, Any]) -> str | None:
    if deprecated.get("group") is not None:
        return "funcamp.distributed.DataParallel(group)"
    if deprecated.get("mesh") is not None:
        return "funcamp.distributed.Sharded(mesh)"
    return None


def _translate_parallel(parallel: Any, deprecated: dict[str, Any]) -> SingleProcess | None:
    """``parallel=``, or the piece the old ``group=``/``mesh=`` keywords name."""
    group, mesh = deprecated.get("group"), deprecated.get("mesh")
    given = [
        name
        for name, v in (("parallel", parallel), ("group", group), ("mesh", mesh))
        if v is not None
    ]
    if len(given) > 1:
        raise ValueError(
            f"funcamp.{API}: give one of {' and '.join(f'`{n}`' for n in given)}: a sharded "
            "step is also data parallel over the mesh's ranks (its process group)"
        )
    if group is not None:
        return DataParallel(group, api=API)
    if mesh is not None:
        return Sharded(mesh, api=API)
    if parallel is not None and not isinstance(parallel, SingleProcess):
        raise TypeError(
            f"funcamp.{API}: `parallel` must be funcamp.distributed.DataParallel(group), "
            f"Sharded(mesh) or None, got {type(parallel).__name__}"
        )
    return parallel


def _bound(parallel: SingleProcess, policy: Policy) -> SingleProcess:
    """A copy of ``parallel`` for this step: the delayed-FP8 margin comes from the policy, and
    a piece that keeps per-state layouts (sharded) keeps them per step."""
    piece = copy.copy(parallel)
    piece.margin = policy.fp8.recipe.margin if policy.fp8 is not None else 0
    return piece
