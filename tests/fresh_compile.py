"""Compiles lowered afresh: no FX graph or AOTAutograd cache hit skips inductor's lowering
(tests of what funcamp's compiler patches do while lowering)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def fresh_inductor() -> Iterator[None]:
    """Every compile lowered afresh (no FX graph or AOTAutograd cache hit skips lowering)."""
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield
