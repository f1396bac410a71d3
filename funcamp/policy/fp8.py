"""FP8 as plain data: :class:`Fp8Recipe` (how FP8 linears choose their scales) and the
configuration a policy stores (:class:`Fp8Config`: the recipe and which modules' linears run in
FP8). Imports only the standard library, torch and the ground floor, as torchao's
``float8/config.py`` does; the FP8 execution is in :mod:`funcamp.casting.fp8`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from funcamp._core.tree import describe
from funcamp.policy.modules import glob_match

__all__ = ["E4M3", "E5M2", "Fp8Config", "Fp8Recipe"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


# ------------------------------------------------------------------------------------ recipes
@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How FP8 linears choose their scales: ``current`` (per call) or ``delayed`` (from history).

    Build one with :meth:`current` or :meth:`delayed`. Forward operands (input and weight) are
    quantized to ``float8_e4m3fn`` and the output gradient to ``float8_e5m2`` (TransformerEngine's
    ``HYBRID`` format, torchao's default).

    Attributes:
        kind: ``"current"`` or ``"delayed"``.
        history: length of the amax history (delayed; 1 for current).
        margin: the scale is divided by ``2**margin`` (delayed; 0 for current).

    Example:
        >>> import funcamp
        >>> funcamp.Fp8Recipe.delayed(history=4)
        Fp8Recipe(kind='delayed', history=4, margin=0)
    """

    kind: str = "current"
    history: int = 1
    margin: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("current", "delayed"):
            raise ValueError(
                f"funcamp.Fp8Recipe: `kind` must be 'current' or 'delayed', got {self.kind!r}; "
                "use Fp8Recipe.current() or Fp8Recipe.delayed(...)"
            )
        for name, low in (("history", 1), ("margin", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(
                    f"funcamp.Fp8Recipe: `{name}` must be an int >= {low}, got {describe(value)}"
                )
        if self.kind == "current" and (self.history, self.margin) != (1, 0):
            raise ValueError(
                "funcamp.Fp8Recipe: `history` and `margin` only apply to delayed scaling; use "
                f"Fp8Recipe.delayed(history={self.history}, margin={self.margin})"
            )

    @classmethod
    def current(cls) -> Fp8Recipe:
        """Tensorwise dynamic scaling: each tensor's scale comes from its own amax, per call.

        Stateless (torchao's default): ``scale = fp8_max / max(amax, 1e-12)``.

        Example:
            >>> import funcamp
            >>> funcamp.Fp8Recipe.current().kind
            'current'
        """
        return cls("current")

    @classmethod
    def delayed(cls, history: int = 16, margin: int = 0) -> Fp8Recipe:
        """TransformerEngine's delayed scaling: scales from the max of the last ``history`` amaxes.

        ``scale = fp8_max / max(amax_history) / 2**margin``; the histories and scales are explicit
        state (:class:`Fp8State`), one entry per call site.

        Args:
            history: how many past amaxes each scale looks at (TransformerEngine's
                ``amax_history_len``), >= 1.
            margin: scales are divided by ``2**margin`` (headroom), >= 0.

        Example:
            >>> import funcamp
            >>> funcamp.Fp8Recipe.delayed(history=8, margin=1).margin
            1
        """
        return cls("delayed", history, margin)

    @property
    def stateful(self) -> bool:
        """Whether the recipe needs an :class:`Fp8State` (delayed scaling)."""
        return self.kind == "delayed"


def _check_keys(keys: Any, arg: str) -> tuple[Any, ...]:
    if isinstance(keys, (str, type)):
        keys = (keys,)
    if not isinstance(keys, Iterable):
        raise TypeError(
            f"funcamp.Policy.with_fp8: `{arg}` must be a tuple of nn.Module classes or "
            f"module-path globs, got {describe(keys)}"
        )
    keys = tuple(keys)
    for key in keys:
        ok = (isinstance(key, str) and key) or (
            isinstance(key, type) and issubclass(key, torch.nn.Module)
        )
        if not ok:
            raise TypeError(
                f"funcamp.Policy.with_fp8: `{arg}` entries must be torch.nn.Module subclasses or "
                f"non-empty module-path globs (e.g. torch.nn.Linear or 'layers.*.mlp.*'), got "
                f"{describe(key)}"
            )
    return keys


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """What :meth:`funcamp.Policy.with_fp8` stores as ``policy.fp8``: the recipe and which
    modules' linear and addmm calls run in FP8 (``modules`` match by class or path glob;
    ``exclude`` wins)."""

    recipe: Fp8Recipe
    modules: tuple[Any, ...] = (torch.nn.Linear,)
    exclude: tuple[Any, ...] = ()

    @classmethod
    def build(cls, recipe: Any, modules: Any, exclude: Any) -> Fp8Config:
        if not isinstance(recipe, Fp8Recipe):
            raise TypeError(
                "funcamp.Policy.with_fp8: `recipe` must be a funcamp.Fp8Recipe "
                f"(Fp8Recipe.current() or Fp8Recipe.delayed()), got {describe(recipe)}"
            )
        return cls(recipe, _check_keys(modules, "modules"), _check_keys(exclude, "exclude"))

    def matches(self, module: torch.nn.Module, path: str) -> bool:
        """Whether the linear and addmm calls of ``module`` (at ``path``) run in FP8."""
        return _hit(self.modules, module, path) and not _hit(self.exclude, module, path)

    def __repr__(self) -> str:
        names = lambda ks: "(" + ", ".join(getattr(k, "__name__", repr(k)) for k in ks) + ")"  # noqa: E731
        return (
            f"Fp8Config({self.recipe!r}, modules={names(self.modules)}, "
            f"exclude={names(self.exclude)})"
        )


def _hit(keys: tuple[Any, ...], module: torch.nn.Module, path: str) -> bool:
    for key in keys:
        if isinstance(key, str):
            if glob_match(path, key):
                return True
        elif isinstance(module, key):
            return True
    return False


# ------------------------------------------------------------------------------------- state
