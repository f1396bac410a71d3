"""The one wrapper every train step runs in, and the checks of its options and calls.

:func:`wrap_step` wraps the train step, for one process, data parallel or sharded alike. It
holds:

* the first-call and per-call checks;
* the parallel piece's view of the state;
* the compile notice;
* the compiled (or eager) call through :func:`funcamp.train.compiling.run_compiled`;
* the on-disk step cache (``cache_dir``: :mod:`funcamp.stepcache`). It is imported only when a
  step is built with it, since it imports dynamo's internals and ``import funcamp`` does not.

What becomes of a donated state is recorded here, in :mod:`funcamp._core.donation`. A state is
marked before the step's first write, and donated once the step returned.
:func:`check_not_donated` refuses it when it comes back. The checks of ``specialize`` and
``cache_dir`` that ``make_train_step`` and ``make_eval_step`` share live here too.
"""

from __future__ import annotations

import gc
import importlib
import os
import types
import warnings
from collections.abc import Callable
from typing import Any

import optree

from funcamp._core import donation
from funcamp._core.donation import refuse_consumed
from funcamp._core.progress import announce_first_call
from funcamp._core.tree import NAMESPACE, describe
from funcamp.policy.policy import Policy
from funcamp.train.compiling import (
    NO_PATCHES,
    compile_fn,
    fresh_code,
    patches_for,
    run_compiled,
    state_device_type,
)
from funcamp.train.config import Compile
from funcamp.train.loss import GradMethod, clone_buffers
from funcamp.train.parallel import SingleProcess
from funcamp.train.pieces import Halves, Pieces, in_pieces
from funcamp.train.state import (
    TrainState,
    check_donation,
    check_overlap,
    check_train_state,
)

__all__ = [
    "check_cache_dir",
    "check_not_donated",
    "wrap_step",
]


def _stepcache(module: str) -> types.ModuleType:
    """``funcamp.stepcache.<module>``, imported when a step is built with ``cache_dir=``: the
    step cache imports dynamo's internals, which ``import funcamp`` does not."""
    return importlib.import_module(f"funcamp.stepcache.{module}")


