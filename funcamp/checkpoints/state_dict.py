"""Checkpoints of any pytree as plain nested dicts, loadable with ``torch.load(weights_only=True)``.

``state_dict(tree)`` turns every container into a ``dict``, with tensors and Python
scalars/strings/``None`` as values. Dict keys are kept. Sequence indices become ``"0"``, ``"1"``,
.... NamedTuple and :class:`~funcamp.ScalerState` fields go by name.
:class:`~funcamp.ScalerState`'s static configuration is saved next to its tensors.
``load_state_dict(template, sd)`` rebuilds the tree with the template's container types. It
checks the structure, tensor shapes and dtypes on the way, and names the path of the first
mismatch.
"""

from __future__ import annotations

import collections
from typing import Any

import optree
import torch

from funcamp._core.donation import refuse_consumed
from funcamp._core.tree import NAMESPACE, PyTree, describe
from funcamp.scaling.state import CONFIG, LEAVES, ScalerState, check_scaler_values

__all__ = ["encode", "load_state_dict", "state_dict"]

_SCALARS = (bool, int, float, str, type(None))
_ROOT_LEAF_KEY = "value"


def _path(path: tuple[Any, ...]) -> str:
    if not path:
        return "<root>"
    return "".join(f"[{k!r}]" for k in path)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, *_SCALARS))


def _save_tensor(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    # A view of a bigger storage (a slice, a member of a vmapped stack) would save it all.
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _children(node: Any, path: tuple[Any, ...], api: str) -> tuple[list[Any], list[Any]]:
    """(keys, children) of a container node, in the order they are saved."""
    if isinstance(node, ScalerState):
        return list(LEAVES), [getattr(node, k) for k in LEAVES]
    if _is_namedtuple(node):
        return list(node._fields), list(node)
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(
                    f"funcamp.{api}: dict keys must be str or int, got {key!r} at {_path(path)}"
                )
        return list(node), list(node.values())
    if isinstance(node, (list, tuple)):
        return [str(i) for i in range(len(node))], list(node)
    if optree.tree_is_leaf(node, namespace=NAMESPACE):
        raise TypeError(
            f"funcamp.{api}: leaf {_path(path)} must be a tensor, a Python scalar, a string or "
            f"None, got {describe(node)}"
        )
    out = optree.tree_flatten_one_level(node, namespace=NAMESPACE)
    return [str(e) for e in out.entries], list(out.children)


def _encode(node: Any, path: tuple[Any, ...], api: str) -> Any:
    if isinstance(node, torch.Tensor):
        return _save_tensor(node)
    if isinstance(node, _SCALARS):
        return node
    if isinstance(node, ScalerState):  # the key of a donated state (funcamp._core.donation)
        where = f" at {_path(path[:-1])}" if len(path) > 1 else ""
        refuse_consumed(api, node, f"the state{where}")
    keys, children = _children(node, path, "state_dict")
    encoded = {k: _encode(c, (*path, k), api) for k, c in zip(keys, children)}
    if isinstance(node, ScalerState):
        encoded.update({name: getattr(node, name) for name in CONFIG})
    return encoded


def state_dict(tree: PyTree) -> dict[str, Any]:
    """Return ``tree`` as a plain nested dict of tensors and Python scalars/strings/None.

    Works for any pytree: dicts, lists, tuples, NamedTuples, :class:`~funcamp.ScalerState` (its
    static configuration included) and other nodes registered in the ``"funcamp"`` optree
    namespace. The result saves with ``torch.save`` and loads with
    ``torch.load(..., weights_only=True)``. A bare leaf is saved as ``{"value": leaf}``. A
    :class:`~funcamp.TrainState` donated to a train step is refused (see ``make_train_step``).

    Example:
        >>> import torch, funcamp
        >>> tree = {"params": {"w": torch.ones(2)}, "scaler": funcamp.ScalerState.static(8.0)}
        >>> sd = funcamp.state_dict(tree)
        >>> sd["params"]["w"], sd["scaler"]["scale"], sd["scaler"]["kind"]
        (tensor([1., 1.]), tensor(8.), 'static')
    """
    return encode(tree, "state_dict")


def encode(tree: PyTree, api: str) -> dict[str, Any]:
    """:func:`state_dict` for ``funcamp.<api>``: refuses a state donated to a train step."""
    encoded = _encode(tree, (), api)
    return {_ROOT_LEAF_KEY: encoded} if _is_leaf(tree) else encoded


def _mismatch(path: tuple[Any, ...], expected: str, got: Any) -> ValueError:
    return ValueError(
        f"funcamp.load_state_dict: `sd` at {_path(path)} must be {expected}, got {describe(got)}"
    )


def _decode_leaf(template: Any, value: Any, path: tuple[Any, ...]) -> Any:
    if isinstance(template, torch.Tensor):
        expected = f"a tensor of shape {tuple(template.shape)} and dtype {template.dtype}"
        if (
            not isinstance(value, torch.Tensor)
            or value.shape != template.shape
            or value.dtype != template.dtype
        ):
            raise _mismatch(path, expected, value)
        return value.detach().to(template.device)
    kind = type(template)
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:
        raise _mismatch(path, f"a {kind.__name__} like the template", value)
    return value


def _holds_nothing(tree: Any) -> bool:
    return not optree.tree_leaves(tree, namespace=NAMESPACE)


def _decode(template: Any, value: Any, path: tuple[Any, ...]) -> Any:
    if _is_leaf(template):
        return _decode_leaf(template, value, path)
    keys, children = _children(template, path, "load_state_dict")
    expected_keys = list(keys)
    if isinstance(template, ScalerState):
        expected_keys += list(CONFIG)
    if not isinstance(value, dict):
        raise _mismatch(path, f"a dict with keys {expected_keys}", value)
    missing = [k for k in expected_keys if k not in value]
    unexpected = [k for k in value if k not in expected_keys]
    if missing and _is_namedtuple(template):
        # A field added in a later release with a default (TrainState.fp8) is absent from older
        # checkpoints: when the template holds no tensors there either, nothing is lost by
        # taking the template's value, so those checkpoints still load.
        kept = dict(zip(keys, children))
        added = [k for k in missing if k in template._field_defaults and _holds_nothing(kept[k])]
        value = {**value, **{k: _encode(kept[k], (*path, k), "load_state_dict") for k in added}}
        missing = [k for k in missing if k not in added]
    if missing or unexpected:
        where = _path((*path, (missing or unexpected)[0]))
        raise ValueError(
            f"funcamp.load_state_dict: `sd` must have the structure of `template`: "
            f"{'missing' if missing else 'unexpected'} key at {where} "
            f"(missing {missing}, unexpected {unexpected})"
        )
    decoded = [_decode(c, value[k], (*path, k)) for k, c in zip(keys, children)]

    if isinstance(template, ScalerState):
        config = {name: value[name] for name in CONFIG}
        try:
            state = ScalerState(*decoded, **config)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"funcamp.load_state_dict: invalid ScalerState configuration at {_path(path)}: {e}"
            ) from e
        # The values too (a checkpoint is outside input): a zero, negative or NaN scale, or a
        # tracker out of range, would train wrongly without an error.
        check_scaler_values("load_state_dict", state, arg="sd" + (_path(path) if path else ""))
        return state
    if _is_namedtuple(template):
        return type(template)(*decoded)
    if isinstance(template, collections.defaultdict):
        return collections.defaultdict(template.default_factory, zip(keys, decoded))
    if isinstance(template, dict):
        items = dict(zip(keys, decoded))
        return items if type(template) is dict else type(template)(items)
    if isinstance(template, (list, tuple)):
        return type(template)(decoded)
    out = optree.tree_flatten_one_level(template, namespace=NAMESPACE)
    return out.unflatten_func(out.metadata, decoded)


