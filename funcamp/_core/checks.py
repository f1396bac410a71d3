"""Input validation shared by the optimizers, the scaler and the train step.

Every check here reads metadata only (types, shapes, dtypes) unless its name says it reads
values (``*_values``: build or load time, never on the step path). Errors have the form
``funcamp.<api>: `arg` must be ..., got ...`` and name the pytree leaf path.

Learning rates
--------------
A learning rate is a Python float, a 0-d floating tensor or a schedule ``count -> lr``. A float
or a tensor is checked when the optimizer is built; a tensor may be changed in place later. A
schedule is probed once when the optimizer is built, with the count
``torch.zeros((), dtype=torch.int32)``. It must return a 0-d floating tensor whose value is
finite and >= 0. A schedule that raises, or returns anything else, is refused there. On the step
path each value a schedule returns is checked again for its type and shape (metadata, no host
sync).

A tensor's *value* can only be known on the device. A tensor learning rate that is NaN, infinite
or negative at run time is replaced by 0 inside ``update``, so the params do not move.
:func:`funcamp.unscale_and_step` and :func:`funcamp.make_train_step` treat that step as skipped
(``found_inf`` is True). Params and optimizer state are kept bit-identical, the ``skipped``
counter counts it, and a dynamic scaler backs off as for an overflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

import optree
import torch

from funcamp._core.context import compiling
from funcamp._core.tree import NAMESPACE, PyTree, describe, flatten, leaf_path, path_str, spec_text

#: ``count -> (lr, bad)``: ``lr`` a float or a 0-d tensor (0 where the value is not usable),
#: ``bad`` None for a Python float, else a 0-d bool tensor (True when the value was NaN, infinite
#: or negative).
LrFn = Callable[[torch.Tensor], tuple[Any, "torch.Tensor | None"]]


# --------------------------------------------------------------------------------------------
# learning rates


_PROBE_HINT = (
    "a schedule must take the step count (a 0-d int32 tensor) and return a 0-d floating tensor "
    "(see funcamp.constant_schedule); pass a fixed rate as a float"
)


def _check_schedule_metadata(
    api: str, value: Any, when: str, name: str = "learning_rate", hint: str = _PROBE_HINT
) -> torch.Tensor:
    """A schedule's value, checked for its type and shape only (no host sync): a 0-d floating
    tensor."""
    if (
        not isinstance(value, torch.Tensor)
        or value.dim() != 0
        or not value.is_floating_point()
        or value.is_complex()
    ):
        raise TypeError(
            f"funcamp.{api}: `{name}` schedule must return a 0-d floating tensor, got "
            f"{describe(value)} {when}; {hint}"
        )
    return value


def _check_lr_value(api: str, value: torch.Tensor, what: str) -> None:
    """Build-time value check (reads the value: never on the step path)."""
    v = float(value.detach().to("cpu", torch.float64))
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"funcamp.{api}: `learning_rate` must be >= 0 and finite, got {v!r}{what}")


def _guard_lr(lr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lr or 0 where unusable, unusable)``: 0-d device ops, no host sync."""
    ok = (lr >= 0) & (lr <= torch.finfo(lr.dtype).max)
    return torch.where(ok, lr, torch.zeros_like(lr)), ~ok


def learning_rate_fn(api: str, learning_rate: Any) -> LrFn:
    """Validate a learning rate when the optimizer is built; return ``count -> (lr, bad)``.

    A schedule is probed here, at build time.
    """
    if isinstance(learning_rate, torch.Tensor):
        if (
            learning_rate.dim() != 0
            or not learning_rate.is_floating_point()
            or learning_rate.is_complex()
        ):
            raise TypeError(
                f"funcamp.{api}: `learning_rate` must be a float, a 0-d floating tensor or a "
                f"schedule, got {describe(learning_rate)}"
            )
        _check_lr_value(api, learning_rate, "")  # construction time, not the step path
        fixed = learning_rate
        return lambda count: _guard_lr(fixed)
    if callable(learning_rate):
        schedule = learning_rate
        probe = torch.zeros((), dtype=torch.int32)
        try:
            value = schedule(probe)
        except Exception as e:
            raise TypeError(
                f"funcamp.{api}: `learning_rate` schedule raised {type(e).__name__}: {e} when "
                f"called with the step count 0; {_PROBE_HINT}"
            ) from e
        _check_schedule_metadata(api, value, "for the step count 0")
        _check_lr_value(api, value, " from the schedule at step count 0")

        def fn(count: torch.Tensor) -> tuple[Any, torch.Tensor | None]:
            return _guard_lr(_check_schedule_metadata(api, schedule(count), "at run time"))

        return fn
    if (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, Real)
        or not math.isfinite(float(learning_rate))
    ):
        raise TypeError(
            f"funcamp.{api}: `learning_rate` must be a finite real number, a 0-d floating "
            f"tensor or a schedule, got {describe(learning_rate)}"
        )
    lr = float(learning_rate)
    if lr < 0:
        raise ValueError(f"funcamp.{api}: `learning_rate` must be >= 0.0, got {lr!r}")
    return lambda count: (lr, None)


