"""torch.optim's per-param state as funcamp's optimizer state, and back, by one table.

:data:`TORCH_STATES` maps a torch optimizer class to the keys torch keeps for each param, in
torch's order, and to funcamp's field for each (the same name unless renamed). It is derived
from :data:`funcamp.optim.REGISTRY` (each entry's ``torch_state``, ``renamed``, ``computed``).
A funcamp field that is a params-shaped dict takes each param's tensor; a 0-d field (NAdam's
``mu_product``) takes the value every param holds; ``step`` is funcamp's one ``count`` per param
group; a key funcamp computes from the count instead of keeping (ASGD's ``eta`` and ``mu``) is
written back by its function in ``_DERIVED``.

The funcamp state is the one :func:`funcamp.optim.from_torch`'s optimizer builds: a group's
state alone, a :class:`~funcamp.optim.MultiTransformState` of ``"group<i>"`` states, or a
:class:`~funcamp.optim.PlateauState` around one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.optimizer import _default_to_fused_or_foreach

from funcamp._core.tree import describe
from funcamp.optim._plateau import PlateauState
from funcamp.optim._registry import REGISTRY
from funcamp.optim._transforms import MultiTransformState

__all__ = [
    "StateKeys",
    "TORCH_STATES",
    "check_groups",
    "group_names",
    "group_states",
    "opt_state_from_torch",
    "opt_state_to_torch",
    "plain",
    "torch_steps",
    "with_group_states",
]


class StateKeys(NamedTuple):
    """The per-param state one torch optimizer keeps.

    Attributes:
        keys: torch's keys in torch's order, ``"step"`` among them where torch counts steps.
        rename: torch key -> funcamp field, where the names differ.
        derived: ``(group, count) -> {key: value}`` for the keys funcamp computes from the
            count instead of keeping; ``group`` is the torch param group.
    """

    keys: tuple[str, ...]
    rename: Mapping[str, str] = {}
    derived: Callable[[Mapping[str, Any], int], dict[str, Any]] | None = None


def _scalar_dtype() -> torch.dtype:
    """torch.optim's dtype for its 0-d state (``_get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _asgd(group: Mapping[str, Any], count: int) -> dict[str, Any]:
    """ASGD's ``eta`` and ``mu`` as its step leaves them after ``count`` steps, for a next step
    at the group's learning rate (funcamp's ``asgd`` computes them from the count)."""
    lr, lambd, alpha, t0 = group["lr"], group["lambd"], group["alpha"], group["t0"]
    step = float(count)
    # the foreach step computes eta from its step tensor (tensor math), the for-loop one from
    # the step's Python float
    t = torch.tensor(step, dtype=_scalar_dtype()) if _foreach_group(group) else step
    return {
        "eta": torch.as_tensor(lr / ((1 + lambd * lr * t) ** alpha)),
        "mu": torch.as_tensor(1 / max(1, step - t0)),
    }


def _foreach_group(group: Mapping[str, Any]) -> bool:
    """Whether torch runs the group's foreach step (its default where ``foreach`` is None)."""
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    params = list(group["params"])
    return _default_to_fused_or_foreach(params, bool(group.get("differentiable")), False)[1]


#: registered name -> ``(group, count) -> {key: value}`` for its computed keys
_DERIVED: dict[str, Callable[[Mapping[str, Any], int], dict[str, Any]]] = {"asgd": _asgd}

#: torch optimizer class (or, for one outside torch, ``"module.QualName"``) -> its state keys.
TORCH_STATES: dict[type | str, StateKeys] = {
    e.torch: StateKeys(e.torch_state, dict(e.renamed), _DERIVED.get(e.name))
    for e in REGISTRY.values()
    if e.torch is not None and e.torch_state
}


