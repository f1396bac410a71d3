"""Gradients of the scaled loss: the forward and backward half of a train step.

:func:`scaled_grad_and_value` is the public piece: ``torch.func.grad_and_value`` of the loss
times the loss scale, with the loss itself back unscaled. :func:`forward_backward` is the train
step's use of it, with the model's buffers and the delayed-FP8 state threaded through.

:func:`grad_method` chooses between two ways to compute the same gradients:

* ``torch.func``: the default, and what a compiled step traces.
* ``torch.autograd`` on leaf copies of the differentiated inputs. It runs in plain eager, where
  it is faster with the same bits, and around the compiled loss of a step in pieces. It is
  traced into the graph for a step whose model torch.func refuses.

Workaround of torch internals (docs/internals.md#workarounds):

- Root cause: dynamo puts torch.autograd.grad into a graph only with its private option
  torch._dynamo.config.trace_autograd_ops (torch >= 2.7).
- Upstream: none filed.
- Why it is safe: patched only while dynamo traces a step; a torch without the option compiles
  the loss in pieces instead.
- Tested on: torch 2.13 and 2.14.
- Delete when: dynamo traces torch.autograd.grad by default.

"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

from funcamp._core.context import plain_eager
from funcamp._core.numerics import as_dtype
from funcamp._core.progress import logger
from funcamp._core.tree import NAMESPACE, PyTree, describe, flatten, leaf_path, spec_text, unflatten
from funcamp.casting.fp8 import Fp8State, fp8_update
from funcamp.scaling.ops import scale
from funcamp.scaling.state import ScalerState
from funcamp.train.errors import refuses_torch_func, user_frame
from funcamp.train.frozen import combine

__all__ = [
    "GradMethod",
    "clone_buffers",
    "grad_method",
    "forward_backward",
    "restore_buffers",
    "scaled_grad_and_value",
]
GradAndValue = Callable[..., Callable[..., Any]]


REENTRANT_MESSAGE = (
    "funcamp: a train step cannot run reentrant activation checkpointing "
    "(torch.utils.checkpoint.checkpoint(..., use_reentrant=True)): its backward calls "
    "torch.autograd.backward itself, which torch refuses inside torch.autograd.grad, and "
    "torch.func cannot run it at all. Use use_reentrant=False (torch's recommended form: the "
    "same values, bit for bit under funcamp.amp), transformers' "
    "model.gradient_checkpointing_enable() without gradient_checkpointing_kwargs (its default "
    'is {"use_reentrant": False}), or funcamp.remat(block)'
)


@contextlib.contextmanager
def _reentrant_refused() -> Iterator[None]:
    """torch's refusal of a reentrant checkpoint under ``torch.autograd.grad``, as the way out."""
    try:
        yield
    except RuntimeError as e:
        if "use_reentrant=True" in str(e):
            raise ValueError(REENTRANT_MESSAGE) from e
        raise


def autograd_grad_and_value(
    fn: Callable[..., Any],
    *,
    argnums: int | tuple[int, ...],
    has_aux: bool,
    backward: Callable[[], Any] = contextlib.nullcontext,
) -> Callable[..., Any]:
    """``torch.func.grad_and_value(fn, argnums, has_aux=True)``, computed by torch.autograd.

    It works on leaf copies of the differentiated arguments. Grads of unused leaves are zeros,
    as in torch.func. The backward pass runs inside ``backward()``: the train step's
    :func:`funcamp.recompute_under`, which recomputes checkpointed regions under its policy.
    """
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
            with backward(), _reentrant_refused():
                grads = torch.autograd.grad(out, flat, allow_unused=True, materialize_grads=True)
            grads = list(grads)
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


def clone_buffers(buffers: PyTree) -> PyTree:
    return optree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, buffers, namespace=NAMESPACE
    )


def _split_output(api: str, out: Any, has_aux: bool, returns_buffers: bool) -> tuple[Any, Any, Any]:
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
            f"funcamp.{api}: `loss_fn` must return a tuple {want} with {flags}, got {describe(out)}"
        )
    if has_aux and returns_buffers:
        return out
    if has_aux:
        return out[0], out[1], None
    return out[0], None, out[1]


