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
