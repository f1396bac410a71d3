"""Cast at entry: the floating inputs of a function go to the compute dtype before it runs.

What a policy whose op table casts at entry (``ops=cast_at_entry``) does where ``amp`` (and
``trace``) enter the wrapped function. The cast is a differentiable ``Tensor.to`` run inside the
transformed function, so under ``torch.func.grad`` the gradients come back in the inputs' own
dtypes (float32 for float32 params), as FSDP2's ``reduce_dtype=torch.float32`` gives them.
"""

from __future__ import annotations

from typing import Any

from funcamp.policy.policy import Policy, cast_floating

__all__ = ["cast_at_entry"]


def cast_at_entry(
    policy: Policy, args: tuple[Any, ...], kwargs: dict[str, Any], keep: tuple[int, ...] = ()
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with every floating tensor cast to ``policy.compute_dtype``.

    Only when ``policy.ops.casts_at_entry``; float64 tensors stay float64 unless the compute
    dtype is float64. The positional arguments numbered in ``keep`` stay as they are (a train
    step's buffers: FSDP2 casts params and forward inputs, never buffers).
    """
    if not policy.ops.casts_at_entry:
        return args, kwargs
    dtype = policy.compute_dtype
    args = tuple(a if i in keep else cast_floating(a, dtype) for i, a in enumerate(args))
    return args, (cast_floating(kwargs, dtype) if kwargs else kwargs)
