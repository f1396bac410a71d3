"""Loss scaling as pure functions over an immutable :class:`ScalerState`.

The state is a frozen dataclass registered as a pytree with optree (namespace ``"funcamp"``) and
``torch.utils._pytree``: its tensors are leaves, its configuration is static metadata, so it
survives flatten/unflatten, ``torch.compile``, ``torch.func.vmap`` and checkpoints whole.

:func:`update` reproduces ``torch._amp_update_scale_`` bit for bit (the products are computed in
float64 and rounded to float32, as torch's kernel does) and adds ``min_scale``/``max_scale`` clamps
and Megatron-LM's hysteresis. Nothing on the step path syncs with the host.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import optree
import torch
import torch.utils._pytree as torch_pytree

from funcamp._core.checks import check_flag, check_grads_match, check_int, check_scaler_leaves
from funcamp._core.collectives import Across, any_across, summing_across
from funcamp._core.context import compiling, eager_path
from funcamp._core.numerics import hoist_scalar, math_dtype, spread
from funcamp._core.tree import (
    _BITS,
    NAMESPACE,
    _plan_write,
    _select,
    _self_overlapping,
    _sharing_memory,
    _storage_key,
    describe,
    flatten,
    tree_select,
    unflatten,
)
from funcamp.optim._base import (
    Optimizer,
    apply_updates,
    apply_updates_owned,
    exclusive,
    update_tensors,
)
from funcamp.policy.policy import get_policy

__all__ = ["ScalerState", "StepInfo", "scale", "unscale", "unscale_and_step", "update"]

PyTree = Any
Kind = Literal["dynamic", "static", "noop"]

_KINDS = ("dynamic", "static", "noop")
_LEAVES = ("scale", "growth_tracker", "hysteresis_tracker", "skipped")
_CONFIG = (
    "kind",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_scale",
    "max_scale",
    "hysteresis",
)
_F32 = torch.finfo(torch.float32)
_GRAD_SCALER_KEYS = (
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
)


def _is_real_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, eq=False)
class ScalerState:
    """Immutable loss-scaler state: four 0-d tensor leaves and static configuration.

    Leaves (threaded through the step, traced by ``torch.compile``):

    * ``scale`` -- 0-d float32, the current loss scale.
    * ``growth_tracker`` -- 0-d int32, clean steps since the scale last changed (torch's name).
    * ``hysteresis_tracker`` -- 0-d int32, overflows still tolerated before backing off.
    * ``skipped`` -- 0-d int32, running total of skipped (non-finite) steps.

    Static configuration (pytree metadata, a compile-time constant): ``kind``
    (``"dynamic"``, ``"static"`` or ``"noop"``), ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``min_scale``, ``max_scale`` (``None`` for unbounded) and ``hysteresis``.

    All three kinds skip steps whose gradients are non-finite. ``static`` keeps its scale
    forever; ``noop`` is a static scale of 1: nothing is scaled, but ``found_inf`` is still
    computed and a non-finite step is still skipped, which protects bfloat16 and float32 training
    from a single NaN step destroying the parameters.

    Build one with :meth:`dynamic`, :meth:`static`, :meth:`noop`, :meth:`for_policy` or
    :meth:`from_grad_scaler`; the class is frozen, and :func:`update` returns a new state.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.ScalerState.dynamic(init_scale=1024.0, growth_interval=2)
        >>> s.scale, s.growth_tracker, s.kind
        (tensor(1024.), tensor(0, dtype=torch.int32), 'dynamic')
        >>> s = funcamp.update(s, torch.tensor(True))
        >>> s.scale, s.skipped
        (tensor(512.), tensor(1, dtype=torch.int32))
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_tracker: torch.Tensor
    skipped: torch.Tensor
    kind: Kind = "dynamic"
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None
    max_scale: float | None = None
    hysteresis: int = 1

    def __post_init__(self) -> None:
        # Only the static configuration is checked here: leaves may be anything while a
        # transform (optree, torch pytree, vmap, dynamo) rebuilds the node.
        _validate_config(
            "ScalerState",
            kind=self.kind,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            hysteresis=self.hysteresis,
        )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def dynamic(
        cls,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
        device: torch.device | str | None = None,
    ) -> ScalerState:
        """A dynamic scaler; the defaults are ``torch.amp.GradScaler``'s.

        Args:
            init_scale: the initial scale, finite and > 0 (stored as float32).
            growth_factor: multiplier applied after ``growth_interval`` clean steps, > 1.
            backoff_factor: multiplier applied on overflow, in (0, 1).
            growth_interval: clean steps in a row before the scale grows, >= 1.
            min_scale: optional floor, a normal float32 value; backoff never goes below it.
            max_scale: optional ceiling, a finite float32 value; growth never goes above it.
            hysteresis: overflows tolerated since the last growth before backing off
                (Megatron-LM's rule); 1 is torch's rule (back off on every overflow).
            device: where the state's tensors live (default: the default device).

        Example:
            >>> import funcamp
            >>> s = funcamp.ScalerState.dynamic(2.0**10, hysteresis=2, min_scale=1.0)
            >>> float(s.scale), int(s.hysteresis_tracker), s.min_scale
            (1024.0, 2, 1.0)
        """
        api = "ScalerState.dynamic"
        _validate_config(
            api,
            kind="dynamic",
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
        )
        _validate_init_scale(api, init_scale)
        if min_scale is not None and init_scale < min_scale:
            raise ValueError(
                f"funcamp.{api}: `init_scale` must be >= `min_scale` ({min_scale!r}), "
                f"got {init_scale!r}"
            )
        if max_scale is not None and init_scale > max_scale:
            raise ValueError(
                f"funcamp.{api}: `init_scale` must be <= `max_scale` ({max_scale!r}), "
                f"got {init_scale!r}"
            )
        return cls._build(
            init_scale,
            device,
            kind="dynamic",
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=int(growth_interval),
            min_scale=None if min_scale is None else float(min_scale),
            max_scale=None if max_scale is None else float(max_scale),
            hysteresis=int(hysteresis),
        )

    @classmethod
    def static(cls, scale: float, device: torch.device | str | None = None) -> ScalerState:
        """A fixed scale that never changes; non-finite steps are still skipped.

        Example:
            >>> import torch, funcamp
            >>> s = funcamp.ScalerState.static(128.0)
            >>> s2 = funcamp.update(s, torch.tensor(True))
            >>> float(s2.scale), int(s2.skipped), s2.kind
            (128.0, 1, 'static')
        """
        _validate_init_scale("ScalerState.static", scale, arg="scale")
        return cls._build(scale, device, kind="static")

    @classmethod
    def noop(cls, device: torch.device | str | None = None) -> ScalerState:
        """Scale 1, never changes. ``found_inf`` is still computed and bad steps still skipped.

        This is the scaler for bfloat16 and float32 training: no scaling is needed, but a step
        whose gradients contain inf or nan is dropped instead of poisoning the parameters.

        Example:
            >>> import torch, funcamp
            >>> s = funcamp.ScalerState.noop()
            >>> funcamp.scale(s, torch.tensor(3.0))
            tensor(3.)
        """
        return cls._build(1.0, device, kind="noop")

    @classmethod
    def for_policy(cls, policy: Any, device: torch.device | str | None = None) -> ScalerState:
        """The scaler a precision policy needs: dynamic for float16, noop otherwise.

        Args:
            policy: anything with ``compute_dtype`` and/or ``param_dtype`` attributes (a
                ``funcamp.Policy``), or a policy spec string.
            device: where the state's tensors live.

        Example:
            >>> import torch, funcamp, types
            >>> fp16 = types.SimpleNamespace(param_dtype=torch.float32, compute_dtype=torch.float16)
            >>> funcamp.ScalerState.for_policy(fp16).kind
            'dynamic'
            >>> bf16 = types.SimpleNamespace(param_dtype=torch.float32, compute_dtype=torch.bfloat16)
            >>> funcamp.ScalerState.for_policy(bf16).kind
            'noop'
        """
        if isinstance(policy, str):
            policy = get_policy(policy)
        dtypes = [getattr(policy, a, None) for a in ("compute_dtype", "param_dtype")]
        if not any(isinstance(d, torch.dtype) for d in dtypes):
            raise TypeError(
                "funcamp.ScalerState.for_policy: `policy` must have a `compute_dtype` or "
                f"`param_dtype` torch.dtype attribute, got {describe(policy)}"
            )
        if torch.float16 in dtypes:
            return cls.dynamic(device=device)
        return cls.noop(device=device)

    @classmethod
    def from_grad_scaler(
        cls,
        scaler_or_state_dict: torch.amp.GradScaler | Mapping[str, Any],
        *,
        device: torch.device | str | None = None,
    ) -> ScalerState:
        """Convert a ``torch.amp.GradScaler`` (or its ``state_dict()``) to a :class:`ScalerState`.

        The scale, growth tracker, factors and interval carry over exactly; a disabled scaler
        (empty state dict) becomes :meth:`noop`. ``skipped`` starts at 0 (GradScaler keeps no
        such count).

        Args:
            scaler_or_state_dict: a GradScaler or the dict its ``state_dict()`` returned.
            device: where the state's tensors live (default: the scaler's scale tensor's device
                when it has one, else the default device).

        Example:
            >>> import torch, funcamp
            >>> gs = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=10)
            >>> s = funcamp.ScalerState.from_grad_scaler(gs)
            >>> float(s.scale), s.growth_interval
            (256.0, 10)
            >>> s.to_grad_scaler_state_dict() == gs.state_dict()
            True
        """
        api = "ScalerState.from_grad_scaler"
        if isinstance(scaler_or_state_dict, torch.amp.GradScaler):
            scaler = scaler_or_state_dict
            sd = scaler.state_dict()
            live = getattr(scaler, "_scale", None)
            if device is None and isinstance(live, torch.Tensor):
                device = live.device
        elif isinstance(scaler_or_state_dict, Mapping):
            sd = dict(scaler_or_state_dict)
        else:
            raise TypeError(
                f"funcamp.{api}: `scaler_or_state_dict` must be a torch.amp.GradScaler or its "
                f"state_dict(), got {describe(scaler_or_state_dict)}"
            )
        if not sd:
            return cls.noop(device=device)
        missing = [k for k in _GRAD_SCALER_KEYS if k not in sd]
        extra = sorted(str(k) for k in sd if k not in _GRAD_SCALER_KEYS)
        if missing or extra:
            raise ValueError(
                f"funcamp.{api}: `scaler_or_state_dict` must have exactly the keys "
                f"{list(_GRAD_SCALER_KEYS)}, got missing {missing} and unexpected {extra}"
            )
        raw_scale = sd["scale"]
        if isinstance(raw_scale, torch.Tensor) and raw_scale.numel() == 1:
            raw_scale = raw_scale.item()
        if not _is_real_number(raw_scale):
            raise TypeError(f"funcamp.{api}: `scale` must be a float, got {describe(raw_scale)}")
        if not (math.isfinite(raw_scale) and 0 < raw_scale <= _F32.max):
            raise ValueError(
                f"funcamp.{api}: `scale` must be finite and > 0 (at most the float32 maximum), "
                f"got {raw_scale!r}; a zero or negative scale gives wrong gradients and a NaN "
                "one skips every step: fix the GradScaler or start from ScalerState.dynamic()"
            )
        tracker = sd["_growth_tracker"]
        if isinstance(tracker, torch.Tensor) and tracker.numel() == 1:
            if tracker.is_floating_point() or tracker.dtype == torch.bool:
                raise TypeError(
                    f"funcamp.{api}: `_growth_tracker` must be an int, got {describe(tracker)}"
                )
            tracker = tracker.item()
        if not _is_int(tracker) or tracker < 0:
            raise ValueError(
                f"funcamp.{api}: `_growth_tracker` must be an int >= 0, got {tracker!r}"
            )
        _validate_config(
            api,
            kind="dynamic",
            growth_factor=sd["growth_factor"],
            backoff_factor=sd["backoff_factor"],
            growth_interval=sd["growth_interval"],
            min_scale=None,
            max_scale=None,
            hysteresis=1,
        )
        state = cls._build(
            float(raw_scale),
            device,
            kind="dynamic",
            growth_factor=float(sd["growth_factor"]),
            backoff_factor=float(sd["backoff_factor"]),
            growth_interval=int(sd["growth_interval"]),
        )
        if tracker >= state.growth_interval:
            raise ValueError(
                f"funcamp.{api}: `_growth_tracker` must be < `growth_interval` "
                f"({state.growth_interval}), got {tracker}"
            )
        return dataclasses.replace(
            state, growth_tracker=torch.full_like(state.growth_tracker, tracker)
        )

    def to_grad_scaler_state_dict(self) -> dict[str, Any]:
        """Return the state as ``torch.amp.GradScaler.state_dict()`` would (host sync: use it
        for checkpointing, not inside a step).

        A ``noop`` scaler gives ``{}`` (a disabled GradScaler). GradScaler cannot represent a
        ``static`` scaler, hysteresis or scale bounds; those raise ``ValueError`` rather than
        losing information.

        Example:
            >>> import torch, funcamp
            >>> s = funcamp.ScalerState.dynamic(1024.0, growth_interval=100)
            >>> gs = torch.amp.GradScaler("cpu")
            >>> gs.load_state_dict(s.to_grad_scaler_state_dict())
            >>> gs.get_scale(), gs.get_growth_interval()
            (1024.0, 100)
        """
        api = "ScalerState.to_grad_scaler_state_dict"
        if self.kind == "noop":
            return {}
        if self.kind == "static":
            raise ValueError(
                f"funcamp.{api}: torch.amp.GradScaler has no static mode; `kind` must be "
                "'dynamic' or 'noop', got 'static'"
            )
        unsupported = [
            f"{name}={value!r}"
            for name, value, default in (
                ("hysteresis", self.hysteresis, 1),
                ("min_scale", self.min_scale, None),
                ("max_scale", self.max_scale, None),
            )
            if value != default
        ]
        if unsupported:
            raise ValueError(
                f"funcamp.{api}: torch.amp.GradScaler cannot represent "
                f"{', '.join(unsupported)}; the state must use hysteresis=1 and no scale bounds"
            )
        return {
            "scale": float(self.scale.item()),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(self.growth_tracker.item()),
        }

    @classmethod
    def _build(
        cls, init_scale: float, device: torch.device | str | None, **config: Any
    ) -> ScalerState:
        hysteresis = config.get("hysteresis", 1)
        return cls(
            scale=torch.full((), init_scale, dtype=torch.float32, device=device),
            growth_tracker=torch.zeros((), dtype=torch.int32, device=device),
            hysteresis_tracker=torch.full((), hysteresis, dtype=torch.int32, device=device),
            skipped=torch.zeros((), dtype=torch.int32, device=device),
            **config,
        )

    def _config(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _CONFIG)

    def _with_leaves(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        hysteresis_tracker: torch.Tensor,
        skipped: torch.Tensor,
    ) -> ScalerState:
        return ScalerState(
            scale,
            growth_tracker,
            hysteresis_tracker,
            skipped,
            *self._config(),
        )


# ---------------------------------------------------------------------- pytree registration


def _flatten(state: ScalerState) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
    return [getattr(state, name) for name in _LEAVES], state._config()


def _unflatten(config: tuple[Any, ...], leaves: Any) -> ScalerState:
    return ScalerState(*leaves, *config)


optree.register_pytree_node(
    ScalerState,
    lambda s: (*_flatten(s), _LEAVES),
    _unflatten,
    namespace=NAMESPACE,
)

torch_pytree.register_pytree_node(
    ScalerState,
    _flatten,
    lambda leaves, config: _unflatten(config, leaves),
    serialized_type_name="funcamp.ScalerState",
    flatten_with_keys_fn=lambda s: (
        [(torch_pytree.GetAttrKey(name), getattr(s, name)) for name in _LEAVES],
        s._config(),
    ),
)


class StepInfo(NamedTuple):
    """What :func:`unscale_and_step` learned about the step, as tensors (no host sync).

    Attributes:
        found_inf: 0-d bool, True when the scaled gradients had an inf or nan and the step was
            skipped.
        grad_norm: 0-d float32, the global L2 norm of the unscaled gradients; ``None`` when
            the step was asked not to compute it (``grad_norm=False``).

    Example:
        >>> import torch, funcamp
        >>> info = funcamp.StepInfo(torch.tensor(False), torch.tensor(1.5))
        >>> info.found_inf, info.grad_norm
        (tensor(False), tensor(1.5000))
    """

    found_inf: torch.Tensor
    grad_norm: torch.Tensor | None


# ---------------------------------------------------------------------- validation


def _validate_init_scale(api: str, value: Any, arg: str = "init_scale") -> None:
    if not _is_real_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"funcamp.{api}: `{arg}` must be a finite float > 0, got {value!r}")
    if value > _F32.max:
        raise ValueError(
            f"funcamp.{api}: `{arg}` must be at most the float32 maximum {_F32.max!r}, "
            f"got {value!r}"
        )


