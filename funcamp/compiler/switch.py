"""The switch shared by funcamp's patches of inductor, and a record of where a patch acted.

The patches are :mod:`funcamp.compiler.cpp_bundle` and :mod:`funcamp.compiler.dead_stores`.
Each is installed once, under one lock, whichever thread asks first. It is in force only inside
a block of the thread (or task) that entered it. It is on unless the environment turns it off.
The record notes where a patch's own code path ran.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator

__all__ = ["ACTED", "acted", "install_once", "switched_on"]

_LOCK = threading.RLock()
_INSTALLED: set[str] = set()

#: ``(patch, thread id)`` of the latest times a patch's own code path ran (not inductor's):
#: what tests read to see that a compile outside funcamp's was left to torch.
ACTED: collections.deque[tuple[str, int]] = collections.deque(maxlen=4096)


def acted(name: str) -> None:
    """Record that patch ``name`` changed what inductor does, in this thread."""
    ACTED.append((name, threading.get_ident()))


def install_once(name: str, install: Callable[[], bool]) -> bool:
    """Run ``install()`` for patch ``name`` once in the process; return whether it is installed.

    It runs under a lock, so two threads compiling at once install it once. ``install``
    returns False (and patches nothing) where this torch's internals are not the ones it
    expects.
    """
    with _LOCK:
        if name not in _INSTALLED and install():
            _INSTALLED.add(name)
        return name in _INSTALLED


@contextlib.contextmanager
def switched_on(
    flag: contextvars.ContextVar[bool],
    env: str,
    enabled: bool | None,
    supported: Callable[[], bool],
    install: Callable[[], None],
) -> Iterator[bool]:
    """Set ``flag`` for the block, after ``install()``; yield whether it did.

    The patch's code asks ``flag``. It is set where ``enabled`` and ``supported()`` hold.
    ``enabled=None`` means on, unless the environment sets ``env`` to ``0``.
    """
    if enabled is None:
        enabled = os.environ.get(env, "1") != "0"
    if not enabled or not supported():
        yield False
        return
    install()
    token = flag.set(True)
    try:
        yield True
    finally:
        flag.reset(token)
