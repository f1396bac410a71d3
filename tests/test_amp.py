"""amp and full_precision: composition with torch.func, pass-through, no leaks, module policies."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import types
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from amp_zoo import make_case, one_thread  # noqa: F401 (autouse fixture)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

import funcamp
from funcamp import OpPolicy, OpRule, Policy

BF16 = torch.bfloat16
F32 = torch.float32
MIXED = "mixed_bfloat16"
NN_MODULE = torch.nn.modules.module


def no_leaks() -> None:
    assert torch._C._len_torch_function_stack() == 0
    assert not NN_MODULE._global_forward_pre_hooks
    assert not NN_MODULE._global_forward_hooks
    assert not NN_MODULE._global_forward_hooks_always_called
    x = torch.randn(2, 2)
    assert (x @ x).dtype == F32  # nothing casts after the call


# -- composition ------------------------------------------------------------------------------
def test_grad_of_amp_gives_float32_grads_of_float32_params() -> None:
    _, params, loss, (x, y) = make_case("block", 0)
    grads = grad(funcamp.amp(loss, MIXED))(params, x, y)
    assert grads.keys() == params.keys()
    assert all(g.dtype == F32 for g in grads.values())
    # Different from the float32 grads: the matmuls did run in bf16.
    exact = grad(loss)(params, x, y)
    assert not torch.equal(grads["qkv.weight"], exact["qkv.weight"])
    torch.testing.assert_close(grads["qkv.weight"], exact["qkv.weight"], rtol=0.1, atol=0.02)
    no_leaks()


def test_vmap_of_grad_of_amp_gives_per_example_grads() -> None:
    _, params, loss, (x, y) = make_case("mlp", 0)

    def one(p: Any, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss(p, xi[None], yi[None])

    per_example = vmap(grad(funcamp.amp(one, MIXED)), in_dims=(None, 0, 0))(params, x, y)
    for i in range(x.shape[0]):
        expected = grad(funcamp.amp(one, MIXED))(params, x[i], y[i])
        for k, g in per_example.items():
            assert g.shape == (x.shape[0], *params[k].shape) and g.dtype == F32
            # bf16 rounding of batched vs single matmuls differs in the last bits
            torch.testing.assert_close(g[i], expected[k], rtol=0.05, atol=5e-3)
    # Bit for bit what vmap(grad(...)) gives under torch.autocast.
    cpu = Policy(compute_dtype=BF16, ops=OpPolicy.autocast("cpu"))
    ours = vmap(grad(funcamp.amp(one, cpu)), in_dims=(None, 0, 0))(params, x, y)
    with torch.autocast("cpu", BF16):
        theirs = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    assert all(torch.equal(ours[k], theirs[k]) for k in params)
    no_leaks()


def test_jvp_of_amp_matches_jvp_under_autocast() -> None:
    torch.manual_seed(0)
    w, x, t = torch.randn(6, 5), torch.randn(4, 6), torch.randn(4, 6)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sum(-1)

    out, tangent = jvp(
        funcamp.amp(f, Policy(compute_dtype=BF16, ops=OpPolicy.autocast("cpu"))), (x,), (t,)
    )
    with torch.autocast("cpu", BF16):
        ref_out, ref_tangent = jvp(f, (x,), (t,))
    assert out.dtype == tangent.dtype == F32
    assert torch.equal(out, ref_out.float()) and torch.equal(tangent, ref_tangent.float())
    no_leaks()


def test_functional_call_inside_amp_casts_module_ops() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    params = dict(model.named_parameters())
    t = funcamp.trace(lambda p, x: functional_call(model, p, (x,)), MIXED)(
        params, torch.randn(3, 4)
    )
    assert t.ops("linear")[0].output_dtypes == (BF16,)
    assert t.ops("layer_norm")[0].output_dtypes == (F32,)
    assert [r.module for r in t.ops("linear") + t.ops("layer_norm")] == ["0", "1"]


# -- what is never cast -----------------------------------------------------------------------
def test_float64_integer_bool_and_python_leaves_pass_through() -> None:
    x64 = torch.randn(3, 3, dtype=torch.float64)
    ints, flags = torch.arange(3), torch.tensor([True, False])

    def f(x64: torch.Tensor, ints: torch.Tensor, flags: torch.Tensor) -> dict[str, Any]:
        return {
            "mm64": x64 @ x64,
            "sm64": torch.softmax(x64, -1),
            "ints": ints,
            "intsum": ints.sum(),
            "flags": flags,
            "name": "f",
            "none": None,
            "n": 3,
        }

    out = funcamp.amp(f, "params=float32,compute=bfloat16,output=bfloat16")(x64, ints, flags)
    assert torch.equal(out["mm64"], x64 @ x64) and out["mm64"].dtype == torch.float64
    assert torch.equal(out["sm64"], torch.softmax(x64, -1))
    assert out["ints"] is ints and out["flags"] is flags
    assert out["intsum"].dtype == torch.int64
    assert (out["name"], out["none"], out["n"]) == ("f", None, 3)


def test_inplace_and_out_calls_are_not_cast_and_are_marked() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(4, 4), torch.randn(4, 4)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.empty(4, 4)
        torch.mm(a, b, out=out)
        acc = torch.zeros(4, 4)
        acc.addmm_(a, b)
        return out + acc

    t = funcamp.trace(f, MIXED)(a, b)
    assert torch.equal(t.output, 2 * (a @ b))  # both ran in float32
    (mm,) = t.ops("mm")
    assert mm.out and mm.rule is OpRule.NONE and mm.input_dtypes == (F32, F32, F32)
    (addmm_,) = [r for r in t if r.op == "addmm_"]
    assert addmm_.inplace and addmm_.rule is OpRule.NONE and addmm_.output_dtypes == (F32,)
    assert "(out=)" in str(t) and "(in-place)" in str(t)


# -- nothing leaks ------------------------------------------------------------------------------
def test_exception_inside_fn_leaves_nothing_behind() -> None:
    policy = funcamp.get_policy(MIXED).with_module_policies({nn.Linear: "float32"})
    model = nn.Linear(3, 3)

    def boom(x: torch.Tensor) -> torch.Tensor:
        model(x)
        raise RuntimeError("boom")

    for wrapped in (funcamp.amp(boom, policy), funcamp.trace(boom, policy)):
        with pytest.raises(RuntimeError, match="boom"):
            wrapped(torch.randn(2, 3))
        no_leaks()


def test_exception_inside_module_leaves_nothing_behind() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad module")

    policy = funcamp.get_policy(MIXED).with_module_policies({Bad: "float32"})
    with pytest.raises(ValueError, match="bad module"):
        funcamp.amp(lambda x: Bad()(x), policy)(torch.randn(2))
    no_leaks()


def test_nested_amp_with_different_policies_restores_outer() -> None:
    torch.manual_seed(0)
    a = torch.randn(3, 3)
    inner = funcamp.amp(lambda x: (x @ x, torch.softmax(x, -1)), "float32")

    def boom(x: torch.Tensor) -> None:
        raise KeyError("inner")

    def outer(x: torch.Tensor) -> tuple[torch.dtype, ...]:
        before = (x @ x).dtype
        mm, sm = inner(x)
        with pytest.raises(KeyError):
            funcamp.amp(boom, "float32")(x)
        after = (x @ x).dtype
        return before, mm.dtype, sm.dtype, after

    policy = funcamp.get_policy(MIXED).with_op_rules({"softmax": OpRule.COMPUTE})
    assert funcamp.amp(outer, policy)(a) == (BF16, F32, F32, BF16)
    no_leaks()


def test_full_precision_inside_amp() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(3, 3), torch.randn(3, 3)

    @funcamp.full_precision
    def exact(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.dtype, torch.Tensor]:
        return a.dtype, a @ b

    def f(a: torch.Tensor, b: torch.Tensor) -> Any:
        dtype, out = exact(a.to(BF16), b)
        return dtype, out, (a @ b).dtype

    dtype, out, after = funcamp.amp(f, "params=float32,compute=bfloat16,output=float32")(a, b)
    assert dtype == F32  # the bf16 input was cast up
    assert torch.equal(out, a.to(BF16).float() @ b)  # and the matmul ran in float32
    assert after == BF16
    assert exact(a, b)[1].dtype == F32  # outside amp it just runs
    no_leaks()


# -- module policies ----------------------------------------------------------------------------
class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.norm(self.fc(x)), dim=-1)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Inner(), Inner()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.fixture(scope="module")
def outer() -> tuple[Outer, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Outer()
    return model, {k: v.detach() for k, v in model.named_parameters()}


def run_traced(model: nn.Module, params: Any, policy: Policy) -> funcamp.AmpTrace:
    def f(p: Any, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,))

    return funcamp.trace(f, policy)(params, torch.randn(3, 4))


def by_module(t: funcamp.AmpTrace, op: str) -> dict[str | None, funcamp.OpRecord]:
    return {r.module: r for r in t.ops(op)}


def test_module_policy_by_class(outer: Any) -> None:
    policy = funcamp.get_policy(MIXED).with_module_policies({nn.LayerNorm: "bf16"})
    t = run_traced(*outer, policy)
    norms = by_module(t, "layer_norm")
    assert set(norms) == {"blocks.0.norm", "blocks.1.norm"}
    for r in norms.values():
        # "bf16" uses the default table: layer_norm still runs in float32 inside...
        assert r.rule is OpRule.FLOAT32 and r.output_dtypes == (F32,)
    # ...and the module's output is cast to bf16 on exit: the softmax after it receives bf16.
    assert {r.input_dtypes for r in t.ops("softmax")} == {(BF16,)}
    no_leaks()


def test_module_policy_by_glob_and_innermost_wins(outer: Any) -> None:
    policy = funcamp.get_policy(MIXED).with_module_policies(
        {"blocks.*": "float32", "blocks.1.fc": MIXED, Inner: "bf16-true"}
    )
    t = run_traced(*outer, policy)
    linears = by_module(t, "linear")
    assert linears["stem"].input_dtypes == (BF16, BF16, BF16)  # outer policy
    assert linears["blocks.0.fc"].input_dtypes == (F32, F32, F32)  # glob over class
    assert linears["blocks.1.fc"].input_dtypes == (BF16, BF16, BF16)  # innermost
    assert linears["head"].input_dtypes == (BF16, BF16, BF16)
    # blocks.* is float32 with output float32: the head receives float32 activations.
    assert t.ops("linear")[-1].module == "head"
    no_leaks()


def test_module_policy_casts_inputs_on_entry_and_outputs_on_exit(outer: Any) -> None:
    half_out = Policy(compute_dtype=F32, output_dtype=BF16)
    policy = funcamp.get_policy("float32").with_module_policies({"blocks.0": half_out})
    model, params = outer
    entries: list[torch.dtype] = []
    hook = model.blocks[1].register_forward_pre_hook(lambda m, args: entries.append(args[0].dtype))
    try:
        t = run_traced(model, params, policy)
    finally:
        hook.remove()
    assert entries == [BF16]  # blocks.0's output left it in bf16
    # Inside blocks.0 the ops ran in float32; only its output was cast on exit.
    assert by_module(t, "softmax")["blocks.0"].output_dtypes == (F32,)
    # Entry: module pre-hooks run after the global ones, so they see the cast inputs.
    into = funcamp.get_policy("float32").with_module_policies(
        {"blocks.1": Policy(compute_dtype=BF16, output_dtype=F32)}
    )
    entries.clear()
    hook = model.blocks[1].register_forward_pre_hook(lambda m, args: entries.append(args[0].dtype))
    try:
        t = run_traced(model, params, into)
    finally:
        hook.remove()
    assert entries == [BF16]
    assert by_module(t, "linear")["blocks.1.fc"].input_dtypes == (BF16, BF16, BF16)
    assert by_module(t, "linear")["head"].input_dtypes == (F32, F32, F32)
    no_leaks()


def test_module_policy_op_rules_apply_inside_only(outer: Any) -> None:
    sub = funcamp.get_policy(MIXED).with_op_rules({"softmax": OpRule.COMPUTE})
    policy = funcamp.get_policy(MIXED).with_module_policies({"blocks.1": sub})
    t = run_traced(*outer, policy)
    (first, second) = t.ops("softmax")
    assert first.module == "blocks.0" and first.rule is OpRule.FLOAT32
    assert first.output_dtypes == (F32,)
    assert second.module == "blocks.1" and second.rule is OpRule.COMPUTE
    assert second.output_dtypes == (BF16,)
    no_leaks()


# -- properties and errors ------------------------------------------------------------------
_W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))


def _net(x: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(x @ _W, (6,))
    return torch.log_softmax(torch.softmax(h, -1) * 3, -1).sum(-1) + F.gelu(h).cumsum(-1)[..., -1]


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]),
)
def test_amp_float32_is_the_identity(rows: int, seed: int, scale: float) -> None:
    x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(seed)) * scale
    torch.testing.assert_close(
        funcamp.amp(_net, "float32")(x), _net(x), rtol=0, atol=0, equal_nan=True
    )


def test_non_callable_fn_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"funcamp.amp: `fn` must be callable.*got int 3"):
        funcamp.amp(3, MIXED)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"funcamp.full_precision: `fn` must be callable"):
        funcamp.full_precision("f")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"funcamp.amp: `policy` must be a funcamp.Policy"):
        funcamp.amp(torch.sin, torch.bfloat16)  # type: ignore[arg-type]


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    extra: dict
    step: int = 0


class _Pair(NamedTuple):
    first: torch.Tensor
    second: list


@dataclasses.dataclass(frozen=True)
class _Frozen:
    h: torch.Tensor


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_output_cast_reaches_every_common_container(compiled):
    """Dataclasses (frozen too), NamedTuples, mappings of any kind and what they nest: every
    floating leaf in the output dtype, integer leaves and non-tensors untouched."""

    def f(x, w):
        h = x @ w  # bfloat16 under the policy
        counts = torch.ones(2, dtype=torch.int64)
        return (
            _Out(h, {"h": h, "n": counts}, step=3),
            _Pair(h, [h, "tag"]),
            collections.OrderedDict(a=h),
            collections.defaultdict(list, b=h),
            _Frozen(h),
            types.MappingProxyType({"c": h}),
        )

    g = funcamp.amp(f, "mixed_bfloat16")
    if compiled:
        g = torch.compile(g, fullgraph=True, backend="aot_eager")
    out, pair, ordered, default, frozen, proxy = g(torch.randn(2, 3), torch.randn(3, 3))
    assert out.logits.dtype == out.extra["h"].dtype == torch.float32
    assert out.extra["n"].dtype == torch.int64 and out.step == 3
    assert pair.first.dtype == pair.second[0].dtype == torch.float32 and pair.second[1] == "tag"
    assert ordered["a"].dtype == default["b"].dtype == frozen.h.dtype == torch.float32
    assert type(default) is collections.defaultdict and default.default_factory is list
    assert isinstance(proxy, types.MappingProxyType) and proxy["c"].dtype == torch.float32


def test_output_cast_keeps_containers_without_floating_tensors():
    keep = _Out(torch.ones(1, dtype=torch.int64), {"s": "x"})
    assert funcamp.amp(lambda: keep, "mixed_bfloat16")() is keep


def test_output_cast_names_a_mapping_it_cannot_rebuild():
    class Odd(collections.abc.Mapping):
        def __init__(self, x):
            self.x = x

        def __getitem__(self, k):
            return self.x

        def __iter__(self):
            return iter(["x"])

        def __len__(self):
            return 1

    with pytest.raises(TypeError, match=r"cannot rebuild a .*Odd.*return a dict"):
        funcamp.amp(lambda: Odd(torch.ones(1, dtype=torch.bfloat16)), "mixed_bfloat16")()
