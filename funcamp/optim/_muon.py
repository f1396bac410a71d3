"""Muon (momentum orthogonalised by Newton-Schulz) with torch.optim.Muon's semantics.

It is written with :func:`funcamp.optim.elementwise`. The algorithm gets each leaf whole, so the
orthogonalisation is a per-leaf function like any other op. The momentum, the weight decay and
the step are torch.optim's operations, rounded as its kernels round them.
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from funcamp._core.checks import check_flag, check_int, check_number
from funcamp._core.tree import NAMESPACE, PyTree, describe, path_str
from funcamp.optim import _betas as bt
from funcamp.optim._base import NewParams, Optimizer
from funcamp.optim._paths import Ops
from funcamp.optim._shared import (
    LearningRate,
    LowPrecision,
    Tensors,
    _build,
    _f64,
    _kept,
    at,
    hyperparameter,
    hyperparameters,
    operand,
    positive,
)
from funcamp.optim._states import MuonState
from funcamp.optim._whole import gather_whole, local_part, shard_layouts

__all__ = ["muon", "newton_schulz"]
#: torch.optim.Muon's defaults: the quintic's coefficients, its steps and the norm's floor.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")
WHOLE = "Newton-Schulz orthogonalises whole matrices"


def newton_schulz(
    x: torch.Tensor,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = EPS,
) -> torch.Tensor:
    """Orthogonalise a 2-D ``x`` by ``ns_steps`` quintic Newton-Schulz iterations in bfloat16.

    This is torch.optim.Muon's computation. It starts from ``x / max(||x||, eps)``, transposed
    when it has more rows than columns. Each iteration is ``X = a X + (b A + c A @ A) @ X`` with
    ``A = X @ X.T``.

    Args:
        x: a 2-D tensor.
        ns_coefficients: ``(a, b, c)``.
        ns_steps: the number of iterations.
        eps: the floor of the norm.

    Returns:
        A bfloat16 tensor of ``x``'s shape, whose singular values are near 1.

    Example:
        >>> import torch, funcamp
        >>> o = funcamp.optim.newton_schulz(torch.tensor([[3.0, 0.0], [0.0, 0.5]]))
        >>> o.dtype, o.diagonal().float().round(decimals=1)
        (torch.bfloat16, tensor([0.7000, 1.0000]))
    """
    a, b, c = ns_coefficients
    o = x.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        o = o.T
    o = o / o.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = o @ o.T
        gram = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        o = torch.addmm(o, gram, o, beta=a)
    return o.T if tall else o


def _ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":  # Bernstein's (torch 2.14)
        return math.sqrt(rows / cols)
    return math.sqrt(max(1, rows / cols))


def _muon_step(
    momentum: Any,
    nesterov: bool,
    weight_decay: Any,
    ns: tuple[tuple[float, float, float], int, float],
    adjust_lr_fn: str | None,
    shards: list[Any],
) -> Any:
    cfg = (momentum, weight_decay)

    def step(
        ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any, hyper: Any = None
    ) -> Any:
        # torch.optim.Muon: buf.lerp_(grad, 1 - momentum); update = grad.lerp(buf, momentum)
        # (nesterov) or buf; update = NS(update) (bfloat16); adjusted_lr = lr * ratio(shape);
        # p.mul_(1 - lr * weight_decay); p.add_(update, alpha=-adjusted_lr).
        momentum, weight_decay = (at(hyper, x) for x in cfg)
        buf = ops.lerp(buffers["momentum_buffer"], g, operand(ops, 1.0 - momentum))
        update = ops.lerp(g, buf, operand(ops, momentum)) if nesterov else buf
        dtypes = [x.dtype for x in g]
        on_shards = shards[-1] if shards else None
        if on_shards is None:
            orth = [newton_schulz(x, *ns).to(d) for x, d in zip(update, dtypes)]
            shapes = [x.shape for x in g]
        else:  # each rank: the whole matrices gathered, orthogonalised, its own rows kept
            across, lays = on_shards
            whole = gather_whole(across, list(update), lays)
            orth = [
                local_part(across, newton_schulz(x, *ns), lay).to(d)
                for x, lay, d in zip(whole, lays, dtypes)
            ]
            shapes = [lay.shape for lay in lays]
        if bt.is_tensor_rate(lr):  # torch's tensor lr: `lr * ratio`, `1 - lr * wd` in its dtype
            neg = [ops.scalar(-(lr * _ratio(adjust_lr_fn, shape))) for shape in shapes]
            factor = ops.scalar(1 - lr * weight_decay)
        else:
            lr64 = _f64(lr)
            neg = [ops.scalar(-(lr64 * _ratio(adjust_lr_fn, shape))) for shape in shapes]
            factor = ops.scalar(1.0 - lr64 * weight_decay)
        new = _kept(ops, buffers, momentum_buffer=buf)
        if p is None:
            return ops.mul(orth, neg), new
        decays = isinstance(weight_decay, torch.Tensor) or weight_decay != 0  # p * 1 is p
        new_p = ops.mul(p, factor) if decays else p
        return NewParams(ops.fma(orth, neg, new_p)), new  # p.add_(O, alpha=-adjusted_lr)

    return step


def muon(
    learning_rate: LearningRate = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: str | None = None,
    *,
    master_weights: bool = False,
    kahan: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> Optimizer:
    """Muon with torch.optim.Muon's semantics and defaults, for 2-D params (hidden matrices).

    The momentum is ``buf = momentum * buf + (1 - momentum) * g`` (a ``lerp``). The direction is
    ``g + momentum * (buf - g)`` with ``nesterov``, else ``buf``.
    :func:`funcamp.optim.newton_schulz` orthogonalises it into ``O`` (in bfloat16, as torch's).
    Then ``p = p * (1 - lr * weight_decay) - adjusted_lr * O``. With ``adjust_lr_fn="original"`` or
    None, ``adjusted_lr = lr * sqrt(max(1, rows / cols))``. With ``"match_rms_adamw"``
    (Moonshot's), it is ``lr * 0.2 * sqrt(max(rows, cols))``.

    Every param must be a matrix. Pair Muon with another optimizer for the rest through
    :func:`funcamp.multi_transform` (docs/guides/writing-an-optimizer.md shows the usual Muon +
    AdamW split).

    Newton-Schulz needs each matrix whole. Under ``parallel=Sharded(mesh)`` the momentum-updated
    direction of every sharded matrix is all-gathered along its shard dimension once a step (one
    all-gather per dtype: ``rows * cols`` floats per matrix on each rank). Each rank then
    orthogonalises the whole matrices and keeps its own rows (or columns) of the result. The
    momentum, the decay and the step stay on the shards; ``adjusted_lr`` uses the whole shape.
    The result is one process's within the bfloat16 rounding of Newton-Schulz's input. On
    DTensor params, DTensor's collectives gather what it needs instead, with the same result.

    Args:
        learning_rate: a float, a 0-d tensor, or a schedule ``count -> lr``.
        weight_decay: decoupled weight decay (>= 0).
        momentum: momentum factor, in [0, 1).
        nesterov: use the Nesterov direction.
        ns_coefficients: the quintic's ``(a, b, c)``.
        eps: the floor of the norm the direction is divided by (>= 0).
        ns_steps: Newton-Schulz iterations (an int in [0, 100)).
        adjust_lr_fn: ``None``/``"original"``, ``"match_rms_adamw"`` or
            ``"spectral_unclamped"`` (``sqrt(rows / cols)``, as in torch 2.14).
        master_weights: keep float32 copies of half params (see :mod:`funcamp.optim`).
        kahan: keep Kahan compensation buffers for half params.
        stochastic_rounding: round half params stochastically.
        seed: seed of the stochastic-rounding hash.

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.MuonState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.muon(0.1, weight_decay=0.0)
        >>> params = {"w": torch.zeros(2, 2)}
        >>> g = {"w": torch.tensor([[1.0, 0.0], [0.0, 1.0]])}
        >>> updates, state = opt.update(g, opt.init(params), params)
        >>> funcamp.apply_updates(params, updates)["w"].diagonal()
        tensor([-0.1125, -0.1125])
        >>> funcamp.muon(0.1).init({"b": torch.zeros(3)})
        Traceback (most recent call last):
        ...
        ValueError: funcamp.muon: every param must be a 2-D matrix (torch.optim.Muon's rule); the param at ['b'] has shape (3,): optimize it with another optimizer through funcamp.multi_transform (AdamW for biases, norms and embeddings, as in the Muon + AdamW split)
    """
    api = "muon"
    check_flag(api, "nesterov", nesterov)
    weight_decay = hyperparameter(api, "weight_decay", weight_decay)
    momentum = hyperparameter(api, "momentum", momentum, maximum=1.0)
    eps = check_number(api, "eps", eps)
    ns_steps = check_int(api, "ns_steps", ns_steps, minimum=0)
    if ns_steps >= 100:
        raise ValueError(f"funcamp.{api}: `ns_steps` must be an int < 100, got {ns_steps}")
    if not isinstance(ns_coefficients, (tuple, list)) or len(ns_coefficients) != 3:
        raise TypeError(
            f"funcamp.{api}: `ns_coefficients` must be three floats (a, b, c), got "
            f"{describe(ns_coefficients)}"
        )
    coefficients = tuple(
        check_number(api, f"ns_coefficients[{i}]", c, minimum=-math.inf)
        for i, c in enumerate(ns_coefficients)
    )
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(
            f"funcamp.{api}: `adjust_lr_fn` must be None, 'original', 'match_rms_adamw' or "
            "'spectral_unclamped', "
            f"got {adjust_lr_fn!r}"
        )
    # (across, layouts) of the update running on a sharded step's shards, for `step` to read
    shards: list[Any] = []
    ns = (coefficients, ns_steps, eps)
    step = _muon_step(momentum, nesterov, weight_decay, ns, adjust_lr_fn, shards)
    modes = LowPrecision(master_weights, kahan, stochastic_rounding, seed)
    opt = _build(
        api, MuonState, step, learning_rate, modes,
        needs_params=positive(weight_decay),
        hyper=hyperparameters(momentum, weight_decay),
    )  # fmt: skip

    def on_shards(grads: PyTree, run: Any, *args: Any) -> Any:
        shards.append(shard_layouts(api, WHOLE, grads))
        try:
            return run(grads, *args)
        finally:
            shards.pop()

    def update(grads: PyTree, state: MuonState, params: PyTree = None) -> Any:
        return on_shards(grads, opt.update, state, params)

    def prepare(grads: PyTree, state: MuonState, params: PyTree = None) -> Any:
        prepared = opt.prepare(grads, state, params)
        return prepared._replace(run=lambda g, writes: on_shards(g, prepared.run, writes))

    def init(params: PyTree) -> MuonState:
        leaves = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
        for path, x in zip(leaves[0], leaves[1]):
            if isinstance(x, torch.Tensor) and x.dim() != 2:
                raise ValueError(
                    f"funcamp.{api}: every param must be a 2-D matrix (torch.optim.Muon's rule); "
                    f"the param at {path_str(path)} has shape {tuple(x.shape)}: optimize it with "
                    "another optimizer through funcamp.multi_transform (AdamW for biases, norms "
                    "and embeddings, as in the Muon + AdamW split)"
                )
        return opt.init(params)

    return opt._replace(init=init, update=update, prepare=prepare)
