"""How a step is built, as frozen values, and every rule for what does not combine.

Each option is declared once, as a field of a frozen dataclass, with its check and whether it
enters the step cache's key (:func:`meta`):

* :class:`Compile` says how a step is compiled (torchao's config pattern): ``torch.compile``'s
  options and funcamp's own (the step cache, guards, compiler patches) as one immutable value;
* :class:`StepOptions` holds ``make_train_step``'s keyword options. Its fields are the
  builder's keywords, in order (``tests/test_front_door.py`` holds them equal).

:func:`check_options` runs every field's check, then :func:`check_combinations`, the one place
that refuses options which cannot go together. :func:`key_items` lists what enters the key.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any, Literal

import torch

from funcamp._core.checks import check_flag
from funcamp._core.tree import describe
from funcamp.compiler.gate import check_choice
from funcamp.train.parallel import SingleProcess

__all__ = [
    "Compile",
    "StepOptions",
    "as_compile",
    "build",
    "check_combinations",
    "check_options",
    "compile_config",
    "key_items",
    "meta",
]

Check = Callable[[str, str, Any], Any]


def meta(check: Check, not_in_key: str | None = None) -> dict[str, Any]:
    """A field's declaration besides its default (``field(default=..., metadata=meta(...))``):
    its check ``check(api, name, value)`` and, for a field left out of the step cache's key,
    why (``not_in_key``)."""
    return {"check": check, "not_in_key": not_in_key}


def _one_of(*allowed: Any, text: str) -> Check:
    def check(api: str, name: str, value: Any) -> None:
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            raise TypeError(f"funcamp.{api}: `{name}` must be {text}, got {describe(value)}")

    return check


def _instance(types: tuple[type, ...], text: str) -> Check:
    def check(api: str, name: str, value: Any) -> None:
        if not isinstance(value, types):
            raise TypeError(f"funcamp.{api}: `{name}` must be {text}, got {describe(value)}")

    return check


def _backend(api: str, name: str, value: Any) -> None:
    if not (isinstance(value, str) or callable(value)):
        raise TypeError(
            f"funcamp.{api}: `backend` must be a torch.compile backend name or callable, got "
            f"{describe(value)}"
        )


def _optional_callable(api: str, name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"funcamp.{api}: `{name}` must be callable or None, got {describe(value)}")


def _patches(api: str, name: str, value: Any) -> None:
    check_choice(api, value)


def _headroom(api: str, name: str, value: Any) -> None:
    if not (isinstance(value, bool) or callable(value)):
        raise TypeError(
            f"funcamp.{api}: `headroom` must be a bool or a callable of the leaf path, got "
            f"{describe(value)}"
        )


def _parallel(api: str, name: str, value: Any) -> None:
    if value is not None and not isinstance(value, SingleProcess):
        raise TypeError(
            f"funcamp.{api}: `parallel` must be funcamp.distributed.DataParallel(group), "
            f"Sharded(mesh) or None, got {describe(value)}"
        )


def _compile(api: str, name: str, value: Any) -> None:
    if not isinstance(value, (bool, Compile)):
        raise TypeError(
            f"funcamp.{api}: `compile` must be True, False or a funcamp.Compile(...), got "
            f"{describe(value)}"
        )


_MODE = _instance((str, type(None)), "a torch.compile mode or None")
_FULLGRAPH = _one_of("auto", True, False, text="'auto', True or False")
_DYNAMIC = _one_of(None, True, False, text="True, False or None")
_OPTIONS = _instance((Mapping, type(None)), "a dict of inductor options or None")
_PATH = _instance((str, os.PathLike, type(None)), "a directory path (str or os.PathLike) or None")


@dataclasses.dataclass(frozen=True)
class Compile:
    """How a train or eval step is compiled.

    ``compile=True`` is ``Compile()``: inductor, one graph where the loss allows it, every
    dynamo guard kept.

    Attributes:
        backend, mode, dynamic, options: as for ``torch.compile``. ``options`` are inductor's;
            ``{"fallback_random": True}`` makes compiled dropout draw eager code's masks.
        fullgraph: ``"auto"`` (default) compiles the step as one graph; where ``loss_fn``
            cannot be one (an RNN module, a branch on a tensor's value), it compiles the loss
            in pieces with gradients from torch.autograd, keeps the update one graph, and says
            once on stderr where the graph broke. ``True`` refuses such a loss with the reason;
            ``False`` compiles in pieces from the start.
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

    backend: str | Callable[..., Any] = field(default="inductor", metadata=meta(_backend))
    mode: str | None = field(default=None, metadata=meta(_MODE))
    fullgraph: bool | Literal["auto"] = field(default="auto", metadata=meta(_FULLGRAPH))
    dynamic: bool | None = field(default=None, metadata=meta(_DYNAMIC))
    options: Mapping[str, Any] | None = field(default=None, metadata=meta(_OPTIONS))
    guard_filter_fn: Callable[..., Any] | None = field(
        default=None, metadata=meta(_optional_callable)
    )
    cache_dir: str | os.PathLike[str] | None = field(
        default=None,
        metadata=meta(_PATH, not_in_key="where the entry is kept, not what it holds"),
    )
    specialize: bool = field(
        default=False,
        metadata=meta(
            check_flag, not_in_key="it says how a loaded entry is checked, not what it holds"
        ),
    )
    compiler_patches: bool | Literal["auto"] = field(default="auto", metadata=meta(_patches))

    def __post_init__(self) -> None:
        check_options("Compile", self)

    def torch_options(self) -> dict[str, Any]:
        """The ``torch.compile`` keywords this value sets (those left at their default are
        left out; ``fullgraph`` is the step's business: :func:`funcamp.train.compiling.compile_fn`
        is told it per piece)."""
        out = {}
        for name in _TORCH_FIELDS:
            value = getattr(self, name)
            if value != _DEFAULTS[name]:
                out[name] = dict(value) if name == "options" else value
        return out


_TORCH_FIELDS = ("backend", "mode", "dynamic", "options", "guard_filter_fn")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Compile)}


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """``make_train_step``'s keyword options, one field each (the Args of its docstring).

    A new option is a field here (its default, its check, whether it enters the step cache's
    key), the same keyword on ``make_train_step``, and its use in the step.
    """

    has_aux: bool = field(default=False, metadata=meta(check_flag))
    returns_buffers: bool = field(default=False, metadata=meta(check_flag))
    donate_state: bool = field(default=True, metadata=meta(check_flag))
    grad_norm: bool = field(default=True, metadata=meta(check_flag))
    skip_if: Callable[[dict[str, Any]], torch.Tensor] | None = field(
        default=None, metadata=meta(_optional_callable)
    )
    headroom: bool | Callable[[str], bool] = field(default=False, metadata=meta(_headroom))
    parallel: SingleProcess | None = field(
        default=None, metadata=meta(_parallel, not_in_key="every parallel piece refuses cache_dir")
    )
    compile: bool | Compile = field(default=True, metadata=meta(_compile))

    def __post_init__(self) -> None:
        check_options("StepOptions", self)

    @property
    def compiled(self) -> Compile | None:
        """``compile`` as a :class:`Compile` (None: an eager step)."""
        return as_compile(self.compile)


