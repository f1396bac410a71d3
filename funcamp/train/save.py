"""Whole-state checkpoints: :func:`save`, :func:`load` and :func:`checkpoint_info`.

Built on :func:`funcamp.state_dict` / :func:`funcamp.load_state_dict`. A checkpoint records what
produced it -- the policy, the kind of every :class:`~funcamp.ScalerState` in the state, the
funcamp and torch versions -- and the caller's metadata, and :func:`load` checks them.

One process (``group=None``): one file, written atomically. The file is first written under a
temporary name in the same directory, flushed and ``fsync``-ed, then renamed over ``path``
(``os.replace``, atomic on POSIX and Windows) and the directory ``fsync``-ed: whatever happens
during a save (an exception, a full disk, a ``SIGKILL``, a power cut), ``path`` holds either the
previous checkpoint or the new one, never a mixture (:mod:`funcamp._core.atomic`, which also
removes the temporary files that killed saves to the same path left behind). A CRC-32 of every
value is stored with them, so a file damaged later (truncated, bytes flipped) fails to load with
an error starting ``funcamp.load:`` instead of loading wrong numbers or crashing inside
``torch.load``.

Several processes (``group=pg``): ``path`` is a directory. The tensors go through
``torch.distributed.checkpoint`` into a fresh ``data-<token>/`` subdirectory (each rank writes
its part: replicated tensors are split between the ranks, sharded ones -- DTensors -- are saved
shard by shard), then rank 0 commits the checkpoint by writing the small header file
``path/funcamp.pt`` (structure, records and metadata) atomically as above, and only then removes
the data of the previous checkpoint -- every ``data-*`` directory but its own, so the data of
saves killed before their commit goes too. A save that fails before the commit leaves the
previous checkpoint in place.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from funcamp._core.atomic import atomic_write
from funcamp._core.tree import NAMESPACE, describe
from funcamp._core.version import __version__
from funcamp.policy.policy import Policy, as_policy
from funcamp.scaling.state import CONFIG, LEAVES
from funcamp.train.checkpoint import load_state_dict, state_dict

__all__ = ["CheckpointInfo", "checkpoint_info", "load", "save"]

PyTree = Any
PathLike = str | os.PathLike

_FORMAT = "funcamp.checkpoint"
_FORMAT_VERSION = 1
_HEADER = "funcamp.pt"  # the commit record of a multi-rank checkpoint directory
_DATA_PREFIX = "data-"
_TENSOR = "funcamp.tensor"  # placeholder tag in a multi-rank checkpoint's structure
_SCALER_KEYS = frozenset((*LEAVES, *CONFIG))


class CheckpointInfo(NamedTuple):
    """What a checkpoint records besides the state (see :func:`checkpoint_info`).

    Attributes:
        policy: the policy string it was saved under (``str(policy)``).
        policy_repr: ``repr(policy)``: also shows op-rule and module overrides.
        scaler_kind: the kind of its :class:`~funcamp.ScalerState` (``"dynamic"``,
            ``"static"``, ``"noop"``), ``None`` without one (or with several: see ``scalers``).
        scalers: every :class:`~funcamp.ScalerState` in the state, ``{path: kind}``.
        funcamp_version: the funcamp version that wrote it.
        torch_version: the torch version that wrote it.
        metadata: the keyword arguments given to :func:`save`.
        world_size: the number of ranks that wrote it (1 for a single file).

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


# ------------------------------------------------------------------------------ validation


def _check_path(path: Any, api: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"funcamp.{api}: `path` must be a str or os.PathLike, got {describe(path)}")
    return Path(path)