def _check_loss(api: str, loss: Any) -> torch.Tensor:
    if isinstance(loss, (tuple, list)):
        raise TypeError(
            f"funcamp.{api}: `loss_fn` must return a 0-d floating tensor as the loss, got a "
            f"{type(loss).__name__} of {len(loss)} items; if it returns (loss, aux), build the "
            "step with has_aux=True (and returns_buffers=True if it returns new buffers)"
        )
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        raise TypeError(
            f"funcamp.{api}: `loss_fn` must return a 0-d floating tensor as the loss, got "
            f"{describe(loss)}"
        )
    return loss


def restore_buffers(api: str, new: PyTree, old: PyTree, returned: bool = True) -> PyTree:
    """Check ``new`` against ``old`` and give every leaf its old dtype back.

    ``returned`` says ``loss_fn`` returned the new buffers (``returns_buffers=True``). Otherwise
    they are the copies it was given, which it may update in place but must not rebind or
    extend.
    """
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
            f"funcamp.{api}: {what} with the structure of the state's buffers (none: "
            f"{old!r}), got {got}; keep new values out of the buffers (return them as aux with "
            "has_aux=True) or add them to the state's buffers"
        )
    # funcamp's flatten: under compile a buffers dict gets a DictSpec, where optree's
    # flattening with paths is traced in Python (~3,000 source lines on ResNet's buffers); the
    # paths are read only for a message
    old_leaves, spec = flatten(old)
    try:
        new_leaves = spec.flatten_up_to(new)
    except (ValueError, TypeError):
        raise TypeError(
            f"funcamp.{api}: {what} with the structure of the state's buffers {spec_text(spec)}, "
            f"got {optree.tree_structure(new, namespace=NAMESPACE)}; keep new values out of the "
            "buffers (return them as aux with has_aux=True) or add them to the state's buffers"
        ) from None
    out = []
    for i, o, n in zip(range(len(old_leaves)), old_leaves, new_leaves):
        if isinstance(o, torch.Tensor):
            if not isinstance(n, torch.Tensor) or n.shape != o.shape:
                raise TypeError(
                    f"funcamp.{api}: {what} shaped like the old; buffer {leaf_path(old, i)} "
                    f"should be a tensor of shape {tuple(o.shape)}, got {describe(n)}"
                )
            if n.is_complex() and not o.is_complex():
                raise TypeError(
                    f"funcamp.{api}: {what} of the old dtypes; buffer {leaf_path(old, i)} "
                    f"should be {o.dtype}, got {describe(n)}"
                )
            n = as_dtype(n, o.dtype)
        out.append(n)
    return unflatten(spec, out)


def grad_method(kind: str) -> GradAndValue:
    """The ``grad_and_value`` to differentiate with.

    ``"func"`` is ``torch.func``, and ``"autograd"`` is :func:`autograd_grad_and_value`.
    ``"auto"`` takes autograd in plain eager (same bits, faster), and torch.func otherwise
    (compiling, inside a torch.func transform). ``"auto"`` answers for the context it is asked
    in, so ask where the gradient is taken.
    """
    if kind == "autograd" or (kind == "auto" and plain_eager()):
        return autograd_grad_and_value
    return torch.func.grad_and_value


def auto_grad_and_value(
    fn: Callable[..., Any], *, argnums: int | tuple[int, ...], has_aux: bool
) -> Callable[..., Any]:
    """``grad_method("auto")``, chosen each time the gradient is taken.

    A function built in plain eager differentiates with torch.autograd there. Run under
    ``vmap`` or ``torch.compile``, it differentiates with torch.func. (torch.func refuses
    ``requires_grad_()`` on torch.autograd's leaf copies, and dynamo traces
    ``torch.autograd.grad`` only with ``trace_autograd_ops``.) Under dynamo ``plain_eager()`` is
    a constant of the trace.
    """
    return grad_method("auto")(fn, argnums=argnums, has_aux=has_aux)


