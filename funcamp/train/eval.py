"""Evaluation under a policy: :func:`make_eval_step`, compiled, without gradients."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from funcamp._core.checks import flatten_params
from funcamp._core.donation import refuse_consumed
from funcamp._core.progress import announce_first_call
from funcamp._core.tree import PyTree, describe
from funcamp.casting.amp import amp_keeping
from funcamp.casting.fp8 import Fp8State, needs_state, with_fp8_state
from funcamp.policy.policy import Policy, as_policy
from funcamp.train.compiling import (
    Patches,
    compile_fn,
    first_device_type,
    fresh_code,
    patches_for,
    rounds_casts,
    run_compiled,
)
from funcamp.train.config import Compile, new_spelling, resolve_compile
from funcamp.train.frozen import combine
from funcamp.train.loss import clone_buffers
from funcamp.train.state import TrainState

__all__ = ["make_eval_step"]
Batch = Any


def _eval_config(api: str, compile: Any, deprecated: dict[str, Any]) -> Compile | None:
    """``compile=`` and the old keywords as one :class:`Compile`, warning for the old ones."""
    if deprecated:
        warnings.warn(
            f"funcamp.{api}: {', '.join(f'{k}=' for k in deprecated)} is the old spelling; "
            f"pass {new_spelling(deprecated)} instead",
            FutureWarning,
            stacklevel=3,
        )
    return resolve_compile(api, compile, deprecated)


def make_eval_step(
    fn: Callable[..., Any],
    policy: Policy | str,
    *,
    compile: bool | Compile = True,
    **deprecated: Any,
) -> Callable[[Any, Batch], Any]:
    """Build ``eval_step(state, batch) -> fn(params, buffers, batch)``: evaluation under a policy.

    The step is compiled and takes no gradients. ``fn`` runs under ``funcamp.amp(fn, policy)``
    and ``torch.no_grad()`` (a cast at entry leaves the buffers as they are). Ops cast as the
    policy says. Every floating tensor ``fn`` returns is in the policy's output dtype (a loss,
    logits, a dict of metrics, a Hugging Face ``ModelOutput``).

    ``state`` is a :class:`TrainState` or a ``(params, buffers)`` pair. From a ``TrainState`` it
    reads ``params`` (with the ``frozen`` ones merged in), ``buffers`` and the delayed-FP8
    scales. Nothing in it is modified. ``fn`` gets copies of the buffers, so a module left in
    training mode cannot update its running statistics.

    Like the train step, the compiled step follows the modules' ``train()``/``eval()`` mode.
    Call ``model.eval()`` first (dropout off, BatchNorm's running statistics used). It says on
    stderr that it compiles on its first call, and how long it took. A failure to compile is one
    paragraph naming the way out.

    Args:
        fn: ``(params, buffers, batch) -> anything``, e.g. the train step's ``loss_fn``.
        policy: a :class:`funcamp.Policy` or a policy string.
        compile: ``True`` (default) compiles with ``torch.compile(fullgraph=True)``;
            ``False`` runs eagerly; a :class:`funcamp.Compile` says how to compile.
        **deprecated: the old spelling (``specialize=``, ``backend=``, ...): folded into
            ``compile`` with a warning.

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
    pol = as_policy(policy, api)
    cfg = _eval_config(api, compile, deprecated)
    compiler_patches = "auto" if cfg is None else cfg.compiler_patches
    specialize = cfg is not None and cfg.specialize
    compile_options = {} if cfg is None else cfg.torch_options()
    compile = cfg is not None
    run_fn = with_fp8_state(amp_keeping(fn, pol, keep=(1,)))  # buffers: not cast at entry
    fp8_stateful = needs_state(pol)

    def eval_step(params: PyTree, buffers: PyTree, fp8: Fp8State, batch: Batch) -> Any:
        with torch.no_grad():
            return run_fn(fp8, params, clone_buffers(buffers), batch)

    eval_step.__code__ = fresh_code(eval_step.__code__)
    compiled: list[tuple[Callable[..., Any], Patches]] = []

    def compiled_for(device_type: str) -> tuple[Callable[..., Any], Patches]:
        # Built on the first call, when the params' device is known (the compiler patches').
        on = patches_for(compiler_patches, device_type, compile_options)
        run = compile_fn(
            eval_step,
            compile_options,
            specialize=specialize,
            patches=on.on,
            eager_casts=rounds_casts(pol),
        )
        return announce_first_call(run, "eval step"), on

    def step(state: Any, batch: Batch) -> Any:
        if isinstance(state, TrainState):
            refuse_consumed(api, state.scaler)
            params, buffers, fp8 = combine(state.params, state.frozen), state.buffers, state.fp8
        elif isinstance(state, tuple) and len(state) == 2 and not fp8_stateful:
            (params, buffers), fp8 = state, Fp8State()
        else:
            pair = "" if fp8_stateful else " or a (params, buffers) pair"
            raise TypeError(
                f"funcamp.{api}: `state` must be a funcamp.TrainState{pair}, got {describe(state)}"
            )
        flatten_params(api, params)
        args = (params, buffers, fp8, batch)
        if not compile:
            return eval_step(*args)
        if not compiled:
            compiled.append(compiled_for(first_device_type(params)))
        run, on = compiled[0]
        return run_compiled(api, run, args, lambda: eval_step(*args), patches=on)

    step.__doc__ = f"A funcamp eval step ({'compiled' if compile else 'eager'}, policy {pol})."
    return step