def _check_metadata(key: str, value: Any) -> None:
    """Metadata must load with ``weights_only=True``: round-trip it once to know."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TypeError(
            f"funcamp.save: metadata `{key}` must be made of tensors, Python scalars, strings, "
            "None and lists/tuples/dicts of them (a checkpoint loads with "
            f"torch.load(weights_only=True)), got {describe(value)[:200]} ({first[:300]})"
        ) from None


def _check_params_dtype(state: Any, policy: Policy) -> None:
    """A TrainState's floating params are in the policy's ``param_dtype``: catch the wrong
    policy at save time, not at the next resume."""
    params = getattr(state, "params", None)
    if params is None or not hasattr(state, "opt_state"):
        return
    paths, leaves, _ = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
    for path, leaf in zip(paths, leaves):
        if (
            isinstance(leaf, torch.Tensor)
            and leaf.is_floating_point()
            and leaf.dtype not in (policy.param_dtype, torch.float64)
            and leaf.element_size() > 1  # FP8 leaves follow their own recipe
        ):
            where = "".join(f"[{k!r}]" for k in path)
            raise ValueError(
                f"funcamp.save: `policy` {str(policy)!r} keeps params in {policy.param_dtype}, but "
                f"state.params{where} is {leaf.dtype}; pass the policy the state was trained with"
            )


# --------------------------------------------------------------------------- what is recorded


def _scaler_kinds(sd: Any, path: tuple[str, ...] = ()) -> dict[str, str]:
    """``{path: kind}`` of every scaler state in a state dict (``"scaler"`` for a TrainState's)."""
    if _is_scaler_sd(sd):
        return {"/".join(path) or "<root>": sd["kind"]}
    out: dict[str, str] = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(_scaler_kinds(v, (*path, str(k))))
    return out


def _info(sd: Any, policy: Policy, metadata: dict[str, Any], world: int) -> dict[str, Any]:
    return {
        "policy": str(policy),
        "policy_repr": repr(policy),
        "scalers": _scaler_kinds(sd),
        "funcamp_version": __version__,
        "torch_version": str(torch.__version__),
        "metadata": metadata,
        "world_size": world,
    }


def _as_info(raw: dict[str, Any]) -> CheckpointInfo:
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
    )


def _checksum(value: Any, crc: int = 0) -> int:
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
            crc = _checksum(v, zlib.crc32(repr(k).encode(), crc))
        return zlib.crc32(b"}", crc)
    if isinstance(value, (list, tuple)):
        crc = zlib.crc32(b"[" if isinstance(value, list) else b"(", crc)
        for v in value:
            crc = _checksum(v, crc)
        return zlib.crc32(b"]", crc)
    return zlib.crc32(repr(value).encode(), crc)


# ------------------------------------------------------------------------------------- save


def save(
    path: PathLike,
    state: PyTree,
    *,
    policy: Policy | str,
    group: Any = None,
    **metadata: Any,
) -> None:
    """Save a whole training state atomically, with what produced it.

    The file holds :func:`funcamp.state_dict` of ``state`` (any funcamp pytree: a
    :class:`~funcamp.TrainState`, a dict of them, ...), the policy (``str`` and ``repr``), the
    kind of every :class:`~funcamp.ScalerState` in it, the funcamp and torch versions, a CRC-32
    of every value and ``metadata``. It is written to a temporary file in the same directory,
    ``fsync``-ed and renamed over ``path``: the previous checkpoint survives any failure,
    including the process being killed mid-write. Read it back with :func:`load`.

    Args:
        path: the checkpoint file (its directory must exist). With ``group``, a directory
            (created if missing).
        state: the pytree to save.
        policy: the :class:`~funcamp.Policy` (or policy string) the state is trained under;
            :func:`load` checks it. A :class:`~funcamp.TrainState`'s floating params must be in
            its ``param_dtype``.
        group: a ``torch.distributed`` process group: every rank of it calls ``save`` with its
            own state and the same ``path``, and the state goes through
            ``torch.distributed.checkpoint`` (see the checkpoints guide). ``None`` (default):
            one process writes one file.
        **metadata: anything to keep with the state (epoch, data position, loss history):
            tensors, Python scalars, strings, ``None`` and lists/tuples/dicts of them, since
            checkpoints load with ``torch.load(weights_only=True)``. Read it back with
            :func:`checkpoint_info`.

    Example:
        >>> import os, tempfile, torch, funcamp
        >>> opt = funcamp.adamw(1e-3)
        >>> state = funcamp.TrainState.create({"w": torch.ones(2)}, opt, "mixed_float16")
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> funcamp.save(path, state, policy="mixed_float16", epoch=3)
        >>> info = funcamp.checkpoint_info(path)
        >>> info.policy, info.scaler_kind, info.metadata
        ('params=float32,compute=float16,output=float32', 'dynamic', {'epoch': 3})
    """
    p = _check_path(path, "save")
    pol = as_policy(policy, "save")
    _check_params_dtype(state, pol)
    for key, value in metadata.items():
        _check_metadata(key, value)
    sd = state_dict(state)
    if group is not None:
        _save_distributed(p, sd, state, pol, metadata, group)
        return
    if p.is_dir():
        raise IsADirectoryError(
            f"funcamp.save: `path` {str(p)!r} is a directory; give a file name (a directory is "
            "for a multi-rank checkpoint, with group=...)"
        )
    if not p.parent.is_dir():
        raise FileNotFoundError(f"funcamp.save: the directory of `path` {str(p)!r} does not exist")
    info = _info(sd, pol, metadata, 1)
    payload = {
        "format": _FORMAT,
        "version": _FORMAT_VERSION,
        "info": info,
        "state": sd,
        "checksum": _checksum([info, sd]),
    }
    atomic_write(p, lambda f: torch.save(payload, f))