def _validate_config(
    api: str,
    *,
    kind: Any,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    min_scale: Any,
    max_scale: Any,
    hysteresis: Any,
) -> None:
    prefix = f"funcamp.{api}:"
    if kind not in _KINDS:
        raise ValueError(f"{prefix} `kind` must be one of {list(_KINDS)}, got {kind!r}")
    if not _is_real_number(growth_factor) or not (1.0 < growth_factor < math.inf):
        raise ValueError(
            f"{prefix} `growth_factor` must be a finite float > 1, got {growth_factor!r}"
        )
    if not _is_real_number(backoff_factor) or not (0.0 < backoff_factor < 1.0):
        raise ValueError(
            f"{prefix} `backoff_factor` must be a float in (0, 1), got {backoff_factor!r}"
        )
    check_int(api, "growth_interval", growth_interval, minimum=1)
    check_int(api, "hysteresis", hysteresis, minimum=1)
    if min_scale is not None and (
        not _is_real_number(min_scale) or not (_F32.tiny <= min_scale <= _F32.max)
    ):
        raise ValueError(
            f"{prefix} `min_scale` must be None or a normal float32 value in "
            f"[{_F32.tiny!r}, {_F32.max!r}], got {min_scale!r}"
        )
    if max_scale is not None and (
        not _is_real_number(max_scale) or not (_F32.tiny <= max_scale <= _F32.max)
    ):
        raise ValueError(
            f"{prefix} `max_scale` must be None or a normal float32 value in "
            f"[{_F32.tiny!r}, {_F32.max!r}], got {max_scale!r}"
        )
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(
            f"{prefix} `min_scale` must be <= `max_scale` ({max_scale!r}), got {min_scale!r}"
        )


