"""trace: records of every op, its rule, dtypes and module; the table and the summary."""

from __future__ import annotations

import pytest
import torch
from amp_zoo import one_thread  # noqa: F401 (autouse fixture)
from torch import nn
from torch.func import functional_call

import funcamp
from funcamp import OpRule

BF16, F32 = torch.bfloat16, torch.float32


def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x @ w, dim=-1).sum()


def test_records_and_output() -> None:
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    t = funcamp.trace(f, "params=float32,compute=bfloat16,output=bfloat16")(x, w)
    assert [r.op for r in t] == ["matmul", "softmax", "sum"]
    assert [r.rule for r in t] == [OpRule.COMPUTE, OpRule.FLOAT32, OpRule.FLOAT32]
    assert t[0].input_dtypes == (BF16, BF16) and t[0].output_dtypes == (BF16,)
    assert t[1].output_dtypes == (F32,) and t[2].output_dtypes == (F32,)
    assert not any(r.inplace or r.out or r.module for r in t)
    assert t.output.dtype == BF16
    assert torch.equal(t.output, funcamp.amp(f, "c=bf16")(x, w))
    assert len(t) == 3 and t.ops("softmax") == [t[1]]
    assert t.summary() == {("compute", "bfloat16"): 1, ("float32", "float32"): 2}


def test_str_is_a_table() -> None:
    t = funcamp.trace(f, "mixed_bfloat16")(torch.randn(2, 3), torch.randn(3, 3))
    lines = str(t).splitlines()
    assert lines[0] == "AmpTrace under params=float32,compute=bfloat16,output=float32: 3 ops"
    assert lines[1].split() == ["#", "op", "rule", "inputs", "outputs", "module"]
    assert lines[2].split() == ["0", "matmul", "compute", "bfloat16,bfloat16", "bfloat16"]
    assert repr(t) == "<AmpTrace: 3 ops under params=float32,compute=bfloat16,output=float32>"


def test_module_paths_through_functional_call() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    params = dict(model.named_parameters())
    t = funcamp.trace(lambda p, x: functional_call(model, p, (x,)).sum(), "mixed_bfloat16")(
        params, torch.randn(5, 3)
    )
    assert [(r.op, r.module) for r in t] == [
        ("linear", "0"),
        ("relu", "1.0"),
        ("linear", "1.1"),
        ("sum", None),
    ]


def test_trace_errors() -> None:
    with pytest.raises(TypeError, match=r"funcamp.trace: `fn` must be callable"):
        funcamp.trace(None, "float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown policy 'f7'"):
        funcamp.trace(f, "f7")


# ------------------------------------------------------------------------- stats=True


def test_stats_overflow_and_subnormal() -> None:
    """float16: a matmul past 65504 overflows to inf; a tiny product lands subnormal."""
    x = torch.full((2, 2), 300.0)  # 300 * 300 * 2 = 180000 > 65504
    t = funcamp.trace(torch.matmul, "mixed_float16", stats=True)(x, x)
    (r,) = t.records
    assert r.amax == float("inf") and r.nonfinite == 1.0 and r.subnormal == 0.0
    tiny = torch.tensor([1e-6, 1.0, 0.0, 2e-5], dtype=torch.float16)  # 1e-6, 2e-5 < 2**-14

    def f(a):
        return a * 1.0

    (r,) = funcamp.trace(f, "mixed_float16", stats=True)(tiny).records
    assert r.output_dtypes == (torch.float16,)
    assert r.amax == 1.0 and r.nonfinite == 0.0 and r.subnormal == 0.5
    # the same values are normal in float32: subnormal is judged in the output's own dtype
    (r,) = funcamp.trace(f, "float32", stats=True)(tiny.float()).records
    assert r.subnormal == 0.0


def test_stats_nan_amax_and_non_float_outputs() -> None:
    x = torch.tensor([float("nan"), -3.0, float("inf"), 1.0])
    t = funcamp.trace(lambda a: (a * 1.0, a.argmax()), "float32", stats=True)(x)
    mul, argmax = t.records
    assert mul.amax == float("inf") and mul.nonfinite == 0.5 and mul.subnormal == 0.0
    assert argmax.amax is None and argmax.nonfinite is None  # no floating output
    (r,) = funcamp.trace(lambda a: a * 1.0, "float32", stats=True)(torch.full((3,), float("nan")))
    assert r.nonfinite == 1.0 and r.amax != r.amax  # nan when every element is nan


def test_stats_point_at_the_overflowing_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    with torch.no_grad():
        model[1].weight.mul_(1e6)
    params = dict(model.named_parameters())

    def loss(p, x):
        return functional_call(model, p, (x,)).square().mean()

    x = torch.rand(3, 4)
    broken = funcamp.trace(loss, "mixed_float16", stats=True)(params, x)
    first = broken.nonfinite()[0]
    assert (first.op, first.module) == ("linear", "1")
    assert broken.records[0].nonfinite == 0.0  # module 0 is fine
    full = funcamp.trace(loss, "float32", stats=True)(params, x)
    amax = {r.module: r.amax for r in full if r.op == "linear"}
    assert amax["1"] > 65504 > amax["0"] and amax["3"] < 65504
    assert full.nonfinite() == []
    # the table shows the columns; the summary counts per (rule, dtype)
    lines = str(broken).splitlines()
    assert lines[1].split() == [
        "#",
        "op",
        "rule",
        "inputs",
        "outputs",
        "amax",
        "nonfinite",
        "subnormal",
        "module",
    ]
    row = lines[2 + broken.records.index(first)].split()
    assert row[-1] == "1" and first.nonfinite > 0
    assert row[-3] == f"{100 * first.nonfinite:.3g}%" and row[-4] == f"{first.amax:.4g}"
    summary = broken.summary()
    compute = summary[("compute", "float16")]
    assert isinstance(compute, funcamp.OpStats)
    assert compute.count == 3 and compute.nonfinite >= 2  # linear "1" and everything after
    assert sum(s.count for s in summary.values()) == len(broken)


def test_stats_off_by_default() -> None:
    t = funcamp.trace(f, "mixed_bfloat16")(torch.randn(2, 3), torch.randn(3, 3))
    assert all(r.amax is None and r.nonfinite is None and r.subnormal is None for r in t)
    assert "amax" not in str(t)
    assert all(isinstance(v, int) for v in t.summary().values())
    with pytest.raises(ValueError, match=r"funcamp.AmpTrace.nonfinite: .*stats=True"):
        t.nonfinite()
    with pytest.raises(TypeError, match=r"funcamp.trace: `stats` must be a bool"):
        funcamp.trace(f, "float32", stats=1)  # type: ignore[arg-type]
