"""Sharded training on a 1-D device mesh: :func:`shard` and ``parallel=Sharded(mesh)``.

Params and optimizer state live as ``DTensor`` s sharded along one dimension of every large leaf
(ZeRO-3 / FSDP's layout): each rank holds about ``1/N`` of them. The step itself works on the
*local shards*, as plain tensors, because ``torch.func.grad`` does not see through ``DTensor``
(measured on torch 2.13: the DTensor is unwrapped, ``'Tensor' object has no attribute
'redistribute'``). At the step boundary the state's DTensors become their local tensors and the
results are wrapped back with the same placements, so the step stays pure from the outside.

Inside the step (compiled as one graph when ``compile=True``):

* the sharded params are packed into one flat buffer per dtype and all-gathered, by an
  ``autograd.Function`` whose backward is a reduce-scatter (as torchtitan's SimpleFSDP does;
  torch's own ``all_gather_tensor_autograd`` fails under ``torch.func.grad``: its autograd
  function has no ``setup_context``), so ``torch.func.grad`` of the loss of the gathered params
  gives each rank the *sum over ranks* of its shard's gradient; divided by the world size it is
  the mean, as with data parallelism;
* the gradients of replicated leaves, the loss, rank 0's buffers, and this rank's squared norm
  and non-finite flag of its gradient shards travel in one all-reduce
  (:func:`funcamp._core.collectives.all_reduce_step`), so ``found_inf``, ``loss`` and ``grad_norm`` are
  global: no rank steps when any rank overflowed;
* unscale, the optimizer and the skip run on the local shards; :func:`funcamp.clip_by_global_norm`
  gets the global norm (one more small all-reduce).
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import optree
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

try:  # torch's private spec classes (a cached spec makes a DTensor much faster)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec as _DTensorSpec
    from torch.distributed.tensor._dtensor_spec import TensorMeta as _TensorMeta
except ImportError:  # pragma: no cover - another torch
    _DTensorSpec = _TensorMeta = None

from funcamp._core.collectives import Across, all_reduce_step
from funcamp._core.tree import NAMESPACE, PyTree, describe, dotted_path, path_str, unflatten
from funcamp.casting.fp8 import Fp8State, all_reduce_amax
from funcamp.distributed.agree import start_together
from funcamp.optim._whole import gather_packed
from funcamp.train.parallel import SingleProcess
from funcamp.train.state import TrainState

__all__ = ["Sharded", "shard"]


# ------------------------------------------------------------------------------ the mesh


def _check_mesh(api: str, mesh: Any) -> Any:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"funcamp.{api}: `mesh` needs torch.distributed initialized "
            "(torch.distributed.init_process_group) before use"
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"funcamp.{api}: `mesh` must be a 1-D torch.distributed.device_mesh.DeviceMesh "
            "(init_device_mesh(device_type, (world_size,))), got "
            f"{describe(mesh)}"
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"funcamp.{api}: `mesh` must be a 1-D DeviceMesh (funcamp shards along one mesh "
            f"dimension), got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; pass a 1-D "
            "mesh, e.g. init_device_mesh(device_type, (world_size,)), or one dimension of "
            "yours (mesh['dp'])"
        )
    return mesh


def _placements(dim: int | None) -> tuple[Any, ...]:
    return (Replicate(),) if dim is None else (Shard(dim),)


def _rule(x: torch.Tensor, dim: int, world: int) -> int | None:
    """The dimension a leaf is sharded along, or None for a replicated leaf."""
    return dim if x.dim() > dim and x.shape[dim] >= world else None


def shard(tree: PyTree, mesh: Any, *, dim: int = 0) -> PyTree:
    """Turn a pytree of tensors into ``DTensor`` s sharded on a 1-D device mesh.

    The rule, leaf by leaf (it depends on the shape only, so an optimizer state's moments are
    sharded exactly as their params): a tensor with more than ``dim`` dimensions and at least as
    many entries along ``dim`` as the mesh has ranks is sharded ``Shard(dim)`` (uneven sizes are
    split as ``torch.chunk`` splits them, DTensor's rule: the first ranks hold one more row);
    every other tensor -- 0-d step counts, a bias shorter than the mesh -- is ``Replicate()``.
    Non-tensor leaves pass through; a leaf already a DTensor on ``mesh`` is kept as it is.

    Given a :class:`funcamp.TrainState`, its ``params`` and ``opt_state`` are sharded by that
    rule and its ``buffers``, ``scaler`` and ``fp8`` are left as they are (plain tensors, the
    same on every rank; the sharded step keeps them so). Values are rank 0's
    (``distribute_tensor`` scatters them from rank 0), so every rank may build the state from
    its own random init. Every rank of the mesh must call ``shard`` (it communicates).

    Args:
        tree: a pytree of tensors, or a :class:`funcamp.TrainState`.
        mesh: a 1-D ``torch.distributed.device_mesh.DeviceMesh``.
        dim: the tensor dimension to shard along (default 0).

    Returns:
        The same structure with DTensor leaves.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> import funcamp, funcamp.distributed as fd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> state = funcamp.TrainState.create({"w": torch.ones(4, 2)}, funcamp.adam(1e-3), "float32")
        >>> state = fd.shard(state, mesh)
        >>> state.params["w"].placements, state.opt_state.count.placements
        ((Shard(dim=0),), (Replicate(),))
        >>> dist.destroy_process_group()
    """
    api = "distributed.shard"
    _check_mesh(api, mesh)
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise TypeError(f"funcamp.{api}: `dim` must be an int >= 0, got {describe(dim)}")
    if isinstance(tree, TrainState):
        return tree._replace(
            params=_shard_tree(api, tree.params, mesh, dim, "state.params"),
            opt_state=_shard_tree(api, tree.opt_state, mesh, dim, "state.opt_state"),
        )
    return _shard_tree(api, tree, mesh, dim, "tree")


def _check_on_mesh(api: str, name: str, path: Any, x: DTensor, mesh: Any, fix: str) -> None:
    if x.device_mesh != mesh:
        raise ValueError(
            f"funcamp.{api}: `{name}` leaf {path_str(path)} is a DTensor on another mesh than "
            f"`mesh`; {fix}"
        )


def _shard_tree(api: str, tree: PyTree, mesh: Any, dim: int, name: str) -> PyTree:
    world = mesh.size()
    paths, leaves, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    out = []
    for path, x in zip(paths, leaves):
        if isinstance(x, DTensor):
            _check_on_mesh(
                api, name, path, x, mesh, "shard from plain tensors (DTensor.full_tensor() first)"
            )
            out.append(x)
        elif isinstance(x, torch.Tensor):
            out.append(distribute_tensor(x.detach(), mesh, _placements(_rule(x, dim, world))))
        else:
            out.append(x)
    return unflatten(spec, out)


# ------------------------------------------------------------------ layout at the boundary


class _Leaf(NamedTuple):
    """How one DTensor leaf is laid out: ``dim`` (None: replicated), global shape and stride."""

    dim: int | None
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _unwrap(api: str, tree: PyTree, mesh: Any, name: str, required: bool) -> tuple[Any, ...]:
    """``(local tree, layouts)``: each DTensor leaf replaced by its local tensor; ``layouts``
    holds a :class:`_Leaf` per leaf (None for a plain one)."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    local, layouts = [], []
    for path, x in zip(paths, leaves):
        if isinstance(x, DTensor):
            _check_on_mesh(api, name, path, x, mesh, "shard the state on the step's mesh")
            (p,) = x.placements
            if isinstance(p, Shard):
                d = p.dim
            elif isinstance(p, Replicate):
                d = None
            else:
                raise ValueError(
                    f"funcamp.{api}: `{name}` leaf {path_str(path)} must be a DTensor placed "
                    f"Shard(dim) or Replicate(), got {p}; build the state with "
                    "funcamp.distributed.shard(state, mesh)"
                )
            layouts.append(_Leaf(d, tuple(x.shape), tuple(x.stride())))
            # The local tensor itself (to_local() goes through autograd, for each leaf; these
            # state tensors never require grad).
            local.append(x.to_local() if x.requires_grad else x._local_tensor)
        elif isinstance(x, torch.Tensor) and required:
            raise TypeError(
                f"funcamp.{api}: with `mesh`, `{name}` leaf {path_str(path)} must be a DTensor "
                f"on the mesh, got {describe(x)}; shard the state first: "
                "state = funcamp.distributed.shard(state, mesh)"
            )
        else:
            layouts.append(None)
            local.append(x)
    return unflatten(spec, local), tuple(layouts)


def _rewrap(
    tree: PyTree, layouts: tuple[Any, ...], mesh: Any, specs: dict[Any, Any] | None = None
) -> PyTree:
    """``tree``'s leaves laid out by ``layouts`` as DTensors (None: left as they are);
    ``specs`` caches their DTensor specs between steps."""
    specs = {} if specs is None else specs
    leaves, tree_spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    out = [
        x if lay is None else _as_dtensor(x, lay, mesh, specs) for x, lay in zip(leaves, layouts)
    ]
    return unflatten(tree_spec, out)


def _as_dtensor(x: torch.Tensor, lay: _Leaf, mesh: Any, specs: dict[Any, Any]) -> torch.Tensor:
    """``x`` (a local shard) as a DTensor laid out as ``lay``, built from a cached spec: an order
    of magnitude cheaper a leaf than ``DTensor.from_local(..., run_check=False)`` or a new spec
    (NOTES.md); ``from_local`` if torch's private spec classes move."""
    try:
        if _DTensorSpec is None:
            raise TypeError("no DTensorSpec in this torch")
        key = (lay, x.dtype)
        spec = specs.get(key)
        if spec is None:
            meta = _TensorMeta(torch.Size(lay.shape), lay.stride, x.dtype)
            spec = specs[key] = _DTensorSpec(mesh, _placements(lay.dim), meta)
        return DTensor(x, spec, requires_grad=False)
    except TypeError:  # pragma: no cover - another torch
        return DTensor.from_local(
            x,
            mesh,
            _placements(lay.dim),
            run_check=False,
            shape=torch.Size(lay.shape),
            stride=lay.stride,
        )


def _as_layouts(tree: PyTree, layouts: tuple[Any, ...]) -> PyTree:
    """``tree`` (local shards) with each sharded leaf as ``(dim, global shape, dtype)``: what
    every rank must agree on (the local shapes of uneven shards differ)."""
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    out = [x if lay is None else (lay.dim, lay.shape, x.dtype) for x, lay in zip(leaves, layouts)]
    return unflatten(spec, out)


# --------------------------------------------------------------------------- the gather


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 whose backward is a reduce-scatter (sum), usable under
    ``torch.func.grad`` (it has ``setup_context``) and traced by dynamo."""

    @staticmethod
    def forward(flat: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        return funcol.wait_tensor(funcol.all_gather_single(flat, 0, group))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # detach: the functional op's own autograd wrapper has no setup_context either, and
        # under torch.func the incoming grad is a wrapped tensor that requires grad.
        out = funcol.reduce_scatter_single(grad.detach().contiguous(), "sum", 0, ctx.group)
        return funcol.wait_tensor(out), None


def _gather(leaves: list[torch.Tensor], layouts: tuple[Any, ...], group: Any, world: int) -> list:
    """The full params: the sharded leaves packed in one flat buffer per dtype, all-gathered
    (the backward a reduce-scatter), and cut back into tensors of their global shapes;
    replicated leaves as they are."""
    return gather_packed(leaves, layouts, world, lambda flat: _AllGather.apply(flat, group))


# ------------------------------------------------------------------------------ the piece


class Sharded(SingleProcess):
    """Training on shards: params and optimizer state live as ``DTensor`` s sharded along one
    dimension (:func:`shard`), and each rank runs the step on its own equal shard of the batch.

    The step works on the local shards as plain tensors (``torch.func.grad`` does not see through
    ``DTensor``): at the boundary the state's DTensors become their local tensors and the
    results are wrapped back with the same placements. Inside, the loss runs on the params
    all-gathered (:meth:`gather`: one flat buffer per dtype, whose backward is a reduce-scatter,
    so each rank gets the sum over ranks of its shard's gradient); :meth:`exchange` divides those
    by the world size (their mean, as data parallelism has) and averages the replicated leaves'
    gradients, the loss and rank 0's buffers in one all-reduce; :meth:`across` makes
    :func:`funcamp.unscale_and_step`'s ``found_inf`` and norms global (and
    :func:`funcamp.clip_by_global_norm`'s). On the first call only, :meth:`agree` refuses
    ranks that built the step differently (policy, optimizer, options, scaler settings,
    global layout), naming the field and the ranks, and gives every rank rank 0's buffers,
    scaler, FP8 state and frozen params (the DTensors are rank 0's already).

    Example:
        >>> import torch, torch.distributed as dist, funcamp
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> import funcamp.distributed as fd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> fd.Sharded(init_device_mesh("cpu", (1,))).name
        'parallel=Sharded(mesh) (1 ranks)'
        >>> dist.destroy_process_group()
    """

    refuses: ClassVar[dict[str, str]] = {
        "cache_dir": "the compiled graph holds collectives bound to this process's group, "
        "which a saved step cannot rebind; drop `cache_dir` (torch's compile caches still "
        "apply)",
        "headroom": "the headroom summary covers every gradient element, and under `mesh` "
        "each rank holds only its shards; call funcamp.headroom on gathered gradients instead",
    }

    def __init__(self, mesh: Any, *, margin: int = 0, api: str = "make_train_step") -> None:
        self.mesh = _check_mesh(api, mesh)
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        self.margin = margin  # the delayed-FP8 recipe's margin
        self.name = f"parallel=Sharded(mesh) ({self.world} ranks)"
        self.params_layout: tuple[Any, ...] | None = None  # fixed by the first state
        self.whole: dict[str, Any] = {}  # dotted path -> (dim, global shape), for Across
        self.layouts: tuple[Any, ...] = ()  # of the state being stepped: to wrap the new one
        self.specs: dict[Any, Any] = {}  # DTensor specs of the new state's leaves, made once

    def local(self, api: str, state: Any) -> Any:
        p, p_lay = _unwrap(api, state.params, self.mesh, "state.params", True)
        o, o_lay = _unwrap(api, state.opt_state, self.mesh, "state.opt_state", True)
        b, b_lay = _unwrap(api, state.buffers, self.mesh, "state.buffers", False)
        s, s_lay = _unwrap(api, state.scaler, self.mesh, "state.scaler", False)
        for name, lays in (("state.buffers", b_lay), ("state.scaler", s_lay)):
            if any(lay is not None and lay.dim is not None for lay in lays):
                raise ValueError(
                    f"funcamp.{api}: `{name}` must be replicated (plain tensors or Replicate() "
                    "DTensors), got a sharded DTensor; shard only params and optimizer state "
                    "(funcamp.distributed.shard(state, mesh) does so)"
                )
        if self.params_layout is None:
            self.params_layout = p_lay
            paths = optree.tree_flatten_with_path(state.params, namespace=NAMESPACE)[0]
            self.whole = {
                dotted_path(path): (lay.dim, lay.shape)
                for path, lay in zip(paths, p_lay)
                if lay is not None
            }
        elif p_lay != self.params_layout:
            raise ValueError(
                f"funcamp.{api}: `state.params` must keep the sharding of the first state the "
                "step ran on (the same global shapes and placements); build another step"
            )
        self.layouts = (p_lay, b_lay, o_lay, s_lay)
        return state._replace(params=p, buffers=b, opt_state=o, scaler=s)

    def agree(self, api: str, state: Any, settings: dict[str, Any], in_place: bool) -> Any:
        """On the first call: the ranks agree on ``settings`` and the state's structure (the
        params and optimizer state by their global layout), and the replicated parts (buffers,
        scaler, FP8 state, frozen params) become rank 0's; the sharded ones are rank 0's
        already (:func:`shard` scatters rank 0's values)."""
        p_lay, _, o_lay, _ = self.layouts
        described = state._replace(
            params=_as_layouts(state.params, p_lay), opt_state=_as_layouts(state.opt_state, o_lay)
        )
        return start_together(
            api,
            self,
            state,
            settings,
            in_place=in_place,
            synced=("buffers", "scaler", "fp8", "frozen"),
            described=described,
        )

    def wrap(self, new: Any) -> Any:
        p_lay, b_lay, o_lay, s_lay = self.layouts
        return new._replace(
            params=_rewrap(new.params, p_lay, self.mesh, self.specs),
            buffers=_rewrap(new.buffers, b_lay, self.mesh, self.specs),
            opt_state=_rewrap(new.opt_state, o_lay, self.mesh, self.specs),
            scaler=_rewrap(new.scaler, s_lay, self.mesh, self.specs),
        )

    def _sharded(self) -> list[bool]:
        return [lay.dim is not None for lay in self.params_layout or ()]

    def gather(self, params: PyTree) -> PyTree:
        leaves, spec = optree.tree_flatten(params, namespace=NAMESPACE)
        return unflatten(spec, _gather(leaves, self.params_layout, self.group, self.world))

    def exchange(
        self, grads: PyTree, loss: torch.Tensor, buffers: PyTree
    ) -> tuple[PyTree, torch.Tensor, PyTree, torch.Tensor | None]:
        leaves, spec = optree.tree_flatten(grads, namespace=NAMESPACE)
        sharded = self._sharded()
        # The replicated leaves' gradients, the loss and rank 0's buffers: one all-reduce.
        rep = [g for g, s in zip(leaves, sharded) if not s]
        got = all_reduce_step(rep, loss, buffers, self.group, world_size=self.world, rank=self.rank)
        mean = iter(got.grads)
        # Sharded leaves: the reduce-scatter summed the ranks' gradients; their mean.
        out = [g / self.world if s else next(mean) for g, s in zip(leaves, sharded)]
        return unflatten(spec, out), got.loss, got.buffers, got.nonfinite

    def across(self) -> Across:
        return Across(self.group, tuple(self._sharded()), self.whole, self.rank, self.world)

    def fp8_reduce(self, state: Fp8State, grads: Fp8State) -> Fp8State:
        return all_reduce_amax(state, grads, self.margin, self.group)