def _check_scaler(api: str, state: Any) -> None:
    if not isinstance(state, ScalerState):
        raise TypeError(f"funcamp.{api}: `state` must be a ScalerState, got {describe(state)}")
    check_scaler_leaves(api, state)  # metadata only: 0-d tensors of the right dtypes


def _check_found_inf(api: str, found_inf: Any) -> None:
    if (
        not isinstance(found_inf, torch.Tensor)
        or found_inf.dtype != torch.bool
        or found_inf.dim() != 0
    ):
        raise TypeError(
            f"funcamp.{api}: `found_inf` must be a 0-d bool tensor, got {describe(found_inf)}"
        )


# ---------------------------------------------------------------------- scale / unscale


def scale(state: ScalerState, tree: PyTree) -> PyTree:
    """Multiply the floating tensor leaves of ``tree`` (usually the loss) by the scale.

    The product is computed in float32 (float16/bfloat16 leaves are upcast first, so a scaled
    float16 loss cannot overflow; float64 leaves stay float64, as with ``GradScaler.scale``).
    Integer, bool and non-tensor leaves pass through.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.ScalerState.dynamic(init_scale=8.0)
        >>> funcamp.scale(s, torch.tensor(0.5, dtype=torch.float16))
        tensor(4.)
    """
    _check_scaler("scale", state)

    def mul(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        return x.to(math_dtype(x.dtype)) * state.scale.to(x.device)

    return optree.tree_map(mul, tree, namespace=NAMESPACE)


def _fused_unscale(leaves: list[torch.Tensor]) -> bool:
    """Whether unscaling runs on the eager path: torch's fused
    ``_amp_foreach_non_finite_check_and_unscale_`` on copies of the leaves (one pass for the
    check and the multiply). It mutates in place, has no autograd formula, no vmap rule, and
    inductor cannot fuse it: the traced path's pure ops, which give identical results, run
    under compile, functorch transforms and autograd."""
    return hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_") and eager_path(leaves)


def _floating(
    grads: PyTree, flat: tuple[list[Any], Any] | None = None
) -> tuple[list[Any], Any, list[int]]:
    """``(leaves, treespec, indices of the floating tensor leaves)`` of ``grads`` (``flat``:
    its leaves and treespec, when the caller has them)."""
    leaves, spec = flatten(grads) if flat is None else flat
    idx = [
        i
        for i, x in zip(range(len(leaves)), leaves)  # dynamo traces enumerate in Python
        if isinstance(x, torch.Tensor) and x.is_floating_point()
    ]
    return leaves, spec, idx


def _refill(leaves: list[Any], idx: list[int], out: list[torch.Tensor]) -> list[Any]:
    """``leaves`` with the floating ones (at ``idx``) replaced by ``out``."""
    new_leaves = list(leaves)
    for i, x in zip(idx, out):
        new_leaves[i] = x
    return new_leaves


def _unscale_leaves(
    leaves: list[torch.Tensor], scale_tensor: torch.Tensor, fused: bool, *, donate: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor]:
    # torch's rule: the reciprocal is taken in float64, then rounded to float32.
    inv_scale = hoist_scalar(scale_tensor.double().reciprocal().float())
    if not leaves:
        return [], torch.zeros((), dtype=torch.bool, device=scale_tensor.device)
    if fused:
        # Fresh copies (the caller's tensors only when donated, and then only those already in
        # the unscaled dtype), grouped by device and dtype as the kernel requires; it writes 1.0
        # into found (a float, per device) on inf/nan.
        out = [
            x if donate and x.dtype == math_dtype(x.dtype) else
            x.to(math_dtype(x.dtype), copy=True)
            for x in leaves
        ]  # fmt: skip
        groups: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for x in out:  # get_device (-1 on the CPU): reading x.device costs more, per leaf
            groups.setdefault((x.get_device(), x.dtype), []).append(x)
        flags = []
        for group in groups.values():
            device = group[0].device
            found = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale.to(device))
            flags.append(found.to(scale_tensor.device))
        found_inf = torch.stack(flags).sum() > 0 if len(flags) > 1 else flags[0] > 0
        return out, found_inf
    finite = [torch.isfinite(x).all().to(scale_tensor.device) for x in leaves]
    found_inf = ~torch.stack(finite).all()
    out = [
        x.to(math_dtype(x.dtype)) * inv.to(x.device)
        for x, inv in zip(leaves, spread(inv_scale, len(leaves)))
    ]
    return out, found_inf


