"""torch.optim's ``maximize`` and ``amsgrad`` as transforms of their own, in optax's style.

Compose them with :func:`funcamp.chain`. ``funcamp.chain(funcamp.negate_gradients(), opt)`` ascends
where ``opt`` descends (torch.optim's ``maximize=True``, optax's ``scale(-1)`` in front).
:func:`scale_by_amsgrad` is Adam's direction with torch.optim's AMSGrad maximum (optax's
``scale_by_amsgrad``, with torch's rule for the maximum). Scale it by a learning rate, for example
with ``funcamp.sgd(lr)`` after it.
"""

from __future__ import annotations

from typing import Any

import torch

from funcamp._core.checks import check_number
from funcamp._core.tree import PyTree
from funcamp.optim._base import Optimizer
from funcamp.optim._elementwise import elementwise
from funcamp.optim._fused import AdamHyper
from funcamp.optim._optimizers import _adam_step
from funcamp.optim._paths import Ops
from funcamp.optim._shared import _stateless
from funcamp.optim._states import AdamState

__all__ = ["negate_gradients", "scale_by_amsgrad"]
Tensors = list[torch.Tensor]


def negate_gradients() -> Optimizer:
    """A transform whose updates are the gradients negated (``-g``, exactly, in their dtype).

    In front of an optimizer in :func:`funcamp.chain` it turns descent into ascent. It is what
    torch.optim's ``maximize=True`` does first. ``funcamp.sgd``/``adam``/``adamw(...,
    maximize=True)`` do the same, bit for bit. Optax writes it ``optax.scale(-1.0)``. The state is
    ``()``.

    Returns:
        An :class:`~funcamp.Optimizer` with state ``()``.

    Example:
        >>> import torch, funcamp
        >>> ascent = funcamp.chain(funcamp.negate_gradients(), funcamp.sgd(0.5))
        >>> params, g = {"w": torch.ones(2)}, {"w": torch.tensor([1.0, -2.0])}
        >>> updates, _ = ascent.update(g, ascent.init(params), params)
        >>> funcamp.apply_updates(params, updates)
        {'w': tensor([1.5000, 0.0000])}
        >>> same = funcamp.sgd(0.5, maximize=True)
        >>> funcamp.apply_updates(params, same.update(g, same.init(params), params)[0])
        {'w': tensor([1.5000, 0.0000])}
    """

    def negate(ops: Ops, gs: Tensors, grads: PyTree, params: PyTree) -> Tensors:
        return ops.mul(gs, -1.0, into=gs)  # times -1: exact

    return _stateless("negate_gradients", negate)


def _amsgrad_direction(b1: float, b2: float, eps: float) -> Any:
    adam = _adam_step(AdamHyper(b1, b2, eps, 0.0, False, amsgrad=True))

    def step(ops: Ops, g: Tensors, p: Any, buffers: dict, lr: Any, count: Any) -> Any:
        # Adam's step at lr = 1 is -m_hat / denom; the direction is its negation (exact).
        deltas, new = adam(ops, g, p, buffers, 1.0, count)
        return ops.mul(deltas, -1.0, into=deltas), new

    return step


def scale_by_amsgrad(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> Optimizer:
    """Adam's direction with the AMSGrad maximum, as torch.optim computes it.

    Scale it by a learning rate: ``chain(scale_by_amsgrad(b1, b2, eps), sgd(lr))`` is
    ``adam(lr, b1, b2, eps, amsgrad=True)``. They agree within rounding, since the product with
    ``lr`` is rounded separately.

    The moments are ``m = b1 m + (1 - b1) g`` and ``v = b2 v + (1 - b2) g^2``, and ``v_max =
    max(v_max, v)``. The update is ``(m / (1 - b1^t)) / (sqrt(v_max) / sqrt(1 - b2^t) + eps)``. The
    maximum is taken of the raw second moments and divided by the current bias correction, as
    ``torch.optim.Adam(amsgrad=True)`` does. (Optax's ``scale_by_amsgrad`` takes the maximum of the
    bias-corrected moments; the two differ while the correction changes.) The state is an
    :class:`~funcamp.optim.AdamState` with ``max_exp_avg_sq``. It is checkpointed, skipped on an
    overflowing step and sharded like the moments. Float32 math for half grads.

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the denominator (>= 0).

    Returns:
        An :class:`~funcamp.Optimizer` whose state is a :class:`funcamp.optim.AdamState`.

    Example:
        >>> import torch, funcamp
        >>> opt = funcamp.chain(funcamp.scale_by_amsgrad(), funcamp.sgd(0.1))
        >>> ref = funcamp.adam(0.1, amsgrad=True)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> s, r = opt.init(params), ref.init(params)
        >>> p, q = params, params
        >>> for g in ([3.0, -1.0], [0.5, -4.0], [0.1, 0.2]):
        ...     u, s = opt.update({"w": torch.tensor(g)}, s, p)
        ...     p = funcamp.apply_updates(p, u)
        ...     v, r = ref.update({"w": torch.tensor(g)}, r, q)
        ...     q = funcamp.apply_updates(q, v)
        >>> torch.allclose(p["w"], q["w"], rtol=1e-6), s[0].max_exp_avg_sq
        (True, {'w': tensor([0.0092, 0.0170])})
    """
    api = "scale_by_amsgrad"
    b1 = check_number(api, "b1", b1, maximum=1.0)
    b2 = check_number(api, "b2", b2, maximum=1.0)
    eps = check_number(api, "eps", eps)
    opt = elementwise(
        api,
        AdamState,
        _amsgrad_direction(b1, b2, eps),
        1.0,
        buffers=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    )
    # no learning rate of its own: a chain reports the one of the optimizer after it
    return opt._replace(learning_rate=None)
