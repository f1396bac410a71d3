"""``trace``: run a function under ``amp`` and record which op ran in which dtype."""

from __future__ import annotations

import collections
import functools
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp.casting.amp import check_fn, mode_context, run_in_mode
from funcamp.casting.entry import cast_at_entry
from funcamp.policy.ops import OpRule, op_name
from funcamp.policy.policy import Policy, as_policy, cast_floating

__all__ = ["AmpTrace", "OpRecord", "OpStats", "trace"]

_SKIP_NAMES = frozenset({"__get__", "__set__", "__torch_function__"})
# Modules a call passes through on its way to the mode (a context manager's __enter__, a
# Python Tensor method, funcamp's own mode and copies): the caller is the frame outside them.
_PASS_THROUGH = ("funcamp.", "torch.overrides", "torch.autograd", "torch.utils._contextlib")
_PASS_THROUGH_EXACT = frozenset({"contextlib", "torch._tensor", "torch.functional", "torch._ops"})

# torch.func's own code, and the tracer ``linearize`` runs the function under (make_fx).
_TORCH_FUNC_MACHINERY = (
    "torch._functorch",
    "torch.fx",
    "torch._subclasses",
    "torch._prims_common",
)


def _issued_by_torch_func() -> bool:
    """Whether the call being recorded comes from torch.func's own code (its bookkeeping:
    marking its inputs, switching grad mode, ``dim``/``size`` checks, the ``autograd.grad``
    it runs, the graph ``linearize`` traces and replays) rather than from the traced function."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if frame.f_code.co_filename.startswith("<eval_with_key"):  # an fx graph's code
            return True
        if not (module.startswith(_PASS_THROUGH) or module in _PASS_THROUGH_EXACT):
            return module.startswith(_TORCH_FUNC_MACHINERY)
        frame = frame.f_back
    return False


class OpRecord(NamedTuple):
    """One op call seen under ``amp``.

    Attributes:
        op: canonical op name (``"linear"``, ``"matmul"``) or the callable's name.
        rule: the :class:`OpRule` applied (``OpRule.NONE`` for ops run as called).
        input_dtypes: dtypes of the tensor arguments, as the op received them (after casting).
        output_dtypes: dtypes of the tensor results.
        module: path of the innermost module running (``"encoder.0.attn"``), or None.
        inplace: True for in-place ops (never cast).
        out: True for calls given ``out=`` (never cast).
        amax: with ``trace(..., stats=True)``, the largest magnitude among the op's floating
            outputs (``inf`` when one overflowed; nan elements are left out). Nan when every
            element is nan. Else None.
        nonfinite: with ``stats=True``: the fraction of the floating output elements that are
            inf or nan; else None.
        subnormal: with ``stats=True``: the fraction of the floating output elements that are
            nonzero and subnormal in their own dtype (below its smallest normal value); else
            None.

    Example:
        >>> import torch, funcamp
        >>> x = torch.ones(2, 2)
        >>> record = funcamp.trace(torch.matmul, "mixed_bfloat16")(x, x)[0]
        >>> record.op, record.rule, record.output_dtypes
        ('matmul', <OpRule.COMPUTE: 'compute'>, (torch.bfloat16,))
    """

    op: str
    rule: OpRule
    input_dtypes: tuple[torch.dtype, ...]
    output_dtypes: tuple[torch.dtype, ...]
    module: str | None
    inplace: bool
    out: bool
    amax: float | None = None
    nonfinite: float | None = None
    subnormal: float | None = None


class OpStats(NamedTuple):
    """One row of :meth:`AmpTrace.summary` for a trace taken with ``stats=True``.

    Attributes:
        count: number of op calls with this (rule, output dtype).
        amax: the largest output magnitude among them (``inf`` if one overflowed).
        nonfinite: how many of them produced an inf or nan.
        subnormal: how many of them produced a subnormal value.

    Example:
        >>> import torch, funcamp
        >>> x = torch.full((2, 2), 300.0)
        >>> t = funcamp.trace(torch.matmul, "mixed_float16", stats=True)(x, x)
        >>> t.summary()
        {('compute', 'float16'): OpStats(count=1, amax=inf, nonfinite=1, subnormal=0)}
    """

    count: int
    amax: float
    nonfinite: int
    subnormal: int


def _floating_outputs(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, (list, tuple)):
        return [t for e in x for t in _floating_outputs(e)]
    if isinstance(x, dict):
        return _floating_outputs(tuple(x.values()))
    return []


def _output_stats(out: Any) -> tuple[float | None, float | None, float | None]:
    """``(amax, nonfinite fraction, subnormal fraction)`` of the floating outputs (eager)."""
    tensors = [t.detach() for t in _floating_outputs(out)]
    if not tensors:
        return None, None, None
    total = sum(t.numel() for t in tensors)
    if total == 0:
        return 0.0, 0.0, 0.0
    with torch.no_grad():
        amax, nonfinite, subnormal, nans = 0.0, 0, 0, 0
        for t in tensors:
            if t.numel() == 0:
                continue
            a = t.abs()
            isnan = a.isnan()
            amax = max(amax, float(torch.where(isnan, 0.0, a).amax()))
            nans += int(isnan.sum())
            nonfinite += int((~torch.isfinite(t)).sum())
            tiny = torch.finfo(t.dtype).smallest_normal
            subnormal += int(((a != 0) & (a < tiny)).sum())
    if nans == total:
        amax = math.nan
    return amax, nonfinite / total, subnormal / total


def _dtypes(x: Any) -> tuple[torch.dtype, ...]:
    if isinstance(x, torch.Tensor):
        return (x.dtype,)
    if isinstance(x, (list, tuple)):
        found: tuple[torch.dtype, ...] = ()
        for e in x:
            if isinstance(e, (torch.Tensor, list, tuple)):
                found += _dtypes(e)
        return found
    if isinstance(x, dict):
        return _dtypes(tuple(x.values()))
    return ()


def _short_dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


class _Recorder:
    def __init__(self, stats: bool = False) -> None:
        self.records: list[OpRecord] = []
        self.fp8: list[Any] = []  # Fp8Record per linear or addmm call run in FP8
        self.fp8_fallbacks: list[Any] = []  # Fp8Fallback per such call of an FP8 site not run so
        self.stats = stats

    def record(
        self,
        func: Any,
        rule: OpRule | None,
        ctx: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        mode: Any,
    ) -> None:
        name = getattr(func, "__name__", None) or repr(func)
        if name in _SKIP_NAMES or _issued_by_torch_func():
            return
        canonical = op_name(func) or name
        inplace = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
        tracker = mode.tracker
        stats = _output_stats(out) if self.stats else (None, None, None)
        self.records.append(
            OpRecord(
                op=canonical,
                rule=rule if rule is not None else OpRule.NONE,
                input_dtypes=_dtypes(args) + _dtypes(kwargs),
                output_dtypes=_dtypes(out),
                module=tracker.path if tracker is not None else None,
                inplace=inplace,
                out=kwargs.get("out") is not None,
                amax=stats[0],
                nonfinite=stats[1],
                subnormal=stats[2],
            )
        )

    def record_fp8(
        self, func: Any, ctx: Any, mode: Any, operands: Any, out: Any, record: Any
    ) -> None:
        """An FP8 linear or addmm: its op record (the FP8 operands as inputs) and its scales."""
        self.record(func, OpRule.COMPUTE, ctx, operands, {}, out, mode)
        self.fp8.append(record._replace(index=len(self.records) - 1))

    def record_fp8_fallback(self, fallback: Any) -> None:
        """An FP8 call site's call that the policy runs instead: its record comes next."""
        self.fp8_fallbacks.append(fallback._replace(index=len(self.records)))


