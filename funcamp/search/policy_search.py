"""``search_policy``: find the cheapest per-module policy whose loss and gradients stay close to
float32's.

Starting from a low-precision base policy, each candidate module is either left in the compute
dtype or given a float32 module policy (:meth:`funcamp.Policy.with_module_policies`). Every
policy tried is measured the same way: one forward and backward pass of ``loss_fn`` on the
given arguments, compared with float32's loss and gradients. The algorithm, its cost and its
guarantees are in :func:`search_policy`'s docstring.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.checks import flatten_params
from funcamp._core.tree import NAMESPACE, describe
from funcamp.casting.amp import amp, check_fn
from funcamp.casting.trace import trace
from funcamp.policy.ops import OpRule
from funcamp.policy.policy import ModuleKey, Policy, as_policy, check_module_key
from funcamp.scaling.headroom import headroom_of

__all__ = ["PolicyDecision", "SearchReport", "search_policy"]

_API = "search_policy"
_SEED = 0
_MAX_LOG2_SCALE = 24


class PolicyDecision(NamedTuple):
    """What :func:`search_policy` decided for one candidate module.

    Attributes:
        candidate: the module path (or class, or glob) as given or found by the trace.
        precision: ``"compute"`` (left in the base policy's compute dtype) or ``"float32"``
            (given a float32 module policy).
        loss_error: relative loss error with *only* this candidate in the compute dtype (every
            other candidate in float32); nan when the base policy passed and nothing was
            measured alone.
        grad_error: the same for the gradients (relative L2 error over all leaves).
        reason: why, in words.

    Example:
        >>> import funcamp
        >>> d = funcamp.PolicyDecision("fc", "compute", 1e-4, 2e-4, "within tolerance")
        >>> d.precision
        'compute'
    """

    candidate: ModuleKey
    precision: str
    loss_error: float
    grad_error: float
    reason: str


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """What :func:`search_policy` measured and decided.

    Attributes:
        base: the starting policy.
        policy: the policy returned.
        tolerance: the relative tolerance on the loss and on the gradients.
        loss_scale: the loss scale the gradients were measured with (a power of two chosen from
            the float32 gradients' :func:`funcamp.headroom` for a float16 base, else 1).
        reference_loss: the float32 loss.
        base_loss_error: relative loss error of ``base``.
        base_grad_error: relative gradient error of ``base``.
        loss_error: relative loss error of ``policy``.
        grad_error: relative gradient error of ``policy``.
        within_tolerance: whether ``policy`` met the tolerance (False only when even every
            candidate in float32 does not: the rest of the work is not in any candidate).
        decisions: one :class:`PolicyDecision` per candidate, in candidate order.
        runs: forward and backward passes made, the float32 reference included.
        traced: forward passes made under :func:`funcamp.trace` to find the candidates (0 or 1).

    Example:
        >>> import torch, funcamp
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 1))
        >>> params = dict(model.named_parameters())
        >>> loss = lambda p, x: torch.func.functional_call(model, p, (x,)).square().mean()
        >>> x = torch.ones(4, 2)
        >>> policy, report = funcamp.search_policy(loss, params, x, base="mixed_bfloat16", tolerance=0.1)
        >>> report.within_tolerance, report.runs, [d.precision for d in report.decisions]
        (True, 2, ['compute'])
    """

    base: Policy
    policy: Policy
    tolerance: float
    loss_scale: float
    reference_loss: float
    base_loss_error: float
    base_grad_error: float
    loss_error: float
    grad_error: float
    within_tolerance: bool
    decisions: tuple[PolicyDecision, ...]
    runs: int
    traced: int

    @property
    def unsafe(self) -> list[ModuleKey]:
        """The candidates given a float32 module policy."""
        return [d.candidate for d in self.decisions if d.precision == "float32"]

    def __str__(self) -> str:
        rows = [("candidate", "precision", "loss error", "grad error", "reason")]
        for d in self.decisions:
            rows.append(
                (
                    _key_name(d.candidate),
                    d.precision,
                    _err(d.loss_error),
                    _err(d.grad_error),
                    d.reason,
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [
            f"search_policy from {self.base} (tolerance {self.tolerance:g}, loss scale "
            f"{self.loss_scale:g}, {self.runs} forward/backward runs)",
            f"  float32 loss {self.reference_loss:.6g}; base: loss error "
            f"{_err(self.base_loss_error)}, grad error {_err(self.base_grad_error)}",
            f"  result: {len(self.unsafe)} of {len(self.decisions)} candidates in float32; "
            f"loss error {_err(self.loss_error)}, grad error {_err(self.grad_error)}"
            + ("" if self.within_tolerance else " (NOT within tolerance)"),
        ]
        for row in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        return "\n".join(lines)


def _key_name(key: ModuleKey) -> str:
    return key if isinstance(key, str) else key.__name__


def _err(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3g}"


class _Measure(NamedTuple):
    loss_error: float
    grad_error: float

    def within(self, tolerance: float) -> bool:
        return self.loss_error <= tolerance and self.grad_error <= tolerance


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    denom = float(torch.linalg.vector_norm(want))
    diff = float(torch.linalg.vector_norm(got - want))
    return diff / denom if denom > 0 else diff


class _Runner:
    """Runs ``loss_fn`` under a policy and measures it against float32; caches by policy."""

    def __init__(
        self, loss_fn: Callable[..., Any], params: Any, args: tuple[Any, ...], kwargs: Any
    ) -> None:
        self.loss_fn = loss_fn
        self.params = params
        self.args = args
        self.kwargs = kwargs
        self.runs = 0
        self.cache: dict[Policy, _Measure] = {}
        self.scale = 1.0
        self.ref_loss = torch.zeros(())
        self.ref_grads = torch.zeros(0)

    def _grads(self, policy: Policy | None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        fn = self.loss_fn if policy is None else amp(self.loss_fn, policy)
        params = self.params if policy is None else policy.cast_to_param(self.params)
        scale = 1.0 if policy is None else self.scale

        def scaled(p: Any) -> tuple[torch.Tensor, torch.Tensor]:
            loss = fn(p, *self.args, **self.kwargs)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(
                    f"funcamp.{_API}: `loss_fn` must return a 0-d floating tensor (the loss), "
                    f"got {describe(loss)}"
                )
            loss = loss.to(torch.float32)
            return loss * scale, loss.detach()

        with torch.random.fork_rng():
            torch.manual_seed(_SEED)  # the same dropout masks (or any randomness) in every run
            grads, loss = torch.func.grad(scaled, has_aux=True)(params)
        self.runs += 1
        leaves = optree.tree_leaves(grads, namespace=NAMESPACE)
        flat = torch.cat([g.detach().reshape(-1).to(torch.float32) for g in leaves])
        return loss, flat / scale, grads

    def reference(self) -> Any:
        self.ref_loss, self.ref_grads, grads = self._grads(None)
        if not (bool(torch.isfinite(self.ref_loss)) and bool(torch.isfinite(self.ref_grads).all())):
            raise ValueError(
                f"funcamp.{_API}: the float32 loss or gradients are not finite (loss "
                f"{float(self.ref_loss)}); the search compares against float32, which must work"
            )
        return grads

    def measure(self, policy: Policy) -> _Measure:
        if policy not in self.cache:
            loss, grads, _ = self._grads(policy)
            self.cache[policy] = _Measure(
                _relative(loss, self.ref_loss), _relative(grads, self.ref_grads)
            )
        return self.cache[policy]


def _choose_scale(grads: Any, policy: Policy) -> float:
    """A power of two in the middle of the float32 gradients' safe range in float16."""
    if policy.compute_dtype != torch.float16 and policy.param_dtype != torch.float16:
        return 1.0
    h = headroom_of(grads, torch.ones(()), torch.float16, scaled=False, leaves=False)
    lo, hi = float(h.log2_scale_min), float(h.log2_scale_max)
    hi_k = math.ceil(hi) - 1 if math.isfinite(hi) else _MAX_LOG2_SCALE
    lo_k = math.floor(lo) + 1 if math.isfinite(lo) else -_MAX_LOG2_SCALE
    k = (lo_k + hi_k) // 2 if lo_k <= hi_k else hi_k
    return 2.0 ** max(-_MAX_LOG2_SCALE, min(_MAX_LOG2_SCALE, k))


