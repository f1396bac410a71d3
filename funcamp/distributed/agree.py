"""The first call of a step over several ranks: the ranks agree, then start from rank 0's state.

DDP broadcasts rank 0's params and buffers when it is built, and checks nothing else: ranks
built with another learning rate, policy or scaler train apart without a word. A funcamp
step over a process group does this once, on its first call, before its compiled graph runs
(later calls run no collective and no host sync of their own for it):

1. **What the ranks must agree on**, described on every rank (:func:`fingerprint`): the policy,
   the optimizer (the plain values its closures hold -- learning rate and schedule, betas,
   weight decay, ... -- floats by their bits, functions by their code), the step's options, and
   the state's structure (leaf paths, dtypes, shapes) with the scaler's settings. The
   descriptions are exchanged (two all-gathers of a few KiB) and compared; a difference is
   refused on every rank with a ``ValueError`` that names the fields and the ranks.
2. **Rank 0's state on every rank**: the state's tensors, packed by device into byte buffers
   of at most 256 MiB, are broadcast from rank 0, one broadcast a buffer (about a checkpoint's
   bytes once). A donated state is overwritten in place (the step is about to write it
   anyway); otherwise the other ranks work on copies and the caller's state is left as it was.
3. **The learning rate** the optimizer reports for that state (:func:`funcamp.learning_rate`),
   all-gathered and compared: a schedule that reads something the closures do not hold.

Workaround of torch internals (docs/internals.md#workarounds):

- Root cause: the types of torch.ops entries (OpOverload, OpOverloadPacket), which the
  fingerprint describes by name, are importable only from torch._ops.
- Upstream: none filed.
- Why it is safe: isinstance checks only.
- Tested on: torch 2.13 and 2.14.
- Delete when: torch names the op types publicly.

"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import json
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from funcamp._core.tree import NAMESPACE, path_str, unflatten
from funcamp.optim import learning_rate

__all__ = [
    "BUCKET_BYTES",
    "broadcast_from_first",
    "fingerprint",
    "refuse_differences",
    "start_together",
]

BUCKET_BYTES = 256 << 20  # one broadcast carries at most this many bytes (DDP's 250 MB)
_ALIGN = 16  # each tensor starts at a multiple of this many bytes in a broadcast buffer
_DEPTH = 12  # how deep a value is described; deeper is known by its type
_MAX_VISITS = 200_000  # a description stops there (the rest is one "(truncated)" field)
_SHOWN = 3  # disagreeing fields named in the message
_TEXT = 80  # characters of a value shown in the message

Field = tuple[str, str, str]  # (path, what is compared, what the message shows)


@functools.cache
def _key_module() -> Any:
    """:mod:`funcamp.stepcache.key`, whose descriptions of values (functions by their code) the
    fingerprint shares; imported on the first call of a parallel step, as ``import funcamp``
    does not import the step cache."""
    return importlib.import_module("funcamp.stepcache.key")


def _describe_value(x: Any) -> tuple[Any, ...]:
    return _key_module().describe_value(x)


# ------------------------------------------------------------------------------ description


def _tensor(x: torch.Tensor, values: bool) -> tuple[str, str]:
    text = f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    key = f"{text}@{x.device.type}"
    if values and x.numel() <= 64 and not isinstance(x, DTensor) and x.layout == torch.strided:
        data = x.detach().cpu().contiguous()
        key += ":" + bytes(data.reshape(-1).view(torch.uint8).numpy()).hex()
        text = f"tensor({data.tolist()})"
    return key, text


class _Describe:
    """The fields of one value, by path: plain values by value (floats by their bits), tensors
    by dtype and shape (and, with ``values``, a small tensor by its bytes), functions by name
    and code; with ``deep``, a function's closure cells and defaults and an object's
    attributes too. An object reached again (a closure two functions share) is described at
    its first path only."""

    def __init__(self, deep: bool, values: bool) -> None:
        self.deep, self.values = deep, values
        self.out: list[Field] = []
        self.visits = 0
        self.on_path: set[int] = set()  # containers being described (cycles)
        self.seen: set[int] = set()  # objects with an identity, described once

    def add(self, path: str, key: str, text: str | None = None) -> None:
        self.out.append((path, key, key if text is None else text))

    def visit(self, x: Any, path: str, depth: int = 0) -> None:
        self.visits += 1
        if self.visits == _MAX_VISITS:
            self.add(path, "(truncated)")
        if self.visits >= _MAX_VISITS:
            return
        if x is None or isinstance(x, (bool, int, str, bytes)):
            self.add(path, repr(x))
        elif isinstance(x, float):
            self.add(path, "nan" if math.isnan(x) else x.hex(), repr(x))
        elif isinstance(x, (complex, torch.dtype, torch.device, torch.layout)):
            self.add(path, str(x))
        elif isinstance(x, enum.Enum):
            self.add(path, f"{type(x).__qualname__}.{x.name}")
        elif isinstance(x, torch.Tensor):
            self.add(path, *_tensor(x, self.values))
        elif isinstance(x, (set, frozenset)):
            self.add(path, repr(sorted(repr(_describe_value(v)) for v in x)), _short(x))
        elif id(x) in self.on_path or depth >= _DEPTH or _opaque(x):
            self.add(path, repr(_describe_value(x)), _name(x))
        elif _has_identity(x):
            if id(x) not in self.seen:
                self.seen.add(id(x))
                self.children(x, path, depth + 1)
        else:
            self.on_path.add(id(x))
            try:
                self.children(x, path, depth + 1)
            finally:
                self.on_path.discard(id(x))

    def children(self, x: Any, path: str, depth: int) -> None:
        if isinstance(x, types.FunctionType):
            self.add(path, repr(_describe_value(x)), _name(x))
            if self.deep:
                for name, cell in zip(x.__code__.co_freevars, x.__closure__ or ()):
                    try:
                        value = cell.cell_contents
                    except ValueError:  # an empty cell
                        continue
                    self.visit(value, f"{path}.{name}", depth)
                for i, value in enumerate(x.__defaults__ or ()):
                    self.visit(value, f"{path}.<default {i}>", depth)
                for name, value in (x.__kwdefaults__ or {}).items():
                    self.visit(value, f"{path}.{name}", depth)
        elif isinstance(x, functools.partial):
            self.visit(x.func, f"{path}.func", depth)
            self.visit(x.args, f"{path}.args", depth)
            self.visit(x.keywords, f"{path}.keywords", depth)
        elif isinstance(x, types.MethodType):
            self.visit(x.__func__, path, depth)
            self.visit(x.__self__, f"{path}.__self__", depth)
        elif isinstance(x, tuple) and hasattr(type(x), "_fields"):  # a NamedTuple
            self.add(path, type(x).__qualname__)
            for name in type(x)._fields:
                self.visit(getattr(x, name), f"{path}.{name}", depth)
        elif dataclasses.is_dataclass(x):
            self.add(path, type(x).__qualname__)
            for f in dataclasses.fields(x):
                self.visit(getattr(x, f.name), f"{path}.{f.name}", depth)
        elif isinstance(x, (tuple, list)):
            self.add(path, f"{type(x).__qualname__} of {len(x)}")
            for i, value in enumerate(x):
                self.visit(value, f"{path}[{i}]", depth)
        elif isinstance(x, Mapping):  # a dict, or an OpPolicy
            self.add(path, f"{type(x).__qualname__} of {len(x)}")
            for k, value in x.items():
                self.visit(value, f"{path}[{_key_text(k)}]", depth)
        elif self.deep and isinstance(getattr(x, "__dict__", None), dict):
            self.add(path, repr(_describe_value(x)), _name(x))
            for name, value in vars(x).items():
                self.visit(value, f"{path}.{name}", depth)
        else:
            self.add(path, repr(_describe_value(x)), _name(x))


def _opaque(x: Any) -> bool:
    """Known by name (code for a function) only: classes, modules, torch ops, modules."""
    return isinstance(
        x,
        (
            type,
            types.ModuleType,
            types.BuiltinFunctionType,
            types.CodeType,
            torch.nn.Module,
            torch._ops.OpOverload,
            torch._ops.OpOverloadPacket,
        ),
    )


def _key_text(k: Any) -> str:
    return repr(k) if isinstance(k, (str, int, float, bool, type(None))) else _name(k)


def _has_identity(x: Any) -> bool:
    """Not a plain container: what two paths reaching it share (plain tuples are left out, as
    equal constants may or may not be one object)."""
    return not isinstance(x, (dict, list)) and type(x) is not tuple


def _name(x: Any) -> str:
    if isinstance(x, (type, types.FunctionType, types.BuiltinFunctionType)):
        return ".".join(_key_module().where_defined(x))
    if isinstance(x, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(x)
    return f"a {type(x).__qualname__}"


def _short(x: Any) -> str:
    return _short_text(repr(x))


def fingerprint(settings: dict[str, Any], state: Any) -> list[Field]:
    """What every rank of a step must agree on, as ``(path, key, text)`` fields.

    ``settings`` maps a name to what the step was built with (``"policy"``, ``"optimizer"``,
    ``"options"``). The policy and the optimizer are described down to their closures' and
    attributes' values; the options' functions (a ``torch.compile`` backend) by name and code.
    ``state`` is described by structure, dtypes and shapes (and the scaler's settings, its
    plain fields), not by its tensors' values, which the first call broadcasts.
    """
    out: list[Field] = []
    for name, value in settings.items():
        d = _Describe(deep=name != "options", values=True)
        d.visit(value, name)
        out += d.out
    d = _Describe(deep=False, values=False)
    d.visit(state, "state")
    return out + d.out


# ------------------------------------------------------------------------------ agreement


def _gather_bytes(data: bytes, group: Any, world: int, device: torch.device) -> list[bytes]:
    """Every rank's ``data``, in rank order (two all-gathers, on the state's device)."""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    got = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(got, mine, group=group)
    return [bytes(g[:n].cpu().numpy()) for g, n in zip(got, lengths)]


def _what(path: str) -> str:
    """How the message names a field: its section and its last name, then its whole path."""
    leaf = path.replace("[", ".").replace("]", "").rsplit(".", 1)[-1].strip("'\"")
    if path.startswith("state.scaler."):
        section = "the scaler's"
    elif path.startswith("options"):
        section = "the step option"
        return f"{section} `{leaf}`"
    else:
        section = {"policy": "the policy's", "optimizer": "the optimizer's"}.get(
            path.split(".", 1)[0].split("[", 1)[0], "the state's"
        )
    return f"{section} `{leaf}` ({path})"


def _by_rank(values: Sequence[tuple[str, str] | None]) -> str:
    groups: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(None if v is None else v[0], []).append(r)
    parts = []
    for rs in groups.values():
        v = values[rs[0]]
        text = "nothing there" if v is None else _short_text(v[1])
        who = f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))
        parts.append(f"{who} {'has' if len(rs) == 1 else 'have'} {text}")
    return ", ".join(parts)


def _short_text(text: str) -> str:
    return text if len(text) <= _TEXT else text[: _TEXT - 3] + "..."


def refuse_differences(api: str, who: str, per_rank: Sequence[list[Field]]) -> None:
    """Raise, on every rank alike, when the ranks' fields differ; name the first few."""
    tables = [{p: (k, t) for p, k, t in fields} for fields in per_rank]
    order = list(dict.fromkeys(p for fields in per_rank for p, _, _ in fields))
    bad = []
    for path in order:
        values = [t.get(path) for t in tables]
        if len({None if v is None else v[0] for v in values}) > 1:
            bad.append(f"  - {_what(path)}: {_by_rank(values)}")
    if not bad:
        return
    more = f"\n  (and {len(bad) - _SHOWN} more)" if len(bad) > _SHOWN else ""
    raise ValueError(
        f"funcamp.{api}: every rank of {who} must build the step alike (the same policy, "
        "optimizer, options and state structure, the scaler's settings included; only the "
        "batch differs by rank), but they differ in:\n"
        + "\n".join(bad[:_SHOWN])
        + more
        + "\nBuild them from values that do not depend on the rank."
    )