# ------------------------------------------------------------------------------------- load


def _read(p: Path, api: str, *, mmap: bool = False) -> dict[str, Any]:
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
    if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
        raise ValueError(
            f"funcamp.{api}: {str(p)!r} is not a funcamp checkpoint (written by funcamp.save); "
            "for a plain funcamp.state_dict use torch.load and funcamp.load_state_dict"
        )
    version = raw.get("version")
    if not isinstance(version, int) or version > _FORMAT_VERSION:
        raise ValueError(
            f"funcamp.{api}: {str(p)!r} has checkpoint format version {version!r}, newer than "
            f"this funcamp reads ({_FORMAT_VERSION}); upgrade funcamp"
        )
    return raw


def _header_path(p: Path) -> Path:
    return p / _HEADER if p.is_dir() else p


def checkpoint_info(path: PathLike) -> CheckpointInfo:
    """Read what a checkpoint written by :func:`save` records, without loading its state.

    Args:
        path: the checkpoint file (or multi-rank checkpoint directory).

    Returns:
        A :class:`CheckpointInfo`: policy, scaler kind, versions and the caller's metadata.

    Example:
        >>> import os, tempfile, torch, funcamp
        >>> state = funcamp.TrainState.create({"w": torch.ones(2)}, funcamp.sgd(0.1), "bf16-mixed")
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> funcamp.save(path, state, policy="bf16-mixed", step=100)
        >>> funcamp.checkpoint_info(path).metadata["step"]
        100
    """
    p = _check_path(path, "checkpoint_info")
    raw = _read(_header_path(p), "checkpoint_info", mmap=not p.is_dir())
    return _as_info(raw["info"])


