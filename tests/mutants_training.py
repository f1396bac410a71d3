"""Mutants of tests/mutation_suite.py in training: Adam, FP8 scaling, loss scaling, gradient
clipping, skipped steps and a loss scaler's bookkeeping, each a correct and a buggy version of a
small function and the property that tells them apart.

Properties assert what the function promises, with the tolerance its precision allows, against a
float64 reference or torch's own rule (``funcamp.update``); none of them knows the bug.
"""

from __future__ import annotations

import functools
import math

import torch
from hypothesis import strategies as st
from mutation_suite import (
    E4M3,
    E5M2,
    EPS32,
    F16,
    F32,
    Mutant,
    close,
    dynamic_scalers,
    loss_scalers,
    registrar,
    tensor,
    vectors,
)

import funcamp

MUTANTS: list[Mutant] = []
mutant = registrar(MUTANTS)


# ------------------------------------------------------------------------------------- Adam

LR, B1, B2, ADAM_EPS = 1e-3, 0.9, 0.999, 1e-8


def adam_ok(p, g):
    """One Adam step from a fresh state (torch.optim.Adam's formula)."""
    m, v = (1 - B1) * g, (1 - B2) * g * g
    m_hat, v_hat = m / (1 - B1), v / (1 - B2)
    return p - LR * m_hat / (v_hat.sqrt() + ADAM_EPS)


def adam_eps_bug(p, g):
    m, v = (1 - B1) * g, (1 - B2) * g * g
    m_hat, v_hat = m / (1 - B1), v / (1 - B2)
    return p - LR * m_hat / (v_hat + ADAM_EPS).sqrt()  # eps inside the root


def adam_f16_bug(p, g):
    m, v = ((1 - B1) * g).half(), ((1 - B2) * g * g).half()  # moments kept in float16
    m_hat, v_hat = m.float() / (1 - B1), v.float() / (1 - B2)
    return p - LR * m_hat / (v_hat.sqrt() + ADAM_EPS)


def _adam_args(f):
    return {
        "p": tensor(f, F32, (16,), min_value=-1.0, max_value=1.0),
        "g": tensor(f, F32, (16,), min_value=-1.0, max_value=1.0),
    }


def check_adam(impl, p, g):
    p64, g64 = p.double(), g.double()
    ref = p64 - LR * g64 / (g64.abs() + ADAM_EPS)
    close(impl(p, g), ref, 1e-3 * LR + 2 * EPS32 * p64.abs())


mutant("adam_eps_in_root", "Adam's eps inside the square root", adam_ok, adam_eps_bug, _adam_args)(
    check_adam
)
mutant("adam_f16_moments", "Adam's moments kept in float16", adam_ok, adam_f16_bug, _adam_args)(
    check_adam
)


# ------------------------------------------------------------------------------- FP8 scaling


def fp8_roundtrip_ok(x):
    scale = 448.0 / x.abs().max().clamp(min=1e-12)
    return (x * scale).clamp(-448, 448).to(E4M3).float() / scale


def fp8_no_eps_bug(x):
    scale = 448.0 / x.abs().max()  # 0 (or a tiny amax) makes it inf
    return (x * scale).clamp(-448, 448).to(E4M3).float() / scale


def fp8_f16_scale_bug(x):
    scale = (448.0 / x.abs().max().clamp(min=1e-12)).half()  # overflows below amax 0.0068
    return (x * scale).clamp(-448, 448).to(E4M3).float() / scale


def _fp8_args(f):
    return {"x": tensor(f, F32, vectors(1, 64), min_value=-1e4, max_value=1e4)}


def check_fp8_roundtrip(impl, x):
    # e4m3 keeps 4 significant bits (2**-4 relative); its subnormals are 2**-9 apart
    x64 = x.double()
    amax = max(float(x64.abs().max()), 1e-12)
    close(impl(x), x64, 2**-4 * x64.abs() + amax * 2**-10 / 448)