def state_keys(api: str, optimizer: torch.optim.Optimizer) -> StateKeys:
    cls = type(optimizer)
    found = TORCH_STATES.get(cls) or TORCH_STATES.get(f"{cls.__module__}.{cls.__qualname__}")
    if found is None:
        known = sorted(c if isinstance(c, str) else c.__name__ for c in TORCH_STATES)
        raise ValueError(
            f"funcamp.{api}: `optimizer` {cls.__name__}'s state has no funcamp translation "
            f"(it knows {known}); move the params alone with funcamp.params_and_buffers"
        )
    return found


def plain(x: Any) -> Any:
    """A DTensor's whole value (every rank must call); anything else as it is."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def group_names(
    api: str, optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]
) -> list[list[str]]:
    """The names of each param group's params, in the group's order."""
    names = {id(v): k for k, v in params.items()}
    out = []
    for i, group in enumerate(optimizer.param_groups):
        row = []
        for j, p in enumerate(group["params"]):
            if id(p) not in names:
                raise ValueError(
                    f"funcamp.{api}: `optimizer` param group {i}'s param {j} ({describe(p)}) "
                    "is not a parameter of `module`; build the optimizer on "
                    "module.parameters()"
                )
            row.append(names[id(p)])
        out.append(row)
    return out


# ------------------------------------------------------------------ funcamp's state, by group


def group_states(opt_state: Any) -> list[Any]:
    """The per-group states of a state :func:`funcamp.optim.from_torch`'s optimizer built."""
    if isinstance(opt_state, PlateauState):
        return group_states(opt_state.inner)
    if isinstance(opt_state, MultiTransformState):
        return [opt_state.inner[f"group{i}"] for i in range(len(opt_state.inner))]
    return [opt_state]


def with_group_states(opt_state: Any, states: Sequence[Any]) -> Any:
    """``opt_state`` with its per-group states replaced (the inverse of :func:`group_states`)."""
    if isinstance(opt_state, PlateauState):
        return opt_state._replace(inner=with_group_states(opt_state.inner, states))
    if isinstance(opt_state, MultiTransformState):
        return MultiTransformState({f"group{i}": s for i, s in enumerate(states)})
    (state,) = states
    return state


def _field(keys: StateKeys, key: str) -> str:
    return keys.rename.get(key, key)


def _unused(value: Any, param: torch.Tensor) -> bool:
    """A funcamp field torch keeps no key for: ``()`` (not in use: momentum 0, no amsgrad), or
    an empty vector for a param that is not empty (Adafactor's factored moments)."""
    if not isinstance(value, torch.Tensor):
        return value == ()
    return value.shape == (0,) and param.numel() != 0


# ------------------------------------------------------------------------- torch -> funcamp


def torch_steps(
    api: str,
    optimizer: torch.optim.Optimizer,
    names: list[list[str]],
) -> list[int | None]:
    """Each group's step count as torch keeps it (the same for all its params; 0 before the
    first step), or None for an optimizer that keeps none (SGD, Muon)."""
    keys = state_keys(api, optimizer)
    out: list[int | None] = []
    for i, (group, row) in enumerate(zip(optimizer.param_groups, names)):
        states = [(n, optimizer.state.get(p, {})) for n, p in zip(row, group["params"])]
        held = [n for n, s in states if s]
        if held and len(held) != len(states):
            empty = next(n for n, s in states if not s)
            raise ValueError(
                f"funcamp.{api}: `optimizer` param group {i} holds state for {held[0]!r} but "
                f"none for {empty!r} (torch skips a param whose grad is None): funcamp steps "
                "every param of a group together; give every param a gradient (or leave it out "
                "of the optimizer) before moving the run"
            )
        if "step" not in keys.keys:
            out.append(None)
            continue
        steps = [(n, _step_value(api, n, s["step"])) for n, s in states if "step" in s]
        if len({v for _, v in steps}) > 1:
            (a, x), (b, y) = steps[0], next(s for s in steps if s[1] != steps[0][1])
            raise ValueError(
                f"funcamp.{api}: the params of `optimizer` param group {i} have taken different "
                f"numbers of steps ({a!r}: {x}, {b!r}: {y}); funcamp keeps one step count per "
                "param group: put params that step apart in param groups of their own"
            )
        out.append(steps[0][1] if steps else 0)
    return out


