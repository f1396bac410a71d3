"""Say what a long first call is doing: the first call of a compiled train step compiles it.

funcamp logs on the ``"funcamp"`` logger. Its notices are INFO records, shown by default: a
step is compiling, how long it took, a compiled step loaded from a cache.

* The ``"funcamp"`` logger's level is INFO unless you set one (before or after importing
  funcamp). So the notices pass whatever level the root logger has.
* If nobody configured logging, funcamp's own handler writes each record as a plain line to
  ``sys.stderr``, as ``logging.lastResort`` does for warnings. (Nobody configured it means no
  handler on the ``"funcamp"`` logger or the loggers it propagates to.)
* If you configured logging (``logging.basicConfig(...)``, a handler of your own), your handlers
  get the records, in your format. funcamp's handler then writes nothing.

Silence the notices with the environment variable ``FUNCAMP_QUIET=1``, read at each record.
funcamp's INFO records are then dropped; warnings still show. Or call
``logging.getLogger("funcamp").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["COMPILING", "QUIET_ENV", "announce_first_call", "logger"]

#: The environment variable that silences funcamp's notices (any value but "" and "0").
QUIET_ENV = "FUNCAMP_QUIET"

COMPILING = (
    "funcamp: compiling the train step (first call: up to minutes on a CPU for a real model, "
    "seconds with cache_dir; docs/benchmarks.md)..."
)


def _quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


class _QuietFilter(logging.Filter):
    """Drops funcamp's INFO (and DEBUG) records while ``FUNCAMP_QUIET`` is set."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not _quiet()


class _DefaultHandler(logging.Handler):
    """funcamp's records as plain lines on ``sys.stderr`` (looked up at each record, as
    ``logging.lastResort`` does), only while no other handler would receive them."""

    def emit(self, record: logging.LogRecord) -> None:
        if self._others_handle(record):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # pragma: no cover - a closed stderr
            self.handleError(record)

    def _others_handle(self, record: logging.LogRecord) -> bool:
        node: logging.Logger | None = logging.getLogger(record.name)
        while node is not None:
            if any(h is not self for h in node.handlers):
                return True
            if not node.propagate:
                return False
            node = node.parent  # type: ignore[assignment]
        return False


#: funcamp's logger (see the module docstring for what it shows and how to silence it).
logger = logging.getLogger("funcamp")
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)
if not any(isinstance(f, _QuietFilter) for f in logger.filters):
    logger.addFilter(_QuietFilter())
if not any(isinstance(h, _DefaultHandler) for h in logger.handlers):
    logger.addHandler(_DefaultHandler())


def announce_first_call(fn: Callable[..., Any], what: str = "train step") -> Callable[..., Any]:
    """Wrap a compiled ``fn`` so that its first call logs what it is doing.

    The first call logs ``COMPILING`` at INFO level before it runs, and the time it took after.
    Later calls go straight through.
    """
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
