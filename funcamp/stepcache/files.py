"""The files of ``cache_dir``: the sources an entry depends on, and the note of an unsaved step.

This module tells whether the sources changed. It also keeps the note that a step cannot be
saved. :mod:`funcamp.stepcache.cache` reads and writes both.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys

import torch

from funcamp._core.atomic import atomic_write
from funcamp.stepcache.key import UNSAVED_SUFFIX

__all__ = [
    "changed_file",
    "file_digest",
    "modified",
    "module_files",
    "note_unsaved",
    "unsaved_reason",
]


def note_unsaved(stem: str, why: str) -> None:
    """Record beside the entries that the step of ``stem`` cannot be saved, and why.

    ``stem`` is one key: the same code, versions, options and input shapes. A note that cannot
    be written is skipped; the next process finds out again.
    """
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)  # no entry made it yet
        atomic_write(stem + UNSAVED_SUFFIX, lambda f: f.write(why.encode("utf-8", "replace")))


def unsaved_reason(stem: str) -> str | None:
    """Why an earlier process could not save the step of ``stem``, or ``None``."""
    try:
        with open(stem + UNSAVED_SUFFIX, "rb") as f:
            return f.read(4000).decode("utf-8", "replace").strip() or "no reason recorded"
    except OSError:
        return None


def modified(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))

_SITE = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def module_files() -> list[tuple[str, str]]:
    """The source files of the Python modules loaded now, with three exceptions.

    The standard library and torch are pinned by version in the key. ``__main__`` is checked
    line by line where the step traced it. Code that runs while compiling without being traced
    is in one of these files (a kernel written in Python, a ``nonstrict_trace`` helper, a tensor
    subclass).
    """
    out = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name == "__main__" or not isinstance(path, str) or not path.endswith(".py"):
            continue
        path = os.path.abspath(path)
        if path.startswith(_TORCH_DIR + os.sep):
            continue
        if path.startswith(_STDLIB_DIR + os.sep) and not any(
            part in path[len(_STDLIB_DIR) :] for part in _SITE
        ):
            continue
        out.append((name, path))
    return sorted(out)


def file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def changed_file(files: list[tuple[str, str, str | None]]) -> str | None:
    for name, path, digest in files:
        if file_digest(path) != digest:
            return f"{name} ({path}) changed"
    return None