def _step_value(api: str, name: str, step: Any) -> int:
    value = float(plain(step))
    if not value.is_integer() or not 0 <= value < 2**31:
        raise ValueError(
            f"funcamp.{api}: `optimizer`'s step for {name!r} must be a whole number of steps "
            f"below 2**31, got {value!r}"
        )
    return int(value)


def _taken(api: str, name: str, key: str, value: Any, like: torch.Tensor) -> torch.Tensor:
    value = plain(value)
    if not isinstance(value, torch.Tensor) or value.shape != like.shape:
        raise ValueError(
            f"funcamp.{api}: `optimizer`'s state[{key!r}] for {name!r} must be a tensor of "
            f"shape {tuple(like.shape)}, got {describe(value)}"
        )
    return value.detach().to(device=like.device, dtype=like.dtype).clone()


def _group_from_torch(
    api: str, keys: StateKeys, state: Any, row: list[str], params: list[Any], torch_state: Any
) -> Any:
    """One group's funcamp state (``state``, its template: count set) filled from torch's."""
    fields = dict(state._asdict())
    for key in keys.keys:
        field = _field(keys, key)
        if key == "step" or field not in fields:  # the count, or a key derived from it
            continue
        value = fields[field]
        if isinstance(value, torch.Tensor) and value.dim() == 0:  # one value for the group
            held = [(n, torch_state[p][key]) for n, p in zip(row, params) if key in torch_state[p]]
            if held:
                got = [_taken(api, n, key, v, value) for n, v in held]
                other = next((i for i, g in enumerate(got) if not torch.equal(got[0], g)), None)
                if other is not None:
                    raise ValueError(
                        f"funcamp.{api}: `optimizer`'s state[{key!r}] differs between the "
                        f"params of one group ({held[0][0]!r}: {got[0].item()}, "
                        f"{held[other][0]!r}: {got[other].item()}); funcamp keeps one per "
                        "param group"
                    )
                fields[field] = got[0]
            continue
        new = dict(value) if isinstance(value, dict) else value
        for n, p in zip(row, params):
            s = torch_state[p]
            if not s:
                continue  # no step taken yet: funcamp's initial state
            if not isinstance(new, dict) or _unused(new[n], p):
                if s.get(key) is not None:
                    raise ValueError(
                        f"funcamp.{api}: `optimizer` holds state[{key!r}] for {n!r}, which its "
                        "hyperparameters do not use (funcamp's translation keeps none): was the "
                        "group changed after it stepped?"
                    )
                continue
            if s.get(key) is None:
                raise ValueError(
                    f"funcamp.{api}: `optimizer`'s state for {n!r} has no {key!r}, which its "
                    f"hyperparameters use; got the keys {sorted(s)}"
                )
            new[n] = _taken(api, n, key, s[key], new[n])
        fields[field] = new
    _refuse_unknown(api, keys, row, params, torch_state)
    return type(state)(**fields)


def _refuse_unknown(
    api: str, keys: StateKeys, row: list[str], params: list[Any], torch_state: Any
) -> None:
    for n, p in zip(row, params):
        extra = sorted(set(torch_state[p]) - set(keys.keys))
        if extra:
            raise ValueError(
                f"funcamp.{api}: `optimizer`'s state for {n!r} holds {extra}, which funcamp's "
                f"translation does not know (it knows {list(keys.keys)})"
            )


def opt_state_from_torch(
    api: str,
    optimizer: torch.optim.Optimizer,
    names: list[list[str]],
    opt_state: Any,
    counts: Sequence[int],
) -> Any:
    """``opt_state`` (the translated optimizer's initial state) holding ``optimizer``'s state,
    each group's count set to ``counts[i]``."""
    keys = state_keys(api, optimizer)
    states = []
    for group, row, state, count in zip(
        optimizer.param_groups, names, group_states(opt_state), counts
    ):
        state = state._replace(count=torch.full_like(state.count, count))
        params = list(group["params"])
        torch_state = {p: optimizer.state.get(p, {}) for p in params}
        states.append(_group_from_torch(api, keys, state, row, params, torch_state))
    return with_group_states(opt_state, states)