def _traced_candidates(
    loss_fn: Callable[..., Any], params: Any, args: Any, kwargs: Any, base: Policy
) -> list[ModuleKey]:
    """Module paths where an op ran in the base compute dtype under the COMPUTE rule."""
    with torch.random.fork_rng():
        torch.manual_seed(_SEED)
        with torch.no_grad():
            t = trace(loss_fn, base)(base.cast_to_param(params), *args, **kwargs)
    found: dict[str, None] = {}
    for r in t:
        if r.module and r.rule is OpRule.COMPUTE and base.compute_dtype in r.output_dtypes:
            found.setdefault(r.module, None)
    return list(found)


def _check_candidates(candidates: Any) -> list[ModuleKey]:
    if isinstance(candidates, (str, type)) or not isinstance(candidates, Sequence):
        raise TypeError(
            f"funcamp.{_API}: `candidates` must be a list of module paths, globs or "
            f"nn.Module classes (or None for the paths the trace finds), got "
            f"{describe(candidates)}"
        )
    out: list[ModuleKey] = []
    for c in candidates:
        check_module_key(c, _API)
        if c in out:
            raise ValueError(f"funcamp.{_API}: `candidates` lists {c!r} twice")
        out.append(c)
    return out


def _builder(base: Policy, candidates: list[ModuleKey]) -> Callable[[frozenset[int]], Policy]:
    """``build(compute)``: ``base`` with the candidates not in ``compute`` (indices) in float32."""
    f32 = dataclasses.replace(
        base, compute_dtype=torch.float32, output_dtype=torch.float32, module_policies=()
    )
    flat = dataclasses.replace(base, module_policies=())

    def build(compute: frozenset[int]) -> Policy:
        overrides: dict[ModuleKey, Policy] = {}
        unsafe = [c for i, c in enumerate(candidates) if i not in compute]
        for c in unsafe:
            overrides[c] = f32
        for i, c in enumerate(candidates):
            # a path nested in a float32 one runs under it unless told otherwise
            nested = isinstance(c, str) and any(
                isinstance(u, str) and fnmatch.fnmatchcase(c, u + ".*") for u in unsafe
            )
            if i in compute and nested:
                overrides[c] = flat
        return base.with_module_policies(overrides) if overrides else base

    return build


