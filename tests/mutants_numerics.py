"""Mutants of tests/mutation_suite.py in numerics: softmax, logsumexp, norms, accumulation and
casts, each a correct and a buggy version of a small function and the property that tells them
apart.

Properties assert what the function promises, with the tolerance its precision allows, against a
float64 reference; none of them knows the bug.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from mutation_suite import BF16, EPS32, F16, F32, FINITE, Mutant, close, registrar, tensor, vectors

MUTANTS: list[Mutant] = []
mutant = registrar(MUTANTS)


# ------------------------------------------------------------------ softmax, logsumexp, norms


def softmax_ok(x):
    e = (x - x.max()).exp()
    return e / e.sum()


def softmax_bug(x):
    e = x.exp()
    return e / e.sum()


@mutant(
    "softmax_f16",
    "softmax in float16 without subtracting the max",
    softmax_ok,
    softmax_bug,
    lambda f: {"x": tensor(f, F16, vectors(1, 64), **FINITE)},
)
def check_softmax(impl, x):
    close(impl(x), torch.softmax(x.double(), 0), 4e-3)


def logsumexp_ok(x):
    m = x.max()
    return m + (x - m).exp().sum().log()


def logsumexp_bug(x):
    return x.exp().sum().log()


@mutant(
    "logsumexp",
    "logsumexp as log(sum(exp(x))) in float32",
    logsumexp_ok,
    logsumexp_bug,
    lambda f: {"x": tensor(f, F32, vectors(1, 64), min_value=-1e4, max_value=1e4)},
)
def check_logsumexp(impl, x):
    ref = torch.logsumexp(x.double(), 0)
    close(impl(x), ref, 4 * EPS32 * (ref.abs() + x.numel()))


def log_softmax_ok(x):
    return torch.log_softmax(x.float(), 0)


def log_softmax_bug(x):
    return torch.softmax(x, 0).log().float()


@mutant(
    "log_of_softmax_f16",
    "log(softmax(x)) in float16",
    log_softmax_ok,
    log_softmax_bug,
    lambda f: {"x": tensor(f, F16, vectors(1, 64), min_value=-1e4, max_value=1e4)},
)
def check_log_softmax(impl, x):
    ref = torch.log_softmax(x.double(), 0)
    close(impl(x), ref, 1e-3 * (1 + ref.abs()))


def variance_ok(x):
    return x.float().var(correction=0).bfloat16()


def variance_bug(x):
    return (x * x).mean() - x.mean() ** 2


@mutant(
    "variance_one_pass_bf16",
    "variance as E[x^2] - E[x]^2 in bfloat16",
    variance_ok,
    variance_bug,
    lambda f: {"x": tensor(f, BF16, vectors(2, 64), min_value=-100.0, max_value=100.0)},
)
def check_variance(impl, x):
    x64 = x.double()
    ref = x64.var(correction=0)
    close(impl(x), ref, 2**-8 * 1.01 * ref + 1e-6 * x64.abs().max() ** 2 + 2.0**-126)


def layer_norm_ok(x):
    return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], eps=1e-5).half()


def layer_norm_bug(x):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / (var + 1e-5).sqrt()


@mutant(
    "layer_norm_f16",
    "a layer norm computed in float16",
    layer_norm_ok,
    layer_norm_bug,
    lambda f: {
        "x": tensor(
            f, F16, st.tuples(st.integers(1, 4), st.integers(2, 32)), min_value=-1e4, max_value=1e4
        )
    },
)
def check_layer_norm(impl, x):
    ref = torch.nn.functional.layer_norm(x.double(), x.shape[-1:], eps=1e-5)
    close(impl(x), ref, 2e-3 * (1 + ref.abs()))


# ------------------------------------------------------------------------------ accumulation


def sum_ok(x):
    return x.float().sum()


def sum_bug(x):
    return x.sum().float()


@mutant(
    "sum_f16",
    "a float16 sum returned in float16 (past 65504)",
    sum_ok,
    sum_bug,
    lambda f: {"x": tensor(f, F16, vectors(1, 256), **FINITE)},
)
def check_sum(impl, x):
    x64 = x.double()
    ref = x64.sum()
    close(impl(x), ref, 2**-10 * ref.abs() + x.numel() * EPS32 * x64.abs().sum())


def mean_ok(x):
    return x.float().mean().bfloat16()


def mean_bug(x):
    acc = torch.zeros((), dtype=x.dtype)
    for v in x:
        acc = acc + v
    return acc / x.numel()


@mutant(
    "mean_bf16_accumulator",
    "a bfloat16 mean accumulated in bfloat16",
    mean_ok,
    mean_bug,
    lambda f: {"x": tensor(f, BF16, vectors(1, 256), min_value=-1e4, max_value=1e4)},
)
def check_mean(impl, x):
    x64 = x.double()
    close(impl(x), x64.mean(), 2**-7 * x64.abs().mean() + 2.0**-133)


# -------------------------------------------------------------------------------------- casts


def to_bf16_ok(x):
    return x.bfloat16()


def to_bf16_bug(x):
    return (x.view(torch.int32) & -65536).view(F32).bfloat16()  # truncates the low bits


@mutant(
    "bf16_cast_truncates",
    "float32 to bfloat16 by truncation",
    to_bf16_ok,
    to_bf16_bug,
    lambda f: {"x": tensor(f, F32, vectors(1, 64), min_value=-(2.0**127), max_value=2.0**127)},
)
def check_to_bf16(impl, x):
    # round to nearest: within half an ulp (2**-8 relative, 2**-134 among subnormals)
    close(impl(x), x, 2**-8 * x.double().abs() + 2.0**-134)


def saturate_f16_ok(x):
    return torch.where(x.abs() >= 65520, x.sign() * 65504, x).half()


def saturate_f16_bug(x):
    return torch.where(x.abs() > 65536, x.sign() * 65504, x).half()  # float16 "tops at 2**16"


@mutant(
    "f16_saturation_threshold",
    "a saturating float16 cast that saturates above 65536",
    saturate_f16_ok,
    saturate_f16_bug,
    lambda f: {"x": tensor(f, F32, vectors(1, 64), **FINITE)},
)
def check_saturate(impl, x):
    x64 = x.double()
    close(impl(x), x64.clamp(-65504, 65504), 2**-11 * x64.abs().clamp(max=65504) + 2.0**-25)


def overflows_f16_ok(x):
    return x.abs() >= 65520


def overflows_f16_bug(x):
    return x.abs() > torch.finfo(F16).max


@mutant(
    "f16_overflow_check",
    "a float16 overflow mask against finfo(float16).max",
    overflows_f16_ok,
    overflows_f16_bug,
    lambda f: {"x": tensor(f, F32, vectors(1, 64), min_value=-1e5, max_value=1e5)},
)
def check_overflows_f16(impl, x):
    assert torch.equal(impl(x), ~torch.isfinite(x.half()))


def underflows_f16_ok(x):
    return (x != 0) & (x.abs() <= 2.0**-25)


def underflows_f16_bug(x):
    return (x != 0) & (x.abs() < torch.finfo(F16).tiny)  # subnormals survive the cast


@mutant(
    "f16_underflow_check",
    "a float16 underflow mask against finfo(float16).tiny",
    underflows_f16_ok,
    underflows_f16_bug,
    lambda f: {"x": tensor(f, F32, vectors(1, 64), min_value=-1.0, max_value=1.0)},
)
def check_underflows_f16(impl, x):
    assert torch.equal(impl(x), (x != 0) & (x.half() == 0))


def residual_ok(x, w):
    return x + (x.bfloat16() @ w).float()


def residual_bug(x, w):
    return (x.bfloat16() + x.bfloat16() @ w).float()  # the residual add in bfloat16


@mutant(
    "residual_add_bf16",
    "a float32 residual stream added in bfloat16",
    residual_ok,
    residual_bug,
    lambda f: {
        "x": tensor(f, F32, (2, 8), min_value=-100.0, max_value=100.0),
        "w": tensor(f, BF16, (8, 8), min_value=-(2.0**-10), max_value=2.0**-10),
    },
)
def check_residual(impl, x, w):
    xb = x.bfloat16().double()
    ref = x.double() + xb @ w.double()
    tol = 2**-7 * (xb.abs() @ w.double().abs()) + 2 * EPS32 * x.double().abs() + 1e-30
    close(impl(x, w), ref, tol)


def sgd_ok(p, g):
    return p - 1e-3 * g


def sgd_bug(p, g):
    return (p.bfloat16() - 1e-3 * g.bfloat16()).float()  # no float32 master weights


@mutant(
    "bf16_master_weights",
    "an SGD step on bfloat16 weights, no float32 master copy",
    sgd_ok,
    sgd_bug,
    lambda f: {
        "p": tensor(f, F32, (16,), min_value=-10.0, max_value=10.0),
        "g": tensor(f, F32, (16,), min_value=-10.0, max_value=10.0),
    },
)
def check_sgd(impl, p, g):
    p64, g64 = p.double(), g.double()
    close(impl(p, g), p64 - 1e-3 * g64, 2 * EPS32 * (p64.abs() + 1e-3 * g64.abs()))
