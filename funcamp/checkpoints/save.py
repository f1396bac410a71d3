"""Whole-state checkpoints: :func:`save`, :func:`load` and :func:`checkpoint_info`.

Built on :func:`funcamp.state_dict` / :func:`funcamp.load_state_dict`. A checkpoint records what
produced it: the policy, the kind of every :class:`~funcamp.ScalerState` in the state, and the
funcamp and torch versions. It also records the caller's metadata. :func:`load` checks them.

One process (``group=None``): one file, written atomically. The file is first written under a
temporary name in the same directory, flushed and ``fsync``-ed. Then it is renamed over ``path``
(``os.replace``, atomic on POSIX and Windows), and the directory is ``fsync``-ed. Whatever
happens during a save, ``path`` holds either the previous checkpoint or the new one, never a
mixture. That holds for an exception, a full disk, a ``SIGKILL`` or a power cut
(:mod:`funcamp._core.atomic`). Temporary files that killed saves to the same path left behind
are removed. A CRC-32 of every value is stored with them. So a file damaged later (truncated,
bytes flipped) fails to load with an error starting ``funcamp.load:``. It does not load wrong
numbers or crash inside ``torch.load``.

Several processes (``group=pg``): ``path`` is a directory. The tensors go through
``torch.distributed.checkpoint`` into a fresh ``data-<token>/`` subdirectory. Each rank writes
its part: replicated tensors are split between the ranks, and sharded ones (DTensors) are saved
shard by shard. Then rank 0 commits the checkpoint by writing the small header file
``path/funcamp.pt`` (structure, records and metadata), atomically as above. Only then does it
remove the data of the previous checkpoint: every ``data-*`` directory but its own. So the data
of saves killed before their commit goes too. A save that fails before the commit leaves the
previous checkpoint in place.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from funcamp._core.atomic import atomic_write
from funcamp._core.tree import PyTree, describe, first_leaf
from funcamp.checkpoints.dcp import load_distributed, save_distributed
from funcamp.checkpoints.format import (
    FILE_KEYS,
    FORMAT,
    FORMAT_VERSION,
    HEADER_KEYS,
    CheckpointInfo,
    check_and_rebuild,
    header_info,
    header_path,
    parse_info,
    read_checkpoint,
    state_checksum,
    verify,
    verify_header,
)
from funcamp.checkpoints.state_dict import encode
from funcamp.policy.policy import Policy, as_policy, off_policy_param

__all__ = ["checkpoint_info", "load", "save"]


PathLike = str | os.PathLike


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
    found = off_policy_param(policy, params)
    if found is not None:
        where, leaf = found
        raise ValueError(
            f"funcamp.save: `policy` {str(policy)!r} keeps params in {policy.param_dtype}, but "
            f"state.params{where} is {leaf.dtype}; pass the policy the state was trained with"
        )


def _refuse_sharded(state: PyTree) -> None:
    """One file cannot hold a state sharded across ranks: say how to save it."""
    named = hasattr(state, "_asdict")  # a TrainState: leaves named by its fields
    trees = {f"state.{k}": v for k, v in state._asdict().items()} if named else {"state": state}
    where = first_leaf(trees, lambda x: isinstance(x, DTensor))
    if where is not None:
        raise ValueError(
            f"funcamp.save: `state` leaf {where} is a DTensor (a state sharded across ranks) "
            "and needs `group`: call "
            "funcamp.save(directory, state, policy=..., group=mesh.get_group()) on every rank "
            "(torch.distributed.checkpoint writes each rank's shards), or gather the leaves "
            "first (DTensor.full_tensor()) to save one file"
        )


def save(
    path: PathLike,
    state: PyTree,
    *,
    policy: Policy | str,
    group: Any = None,
    **metadata: Any,
) -> None:
    """Save a whole training state atomically, with what produced it.

    The file holds :func:`funcamp.state_dict` of ``state``, which may be any funcamp pytree (a
    :class:`~funcamp.TrainState`, a dict of them, ...). It also holds the whole policy
    (``CheckpointInfo.policy_spec``: dtypes, op table and op rules, module rules, FP8). It records
    the kind of every :class:`~funcamp.ScalerState` in the state, the funcamp and torch versions,
    and ``metadata``. A CRC-32 of every value is stored, and one of the header.

    The file is written to a temporary file in the same directory, ``fsync``-ed and renamed over
    ``path``. So the previous checkpoint survives any failure, including the process being killed
    mid-write. A failure of the file system (a full disk) raises ``OSError`` with its ``errno``,
    naming ``path``. Read it back with :func:`load`. A state donated to a train step (or whose
    donated step raised part-way) is refused: its tensors hold another state than its scaler's.

    Args:
        path: the checkpoint file (its directory must exist). With ``group``, a directory
            (created if missing).
        state: the pytree to save.
        policy: the :class:`~funcamp.Policy` (or policy string) the state is trained under.
            :func:`load` checks it. A :class:`~funcamp.TrainState`'s floating params must be in
            its ``param_dtype``.
        group: a process group. Every rank calls ``save`` with its own state and the same
            ``path``, through ``torch.distributed.checkpoint``. ``None``: one file (a state
            sharded with :func:`funcamp.distributed.shard` needs a group).
        **metadata: anything to keep with the state: tensors, Python scalars, strings,
            ``None`` and containers of them (``weights_only`` loads). See
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
    sd = encode(state, "save")  # refuses a donated state
    if group is not None:
        save_distributed(p, sd, state, pol, metadata, group)
        return
    _refuse_sharded(state)
    if p.is_dir():
        raise IsADirectoryError(
            f"funcamp.save: `path` {str(p)!r} is a directory; give a file name (a directory is "
            "for a multi-rank checkpoint, with group=...)"
        )
    if not p.parent.is_dir():
        raise FileNotFoundError(f"funcamp.save: the directory of `path` {str(p)!r} does not exist")
    info = header_info(sd, pol, metadata, 1)
    payload = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "info": info,
        "info_checksum": state_checksum(info),  # checkpoint_info checks the header alone
        "state": sd,
        "checksum": state_checksum([info, sd]),
    }
    atomic_write(p, lambda f: torch.save(payload, f))