mutant(
    "fp8_scale_no_eps", "an FP8 scale with no epsilon", fp8_roundtrip_ok, fp8_no_eps_bug, _fp8_args
)(check_fp8_roundtrip)
mutant(
    "fp8_scale_f16",
    "an FP8 scale stored in float16",
    fp8_roundtrip_ok,
    fp8_f16_scale_bug,
    _fp8_args,
)(check_fp8_roundtrip)


def overflows_e5m2_ok(x):
    return x.abs() >= 61440


def overflows_e5m2_bug(x):
    return x.abs() > torch.finfo(E5M2).max


@mutant(
    "e5m2_overflow_check",
    "an FP8 e5m2 overflow mask against its max, 57344",
    overflows_e5m2_ok,
    overflows_e5m2_bug,
    lambda f: {"x": tensor(f, F32, vectors(1, 64), min_value=-1e5, max_value=1e5)},
)
def check_overflows_e5m2(impl, x):
    assert torch.equal(impl(x), ~torch.isfinite(x.to(E5M2).float()))


# -------------------------------------------------------------- loss scaling and gradients


def found_inf_ok(g):
    return not bool(torch.isfinite(g).all())


def found_inf_bug(g):
    return bool((g.abs() == math.inf).any())  # misses nan


@mutant(
    "found_inf_misses_nan",
    "a found-inf check that misses nan",
    found_inf_ok,
    found_inf_bug,
    lambda f: {"g": tensor(f, F32, vectors(1, 64))},
)
def check_found_inf(impl, g):
    _, found = funcamp.unscale(funcamp.ScalerState.noop(), g)
    assert impl(g) == bool(found)


def unscale_ok(g, state):
    return g / float(state.scale)


def unscale_bug(g, state):
    return (g.half() / float(state.scale)).float()  # cast to the float16 params' dtype first


@mutant(
    "unscale_after_f16_cast",
    "scaled grads cast to float16 before unscaling",
    unscale_ok,
    unscale_bug,
    lambda f: {
        "g": tensor(f, F32, vectors(1, 64), min_value=-1e6, max_value=1e6),
        "state": loss_scalers(f, 1.0, 2.0**24),
    },
)
def check_unscale(impl, g, state):
    # float16 rounding (2**-11) and underflow (2**-25) allowed: only overflow is a bug here
    scale = float(state.scale)
    ref = g.double() / scale
    close(impl(g, state), ref, 2**-10 * ref.abs() + 2.0**-24 / scale)


def clip_ok(g, state, max_norm=1.0):
    g = g / float(state.scale)
    return g * (max_norm / (g.norm() + 1e-6)).clamp(max=1.0)


def clip_before_unscale_bug(g, state, max_norm=1.0):
    g = g * (max_norm / (g.norm() + 1e-6)).clamp(max=1.0)  # clips the scaled grads
    return g / float(state.scale)


def check_clip(impl, g, state):
    g64 = g.double() / float(state.scale)
    ref = g64 * (1.0 / (g64.norm() + 1e-6)).clamp(max=1.0)
    close(impl(g, state), ref, 1e-5 * ref.abs() + 1e-7 * ref.abs().max())


mutant(
    "clip_before_unscale",
    "gradient clipping before unscaling",
    clip_ok,
    clip_before_unscale_bug,
    lambda f: {
        "g": tensor(f, F32, vectors(1, 64), min_value=-1e4, max_value=1e4),
        "state": loss_scalers(f, 1.0, 2.0**24),
    },
)(check_clip)


def clip_f16_ok(g, max_norm=1.0):
    g = g.float()
    return g * (max_norm / (g.norm() + 1e-6)).clamp(max=1.0)


def clip_f16_bug(g, max_norm=1.0):
    norm = (g * g).sum().sqrt().float()  # the norm of float16 grads, in float16
    return g.float() * (max_norm / (norm + 1e-6)).clamp(max=1.0)


