"""FP8 state and scaling: the delayed-scaling state ``Fp8State``, its update, and quantization.

``amp`` runs a scaled FP8 matmul (:mod:`funcamp.casting.fp8_matmul`) for the linear and addmm
calls of the modules a policy's :meth:`~funcamp.Policy.with_fp8` selects. This module holds the
explicit delayed-scaling state and its update, the scales, and the quantization.

Numerics, for one linear ``y = x @ w.T + b`` of an FP8 call site with compute dtype ``c``:

* ``x`` is cast to ``c`` first (as the ``COMPUTE`` rule does). ``w`` is quantized from its own
  dtype (torchao's ``Float8Linear`` does the same).
* a tensor ``t`` is quantized with a float32 scale ``s`` as
  ``clamp(t.float() * s, -max, max).to(fp8)``. This saturates, as torchao's ``to_fp8_saturated``
  and TransformerEngine's cast kernels do. ``x`` and ``w`` use ``float8_e4m3fn`` (max 448), the
  output gradient ``float8_e5m2`` (max 57344).
* ``current`` scaling (torchao's tensorwise dynamic default) uses this very tensor:
  ``s = fp8_max / max(amax(t), 1e-12)``. It is computed in float64 and rounded to float32, as
  torchao's ``amax_to_scale`` does. (That is the same float32 as a correctly rounded float32
  division for ``amax >= 1e-12``.)
* ``delayed`` scaling (TransformerEngine's ``DelayedScaling``) reads ``s`` from the
  :class:`Fp8State`. After the call the amax of each tensor joins its history (the last
  ``history`` amaxes). The next scale is ``fp8_max / max(history) / 2**margin``. It keeps the
  previous scale where that max is 0 or not finite, and is ``float32.max`` where the quotient
  overflows (TransformerEngine's ``_default_sf_compute``).
* the three matmuls (``y``, ``dx = g @ w``, ``dw = g.T @ x``) run with ``torch._scaled_mm`` on
  the FP8 operands. They use the inverse scales ``1/s`` (rounded once from float64) and output
  in ``c``. The bias is added after, in ``c`` (torchao). ``dw`` is cast to ``w``'s dtype, as the
  backward of a ``COMPUTE`` cast does.

An ``addmm(b, x, w)`` with ``w`` of shape ``(in, out)`` (as Hugging Face's ``Conv1D`` keeps it)
runs as the linear with weight ``w.T``. ``w``'s per-tensor scale and FP8 values do not depend on
its layout, so the quantization, matmuls and state are the same.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed._functional_collectives as funcol

from funcamp._core.tree import describe
from funcamp.policy.fp8 import E4M3, E5M2
from funcamp.policy.policy import as_policy

__all__ = [
    "Fp8State",
    "all_reduce_amax",
    "current_scale",
    "delayed_update",
    "fp8_update",
    "needs_state",
    "quantize",
    "with_fp8_state",
]

F = TypeVar("F", bound=Callable[..., Any])

_EPS = 1e-12  # torchao's EPS: the smallest amax a current scale is computed from

_F32_MAX = torch.finfo(torch.float32).max

_ROWS = ("input", "weight", "grad_output")


class Fp8State(NamedTuple):
    """Delayed-scaling state of every FP8 call site: amax histories and scales. Pure data.

    ``amax_history[site]`` is a float32 tensor of shape ``(3, history)``, and ``scale[site]`` one
    of shape ``(3,)``. The rows are the input, the weight and the output gradient. The newest
    amax is the last column. Sites are module paths as ``named_modules()`` gives them. The state
    is empty (``Fp8State()``) when no delayed recipe is used. Build it with :meth:`init` (or
    ``TrainState.create(..., model=module)``). It is a NamedTuple, so it flattens, compiles and
    checkpoints like any state.

    Example:
        >>> import torch, funcamp
        >>> policy = funcamp.get_policy("mixed_bfloat16").with_fp8(funcamp.Fp8Recipe.delayed(4))
        >>> state = funcamp.Fp8State.init(torch.nn.Sequential(torch.nn.Linear(2, 2)), policy)
        >>> list(state.scale), state.amax_history["0"].shape, state.scale["0"]
        (['0'], torch.Size([3, 4]), tensor([1., 1., 1.]))
    """

    amax_history: dict[str, torch.Tensor] = {}  # noqa: RUF012 (never mutated: a pure value)
    scale: dict[str, torch.Tensor] = {}  # noqa: RUF012

    @classmethod
    def init(
        cls,
        module: torch.nn.Module,
        policy: Any,
        *,
        device: torch.device | str | None = None,
    ) -> Fp8State:
        """The initial state for the FP8 call sites of ``module`` under ``policy``.

        One entry per submodule (the root included) whose linear and addmm calls the policy runs
        in FP8, with histories of zeros and scales of 1 (TransformerEngine's initial values).
        Empty when the policy has no delayed FP8 recipe.

        Args:
            module: the root module (the one run by ``functional_call``).
            policy: a :class:`funcamp.Policy` or a policy string.
            device: where the tensors live; default the device of ``module``'s first parameter.

        Returns:
            An :class:`Fp8State`.

        Example:
            >>> import torch, funcamp
            >>> p = funcamp.get_policy("bf16-mixed").with_fp8(funcamp.Fp8Recipe.delayed(),
            ...                                              exclude=("2",))
            >>> model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ReLU(),
            ...                             torch.nn.Linear(4, 1))
            >>> list(funcamp.Fp8State.init(model, p).scale)
            ['0']
        """
        pol = as_policy(policy, "Fp8State.init")
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"funcamp.Fp8State.init: `module` must be a torch.nn.Module, got {describe(module)}"
            )
        config = pol.fp8
        if config is None or not config.recipe.stateful:
            return cls({}, {})
        if device is None:
            first = next(module.parameters(), None)
            device = first.device if first is not None else None
        history, scale = {}, {}
        for path, sub in module.named_modules():
            if config.matches(sub, path):
                history[path] = torch.zeros(3, config.recipe.history, device=device)
                scale[path] = torch.ones(3, device=device)
        return cls(history, scale)


def fp8_update(state: Fp8State, grads: Fp8State) -> Fp8State:
    """The new :class:`Fp8State` from its "gradient": the overwrite-with-gradient merge.

    Under :func:`with_fp8_state`, differentiating with respect to the FP8 state does not give a
    derivative. For each call site that ran, it gives its *new* state (new histories and
    scales). Sites that did not run get zeros. This keeps the new state where a site ran (its
    new scale is never 0), and the old one elsewhere. Pure: nothing is mutated.

    Args:
        state: the state the step started from.
        grads: the gradient of the loss with respect to ``state``.

    Returns:
        The state for the next step.

    Example:
        >>> import torch, funcamp
        >>> old = funcamp.Fp8State({"a": torch.zeros(3, 2)}, {"a": torch.ones(3)})
        >>> unused = funcamp.Fp8State({"a": torch.zeros(3, 2)}, {"a": torch.zeros(3)})
        >>> funcamp.fp8_update(old, unused).scale["a"]
        tensor([1., 1., 1.])
    """
    if not isinstance(state, Fp8State) or not isinstance(grads, Fp8State):
        raise TypeError(
            "funcamp.fp8_update: `state` and `grads` must be funcamp.Fp8State values (the state "
            f"and its gradient), got {describe(state)} and {describe(grads)}"
        )
    if set(state.scale) != set(grads.scale):
        raise ValueError(
            f"funcamp.fp8_update: `grads` must have the sites of `state` {sorted(state.scale)}, "
            f"got {sorted(grads.scale)}"
        )
    history, scale = {}, {}
    for site in state.scale:
        ran = grads.scale[site].amax() > 0
        history[site] = torch.where(ran, grads.amax_history[site], state.amax_history[site])
        scale[site] = torch.where(ran, grads.scale[site], state.scale[site])
    return Fp8State(history, scale)


# ------------------------------------------------------------------------------------ scope
class _Scope:
    """The state visible to FP8 linears of the function run by :func:`with_fp8_state`."""

    def __init__(self, state: Fp8State) -> None:
        self.state = state
        self.used: set[str] = set()


class _Scopes(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Scope] = []


_SCOPES = _Scopes()


def with_fp8_state(fn: F) -> Callable[..., Any]:
    """Thread an explicit :class:`Fp8State` through ``fn``: ``g(fp8_state, *args, **kwargs)``.

    ``g`` calls ``fn(*args, **kwargs)``, and the delayed-scaling FP8 linears inside read their
    scales from ``fp8_state``. (Those are the linears of an ``amp``-wrapped function whose policy
    has ``with_fp8(Fp8Recipe.delayed(...))``.) The new state comes back as the *gradient* with
    respect to ``fp8_state`` (flax's "overwrite with gradient"). The output gradient's amax is
    only known in the backward pass, so the backward pass is where the state is produced.
    Differentiate with ``torch.func.grad(g, argnums=(0, 1))`` (or autograd). Then pass the
    state's gradient to :func:`fp8_update`. Without differentiation (evaluation) the state is
    only read.

    A call site may run once per call of ``g`` (its two updates would add up); a second call
    raises.

    Example:
        >>> import torch, funcamp
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16))
        >>> policy = funcamp.get_policy("mixed_bfloat16").with_fp8(funcamp.Fp8Recipe.delayed(4))
        >>> fp8 = funcamp.Fp8State.init(model, policy)
        >>> def loss(params, x):
        ...     return torch.func.functional_call(model, params, (x,)).square().mean()
        >>> g = funcamp.with_fp8_state(funcamp.amp(loss, policy))
        >>> params = dict(model.named_parameters())
        >>> fp8_grads, grads = torch.func.grad(g, argnums=(0, 1))(fp8, params, torch.ones(4, 16))
        >>> fp8 = funcamp.fp8_update(fp8, fp8_grads)
        >>> fp8.amax_history["0"][:, -1] > 0          # this step's amaxes, newest last
        tensor([True, True, True])
    """
    if not callable(fn):
        raise TypeError(f"funcamp.with_fp8_state: `fn` must be callable, got {describe(fn)}")

    def run(fp8_state: Fp8State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(fp8_state, Fp8State):
            raise TypeError(
                "funcamp.with_fp8_state: the first argument must be a funcamp.Fp8State (see "
                f"Fp8State.init), got {describe(fp8_state)}"
            )
        stack = _SCOPES.stack
        stack.append(_Scope(fp8_state))
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()

    return run


def site_state(site: str) -> tuple[torch.Tensor, torch.Tensor]:
    stack = _SCOPES.stack
    if not stack:
        raise RuntimeError(
            f"funcamp.amp: the linear call at {site!r} runs with delayed FP8 scaling, which "
            "needs its Fp8State: call the function through funcamp.with_fp8_state(fn)(fp8_state, "
            "...) or train with make_train_step (state from TrainState.create(..., model=model))"
        )
    scope = stack[-1]
    state = scope.state
    if site not in state.scale:
        raise KeyError(
            f"funcamp.amp: `fp8_state` has no entry for the FP8 call site {site!r} (it has "
            f"{sorted(state.scale)}); build it with Fp8State.init(model, policy) or "
            "TrainState.create(..., model=model) for the root module the function runs"
        )
    if site in scope.used:
        raise RuntimeError(
            f"funcamp.amp: the FP8 call site {site!r} ran twice in one call; delayed scaling "
            "keeps one state per call site. Exclude it (Policy.with_fp8(..., exclude=(...))) or "
            "use Fp8Recipe.current()"
        )
    scope.used.add(site)
    return state.amax_history[site], state.scale[site]


# ------------------------------------------------------------------------------------ numerics
def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def tensor_amax(t: torch.Tensor) -> torch.Tensor:
    return t.detach().abs().amax().to(torch.float32)


def current_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's ``amax_to_scale``: ``fp8_max / max(amax, 1e-12)`` in float64, as float32."""
    return (_fp8_max(dtype) / torch.clamp(amax.to(torch.float64), min=_EPS)).to(torch.float32)


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    # One rounding from float64: the same in eager and compiled code (inductor may lower a
    # float32 reciprocal differently).
    return (1.0 / scale.to(torch.float64)).to(torch.float32)


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast: ``clamp(t.float() * scale, -max, max).to(dtype)``."""
    m = _fp8_max(dtype)
    return (t.to(torch.float32) * scale).clamp(-m, m).to(dtype)


def delayed_update(
    history: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """TransformerEngine's delayed-scaling update for the three rows of a call site."""
    history = torch.cat([history[:, 1:], amax.to(history.dtype)[:, None]], dim=1)
    return history, _delayed_scale(history, scale, margin)