# ------------------------------------------------------------------------- funcamp -> torch


def _like_param(value: torch.Tensor, p: torch.Tensor, old: Any) -> torch.Tensor:
    """``value`` as torch keeps the state of ``p``: the dtype of the tensor it replaces (else
    the param's), on the param's device, sharded as the param (a DTensor param)."""
    value = plain(value)
    dtype = old.dtype if isinstance(old, torch.Tensor) else p.dtype
    if isinstance(p, DTensor):
        value = value.to(dtype=dtype, device=p.to_local().device)
        return distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
    return value.detach().to(dtype=dtype, device=p.device).clone()


def _scalar(value: Any, p: torch.Tensor, old: Any, group: Mapping[str, Any]) -> torch.Tensor:
    """A 0-d state entry (``step``, ``mu_product``, ``eta``): the dtype and device of the one it
    replaces; else torch's scalar dtype, on the param's device where torch keeps it there
    (``fused``/``capturable``)."""
    if isinstance(old, torch.Tensor):
        return torch.as_tensor(value).to(dtype=old.dtype, device=old.device).clone()
    on_device = group.get("fused") or group.get("capturable")
    device = p.to_local().device if isinstance(p, DTensor) else p.device
    return (
        torch.as_tensor(value)
        .to(dtype=_scalar_dtype(), device=device if on_device else "cpu")
        .clone()
    )


def _group_to_torch(
    keys: StateKeys, state: Any, group: Mapping[str, Any], row: list[str], torch_state: Any
) -> None:
    count = int(plain(state.count))
    derived = keys.derived(group, count) if keys.derived is not None and count > 0 else {}
    fields = state._asdict()
    for n, p in zip(row, group["params"]):
        old = torch_state.get(p, {})
        if count == 0 and "step" not in old:  # torch builds it at the first step (but Adagrad)
            torch_state.pop(p, None)
            continue
        new: dict[str, Any] = {}
        for key in keys.keys:
            if key == "step":
                new[key] = _scalar(float(count), p, old.get(key), group)
            elif key in derived:
                new[key] = _scalar(derived[key], p, old.get(key), group)
            else:
                value = fields.get(_field(keys, key), ())
                if isinstance(value, torch.Tensor) and value.dim() == 0:
                    new[key] = _scalar(plain(value), p, old.get(key), group)
                elif isinstance(value, dict) and not _unused(value[n], p):
                    new[key] = _like_param(value[n], p, old.get(key))
        torch_state[p] = new


def check_groups(
    api: str, opt_state: Any, optimizer: torch.optim.Optimizer, names: list[list[str]]
) -> None:
    """``optimizer``'s param groups must hold the params of the state's groups."""
    state_keys(api, optimizer)
    states = group_states(opt_state)
    if len(states) != len(optimizer.param_groups):
        raise ValueError(
            f"funcamp.{api}: `optimizer` must have the param groups the state was built for "
            f"({len(states)}), got {len(optimizer.param_groups)}"
        )
    for i, (state, row) in enumerate(zip(states, names)):
        held = next((set(v) for v in state if isinstance(v, dict)), None)
        if held is not None and held != set(row):
            raise ValueError(
                f"funcamp.{api}: `optimizer` param group {i} must hold the params of the "
                f"state's group {i} ({sorted(held)[:3]}...), got {row[:3]}..."
            )


def opt_state_to_torch(
    api: str, opt_state: Any, optimizer: torch.optim.Optimizer, names: list[list[str]]
) -> None:
    """Write ``opt_state`` into ``optimizer.state`` (each param's entry replaced; see
    :func:`check_groups`)."""
    keys = state_keys(api, optimizer)
    states = group_states(opt_state)
    with torch.no_grad():
        for group, row, state in zip(optimizer.param_groups, names, states):
            _group_to_torch(keys, state, group, row, optimizer.state)