def _check_policy(info: CheckpointInfo, policy: Any, convert: bool, where: str) -> None:
    if policy is None:
        if convert:
            raise TypeError(
                "funcamp.load: convert=True needs `policy`, the policy to convert the state to"
            )
        return
    pol = as_policy(policy, "load")
    if str(pol) == info.policy and repr(pol) == info.policy_repr:
        return
    if convert:
        return
    saved, given = (
        (info.policy, str(pol)) if str(pol) != info.policy else (info.policy_repr, repr(pol))
    )
    raise ValueError(
        f"funcamp.load: {where} was saved under policy {saved!r}, but `policy` is {given!r}; "
        f"resume under the checkpoint's policy (policy={info.policy!r}), or pass convert=True "
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


def _rebuild(template: PyTree, sd: dict[str, Any], where: str) -> PyTree:
    try:
        return load_state_dict(template, sd)
    except (TypeError, ValueError) as e:
        msg = str(e).replace("funcamp.load_state_dict: `sd`", "the checkpoint")
        raise type(e)(f"funcamp.load: {where} does not fit `template`: {msg}") from e


def load(
    path: PathLike,
    template: PyTree,
    *,
    policy: Policy | str | None = None,
    convert: bool = False,
    group: Any = None,
) -> PyTree:
    """Load a checkpoint written by :func:`save` into the structure of ``template``.

    Reads with ``torch.load(weights_only=True)`` (no pickled code runs), verifies the stored
    CRC-32, checks the structure, shapes and dtypes against ``template`` (as
    :func:`funcamp.load_state_dict`, which supplies the container types and the device), and
    checks what the checkpoint records:

    * ``policy``: the policy the caller trains under. If it differs from the checkpoint's (its
      ``str``, or its op-rule/module overrides), ``load`` raises ``ValueError`` naming both --
      a resumed run never silently changes precision -- unless ``convert=True``.
    * Each :class:`~funcamp.ScalerState` must be of the kind the template has at that place
      (a ``dynamic`` checkpoint does not silently become ``noop``), unless ``convert=True``.

    ``convert=True`` (with ``policy``): continue under a new policy on purpose. Floating
    tensors are cast to the template's dtypes (build the template for the new policy, e.g. with
    ``TrainState.create(params, opt, new_policy)``), and a scaler of another kind is replaced by
    the template's (a float16 run moving to bfloat16 drops its dynamic scaler for the noop one;
    the other way round starts a fresh dynamic scaler); a scaler of the same kind keeps its
    state. Optimizer states whose structure depends on the dtype cannot be converted (an error
    names the path).

    A file that is truncated, corrupted or not a funcamp checkpoint raises ``ValueError``
    starting ``funcamp.load:``; a missing one ``FileNotFoundError``.

    Args:
        path: the checkpoint file, or the directory of a multi-rank checkpoint (then, without
            ``group``, the whole state loads into this one process).
        template: a pytree of the state's structure (e.g. a fresh ``TrainState.create(...)``);
            never modified.
        policy: the policy the loaded state will train under; ``None`` skips the policy check.
        convert: cast the state to ``policy`` instead of refusing a different one (see above).
        group: the process group of a multi-rank checkpoint (every rank calls ``load``).

    Returns:
        The state, with ``template``'s structure.

    Raises:
        ValueError: a different policy or scaler kind, a state that does not fit the template,
            or a truncated, corrupted or foreign file.

    Example:
        >>> import os, tempfile, torch, funcamp
        >>> opt = funcamp.adamw(1e-3)
        >>> state = funcamp.TrainState.create({"w": torch.ones(2)}, opt, "mixed_float16")
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> funcamp.save(path, state, policy="mixed_float16")
        >>> template = funcamp.TrainState.create({"w": torch.zeros(2)}, opt, "mixed_float16")
        >>> funcamp.load(path, template, policy="mixed_float16").params["w"]
        tensor([1., 1.])
        >>> funcamp.load(path, template, policy="bf16-mixed")
        Traceback (most recent call last):
        ...
        ValueError: funcamp.load: ... was saved under policy 'params=float32,compute=float16,output=float32', but `policy` is 'params=float32,compute=bfloat16,output=float32'; ...
    """
    p = _check_path(path, "load")
    if not isinstance(convert, bool):
        raise TypeError(f"funcamp.load: `convert` must be a bool, got {describe(convert)}")
    if policy is not None:
        as_policy(policy, "load")
    if group is not None or p.is_dir():
        return _load_distributed(p, template, policy, convert, group)
    where = repr(str(p))
    raw = _read(p, "load")
    try:
        info, sd, checksum = _as_info(raw["info"]), raw["state"], raw["checksum"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"funcamp.load: {where} is corrupted (missing {e})") from e
    if _checksum([raw["info"], sd]) != checksum:
        raise ValueError(
            f"funcamp.load: {where} is corrupted (its contents do not match the CRC-32 stored "
            "when it was saved); load an earlier checkpoint"
        )
    return _check_and_rebuild(info, sd, template, policy, convert, where)


def _check_and_rebuild(
    info: CheckpointInfo, sd: Any, template: PyTree, policy: Any, convert: bool, where: str
) -> PyTree:
    """The loaded state dict ``sd`` as ``template``'s tree: policy checked, newer-version warning,
    converted (``convert``) or scaler configs checked, then rebuilt leaf by leaf."""
    _check_policy(info, policy, convert, where)
    _warn_newer(info, where)
    template_sd = state_dict(template)
    if convert:
        sd = _convert(template_sd, sd)
    else:
        _check_scalers(info, template_sd, where)
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


# ------------------------------------------------------------------------ several processes


def _split_tensors(sd: Any, path: tuple[str, ...], tensors: dict[str, Any]) -> Any:
    """The structure of ``sd`` with each tensor replaced by a placeholder tuple ``(tag, key,
    dtype, shape)``; the tensors go into ``tensors`` under ``key`` (the path joined by "/")."""
    if isinstance(sd, torch.Tensor):
        key = "/".join(path) or "value"
        if key in tensors:
            raise ValueError(
                f"funcamp.save: two tensors of the state map to the checkpoint key {key!r}; "
                "rename a dict key containing '/'"
            )
        tensors[key] = sd
        return (_TENSOR, key, str(sd.dtype).removeprefix("torch."), list(sd.shape))
    if isinstance(sd, dict):
        return {k: _split_tensors(v, (*path, str(k)), tensors) for k, v in sd.items()}
    return sd


def _is_placeholder(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 4 and x[0] == _TENSOR


def _group_info(group: Any, api: str) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"funcamp.{api}: `group` needs torch.distributed initialized")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"funcamp.{api}: `group` must be a torch.distributed.ProcessGroup (for example "
            f"torch.distributed.group.WORLD), got {describe(group)}"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _save_distributed(
    p: Path, sd: dict[str, Any], state: PyTree, policy: Policy, metadata: dict, group: Any
) -> None:
    rank, world = _group_info(group, "save")
    if p.exists() and not p.is_dir():
        raise NotADirectoryError(
            f"funcamp.save: with `group`, `path` is a directory, but {str(p)!r} is a file"
        )
    # Rank 0 picks the data directory's name and tells the others.
    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    data = f"{_DATA_PREFIX}{token[0]}"
    if rank == 0:
        p.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=group)
    tensors: dict[str, Any] = {}
    skeleton = _split_tensors(sd, (), tensors)
    dcp.save(tensors, checkpoint_id=p / data, process_group=group)
    # dcp.save returns once every rank has written its part and rank 0 the metadata.
    error: list[Any] = [None]
    if rank == 0:
        try:
            info = _info(sd, policy, metadata, world)
            header = {
                "format": _FORMAT,
                "version": _FORMAT_VERSION,
                "info": info,
                "structure": skeleton,
                "data": data,
                "checksum": _checksum([info, skeleton, data]),
            }
            atomic_write(p / _HEADER, lambda f: torch.save(header, f))  # the commit
            for old in p.iterdir():
                if old.name.startswith(_DATA_PREFIX) and old.name != data and old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
        except Exception as e:
            error[0] = f"{type(e).__name__}: {e}"
            shutil.rmtree(p / data, ignore_errors=True)
    dist.broadcast_object_list(error, src=dist.get_global_rank(group, 0), group=group)
    if error[0] is not None:
        raise RuntimeError(f"funcamp.save: rank 0 failed to commit {str(p)!r}: {error[0]}")


