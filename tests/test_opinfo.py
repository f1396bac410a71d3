"""torch's OpInfo database as a peer suite for ``amp`` (every op with CPU float32 samples).

Eager, every op and every one of its samples, in CI (~25 s on one core):

- ``amp`` with ``OpPolicy.autocast("cpu")`` and a bfloat16 compute dtype gives what
  ``torch.autocast("cpu", torch.bfloat16)`` gives, bit for bit: every tensor leaf of the op's own
  output (before amp's output cast) with the same dtype and the same bytes (NaNs equal whatever
  their payload), every other leaf equal; and it raises where autocast raises.
- The same table with a float32 compute dtype casts nothing but still re-enters every Python
  composite and C++ composite copy the table asks for: it gives exactly what the op run plainly gives, and
  raises only where the op raises. This is what keeps the copies of ``funcamp/casting/cpp_composites.py`` honest.

The exceptions are listed below with their measured reason (and in docs/differences.md): ops
whose output is uninitialized memory, and samples torch itself does not repeat. An op listed in
``DIFFERENT`` must still differ (none on torch 2.13): the test fails when it starts agreeing,
as it fails when an op not listed disagrees.

Compiled, ``torch.compile(amp(f, policy), fullgraph=True, backend="eager")`` must compile
wherever ``torch.compile`` of ``f`` under the matching ``torch.autocast`` (plain, for the float32
preset) does, for the presets and the CPU table: in CI on a budgeted subset of ops (``CI_COMPILED``,
first sample), all ops with ``FUNCAMP_OPINFO_FULL=1``. ``python tests/test_opinfo.py`` prints the
table that docs/opinfo.md shows.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from amp_zoo import one_thread  # noqa: F401 (autouse fixture)

import funcamp
from funcamp import OpPolicy, Policy

common = pytest.importorskip(
    "torch.testing._internal.common_methods_invocations", reason="needs torch's test utilities"
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
FULL = os.environ.get("FUNCAMP_OPINFO_FULL") == "1"

#: amp's side of the comparison with torch.autocast("cpu", bf16); outputs are read before
#: amp's output cast, so output_dtype does not matter.
CPU_TABLE = Policy(compute_dtype=BF16, ops=OpPolicy.autocast("cpu"))
#: The same table casting nothing: every composite and copy it needs runs, bit-exact to plain.
CPU_TABLE_F32 = Policy(compute_dtype=F32, ops=OpPolicy.autocast("cpu"))

#: Ops whose output is uninitialized memory (OpInfo skips their value comparisons too): compared
#: by dtype, shape and strides only.
UNINITIALIZED = {
    name: "returns uninitialized memory"
    for name in (
        "empty",
        "empty_like",
        "empty_permuted",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
    )
}
#: Samples torch itself does not repeat, by the keyword argument that marks them: two plain runs
#: of ``torch.linalg.lstsq(..., driver="gelsy")`` on the same tensors differ by up to ~2e-6
#: (LAPACK's gelsy, measured on torch 2.13). Compared by dtype and within 1e-5.
UNREPEATABLE = {
    "linalg.lstsq": ("driver", "gelsy"),
    "linalg.lstsq.grad_oriented": ("driver", "gelsy"),
}


def _name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


OPS = sorted(
    (op for op in common.op_db if F32 in op.supported_dtypes("cpu")),
    key=_name,
)
BY_NAME = {_name(op): op for op in OPS}
#: Ops where amp differs from torch.autocast on some sample (docs/differences.md): none on
#: torch 2.13.
DIFFERENT: dict[str, str] = {}
if "linalg.polar" in BY_NAME:  # torch >= 2.14
    # aten::linalg_polar has no autocast kernel: the AutocastCPU key falls through, and the CPU
    # kernel's own at::linalg_svd / at::matmul calls dispatch through autocast again (matmul in
    # bf16). amp, a torch function mode, sees only torch.linalg.polar and runs it in float32:
    # the plain result, where autocast differs from plain by ~3e-3.
    DIFFERENT["linalg.polar"] = "autocast lowers the matmuls inside linalg_polar's CPU kernel"


# OpInfo seeds torch's RNG for every sample with torch.manual_seed, which also queues a seed for
# each device torch could initialize later, recording the caller's stack with it: under pytest's
# deep stack that cost 10x the tests themselves. A worker thread's stack is a few frames deep.
_SAMPLER = concurrent.futures.ThreadPoolExecutor(max_workers=1)


def _all_samples(op: Any) -> list[Any]:
    return _SAMPLER.submit(lambda: list(op.sample_inputs("cpu", F32, requires_grad=False))).result()


def _fresh(x: Any) -> Any:
    """A copy of a sample's tensors with the same strides (an op may write into its inputs:
    ``embedding_bag(max_norm=)`` renormalizes its weight in place)."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or torch._debug_has_internal_overlap(x) != 0:
            return x  # sparse, or expanded (nothing can write into it)
        y = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
        with torch.no_grad():
            y.copy_(x)
        return y.requires_grad_(x.requires_grad)
    if isinstance(x, list):
        return [_fresh(e) for e in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_fresh(e) for e in x)
    if isinstance(x, dict):
        return {k: _fresh(v) for k, v in x.items()}
    return x


