"""Checkpoints written by several ranks, through ``torch.distributed.checkpoint``.

``save``/``load`` with a process group come here. Each rank writes its own shards; the header
is rank 0's.
"""

from __future__ import annotations

import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from funcamp._core.atomic import atomic_write
from funcamp._core.tree import PyTree, describe
from funcamp.checkpoints.format import (
    DATA_PREFIX,
    FORMAT,
    FORMAT_VERSION,
    HEADER,
    HEADER_KEYS,
    TENSOR,
    CheckpointInfo,
    check_and_rebuild,
    check_policy,
    header_info,
    parse_info,
    read_checkpoint,
    state_checksum,
    verify,
)
from funcamp.checkpoints.state_dict import state_dict
from funcamp.policy.policy import Policy

__all__ = []


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
        return (TENSOR, key, str(sd.dtype).removeprefix("torch."), list(sd.shape))
    if isinstance(sd, dict):
        return {k: _split_tensors(v, (*path, str(k)), tensors) for k, v in sd.items()}
    return sd


def _is_placeholder(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 4 and x[0] == TENSOR


def _group_info(group: Any, api: str) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"funcamp.{api}: `group` needs torch.distributed initialized")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"funcamp.{api}: `group` must be a torch.distributed.ProcessGroup (for example "
            f"torch.distributed.group.WORLD), got {describe(group)}"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def save_distributed(
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
    data = f"{DATA_PREFIX}{token[0]}"
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
            info = header_info(sd, policy, metadata, world)
            header = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "info": info,
                "structure": skeleton,
                "data": data,
                "checksum": state_checksum([info, skeleton, data]),
            }
            atomic_write(p / HEADER, lambda f: torch.save(header, f))  # the commit
            for old in p.iterdir():
                if old.name.startswith(DATA_PREFIX) and old.name != data and old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
        except Exception as e:
            error[0] = (e.errno if isinstance(e, OSError) else None, f"{type(e).__name__}: {e}")
            shutil.rmtree(p / data, ignore_errors=True)
    dist.broadcast_object_list(error, src=dist.get_global_rank(group, 0), group=group)
    if error[0] is not None:
        code, text = error[0]
        if code is not None:  # a full disk, ...: an OSError on every rank, as in one process
            raise OSError(code, f"funcamp.save: rank 0 failed to commit it: {text}", str(p))
        raise RuntimeError(f"funcamp.save: rank 0 failed to commit {str(p)!r}: {text}")


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


def load_distributed(
    p: Path, template: PyTree, policy: Any, convert: bool, group: Any
) -> tuple[PyTree, CheckpointInfo]:
    """The state of the multi-rank checkpoint ``p`` as ``template``'s tree, and its header."""
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
    raw = read_checkpoint(p / HEADER, "load")
    verify(raw, HEADER_KEYS, "load", where)
    info, skeleton, data = parse_info(raw, "load", where), raw["structure"], raw["data"]
    check_policy(info, policy, convert, where)
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
    return check_and_rebuild(info, dest, template, policy, convert, where), info
