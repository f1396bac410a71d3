"""torch's own autocast test lists, run through ``amp`` with torch's own method.

``torch.testing._internal.autocast_test_lists`` holds, per list, the op names and arguments torch
uses to test its C++ autocast (``AutocastCPUTestLists``: torch.autocast("cpu"), and
``AutocastTestLists``: torch.autocast("cuda")). Each entry is run here as torch's
``_run_autocast_outofplace`` runs it: through ``torch.<op>`` (or ``torch._C._nn``,
``torch._C._linalg``) and the ``Tensor`` method, under ``amp`` with the matching preset; the output
must come out in the listed dtype and equal, bit for bit, the op run with mode off on arguments
cast by hand. The CPU lists are also compared with ``torch.autocast("cpu")`` itself. A new torch
whose lists move an op (as torch 2.13 added ``rms_norm`` to the CUDA float32 list) fails here.
The CUDA lists run on CPU tensors: the few entries whose op has no CPU kernel are reported.
"""

from __future__ import annotations

import collections.abc
from typing import Any

import pytest
import torch

import funcamp
from funcamp import OpPolicy, Policy

autocast_test_lists = pytest.importorskip(
    "torch.testing._internal.autocast_test_lists", reason="needs expecttest (the test extra)"
)

CPU = torch.device("cpu")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _cast(val: Any, dtype: torch.dtype) -> Any:
    if isinstance(val, torch.Tensor):
        return val.to(dtype) if val.is_floating_point() else val
    if isinstance(val, str):
        return val
    if isinstance(val, collections.abc.Iterable):
        return type(val)(_cast(v, dtype) for v in val)
    return val


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, collections.abc.Iterable) and not isinstance(a, str):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _dtype(x: Any) -> torch.dtype | None:
    if isinstance(x, torch.Tensor):
        return x.dtype
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0].dtype
    return None


def _calls(op: str, args: tuple[Any, ...], module: Any) -> list[tuple[str, Any]]:
    """The variants torch's test runs: ``module.<op>`` and ``Tensor.<op>`` where they exist."""
    calls = []
    if module is not None and hasattr(module, op):
        calls.append((f"{module.__name__}.{op}", getattr(module, op)))
    if hasattr(torch.Tensor, op) and isinstance(args[0], torch.Tensor):
        calls.append((f"Tensor.{op}", getattr(torch.Tensor, op)))
    assert calls, f"{op} is neither on {module} nor a Tensor method"
    return calls


def _under_amp(fn: Any, policy: Policy, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    box: list[Any] = []

    def run(*a: Any) -> None:
        box.append(fn(*a, **kwargs))

    funcamp.amp(run, policy)(*args)  # the op's own output, before amp's output cast
    return box[0]


def _control(op: str, args: tuple[Any, ...], kwargs: dict[str, Any], module: Any, run_as: Any):
    if module is not None and hasattr(module, op):
        return getattr(module, op)(*_cast(args, run_as), **kwargs)
    return getattr(args[0].to(run_as), op)(*_cast(args[1:], run_as), **kwargs)


def _check(
    op: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    module: Any,
    policy: Policy,
    run_as: torch.dtype,
    out_type: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
) -> None:
    out_type = out_type or run_as
    control = _control(op, args, kwargs, module, run_as)
    for where, fn in _calls(op, args, module):
        got = _under_amp(fn, policy, args, kwargs)
        if _dtype(got) is not None:
            assert _dtype(got) == out_type, f"{where} ran in {_dtype(got)}, torch lists {out_type}"
        assert _equal(got, control), f"{where} differs from the op run on args cast by hand"
        if autocast is not None:
            with torch.autocast("cpu", autocast):
                ref = fn(*args, **kwargs)
            assert _equal(got, ref), f"{where} differs from torch.autocast('cpu', {autocast})"


def _entries(lst: list[tuple[Any, ...]]) -> list[Any]:
    """``(op, args)``, ``(op, args, kwargs)`` or ``(op, args, skip)``: the shapes torch's lists
    use."""
    out = []
    for i, entry in enumerate(lst):
        op, args, kwargs = entry[0], entry[1], {}
        if len(entry) > 2 and isinstance(entry[2], dict):
            kwargs = entry[2]
        elif len(entry) > 2 and entry[2]:
            # torch's own runner reads a third element that is not a dict as "skip this entry"
            # (a ROCm flag; the CUDA list's einsum entry, whose equation does not fit its
            # operands, is skipped that way too): skipped here as torch skips it.
            continue
        out.append(pytest.param(op, args, kwargs, id=f"{op}-{i}"))
    return out


# -- torch.autocast("cpu") lists -------------------------------------------------------------
_CPU_LISTS = autocast_test_lists.AutocastCPUTestLists(CPU)
_CPU_POLICY = {
    dtype: Policy(compute_dtype=dtype, ops=OpPolicy.autocast("cpu")) for dtype in (BF16, F16)
}


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CPU_LISTS.torch_16))
def test_cpu_torch_16(op: str, args: Any, kwargs: Any, dtype: torch.dtype) -> None:
    _check(op, args, kwargs, torch, _CPU_POLICY[dtype], dtype, autocast=dtype)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CPU_LISTS.nn_16))
