"""The loss-scaler state: :class:`ScalerState`, an immutable pytree.

It is a frozen dataclass registered with optree (namespace ``"funcamp"``) and
``torch.utils._pytree``. Its tensors are leaves, and its configuration is static metadata. So it
survives flatten/unflatten, ``torch.compile``, ``torch.func.vmap`` and checkpoints whole. It
converts to and from ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import optree
import torch
import torch.utils._pytree as torch_pytree

from funcamp._core.checks import check_int, check_real
from funcamp._core.tree import (
    NAMESPACE,
    describe,
)
from funcamp.policy.policy import get_policy

__all__ = ["CONFIG", "Kind", "LEAVES", "ScalerState", "check_scaler_leaves", "check_scaler_values"]

Kind = Literal["dynamic", "static", "noop"]

_KINDS = ("dynamic", "static", "noop")

#: The state's leaves, in order, each a 0-d tensor of its dtype (the one list of them).
LEAVES = {
    "scale": torch.float32,
    "growth_tracker": torch.int32,
    "hysteresis_tracker": torch.int32,
    "skipped": torch.int32,
}

CONFIG = (
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


@dataclasses.dataclass(frozen=True, eq=False)
class ScalerState:
    """Immutable loss-scaler state: four 0-d tensor leaves and static configuration.

    Leaves (threaded through the step, traced by ``torch.compile``):

    * ``scale``: 0-d float32, the current loss scale.
    * ``growth_tracker``: 0-d int32, clean steps since the scale last changed (torch's name).
    * ``hysteresis_tracker``: 0-d int32, overflows still tolerated before backing off.
    * ``skipped``: 0-d int32, running total of skipped (non-finite) steps.

    Static configuration is pytree metadata, a compile-time constant. It holds ``kind``
    (``"dynamic"``, ``"static"`` or ``"noop"``), ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``min_scale``, ``max_scale`` (``None`` for unbounded) and ``hysteresis``.

    All three kinds skip steps whose gradients are non-finite. ``static`` keeps its scale
    forever. ``noop`` is a static scale of 1: nothing is scaled, but ``found_inf`` is still
    computed and a non-finite step is still skipped. That protects bfloat16 and float32 training
    from a single NaN step destroying the parameters.

    Build one with :meth:`dynamic`, :meth:`static`, :meth:`noop`, :meth:`for_policy` or
    :meth:`from_grad_scaler`. The class is frozen; :func:`update` returns a new state.

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
        _validate_config("ScalerState", **dict(zip(CONFIG, self._config())))

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
                (Megatron-LM's rule). 1 is torch's rule: back off on every overflow.
            device: where the state's tensors live (default: the default device).

        Example:
            >>> import funcamp
            >>> s = funcamp.ScalerState.dynamic(2.0**10, hysteresis=2, min_scale=1.0)
            >>> float(s.scale), int(s.hysteresis_tracker), s.min_scale
            (1024.0, 2, 1.0)
        """
        api = "ScalerState.dynamic"
        config = {
            "kind": "dynamic",
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
            "min_scale": min_scale,
            "max_scale": max_scale,
            "hysteresis": hysteresis,
        }
        _validate_config(api, **config)
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
        return cls._build(init_scale, device, **_stored(config))

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

        The scale, growth tracker, factors and interval carry over exactly. A disabled scaler
        (empty state dict) becomes :meth:`noop`. ``skipped`` starts at 0, since GradScaler
        keeps no such count.

        Args:
            scaler_or_state_dict: a GradScaler or the dict its ``state_dict()`` returned.
            device: where the state's tensors live. Default: the device of the scaler's scale
                tensor when it has one, else the default device.

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
        check_real(
            api,
            "scale",
            raw_scale,
            low=0.0,
            low_open=True,
            high=_F32.max,
            hint="; a zero or negative scale gives wrong gradients and a NaN one skips every "
            "step: fix the GradScaler or start from ScalerState.dynamic()",
        )
        tracker = sd["_growth_tracker"]
        if isinstance(tracker, torch.Tensor) and tracker.numel() == 1:
            if tracker.is_floating_point() or tracker.dtype == torch.bool:
                raise TypeError(
                    f"funcamp.{api}: `_growth_tracker` must be an int, got {describe(tracker)}"
                )
            tracker = tracker.item()
        check_int(api, "_growth_tracker", tracker, minimum=0)
        # GradScaler has no bounds and no hysteresis: ScalerState's defaults
        config = {
            "kind": "dynamic",
            **{k: sd[k] for k in ("growth_factor", "backoff_factor", "growth_interval")},
            "min_scale": None,
            "max_scale": None,
            "hysteresis": 1,
        }
        _validate_config(api, **config)
        state = cls._build(float(raw_scale), device, **_stored(config))
        if tracker >= state.growth_interval:
            raise ValueError(
                f"funcamp.{api}: `_growth_tracker` must be < `growth_interval` "
                f"({state.growth_interval}), got {tracker}"
            )
        return dataclasses.replace(
            state, growth_tracker=torch.full_like(state.growth_tracker, tracker)
        )

    def to_grad_scaler_state_dict(self) -> dict[str, Any]:
        """Return the state as ``torch.amp.GradScaler.state_dict()`` would.

        It syncs with the host: use it for checkpointing, not inside a step. A ``noop`` scaler
        gives ``{}`` (a disabled GradScaler). GradScaler cannot represent a ``static`` scaler,
        hysteresis or scale bounds. Those raise ``ValueError`` rather than losing information.

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
        return tuple(getattr(self, name) for name in CONFIG)

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


def _flatten(state: ScalerState) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
    return [getattr(state, name) for name in LEAVES], state._config()


def _unflatten(config: tuple[Any, ...], leaves: Any) -> ScalerState:
    return ScalerState(*leaves, *config)


optree.register_pytree_node(
    ScalerState,
    lambda s: (*_flatten(s), tuple(LEAVES)),
    _unflatten,
    namespace=NAMESPACE,
)

torch_pytree.register_pytree_node(
    ScalerState,
    _flatten,
    lambda leaves, config: _unflatten(config, leaves),
    serialized_type_name="funcamp.ScalerState",
    flatten_with_keys_fn=lambda s: (
        [(torch_pytree.GetAttrKey(name), getattr(s, name)) for name in LEAVES],
        s._config(),
    ),
)


def _validate_init_scale(api: str, value: Any, arg: str = "init_scale") -> None:
    check_real(api, arg, value, low=0.0, low_open=True, high=_F32.max)


def _stored(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as the state stores it: ints and floats (a ``None`` bound stays ``None``)."""
    ints = ("growth_interval", "hysteresis")
    return {
        k: v if v is None or k == "kind" else (int(v) if k in ints else float(v))
        for k, v in config.items()
    }


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
    check_real(api, "growth_factor", growth_factor, low=1.0, low_open=True)
    check_real(
        api, "backoff_factor", backoff_factor, low=0.0, high=1.0, low_open=True, high_open=True
    )
    check_int(api, "growth_interval", growth_interval, minimum=1)
    check_int(api, "hysteresis", hysteresis, minimum=1)
    for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
        if bound is not None:  # None, or a normal float32 value
            check_real(api, name, bound, low=_F32.tiny, high=_F32.max)
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(
            f"{prefix} `min_scale` must be <= `max_scale` ({max_scale!r}), got {min_scale!r}"
        )


def check_scaler(api: str, state: Any) -> None:
    if not isinstance(state, ScalerState):
        raise TypeError(f"funcamp.{api}: `state` must be a ScalerState, got {describe(state)}")
    check_scaler_leaves(api, state)  # metadata only: 0-d tensors of the right dtypes


def check_found_inf(api: str, found_inf: Any) -> None:
    if (
        not isinstance(found_inf, torch.Tensor)
        or found_inf.dtype != torch.bool
        or found_inf.dim() != 0
    ):
        raise TypeError(
            f"funcamp.{api}: `found_inf` must be a 0-d bool tensor, got {describe(found_inf)}"
        )


def check_scaler_leaves(api: str, state: Any, arg: str = "state") -> None:
    """Each leaf of a ScalerState must be a 0-d tensor of its dtype (metadata only)."""
    for name, dtype in LEAVES.items():
        x = getattr(state, name)
        if not isinstance(x, torch.Tensor) or x.dim() != 0 or x.dtype != dtype:
            raise TypeError(
                f"funcamp.{api}: `{arg}.{name}` must be a 0-d {dtype} tensor, got "
                f"{describe(x)}; build scaler states with ScalerState.dynamic/static/noop (or "
                "from_grad_scaler / load_state_dict), not positionally"
            )


def check_scaler_values(api: str, state: Any, arg: str = "state") -> None:
    """Value checks for a ScalerState coming in from outside (a checkpoint, a GradScaler).

    It reads the four scalars: a host sync, at load time only, never on the step path. A stacked
    state (the leaves of several states, as ``vmap`` makes) is checked element by element.
    """
    for name, dtype in LEAVES.items():
        x = getattr(state, name)
        if not isinstance(x, torch.Tensor) or x.dtype != dtype:
            raise TypeError(
                f"funcamp.{api}: `{arg}.{name}` must be a {dtype} tensor, got {describe(x)}"
            )

    def worst(x: torch.Tensor, bad: torch.Tensor) -> Any:
        """The first offending value (a Python number), or None when there is none."""
        bad = bad.reshape(-1).cpu()
        if not bool(bad.any()):
            return None
        return x.reshape(-1).cpu()[bad][0].item()

    scale = state.scale.detach().to(torch.float64)
    f32max = torch.finfo(torch.float32).max
    v = worst(scale, ~(torch.isfinite(scale) & (scale > 0) & (scale <= f32max)))
    if v is not None:
        raise ValueError(
            f"funcamp.{api}: `{arg}.scale` must be finite and > 0, got {v!r} (a zero or "
            "negative scale gives wrong gradients, a NaN one skips every step); start from a "
            "fresh ScalerState.dynamic() or fix the checkpoint"
        )
    if state.kind == "noop":
        v = worst(scale, scale != 1.0)
        if v is not None:
            raise ValueError(
                f"funcamp.{api}: `{arg}.scale` must be 1.0 for a 'noop' scaler, got {v!r}"
            )
    if state.kind == "dynamic":
        for bound, bad in (
            ("min_scale", None if state.min_scale is None else scale < state.min_scale),
            ("max_scale", None if state.max_scale is None else scale > state.max_scale),
        ):
            v = None if bad is None else worst(scale, bad)
            if v is not None:
                raise ValueError(
                    f"funcamp.{api}: `{arg}.scale` must respect `{bound}` "
                    f"({getattr(state, bound)!r}), got {v!r}"
                )
    for name, low, high, bound in (
        (
            "growth_tracker",
            0,
            state.growth_interval - 1,
            f"[0, growth_interval={state.growth_interval})",
        ),
        ("hysteresis_tracker", 0, state.hysteresis, f"[0, hysteresis={state.hysteresis}]"),
        ("skipped", 0, None, "[0, inf)"),
    ):
        x = getattr(state, name).detach()
        bad = x < low if high is None else (x < low) | (x > high)
        v = worst(x, bad)
        if v is not None:
            raise ValueError(f"funcamp.{api}: `{arg}.{name}` must be in {bound}, got {v}")
