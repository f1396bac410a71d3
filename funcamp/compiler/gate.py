"""The one gate of funcamp's compiler patches: which torch releases and devices they are on for.

A patch is on for a compile when it is chosen explicitly: ``compiler_patches=True`` of
:func:`funcamp.make_train_step` / :func:`funcamp.make_eval_step`, or a :func:`compiler_patches`
block. By default (``"auto"``) it is on when this torch release and the step's device are on
:data:`ALLOWLIST`. Those are the pairs on which funcamp's whole test suite has run with the
patches on. Elsewhere they are off, and the first compile that leaves them off says so (once per
release and device, on the ``"funcamp"`` logger). ``compiler_patches=False`` or
``compiler_patches(False)`` turns them off everywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any, Literal

from funcamp._core.progress import logger
from funcamp._core.version import torch_release as _torch_release

__all__ = [
    "ALLOWLIST",
    "Choice",
    "check_choice",
    "compiler_patches",
    "patches_on",
    "torch_release",
]

Choice = bool | Literal["auto"]

#: ``(torch release, device type)`` pairs on which the whole suite has run with the patches on.
ALLOWLIST: frozenset[tuple[str, str]] = frozenset({("2.13", "cpu"), ("2.14", "cpu")})

_CHOICE: contextvars.ContextVar[Choice] = contextvars.ContextVar(
    "funcamp_compiler_patches", default="auto"
)
_SAID: set[tuple[str, str]] = set()
_SAID_LOCK = threading.Lock()


def torch_release() -> str:
    """This torch's release as :data:`ALLOWLIST` names it: ``"major.minor"``.

    For example ``"2.13"`` for ``2.13.0+cpu``.

    Example:
        >>> from funcamp.compiler import torch_release
        >>> torch_release().count(".")
        1
    """
    return _torch_release()


def check_choice(api: str, choice: Any) -> Choice:
    """``choice`` if it is ``"auto"``, ``True`` or ``False``; else a TypeError naming ``api``."""
    if choice == "auto" or isinstance(choice, bool):
        return choice  # type: ignore[no-any-return]
    raise TypeError(
        f"funcamp.{api}: `compiler_patches` must be 'auto', True or False, got {choice!r}"
    )


def patches_on(choice: Choice, device_type: str | None) -> bool:
    """Whether the patches are on for a compile on ``device_type`` given ``choice``.

    An explicit ``True``/``False`` wins. ``"auto"`` takes the innermost :func:`compiler_patches`
    block's choice. Without one, it is on only for an :data:`ALLOWLIST` pair (off elsewhere,
    said once).

    Example:
        >>> from funcamp.compiler import compiler_patches, patches_on
        >>> patches_on(True, "cuda"), patches_on(False, "cpu")
        (True, False)
        >>> with compiler_patches(False):
        ...     patches_on("auto", "cpu")
        False
    """
    if choice == "auto":
        choice = _CHOICE.get()
    if choice != "auto":
        return bool(choice)
    pair = (torch_release(), device_type or "unknown")
    if pair in ALLOWLIST:
        return True
    with _SAID_LOCK:
        first = pair not in _SAID
        _SAID.add(pair)
    if first:
        logger.info(
            "funcamp: compiler patches off for torch %s on %s (not on the allowlist %s, where "
            "the test suite ran with them); compiler_patches=True or "
            "funcamp.compiler.compiler_patches(True) turns them on",
            *pair,
            sorted(ALLOWLIST),
        )
    return False


@contextlib.contextmanager
def compiler_patches(enabled: Choice = True) -> Iterator[None]:
    """Choose funcamp's compiler patches for the compiles this block starts in this thread.

    A task (asyncio) counts as a thread here.

    ``True`` turns them on whatever the torch release and device, and ``False`` off. ``"auto"``
    follows the allowlist. A step's own ``compiler_patches=True``/``False`` wins over the block.
    A ``torch.compile`` of your own :func:`funcamp.amp` function follows it too. (It decides the
    routing of a ``CrossEntropyLoss`` built inside the traced function to the amp mode.)

    Example:
        >>> import torch, funcamp
        >>> step = funcamp.make_train_step(lambda p, b, x: (x @ p["w"]).sum(), funcamp.sgd(0.1),
        ...     "float32", compile=funcamp.Compile(backend="eager"))
        >>> state = funcamp.TrainState.create({"w": torch.ones(2)}, funcamp.sgd(0.1), "float32")
        >>> with funcamp.compiler.compiler_patches(False):  # torch's compiler, untouched
        ...     state, metrics = step(state, torch.ones(3, 2))
        >>> state.params["w"]
        tensor([0.7000, 0.7000])
    """
    token = _CHOICE.set(check_choice("compiler.compiler_patches", enabled))
    try:
        yield
    finally:
        _CHOICE.reset(token)