def checkpoint_info(path: PathLike) -> CheckpointInfo:
    """Read what a checkpoint written by :func:`save` records, without loading its state.

    The header's CRC-32 is verified (the whole file's, for an older file without one). Another
    process may replace the file between two calls. To read the state and the header of the
    same save, use ``load(..., with_info=True)``.

    Args:
        path: the checkpoint file (or multi-rank checkpoint directory).

    Returns:
        A :class:`CheckpointInfo`: policy, scaler kind, versions and the caller's metadata.

    Raises:
        ValueError: a truncated, corrupted or foreign file (starting ``funcamp.checkpoint_info:``).

    Example:
        >>> import os, tempfile, torch, funcamp
        >>> state = funcamp.TrainState.create({"w": torch.ones(2)}, funcamp.sgd(0.1), "bf16-mixed")
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> funcamp.save(path, state, policy="bf16-mixed", step=100)
        >>> funcamp.checkpoint_info(path).metadata["step"]
        100
    """
    p = _check_path(path, "checkpoint_info")
    is_dir = p.is_dir()
    raw = read_checkpoint(header_path(p), "checkpoint_info", mmap=not is_dir)
    where = repr(str(p))
    if is_dir:
        verify(raw, HEADER_KEYS, "checkpoint_info", where)
    else:
        verify_header(raw, FILE_KEYS, "checkpoint_info", where)
    return parse_info(raw, "checkpoint_info", where)


def load(
    path: PathLike,
    template: PyTree,
    *,
    policy: Policy | str | None = None,
    convert: bool = False,
    group: Any = None,
    with_info: bool = False,
) -> PyTree | tuple[PyTree, CheckpointInfo]:
    """Load a checkpoint written by :func:`save` into the structure of ``template``.

    It reads with ``torch.load(weights_only=True)``, so no pickled code runs. It verifies the
    stored CRC-32. It checks the structure, shapes and dtypes against ``template``, as
    :func:`funcamp.load_state_dict` does (which supplies the container types and the device).
    Then it checks what the checkpoint records:

    * ``policy``: the policy the caller trains under. If it differs from the checkpoint's in
      anything (dtypes, op table, op rules, module rules, FP8), ``load`` raises ``ValueError``
      naming the first difference. So a resumed run never silently changes precision.
      ``convert=True`` allows the change.
    * Each :class:`~funcamp.ScalerState` must be of the kind the template has at that place.
      (A ``dynamic`` checkpoint does not silently become ``noop``.) ``convert=True`` allows the
      change.

    ``convert=True`` (with ``policy``) continues under a new policy on purpose. Floating tensors
    are cast to the template's dtypes. (Build the template for the new policy, e.g. with
    ``TrainState.create(params, opt, new_policy)``.) A scaler of another kind is replaced by the
    template's. A float16 run moving to bfloat16 drops its dynamic scaler for the noop one; the
    other way round starts a fresh dynamic scaler. A scaler of the same kind keeps its state.
    Optimizer states whose structure depends on the dtype cannot be converted (an error names the
    path).

    A file that is truncated, corrupted or not a funcamp checkpoint raises ``ValueError`` starting
    ``funcamp.load:``. A missing one raises ``FileNotFoundError``.

    Args:
        path: the checkpoint file, or the directory of a multi-rank checkpoint. Without
            ``group``, a multi-rank checkpoint loads whole into this one process.
        template: a pytree of the state's structure (e.g. a fresh ``TrainState.create(...)``).
            Never modified.
        policy: the policy the loaded state will train under; ``None`` skips the policy check.
        convert: cast the state to ``policy`` instead of refusing a different one (see above).
        group: the process group of a multi-rank checkpoint (every rank calls ``load``).
        with_info: also return the checkpoint's :class:`CheckpointInfo` (its metadata). It is
            read from the same file in the same call, so the two belong to the same save.

    Returns:
        The state, with ``template``'s structure; with ``with_info``, ``(state, info)``.

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
    if not isinstance(with_info, bool):
        raise TypeError(f"funcamp.load: `with_info` must be a bool, got {describe(with_info)}")
    if policy is not None:
        as_policy(policy, "load")
    if group is not None or p.is_dir():
        state, info = load_distributed(p, template, policy, convert, group)
        return (state, info) if with_info else state
    where = repr(str(p))
    raw = read_checkpoint(p, "load")
    verify(raw, FILE_KEYS, "load", where)
    info = parse_info(raw, "load", where)
    state = check_and_rebuild(info, raw["state"], template, policy, convert, where)
    return (state, info) if with_info else state