# ------------------------------------------------------------------------------- broadcast


def _padded(x: torch.Tensor) -> int:
    n = x.numel() * x.element_size()
    return -(-n // _ALIGN) * _ALIGN


def _buckets(idx: list[int], leaves: list[torch.Tensor]) -> list[list[int]]:
    out: list[list[int]] = [[]]
    size = 0
    for i in idx:
        n = _padded(leaves[i])
        if out[-1] and size + n > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return [b for b in out if b]


def _like(x: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``x``'s layout (strides included), and its ``requires_grad``."""
    return torch.empty_like(x).requires_grad_(x.requires_grad)


def _as_bytes(x: torch.Tensor, size: int) -> torch.Tensor:
    data = x.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = size - data.numel()
    return torch.cat([data, data.new_zeros(pad)]) if pad else data


@torch.no_grad()
def broadcast_from_first(
    leaves: list[torch.Tensor], group: Any, *, is_src: bool, in_place: bool
) -> list[torch.Tensor]:
    """Rank 0's ``leaves`` on every rank of ``group``, bit for bit: packed by device into byte
    buffers of at most :data:`BUCKET_BYTES`, one broadcast each. Rank 0's tensors are returned
    as they are; another rank's are written in place (``in_place``) or into new tensors of the
    same layout."""
    src = dist.get_global_rank(group, 0)
    out = [x if is_src or in_place else _like(x) for x in leaves]
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(leaves):
        by_device.setdefault(x.device, []).append(i)
    for device, idx in by_device.items():
        for bucket in _buckets(idx, leaves):
            sizes = [_padded(leaves[i]) for i in bucket]
            if is_src:
                flat = torch.cat([_as_bytes(leaves[i], n) for i, n in zip(bucket, sizes)])
            else:
                flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            if flat.numel():
                dist.broadcast(flat, src=src, group=group)
            if is_src:
                continue
            for i, chunk in zip(bucket, flat.split(sizes)):
                x = leaves[i]
                got = chunk[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
                out[i].copy_(got)
    return out


# ------------------------------------------------------------------------------ the first call


_SYNCED = ("params", "buffers", "opt_state", "scaler", "fp8", "frozen")


def start_together(
    api: str,
    piece: Any,
    state: Any,
    settings: dict[str, Any],
    *,
    in_place: bool,
    synced: Sequence[str] = _SYNCED,
    described: Any = None,
) -> Any:
    """The state a step's first call starts from, after the ranks of ``piece.group`` agreed.

    Every rank describes ``settings`` and ``described`` (default: ``state``) with
    :func:`fingerprint`; a difference raises on every rank (:func:`refuse_differences`). Then
    the tensors of ``state``'s fields named in ``synced`` become rank 0's
    (:func:`broadcast_from_first`; DTensors are left alone, their values are rank 0's already),
    and the ranks compare the learning rate the optimizer reports for that state.
    """
    if piece.world == 1:
        return state
    tensors = [x for x in optree.tree_leaves(state, namespace=NAMESPACE) if _plain(x)]
    device = tensors[0].device if tensors else torch.device("cpu")
    mine = fingerprint(settings, state if described is None else described)
    got = _gather_bytes(json.dumps(mine).encode(), piece.group, piece.world, device)
    refuse_differences(api, piece.name, [[tuple(f) for f in json.loads(g)] for g in got])

    parts = {name: getattr(state, name) for name in synced}
    leaves, spec = optree.tree_flatten(parts, namespace=NAMESPACE)
    idx = [i for i, x in enumerate(leaves) if _plain(x)]
    new = broadcast_from_first(
        [leaves[i] for i in idx], piece.group, is_src=piece.rank == 0, in_place=in_place
    )
    for i, x in zip(idx, new):
        leaves[i] = x
    state = state._replace(**unflatten(spec, leaves))
    _same_learning_rate(api, piece, settings.get("optimizer"), state, device)
    return state


def _plain(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.layout == torch.strided


def _same_learning_rate(api: str, piece: Any, optimizer: Any, state: Any, device: Any) -> None:
    """The learning rate the optimizer reports for the (now common) state, compared: a
    schedule that reads something its closures do not hold. A tree of rates (one per group)
    is compared leaf by leaf."""
    lr = None if optimizer is None else learning_rate(optimizer, state.opt_state)
    paths, leaves, _ = optree.tree_flatten_with_path(lr, namespace=NAMESPACE)
    numbers = [(p, x) for p, x in zip(paths, leaves) if isinstance(x, (int, float, torch.Tensor))]
    if not numbers:
        return
    mine = torch.stack(
        [torch.as_tensor(x, dtype=torch.float64).cpu().reshape(()) for _, x in numbers]
    )
    got = [torch.empty_like(mine).to(device) for _ in range(piece.world)]
    dist.all_gather(got, mine.to(device), group=piece.group)
    per_rank = []
    for g in got:
        fields = []
        for (path, _), v in zip(numbers, g.cpu().tolist()):
            where = f"optimizer.<learning rate>{path_str(path) if path else ''}"
            fields.append((where, "nan" if math.isnan(v) else v.hex(), repr(v)))
        per_rank.append(fields)
    refuse_differences(api, piece.name, per_rank)
