"""A value on top of a module's stack while a ``with`` block runs."""

from __future__ import annotations

from typing import Any

__all__ = ["Pushing"]


class Pushing:
    """``with Pushing(stack, item): ...`` puts ``item`` on top of ``stack`` inside the block;
    ``None`` changes nothing. The reader looks at ``stack[-1]`` (the innermost block's)."""

    def __init__(self, stack: list[Any], item: Any) -> None:
        self.stack = stack
        self.item = item

    def __enter__(self) -> None:
        if self.item is not None:
            self.stack.append(self.item)

    def __exit__(self, *exc: Any) -> None:
        if self.item is not None:
            self.stack.pop()
