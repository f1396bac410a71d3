"""The calls funcamp's training and casting code make into :mod:`funcamp.compiler`.

Light by design. The patch modules, and the inductor and dynamo internals they patch, are
imported here only when a compile needs them (``importlib``, once). Never at ``import funcamp``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from funcamp.compiler import gate

__all__ = ["inductor_options", "route_cross_entropy", "running"]


def _load(name: str) -> Any:
    """``funcamp.compiler.<name>``, imported on first use (it imports inductor's internals)."""
    return importlib.import_module(f"funcamp.compiler.{name}")


def inductor_options(on: bool, device_type: str | None, caller: dict[str, Any]) -> dict[str, Any]:
    """The inductor options a funcamp compile with the patches ``on`` adds to the caller's.

    ``caller`` holds the options given, which win over these. The additions are the
    channels-last pass for a CPU step (:class:`~funcamp.compiler.layouts.ChannelsLastConvBackward`).
    In ``post_grad_custom_pre_pass`` goes :class:`~funcamp.compiler.keys.PatchKey`, around the
    caller's own pass there, if any. It puts the patches' state in inductor's FX graph cache
    key. None while the patches are off: torch's compile as it is.
    """
    if not on:
        return {}
    options: dict[str, Any] = {}
    if device_type == "cpu":
        options["post_grad_custom_post_pass"] = _load("layouts").ChannelsLastConvBackward()
    options["post_grad_custom_pre_pass"] = _load("keys").PatchKey(
        caller.get("post_grad_custom_pre_pass")
    )
    return options


@contextlib.contextmanager
def running(on: bool, choice: gate.Choice = "auto") -> Iterator[None]:
    """The block a funcamp compiled call runs in.

    With inductor's patches ``on``, its CPU kernels are built in units
    (:func:`~funcamp.compiler.cpp_bundle.bundling`). Only live readers are stored before a
    write (:func:`~funcamp.compiler.dead_stores.skip_dead_stores`). Each has its environment
    switch (``FUNCAMP_CPP_BUNDLE=0``, ``FUNCAMP_DEAD_STORES=0``). The routing of in-graph
    ``CrossEntropyLoss`` follows the caller's ``choice``. ``"auto"`` takes the enclosing
    :func:`~funcamp.compiler.compiler_patches` block's, else the allowlist's releases. Off,
    inductor's code runs as it is.
    """
    with gate.compiler_patches(choice) if choice != "auto" else contextlib.nullcontext():
        if not on:
            yield
            return
        with _load("cpp_bundle").bundling(), _load("dead_stores").skip_dead_stores():
            yield


def route_cross_entropy(mode_class: type) -> None:
    """Route a ``CrossEntropyLoss`` built inside a traced function to ``mode_class``.

    ``mode_class`` is funcamp's amp mode. The routing applies when that mode is active in the
    trace (:mod:`funcamp.compiler.cross_entropy`). Called when :func:`funcamp.amp` wraps a
    function; it installs dynamo's patch once.
    """
    _load("cross_entropy").install(mode_class)
