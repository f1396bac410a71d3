"""OpRule and OpPolicy: the tables, lookups, and which dtype ops run in (asserted from trace)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from amp_zoo import one_thread  # noqa: F401 (autouse fixture)

import funcamp
from funcamp import OpPolicy, OpRule, Policy
from funcamp.policy.ops import op_name

BF16, F32 = torch.bfloat16, torch.float32


def _everything(x: torch.Tensor, w: torch.Tensor, img: torch.Tensor, k: torch.Tensor) -> None:
    y = torch.randint(0, 4, (4,))
    h = F.linear(x, w)
    torch.matmul(h, w)
    h @ w
    torch.mm(h, w)
    torch.bmm(h[None], w[None])
    F.conv2d(img, k)
    F.scaled_dot_product_attention(h[None], h[None], h[None])
    torch.softmax(h, -1)
    F.log_softmax(h, -1)
    F.layer_norm(h, (4,))
    F.cross_entropy(h, y)
    F.nll_loss(h, y)
    F.mse_loss(h, h.flip(0))
    F.l1_loss(h, h.flip(0))
    F.binary_cross_entropy_with_logits(h, torch.rand(4, 4))
    h.sum()
    torch.sum(h, 0)


COMPUTE_OPS = ("linear", "matmul", "mm", "bmm", "conv2d", "scaled_dot_product_attention")
FLOAT32_OPS = (
    "softmax",
    "log_softmax",
    "layer_norm",
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "binary_cross_entropy_with_logits",
    "sum",
)


def test_default_table_on_cpu_from_trace() -> None:
    torch.manual_seed(0)
    args = (torch.randn(4, 4), torch.randn(4, 4), torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3))
    t = funcamp.trace(_everything, Policy(compute_dtype=BF16))(*args)
    for op in COMPUTE_OPS:
        records = t.ops(op)
        assert records, op
        for r in records:
            assert r.rule is OpRule.COMPUTE and r.output_dtypes == (BF16,), r
            assert set(r.input_dtypes) == {BF16}, r
    for op in FLOAT32_OPS:
        records = t.ops(op)
        assert records, op
        for r in records:
            assert r.rule is OpRule.FLOAT32 and r.output_dtypes == (F32,), r
    assert len(t.ops("matmul")) == 2  # torch.matmul and @
    # softmax and sum got dtype=float32: their bf16 inputs were left as they came.
    assert t.ops("softmax")[0].input_dtypes == (BF16,)
    assert {r.input_dtypes for r in t.ops("sum")} == {(BF16,)}


def test_dtype_arg_ops_get_dtype_float32_and_keep_an_explicit_dtype() -> None:
    x = torch.randn(3, 4).to(BF16)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.softmax(x, -1), torch.softmax(x, -1, dtype=BF16), x.sum(), x.cumsum(0)

    a, b, c, d = funcamp.amp(f, "params=bf16,compute=bf16,output=bf16")(x)
    assert torch.equal(a, torch.softmax(x, -1, dtype=F32).to(BF16))
    assert torch.equal(b, torch.softmax(x, -1))
    assert torch.equal(c, x.sum(dtype=F32).to(BF16))
    assert torch.equal(d, x.cumsum(0, dtype=F32).to(BF16))


def test_promote_casts_to_the_widest_input() -> None:
    a, b = torch.randn(2, 3), torch.randn(2, 3).to(BF16)
    t = funcamp.trace(lambda a, b: torch.cat([a, b]), Policy(compute_dtype=BF16))(a, b)
    # cat is not on the CUDA lists (promote there is for e.g. addcmul): run as called
    assert t[0].op == "cat" and t[0].output_dtypes == (F32,)
    cpu = Policy(compute_dtype=BF16, ops=OpPolicy.autocast("cpu"))
    t = funcamp.trace(lambda a, b: torch.cat([a, b]), cpu)(a, b)
    assert t[0].rule is OpRule.PROMOTE and t[0].input_dtypes == (F32, F32)
    t = funcamp.trace(lambda a, b: torch.addcmul(a, b, b), Policy(compute_dtype=BF16))(a, b)
    assert t[0].rule is OpRule.PROMOTE and t[0].input_dtypes == (F32, F32, F32)
    t = funcamp.trace(lambda b: torch.addcmul(b, b, b), Policy(compute_dtype=BF16))(b)
    assert t[0].input_dtypes == (BF16, BF16, BF16)


def test_tables() -> None:
    default, cpu, cuda = OpPolicy.default(), OpPolicy.autocast("cpu"), OpPolicy.autocast("cuda")
    assert default == cuda and default is not cpu
    assert cpu["linear"] is OpRule.COMPUTE and "layer_norm" not in cpu and "softmax" not in cpu
    assert cpu["cross_entropy_loss"] is OpRule.FLOAT32 and cpu["cat"] is OpRule.PROMOTE
    assert default["layer_norm"] is OpRule.FLOAT32 and default["exp"] is OpRule.FLOAT32
    assert default[torch.nn.functional.linear] is OpRule.COMPUTE
    assert default[torch.Tensor.__rmatmul__] is OpRule.COMPUTE
    assert default[torch.Tensor.__matmul__] is OpRule.COMPUTE
    assert len(OpPolicy.none()) == 0
    assert repr(cpu) == 'OpPolicy.autocast("cpu")'
    changed = default.with_rules({torch.exp: OpRule.NONE})
    assert changed["exp"] is OpRule.NONE and default["exp"] is OpRule.FLOAT32
    assert changed == default.with_rules({"exp": OpRule.NONE})


def test_op_name() -> None:
    assert op_name(torch.nn.functional.linear) == "linear"
    assert op_name(torch.Tensor.__matmul__) == "matmul"
    assert op_name(torch.linalg.vecdot) == "linalg_vecdot"
    assert op_name(lambda x: x) is None


def test_rule_for_a_user_callable() -> None:
    def my_op(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    ops = OpPolicy({torch.nn.functional.relu: OpRule.COMPUTE})
    t = funcamp.trace(lambda x: F.relu(x), Policy(compute_dtype=BF16, ops=ops))(torch.randn(3))
    assert t[0].rule is OpRule.COMPUTE and t[0].output_dtypes == (BF16,)
    assert my_op not in ops


def test_bad_op_keys_and_devices() -> None:
    with pytest.raises(ValueError, match=r"funcamp.OpPolicy: unknown op name 'not_an_op'"):
        OpPolicy({"not_an_op": OpRule.COMPUTE})
    with pytest.raises(TypeError, match=r"op keys must be op names \(str\) or callables"):
        OpPolicy({3: OpRule.COMPUTE})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"`device` must be 'cpu' or 'cuda', got 'mps'"):
        OpPolicy.autocast("mps")


def test_user_rules_reach_ops_behind_python_wrappers() -> None:
    x = torch.randn(3, 4)
    cpu = Policy(compute_dtype=BF16, ops=OpPolicy.autocast("cpu"))
    # Not listed: F.relu and F.layer_norm run as called.
    t = funcamp.trace(lambda x: (F.relu(x), F.layer_norm(x.to(BF16), (4,))), cpu)(x)
    got = [(r.op, r.output_dtypes) for r in t if r.op != "to"]
    assert got == [("relu", (F32,)), ("layer_norm", (BF16,))]
    # Listed by the user, by callable or by name: the wrappers are cast too.
    ours = cpu.with_op_rules({torch.relu: OpRule.COMPUTE, "layer_norm": OpRule.FLOAT32})
    t = funcamp.trace(lambda x: (F.relu(x), F.layer_norm(x.to(BF16), (4,))), ours)(x)
    assert [r.output_dtypes for r in t if r.op in ("relu", "layer_norm")] == [(BF16,), (F32,)]