def unscale(
    state: ScalerState, grads: PyTree, *, donate_grads: bool = False
) -> tuple[PyTree, torch.Tensor]:
    """Divide scaled gradients by the scale and check them for inf/nan.

    Floating leaves are returned in float32 (float16 and bfloat16 grads are unscaled in float32,
    which ``GradScaler.unscale_`` refuses to do for float16; float64 stays float64), multiplied by
    ``float32(1 / float64(scale))`` exactly as ``GradScaler`` does. ``found_inf`` is a 0-d bool
    tensor, True when any *scaled* gradient is inf or nan (torch's rule). Integer and non-tensor
    leaves pass through. The input tensors are never modified; no host sync.

    Eager CPU/CUDA tensors use torch's fused ``_amp_foreach_non_finite_check_and_unscale_`` on
    fresh copies; under ``torch.compile``, ``torch.func`` transforms or autograd a pure-torch
    path with bit-identical results runs instead.

    Args:
        state: the scaler state the loss was scaled with.
        grads: scaled gradients (any pytree).
        donate_grads: opt-in, for callers that own ``grads`` and never use them again (a train
            step whose grads come from ``torch.func.grad``). In plain eager, float32/float64
            leaves are then unscaled in place -- the returned leaves *are* the given tensors --
            saving a copy; the results are identical. Leaves that share memory with each other
            are still copied. Default False: ``grads`` are never modified.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.ScalerState.dynamic(init_scale=4.0)
        >>> grads, found_inf = funcamp.unscale(s, {"w": torch.tensor([8.0, 2.0])})
        >>> grads, found_inf
        ({'w': tensor([2.0000, 0.5000])}, tensor(False))
        >>> funcamp.unscale(s, {"w": torch.tensor([float("inf")])})[1]
        tensor(True)
        >>> mine = {"w": torch.tensor([8.0, 2.0])}  # donated: unscaled in place, then reused
        >>> funcamp.unscale(s, mine, donate_grads=True)[0]["w"] is mine["w"]
        True
    """
    _check_scaler("unscale", state)
    check_flag("unscale", "donate_grads", donate_grads)
    leaves, spec, idx = _floating(grads)
    floating = [leaves[i] for i in idx]
    fused = _fused_unscale(floating)
    donate = donate_grads and fused and _disjoint(floating, set())
    out, found_inf = _unscale_leaves(floating, state.scale, fused, donate=donate)
    return unflatten(spec, _refill(leaves, idx, out)), found_inf


