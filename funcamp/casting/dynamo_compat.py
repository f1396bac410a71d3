"""Where ``torch.compile`` would bypass a torch function mode, make it trace as eager runs.

Dynamo special-cases the construction of ``torch.nn.CrossEntropyLoss`` inside a traced
function: instead of tracing the module's ``__init__`` and ``forward`` it puts a bare
``F.cross_entropy`` node into the graph (``UserDefinedClassVariable._call_cross_entropy_loss``).
That node never reaches an active :class:`torch.overrides.TorchFunctionMode`, so under
:func:`funcamp.amp` a loss that eager code computes in float32 was computed in the compute dtype
once compiled (Hugging Face's ``BertForMaskedLM`` builds ``CrossEntropyLoss()`` in its
``forward``: a bf16 loss, silently). Module hooks (module policies, ``trace``'s module paths)
were skipped too.

While a torch function mode is active in the trace, the construction is routed to an
identical subclass instead, which dynamo traces like any other module: ``__init__``, the global
forward hooks and ``forward`` run as written, and ``F.cross_entropy`` dispatches to the mode as
it does in eager code. Without an active mode dynamo's own fast path is kept, so code that does
not use funcamp traces exactly as before. Installed once, when funcamp is imported; a torch
without the special case is left alone.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # dynamo's internals the patch goes through (torch 2.6-2.13)
    from torch._dynamo.source import AttrSource
    from torch._dynamo.variables import user_defined
    from torch._dynamo.variables.base import VariableTracker
except ImportError:  # pragma: no cover - a torch without dynamo
    AttrSource = VariableTracker = user_defined = None

__all__ = ["install"]


class _CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` under a class object dynamo does not special-case."""


_CrossEntropyLoss.__name__ = _CrossEntropyLoss.__qualname__ = "CrossEntropyLoss"


def _mode_active(tx: Any) -> bool:
    state = getattr(tx, "symbolic_torch_function_state", None)
    check = getattr(state, "in_torch_function_mode", None)
    return True if check is None else bool(check())


def install() -> bool:
    """Patch dynamo's ``CrossEntropyLoss`` construction; True when the patch is in place."""
    if user_defined is None:  # pragma: no cover - a torch without dynamo
        return False
    cls = getattr(user_defined, "UserDefinedClassVariable", None)
    original = getattr(cls, "_call_cross_entropy_loss", None)
    if original is None:
        return False
    if getattr(original, "__funcamp__", False):
        return True

    def _call_cross_entropy_loss(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        if not _mode_active(tx):
            return original(self, tx, args, kwargs)
        # With a source (an attribute of this module), dynamo takes its generic path for a
        # user class: the real constructor, then the module's __call__ when it is called.
        source = AttrSource(tx.import_source(__name__), "_CrossEntropyLoss")
        subclass = VariableTracker.build(tx, _CrossEntropyLoss, source)
        return subclass.call_function(tx, args, kwargs)

    _call_cross_entropy_loss.__funcamp__ = True  # type: ignore[attr-defined]
    _call_cross_entropy_loss.__wrapped__ = original  # type: ignore[attr-defined]
    cls._call_cross_entropy_loss = _call_cross_entropy_loss
    return True


INSTALLED = install()
