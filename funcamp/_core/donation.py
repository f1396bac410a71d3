"""What became of a state given to a donating train step: the one registry every use consults.

A donated train step writes the new state into the tensors of the state it was given. Each
state is known by a key object: its :class:`funcamp.ScalerState`. Every step returns a new one,
and ``TrainState.create`` gives each state its own. The registry records what happened to each
state, weakly (it keeps nothing alive):

* :data:`CHECKED`: the state passed the once-per-state checks of a donating step. (A state that
  step returned is checked already: its tensors are the given ones, or new.)
* :data:`WRITING`: a donated step is writing into its tensors, or began to and raised;
* :data:`DONATED`: a donated step wrote into it and returned the new state;
* ``"raised part-way (<exception>)"``: a donated step raised after its first write.

A step marks its state :data:`WRITING` *before* its first write, and :data:`DONATED` only after
it returned. So a state whose step was interrupted anywhere in between stays marked
(``KeyboardInterrupt``, an allocation failure, a torch error on one write).
:func:`refuse_consumed` refuses it in every later step, ``save``, ``state_dict`` and
``load_into_module``.

The eager step marks at its first write (:func:`writing`, armed by the wrapper with :func:`arm`).
So a ``loss_fn`` that raises leaves a usable state. The compiled step marks before the compiled
call, since its writes run inside the graph. A trace that fails before the graph runs unmarks it
(:func:`restore`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = [
    "CHECKED",
    "DONATED",
    "WRITING",
    "arm",
    "begin",
    "failed",
    "not_written",
    "refuse_consumed",
    "restore",
    "set_status",
    "status",
    "writing",
]

CHECKED = "checked"
WRITING = "writing"
DONATED = "donated"

_STATUS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_ARMED = threading.local()


def status(key: Any) -> str | None:
    """What became of the state known by ``key`` (None: nothing known)."""
    try:
        return _STATUS.get(key)
    except TypeError:  # not weakly referenceable: never registered
        return None


def set_status(key: Any, value: str) -> None:
    _STATUS[key] = value


def begin(key: Any) -> None:
    """Mark the state known by ``key`` as being written (before the first write)."""
    _STATUS[key] = WRITING


def restore(key: Any, previous: str | None) -> None:
    """Undo :func:`begin` when nothing was written after all (a trace that failed)."""
    if previous is None:
        _STATUS.pop(key, None)
    else:
        _STATUS[key] = previous


def failed(key: Any, error: BaseException) -> None:
    """A donated step raised: if it had begun writing, record how it ended."""
    if status(key) == WRITING:
        _STATUS[key] = f"raised part-way ({type(error).__name__})"


def arm(key: Any) -> None:
    """The state the eager step on this thread marks at its first write (None: none)."""
    _ARMED.key = key


def writing() -> Any:
    """Mark the armed state; an eager donated step calls this just before its first write.

    Returns what :func:`not_written` needs to take the mark back.
    """
    key = getattr(_ARMED, "key", None)
    if key is None:
        return None
    _ARMED.key = None
    previous = _STATUS.get(key)
    _STATUS[key] = WRITING
    return key, previous


def not_written(token: Any) -> None:
    """Take back :func:`writing`'s mark when the write it announced did not happen.

    That happens when a fused kernel declined the leaves. The state stays armed for the real
    first write.
    """
    if token is None:
        return
    key, previous = token
    if previous is None:
        _STATUS.pop(key, None)
    else:
        _STATUS[key] = previous
    _ARMED.key = key


def refuse_consumed(api: str, key: Any, what: str = "`state`") -> None:
    """Raise if the state known by ``key`` was donated, or its donated step raised part-way."""
    got = status(key)
    if got is None or got == CHECKED:
        return
    if got == DONATED:
        raise ValueError(
            f"funcamp.{api}: {what} was donated to an earlier train step: its tensors now "
            "hold the state that call returned. Keep only the returned state "
            "(`state, metrics = step(state, batch)`), or build the step with "
            "donate_state=False to keep the input state unchanged"
        )
    how = "raised part-way" if got == WRITING else got
    raise ValueError(
        f"funcamp.{api}: {what} was donated to a train step that {how}, after it had begun "
        "writing the new state into the state's tensors: some may hold new values and others "
        "old ones, so the state (and a module sharing its tensors) cannot be used. Reload the "
        "last checkpoint (funcamp.load), or build the step with donate_state=False, which "
        "leaves its input state unchanged whatever happens"
    )