# ---------------------------------------------------------------------- update


def update(state: ScalerState, found_inf: torch.Tensor) -> ScalerState:
    """Return the next scaler state after a step whose overflow flag is ``found_inf``.

    ``skipped`` counts up on every overflow, for every kind. ``static`` and ``noop`` scalers
    keep their scale. A ``dynamic`` scaler follows ``torch._amp_update_scale_`` bit for bit
    (float64 products rounded to float32): on overflow the scale is multiplied by
    ``backoff_factor`` and the growth tracker resets; otherwise the tracker counts up, and when it
    reaches ``growth_interval`` it resets and the scale is multiplied by ``growth_factor`` unless
    the grown value is not finite. Then ``min_scale``/``max_scale`` clamp the backed-off/grown
    value. With ``hysteresis=h`` (Megatron-LM's ``DynamicGradScaler``) each overflow also
    decrements a hysteresis tracker that starts at ``h``; the scale backs off only when that
    tracker reaches 0 (and on every overflow while it stays 0), and the tracker returns to ``h``
    at each growth step (``growth_interval`` clean steps in a row). ``h=1`` is torch's rule.

    Args:
        state: the current state.
        found_inf: 0-d bool tensor, True when this step's gradients overflowed.

    Example:
        >>> import torch, funcamp
        >>> s = funcamp.ScalerState.dynamic(init_scale=16.0, growth_interval=2)
        >>> for flag in [False, False, True]:
        ...     s = funcamp.update(s, torch.tensor(flag))
        ...     print(float(s.scale), int(s.growth_tracker))
        16.0 1
        32.0 0
        16.0 0
    """
    _check_scaler("update", state)
    _check_found_inf("update", found_inf)
    found_inf = found_inf.to(state.scale.device)
    skipped = state.skipped + found_inf.to(state.skipped.dtype)
    if state.kind != "dynamic":
        return state._with_leaves(
            state.scale, state.growth_tracker, state.hysteresis_tracker, skipped
        )

    if _kernel_updates(state, found_inf):
        return _update_with_kernel(state, found_inf, skipped)

    current = state.scale
    as_f64 = current.double()
    backed_off = (as_f64 * state.backoff_factor).float()
    grown = (as_f64 * state.growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, current)
    if state.min_scale is not None:
        backed_off = torch.clamp_min(backed_off, state.min_scale)
    if state.max_scale is not None:
        grown = torch.clamp_max(grown, state.max_scale)

    tracker = state.growth_tracker
    zero = torch.zeros_like(tracker)
    successful = tracker + 1
    grow_now = successful == state.growth_interval
    clean_scale = torch.where(grow_now, grown, current)
    clean_tracker = torch.where(grow_now, zero, successful)

    hysteresis = state.hysteresis_tracker
    if state.hysteresis == 1:
        # torch's rule; the tracker still follows Megatron's bookkeeping (0 after an overflow,
        # back to 1 when the scale grows).
        overflow_scale = backed_off
        overflow_hysteresis = torch.zeros_like(hysteresis)
    else:
        overflow_hysteresis = torch.clamp_min(hysteresis - 1, 0)
        overflow_scale = torch.where(overflow_hysteresis <= 0, backed_off, current)
    clean_hysteresis = torch.where(
        grow_now, torch.full_like(hysteresis, state.hysteresis), hysteresis
    )

    return state._with_leaves(
        torch.where(found_inf, overflow_scale, clean_scale),
        torch.where(found_inf, zero, clean_tracker),
        torch.where(found_inf, overflow_hysteresis, clean_hysteresis),
        skipped,
    )