def as_compile(compile: bool | Compile) -> Compile | None:
    """``compile=`` (checked) as a :class:`Compile`; None for an eager step."""
    if compile is True:
        return Compile()
    return None if compile is False else compile  # type: ignore[return-value]


def compile_config(api: str, compile: Any) -> Compile | None:
    """``compile=`` checked (``funcamp.<api>: `compile` must be ...``), as :func:`as_compile`."""
    _compile(api, "compile", compile)
    if isinstance(compile, Compile):
        check_combinations(api, compile)
    return as_compile(compile)


def build(cls: type, api: str, values: Mapping[str, Any], *, delayed_fp8: bool = False) -> Any:
    """``cls(**values)``, with its checks in ``api``'s name (``funcamp.make_train_step: ...``).

    ``values`` may hold other names (a builder's ``locals()``); only the fields are read.
    """
    value = object.__new__(cls)
    for f in dataclasses.fields(cls):
        object.__setattr__(value, f.name, values.get(f.name, f.default))
    check_options(api, value, delayed_fp8=delayed_fp8)
    return value


def check_options(api: str, value: Any, *, delayed_fp8: bool = False) -> None:
    """Every field's declared check, then :func:`check_combinations` (``delayed_fp8``: the
    step's policy has a delayed FP8 recipe)."""
    for f in dataclasses.fields(value):
        f.metadata["check"](api, f.name, getattr(value, f.name))
    if isinstance(value, StepOptions):
        check_combinations(
            api,
            value.compiled,
            parallel=value.parallel,
            headroom=value.headroom,
            delayed_fp8=delayed_fp8,
            donate_state=value.donate_state,
            skip_if=value.skip_if,
            grad_norm=value.grad_norm,
        )
    else:
        check_combinations(api, value)


def key_items(value: Any) -> tuple[tuple[str, Any], ...]:
    """``(name, value)`` of every field of ``value`` that enters the step cache's key (a
    :class:`Compile` among them by its own fields); the others say why not
    (``not_in_key``)."""
    items: list[tuple[str, Any]] = []
    for f in dataclasses.fields(value):
        if f.metadata["not_in_key"] is not None:
            continue
        v = getattr(value, f.name)
        if f.name == "compile":
            v = as_compile(v)
            v = None if v is None else key_items(v)
        items.append((f.name, v))
    return tuple(items)


def _guard_filter_given(cfg: Compile) -> bool:
    return cfg.guard_filter_fn is not None or "guard_filter_fn" in (cfg.options or {})


def _check_cache_dir(api: str, cfg: Compile) -> None:
    if cfg.fullgraph is False:
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


def check_combinations(
    api: str,
    cfg: Compile | None,
    *,
    parallel: Any = None,
    headroom: Any = False,
    delayed_fp8: bool = False,
    donate_state: bool = True,
    skip_if: Any = None,
    grad_norm: bool = True,
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
        _check_cache_dir(api, cfg)
    if skip_if is not None and not grad_norm:
        raise ValueError(
            f"funcamp.{api}: `skip_if` is asked with the step's metrics, whose `grad_norm` "
            "grad_norm=False leaves out; drop one of the two"
        )
    if parallel is None:
        return
    asked = {
        "donate_state": donate_state,
        "headroom": headroom is not False,
        "a delayed FP8 recipe": delayed_fp8,
        "cache_dir": cfg is not None and cfg.cache_dir is not None,
    }
    for option_name, on in asked.items():
        if on and option_name in parallel.refuses:
            raise ValueError(
                f"funcamp.{api}: {option_name} does not compose with {parallel.name}: "
                f"{parallel.refuses[option_name]}"
            )