#: ``count -> (value, bad)``: a scheduled hyperparameter's value as a 0-d float64 tensor (the
#: range's lower end where it is unusable) and a 0-d bool, True when it was NaN or out of range.
HyperFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_HYPER_HINT = (
    "a hyperparameter schedule must take the step count (a 0-d int32 tensor) and return a 0-d "
    "floating tensor; pass a fixed value as a float"
)


def hyperparameter_fn(
    api: str,
    name: str,
    schedule: Callable[[torch.Tensor], torch.Tensor],
    *,
    low: float = 0.0,
    high: float | None = None,
    high_open: bool = True,
) -> HyperFn:
    """Validate a hyperparameter schedule when the optimizer is built; return
    ``count -> (value, bad)`` (see :data:`HyperFn`).

    The schedule is probed once, at the count 0: it must return a 0-d floating tensor whose value
    lies in ``[low, high)`` (``]`` unless ``high_open``). On the step path each value is checked
    for its type and shape only (metadata, no host sync). A value outside the range is replaced
    by ``low`` and flagged: the step is skipped as for an unusable learning rate.
    """
    probe = torch.zeros((), dtype=torch.int32)
    try:
        value = schedule(probe)
    except Exception as e:
        raise TypeError(
            f"funcamp.{api}: `{name}` schedule raised {type(e).__name__}: {e} when called with "
            f"the step count 0; {_HYPER_HINT}"
        ) from e

    def metadata(value: Any, when: str) -> torch.Tensor:
        return _check_schedule_metadata(api, value, when, name, _HYPER_HINT)

    metadata(value, "for the step count 0")
    check_real(
        api, name, float(value.detach().to("cpu", torch.float64)), low=low, high=high,
        high_open=high_open, hint=" from its schedule at the step count 0",
    )  # fmt: skip

    def fn(count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = metadata(schedule(count), "at run time").to(torch.float64)
        ok = (v >= low) & (v <= torch.finfo(v.dtype).max)  # NaN and infinities fail
        if high is not None:
            ok = ok & ((v < high) if high_open else (v <= high))
        return torch.where(ok, v, torch.full_like(v, low)), ~ok

    return fn


def any_flag(flags: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """OR of the non-None 0-d bool flags (None when there are none)."""
    out = None
    for f in flags:
        if f is not None:
            out = f if out is None else out | f.to(out.device)
    return out


# --------------------------------------------------------------------------------------------
# numbers and flags


#
# One dialect for every number funcamp takes: a value of the wrong type (a string, a bool, a
# tensor, None) is a TypeError; a number that is not finite or lies outside its range is a
# ValueError. Both messages say what the argument must be.


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if low_open else '>='} {low}"
    if low is None:
        return f" {'<' if high_open else '<='} {high}"
    return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_real(
    api: str,
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> float:
    """A finite real number (not a bool) in the interval, returned as a float; ``hint`` ends
    the message of an out-of-range value."""
    where = _interval(low, high, low_open, high_open)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(
            f"funcamp.{api}: `{name}` must be a finite real number{where}, got {describe(value)}"
        )
    v = float(value)
    ok = math.isfinite(v)
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v < high if high_open else v <= high
    if not ok:
        raise ValueError(
            f"funcamp.{api}: `{name}` must be a finite real number{where}, got {v!r}{hint}"
        )
    return v


def check_number(
    api: str,
    name: str,
    value: Any,
    *,
    minimum: float = 0.0,
    maximum: float | None = None,
    maximum_open: bool = True,
) -> float:
    """A finite real hyperparameter in ``[minimum, maximum)`` (``]`` unless ``maximum_open``)."""
    return check_real(api, name, value, low=minimum, high=maximum, high_open=maximum_open)


def check_flag(api: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"funcamp.{api}: `{name}` must be a bool, got {describe(value)}")


def check_int(api: str, name: str, value: Any, *, minimum: int) -> int:
    """An int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"funcamp.{api}: `{name}` must be an int >= {minimum}, got {describe(value)}"
        )
    if value < minimum:
        raise ValueError(f"funcamp.{api}: `{name}` must be an int >= {minimum}, got {value!r}")
    return value


def check_type(api: str, name: str, value: Any, cls: type, hint: str) -> None:
    if not isinstance(value, cls):
        raise TypeError(
            f"funcamp.{api}: `{name}` must be a {cls.__name__}{hint}, got {describe(value)}"
        )


# --------------------------------------------------------------------------------------------
# params and grads


def flatten_params(api: str, params: PyTree) -> tuple[list[torch.Tensor], Any]:
    """The leaves of ``params`` (each a floating tensor) and its treespec."""
    leaves, spec = flatten(params)
    _check_floating(api, "params", params, leaves)
    return leaves, spec


def _check_floating(api: str, name: str, tree: PyTree, leaves: list[Any]) -> None:
    for i, leaf in zip(range(len(leaves)), leaves):  # dynamo traces enumerate in Python
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            raise TypeError(
                f"funcamp.{api}: `{name}` leaf {leaf_path(tree, i)} must be a floating tensor, "
                f"got {describe(leaf)}"
            )


def check_grads_match(api: str, grads: PyTree, params: PyTree) -> tuple[list[Any], Any]:
    """``grads`` must have the tree structure of ``params`` and, where a param is a tensor, a
    tensor of its shape. Names the first leaf that differs. Returns the grads' leaves and
    treespec (:func:`funcamp._core.tree.flatten`), for the caller to reuse."""
    gleaves, gspec = flatten(grads)
    _params_like_grads(api, grads, gleaves, gspec, params)
    return gleaves, gspec


def _params_like_grads(
    api: str, grads: PyTree, gleaves: list[Any], gspec: Any, params: PyTree
) -> list[Any]:
    """The leaves of ``params``, which must match the flattened ``grads``: by the grads'
    treespec under compile when that matches (:func:`_matching_params`), else flattened and
    checked in full (:func:`_check_match`, which names what differs)."""
    pleaves = _matching_params(gleaves, gspec, params)
    if pleaves is None:
        pleaves, pspec = flatten(params)
        _check_match(api, grads, gleaves, gspec, params, pleaves, pspec)
    return pleaves


def _matching_params(gleaves: list[Any], gspec: Any, params: PyTree) -> list[Any] | None:
    """Under ``torch.compile``, cheaply: ``params`` flattened by the grads' treespec when that
    yields a tensor of each grad's shape; None otherwise, and always in eager (the caller then
    runs the full check, which names what differs). Flattening *up to* a known treespec is
    traced in a fifth of the instructions of a second flatten; like optree's ``flatten_up_to``
    it takes a dict, ``OrderedDict`` or ``defaultdict`` with the same keys as one another,
    which the eager check refuses."""
    if not compiling():  # eager: optree's C++ flatten is cheap, and strict
        return None
    try:
        pleaves = gspec.flatten_up_to(params)
    except (ValueError, TypeError):
        return None
    for g, p in zip(gleaves, pleaves):
        if not isinstance(p, torch.Tensor) or not isinstance(g, torch.Tensor) or g.shape != p.shape:
            return None
    return pleaves


def _check_match(
    api: str,
    grads: PyTree,
    gleaves: list[Any],
    gspec: Any,
    params: PyTree,
    pleaves: list[Any],
    pspec: Any,
) -> None:
    """:func:`check_grads_match` on flattened trees (paths are made only for the message)."""
    if gspec != pspec:
        gpaths = optree.tree_flatten_with_path(grads, namespace=NAMESPACE)[0]
        ppaths = optree.tree_flatten_with_path(params, namespace=NAMESPACE)[0]
        gset = {path_str(p) for p in gpaths}
        pset = {path_str(p) for p in ppaths}
        missing = [path_str(p) for p in ppaths if path_str(p) not in gset]
        extra = [path_str(p) for p in gpaths if path_str(p) not in pset]
        if missing:
            detail = f"leaf {missing[0]} is in `params` but not in `grads`"
        elif extra:
            detail = f"leaf {extra[0]} is in `grads` but not in `params`"
        else:
            detail = f"the containers differ: {spec_text(gspec)} vs {spec_text(pspec)}"
        raise ValueError(f"funcamp.{api}: `grads` must have the structure of `params`; {detail}")
    for i, g, p in zip(range(len(gleaves)), gleaves, pleaves):
        if isinstance(p, torch.Tensor) and (not isinstance(g, torch.Tensor) or g.shape != p.shape):
            raise ValueError(
                f"funcamp.{api}: `grads` leaf {leaf_path(grads, i)} must be a tensor of shape "
                f"{tuple(p.shape)} like its param, got {describe(g)}"
            )


def flatten_grads(
    api: str, grads: PyTree, params: PyTree, *, need_params: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, Any]:
    """Flatten ``grads`` (and ``params`` when given; they must match leaf by leaf): floating
    tensors. ``(grad leaves, param leaves or None, treespec)``."""
    gleaves, gspec = flatten(grads)
    _check_floating(api, "grads", grads, gleaves)
    if params is None:
        if need_params:
            raise ValueError(
                f"funcamp.{api}: `params` must be given to update (weight decay or a "
                "low-precision mode needs them), got None"
            )
        return gleaves, None, gspec
    pleaves = _params_like_grads(api, grads, gleaves, gspec, params)
    _check_floating(api, "params", params, pleaves)
    return gleaves, pleaves, gspec


def state_leaves(api: str, name: str, tree: PyTree, spec: Any) -> list[torch.Tensor]:
    """The leaves of the optimizer state's ``name`` tree, flattened like the grads (``spec``)."""
    try:
        return spec.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"funcamp.{api}: `state.{name}` must have the tree structure of the grads "
            f"{spec_text(spec)}, "
            f"got {spec_text(flatten(tree)[1])}"
        ) from e


