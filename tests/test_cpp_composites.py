"""The Python copies of C++ composites (funcamp/casting/cpp_composites.py) and the re-entry fixes of issue 29.

A copy makes the calls its C++ composite makes, so amp casts what torch.autocast casts: these
tests hold copies to torch.autocast under ``torch.func.grad``/``vmap`` and ``torch.compile``, and
pin the regressions found by the OpInfo sweep (``torch.meshgrid`` recursing, int output sizes of
the adaptive pools breaking ``torch.compile(fullgraph=True)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from amp_zoo import one_thread  # noqa: F401 (autouse fixture)
from torch import nn
from torch.func import grad, vmap

import funcamp
from funcamp import OpPolicy, OpRule, Policy
from funcamp.casting.amp import mode_context

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
CPU = Policy(compute_dtype=BF16, ops=OpPolicy.autocast("cpu"))
PRESETS = ["float32", "mixed_bfloat16", "mixed_float16", "bf16-true"]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and torch.equal(a, b)


def _autocast(fn: Callable[..., Any], *args: Any) -> Any:
    with torch.autocast("cpu", BF16):
        return fn(*args)


def _raw(fn: Callable[..., Any], policy: Any) -> Callable[..., Any]:
    """``amp(fn, policy)`` whose tensor result keeps the dtype the ops gave it (float64 passes
    amp's output cast untouched, and is exact for every narrower dtype)."""

    def keep(*args: Any) -> Any:
        out = fn(*args)
        return out.double(), out.dtype

    amped = funcamp.amp(keep, policy)

    def run(*args: Any) -> Any:
        value, dtype = amped(*args)
        return value.to(dtype)

    return run


def _autocast_grad(loss: Callable[[torch.Tensor], torch.Tensor], a: torch.Tensor) -> Any:
    """The gradient as torch recommends it: forward under autocast, backward outside it."""
    a = a.clone().requires_grad_()
    with torch.autocast("cpu", BF16):
        out = loss(a)
    out.backward()
    return a.grad


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


torch.manual_seed(0)
_A, _B, _W = torch.randn(4, 4), torch.randn(4, 5), torch.randn(3, 4, 5)
_GRU, _LSTM = nn.GRUCell(4, 4), nn.LSTMCell(4, 4)

#: a loss through each copy; ``a`` is used once, by a non-leaf (see
#: test_difference_leaf_cast_cache for a leaf used twice)
COPY_LOSSES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "einsum": lambda a: torch.einsum("ij,jk->ik", a, _B).sum(),
    "einsum_sum_first": lambda a: torch.einsum("ij,jk->k", a, _B).sum(),
    "einsum_sublist": lambda a: torch.einsum(a, [0, 1], _B, [1, 2], [0, 2]).sum(),
    "tensordot": lambda a: torch.tensordot(a, _B, dims=1).sum(),
    "inner": lambda a: torch.inner(a, _B.T).sum(),
    "cov": lambda a: torch.cov(a).sum(),
    "corrcoef": lambda a: torch.corrcoef(a).sum(),
    "matrix_power": lambda a: torch.linalg.matrix_power(a * 1, 5).sum(),
    "matrix_power_negative": lambda a: torch.linalg.matrix_power(a * 1, -2).sum(),
    "bilinear": lambda a: F.bilinear(a, _B[:, :5], _W).sum(),  # see test_amp_vs_autocast
    "pad_reflect": lambda a: F.pad(a.to(BF16)[None], (1, 1), mode="reflect").float().sum(),
    "gru_cell": lambda a: _GRU(a, a.flip(0)).sum(),
    "lstm_cell": lambda a: _LSTM(a, (a.flip(0), a.flip(1)))[0].sum(),
}


@pytest.mark.parametrize("name", sorted(COPY_LOSSES))
def test_copies_match_autocast_with_grad_and_vmap(name: str) -> None:
    loss = COPY_LOSSES[name]
    batch = torch.stack([_A, _A + 1])
    assert _equal(_raw(loss, CPU)(_A), _autocast(loss, _A))
    if name != "bilinear":  # differentiated as one op by autocast: test_difference_gradients
        assert _equal(grad(funcamp.amp(loss, CPU))(_A), _autocast_grad(loss, _A))
    if name not in ("gru_cell", "lstm_cell"):  # test_difference_rnn_cells_under_vmap
        assert _equal(vmap(_raw(loss, CPU))(batch), _autocast(vmap(loss), batch))


@pytest.mark.parametrize(
    "name", ["einsum_sum_first", "corrcoef", "matrix_power", "bilinear", "lstm_cell"]
)
def test_copies_compile_to_one_graph_with_the_eager_bits(name: str) -> None:
    f = grad(funcamp.amp(COPY_LOSSES[name], CPU))
    assert _equal(_compiled(f)(_A), f(_A))


def test_copy_shows_its_inner_ops_in_the_trace() -> None:
    t = funcamp.trace(lambda a: torch.einsum("ij,jk->k", a, _B), CPU)(_A)
    assert [(r.op, r.rule) for r in t.ops("bmm")] == [("bmm", OpRule.COMPUTE)]
    assert t.ops("sum")[0].output_dtypes == (F32,)  # j is summed out first, in float32


def test_copies_apply_the_default_table_too() -> None:
    """cov and matrix_power are on no list, their inner mm/matmul on CUDA's: CUDA's autocast
    casts those, and so does amp with the default table."""
    t = funcamp.trace(lambda a: (torch.cov(a), torch.linalg.matrix_power(a, 3)), "mixed_bfloat16")(
        _A
    )
    out = t.output
    assert [r.output_dtypes for r in t.ops("mm")] == [(BF16,)]
    assert {r.output_dtypes for r in t.ops("matmul")} == {(BF16,)}
    assert out[0].dtype == out[1].dtype == F32  # the output cast


