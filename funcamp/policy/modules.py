"""Matching modules by module path: the one glob matcher of module policies and FP8 selections."""

from __future__ import annotations

import fnmatch

from funcamp._core.context import constant_result

__all__ = ["glob_match"]


@constant_result
def glob_match(path: str, pattern: str) -> bool:
    """Whether the module path ``path`` (``"layers.0.mlp"``) matches the glob ``pattern``.

    fnmatch's pattern compiler calls ``object()``, which dynamo cannot trace; paths and patterns
    are Python strings, so under ``torch.compile`` the match is a constant of the trace."""
    return fnmatch.fnmatchcase(path, pattern)
