"""How a step is compiled, as one frozen value, and every rule for what does not combine.

:class:`Compile` follows torchao's config pattern. The options of ``torch.compile`` and
funcamp's own (the step cache, guards, compiler patches) travel as one immutable value. So the
step builders take ``compile=False | True | Compile(...)`` instead of a dozen keywords.
:func:`check_combinations` is the one place that refuses options which cannot go together.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from funcamp._core.checks import check_flag
from funcamp._core.tree import describe
from funcamp.compiler.gate import check_choice

__all__ = [
    "Compile",
    "check_combinations",
    "check_compile",
    "new_spelling",
    "resolve_compile",
    "unchecked",
]

_TORCH_FIELDS = ("backend", "mode", "fullgraph", "dynamic", "options", "guard_filter_fn")
_FUNCAMP_FIELDS = ("cache_dir", "specialize", "compiler_patches")


@dataclasses.dataclass(frozen=True)
class Compile:
    """How a train or eval step is compiled.

    ``compile=True`` is ``Compile()``: inductor, one graph, every dynamo guard kept.

    Attributes:
        backend, mode, fullgraph, dynamic, options: as for ``torch.compile``.
            ``fullgraph=False`` compiles a loss with graph breaks in pieces.
        guard_filter_fn: dynamo's guard filter (``torch.compile``'s ``options``).
        cache_dir: a directory that keeps the compiled step on disk for later processes.
            See the warm-starts guide.
        specialize: keep only the guards on the step's inputs, as ``jax.jit`` does. A value
            the loss reads from a closure or a module is then fixed at the first call.
        compiler_patches: funcamp's changes to inductor (:mod:`funcamp.compiler`).
            ``"auto"`` turns them on where the test suite ran with them.

    Example:
        >>> import funcamp
        >>> funcamp.Compile(backend="aot_eager", specialize=True).specialize
        True
        >>> funcamp.Compile(specialize=True, guard_filter_fn=lambda guards: [True] * len(guards))
        Traceback (most recent call last):
        ...
        ValueError: funcamp.Compile: give `specialize=True` or a `guard_filter_fn`, not both: ...
    """

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    fullgraph: bool = True
    dynamic: bool | None = None
    options: Mapping[str, Any] | None = None
    guard_filter_fn: Callable[..., Any] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    specialize: bool = False
    compiler_patches: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        check_compile("Compile", self)

    def torch_options(self) -> dict[str, Any]:
        """The ``torch.compile`` keywords this value sets (those left at their default are
        left out)."""
        out = {}
        for name in _TORCH_FIELDS:
            value = getattr(self, name)
            if value != _DEFAULTS[name]:
                out[name] = dict(value) if name == "options" else value
        return out


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Compile)}


def unchecked(**fields: Any) -> Compile:
    """A :class:`Compile` built without its checks, for a caller that runs
    :func:`check_combinations` itself (under its own API name)."""
    cfg = object.__new__(Compile)
    for name, value in {**_DEFAULTS, **fields}.items():
        object.__setattr__(cfg, name, value)
    return cfg


def check_compile(api: str, cfg: Compile) -> None:
    """The fields' types, then :func:`check_combinations`."""
    check_flag(api, "fullgraph", cfg.fullgraph)
    check_flag(api, "specialize", cfg.specialize)
    check_choice(api, cfg.compiler_patches)
    if cfg.options is not None and not isinstance(cfg.options, Mapping):
        raise TypeError(
            f"funcamp.{api}: `options` must be a dict of inductor options or None, got "
            f"{describe(cfg.options)}"
        )
    check_combinations(api, cfg)


def _guard_filter_given(cfg: Compile) -> bool:
    return cfg.guard_filter_fn is not None or "guard_filter_fn" in (cfg.options or {})