def _kernel_updates(state: ScalerState, found_inf: torch.Tensor) -> bool:
    """Whether :func:`update` of this dynamic scaler runs torch's own kernel: torch's rule (no
    hysteresis, no min/max scale), on the eager path (see
    :func:`funcamp.optim._paths.eager_path`), with a float32 scale and an int32 tracker, which
    ``torch._amp_update_scale_`` requires."""
    return (
        state.hysteresis == 1
        and state.min_scale is None
        and state.max_scale is None
        and hasattr(torch, "_amp_update_scale_")
        and state.scale.dtype == torch.float32
        and state.growth_tracker.dtype == torch.int32
        and eager_path([state.scale, state.growth_tracker, state.hysteresis_tracker, found_inf])
    )


def _update_with_kernel(
    state: ScalerState, found_inf: torch.Tensor, skipped: torch.Tensor
) -> ScalerState:
    """:func:`update` where :func:`_kernel_updates` holds: torch's
    ``_amp_update_scale_`` (the rule GradScaler runs, which the traced path reproduces bit for
    bit) on copies, in one kernel instead of some twenty small ops."""
    scale, tracker = state.scale.clone(), state.growth_tracker.clone()
    torch._amp_update_scale_(
        scale,
        tracker,
        found_inf.to(torch.float32),
        state.growth_factor,
        state.backoff_factor,
        state.growth_interval,
    )
    # The hysteresis tracker's bookkeeping for h=1 (as the traced path): 0 after an overflow,
    # 1 again at each growth step. The growth tracker is 0 after exactly those two events.
    hysteresis = state.hysteresis_tracker
    hysteresis = torch.where(tracker == 0, (~found_inf).to(hysteresis.dtype), hysteresis)
    return state._with_leaves(scale, tracker, hysteresis, skipped)


# ---------------------------------------------------------------------- unscale_and_step


def _disjoint(leaves: list[torch.Tensor], taken: set[int | None]) -> bool:
    """Whether no two of ``leaves`` share memory, none shares memory with ``taken``, and none
    with itself (an expanded grad)."""
    seen: set[int | None] = set()
    for x in leaves:
        key = _storage_key(x)
        if key is not None and (key in seen or key in taken or _self_overlapping(x)):
            return False
        seen.add(key)
    return True


_TINY = float.fromhex("0x1p-1074")  # the smallest float64 subnormal
_NEGATIVE_ZERO = -0.0


def _adds_negative_zero_exactly() -> bool:
    """False when the CPU flushes subnormals (``torch.set_flush_denormal(True)`` sets the
    thread's DAZ/FTZ flags, which Python's own float arithmetic obeys too), where ``p + -0.0`` is
    not ``p``. Plain Python floats held in variables: no tensor, no host sync, no constant
    folding."""
    return _TINY + _NEGATIVE_ZERO != 0.0


def _skip_mask(found_inf: torch.Tensor) -> Callable[[torch.Tensor], bool]:
    """Returns ``mask(delta)``, which turns an owned float32/float64 delta into ``-0.0``
    everywhere when ``found_inf`` (and leaves it alone otherwise), in place and without a host
    sync: on the integer view, ``min(bits, cap)`` with a 0-d ``cap`` that is the smallest
    integer (the bits of ``-0.0``) when ``found_inf`` and the largest otherwise. Then
    ``p + delta`` is the new param, or ``p`` itself (``p + -0.0 == p`` bit for bit, signed zeros
    and infinities included), so the skip-step select costs one cheap vectorized pass over the
    delta instead of a (scalar, twice as slow) ``torch.where`` pass over both trees. Declines (returns False, and the caller selects with ``torch.where``) for
    CPU tensors while subnormals are flushed. A signaling-NaN param (torch never makes one)
    would come back quiet from a skipped step.
    """
    caps: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    cpu_exact: list[bool] = []

    def mask(delta: torch.Tensor) -> bool:
        int_dtype = _BITS.get(delta.dtype)  # deltas owned here are float32/float64
        if int_dtype is None:
            return False
        if delta.device.type == "cpu":
            if not cpu_exact:
                cpu_exact.append(_adds_negative_zero_exactly())
            if not cpu_exact[0]:
                return False
        key = (delta.device, int_dtype)
        if key not in caps:
            info = torch.iinfo(int_dtype)
            caps[key] = torch.where(found_inf.to(delta.device), info.min, info.max).to(int_dtype)
        delta.view(int_dtype).clamp_max_(caps[key])
        return True

    return mask