@mutant(
    "clip_norm_f16",
    "a gradient norm accumulated in float16",
    clip_f16_ok,
    clip_f16_bug,
    lambda f: {"g": tensor(f, F16, vectors(1, 64), min_value=-1e4, max_value=1e4)},
)
def check_clip_f16(impl, g):
    g64 = g.double()
    ref = g64 * (1.0 / (g64.norm() + 1e-6)).clamp(max=1.0)
    close(impl(g), ref, 1e-5 * ref.abs() + 1e-7 * ref.abs().max())


def momentum_ok(p, m, g):
    skip = ~torch.isfinite(g).all()
    m_new = 0.9 * m + g
    return torch.where(skip, p, p - 0.1 * m_new), torch.where(skip, m, m_new)


def momentum_bug(p, m, g):
    skip = ~torch.isfinite(g).all()
    m_new = 0.9 * m + g  # the momentum takes the overflowing grads in
    return torch.where(skip, p, p - 0.1 * m_new), m_new


@mutant(
    "skip_keeps_state",
    "a skipped step that still updates the momentum",
    momentum_ok,
    momentum_bug,
    lambda f: {
        "p": tensor(f, F32, (8,), min_value=-1.0, max_value=1.0),
        "m": tensor(f, F32, (8,), min_value=-1.0, max_value=1.0),
        "g": tensor(f, F32, (8,)),
    },
)
def check_skip(impl, p, m, g):
    p_new, m_new = impl(p, m, g)
    if not bool(torch.isfinite(g).all()):
        assert torch.equal(p_new, p) and torch.equal(m_new, m), "a skipped step changed the state"
        return
    p64, m64, g64 = p.double(), m.double(), g.double()
    tol = 4 * EPS32 * (p64.abs() + m64.abs() + g64.abs())  # a few float32 roundings
    close(m_new, 0.9 * m64 + g64, tol)
    close(p_new, p64 - 0.1 * (0.9 * m64 + g64), tol)


# ------------------------------------------------------------------------- scaler bookkeeping


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=F32))


def _scaler(state, flags, *, reset_on_overflow=True, late=False, finite_growth=True):
    """A hand-written dynamic loss scaler (torch's rule), with the bugs switchable."""
    scale, t, out = float(state.scale), int(state.growth_tracker), []
    for overflow in flags:
        if overflow:
            scale = _f32(scale * state.backoff_factor)
            if state.min_scale is not None:
                scale = max(scale, state.min_scale)
            t = 0 if reset_on_overflow else t
        elif (t == state.growth_interval) if late else (t + 1 == state.growth_interval):
            grown = _f32(scale * state.growth_factor)
            grown = grown if math.isfinite(grown) or not finite_growth else scale
            scale = grown if state.max_scale is None else min(grown, state.max_scale)
            t = 0
        else:
            t += 1
        out.append((scale, t))
    return out


def _scaler_args(f):
    f32_max = float(torch.finfo(F32).max)
    return {
        "state": dynamic_scalers(f, scale=(2.0**-24, f32_max), growth_interval=(1, 2000)),
        "flags": st.lists(st.booleans(), min_size=1, max_size=20),
    }


def check_scaler(impl, state, flags):
    """Step for step, (scale, growth tracker) as funcamp.update (torch's rule, bit for bit)."""
    got, want = impl(state, flags), []
    for overflow in flags:
        state = funcamp.update(state, torch.tensor(overflow))
        want.append((float(state.scale), int(state.growth_tracker)))
    assert got == want, f"{got} != {want}"


for _name, _bug, _kwargs in (
    (
        "scaler_tracker_kept",
        "a scaler that keeps its clean-step count over an overflow",
        {"reset_on_overflow": False},
    ),
    ("scaler_grows_late", "a scaler that compares its count before counting", {"late": True}),
    ("scaler_grows_to_inf", "a scaler that grows past float32's max", {"finite_growth": False}),
):
    mutant(_name, _bug, _scaler, functools.partial(_scaler, **_kwargs), _scaler_args)(check_scaler)