def scaled_grad_and_value(
    fn: Callable[..., Any],
    scaler: ScalerState,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """``g(*args) -> (grads, loss)``: the gradients of ``scale(scaler, fn(*args))``, and the loss.

    The gradients are with respect to the arguments ``argnums``. The loss comes back unscaled,
    in float32.

    The first half of a mixed-precision step, as one piece: pass the grads (still scaled) to
    :func:`funcamp.unscale_and_step`. ``fn`` returns a 0-d floating loss, or ``(loss, aux)`` with
    ``has_aux=True``. Then ``g`` returns ``(grads, (loss, aux))``. It is
    ``torch.func.grad_and_value`` of the scaled loss. So ``g`` composes with ``vmap``, ``grad`` and
    ``torch.compile(fullgraph=True)``, built inside or outside them. In plain eager,
    ``torch.autograd`` on leaf copies of the arguments gives the same bits faster. The gradient
    method is chosen each call, where ``g`` runs.

    Example:
        >>> import torch, funcamp
        >>> scaler = funcamp.ScalerState.static(1024.0)
        >>> loss_fn = lambda w, x: (x @ w).square().mean()
        >>> grads, loss = funcamp.scaled_grad_and_value(loss_fn, scaler)(
        ...     torch.ones(2), torch.ones(3, 2))
        >>> grads, loss  # d(1024 * mean((x @ w)**2)) / dw; the loss unscaled
        (tensor([4096., 4096.]), tensor(4.))

        Per-sample gradients, with one scaler:

        >>> g = funcamp.scaled_grad_and_value(lambda w, x: (x @ w).square(), scaler)
        >>> grads, losses = torch.func.vmap(g, in_dims=(None, 0))(torch.ones(2), torch.eye(2))
        >>> grads, losses
        (tensor([[2048.,    0.],
                [   0., 2048.]]), tensor([1., 1.]))
    """
    api = "scaled_grad_and_value"
    if not callable(fn):
        raise TypeError(f"funcamp.{api}: `fn` must be callable, got {describe(fn)}")
    if not isinstance(scaler, ScalerState):
        raise TypeError(
            f"funcamp.{api}: `scaler` must be a funcamp.ScalerState, got {describe(scaler)}"
        )
    return _scaled(api, fn, scaler, argnums, has_aux, auto_grad_and_value)


def _scaled(
    api: str,
    fn: Callable[..., Any],
    scaler: ScalerState,
    argnums: int | tuple[int, ...],
    has_aux: bool,
    grad_and_value: GradAndValue,
) -> Callable[..., tuple[Any, Any]]:
    def scaled_loss(*args: Any) -> tuple[torch.Tensor, Any]:
        out = fn(*args)
        loss, aux = out if has_aux else (out, None)
        loss = _check_loss(api, loss).to(torch.float32)
        # Without aux the loss alone rides as torch.func's aux: vmap refuses a None output.
        return scale(scaler, loss), ((loss.detach(), aux) if has_aux else loss.detach())

    def run(*args: Any) -> tuple[Any, Any]:
        # grad_and_value is called here, per call: auto_grad_and_value picks the gradient method for
        # the context this call runs in (eager, a torch.func transform, dynamo).
        grads, (_, value) = grad_and_value(scaled_loss, argnums=argnums, has_aux=True)(*args)
        return grads, value

    return run


def forward_backward(
    api: str,
    run_loss: Callable[..., Any],
    state: Any,
    batch: Any,
    *,
    has_aux: bool,
    returns_buffers: bool,
    fp8_stateful: bool,
    grad_and_value: GradAndValue,
    gather: Callable[[PyTree], PyTree],
    fp8_reduce: Callable[[Fp8State, Fp8State], Fp8State],
) -> tuple[PyTree, torch.Tensor, Any, PyTree, Fp8State]:
    """A train step's forward and backward.

    It returns ``(scaled grads, loss, aux, new buffers, new FP8 state)``, the loss in float32,
    unscaled. ``run_loss(fp8, params, buffers, batch)`` is the user's loss under ``amp``, with
    the FP8 state threaded. It runs on ``gather(params)`` (the sharded step's all-gather of its
    local shards). The frozen params are merged in, as constants of the gradient. It runs on
    copies of the buffers, so that in-place updates (BatchNorm under ``functional_call``)
    become the new buffers. With delayed FP8 the state is differentiated too. Its "gradient" is
    this step's amaxes, combined across ranks by ``fp8_reduce``. :func:`funcamp.fp8_update`
    makes the new state from them.
    """

    def loss_of(params: PyTree, fp8: Fp8State) -> tuple[Any, tuple[Any, PyTree]]:
        # Copies made inside the transform, so in-place buffer updates are allowed.
        buffers = state.buffers if returns_buffers else clone_buffers(state.buffers)
        loss, aux, new_buffers = _split_output(
            api,
            run_loss(fp8, combine(gather(params), state.frozen), buffers, batch),
            has_aux,
            returns_buffers,
        )
        return loss, (aux if has_aux else (), new_buffers if returns_buffers else buffers)

    argnums = (0, 1) if fp8_stateful else 0
    grads, (loss, (aux, new_buffers)) = _scaled(
        api, loss_of, state.scaler, argnums, True, grad_and_value
    )(state.params, state.fp8)
    new_fp8 = state.fp8
    if fp8_stateful:  # every rank scales with the amaxes of all ranks
        grads, fp8_grads = grads
        new_fp8 = fp8_update(state.fp8, fp8_reduce(state.fp8, fp8_grads))
    return grads, loss, aux, new_buffers, new_fp8


@functools.cache
def can_trace_autograd() -> bool:
    """Whether dynamo traces ``torch.autograd.grad`` into a graph.

    Dynamo does with its option ``trace_autograd_ops`` (torch >= 2.7). This is asked after a
    failed trace, when dynamo is loaded (``import funcamp`` does not load it). The answer is
    kept.
    """
    return hasattr(torch._dynamo.config, "trace_autograd_ops")


class GradMethod:
    """Which ``grad_and_value`` a train step differentiates with, asked when it is traced.

    It is ``torch.func`` by default. It is ``torch.autograd`` on leaf copies in three cases:

    * a step compiled in pieces (:mod:`funcamp.train.pieces`), whose forward and backward run
      in Python around the compiled loss, since dynamo cannot resume a frame inside
      ``torch.func.grad``;
    * plain eager (same bits, faster), except with delayed FP8, whose state is differentiated
      through torch.func;
    * once torch.func has refused the model (:meth:`switch`); it is traced into the same graph
      then.
    """

    def __init__(
        self,
        *,
        pieces: bool,
        compiled: bool,
        fp8_stateful: bool,
        backward: Callable[[], Any] = contextlib.nullcontext,
    ) -> None:
        self.pieces = pieces
        self.compiled = compiled
        self.fp8_stateful = fp8_stateful
        self.in_graph = False
        self.backward = backward

    def __call__(self) -> GradAndValue:
        if (
            self.pieces
            or self.in_graph
            or (not self.compiled and not self.fp8_stateful and plain_eager())
        ):
            return functools.partial(autograd_grad_and_value, backward=self.backward)
        return torch.func.grad_and_value

    def switch(self, error: BaseException) -> bool:
        """After a failed trace, switch to torch.autograd where torch.func refused the model.

        torch.func refuses an autograd function without ``setup_context``, such as a custom
        op's registered formula (Hugging Face's MoE ``grouped_mm``). It also refuses
        activation checkpointing, whose saved-tensor hooks it does not support. The step then
        differentiates with torch.autograd in the graph from now on, and says so. Returns True
        when the step should be traced again.
        """
        if self.pieces or self.in_graph or not can_trace_autograd():
            return False
        if not refuses_torch_func(error):
            return False
        self.in_graph = True
        logger.info(
            "funcamp: torch.func cannot differentiate %s (an autograd function without "
            "setup_context, such as a custom op's registered formula, or activation "
            "checkpointing); the step takes its gradients from torch.autograd, in the same graph",
            user_frame(error) or "the model",
        )
        return True

    def tracing(self) -> Any:
        """While dynamo traces the step: what torch.autograd in the graph needs."""
        if not self.in_graph:
            return contextlib.nullcontext()
        return torch._dynamo.config.patch(trace_autograd_ops=True)