class AmpTrace:
    """What ``trace`` saw: the records of every op, and the function's output.

    Attributes:
        output: what the traced function returned (cast to the output dtype, as ``amp`` does).
        records: one :class:`OpRecord` per op call, in call order.
        policy: the policy the function ran under.
        fp8: one :class:`funcamp.Fp8Record` per linear or addmm call that ran in FP8, with its
            site and scales. Its op record, at ``fp8[i].index``, lists the FP8 operands as
            inputs.
        fp8_fallbacks: one :class:`funcamp.Fp8Fallback` per linear or addmm call of an FP8 call
            site that ran under the policy instead, with the reason.

    Example:
        >>> import torch, funcamp
        >>> t = funcamp.trace(lambda x: (x @ x).sum(), "mixed_bfloat16")(torch.ones(2, 2))
        >>> len(t), t.output, t.summary()
        (2, tensor(8.), {('compute', 'bfloat16'): 1, ('float32', 'float32'): 1})
    """

    def __init__(
        self,
        output: Any,
        records: list[OpRecord],
        policy: Policy,
        stats: bool = False,
        fp8: Any = (),
        fp8_fallbacks: Any = (),
    ) -> None:
        self.output = output
        self.records = records
        self.policy = policy
        self.stats = stats
        self.fp8 = list(fp8)
        self.fp8_fallbacks = list(fp8_fallbacks)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Any:
        return iter(self.records)

    def __getitem__(self, i: int) -> OpRecord:
        return self.records[i]

    def ops(self, name: str) -> list[OpRecord]:
        """Return the records of the op ``name`` (canonical name, e.g. ``"linear"``)."""
        return [r for r in self.records if r.op == name]

    def nonfinite(self) -> list[OpRecord]:
        """The records of the ops whose outputs hold an inf or nan, in call order (needs
        ``stats=True``). The first is where the overflow starts; its ``module`` says where.

        Example:
            >>> import torch, funcamp
            >>> f = lambda x: (x @ x).softmax(-1).sum()
            >>> t = funcamp.trace(f, "mixed_float16", stats=True)(torch.full((2, 2), 300.0))
            >>> [r.op for r in t.nonfinite()]
            ['matmul', 'softmax', 'sum']
        """
        if not self.stats:
            raise ValueError(
                "funcamp.AmpTrace.nonfinite: the trace has no output statistics; take it with "
                "funcamp.trace(fn, policy, stats=True)"
            )
        return [r for r in self.records if r.nonfinite]

    def summary(self) -> dict[tuple[str, str], Any]:
        """Count op calls by (rule, output dtype): ``{("compute", "bfloat16"): 3, ...}``.

        For a trace taken with ``stats=True`` each value is an :class:`OpStats` instead. It holds
        the count, the largest output magnitude, and how many of those ops produced a non-finite
        or a subnormal value.
        """
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        amax: dict[tuple[str, str], float] = collections.defaultdict(float)
        nonfinite: collections.Counter[tuple[str, str]] = collections.Counter()
        subnormal: collections.Counter[tuple[str, str]] = collections.Counter()
        for r in self.records:
            out = ",".join(_short_dtype(d) for d in r.output_dtypes) or "-"
            key = (r.rule.value, out)
            counts[key] += 1
            if r.amax is not None:
                amax[key] = max(amax[key], r.amax) if not math.isnan(r.amax) else amax[key]
                nonfinite[key] += bool(r.nonfinite)
                subnormal[key] += bool(r.subnormal)
        if not self.stats:
            return dict(sorted(counts.items()))
        return {
            k: OpStats(n, amax[k], nonfinite[k], subnormal[k]) for k, n in sorted(counts.items())
        }

    def __str__(self) -> str:
        header: tuple[str, ...] = ("#", "op", "rule", "inputs", "outputs")
        if self.stats:
            header += ("amax", "nonfinite", "subnormal")
        rows = [(*header, "module")]
        for i, r in enumerate(self.records):
            flags = " (in-place)" if r.inplace else (" (out=)" if r.out else "")
            row: tuple[str, ...] = (
                str(i),
                r.op + flags,
                r.rule.value,
                ",".join(_short_dtype(d) for d in r.input_dtypes) or "-",
                ",".join(_short_dtype(d) for d in r.output_dtypes) or "-",
            )
            if self.stats:
                row += _stat_cells(r)
            rows.append((*row, r.module or ""))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = [f"AmpTrace under {self.policy}: {len(self.records)} ops"]
        for row in rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        for f in self.fp8:
            grad = "per call" if f.grad_scale is None else f"{float(f.grad_scale):g}"
            lines.append(
                f"FP8 #{f.index} {f.site or '<root>'} ({f.recipe}): input scale "
                f"{float(f.input_scale):g}, weight scale {float(f.weight_scale):g}, "
                f"grad scale {grad}"
            )
        for f in self.fp8_fallbacks:
            lines.append(f"FP8 fallback #{f.index} {f.site or '<root>'}: {f.reason}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<AmpTrace: {len(self.records)} ops under {self.policy}>"


def _stat_cells(r: OpRecord) -> tuple[str, str, str]:
    if r.amax is None:
        return ("-", "-", "-")
    return (f"{r.amax:.4g}", _fraction(r.nonfinite), _fraction(r.subnormal))


def _fraction(x: float | None) -> str:
    if not x:
        return "0"
    return f"{100 * x:.3g}%"


def trace(
    fn: Callable[..., Any], policy: Policy | str, *, stats: bool = False
) -> Callable[..., AmpTrace]:
    """Run ``fn`` under ``amp(fn, policy)`` and record every op: name, rule, dtypes, module.

    Eager only: it records Python-side, call by call. With ``stats=True`` each record also carries
    the op's output amax. It also carries the fractions of its output elements that are non-finite
    and subnormal (in the output's dtype). The table and :meth:`AmpTrace.summary` show them. Under
    ``mixed_float16`` the first op whose output is non-finite is the one that overflowed float16
    (values past 65504). Under ``float32`` the amax column shows which ops would. Reading them back
    costs a host sync per op.

    Under torch.func transforms (``fn`` a ``grad``, ``vmap``, ... of a function, or calling one),
    the calls torch.func makes itself are not recorded. Those are: marking its inputs, switching
    grad mode, ``dim``/``size`` checks, and the ``autograd.grad`` it runs. The records are the
    function's own ops.

    Args:
        fn: the function to run.
        policy: a :class:`Policy` or a policy string.
        stats: record the output statistics (``amax``, ``nonfinite``, ``subnormal``).

    Example:
        >>> import torch, funcamp
        >>> def f(x, w):
        ...     return torch.softmax(x @ w, dim=-1).sum()
        >>> t = funcamp.trace(f, "mixed_bfloat16")(torch.randn(2, 3), torch.randn(3, 3))
        >>> [(r.op, r.rule.value, str(r.output_dtypes[0])) for r in t]
        [('matmul', 'compute', 'torch.bfloat16'), ('softmax', 'float32', 'torch.float32'), ('sum', 'float32', 'torch.float32')]
        >>> t.output.dtype
        torch.float32
        >>> big = funcamp.trace(f, "mixed_float16", stats=True)(torch.full((2, 3), 200.0), torch.ones(3, 3))
        >>> [(r.op, r.amax, r.nonfinite) for r in big]
        [('matmul', 600.0, 0.0), ('softmax', 0.3333333432674408, 0.0), ('sum', 2.0, 0.0)]
    """
    check_fn(fn, "trace")
    if not isinstance(stats, bool):
        raise TypeError(f"funcamp.trace: `stats` must be a bool, got {type(stats).__name__}")
    pol = as_policy(policy, "trace")
    ctx = mode_context(pol)

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> AmpTrace:
        recorder = _Recorder(stats)
        args, kwargs = cast_at_entry(pol, args, kwargs)
        out = run_in_mode(ctx, fn, args, kwargs, recorder)
        out = cast_floating(out, pol.output_dtype)
        return AmpTrace(out, recorder.records, pol, stats, recorder.fp8, recorder.fp8_fallbacks)

    return traced
