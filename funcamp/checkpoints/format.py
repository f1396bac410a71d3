"""What a checkpoint file holds and how it is checked.

It holds the header (:class:`CheckpointInfo`: the policy, scaler kinds, versions, metadata) and
the checksum. This module reads it, and rebuilds a state from a loaded dict against its
template. The one-process and the multi-rank paths share it.
"""

from __future__ import annotations

import re
import warnings
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import torch

from funcamp._core.tree import PyTree
from funcamp._core.version import __version__
from funcamp.checkpoints.state_dict import load_state_dict, state_dict
from funcamp.policy.describe import describe_policy, policy_difference
from funcamp.policy.policy import Policy, as_policy
from funcamp.scaling.state import CONFIG, LEAVES

__all__ = ["CheckpointInfo"]


FORMAT = "funcamp.checkpoint"

FORMAT_VERSION = 1

HEADER = "funcamp.pt"  # the commit record of a multi-rank checkpoint directory

DATA_PREFIX = "data-"

TENSOR = "funcamp.tensor"  # placeholder tag in a multi-rank checkpoint's structure

#: What the stored CRC-32 (``"checksum"``) covers: in a checkpoint file, in a multi-rank header.
FILE_KEYS = ("info", "state")
HEADER_KEYS = ("info", "structure", "data")

_SCALER_KEYS = frozenset((*LEAVES, *CONFIG))


class CheckpointInfo(NamedTuple):
    """What a checkpoint records besides the state (see :func:`checkpoint_info`).

    Attributes:
        policy: the policy string it was saved under (``str(policy)``).
        policy_repr: ``repr(policy)``: also shows op-rule and module overrides.
        scaler_kind: the kind of its :class:`~funcamp.ScalerState` (``"dynamic"``,
            ``"static"``, ``"noop"``). ``None`` without one, or with several (see ``scalers``).
        scalers: every :class:`~funcamp.ScalerState` in the state, ``{path: kind}``.
        funcamp_version: the funcamp version that wrote it.
        torch_version: the torch version that wrote it.
        metadata: the keyword arguments given to :func:`save`.
        world_size: the number of ranks that wrote it (1 for a single file).
        policy_spec: the whole policy as plain data (dtypes, op table and op rules, module
            rules, FP8), what :func:`load` compares. ``None`` for older checkpoints.

    Example:
        >>> import os, tempfile, torch, funcamp
        >>> state = funcamp.TrainState.create({"w": torch.ones(1)}, funcamp.sgd(0.1), "bf16-true")
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> funcamp.save(path, state, policy="bf16-true", epoch=1)
        >>> info = funcamp.checkpoint_info(path)
        >>> info.policy, info.scalers, info.world_size
        ('params=bfloat16,compute=bfloat16,output=bfloat16', {'scaler': 'noop'}, 1)
    """

    policy: str
    policy_repr: str
    scaler_kind: str | None
    scalers: dict[str, str]
    funcamp_version: str
    torch_version: str
    metadata: dict[str, Any]
    world_size: int
    policy_spec: dict[str, Any] | None = None


def _scaler_kinds(sd: Any, path: tuple[str, ...] = ()) -> dict[str, str]:
    """``{path: kind}`` of every scaler state in a state dict (``"scaler"`` for a TrainState's)."""
    if _is_scaler_sd(sd):
        return {"/".join(path) or "<root>": sd["kind"]}
    out: dict[str, str] = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(_scaler_kinds(v, (*path, str(k))))
    return out


def header_info(sd: Any, policy: Policy, metadata: dict[str, Any], world: int) -> dict[str, Any]:
    return {
        "policy": str(policy),
        "policy_repr": repr(policy),
        "policy_spec": describe_policy(policy),
        "scalers": _scaler_kinds(sd),
        "funcamp_version": __version__,
        "torch_version": str(torch.__version__),
        "metadata": metadata,
        "world_size": world,
    }


def as_info(raw: dict[str, Any]) -> CheckpointInfo:
    scalers = dict(raw["scalers"])
    kinds = set(scalers.values())
    return CheckpointInfo(
        policy=raw["policy"],
        policy_repr=raw["policy_repr"],
        scaler_kind=kinds.pop() if len(scalers) == 1 else None,
        scalers=scalers,
        funcamp_version=raw["funcamp_version"],
        torch_version=raw["torch_version"],
        metadata=raw["metadata"],
        world_size=raw["world_size"],
        policy_spec=raw.get("policy_spec"),
    )