def test_cpu_nn_16(op: str, args: Any, kwargs: Any, dtype: torch.dtype) -> None:
    _check(op, args, kwargs, torch._C._nn, _CPU_POLICY[dtype], dtype, autocast=dtype)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CPU_LISTS.torch_fp32))
def test_cpu_torch_fp32(op: str, args: Any, kwargs: Any, dtype: torch.dtype) -> None:
    _check(op, args, kwargs, torch, _CPU_POLICY[dtype], F32, autocast=dtype)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CPU_LISTS.nn_fp32))
def test_cpu_nn_fp32(op: str, args: Any, kwargs: Any, dtype: torch.dtype) -> None:
    _check(op, args, kwargs, torch._C._nn, _CPU_POLICY[dtype], F32, autocast=dtype)


def _per_dtype(lst: list[Any]) -> list[Any]:
    # (op, args under bfloat16, args under float16)
    return [
        pytest.param(op, args, dtype, id=f"{op}-{i}-{str(dtype)[6:]}")
        for i, (op, args_bf16, args_f16) in enumerate(lst)
        for dtype, args in ((BF16, args_bf16), (F16, args_f16))
    ]


@pytest.mark.parametrize(
    ("op", "args", "dtype"), _per_dtype(_CPU_LISTS.torch_need_autocast_promote)
)
def test_cpu_promote(op: str, args: Any, dtype: torch.dtype) -> None:
    _check(op, args, {}, torch, _CPU_POLICY[dtype], F32, autocast=dtype)


def _cpu_builtin_promote(lst: list[Any]) -> list[Any]:
    # (op, args under bfloat16, args under float16, the dtype torch's own promotion gives)
    return [
        pytest.param(op, args, dtype, out, id=f"{op}-{i}-{str(dtype)[6:]}")
        for i, (op, args_bf16, args_f16, out) in enumerate(lst)
        for dtype, args in ((BF16, args_bf16), (F16, args_f16))
    ]


@pytest.mark.parametrize(
    ("op", "args", "dtype", "out_type"),
    _cpu_builtin_promote(_CPU_LISTS.torch_expect_builtin_promote),
)
def test_cpu_builtin_promote(op: str, args: Any, dtype: torch.dtype, out_type: torch.dtype) -> None:
    _check(op, args, {}, torch, _CPU_POLICY[dtype], F32, out_type, autocast=dtype)


@pytest.mark.parametrize(
    ("op", "args", "dtype", "out_type"),
    _cpu_builtin_promote(_CPU_LISTS.methods_expect_builtin_promote),
)
def test_cpu_methods_builtin_promote(
    op: str, args: Any, dtype: torch.dtype, out_type: torch.dtype
) -> None:
    _check(op, args, {}, None, _CPU_POLICY[dtype], F32, out_type, autocast=dtype)


def _builtin_promote(lst: list[Any]) -> list[Any]:
    return [pytest.param(op, args, out, id=f"{op}-{i}") for i, (op, args, out) in enumerate(lst)]


# -- torch.autocast("cuda") lists, against OpPolicy.autocast("cuda") and OpPolicy.default() -----
_CUDA_LISTS = autocast_test_lists.AutocastTestLists(CPU)
_CUDA_POLICY = {
    name: Policy(compute_dtype=F16, ops=ops)
    for name, ops in (("autocast_cuda", OpPolicy.autocast("cuda")), ("default", OpPolicy.default()))
}
TABLES = sorted(_CUDA_POLICY)