def _global_norm(leaves: list[torch.Tensor], device: torch.device, eager: bool) -> torch.Tensor:
    if not leaves:
        return torch.zeros((), dtype=torch.float32, device=device)
    if eager:
        norms = list(torch._foreach_norm(leaves))
    else:
        norms = [torch.linalg.vector_norm(x) for x in leaves]
    norms = [n.to(device=device, dtype=torch.float32) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms))


def unscale_and_step(
    state: ScalerState,
    optimizer: Optimizer,
    grads: PyTree,
    opt_state: PyTree,
    params: PyTree,
    *,
    group: Any = None,
    donate_grads: bool = False,
    donate_state: bool = False,
    grad_norm: bool = True,
    across: Across | None = None,
) -> tuple[PyTree, PyTree, StepInfo]:
    """Unscale ``grads``, apply ``optimizer``, and skip the step if the grads overflowed.

    Runs :func:`unscale`, then ``optimizer.update(grads, opt_state, params)`` and
    :func:`funcamp.apply_updates`; where ``found_inf`` is True the old ``params`` and
    ``opt_state`` are returned bit-identical (selected leaf-wise with :func:`funcamp.tree_select`,
    no host sync). Call :func:`update` with ``info.found_inf`` afterwards.

    The inputs are checked first (trees, shapes, the optimizer state against the params, the
    learning rate), before the grads are touched or anything is written: a refused call changes
    nothing, donated or not. A tensor learning rate that is NaN, infinite or negative at run
    time skips the step like an overflow (``found_inf`` is True).

    Args:
        state: the scaler state the loss was scaled with.
        optimizer: a :class:`funcamp.Optimizer`.
        grads: scaled gradients, with the structure and shapes of ``params``.
        opt_state: the optimizer state.
        params: the parameters.
        group: optional process group; when given, ``found_inf`` is OR-ed across its ranks
            (:func:`funcamp.distributed.any_across`) so every rank skips together.
        donate_grads: opt-in, for callers that own ``grads`` and never use them again (a train
            step whose grads come from ``torch.func.grad`` inside the step). In plain eager the
            grads are then unscaled in place and their memory may be reused for the results
            (the updates, even the returned params), saving fresh allocations; the results are
            identical. Donated grads must not be used after the call. Grads that share memory
            with each other, ``params``, ``opt_state`` or ``state``, or between their own
            elements (an expanded tensor), are copied instead.
            Default False: no argument is ever modified.
        donate_state: opt-in, for callers that keep only the returned params and optimizer
            state (``params, opt_state, info = unscale_and_step(...)``): the new values are
            written into the tensors of ``params`` and ``opt_state``, which are returned, as
            ``torch.optim`` updates in place (compiled, inductor stores straight into them). In
            plain eager, :func:`funcamp.sgd` without momentum (float32 params, no low-precision
            mode) then runs torch's fused SGD kernel, which skips on ``found_inf`` by itself
            (no host sync): one pass over the params, GradScaler's own cost, and
            ``torch.optim.SGD``'s params bit for bit (the out-of-place path adds a delta, which
            can be an ulp off where a step nearly reaches zero). Tensors of
            ``params``/``opt_state`` that share memory are refused (eager).

        grad_norm: compute ``info.grad_norm``, the global L2 norm of the unscaled gradients
            (default True). It is one more pass over every gradient (a norm per leaf and their
            norm); ``False`` skips it and ``info.grad_norm`` is ``None``.
        across: gradients held as shards (a sharded step: each rank holds a part of some
            leaves, :class:`funcamp.distributed.Across`): ``found_inf`` is OR-ed and the norm
            summed over its ranks (one small all-reduce, always: every rank must skip
            together), and :func:`funcamp.clip_by_global_norm` inside ``optimizer`` clips by
            the global norm too.

    Returns:
        ``(params, opt_state, StepInfo(found_inf, grad_norm))``; ``grad_norm`` is the global L2
        norm of the unscaled gradients (float32), or ``None`` with ``grad_norm=False``.

    Example:
        >>> import torch, funcamp
        >>> s, opt = funcamp.ScalerState.dynamic(init_scale=4.0), funcamp.sgd(0.5)
        >>> params = {"w": torch.tensor([1.0, 1.0])}
        >>> opt_state = opt.init(params)
        >>> grads = {"w": torch.tensor([4.0, 0.0])}
        >>> new, opt_state, info = funcamp.unscale_and_step(s, opt, grads, opt_state, params)
        >>> new["w"], info.found_inf, info.grad_norm
        (tensor([0.5000, 1.0000]), tensor(False), tensor(1.))
        >>> bad = {"w": torch.tensor([float("nan"), 0.0])}
        >>> funcamp.unscale_and_step(s, opt, bad, opt_state, new)[0]["w"]
        tensor([0.5000, 1.0000])

        Donating grads that nobody else holds (here made on the spot) skips their copy:

        >>> new, opt_state, info = funcamp.unscale_and_step(
        ...     s, opt, {"w": torch.tensor([4.0, 0.0])}, opt_state, new, donate_grads=True
        ... )
        >>> new["w"]
        tensor([0., 1.])
    """
    api = "unscale_and_step"
    caps, flat = _check_step_args(api, state, optimizer, grads, params, donate_grads, donate_state)
    check_flag(api, "grad_norm", grad_norm)
    # Everything that can refuse these inputs runs before the grads are touched (donated grads
    # are unscaled in place) and before anything is written (donate_state): the optimizer state
    # is checked against the params, and the learning rate evaluated, here.
    bad_lr = None if caps.preflight is None else caps.preflight(grads, opt_state, params)
    if donate_state and not compiling():
        shared = _sharing_memory({"params": params, "opt_state": opt_state})
        if shared is not None:
            raise ValueError(
                f"funcamp.{api}: with donate_state=True the new values are written into the "
                f"tensors of `params` and `opt_state`, but {shared[0]} and {shared[1]} share "
                "memory; give each its own tensor (clone) or pass donate_state=False"
            )
    leaves, spec, idx = _floating(grads, flat)
    floating = [leaves[i] for i in idx]
    # The execution path, chosen once: eager (torch's fused unscale kernel, in-place reuse of
    # this step's temporaries, the optimizer's fused kernel on a donated state) or traced (pure
    # ops; under compile inductor fuses the whole step anyway). Results are identical.
    # (Under torch.compile the answer is "traced" without looking at the inputs.)
    traced = compiling()
    inputs = (
        [] if traced else update_tensors(params) + update_tensors(opt_state) + update_tensors(state)
    )
    eager = not traced and _fused_unscale(floating + inputs)
    taken: set[int | None] = set()
    donate = False
    if eager:
        taken = {_storage_key(x) for x in inputs}
        donate = donate_grads and _disjoint(floating, taken)
        if not donate:
            taken.update(_storage_key(x) for x in floating)
    out, found_inf = _unscale_leaves(floating, state.scale, eager, donate=donate)
    unscaled = unflatten(spec, _refill(leaves, idx, out))
    if group is not None:
        found_inf = any_across(found_inf, group)
    if bad_lr is not None:  # a NaN/inf/negative tensor learning rate: the step is skipped
        found_inf = found_inf | bad_lr.to(found_inf.device)
    # Before the optimizer: on the eager path it may overwrite the unscaled grads in place.
    if across is not None:  # shards: the flag and the norm over every rank, in one all-reduce
        found_inf, total = across.reduce(found_inf, [x.float().square().sum() for x in out])
        norm = total.sqrt() if grad_norm else None
    else:
        norm = _global_norm(out, state.scale.device, eager) if grad_norm else None
    info = StepInfo(found_inf, norm)
    if eager and donate_state and caps.fused_step is not None:
        new_state = caps.fused_step(out, opt_state, params, found_inf)
        if new_state is not None:
            return params, new_state, info
    with summing_across(across):
        if eager:
            params_out, opt_state_out = _step_eager(
                optimizer, unscaled, opt_state, params, found_inf, taken, out
            )
        else:
            params_out, opt_state_out = _step_traced(
                optimizer, unscaled, opt_state, params, found_inf
            )
    if donate_state:
        # Both trees are matched before either is written: all or nothing.
        write_params = _plan_write(params_out, params)
        write_opt_state = _plan_write(opt_state_out, opt_state)
        params_out, opt_state_out = write_params(), write_opt_state()
    return params_out, opt_state_out, info