def parse_info(raw: dict[str, Any], api: str, where: str) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of a read checkpoint.

    A damaged key or value of the header gives a ``ValueError`` saying it is corrupted.
    """
    try:
        return as_info(raw["info"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(
            f"funcamp.{api}: {where} is corrupted (its header is damaged: {type(e).__name__} "
            f"{e}); load an earlier checkpoint"
        ) from e


def verify(raw: dict[str, Any], keys: tuple[str, ...], api: str, where: str) -> None:
    """Check the CRC-32 stored under ``raw["checksum"]`` against ``raw[k] for k in keys``."""
    try:
        ok = state_checksum([raw[k] for k in keys]) == raw["checksum"]
    except KeyError as e:
        raise ValueError(f"funcamp.{api}: {where} is corrupted (missing {e})") from e
    if not ok:
        raise ValueError(
            f"funcamp.{api}: {where} is corrupted (its contents do not match the CRC-32 stored "
            "when it was saved); load an earlier checkpoint"
        )


def verify_header(raw: dict[str, Any], keys: tuple[str, ...], api: str, where: str) -> None:
    """Check the header's own CRC-32 (``raw["info_checksum"]``).

    An older file without it is checked whole. ``keys`` is what ``raw["checksum"]`` covers.
    """
    if "info_checksum" not in raw:
        verify(raw, keys, api, where)
        return
    try:
        ok = state_checksum(raw["info"]) == raw["info_checksum"]
    except KeyError as e:
        raise ValueError(f"funcamp.{api}: {where} is corrupted (missing {e})") from e
    if not ok:
        raise ValueError(
            f"funcamp.{api}: {where} is corrupted (its header does not match the CRC-32 stored "
            "when it was saved); load an earlier checkpoint"
        )


def state_checksum(value: Any, crc: int = 0) -> int:
    """CRC-32 over every value of a nested state dict, in order (dtype, shape and bytes of each
    tensor; ``repr`` of everything else)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        crc = zlib.crc32(f"T{t.dtype}{tuple(t.shape)}".encode(), crc)
        if t.numel():
            flat = t.cpu().contiguous().reshape(-1).view(torch.uint8)
            crc = zlib.crc32(flat.numpy(), crc)
        return crc
    if isinstance(value, dict):
        crc = zlib.crc32(b"{", crc)
        for k, v in value.items():
            crc = state_checksum(v, zlib.crc32(repr(k).encode(), crc))
        return zlib.crc32(b"}", crc)
    if isinstance(value, (list, tuple)):
        crc = zlib.crc32(b"[" if isinstance(value, list) else b"(", crc)
        for v in value:
            crc = state_checksum(v, crc)
        return zlib.crc32(b"]", crc)
    return zlib.crc32(repr(value).encode(), crc)


def read_checkpoint(p: Path, api: str, *, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint's top-level dict, or a clear error for anything that is not one."""
    if not p.exists():
        raise FileNotFoundError(f"funcamp.{api}: no checkpoint at {str(p)!r}")
    try:
        raw = torch.load(p, weights_only=True, map_location="cpu", mmap=mmap)
    except Exception as e:
        raise ValueError(
            f"funcamp.{api}: {str(p)!r} is not a readable checkpoint (truncated or corrupted: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}); "
            "load an earlier one"
        ) from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(
            f"funcamp.{api}: {str(p)!r} is not a funcamp checkpoint (written by funcamp.save); "
            "for a plain funcamp.state_dict use torch.load and funcamp.load_state_dict"
        )
    version = raw.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"funcamp.{api}: {str(p)!r} has checkpoint format version {version!r}, newer than "
            f"this funcamp reads ({FORMAT_VERSION}); upgrade funcamp"
        )
    return raw


def header_path(p: Path) -> Path:
    return p / HEADER if p.is_dir() else p


def check_policy(info: CheckpointInfo, policy: Any, convert: bool, where: str) -> None:
    if policy is None:
        if convert:
            raise TypeError(
                "funcamp.load: convert=True needs `policy`, the policy to convert the state to"
            )
        return
    pol = as_policy(policy, "load")
    if info.policy_spec is not None:
        difference = policy_difference(info.policy_spec, describe_policy(pol))
    elif str(pol) != info.policy:  # a checkpoint from before funcamp stored the whole policy
        difference = f"policy: {info.policy!r} in the checkpoint, {str(pol)!r} in `policy`"
    elif repr(pol) != info.policy_repr:
        difference = f"policy: {info.policy_repr!r} in the checkpoint, {repr(pol)!r} in `policy`"
    else:
        difference = None
    if difference is None or convert:
        return
    given = f"`policy` is {str(pol)!r}" if str(pol) != info.policy else "`policy` differs"
    raise ValueError(
        f"funcamp.load: {where} was saved under policy {info.policy!r}, but {given}; first "
        f"difference: {difference}. Resume under the checkpoint's policy, or pass convert=True "
        "to cast the state to the new policy (floating tensors cast to the template's dtypes, a "
        "scaler of another kind replaced by the template's)"
    )