def test_copies_decline_what_they_do_not_reproduce() -> None:
    """Declined inputs run as called: torch raises its own error, float64 runs untouched."""
    a = torch.randn(3, 4)
    for bad in (lambda: torch.einsum("ij,jk->ik", a), lambda: torch.tensordot(a, a, dims=1)):
        with pytest.raises(RuntimeError) as plain:
            bad()
        with pytest.raises(RuntimeError) as amped:
            funcamp.amp(bad, CPU)()
        assert str(amped.value) == str(plain.value)
    d = torch.randn(4, 4, dtype=torch.float64)
    t = funcamp.trace(lambda d: torch.linalg.matrix_power(d, 3), CPU)(d)
    assert [r.op for r in t] == ["linalg_matrix_power"] and t.output.dtype == torch.float64


def test_einsum_on_cudas_list_is_cast_as_a_whole() -> None:
    """CUDA's autocast lists einsum itself: the default table casts the call, copy or not."""
    t = funcamp.trace(lambda a: torch.einsum("ij,jk->k", a, _B), "mixed_bfloat16")(_A)
    assert [(r.op, r.rule) for r in t if r.rule is not OpRule.NONE] == [("einsum", OpRule.COMPUTE)]


def test_copies_are_reentered_only_under_tables_that_list_their_inner_ops() -> None:
    cpu, default = (
        mode_context(CPU).composites,
        mode_context(funcamp.get_policy("float32")).composites,
    )
    none = mode_context(Policy(ops=OpPolicy.none())).composites
    assert ("torch", "cov") in cpu and ("torch", "cov") in default
    assert ("torch._C._nn", "pad") in cpu and ("torch._C._nn", "pad") not in default
    assert not any(key[1] in ("cov", "einsum", "pad", "pinverse") for key in none)


# -- torch.meshgrid --------------------------------------------------------------------------------
def _meshgrid(a: torch.Tensor, b: torch.Tensor) -> Any:
    return torch.meshgrid(a, b, indexing="ij")


@pytest.mark.parametrize("policy", [*PRESETS, "cpu"])
def test_meshgrid_runs_under_amp(policy: str) -> None:
    """torch.meshgrid (no entry check) calls _meshgrid, whose check reports meshgrid: re-entered,
    meshgrid recursed until RecursionError. Helpers run as their unchecked copies now, and
    meshgrid, which reaches no listed op, is not re-entered at all."""
    pol = CPU if policy == "cpu" else policy
    a, b = torch.randn(3), torch.randn(4)
    plain = [t.double() for t in _meshgrid(a, b)]  # float64 passes amp's output cast untouched
    f = funcamp.amp(lambda a, b: [t.double() for t in _meshgrid(a, b)], pol)
    assert _equal(f(a, b), plain)
    assert _equal(_compiled(f)(a, b), plain)


def test_meshgrid_under_a_table_keyed_by_callables() -> None:
    """A table keyed by a callable re-enters every composite, meshgrid included."""
    policy = CPU.with_op_rules({torch.sin: OpRule.FLOAT32})
    a, b = torch.randn(3), torch.randn(4)
    got = funcamp.amp(lambda a, b: [t.double() for t in _meshgrid(a, b)], policy)(a, b)
    assert all(torch.equal(g, p.double()) for g, p in zip(got, _meshgrid(a, b)))


# -- int output sizes of the adaptive pools ------------------------------------------------------
POOLS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[int, ...]]] = {
    "avg1d": (lambda x: F.adaptive_avg_pool1d(x, 1), (2, 3, 8)),
    "avg2d": (lambda x: F.adaptive_avg_pool2d(x, 1), (2, 3, 8, 8)),
    "avg3d": (lambda x: F.adaptive_avg_pool3d(x, 2), (2, 3, 4, 4, 4)),
    "max1d": (lambda x: F.adaptive_max_pool1d(x, 2), (2, 3, 8)),
    "max2d": (lambda x: F.adaptive_max_pool2d(x, 1), (2, 3, 8, 8)),
    "max3d": (lambda x: F.adaptive_max_pool3d(x, 2), (2, 3, 4, 4, 4)),
    "module": (nn.AdaptiveAvgPool2d(1), (2, 3, 8, 8)),
}


@pytest.mark.parametrize("policy", [*PRESETS, "cpu"])
@pytest.mark.parametrize("name", sorted(POOLS))
def test_int_output_sizes_compile_to_one_graph(name: str, policy: str) -> None:
    """``_list_with_default(1, x.size())`` returns an int, which dynamo refuses as the result of
    what its trace rules call a torch function: a graph break inside every re-entered adaptive
    pool given an int size. Re-entered composites call their own copy of it, traced as Python.
    (Called from user code, the helper breaks the graph under plain torch.autocast too.)"""
    pool, shape = POOLS[name]
    pol = CPU if policy == "cpu" else policy
    x = torch.randn(*shape)
    f = funcamp.amp(pool, pol)
    assert _equal(_compiled(f)(x), f(x))


@pytest.mark.parametrize("name", sorted(POOLS))
def test_int_output_sizes_match_autocast(name: str) -> None:
    pool, shape = POOLS[name]
    x = torch.randn(*shape)
    assert _equal(_raw(pool, CPU)(x), _autocast(pool, x))