def _delayed_scale(history: torch.Tensor, scale: torch.Tensor, margin: int) -> torch.Tensor:
    """The scales of a call site's three rows from their amax histories (``scale`` where the
    history's peak is 0 or not finite)."""
    peak = history.amax(dim=1).to(torch.float64)
    fp8_max = torch.tensor(
        [_fp8_max(E4M3), _fp8_max(E4M3), _fp8_max(E5M2)], dtype=torch.float64, device=peak.device
    )
    # (fp8_max / amax) / 2**margin, rounded once to float32 (exact: the division by a power of
    # two is), like TransformerEngine's float32 arithmetic but the same eager and compiled.
    new = (fp8_max / peak / 2.0**margin).to(torch.float32)
    new = torch.where((peak > 0) & torch.isfinite(peak), new, scale)
    return torch.where(torch.isinf(new), torch.full_like(new, _F32_MAX), new)


def all_reduce_amax(state: Fp8State, grads: Fp8State, margin: int, group: Any) -> Fp8State:
    """Data parallel: the FP8 "gradient" with amax histories max-reduced over the ranks.

    The "gradient" is the new state (see :func:`fp8_update`). Each site's amax histories are
    max-reduced over the ranks of ``group``, and the scales recomputed from them. This is how
    TransformerEngine reduces amaxes over its data-parallel group. It takes one packed
    all-reduce, and every rank gets the same new state. ``state`` (the same on every rank) gives
    the fallback scales. A site counts as run when it ran on any rank.
    """
    sites = list(state.scale)
    if not sites:
        return grads
    parts = []
    for site in sites:
        ran = (grads.scale[site].amax() > 0).to(torch.float32).reshape(1)
        parts += [grads.amax_history[site].reshape(-1), ran]
    got = funcol.wait_tensor(funcol.all_reduce(torch.cat(parts), "max", group))
    history, scale, pos = {}, {}, 0
    for site in sites:
        like = grads.amax_history[site]
        reduced = got[pos : pos + like.numel()].view(like.shape)
        ran = got[pos + like.numel()] > 0
        pos += like.numel() + 1
        history[site] = reduced
        new = _delayed_scale(reduced, state.scale[site], margin)
        scale[site] = torch.where(ran, new, torch.zeros_like(new))
    return Fp8State(history, scale)


def needs_state(policy: Any) -> bool:
    """Whether ``policy`` runs FP8 linears with delayed scaling (an :class:`Fp8State`)."""
    config = getattr(policy, "fp8", None)
    return config is not None and config.recipe.stateful


def _check_fp8_state(state: Any, api: str) -> None:
    if not isinstance(state, Fp8State):
        raise TypeError(
            f"funcamp.{api}: `state.fp8` must be a funcamp.Fp8State, got {describe(state)}"
        )