def search_policy(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    base: Policy | str = "mixed_float16",
    candidates: Sequence[ModuleKey] | None = None,
    tolerance: float = 1e-2,
    **kwargs: Any,
) -> tuple[Policy, SearchReport]:
    """Find the cheapest policy from ``base`` whose loss and gradients stay close to float32's.

    "Cheapest" means the most candidate modules left in ``base``'s compute dtype. A candidate
    that is not safe gets a float32 module policy (``base.with_module_policies({c: float32})``).
    A policy is within tolerance when both its loss and its gradients differ from float32's by
    at most ``tolerance``, relatively, on the given arguments. The gradients count as one
    vector, in L2 norm. Any inf or nan is an infinite error.

    The search runs in steps. Each step is one forward and backward pass of ``loss_fn``,
    measured against float32 and cached, so no policy is run twice:

    1. the float32 reference (params cast to float32, no ``amp``). It fixes the loss scale: for
       a float16 base, the power of two in the middle of the reference gradients' safe range
       (:func:`funcamp.headroom`), else 1. Gradients are measured scaled, then unscaled.
    2. ``base`` itself: if within tolerance, it is returned (every candidate in compute).
    3. Each candidate alone in the compute dtype, the others in float32: a candidate over the
       tolerance alone is unsafe.
    4. All candidates that passed alone, together; if within tolerance, done.
    5. Otherwise greedily, from the smallest error alone: add each passing candidate to the
       compute set and keep it if the policy stays within tolerance.

    So with ``n`` candidates it costs at most ``2n + 2`` forward/backward runs, plus one traced
    forward when ``candidates`` is None. It costs ``2`` when ``base`` passes. It costs at most
    ``n + 3`` when the candidates that pass alone pass together, the usual case of a few bad
    modules. ``report.runs`` counts them.

    It is deterministic. Every run seeds torch's RNG the same way, inside
    ``torch.random.fork_rng`` (the global RNG is left as it was). So dropout draws the same
    masks. Ties are broken by candidate order. Greedy selection is not an exhaustive search: it
    finds a policy within tolerance, not always the largest one.

    Args:
        loss_fn: ``loss_fn(params, *args, **kwargs) -> loss`` (a 0-d floating tensor). To
            measure several batches, loop over them inside ``loss_fn`` and return their mean.
        params: a pytree of floating tensors (float32 for the reference).
        *args: passed to ``loss_fn`` (a batch).
        base: the low-precision policy to start from (a :class:`Policy` or a string).
        candidates: module paths (as ``named_modules()`` names them), globs or module
            classes. Default: the modules in which :func:`funcamp.trace` sees an op run in the
            compute dtype.
        tolerance: the largest relative error accepted for the loss and for the gradients.
        **kwargs: passed to ``loss_fn``.

    Returns:
        ``(policy, report)``: the policy and a :class:`SearchReport` listing each decision
        with the error measured (``print(report)`` shows a table).

    Example:
        >>> import torch, funcamp
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.mul_(1e5)  # activations past float16's range
        >>> params = dict(model.named_parameters())
        >>> def loss_fn(p, x):
        ...     return torch.func.functional_call(model, p, (x,)).square().mean()
        >>> policy, report = funcamp.search_policy(loss_fn, params, torch.rand(2, 4))
        >>> report.unsafe, report.runs
        (['0'], 4)
        >>> policy.module_policies[0][0], str(policy.module_policies[0][1])
        ('0', 'params=float32,compute=float32,output=float32')
    """
    check_fn(loss_fn, _API)
    pol = as_policy(base, _API)
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not (tolerance >= 0 and math.isfinite(tolerance))
    ):
        raise ValueError(
            f"funcamp.{_API}: `tolerance` must be a finite number >= 0 (a relative error), got "
            f"{tolerance!r}"
        )
    flatten_params(_API, params)
    if candidates is not None:
        candidates = _check_candidates(candidates)
    params32 = optree.tree_map(lambda x: x.detach().to(torch.float32), params, namespace=NAMESPACE)

    runner = _Runner(loss_fn, params32, args, kwargs)
    ref_grads = runner.reference()
    runner.scale = _choose_scale(ref_grads, pol)
    traced = 0
    if candidates is None:
        candidates = _traced_candidates(loss_fn, params32, args, kwargs, pol)
        traced = 1
    build = _builder(pol, candidates)
    everything = frozenset(range(len(candidates)))

    base_err = runner.measure(pol)
    nan = math.nan
    if base_err.within(tolerance):
        decisions = [
            PolicyDecision(c, "compute", nan, nan, "base policy within tolerance")
            for c in candidates
        ]
        return pol, _report(pol, pol, tolerance, runner, base_err, base_err, decisions, traced)

    alone = [runner.measure(build(frozenset({i}))) for i in range(len(candidates))]
    passing = sorted(
        (i for i in everything if alone[i].within(tolerance)),
        key=lambda i: max(alone[i]),
    )
    compute = frozenset(passing)
    reasons = {i: "over tolerance alone" for i in everything if i not in compute}
    final = runner.measure(build(compute))
    if not final.within(tolerance):
        chosen: frozenset[int] = frozenset()
        for i in passing:
            trial = chosen | {i}
            if runner.measure(build(trial)).within(tolerance):
                chosen = trial
            else:
                reasons[i] = "within tolerance alone, not with the ones kept before it"
        compute = chosen
        final = runner.measure(build(compute))
    policy = build(compute)
    decisions = [
        PolicyDecision(
            c,
            "compute" if i in compute else "float32",
            alone[i].loss_error,
            alone[i].grad_error,
            "within tolerance" if i in compute else reasons[i],
        )
        for i, c in enumerate(candidates)
    ]
    return policy, _report(pol, policy, tolerance, runner, base_err, final, decisions, traced)


def _report(
    base: Policy,
    policy: Policy,
    tolerance: float,
    runner: _Runner,
    base_err: _Measure,
    final: _Measure,
    decisions: list[PolicyDecision],
    traced: int,
) -> SearchReport:
    return SearchReport(
        base=base,
        policy=policy,
        tolerance=float(tolerance),
        loss_scale=runner.scale,
        reference_loss=float(runner.ref_loss),
        base_loss_error=base_err.loss_error,
        base_grad_error=base_err.grad_error,
        loss_error=final.loss_error,
        grad_error=final.grad_error,
        within_tolerance=final.within(tolerance),
        decisions=tuple(decisions),
        runs=runner.runs,
        traced=traced,
    )
