"""funcamp's compiler patches in inductor's FX graph cache key.

A graph inductor has compiled is cached under a key of the graph, the torch version and
inductor's config (the custom passes' ``uuid()`` among them). The state of code that patches
inductor's methods is not in the key. Without this, a graph lowered with
:mod:`~funcamp.compiler.dead_stores` on was loaded again with it off (``FUNCAMP_DEAD_STORES=0``).
A graph cached before a fix of a patch was loaded after it. :class:`PatchKey` is the
``post_grad_custom_pre_pass`` of funcamp's compiles while the patches are on. (torchao keys its
passes the same way.) It leaves the graph as it is. Its ``uuid`` is a digest of the patch
modules' files and of which patches are on for the compile being keyed.

Workaround of torch internals (docs/internals.md#workarounds):

- Root cause: inductor's FX graph cache keys a custom pass by its CustomGraphPass.uuid(); the
  class and get_hash_for_files live in torch._inductor.custom_graph_pass.
- Upstream: none filed.
- Why it is safe: it changes what a cached graph is filed under, never what is compiled.
- Tested on: torch 2.13 and 2.14.
- Delete when: the compiler patches it keys go (the compiler/ rows of docs/internals.md).

"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from funcamp.compiler import cpp_bundle, dead_stores

__all__ = ["PATCH_FILES", "PatchKey"]

_HERE = os.path.dirname(os.path.abspath(__file__))

#: The files whose contents enter the key: every module of this package.
PATCH_FILES = tuple(sorted(os.path.join(_HERE, f) for f in os.listdir(_HERE) if f.endswith(".py")))


def state() -> tuple[tuple[str, bool], ...]:
    """Which runtime patches are on for the compile in this thread (the key's second part)."""
    return (("cpp_bundle", cpp_bundle._ACTIVE.get()), ("dead_stores", dead_stores._ACTIVE.get()))


class PatchKey(CustomGraphPass):  # type: ignore[misc]
    """Inductor's ``post_grad_custom_pre_pass`` for funcamp's compiles.

    It runs ``inner`` (the caller's own pass there, if any) and nothing else. ``uuid`` keys the
    patches (see the module docstring). A caller's pass that cannot be keyed (no ``uuid``) keeps
    the graph out of the cache, as inductor itself does.
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> Any:
        """The digest of the patch files, which patches are on, and the caller's pass's own."""
        inner = None
        if self.inner is not None:
            inner = self.inner.uuid() if isinstance(self.inner, CustomGraphPass) else None
            if inner is None:
                return None
        try:
            digest = get_hash_for_files(PATCH_FILES).hex()
        except OSError:  # a patch file gone (an install changing under a running process)
            return None  # not cached, rather than cached under a key that may be stale
        return repr(("funcamp.compiler", digest, state(), inner))