def _is_scaler_sd(node: Any) -> bool:
    return isinstance(node, dict) and set(node) == _SCALER_KEYS


def _convert(template_sd: Any, sd: Any) -> Any:
    """``sd`` moved towards ``template_sd``: floating tensors cast to the template's dtype,
    scaler states of another kind replaced by the template's. Anything else is left for
    :func:`load_state_dict` to check."""
    if isinstance(template_sd, torch.Tensor):
        if (
            isinstance(sd, torch.Tensor)
            and sd.is_floating_point()
            and template_sd.is_floating_point()
            and sd.shape == template_sd.shape
        ):
            return sd.to(template_sd.dtype)
        return sd
    if _is_scaler_sd(template_sd) and _is_scaler_sd(sd) and sd["kind"] != template_sd["kind"]:
        return template_sd
    if isinstance(template_sd, dict) and isinstance(sd, dict):
        return {k: _convert(template_sd[k], v) if k in template_sd else v for k, v in sd.items()}
    return sd


def _check_scalers(info: CheckpointInfo, template_sd: Any, where: str) -> None:
    want = _scaler_kinds(template_sd)
    for path, kind in info.scalers.items():
        if path in want and want[path] != kind:
            raise ValueError(
                f"funcamp.load: {where} holds a {kind!r} scaler at {path}, but the template's is "
                f"{want[path]!r}; build the template with that scaler (e.g. "
                f"TrainState.create(..., scaler=ScalerState.{kind}(...))), or pass convert=True "
                "with `policy` to start from the template's scaler"
            )


def _check_frozen_split(sd: Any, template_sd: Any, where: str) -> None:
    """A checkpoint written before ``TrainState.frozen`` existed holds every parameter in its
    params (and optimizer state for all of them): it cannot fill a template that keeps frozen
    params apart. Say so, and how to load it."""
    if not (isinstance(sd, dict) and isinstance(template_sd, dict)):
        return
    frozen = template_sd.get("frozen")
    if "frozen" in sd or not frozen or not isinstance(sd.get("params"), dict):
        return
    held = [name for name in frozen if name in sd["params"]]
    names = ", ".join(repr(n) for n in held[:3]) + (", ..." if len(held) > 3 else "")
    holds = f"the {len(held)} the template freezes ({names})" if held else "every one"
    raise ValueError(
        f"funcamp.load: {where} has no frozen parameters (TrainState.frozen, or it was written "
        f"before funcamp kept them apart): its params and optimizer state hold {holds}. Load it "
        "into a template built with TrainState.create(..., trainable=True) to resume it as it "
        "was trained, or start the run with frozen parameters from the model"
    )


def _rebuild(template: PyTree, sd: dict[str, Any], where: str) -> PyTree:
    try:
        return load_state_dict(template, sd)
    except (TypeError, ValueError) as e:
        msg = str(e).replace("funcamp.load_state_dict: `sd`", "the checkpoint")
        raise type(e)(f"funcamp.load: {where} does not fit `template`: {msg}") from e


def check_and_rebuild(
    info: CheckpointInfo, sd: Any, template: PyTree, policy: Any, convert: bool, where: str
) -> PyTree:
    """The loaded state dict ``sd`` as ``template``'s tree.

    The policy is checked, and a newer version warned about. The state is converted
    (``convert``), or else its scaler configs are checked. Then it is rebuilt leaf by leaf.
    """
    check_policy(info, policy, convert, where)
    _warn_newer(info, where)
    template_sd = state_dict(template)
    if convert:
        sd = _convert(template_sd, sd)
    else:
        _check_scalers(info, template_sd, where)
    _check_frozen_split(sd, template_sd, where)
    return _rebuild(template, sd, where)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(m) for m in re.findall(r"\d+", version.split("+")[0])[:3])


def _warn_newer(info: CheckpointInfo, where: str) -> None:
    if _version_key(info.funcamp_version) > _version_key(__version__):
        warnings.warn(
            f"funcamp.load: {where} was written by funcamp {info.funcamp_version}, newer than "
            f"this one ({__version__})",
            stacklevel=3,
        )