def load_state_dict(template: PyTree, sd: dict[str, Any]) -> PyTree:
    """Rebuild a pytree from :func:`state_dict` output, with ``template``'s structure.

    ``template`` supplies the container types (and, for tensors, the device to load onto).
    ``sd`` supplies the values, including each :class:`~funcamp.ScalerState`'s saved
    configuration. Keys, tensor shapes and dtypes, and scalar types must match the template. The
    first mismatch raises ``ValueError`` naming its path.

    Example:
        >>> import io, torch, funcamp
        >>> tree = {"w": torch.ones(2), "scaler": funcamp.ScalerState.dynamic(growth_interval=7)}
        >>> buf = io.BytesIO()
        >>> torch.save(funcamp.state_dict(tree), buf)
        >>> _ = buf.seek(0)
        >>> sd = torch.load(buf, weights_only=True)
        >>> template = {"w": torch.zeros(2), "scaler": funcamp.ScalerState.dynamic()}
        >>> out = funcamp.load_state_dict(template, sd)
        >>> out["w"], out["scaler"].growth_interval
        (tensor([1., 1.]), 7)
    """
    if not isinstance(sd, dict):
        raise TypeError(f"funcamp.load_state_dict: `sd` must be a dict, got {describe(sd)}")
    if _is_leaf(template):
        if set(sd) != {_ROOT_LEAF_KEY}:
            raise ValueError(
                f"funcamp.load_state_dict: `sd` for a bare leaf must be "
                f"{{'{_ROOT_LEAF_KEY}': ...}}, got keys {list(sd)}"
            )
        return _decode_leaf(template, sd[_ROOT_LEAF_KEY], ())
    return _decode(template, sd, ())
