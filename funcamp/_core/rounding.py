"""Bit-exact rounding of float32 values to bfloat16/float16 and counter-based random bits.

Everything here works on the float32 *bit pattern* with integer ops. So eager and compiled code
give bit-identical results. (Inductor's default ``emulate_precision_casts=False`` may fuse away a
``.to(bfloat16).to(float32)`` pair.) Each function returns a float32 tensor whose values are
exactly representable in the target dtype. The final ``.to(dtype)`` is then exact.
"""

from __future__ import annotations

import torch

from funcamp._core.context import compiling, transform_while_tracing

__all__ = [
    "bits_from_key",
    "computed_once",
    "leaf_keys",
    "random_bits",
    "round_nearest",
    "round_stochastic",
]


_MASK32 = 0xFFFFFFFF
_INT32_MIN = -(2**31)
_F32_INF_BITS = 0x7F800000
_F16_MAX_BITS = 0x477FE000  # 65504.0 as float32 bits
_F16_MIN_NORMAL_EXP = 113  # float32 biased exponent of 2**-14


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' lowbias32 family) on int64 values in [0, 2**32).

    Multipliers are below 2**31, so every product stays below 2**63: no signed overflow, and
    eager and compiled code agree exactly.
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def _step_key(seed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The 0-d int64 key of step ``count`` under ``seed``, before the leaf index is mixed in."""
    key = _hash32((seed.to(torch.int64) & _MASK32) ^ 0x5BD1E995)
    return _hash32(key ^ (count.to(torch.int64) & _MASK32))


def leaf_keys(seed: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    """Return the int64 keys of leaves ``0 .. n-1`` for step ``count`` (shape ``(n,)``).

    A key is what :func:`random_bits` hashes with the element index. This computes it for every
    leaf at once.
    """
    leaves = torch.arange(n, dtype=torch.int64, device=seed.device)
    return _hash32(_step_key(seed, count) ^ leaves)


def bits_from_key(key: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Return int64 random bits in [0, 2**31) of ``shape`` from a leaf's 0-d ``key``
    (see :func:`leaf_keys`)."""
    idx = torch.arange(shape.numel(), dtype=torch.int64, device=key.device).reshape(shape)
    return _hash32(key ^ (idx & _MASK32)) >> 1


def random_bits(
    seed: torch.Tensor, count: torch.Tensor, leaf: int, shape: torch.Size
) -> torch.Tensor:
    """Return int64 random bits in [0, 2**31) of ``shape``.

    They are a pure function of (seed, count, leaf index, element index), never the global RNG.
    """
    return bits_from_key(_hash32(_step_key(seed, count) ^ (leaf & _MASK32)), shape)


def computed_once(x: torch.Tensor) -> torch.Tensor:
    """``x``, or while compiling a view of it that inductor computes into a buffer once.

    The view is ``as_strided`` onto ``x``'s own size and strides. Without it inductor inlines
    ``x``'s expression into each of its readers. Fused into the same kernel, the buffer stays a
    local value: the same kernels and memory traffic. ``x`` is left alone where autograd or a
    functorch transform (vmap, grad) would see the view. It is also left alone when
    non-contiguous, since inductor's buffer need not share its strides.
    """
    # Why: inductor gives up inlining only past some fan-out or op count, and the integer work
    # here reads its values several times. Each hash step reads its input twice
    # (x ^ (x >> 16), three steps a hash), so an inlined chain of hashes grows as a power of
    # two (the stochastic-rounding keys of a few small leaves were slow to compile). The
    # rounding reads the bit pattern of a whole optimizer update up to six times (Kahan
    # summation compiles faster with this; docs/benchmarks.md, "Low-precision modes").
    if (
        not compiling()
        or not x.is_contiguous()
        or (x.requires_grad and torch.is_grad_enabled())
        or transform_while_tracing()  # compiling: asked as a constant of the trace
    ):
        return x
    return torch.as_strided(x, x.size(), x.stride())


def _round_bits(x: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor | None) -> torch.Tensor:
    """Round float32 ``x`` into ``dtype``'s grid: to nearest-even when ``noise`` is None, else
    stochastically with ``noise`` (int64 uniform in [0, 2**31)). Returns float32."""
    bits = computed_once(x).view(torch.int32)
    sign = bits & _INT32_MIN
    mag = bits & 0x7FFFFFFF
    finite = mag < _F32_INF_BITS
    mag = torch.where(finite, mag, 0)
    if dtype == torch.bfloat16:
        if noise is None:
            inc = 0x7FFF + ((mag >> 16) & 1)
        else:
            inc = (noise >> 15).to(torch.int32)  # 16 random bits
        out = (mag + inc) & -65536  # 0xFFFF0000; a carry into the exponent gives inf
    elif dtype == torch.float16:
        # Normal range of float16: drop 13 mantissa bits of the float32 pattern.
        if noise is None:
            inc = 0xFFF + ((mag >> 13) & 1)
        else:
            inc = (noise >> 18).to(torch.int32)  # 13 random bits
        normal = (mag + inc) & -8192
        normal = torch.where(normal > _F16_MAX_BITS, _F32_INF_BITS, normal)
        # Subnormal range of float16 (|x| < 2**-14): the grid is multiples of 2**-24.
        exp = mag >> 23
        man = (mag & 0x7FFFFF).to(torch.int64) | torch.where(exp > 0, 1 << 23, 0)
        shift = (126 - torch.clamp(exp, min=1)).to(torch.int64)  # >= 14 here
        pre = torch.clamp(shift - 31, min=0, max=62)
        man = man >> pre
        shift = shift - pre  # in [14, 31]
        if noise is None:
            sinc = (torch.ones_like(shift) << (shift - 1)) - 1 + ((man >> shift) & 1)
        else:
            sinc = noise >> (31 - shift)
        k = (man + sinc) >> shift
        sub = (k.to(torch.float32) * 2.0**-24).view(torch.int32)
        out = torch.where(exp >= _F16_MIN_NORMAL_EXP, normal, sub)
    else:  # pragma: no cover - guarded by callers
        raise TypeError(f"funcamp: cannot round to {dtype}")
    out = torch.where(finite, sign | out, bits)
    return out.view(torch.float32)


def round_nearest(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 ``x`` to nearest-even in ``dtype``; float32 result, bit-exact when compiled."""
    return _round_bits(x, dtype, None)


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` stochastically into ``dtype``; float32 result.

    It rounds up with probability equal to the fraction of an ulp. ``noise`` comes from
    :func:`random_bits`.
    """
    return _round_bits(x, dtype, noise)