def _cuda_check(op: str, args: Any, kwargs: Any, module: Any, table: str, run_as: Any) -> None:
    try:
        _control(op, args, kwargs, module, run_as)
    except (RuntimeError, NotImplementedError) as e:
        if "CPU" not in str(e):
            raise
        pytest.skip(f"{op} has no CPU kernel (a CUDA-only op): nothing to compare on this machine")
    _check(op, args, kwargs, module, _CUDA_POLICY[table], run_as)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CUDA_LISTS.torch_fp16))
def test_cuda_torch_fp16(op: str, args: Any, kwargs: Any, table: str) -> None:
    _cuda_check(op, args, kwargs, torch, table, F16)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CUDA_LISTS.torch_fp32))
def test_cuda_torch_fp32(op: str, args: Any, kwargs: Any, table: str) -> None:
    _cuda_check(op, args, kwargs, torch, table, F32)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(
    ("op", "args", "kwargs"), _entries(_CUDA_LISTS.torch_need_autocast_promote)
)
def test_cuda_promote(op: str, args: Any, kwargs: Any, table: str) -> None:
    _cuda_check(op, args, kwargs, torch, table, F32)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CUDA_LISTS.nn_fp16))
def test_cuda_nn_fp16(op: str, args: Any, kwargs: Any, table: str) -> None:
    _cuda_check(op, args, kwargs, torch._C._nn, table, F16)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CUDA_LISTS.nn_fp32))
def test_cuda_nn_fp32(op: str, args: Any, kwargs: Any, table: str) -> None:
    _cuda_check(op, args, kwargs, torch._C._nn, table, F32)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CUDA_LISTS.linalg_fp16))
def test_cuda_linalg_fp16(op: str, args: Any, kwargs: Any, table: str) -> None:
    _cuda_check(op, args, kwargs, torch._C._linalg, table, F16)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CUDA_LISTS.methods_fp16))
def test_cuda_methods_fp16(op: str, args: Any, kwargs: Any, table: str) -> None:
    _cuda_check(op, args, kwargs, None, table, F16)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(("op", "args", "kwargs"), _entries(_CUDA_LISTS.methods_fp32))
def test_cuda_methods_fp32(op: str, args: Any, kwargs: Any, table: str) -> None:
    _cuda_check(op, args, kwargs, None, table, F32)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(
    ("op", "args", "out_type"), _builtin_promote(_CUDA_LISTS.torch_expect_builtin_promote)
)
def test_cuda_builtin_promote(op: str, args: Any, out_type: torch.dtype, table: str) -> None:
    _check(op, args, {}, torch, _CUDA_POLICY[table], F32, out_type)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(
    ("op", "args", "out_type"), _builtin_promote(_CUDA_LISTS.methods_expect_builtin_promote)
)
def test_cuda_methods_builtin_promote(
    op: str, args: Any, out_type: torch.dtype, table: str
) -> None:
    _check(op, args, {}, None, _CUDA_POLICY[table], F32, out_type)


@pytest.mark.parametrize("table", TABLES)
def test_cuda_banned_op_is_upcast_not_refused(table: str) -> None:
    """torch.autocast("cuda") raises for binary_cross_entropy (unsafe in float16); funcamp's
    tables run it in float32 instead (docs/differences.md)."""
    [(op, args, module)] = _CUDA_LISTS.banned
    _check(op, args, {}, module, _CUDA_POLICY[table], F32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lists_against_torch_autocast_on_a_gpu() -> None:
    """On a GPU: every CUDA-list entry under OpPolicy.autocast("cuda") equals torch.autocast."""
    lists = autocast_test_lists.AutocastTestLists(torch.device("cuda"))
    policy = Policy(compute_dtype=F16, ops=OpPolicy.autocast("cuda"))
    groups = [
        (lists.torch_fp16, torch),
        (lists.torch_fp32, torch),
        (lists.torch_need_autocast_promote, torch),
        (lists.nn_fp16, torch._C._nn),
        (lists.nn_fp32, torch._C._nn),
        (lists.linalg_fp16, torch._C._linalg),
        (lists.methods_fp16, None),
        (lists.methods_fp32, None),
    ]
    checked = 0
    for lst, module in groups:
        for param in _entries(lst):
            op, args, kwargs = param.values
            for _, fn in _calls(op, args, module):
                got = _under_amp(fn, policy, args, kwargs)
                with torch.autocast("cuda", F16):
                    ref = fn(*args, **kwargs)
                assert _equal(got, ref), f"{op} differs from torch.autocast('cuda')"
                checked += 1
    assert checked > 80
