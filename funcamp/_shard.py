"""Sharded training on a 1-D device mesh: :func:`shard` and ``make_train_step(..., mesh=)``.

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
  (:func:`funcamp.distributed._reduce_step`), so ``found_inf``, ``loss`` and ``grad_norm`` are
  global: no rank steps when any rank overflowed;
* unscale, the optimizer and the skip run on the local shards; :func:`funcamp.clip_by_global_norm`
  gets the global norm (one more small all-reduce).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed._functional_collectives as funcol

from funcamp._tree import NAMESPACE, describe, path_str, unflatten

PyTree = Any

__all__ = ["shard"]


# ------------------------------------------------------------------------------ the mesh


def _check_mesh(api: str, mesh: Any) -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"funcamp.{api}: `mesh` needs torch.distributed initialized "
            "(torch.distributed.init_process_group) before use"
        )
    from torch.distributed.device_mesh import DeviceMesh

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
    from torch.distributed.tensor import Replicate, Shard

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
    from funcamp._train import TrainState

    if isinstance(tree, TrainState):
        return tree._replace(
            params=_shard_tree(api, tree.params, mesh, dim, "state.params"),
            opt_state=_shard_tree(api, tree.opt_state, mesh, dim, "state.opt_state"),
        )
    return _shard_tree(api, tree, mesh, dim, "tree")


def _shard_tree(api: str, tree: PyTree, mesh: Any, dim: int, name: str) -> PyTree:
    from torch.distributed.tensor import DTensor, distribute_tensor

    world = mesh.size()
    paths, leaves, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    out = []
    for path, x in zip(paths, leaves):
        if isinstance(x, DTensor):
            if x.device_mesh != mesh:
                raise ValueError(
                    f"funcamp.{api}: `{name}` leaf {path_str(path)} is already a DTensor on "
                    "another mesh; shard from plain tensors (DTensor.full_tensor() first)"
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
    from torch.distributed.tensor import DTensor, Replicate, Shard

    paths, leaves, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    local, layouts = [], []
    for path, x in zip(paths, leaves):
        if isinstance(x, DTensor):
            if x.device_mesh != mesh:
                raise ValueError(
                    f"funcamp.{api}: `{name}` leaf {path_str(path)} is a DTensor on another "
                    "mesh than the step's `mesh`; shard the state on the step's mesh"
                )
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
            # The local tensor itself (to_local() costs ~16 us a leaf through autograd; these
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
    """``x`` (a local shard) as a DTensor laid out as ``lay``, built from a cached spec: about
    4 us a leaf, where ``DTensor.from_local(..., run_check=False)`` takes about 60 us and a new
    spec about 30 us (torch 2.13 CPU); ``from_local`` if torch's private spec classes move."""
    from torch.distributed.tensor import DTensor

    try:
        key = (lay, x.dtype)
        spec = specs.get(key)
        if spec is None:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

            meta = TensorMeta(torch.Size(lay.shape), lay.stride, x.dtype)
            spec = specs[key] = DTensorSpec(mesh, _placements(lay.dim), meta)
        return DTensor(x, spec, requires_grad=False)
    except (ImportError, TypeError):  # pragma: no cover - another torch
        return DTensor.from_local(
            x,
            mesh,
            _placements(lay.dim),
            run_check=False,
            shape=torch.Size(lay.shape),
            stride=lay.stride,
        )


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
    """The full params: the sharded leaves packed in one flat buffer per dtype, all-gathered,
    and cut back into tensors of their global shapes; replicated leaves as they are."""
    out = list(leaves)
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (x, lay) in enumerate(zip(leaves, layouts)):
        if lay.dim is not None:
            buckets.setdefault((x.device, x.dtype), []).append(i)
    for idx in buckets.values():
        pieces, blocks = [], []
        for i in idx:
            d, shape = layouts[i].dim, layouts[i].shape
            chunk = -(-shape[d] // world)
            x = leaves[i].movedim(d, 0)
            if x.shape[0] < chunk:  # an uneven split: pad to the chunk size
                x = torch.cat([x, x.new_zeros((chunk - x.shape[0], *x.shape[1:]))])
            pieces.append(x.reshape(-1))
            blocks.append((chunk, x.shape[1:]))
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        full = _AllGather.apply(flat, group).view(world, -1)
        offset = 0
        for i, (chunk, rest) in zip(idx, blocks):
            d, shape = layouts[i].dim, layouts[i].shape
            size = chunk * math.prod(rest)
            block = full[:, offset : offset + size].reshape(world * chunk, *rest)
            out[i] = block[: shape[d]].movedim(0, d)
            offset += size
    return out


# ------------------------------------------------------------------- global-norm clipping

# While a sharded step runs (and is traced) the innermost entry computes the global gradient
# norm for funcamp.clip_by_global_norm from its per-leaf norms; see _optim.clip_by_global_norm.
NORM_HOOKS: list[Callable[[list[torch.Tensor]], torch.Tensor]] = []


def _norm_hook(layouts: tuple[Any, ...], group: Any) -> Callable[[list[torch.Tensor]], Any]:
    def global_norm(norms: list[torch.Tensor]) -> torch.Tensor:
        if len(norms) != len(layouts):
            raise NotImplementedError(
                "funcamp.clip_by_global_norm: under make_train_step(..., mesh=) it must see "
                f"every gradient leaf ({len(layouts)}), got {len(norms)}; chain it at the top "
                "level (chain(clip_by_global_norm(c), ...)), not inside masked/multi_transform"
            )
        sq = [n.to(torch.float32).square() for n in norms]
        sharded = [s for s, lay in zip(sq, layouts) if lay.dim is not None]
        replicated = [s for s, lay in zip(sq, layouts) if lay.dim is None]
        total = torch.zeros((), dtype=torch.float32, device=norms[0].device)
        if sharded:
            local = torch.stack(sharded).sum()
            total = funcol.wait_tensor(funcol.all_reduce(local, "sum", group))
        if replicated:
            total = total + torch.stack(replicated).sum()
        return total.sqrt()

    return global_norm


# ------------------------------------------------------------------------------- the step


def make_sharded_step(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    pol: Any,
    mesh: Any,
    opts: Any,
) -> Callable[..., Any]:
    """``make_train_step(..., mesh=mesh)``: see its docstring and the sharded-training guide.
    ``opts`` is its checked :class:`funcamp._train.StepOptions`."""
    from funcamp._amp import amp
    from funcamp._fp8 import needs_state, with_fp8_state
    from funcamp._progress import announce_first_call
    from funcamp._scaler import unscale, update
    from funcamp._train import (
        TrainState,
        _check_train_state,
        _compile,
        _forward_backward,
        _fresh_code,
        _metrics,
        _restore_buffers,
    )
    from funcamp._tree import tree_select
    from funcamp.distributed import _reduce_step
    from funcamp.optim._base import apply_updates, learning_rate

    api = "make_train_step"
    (
        has_aux,
        returns_buffers,
        compile,
        group,
        donate_state,
        headroom,
        report_norm,
        compile_options,
    ) = opts
    _check_mesh(api, mesh)
    if group is not None:
        raise ValueError(
            f"funcamp.{api}: give `mesh` or `group`, not both: a sharded step is also data "
            "parallel over the mesh's ranks (its process group)"
        )
    for name, on in (("donate_state=True", donate_state), ("headroom", headroom is not False)):
        if on:
            raise NotImplementedError(
                f"funcamp.{api}: `{name.split('=')[0]}` is not supported with `mesh` yet; "
                f"build the sharded step without {name}"
            )
    if needs_state(pol):
        raise NotImplementedError(
            f"funcamp.{api}: delayed FP8 scaling with `mesh` is not supported yet (the amax "
            "histories would need a max-reduction across ranks); use Fp8Recipe.current()"
        )
    pg = mesh.get_group()
    world = mesh.size()
    rank = mesh.get_local_rank()
    run_loss = with_fp8_state(amp(loss_fn, pol))
    plan: dict[str, Any] = {}  # the params' layouts, fixed by the first state

    def sharded_train_step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        layouts = plan["params"]
        scaler = state.scaler
        sharded = [lay.dim is not None for lay in layouts]

        def gather(local: PyTree) -> PyTree:
            leaves, spec = optree.tree_flatten(local, namespace=NAMESPACE)
            return unflatten(spec, _gather(leaves, layouts, pg, world))

        grads, loss, aux, new_buffers, _ = _forward_backward(
            run_loss,
            state,
            batch,
            has_aux,
            returns_buffers,
            False,  # delayed FP8 is refused above: no FP8 state to differentiate
            torch.func.grad_and_value,
            None,
            gather,
        )
        new_buffers = _restore_buffers(new_buffers, state.buffers, returns_buffers)
        leaves, spec = optree.tree_flatten(grads, namespace=NAMESPACE)
        # Sharded leaves: the reduce-scatter summed the ranks' gradients; their mean, unscaled.
        mine = [g / world for g, s in zip(leaves, sharded) if s]
        mine, inf_mine = unscale(scaler, mine)
        device = loss.device
        sumsq = torch.zeros((), dtype=torch.float32, device=device)
        if mine:
            sumsq = torch.stack([g.to(torch.float32).square().sum() for g in mine]).sum()
        # One all-reduce: the replicated leaves' gradients, the loss and rank 0's buffers (as
        # data parallel does), and each rank's squared norm and overflow flag of its shards.
        # (_reduce_step divides every gradient by the world size: the flag's mean is > 0 when
        # any rank's is set, and world * the mean of the squared norms is their sum.)
        extra = torch.stack([sumsq, inf_mine.to(device=device, dtype=torch.float32)])
        rep = [g for g, s in zip(leaves, sharded) if not s]
        reduced = _reduce_step(
            {"rep": rep, "extra": extra}, loss, new_buffers, pg, world, rank == 0
        )
        loss, new_buffers = reduced.loss, reduced.buffers
        rep, inf_rep = unscale(scaler, reduced.grads["rep"])
        extra = reduced.grads["extra"]
        found_inf = reduced.nonfinite | (extra[1] > 0) | inf_rep
        total = extra[0] * world
        if rep:
            total = total + torch.stack([g.to(torch.float32).square().sum() for g in rep]).sum()
        grad_norm = total.sqrt()
        it_mine, it_rep = iter(mine), iter(rep)
        unscaled = unflatten(spec, [next(it_mine) if s else next(it_rep) for s in sharded])
        check = optimizer.capabilities.preflight
        bad_lr = None if check is None else check(unscaled, state.opt_state, state.params)
        if bad_lr is not None:  # a NaN/inf/negative tensor learning rate skips the step
            found_inf = found_inf | bad_lr.to(found_inf.device)
        updates, opt_state = optimizer.update(unscaled, state.opt_state, state.params)
        params = apply_updates(state.params, updates)
        params = tree_select(found_inf, state.params, params)
        opt_state = tree_select(found_inf, state.opt_state, opt_state)
        new_scaler = update(scaler, found_inf)
        # The norm is computed anyway (it rides in the step's one all-reduce); None drops it.
        norm = grad_norm if report_norm else None
        lr = learning_rate(optimizer, state.opt_state)
        metrics = _metrics(loss, norm, scaler, found_inf, new_scaler, aux, has_aux, None, lr)
        new_state = TrainState(params, new_buffers, opt_state, new_scaler, state.fp8)
        return new_state, metrics

    sharded_train_step.__code__ = _fresh_code(sharded_train_step.__code__)
    run = (
        announce_first_call(_compile(sharded_train_step, compile_options))
        if compile
        else sharded_train_step
    )
    expected: list[Any] = []
    specs: dict[Any, Any] = {}  # DTensor specs of the new state's leaves, made once

    def step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"funcamp.{api}: `state` must be a funcamp.TrainState sharded with "
                f"funcamp.distributed.shard(state, mesh), got {describe(state)}"
            )
        params, p_lay = _unwrap(api, state.params, mesh, "state.params", True)
        opt_state, o_lay = _unwrap(api, state.opt_state, mesh, "state.opt_state", True)
        buffers, b_lay = _unwrap(api, state.buffers, mesh, "state.buffers", False)
        scaler, s_lay = _unwrap(api, state.scaler, mesh, "state.scaler", False)
        for name, lays in (("state.buffers", b_lay), ("state.scaler", s_lay)):
            if any(lay is not None and lay.dim is not None for lay in lays):
                raise ValueError(
                    f"funcamp.{api}: `{name}` must be replicated (plain tensors or Replicate() "
                    "DTensors), got a sharded DTensor; shard only params and optimizer state "
                    "(funcamp.distributed.shard(state, mesh) does so)"
                )
        local = TrainState(params, buffers, opt_state, scaler, state.fp8)
        structure = optree.tree_structure(batch, namespace=NAMESPACE)
        if not expected:
            try:
                _check_train_state(local, optimizer)
            except ValueError as e:
                raise ValueError(
                    f"{e}; under `mesh` the local shards are checked: shard params and "
                    "optimizer state together, funcamp.distributed.shard(state, mesh)"
                ) from None
            plan["params"] = p_lay
            expected.append((structure, p_lay))
        elif structure != expected[0][0]:
            raise ValueError(
                f"funcamp.{api}: `batch` must keep the structure of the first batch "
                f"{expected[0][0]}, got {structure}; build another step for batches of another "
                "structure (new shapes or dtypes only recompile)"
            )
        elif p_lay != expected[0][1]:
            raise ValueError(
                f"funcamp.{api}: `state.params` must keep the sharding of the first state the "
                "step ran on (the same global shapes and placements); build another step"
            )
        NORM_HOOKS.append(_norm_hook(p_lay, pg))
        try:
            new, metrics = run(local, batch)
        finally:
            NORM_HOOKS.pop()
        out = TrainState(
            _rewrap(new.params, p_lay, mesh, specs),
            _rewrap(new.buffers, b_lay, mesh, specs),
            _rewrap(new.opt_state, o_lay, mesh, specs),
            _rewrap(new.scaler, s_lay, mesh, specs),
            new.fp8,
        )
        return out, metrics

    step.__doc__ = (
        f"A funcamp sharded train step ({'compiled' if compile else 'eager'}, policy {pol}, "
        f"{world} ranks)."
    )
    step.train_step = sharded_train_step  # type: ignore[attr-defined]
    return step