def _call(op: Any, sample: Any, how: Any) -> tuple[str, Any]:
    """``("ok", output)`` or ``("raise", exception)`` for the op on a fresh copy of the sample,
    run plainly (``how=None``), under ``torch.autocast`` (a dtype) or under ``amp`` (a policy)."""
    args = (_fresh(sample.input), *_fresh(sample.args))
    kwargs = _fresh(sample.kwargs)
    box: list[Any] = []

    def run(*a: Any, **k: Any) -> None:
        box.append(op.op(*a, **k))

    # random ops draw the same numbers on both sides (the CPU generator alone: torch.manual_seed
    # also seeds every lazily initialized device, 0.5 ms a call)
    torch.default_generator.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if isinstance(how, Policy):
                funcamp.amp(run, how)(*args, **kwargs)  # the op's own output, before the cast
            elif how is None:
                run(*args, **kwargs)
            else:
                with torch.autocast("cpu", how):
                    run(*args, **kwargs)
    except Exception as e:  # raising is an outcome to compare
        return "raise", e
    return "ok", box[0]


def _leaves(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for e in x:
            yield from _leaves(e)
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from _leaves(x[k])
    else:
        yield x


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, every NaN replaced by one NaN."""
    if x.layout != torch.strided:
        x = x.to_dense()
    if x.is_complex():
        x = torch.view_as_real(x.resolve_conj().resolve_neg())
    x = x.contiguous()
    if x.is_floating_point():
        x = torch.where(x.isnan(), torch.full_like(x, math.nan), x)
        return x.view(_BITS[x.element_size()])
    return x


def _difference(ref: Any, got: Any, how: str) -> str | None:
    """Why two outputs differ, or None when they agree as this module requires: ``how`` is
    ``"bits"``, ``"uninitialized"`` (dtype, shape and strides) or ``"close"`` (within 1e-5)."""
    a, b = list(_leaves(ref)), list(_leaves(got))
    if len(a) != len(b):
        return f"{len(a)} leaves vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"leaf {i}: {type(x).__name__} vs {type(y).__name__}"
        if not isinstance(x, torch.Tensor):
            same_nan = isinstance(x, float) and isinstance(y, float) and x != x and y != y
            if not (x == y or same_nan):
                return f"leaf {i}: {x!r} vs {y!r}"
            continue
        if (x.dtype, x.shape, x.layout) != (y.dtype, y.shape, y.layout):
            return f"leaf {i}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if how == "uninitialized":
            if x.layout == torch.strided and x.stride() != y.stride():
                return f"leaf {i}: strides {x.stride()} vs {y.stride()}"
        elif how == "close":
            if not torch.allclose(x, y, rtol=1e-5, atol=1e-5, equal_nan=True):
                return f"leaf {i}: beyond 1e-5"
        elif not torch.equal(_bits(x), _bits(y)):
            diff = (x.double() - y.double()).abs().nan_to_num(0.0).max().item()
            return f"leaf {i}: different bytes (max difference {diff:.3g})"
    return None


def _compare(op: Any, sample: Any, ref_how: Any, how: Policy) -> str | None:
    """Compare the op under ``how`` with the op under ``ref_how`` on one sample."""
    name = _name(op)
    ref_kind, ref = _call(op, sample, ref_how)
    kind, got = _call(op, sample, how)
    if ref_kind == "raise":  # the reference refuses the sample: amp must refuse it too
        return None if kind == "raise" else f"runs where the reference raises {ref!r:.80}"
    if kind == "raise":
        return f"raises {type(got).__name__}: {str(got).splitlines()[0][:100]}"
    key, value = UNREPEATABLE.get(name, (None, None))
    if name in UNINITIALIZED:
        return _difference(ref, got, "uninitialized")
    if key is not None and sample.kwargs.get(key) == value:
        return _difference(ref, got, "close")
    return _difference(ref, got, "bits")


def _check(op: Any) -> tuple[int, list[str], list[str]]:
    """(samples, differences from autocast, differences from plain torch) of one op."""
    samples = _all_samples(op)
    vs_autocast, vs_plain = [], []
    for i, sample in enumerate(samples):
        why = _compare(op, sample, BF16, CPU_TABLE)
        if why:
            vs_autocast.append(f"sample {i}: {why}")
        why = _compare(op, sample, None, CPU_TABLE_F32)
        if why:
            vs_plain.append(f"sample {i}: {why}")
    return len(samples), vs_autocast, vs_plain


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_amp_matches_autocast_and_plain_torch(name: str) -> None:
    n, vs_autocast, vs_plain = _check(BY_NAME[name])
    assert n > 0, "no samples"
    assert not vs_plain, f"amp with nothing to cast differs from plain torch: {vs_plain[:3]}"
    if name in DIFFERENT:
        assert vs_autocast, f"{name} now agrees with torch.autocast: take it off DIFFERENT"
    else:
        assert not vs_autocast, f"differs from torch.autocast('cpu', bf16): {vs_autocast[:3]}"


def test_exception_lists_name_real_ops() -> None:
    assert set(UNINITIALIZED) | set(UNREPEATABLE) | set(DIFFERENT) <= set(BY_NAME)
    assert len(OPS) > 600


# -- compiled ------------------------------------------------------------------------------------
#: preset -> the torch.autocast dtype of its reference (None: compiled plainly)
PRESETS = {"mixed_bfloat16": BF16, "float32": None, "mixed_float16": F16, "cpu_table": BF16}
_POLICIES = {
    **{p: funcamp.get_policy(p) for p in PRESETS if p != "cpu_table"},
    "cpu_table": CPU_TABLE,
}
#: ops compiled in CI: the copies and re-entered composites, plus a spread of everyday ops
CI_COMPILED = (
    "einsum",
    "tensordot",
    "inner",
    "nn.functional.bilinear",
    "cov",
    "linalg.matrix_power",
    "linalg.pinv",
    "pinverse",
    "nn.functional.pad.reflect",
    "meshgrid.variadic_tensors",
    "nn.functional.adaptive_avg_pool2d",
    "nn.functional.adaptive_avg_pool3d",
    "nn.functional.cross_entropy",
    "nn.functional.layer_norm",
    "nn.functional.interpolate.bilinear",
    "nn.functional.conv2d",
    "softmax",
    "matmul",
    "nn.functional.gelu",
    "cat",
    "stack",
    "nn.functional.linear",
    "addmm",
    "baddbmm",
    "linalg.multi_dot",
    "nn.functional.embedding",
    "nn.functional.group_norm",
    "nn.functional.rms_norm",
    "nn.functional.normalize",
    "log_softmax",
    "sum",
    "linalg.vector_norm",
    "nn.functional.mse_loss",
    "nn.functional.binary_cross_entropy_with_logits",
    "nn.functional.max_pool2d",
    "nn.functional.interpolate.nearest",
    "pow",
    "index_put",
    "cdist",
    "nn.functional.multi_head_attention_forward",
)


def _compile_outcome(op: Any, sample: Any, how: Any) -> str | None:
    """None when the op compiles (fullgraph, eager backend) and runs, else the error."""
    torch._dynamo.reset()

    def under_autocast(*a: Any, **k: Any) -> Any:
        ctx = torch.autocast("cpu", how) if how is not None else contextlib.nullcontext()
        with ctx:
            return op.op(*a, **k)

    def plain(*a: Any, **k: Any) -> Any:
        return op.op(*a, **k)

    fn = funcamp.amp(plain, how) if isinstance(how, Policy) else under_autocast
    args = (_fresh(sample.input), *_fresh(sample.args))
    torch.default_generator.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.compile(fn, fullgraph=True, backend="eager")(*args, **_fresh(sample.kwargs))
    except Exception as e:  # failing to compile is an outcome to compare
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    finally:
        torch._dynamo.reset()
    return None


#: autocast's outcome per (op, dtype): mixed_bfloat16 and cpu_table compile the same autocast
_AUTOCAST_OUTCOMES: dict[tuple[str, Any], str | None] = {}


def _compiled(op: Any, preset: str) -> tuple[str | None, str | None]:
    """(autocast's compile error, amp's compile error) on the op's first sample."""
    sample = _all_samples(op)[0]
    key = (_name(op), PRESETS[preset])
    if key not in _AUTOCAST_OUTCOMES:
        _AUTOCAST_OUTCOMES[key] = _compile_outcome(op, sample, PRESETS[preset])
    return _AUTOCAST_OUTCOMES[key], _compile_outcome(op, sample, _POLICIES[preset])


_COMPILED_OPS = sorted(BY_NAME) if FULL else list(CI_COMPILED)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", _COMPILED_OPS)
def test_compiles_wherever_autocast_compiles(name: str, preset: str) -> None:
    ref_error, amp_error = _compiled(BY_NAME[name], preset)
    if ref_error is None:
        assert amp_error is None, f"{name} under amp({preset}) fails to compile: {amp_error}"


def test_ci_compiled_subset_names_real_ops() -> None:
    assert set(CI_COMPILED) <= set(BY_NAME)


# -- the table in docs/opinfo.md -------------------------------------------------------------------
def _table() -> str:  # pragma: no cover - run by hand: python tests/test_opinfo.py
    lines = ["| part | ops | samples | pass | fail | why |", "|---|---|---|---|---|---|"]
    start = time.perf_counter()
    samples = failing = 0
    for op in OPS:
        n, vs_autocast, vs_plain = _check(op)
        samples += n
        failing += bool(vs_autocast or vs_plain) and _name(op) not in DIFFERENT
    lines.append(
        f"| eager vs torch.autocast and plain torch | {len(OPS)} | {samples} | "
        f"{len(OPS) - failing} | {failing} | see the exception lists |"
    )
    print(f"eager: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    for preset in sorted(PRESETS):
        start = time.perf_counter()
        both = only_amp = 0
        reasons: dict[str, int] = {}
        for op in OPS:
            ref_error, amp_error = _compiled(op, preset)
            if amp_error and not ref_error:
                only_amp += 1
                print(f"{preset}: {_name(op)}: {amp_error}", file=sys.stderr)
            if ref_error:
                both += 1
                key = ref_error.split(":")[0] + ": " + ref_error.split(":")[1].strip()[:40]
                reasons[key] = reasons.get(key, 0) + 1
        why = "; ".join(f"{k} ({v})" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| compiled, {preset} | {len(OPS)} | {len(OPS)} (first) | "
            f"{len(OPS) - both - only_amp} | {only_amp} | autocast fails too on {both}: {why} |"
        )
        print(f"{preset}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    torch.set_num_threads(1)
    print(_table())
