"""0-d tensor betas for NAdam, RAdam and Adamax, computed as torch.optim computes with them.

torch.optim's NAdam, RAdam and Adamax take ``betas`` as 0-d tensors (one, the other or both) on
their single-tensor path. The per-element operations then read the beta as a float32 scalar --
``exp_avg.lerp_(grad, 1 - beta1)`` is the lerp with the float32 value of ``1 - beta1`` -- so
those take Python floats read here once. The scalars torch computes from the step number
(``1 - beta ** step``, NAdam's ``mu``, RAdam's ``rho_t``) become tensor math in the beta's
dtype: a Python float operand rounded to it first, ``x / tensor`` as
``tensor.reciprocal() * x``, ``beta ** step`` as ``std::pow`` in double (but ``beta * beta``
and ``beta * beta * beta`` at the steps 2 and 3, torch's special cases). The helpers here do
that with the step count as a float64 tensor: no host sync.
"""

from __future__ import annotations

from typing import Any

import torch

from funcamp._core.checks import check_number
from funcamp._core.tree import describe

__all__: list[str] = []

#: The dtypes of the tensor betas taken (torch's defaults: a ``torch.tensor(0.9)`` is float32).
DTYPES = (torch.float32, torch.float64)


def betas(api: str, b1: Any, b2: Any) -> tuple[Any, Any]:
    """``(b1, b2)``, each a float in [0, 1) or a 0-d float32/float64 tensor (a copy)."""
    return _beta(api, "b1", b1), _beta(api, "b2", b2)


def _beta(api: str, name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype not in DTYPES or value.requires_grad:
            raise TypeError(
                f"funcamp.{api}: `{name}` must be a float or a 0-d float32 or float64 tensor "
                f"without grad (torch.optim's tensor betas), got {describe(value)}; pass "
                f"float({name}) or {name}.detach().reshape(())"
            )
        check_number(api, name, float(value), maximum=1.0)
        return value.detach().clone()
    return check_number(api, name, value, maximum=1.0)


def f32(x: Any) -> float:
    """The float32 value of ``x`` (a float or a 0-d tensor) as a Python float: what torch's
    float32 kernels read from a scalar operand."""
    return float(torch.as_tensor(x).to(torch.float32))


def one_minus(b: Any) -> float:
    """``1 - b`` as torch's float32 kernels read it (``lerp_(grad, 1 - beta1)``,
    ``addcmul_(..., value=1 - beta2)``): in the beta's dtype for a tensor, then float32."""
    return f32(1 - b) if isinstance(b, torch.Tensor) else 1.0 - b


def on(b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The beta on the step count's device."""
    return b.to(like.device)


def power(b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """torch's ``b ** step`` for a 0-d tensor ``b`` and the Python float ``step`` (``t``, a
    float64 0-d tensor), in ``b``'s dtype."""
    general = torch.pow(b.to(torch.float64), t).to(b.dtype)
    square = b * b
    return torch.where(t == 2.0, square, torch.where(t == 3.0, square * b, general))


def one_minus_power(b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """torch's ``1 - b ** step`` (a bias correction) in ``b``'s dtype."""
    return 1 - power(b, t)


def is_tensor_rate(lr: Any) -> bool:
    """Whether the learning rate is torch's tensor ``lr`` (a float32 tensor, say), whose step
    scalars torch computes in its dtype; a Python float, or a schedule's float64 value (torch's
    Python float), is not."""
    return isinstance(lr, torch.Tensor) and lr.dtype != torch.float64


def rate(lr: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.dtype]:
    """The learning rate as an operand of tensor math in ``dtype``, and the dtype the result
    takes: a Python float (or a schedule's float64 value, torch's Python float) is rounded to
    ``dtype``; another tensor (torch's tensor ``lr``) promotes as 0-d tensors do."""
    if not isinstance(lr, torch.Tensor):
        return torch.tensor(lr, dtype=dtype), dtype
    if lr.dtype == torch.float64:
        return lr.to(dtype), dtype
    out = torch.promote_types(lr.dtype, dtype)
    return lr.to(out), out


def over(lr: Any, bc: torch.Tensor) -> torch.Tensor:
    """torch's ``lr / bc`` for a 0-d tensor ``bc``: ``bc.reciprocal() * lr`` for a Python float
    ``lr`` (``Tensor.__rtruediv__``), a division of tensors for a tensor ``lr``."""
    value, dtype = rate(lr, bc.dtype)
    if is_tensor_rate(lr):
        return value.to(bc.device) / bc.to(dtype)
    return bc.reciprocal() * value.to(bc.device)