def _destinations(skeleton: Any, template_sd: Any, path: tuple[str, ...]) -> Any:
    """The skeleton with each placeholder replaced by an empty tensor to load into: like the
    template's tensor at that place (device, sharding) with the saved dtype."""
    if _is_placeholder(skeleton):
        _, _, dtype, shape = skeleton
        dtype = getattr(torch, dtype)
        if isinstance(template_sd, torch.Tensor) and list(template_sd.shape) == list(shape):
            return torch.empty_like(template_sd, dtype=dtype)
        return torch.empty(shape, dtype=dtype)  # load_state_dict then names the mismatch
    if isinstance(skeleton, dict):
        return {
            k: _destinations(v, template_sd.get(k) if isinstance(template_sd, dict) else None, ())
            for k, v in skeleton.items()
        }
    return skeleton


def _tensors_of(dest: Any, skeleton: Any, out: dict[str, Any]) -> None:
    if _is_placeholder(skeleton):
        out[skeleton[1]] = dest
    elif isinstance(skeleton, dict):
        for k, v in skeleton.items():
            _tensors_of(dest[k], v, out)


def _load_distributed(p: Path, template: PyTree, policy: Any, convert: bool, group: Any) -> PyTree:
    if group is not None:
        _group_info(group, "load")
    where = repr(str(p))
    if not p.is_dir():
        if p.exists():
            raise NotADirectoryError(
                f"funcamp.load: with `group`, `path` is a multi-rank checkpoint directory, but "
                f"{where} is a file; load it without `group`"
            )
        raise FileNotFoundError(f"funcamp.load: no checkpoint at {where}")
    raw = _read(p / _HEADER, "load")
    try:
        info, skeleton, data = _as_info(raw["info"]), raw["structure"], raw["data"]
        checksum = raw["checksum"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"funcamp.load: {where} is corrupted (missing {e})") from e
    if _checksum([raw["info"], skeleton, data]) != checksum:
        raise ValueError(f"funcamp.load: {where} is corrupted (its header fails its CRC-32)")
    _check_policy(info, policy, convert, where)
    dest = _destinations(skeleton, state_dict(template), ())
    tensors: dict[str, Any] = {}
    _tensors_of(dest, skeleton, tensors)
    try:
        with warnings.catch_warnings():
            # without a group dcp warns that it loads in one process: that is what was asked
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, checkpoint_id=p / data, process_group=group, no_dist=group is None)
    except Exception as e:
        raise ValueError(
            f"funcamp.load: the data of {where} could not be read (truncated or corrupted: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'})"
        ) from e
    return _check_and_rebuild(info, dest, template, policy, convert, where)
