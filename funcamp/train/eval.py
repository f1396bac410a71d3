"""Evaluation under a policy: :func:`make_eval_step`, compiled, without gradients."""

from __future__ import annotations

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
    compile_fn,
    first_device_type,
    fresh_code,
    patches_for,
    rounds_casts,
    run_compiled,
)
from funcamp.train.config import Compile, compile_config
from funcamp.train.frozen import combine
from funcamp.train.loss import clone_buffers
from funcamp.train.pieces import Pieces
from funcamp.train.state import TrainState

__all__ = ["make_eval_step"]
Batch = Any

_IN_PIECES = "the step compiles it in pieces around the break"


def make_eval_step(
    fn: Callable[..., Any],
    policy: Policy | str,
    *,
    compile: bool | Compile = True,
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
    stderr that it compiles on its first call, and how long it took. ``fn`` is one graph where
    it can be; where it cannot (an RNN module, a branch on a tensor's value), it is compiled in
    pieces and the step says once, on stderr, where the graph broke
    (``Compile(fullgraph=True)`` refuses instead). A failure to compile is one paragraph naming
    the way out.

    Args:
        fn: ``(params, buffers, batch) -> anything``, e.g. the train step's ``loss_fn``.
        policy: a :class:`funcamp.Policy` or a policy string.
        compile: ``True`` (default) is ``funcamp.Compile()``; ``False`` runs eagerly; a
            :class:`funcamp.Compile` says how to compile.

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
    cfg = compile_config(api, compile)
    run_fn = with_fp8_state(amp_keeping(fn, pol, keep=(1,)))  # buffers: not cast at entry
    fp8_stateful = needs_state(pol)

    # the names `state` and `batch`: specialize=True keeps the guards on them
    def eval_step(state: tuple[PyTree, PyTree, Fp8State], batch: Batch) -> Any:
        params, buffers, fp8 = state
        with torch.no_grad():
            return run_fn(fp8, params, clone_buffers(buffers), batch)

    eval_step.__code__ = fresh_code(eval_step.__code__)
    compiled: list[Any] = []  # [run, its patches, the device type], set on the first call
    pieces = Pieces(api, None if cfg is None else cfg.fullgraph, _IN_PIECES, "`fn`")

    def compile_for(device_type: str) -> Callable[..., Any]:
        # Built when the params' device is known (the compiler patches').
        assert cfg is not None
        options = {**cfg.torch_options(), "fullgraph": not pieces.split}
        on = patches_for(cfg.compiler_patches, device_type, options)
        run = compile_fn(
            eval_step,
            options,
            specialize=cfg.specialize,
            patches=on.on,
            eager_casts=rounds_casts(pol),
        )
        what = "eval step" + " in pieces" * pieces.split
        compiled[:] = [announce_first_call(run, what), on, device_type]
        return compiled[0]

    def to_pieces(error: BaseException) -> Callable[..., Any] | None:
        return pieces.switch(error, lambda: compile_for(compiled[2]))

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
        args = ((params, buffers, fp8), batch)
        if cfg is None:
            return eval_step(*args)
        if not compiled:
            compile_for(first_device_type(params))
        return run_compiled(
            api, compiled[0], args, lambda: eval_step(*args), patches=compiled[1], pieces=to_pieces
        )

    step.__doc__ = f"A funcamp eval step ({'eager' if cfg is None else 'compiled'}, policy {pol})."
    return step
