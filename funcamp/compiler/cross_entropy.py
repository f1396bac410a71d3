"""A ``CrossEntropyLoss`` built inside a compiled :func:`funcamp.amp` function reaches the amp mode.

Dynamo special-cases the construction of ``torch.nn.CrossEntropyLoss`` inside a traced function.
Instead of tracing the module's ``__init__`` and ``forward``, it puts a bare ``F.cross_entropy``
node into the graph. (This is ``UserDefinedClassVariable._call_cross_entropy_loss``, added with
pytorch/torchdynamo#450, "Add support for crossentropy".) That node never reaches an active
:class:`torch.overrides.TorchFunctionMode`. So under :func:`funcamp.amp`, a loss that eager code
computes in float32 was computed in the compute dtype once compiled. (Hugging Face's
``BertForMaskedLM`` builds ``CrossEntropyLoss()`` in its ``forward``: a bf16 loss, silently.)
Module hooks (module policies, ``trace``'s module paths) were skipped too. Upstream, this module
would be unnecessary if dynamo kept that fast path only while no torch function mode is on its
stack. No issue asks for it yet.

While funcamp's amp mode (the class given to :func:`install`) is on the traced function's mode
stack, the construction is routed to an identical subclass. Dynamo traces it like any other module.
``__init__``, the global forward hooks and ``forward`` run as written. ``F.cross_entropy``
dispatches to the mode as it does in eager code, giving the eager result, bit for bit. Any other
trace, another torch function mode's included, keeps dynamo's own fast path.

It is installed once, under a lock, when :func:`funcamp.amp` first wraps a function (never at
``import funcamp``). Which traces route is decided when dynamo meets the construction. A
:func:`funcamp.compiler.compiler_patches` block or a step's ``compiler_patches=`` chooses. Else
(``"auto"``) it routes only where every device of the compiled function's tensors is on
:data:`funcamp.compiler.ALLOWLIST` with this torch release. Elsewhere it is off, said once per
release and device. A torch whose dynamo has no such special case, or whose internals moved, is
left alone (logged once).

Workaround of torch internals (docs/upstream.md#cross-entropy):

- Root cause: dynamo replaces the construction of nn.CrossEntropyLoss with a bare
  F.cross_entropy node (from pytorch/torchdynamo#450). That node never reaches an active
  TorchFunctionMode.
- Upstream: none asks for it; the write-up is docs/upstream.md#cross-entropy.
- Why it is safe: the routed subclass is identical and traced like any module, so the result is
  eager's, bit for bit (tested). Any other trace keeps dynamo's fast path. Moved internals leave
  it alone.
- Tested on: torch 2.13 and 2.14 on the CPU (funcamp.compiler.ALLOWLIST); off elsewhere unless
  asked for.
- Delete when: dynamo keeps its fast path only while no torch function mode is on its stack.

"""

from __future__ import annotations

import threading
from typing import Any

import torch

from funcamp._core.progress import logger
from funcamp.compiler import gate

try:  # dynamo's internals the patch goes through (torch 2.13, 2.14)
    from torch._dynamo.source import AttrSource
    from torch._dynamo.variables import user_defined
    from torch._dynamo.variables.base import VariableTracker
except ImportError:  # pragma: no cover - a torch without dynamo
    AttrSource = VariableTracker = user_defined = None

__all__ = ["install", "installed", "routes", "trace_devices"]

_LOCK = threading.Lock()
_MODES: list[type] = []  # the mode classes that route (funcamp's amp mode)
_STATE: list[bool] = []  # [installed?], once decided


class _CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` under a class object dynamo does not special-case."""


_CrossEntropyLoss.__name__ = _CrossEntropyLoss.__qualname__ = "CrossEntropyLoss"


def _amp_mode_active(tx: Any) -> bool:
    """Whether one of :data:`_MODES` is on the traced function's torch function mode stack."""
    state = getattr(tx, "symbolic_torch_function_state", None)
    stack = getattr(state, "mode_stack", None)
    if stack is None:
        return False
    for variable in stack:
        try:
            kind = variable.python_type()
        except Exception:  # a mode dynamo cannot type: not ours
            continue
        if isinstance(kind, type) and issubclass(kind, tuple(_MODES)):
            return True
    return False


def trace_devices(tx: Any) -> frozenset[str]:
    """The device types of the tensors the compiled function of the trace ``tx`` was called with.

    The compiled function is the outermost one. Its tensors are those in its arguments' pytrees,
    and the parameters and buffers of modules there.
    """
    root = getattr(getattr(tx, "output", None), "root_tx", None)
    values = list((getattr(root, "f_locals", None) or {}).values())
    devices: set[str] = set()
    for leaf in torch.utils._pytree.tree_leaves(values):
        if isinstance(leaf, torch.nn.Module):
            tensors = [*leaf.parameters(), *leaf.buffers()]
            devices.update(t.device.type for t in tensors[:1])
        elif isinstance(leaf, torch.Tensor):
            devices.add(leaf.device.type)
    return frozenset(devices)


def routes(tx: Any) -> bool:
    """Whether the trace ``tx`` routes.

    The innermost :func:`funcamp.compiler.compiler_patches` choice decides (a step's
    ``compiler_patches=`` enters one). Without one, it routes when every device of
    :func:`trace_devices` (``"unknown"`` without any) is on the allowlist with this release.
    """
    choice = gate._CHOICE.get()
    if choice != "auto":
        return bool(choice)
    devices = sorted(trace_devices(tx)) or ["unknown"]
    return all([gate.patches_on("auto", device) for device in devices])


def installed() -> bool:
    """Whether the routing is in place, after :func:`install`.

    False where this torch's dynamo is not the one it was written against.
    """
    return _STATE == [True]


def install(mode_class: type) -> bool:
    """Route in-graph ``CrossEntropyLoss`` constructions to ``mode_class`` while it is on the stack.

    The stack is the trace's mode stack. It installs once per class, and patches dynamo once,
    under a lock. Returns True when the patch is in place.
    """
    with _LOCK:
        if mode_class not in _MODES:
            _MODES.append(mode_class)
        if not _STATE:
            _STATE.append(_patch())
        return _STATE[0]


def _patch() -> bool:
    cls = getattr(user_defined, "UserDefinedClassVariable", None)
    original = getattr(cls, "_call_cross_entropy_loss", None)
    if original is None or AttrSource is None or not hasattr(VariableTracker, "build"):
        logger.info(
            "funcamp: this torch's dynamo is not the one funcamp.compiler.cross_entropy was "
            "written against; a CrossEntropyLoss built inside a compiled amp function is "
            "traced as dynamo traces it"
        )
        return False

    def _call_cross_entropy_loss(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        if not (_amp_mode_active(tx) and routes(tx)):
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