def check_combinations(
    api: str,
    cfg: Compile | None,
    *,
    parallel: Any = None,
    headroom: Any = False,
    delayed_fp8: bool = False,
    donate_state: bool = True,
) -> None:
    """Refuse what does not combine: the one place for these rules.

    ``cfg`` None is an eager step. ``parallel`` is the piece that spreads the step over
    processes.
    """
    if cfg is not None and cfg.specialize and _guard_filter_given(cfg):
        raise ValueError(
            f"funcamp.{api}: give `specialize=True` or a `guard_filter_fn`, not both: both "
            "choose which of dynamo's guards the step keeps"
        )
    if cfg is not None and cfg.specialize and cfg.mode is not None and cfg.backend != "inductor":
        raise ValueError(
            f"funcamp.{api}: `specialize=True` with mode={cfg.mode!r} needs inductor: "
            f"torch.compile gives backend {describe(cfg.backend)} a mode or options, not both, "
            "and the guard filter travels in options; drop `mode` or `specialize`"
        )
    if cfg is not None and cfg.cache_dir is not None:
        if not cfg.fullgraph:
            raise ValueError(
                f"funcamp.{api}: `cache_dir` saves the step as one compiled graph; a step "
                "compiled in pieces (fullgraph=False) cannot be saved: drop one of the two"
            )
        if _guard_filter_given(cfg):
            raise ValueError(
                f"funcamp.{api}: `cache_dir` and `guard_filter_fn` do not go together: a saved "
                "step checks its inputs' tensors on every call and everything else it depends "
                "on when it is loaded, whatever a guard filter would keep; drop one of the two"
            )
        if not isinstance(cfg.backend, str):
            raise ValueError(
                f"funcamp.{api}: `cache_dir` needs the compile backend by name (such as "
                f"'inductor' or 'aot_eager'), got {describe(cfg.backend)}: a backend object "
                "cannot be told apart from another across processes"
            )
    if parallel is None:
        return
    asked = {
        "donate_state": donate_state,
        "headroom": headroom is not False,
        "a delayed FP8 recipe": delayed_fp8,
        "cache_dir": cfg is not None and cfg.cache_dir is not None,
    }
    for option, on in asked.items():
        if on and option in parallel.refuses:
            raise ValueError(
                f"funcamp.{api}: {option} does not compose with {parallel.name}: "
                f"{parallel.refuses[option]}"
            )


def resolve_compile(api: str, compile: Any, legacy: dict[str, Any]) -> Compile | None:
    """``compile=`` as a :class:`Compile` (None: eager), with the keywords of the old spelling
    (``cache_dir=``, ``specialize=``, ``backend=``, ...) folded in. The caller warns."""
    if compile is True:
        cfg = Compile()
    elif compile is False:
        cfg = None
    elif isinstance(compile, Compile):
        cfg = compile
    else:
        raise TypeError(
            f"funcamp.{api}: `compile` must be True, False or a funcamp.Compile(...), got "
            f"{describe(compile)}"
        )
    unknown = sorted(set(legacy) - set(_TORCH_FIELDS) - set(_FUNCAMP_FIELDS))
    if unknown:
        raise TypeError(f"funcamp.{api}: unexpected keyword argument(s) {unknown}")
    if not legacy:
        return cfg
    if cfg is None:
        if legacy.get("specialize"):
            raise ValueError(
                f"funcamp.{api}: specialize=True fixes what a compiled step reads besides its "
                "inputs at its first call, but compile=False builds an eager step, which reads "
                "them on every call; drop `specialize` or compile the step"
            )
        if legacy.get("cache_dir") is not None:
            raise ValueError(
                f"funcamp.{api}: `cache_dir` keeps the compiled step on disk, but compile=False "
                "builds an eager step; drop `cache_dir` or compile the step"
            )
        torch_given = sorted(k for k in legacy if k in _TORCH_FIELDS)
        if torch_given:
            raise TypeError(
                f"funcamp.{api}: compile options {torch_given} must not be given with compile=False"
            )
        return None
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    merged = unchecked(**{**fields, **legacy})
    check_compile(api, merged)
    return merged


def new_spelling(legacy: dict[str, Any], parallel: str | None = None) -> str:
    """How the old keywords read in the new spelling, for the deprecation warning."""
    parts = [f"{k}={v!r}" for k, v in legacy.items() if k in _TORCH_FIELDS + _FUNCAMP_FIELDS]
    out = []
    if parallel is not None:
        out.append(f"parallel={parallel}")
    if parts:
        out.append(f"compile=funcamp.Compile({', '.join(parts)})")
    return ", ".join(out)
