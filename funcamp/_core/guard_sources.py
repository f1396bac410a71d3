"""Reading dynamo's guard sources (duck-typed: nothing here imports dynamo).

A compiled step checks the guards rooted in its arguments (``state``, ``batch``) or in torch's
global state on every call. Two users read guard sources the same way. One is the guard filter
of ``specialize=True`` (:func:`funcamp.train.compiling.input_guards_only`). The other is the
compiled step kept on disk (:mod:`funcamp.stepcache`), which checks the other guards once, when
it loads an entry.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GLOBAL_STATE_SOURCES", "STEP_INPUTS", "is_mode_flag", "source_root"]

#: The step's arguments; guards rooted in them (or in torch's global state) are the ones a
#: step checks on every call.
STEP_INPUTS = ("state", "batch")

#: The kinds of root source that are torch's global state (grad mode, default device, ...).
GLOBAL_STATE_SOURCES = ("GlobalStateSource", "ShapeEnvSource")


def source_root(source: Any) -> Any:
    """The source a dynamo guard source is read from (``L['state']`` for
    ``L['state'].params['w']``)."""
    while getattr(source, "base", None) is not None:
        source = source.base
    return source


def is_mode_flag(source: Any) -> bool:
    """Whether a guard source reads a module's ``training`` flag (``....training``).

    ``model.train()`` / ``model.eval()`` set that flag, and a compiled step must follow it.
    """
    return type(source).__name__ == "AttrSource" and getattr(source, "member", None) == "training"
