"""Griffe extension for the docs build: read funcamp's ``Example:`` sections as examples.

funcamp's Google-style docstrings title their doctest sections ``Example:``; griffe only knows
``Examples:`` and would render the doctest as Markdown (where ``x["w"][0]`` looks like a link).
This renames the section before griffe parses the docstring, so it renders as a code block.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` to ``Examples:`` in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