def check_cache_dir(api: str, cache_dir: Any) -> str | None:
    """``cache_dir`` as a path, or None when unset.

    It is also None when this torch cannot save steps. A warning then says so, and the step
    compiles as usual.
    """
    if cache_dir is None:
        return None
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(
            f"funcamp.{api}: `cache_dir` must be a directory path (str or os.PathLike) or "
            f"None, got {describe(cache_dir)}"
        )
    path = os.fspath(cache_dir)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"funcamp.{api}: `cache_dir` must be a directory, but {path!r} is a file; give "
            "a directory (it is created if missing)"
        )
    why = _stepcache("key").cache_support()
    if why is not None:
        warnings.warn(
            f"funcamp.{api}: `cache_dir` is ignored: {why}; the step compiles as usual "
            "(torch's compile caches still apply)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return path


def check_not_donated(api: str, state: TrainState) -> None:
    """Refuse a state an earlier call donated (``donate_state=True``, the default).

    Also refuse one whose donated step raised after its first write
    (:mod:`funcamp._core.donation`).
    """
    refuse_consumed(api, state.scaler)


def _checked_call(
    api: str,
    state: Any,
    batch: Any,
    parallel: SingleProcess,
    optimizer: Any,
    expected: list[Any],
    donate_state: bool,
    policy: Policy | None,
    settings: dict[str, Any],
) -> TrainState:
    """The checks of every call of a train step; returns the state the step works on (the
    parallel piece's view). ``expected`` holds the first batch's structure once known. On the
    first call the ranks agree on ``settings`` (:meth:`SingleProcess.agree`)."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"funcamp.{api}: `state` must be a funcamp.TrainState (see "
            f"TrainState.create), got {describe(state)}"
        )
    check_not_donated(api, state)
    local = parallel.local(api, state)
    structure = optree.tree_structure(batch, namespace=NAMESPACE)
    first = not expected
    if first:
        check_train_state(api, local, optimizer, policy)
    elif structure != expected[0]:
        raise ValueError(
            f"funcamp.{api}: `batch` must keep the structure of the first batch "
            f"{expected[0]}, got {structure}; build another step for batches of another "
            "structure (new shapes or dtypes only recompile)"
        )
    if donate_state:
        check_donation(api, local)
        if donation.status(state.scaler) is None:  # once per state: a returned one is checked
            check_overlap(api, local)
    if first:  # the ranks agree, and start from rank 0's state (a refused call: again next time)
        local = parallel.agree(api, local, settings, donate_state)
        expected.append(structure)
    return local


def _compiled_marks(key: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(begin, undo)`` for :func:`run_compiled`: mark the state before the compiled call (its
    writes run inside the graph); undo it when a trace fails, before the graph runs (nothing
    written). A step in pieces writes only in its update, which is one graph too."""
    previous = donation.status(key)
    return lambda: donation.begin(key), lambda: donation.restore(key, previous)


_IN_PIECES = (
    "the step compiles the loss in pieces around it (gradients by torch.autograd) and the "
    "update as one graph"
)


class _Compiled:
    """The compiled train step of one :func:`wrap_step`, built on the first call (when the
    state's device is known: :func:`step_options_for`): whole, cached, or in pieces
    (:mod:`funcamp.train.pieces`)."""

    def __init__(
        self,
        api: str,
        train_step: Callable[..., Any],
        halves: Halves,
        cfg: Compile,
        cache: tuple[str, Callable[..., Any], tuple[Any, ...]] | None,
        grad_method: GradMethod,
    ) -> None:
        self.train_step, self.halves, self.cfg, self.cache = train_step, halves, cfg, cache
        self.grad_method = grad_method
        unsaved = "; it is not saved in cache_dir" if cache is not None else ""
        self.pieces = Pieces(api, cfg.fullgraph, _IN_PIECES + unsaved)
        self.options = cfg.torch_options()
        self.run: Callable[..., Any] | None = None
        self.patches = NO_PATCHES
        self.device_type: str | None = None
        self.eager_casts = False

    def build(self, device_type: str, eager_casts: bool) -> Callable[..., Any]:
        self.patches = patches_for(self.cfg.compiler_patches, device_type, self.options)
        self.device_type, self.eager_casts = device_type, eager_casts
        self.run = self._in_pieces() if self.pieces.split else self._whole()
        return self.run

    def _compile(self, options: dict[str, Any], specialize: bool) -> Callable[..., Any]:
        return compile_fn(
            self.train_step,
            options,
            self.device_type,
            specialize=specialize,
            patches=self.patches.on,
            eager_casts=self.eager_casts,
        )

    def _whole(self) -> Callable[..., Any]:
        compiled = announce_first_call(self._compile(self.options, self.cfg.specialize))
        if self.cache is None:
            return compiled
        directory, loss_fn, settings = self.cache
        return _stepcache("cache").CachedStep(
            self.train_step,
            lambda keep: self._compile({**self.options, "guard_filter_fn": keep}, False),
            compiled,
            directory,
            loss_fn,
            _stepcache("key").describe_settings(settings),
            self.options,  # the device's options are in the key already: its tensors' device
            specialize=self.cfg.specialize,
        )

    def _in_pieces(self) -> Callable[..., Any]:
        self.grad_method.pieces = True  # the forward runs in Python: torch.autograd's grads
        return in_pieces(
            self.halves,
            self.options,
            self.device_type,
            specialize=self.cfg.specialize,
            patches=self.patches.on,
            eager_casts=self.eager_casts,
        )

    def switch(self, error: BaseException) -> Callable[..., Any] | None:
        """For :func:`run_compiled`: the step in pieces after a graph break, if it calls for it."""
        run = self.pieces.switch(error, self._in_pieces)
        if run is not None:
            self.run = run
        return run


def wrap_step(
    api: str,
    train_step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]],
    *,
    halves: Halves,
    optimizer: Any,
    parallel: SingleProcess,
    grad_method: GradMethod,
    cfg: Compile | None,
    donate_state: bool,
    cache: tuple[str, Callable[..., Any], tuple[Any, ...]] | None = None,
    eager_casts: bool = False,
    policy: Policy | None = None,
    settings: dict[str, Any] | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """``step(state, batch)``: ``train_step`` compiled (or eager), as every funcamp train step runs.

    This holds for one process, data parallel or sharded alike. On every call, ``state`` must be
    a :class:`TrainState`. The parallel piece gives the state the compiled step works on, and
    takes the new one back. The batch keeps the first batch's structure. A donated state shares
    no memory. On the first call the optimizer state is checked against the params. The state
    is checked against ``policy``: its param dtypes and scaler kind (:func:`check_fits_policy`).

    ``cfg`` says how to compile (None: eager); ``halves`` are ``train_step``'s two parts, for a
    step in pieces. ``cache``, ``(directory, loss_fn, settings)``, keeps the compiled step on
    disk (:class:`funcamp.stepcache.cache.CachedStep`). ``settings``, what the step was built
    with, enter its key. ``eager_casts`` says the policy rounds to float16, bfloat16 or FP8
    (:func:`funcamp.train.compiling.rounds_casts`). A state with a loss scaler (not ``noop``)
    asks for the same inductor options (:func:`step_options_for`), since its found-inf must be
    eager code's. ``settings`` (``{"policy": ..., "optimizer": ..., "options": ...}``) is what
    the ranks of a parallel step agree on, on its first call.
    """
    train_step.__code__ = fresh_code(train_step.__code__)
    compiled = None if cfg is None else _Compiled(api, train_step, halves, cfg, cache, grad_method)
    expected: list[Any] = []
    agreed = {"policy": policy, "optimizer": optimizer} if settings is None else settings

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        local = _checked_call(
            api, state, batch, parallel, optimizer, expected, donate_state, policy, agreed
        )
        key = state.scaler
        try:
            if compiled is None:
                if donate_state:  # marked at the first write (a loss_fn that raises: intact)
                    donation.arm(key)
                new, metrics = train_step(local, batch)
            else:
                run = compiled.run or compiled.build(
                    state_device_type(local), eager_casts or local.scaler.kind != "noop"
                )
                # A failed trace re-runs the step eagerly, only for the error message: a donated
                # state on copies (made then: a failed trace wrote nothing, and copying the whole
                # state on every call would cost a sizeable part of a small step).
                new, metrics = run_compiled(
                    api,
                    run,
                    (local, batch),
                    lambda: train_step(clone_buffers(local) if donate_state else local, batch),
                    grad_method,
                    first=len(expected) == 1,
                    patches=compiled.patches,
                    marks=_compiled_marks(key) if donate_state else None,
                    pieces=compiled.switch,
                )
                if len(expected) == 1:  # the first compiled call: free what its trace holds
                    expected.append("compiled")
                    gc.collect()
        except BaseException as e:
            if donate_state:
                donation.arm(None)
                donation.failed(key, e)
            raise
        out = parallel.wrap(new._replace(frozen=local.frozen))
        if donate_state:
            donation.arm(None)
            donation.set_status(key, donation.DONATED)
            donation.set_status(out.scaler, donation.CHECKED)
        return out, metrics

    step.train_step = train_step  # type: ignore[attr-defined]
    return step
