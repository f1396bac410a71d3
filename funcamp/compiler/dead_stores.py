"""Inductor lowering a train step that writes its state in place: only live values are stored.

A step with a donated state writes the new params and optimizer state into the old tensors. So the
graph ends with a ``copy_`` into each input it mutates. Inductor keeps the values of the graph it
has lowered lazily: a pointwise value is computed where it is read, not stored. Before lowering a
write into a buffer, it stores every value lowered so far that reads that buffer
(``GraphLowering.mark_buffer_mutated``). So none reads the new contents.

It stores them all, the *dead* ones too. Every intermediate of the update (``m - g``, ``v * b2``,
the denominator, ...) reads the old params or state. Each becomes a buffer of its own, whose
readers were lowered long before and already compute it inline. Nothing ever reads those buffers,
and the scheduler drops them. But first it builds a scheduler node for each, the most expensive
part of inductor's scheduling. On the real-model suite about half of a step's nodes were dead ones
(docs/benchmarks.md has the numbers).

While :func:`skip_dead_stores` is active, a write stores only the values that can still be read. A
value whose graph node's readers have all been lowered is gone from the lowering's environment
(``torch.fx.Interpreter`` frees each value after its last reader). Nothing can read it any more but
the values that computed it inline. Those are themselves live (and stored now) or dead. The values
stored, and so the kernels and their bits, are the ones inductor keeps anyway. Only the nodes it
would have built and dropped are not made. Everything else is inductor's own code. A torch whose
lowering does not look like this (no ``name_to_users``/``env``) runs it unchanged.

Upstream: ``mark_buffer_mutated`` realizing every registered reader came with
pytorch/pytorch#105882. ("Optimize finding users of buffers for mutation" replaced a scan of the
environment by ``register_users_of``.) No issue asks for the dead readers to be skipped. This
module would be unnecessary if inductor dropped a reader from ``name_to_users`` once its FX node's
value is freed, or realized lazily at scheduling. Scope: on only inside :func:`skip_dead_stores`,
in the thread that entered it (funcamp's own compiles, chosen by :mod:`funcamp.compiler.gate`).
There it is part of inductor's FX graph cache key (:mod:`funcamp.compiler.keys`).

Workaround of torch internals (docs/upstream.md#dead-stores):

- Root cause: GraphLowering.mark_buffer_mutated stores every registered reader of a buffer
  before a write into it, the dead ones too. The scheduler builds and then drops a node for
  each.
- Upstream: none asks for the dead readers to be skipped; the write-up is docs/upstream.md#live-
  reads (origin: pytorch/pytorch#105882).
- Why it is safe: the values stored, and so the kernels and their bits, are those inductor keeps
  anyway (tested). A lowering without name_to_users/env runs unchanged.
- Tested on: torch 2.13 and 2.14 on the CPU (funcamp.compiler.ALLOWLIST); off elsewhere unless
  asked for.
- Delete when: inductor drops a reader once its FX value is freed, or realizes lazily at
  scheduling.

"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator
from typing import Any

try:  # inductor's lowering and IR (torch builds with inductor)
    from torch._inductor import ir as _ir
    from torch._inductor.graph import GraphLowering as _GraphLowering
except Exception:  # pragma: no cover - torch without inductor
    _ir = _GraphLowering = None

from funcamp.compiler.switch import acted, install_once, switched_on

__all__ = ["drop_dead_readers", "skip_dead_stores", "supported"]

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("funcamp_dead_stores", default=False)
_ORIGINAL: Any = None


@functools.cache
def supported() -> bool:
    """Whether this torch lowers a write the way this module relies on.

    That means a ``GraphLowering.mark_buffer_mutated`` that realizes the values listed in
    ``name_to_users`` (each graph node's value, registered by ``register_users_of``). Values are
    held in ``env`` (a ``torch.fx.Interpreter``). Lazy values are ``StorageBox`` of ``Loops``.
    """
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
    """The ids of every value the environment still holds, inside nested lists and tuples too:
    ``register_users_of`` registers readers found at any depth of a node's value, so liveness
    is judged at every depth (a value one level deeper, judged dead, was read after the write)."""
    live: set[int] = set()
    stack = list(env.values())
    while stack:
        value = stack.pop()
        live.add(id(value))
        if isinstance(value, (list, tuple)):
            stack.extend(value)
    return live


def _install() -> None:
    """Route ``GraphLowering.mark_buffer_mutated`` through this module (once). Outside
    :func:`skip_dead_stores` it runs inductor's own code only."""
    install_once("dead_stores", _patch)


def _patch() -> bool:
    global _ORIGINAL
    _ORIGINAL = _wrap(_GraphLowering.mark_buffer_mutated)
    return True


def drop_dead_readers(graph: Any, name: Any) -> None:
    """Drop from ``graph.name_to_users[name]`` the lazy values nothing can read any more.

    See the module docstring. Inductor realizes the rest before the write into ``name``.
    """
    users = getattr(graph, "name_to_users", {}).get(name)
    env = getattr(graph, "env", None)
    if users and isinstance(env, dict):
        # Dead for good (a freed value never comes back): dropped from the list.
        live = _live_ids(env)
        kept = [user for user in users if not _dead(user, live)]
        if len(kept) != len(users):
            acted("dead_stores")
            users[:] = kept


def _wrap(original: Any) -> Any:
    """Put ``mark_buffer_mutated`` in the place of ``original``; returns ``original``."""

    def mark_buffer_mutated(self: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        if _ACTIVE.get():
            drop_dead_readers(self, name)
        return original(self, name, *args, **kwargs)

    mark_buffer_mutated.__wrapped__ = original  # type: ignore[attr-defined]
    _GraphLowering.mark_buffer_mutated = mark_buffer_mutated
    return original


@contextlib.contextmanager
def skip_dead_stores(enabled: bool | None = None) -> Iterator[None]:
    """Store only live readers before an in-place write, while this is active.

    It acts when ``enabled``, on a torch this module supports. Inductor then stores only the
    live values that read a buffer before lowering a write into it (see the module docstring).
    Graphs lowered in other threads or outside the block are untouched. ``enabled=None`` means
    on, unless the environment sets ``FUNCAMP_DEAD_STORES=0``. (That gives inductor's own
    lowering, for comparison or debugging. The old name ``FUNCAMP_LIVE_READS=0`` works too.)
    """
    if enabled is None:
        enabled = _from_environment()
    with switched_on(_ACTIVE, "FUNCAMP_DEAD_STORES", enabled, supported, _install):
        yield


def _from_environment() -> bool:
    """On unless ``FUNCAMP_DEAD_STORES`` (or, where it is unset, its old name
    ``FUNCAMP_LIVE_READS``) is ``0``."""
    for name in ("FUNCAMP_DEAD_STORES", "FUNCAMP_LIVE_READS"):
        if name in os.environ:
            return os.environ[name] != "0"
    return True