# --------------------------------------------------------------------------------------------
# optimizer state


def check_count(api: str, name: str, value: Any, dtype: torch.dtype = torch.int32) -> None:
    if not isinstance(value, torch.Tensor) or value.dim() != 0 or value.dtype != dtype:
        raise TypeError(
            f"funcamp.{api}: `state.{name}` must be a 0-d {dtype} tensor, got {describe(value)}; "
            "build the state with the optimizer's init(params)"
        )


def check_state_type(api: str, state: Any, state_type: type, article: str = "a") -> Any:
    """``state`` when it is a ``state_type`` (what the optimizer's init builds), else a
    TypeError naming the type it got (``article``: "a" or "an", as the type's name reads)."""
    if not isinstance(state, state_type):
        raise TypeError(
            f"funcamp.{api}: `state` must be {article} {state_type.__name__} from this "
            f"optimizer's init, got {type(state).__name__}"
        )
    return state


def check_state_like(
    api: str,
    name: str,
    leaves: Sequence[Any],
    refs: Sequence[torch.Tensor],
    dtypes: Sequence[torch.dtype],
    grads: PyTree,
    *,
    empty: Sequence[bool] | None = None,
) -> None:
    """Check the leaves of the optimizer state's ``name`` tree, flattened like the grads.

    Each must be a tensor of its ``refs``' shape and of ``dtypes[i]`` (an empty tensor where
    ``empty[i]``). Metadata only.
    """
    # Runs on every step, traced by dynamo under compile: shapes compare as torch.Size, the
    # expected shape is spelled out only for the message.
    for i, x, ref, dtype in zip(range(len(leaves)), leaves, refs, dtypes):
        if (
            isinstance(x, torch.Tensor)
            and x.dtype == dtype
            and x.device == ref.device
            and x.shape == ((0,) if empty is not None and empty[i] else ref.shape)
        ):
            continue
        shape = (0,) if empty is not None and empty[i] else tuple(ref.shape)
        path = leaf_path(grads, i)
        got = describe(x) + (f" on {x.device}" if isinstance(x, torch.Tensor) else "")
        raise ValueError(
            f"funcamp.{api}: `state.{name}` leaf {path} must be a {dtype} tensor of shape "
            f"{shape} on {ref.device} to match its param, got {got}; build the state with the "
            "optimizer's init(params) (or TrainState.create)"
        )