def _check_step_args(
    api: str,
    state: Any,
    optimizer: Any,
    grads: PyTree,
    params: PyTree,
    donate_grads: Any,
    donate_state: Any,
) -> tuple[Any, tuple[list[Any], Any]]:
    """Validate :func:`unscale_and_step`'s arguments; returns the optimizer's capabilities and
    the grads flattened (leaves, treespec)."""
    _check_scaler(api, state)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"funcamp.{api}: `optimizer` must be a funcamp.Optimizer, got {describe(optimizer)}"
        )
    check_flag(api, "donate_grads", donate_grads)
    check_flag(api, "donate_state", donate_state)
    return optimizer.capabilities, check_grads_match(api, grads, params)


def _step_traced(
    optimizer: Optimizer, unscaled: PyTree, opt_state: PyTree, params: PyTree, found_inf: Any
) -> tuple[PyTree, PyTree]:
    """The traced path: update, apply and select, all pure."""
    updates, new_opt_state = optimizer.update(unscaled, opt_state, params)
    new_params = apply_updates(params, updates)
    return (
        tree_select(found_inf, params, new_params),
        tree_select(found_inf, opt_state, new_opt_state),
    )


def _step_eager(
    optimizer: Optimizer,
    unscaled: PyTree,
    opt_state: PyTree,
    params: PyTree,
    found_inf: torch.Tensor,
    taken: set[int | None],
    grads: list[torch.Tensor],
) -> tuple[PyTree, PyTree]:
    """The eager path: the unscaled ``grads`` are this step's own (or donated), so an optimizer
    that declares ``update_owned`` may overwrite them; one that declares ``fresh`` returns only
    new tensors or its inputs' leaves, so each new tensor that shares memory with no input and no
    other output is ours to reuse: a delta receives its new param (after the skip mask), a new
    state leaf its selection."""
    caps = optimizer.capabilities
    if caps.update_owned is not None:
        updates, new_opt_state = caps.update_owned(unscaled, opt_state, params, grads)
    else:
        updates, new_opt_state = optimizer.update(unscaled, opt_state, params)
    owned = None
    if caps.fresh:
        made = update_tensors(updates) + update_tensors(new_opt_state)
        if eager_path(made):
            ours = {id(x) for x, ok in zip(made, exclusive(made, [])) if ok}
            taken_now = taken

            def owned(x: torch.Tensor) -> bool:
                return id(x) in ours and _storage_key(x) not in taken_now

    new_params, fresh, done = apply_updates_owned(
        params, updates, owned, _skip_mask(found_inf) if owned is not None else None
    )
    params_out = _select(
        found_inf, params, new_params, lambda x: id(x) in fresh, lambda x: id(x) in done
    )
    opt_state_out = _select(found_inf, opt_state, new_opt_state, owned or (lambda x: False))
    return params_out, opt_state_out
