"""Say what a long first call is doing: the first call of a compiled train step compiles it."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["logger", "announce_first_call"]

#: funcamp's logger. ``logging.basicConfig(level=logging.INFO)`` (or a handler on
#: ``logging.getLogger("funcamp")``) shows when a train step compiles and how long it took.
logger = logging.getLogger("funcamp")

COMPILING = (
    "funcamp: compiling the train step (first call, ~10-30 s on a CPU, a few seconds with a "
    "warm compile cache); later steps reuse the compiled graph..."
)


def announce_first_call(fn: Callable[..., Any], what: str = "train step") -> Callable[..., Any]:
    """Wrap a compiled ``fn``: its first call logs ``COMPILING`` at INFO level before it runs
    and the time it took after; later calls go straight through."""
    done = False

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal done
        if done:
            return fn(*args, **kwargs)
        logger.info(COMPILING.replace("train step", what))
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        done = True
        logger.info("funcamp: compiled the %s in %.1f s", what, time.perf_counter() - start)
        return out

    return wrapped
