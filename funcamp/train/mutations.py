"""Inductor lowering a train step that writes its state in place: only live values are stored.

A step with a donated state writes the new params and optimizer state into the old tensors:
the graph ends with a ``copy_`` into each input it mutates. Inductor keeps the values of the
graph it has lowered lazily (a pointwise value is computed where it is read, not stored), and
before lowering a write into a buffer it stores every value lowered so far that reads that
buffer (``GraphLowering.mark_buffer_mutated``), so that none reads the new contents. It stores
them all, the *dead* ones too: every intermediate of the update (``m - g``, ``v * b2``, the
denominator, ...) reads the old params or state, and each becomes a buffer of its own, whose
readers were lowered long before and already compute it inline. Nothing ever reads those
buffers, and the scheduler drops them -- after building a scheduler node for each, the most
expensive part of inductor's scheduling: ViT's step held 1,230 nodes, 593 of them dead
(2.13; torch's own compiled optimizer graph: 520, 280 dead).

While :func:`live_reads_only` is active, a write stores only the values that can still be
read: a value whose graph node's readers have all been lowered is gone from the lowering's
environment (``torch.fx.Interpreter`` frees each value after its last reader), so nothing can
read it any more but the values that computed it inline, which are themselves live (and stored
now) or dead. The values stored, and so the kernels and their bits, are the ones inductor
keeps anyway; only the nodes it would have built and dropped are not made (ViT: 637 nodes,
Scheduler.__init__ 7.4 -> 3.8 s, docs/benchmarks.md). Everything else is inductor's own code;
a torch whose lowering does not look like this (no ``name_to_users``/``env``) runs it
unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Iterator
from typing import Any

try:  # inductor's lowering and IR (torch builds with inductor)
    from torch._inductor import ir as _ir
    from torch._inductor.graph import GraphLowering as _GraphLowering
except Exception:  # pragma: no cover - torch without inductor
    _ir = _GraphLowering = None

from funcamp.train.switch import switched_on

__all__ = ["live_reads_only", "supported"]

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("funcamp_live_reads", default=False)
_LOCK = threading.Lock()
_ORIGINAL: Any = None


@functools.cache
def supported() -> bool:
    """Whether this torch lowers a write the way this module relies on: a
    ``GraphLowering.mark_buffer_mutated`` that realizes the values listed in ``name_to_users``
    (each graph node's value, registered by ``register_users_of``), values held in ``env`` (a
    ``torch.fx.Interpreter``), and lazy values as ``StorageBox`` of ``Loops``."""
    if _GraphLowering is None or _ir is None:
        return False
    return (
        hasattr(_GraphLowering, "mark_buffer_mutated")
        and hasattr(_GraphLowering, "register_users_of")
        and all(hasattr(_ir, n) for n in ("TensorBox", "StorageBox", "Loops"))
    )


def _dead(value: Any, live: set[int]) -> bool:
    """A lazily computed value (not stored yet) whose graph node's value has been freed."""
    if id(value) in live or not isinstance(value, _ir.TensorBox):
        return False
    box = value.data
    return isinstance(box, _ir.StorageBox) and isinstance(box.data, _ir.Loops)


def _live_ids(env: dict[Any, Any]) -> set[int]:
    live: set[int] = set()
    for value in env.values():
        if isinstance(value, (list, tuple)):
            live.update(id(x) for x in value)
        else:
            live.add(id(value))
    return live


def _install() -> None:
    """Route ``GraphLowering.mark_buffer_mutated`` through this module (once). Outside
    :func:`live_reads_only` it runs inductor's own code only."""
    global _ORIGINAL
    with _LOCK:
        if _ORIGINAL is None:
            _ORIGINAL = _wrap(_GraphLowering.mark_buffer_mutated)


def _wrap(original: Any) -> Any:
    """Put ``mark_buffer_mutated`` in the place of ``original``; returns ``original``."""

    def mark_buffer_mutated(self: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        if _ACTIVE.get():
            users = getattr(self, "name_to_users", {}).get(name)
            env = getattr(self, "env", None)
            if users and isinstance(env, dict):
                # Dead for good (a freed value never comes back): dropped from the list, and
                # inductor's own method realizes the rest.
                live = _live_ids(env)
                users[:] = [user for user in users if not _dead(user, live)]
        return original(self, name, *args, **kwargs)

    mark_buffer_mutated.__wrapped__ = original  # type: ignore[attr-defined]
    _GraphLowering.mark_buffer_mutated = mark_buffer_mutated
    return original


@contextlib.contextmanager
def live_reads_only(enabled: bool | None = None) -> Iterator[None]:
    """While active (and ``enabled`` on a torch this module supports), inductor stores only the
    live values that read a buffer before lowering a write into it (see the module's
    docstring); graphs lowered in other threads or outside the block are untouched.
    ``enabled=None``: on unless the environment sets ``FUNCAMP_LIVE_READS=0`` (inductor's own
    lowering, for comparison or debugging)."""
    with switched_on(_ACTIVE, "FUNCAMP_LIVE_READS", enabled, supported, _install):
        yield
