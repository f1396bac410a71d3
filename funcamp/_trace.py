"""``trace``: run a function under ``amp`` and record which op ran in which dtype."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp._amp import _as_policy, _check_fn, _context, _run
from funcamp._ops import OpRule, op_name
from funcamp._policy import Policy, _cast_floating

__all__ = ["AmpTrace", "OpRecord", "trace"]

_SKIP_NAMES = frozenset({"__get__", "__set__", "__torch_function__"})


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
    def __init__(self) -> None:
        self.records: list[OpRecord] = []
        self.fp8: list[Any] = []  # Fp8Record per linear call run in FP8

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
        if name in _SKIP_NAMES:
            return
        canonical = op_name(func) or name
        inplace = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
        tracker = mode.tracker
        self.records.append(
            OpRecord(
                op=canonical,
                rule=rule if rule is not None else OpRule.NONE,
                input_dtypes=_dtypes(args) + _dtypes(kwargs),
                output_dtypes=_dtypes(out),
                module=tracker.path if tracker is not None else None,
                inplace=inplace,
                out="out" in kwargs,
            )
        )

    def record_fp8(
        self, func: Any, ctx: Any, mode: Any, operands: Any, out: Any, record: Any
    ) -> None:
        """An FP8 linear: its op record (the FP8 operands as inputs) and its scales."""
        self.record(func, OpRule.COMPUTE, ctx, operands, {}, out, mode)
        self.fp8.append(record._replace(index=len(self.records) - 1))


class AmpTrace:
    """What ``trace`` saw: the records of every op, and the function's output.

    Attributes:
        output: what the traced function returned (cast to the output dtype, as ``amp`` does).
        records: one :class:`OpRecord` per op call, in call order.
        policy: the policy the function ran under.
        fp8: one :class:`funcamp.Fp8Record` per linear call that ran in FP8 (its site and
            scales; its op record, at ``fp8[i].index``, lists the FP8 operands as inputs).

    Example:
        >>> import torch, funcamp
        >>> t = funcamp.trace(lambda x: (x @ x).sum(), "mixed_bfloat16")(torch.ones(2, 2))
        >>> len(t), t.output, t.summary()
        (2, tensor(8.), {('compute', 'bfloat16'): 1, ('float32', 'float32'): 1})
    """

    def __init__(self, output: Any, records: list[OpRecord], policy: Policy, fp8: Any = ()) -> None:
        self.output = output
        self.records = records
        self.policy = policy
        self.fp8 = list(fp8)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Any:
        return iter(self.records)

    def __getitem__(self, i: int) -> OpRecord:
        return self.records[i]

    def ops(self, name: str) -> list[OpRecord]:
        """Return the records of the op ``name`` (canonical name, e.g. ``"linear"``)."""
        return [r for r in self.records if r.op == name]

    def summary(self) -> dict[tuple[str, str], int]:
        """Count op calls by (rule, output dtype): ``{("compute", "bfloat16"): 3, ...}``."""
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for r in self.records:
            out = ",".join(_short_dtype(d) for d in r.output_dtypes) or "-"
            counts[(r.rule.value, out)] += 1
        return dict(sorted(counts.items()))

    def __str__(self) -> str:
        rows = [("#", "op", "rule", "inputs", "outputs", "module")]
        for i, r in enumerate(self.records):
            flags = " (in-place)" if r.inplace else (" (out=)" if r.out else "")
            rows.append(
                (
                    str(i),
                    r.op + flags,
                    r.rule.value,
                    ",".join(_short_dtype(d) for d in r.input_dtypes) or "-",
                    ",".join(_short_dtype(d) for d in r.output_dtypes) or "-",
                    r.module or "",
                )
            )
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
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<AmpTrace: {len(self.records)} ops under {self.policy}>"


def trace(fn: Callable[..., Any], policy: Policy | str) -> Callable[..., AmpTrace]:
    """Run ``fn`` under ``amp(fn, policy)`` and record every op: name, rule, dtypes, module.

    Eager only (it records Python-side, call by call).

    Example:
        >>> import torch, funcamp
        >>> def f(x, w):
        ...     return torch.softmax(x @ w, dim=-1).sum()
        >>> t = funcamp.trace(f, "mixed_bfloat16")(torch.randn(2, 3), torch.randn(3, 3))
        >>> [(r.op, r.rule.value, str(r.output_dtypes[0])) for r in t]
        [('matmul', 'compute', 'torch.bfloat16'), ('softmax', 'float32', 'torch.float32'), ('sum', 'float32', 'torch.float32')]
        >>> t.output.dtype
        torch.float32
    """
    _check_fn(fn, "trace")
    pol = _as_policy(policy, "trace")
    ctx = _context(pol)

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> AmpTrace:
        recorder = _Recorder()
        out = _run(ctx, fn, args, kwargs, recorder)
        return AmpTrace(_cast_floating(out, pol.output_dtype), recorder.records, pol, recorder.fp8)

    return traced
