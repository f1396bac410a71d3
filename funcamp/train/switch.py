"""The switch shared by funcamp's patches of inductor (:mod:`funcamp.train.cpp_bundle`,
:mod:`funcamp.train.mutations`): installed once, in force only inside a block, on unless the
environment turns it off."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator

__all__ = ["switched_on"]


@contextlib.contextmanager
def switched_on(
    flag: contextvars.ContextVar[bool],
    env: str,
    enabled: bool | None,
    supported: Callable[[], bool],
    install: Callable[[], None],
) -> Iterator[bool]:
    """Set ``flag`` for the block (the patch's code asks it), after ``install()``, where
    ``enabled`` (``None``: on unless the environment sets ``env`` to ``0``) and ``supported()``
    hold; yields whether it did."""
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
