"""What a training step threads: :class:`TrainState`.

:func:`params_and_buffers` takes a module's params and buffers into it, and
:func:`load_into_module` writes them back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import optree
import torch

from funcamp._core.checks import flatten_params
from funcamp._core.donation import refuse_consumed
from funcamp._core.hints import optimizer_type_error
from funcamp._core.tree import (
    NAMESPACE,
    PyTree,
    describe,
    first_leaf,
    path_str,
    self_overlapping,
    sharing_memory,
)
from funcamp.casting.fp8 import Fp8State, needs_state
from funcamp.optim._base import Optimizer
from funcamp.optim._modes import init_from_exact
from funcamp.policy.policy import Policy, as_policy, off_policy_param
from funcamp.scaling.state import ScalerState
from funcamp.train.frozen import (
    Trainable,
    check_frozen,
    combine,
    split_trainable,
    trainable_flags,
)
from funcamp.train.torch_run import state_from_torch, state_to_torch

__all__ = [
    "TrainState",
    "check_donation",
    "check_overlap",
    "check_train_state",
    "load_into_module",
    "params_and_buffers",
]


class TrainState(NamedTuple):
    """Everything a training step reads and writes, as one pytree.

    Attributes:
        params: the parameters (a pytree of floating tensors, in the policy's ``param_dtype``).
        buffers: non-trained state passed to ``loss_fn`` (BatchNorm running stats); ``{}`` if
            none.
        opt_state: the optimizer's state.
        scaler: the :class:`funcamp.ScalerState` (its ``skipped`` leaf counts skipped steps).
        fp8: the delayed-scaling :class:`funcamp.Fp8State` (amax histories and scales of the
            FP8 call sites). Empty (the default) without a delayed FP8 recipe.
        frozen: the frozen parameters, a dict ``loss_fn`` gets merged into ``params``. Never
            differentiated, updated or given optimizer state. ``{}`` (the default) when every
            parameter trains. See :meth:`create`'s ``trainable``.

    Being a NamedTuple it flattens with optree and ``torch.utils._pytree``, compiles, and
    checkpoints with :func:`funcamp.state_dict`.

    Example:
        >>> import torch, funcamp
        >>> state = funcamp.TrainState.create({"w": torch.ones(2)}, funcamp.sgd(0.1), "float32")
        >>> state.params, state.buffers, state.scaler.kind
        ({'w': tensor([1., 1.])}, {}, 'noop')
    """

    params: PyTree
    buffers: PyTree
    opt_state: PyTree
    scaler: ScalerState
    fp8: Fp8State = Fp8State()
    frozen: PyTree = {}  # noqa: RUF012  (never mutated: a NamedTuple field default)

    @classmethod
    def create(
        cls,
        params: PyTree,
        optimizer: Optimizer,
        policy: Policy | str,
        *,
        buffers: PyTree = None,
        scaler: ScalerState | None = None,
        model: torch.nn.Module | None = None,
        trainable: Trainable = None,
    ) -> TrainState:
        """Build the initial state.

        It holds the optimizer state, the params (and buffers) cast to ``param_dtype``, the
        scaler, and the frozen params kept apart.

        Frozen parameters are what torch.optim over ``filter(lambda p: p.requires_grad,
        model.parameters())`` leaves alone. They go to ``state.frozen``, which ``loss_fn`` gets
        merged into its params. They are never differentiated, updated or given optimizer state
        (no weight decay, no all-reduce). By default a leaf is frozen where the module says so:
        :func:`params_and_buffers` hands a parameter with ``requires_grad=False`` over as such
        (a ``peft`` LoRA model's base weights). ``trainable=`` overrides it.

        The optimizer state is built for the params in ``param_dtype``, so a low-precision mode
        allocates what it needs. With ``master_weights=True`` the float32 masters are taken from
        the params *as given*, before the cast. So master weights start exact, not rounded
        through the half dtype.

        Args:
            params: a pytree of floating tensors, usually float32 (see
                :func:`params_and_buffers`).
            optimizer: a :class:`funcamp.Optimizer`.
            policy: a :class:`funcamp.Policy` or a policy string.
            buffers: optional pytree of buffers (default ``{}``). Floating ones are cast to
                ``param_dtype``, as ``module.to(dtype)`` would: BatchNorm needs its stats in the
                params' dtype.
            scaler: the loss scaler; default ``ScalerState.for_policy(policy)`` (dynamic for a
                float16 policy, noop otherwise) on the params' device.
            model: the root module ``loss_fn`` runs. With a delayed FP8 policy, the
                :class:`funcamp.Fp8State` is built for its FP8 call sites
                (:meth:`funcamp.Fp8State.init`). Ignored otherwise.
            trainable: which params train. ``None`` (default): all but those the module froze.
                ``True``: all. A glob pattern of the dotted path (``"*.lora_*"``) or a sequence
                of them, each matching a parameter. Or a callable ``path -> bool``.

        Returns:
            A :class:`TrainState`.

        Raises:
            ValueError: every parameter is frozen (nothing to train), or a ``trainable``
                pattern matches no parameter.

        Example:
            >>> import torch, funcamp
            >>> opt = funcamp.adam(1e-3, master_weights=True)
            >>> state = funcamp.TrainState.create({"w": torch.tensor([1.001])}, opt, "bf16-true")
            >>> state.params["w"].dtype, state.opt_state.low.master["w"]
            (torch.bfloat16, tensor([1.0010]))
            >>> model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 1))
            >>> _ = model[0].requires_grad_(False)  # a frozen embedding
            >>> params, _ = funcamp.params_and_buffers(model)
            >>> state = funcamp.TrainState.create(params, funcamp.adam(1e-3), "float32")
            >>> sorted(state.params), sorted(state.frozen), sorted(state.opt_state.exp_avg)
            (['1.bias', '1.weight'], ['0.weight'], ['1.bias', '1.weight'])
        """
        api = "TrainState.create"
        pol = as_policy(policy, api)
        if not isinstance(optimizer, Optimizer):
            raise optimizer_type_error(api, optimizer)
        leaves = _check_params(api, params)
        _check_float64_params(api, params, pol)
        params, frozen = _split(api, params, trainable)
        if buffers is None:
            buffers = {}
        if scaler is None:
            device = leaves[0].device if leaves else None
            scaler = ScalerState.for_policy(pol, device=device)
        elif not isinstance(scaler, ScalerState):
            raise TypeError(
                f"funcamp.{api}: `scaler` must be a funcamp.ScalerState, got {describe(scaler)}"
            )
        cast = pol.cast_to_param(params)
        # The optimizer state is built for the params in param_dtype (a mode allocates what it
        # needs), with float32 masters taken from the params as given: exact, not rounded.
        opt_state = init_from_exact(optimizer, cast, params)
        fp8 = Fp8State()
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"funcamp.{api}: `model` must be the torch.nn.Module loss_fn runs, got "
                f"{describe(model)}"
            )
        if needs_state(pol):
            if model is None:
                raise ValueError(
                    f"funcamp.{api}: the policy's delayed FP8 recipe keeps state per call site; "
                    "pass `model=` (the root module loss_fn runs) to build it"
                )
            fp8 = Fp8State.init(model, pol, device=leaves[0].device if leaves else None)
        frozen = optree.tree_map(
            lambda x: x.detach(), pol.cast_to_param(frozen), namespace=NAMESPACE
        )
        # Each state its own scaler object: a donated state is told by it (check_not_donated).
        scaler = dataclasses.replace(scaler)
        return cls(cast, pol.cast_to_param(buffers), opt_state, scaler, fp8, frozen)

    @classmethod
    def from_torch(
        cls,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: Policy | str,
        *,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        total_steps: int | None = None,
    ) -> tuple[TrainState, Optimizer]:
        """Take a torch run where it stands: ``(state, optimizer)`` that continue it.

        The state holds copies of the module's params and buffers, the optimizer's state and the
        GradScaler's. The optimizer is :func:`funcamp.optim.from_torch`'s translation, its
        schedule at the scheduler's position. Trained with its eager step, the run goes on as
        torch's would have, bit for bit. A param in no param group is frozen.

        torch's per-param ``step`` becomes the group's ``count``. Params of one group must have
        taken the same steps. torch's loop steps its scheduler on skipped steps too; a scheduler
        that many steps ahead of the count moves as a schedule shifted by them. An optimizer
        without a step (SGD, Muon) takes the scheduler's position as its count (else 1 once it
        holds state). The module and optimizer may be FSDP2's (their DTensors are gathered: every
        rank calls); ``funcamp.distributed.shard`` shards the state.

        Args:
            module: the module the optimizer trains (``functional_call`` runs it in ``loss_fn``).
            optimizer: a ``torch.optim`` optimizer over ``module``'s parameters.
            policy: a :class:`funcamp.Policy` or a policy string.
            scheduler: its lr_scheduler, stepped or not, or None.
            scaler: its ``torch.amp.GradScaler``, or None (``ScalerState.for_policy``).
            total_steps: the run's length, for ``LambdaLR``/``MultiplicativeLR`` (see
                :func:`funcamp.optim.from_torch`).

        Returns:
            ``(state, optimizer)``: a :class:`TrainState` and a :class:`funcamp.Optimizer`.

        Raises:
            ValueError: what :func:`funcamp.optim.from_torch` refuses; a group whose params took
                different steps, or where some have state and some not; a scheduler behind the
                optimizer (stepped once an epoch).

        Example:
            >>> import torch, funcamp
            >>> model = torch.nn.Linear(2, 1)
            >>> torch_opt = torch.optim.Adam(model.parameters(), lr=0.1)
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> torch_opt.step()
            >>> state, opt = funcamp.TrainState.from_torch(model, torch_opt, "float32")
            >>> state.opt_state.count, torch.equal(state.opt_state.exp_avg["bias"], torch_opt.state[model.bias]["exp_avg"])
            (tensor(1, dtype=torch.int32), True)
        """
        return state_from_torch(
            cls.create, module, optimizer, policy, scheduler, scaler, total_steps
        )

    def to_torch(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """Hand the run back to torch: write the state into the torch objects, in place.

        The params and buffers go into ``module`` (as :func:`load_into_module`), the optimizer
        state into ``optimizer.state``, the scaler's into the GradScaler. The scheduler is put
        at the count (plus the lead it had over the optimizer's step, see :meth:`from_torch`):
        its ``last_epoch``, its internal state and the groups' ``lr`` are funcamp's learning
        rates there. torch's loop then continues the run as funcamp's step would have, bit for
        bit. A sharded state is gathered (every rank calls); an FSDP2 module and optimizer
        receive their shards.

        Args:
            module: the module, with the state's param and buffer names.
            optimizer: the ``torch.optim`` optimizer the state's optimizer translates (the same
                class, param groups and hyperparameters).
            scheduler: its lr_scheduler, or None (the groups' ``lr`` are left as they are).
            scaler: a ``torch.amp.GradScaler``, or None.

        Raises:
            ValueError: names or shapes that differ from the module's; a donated state; a
                ``noop`` scaler into an enabled GradScaler (or the reverse).

        Example:
            >>> import torch, funcamp
            >>> model = torch.nn.Linear(2, 1)
            >>> torch_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            >>> state, opt = funcamp.TrainState.from_torch(model, torch_opt, "float32")
            >>> grads = {k: torch.ones_like(v) for k, v in state.params.items()}
            >>> updates, opt_state = opt.update(grads, state.opt_state, state.params)
            >>> state = state._replace(
            ...     params=funcamp.apply_updates(state.params, updates), opt_state=opt_state)
            >>> state.to_torch(model, torch_opt)
            >>> torch_opt.state[model.bias]["momentum_buffer"]
            tensor([1.])
        """
        state_to_torch(self, module, optimizer, scheduler, scaler)


def _split(api: str, params: PyTree, trainable: Trainable) -> tuple[PyTree, PyTree]:
    """``(trained params, frozen params)``; refuses a state with nothing to train."""
    flags = trainable_flags(api, params, trainable)
    if flags and not any(flags):
        hint = (
            "unfreeze some (module.requires_grad_(True) on them before params_and_buffers) "
            "or choose them with `trainable=`"
            if trainable is None
            else "choose at least one with `trainable=`"
        )
        raise ValueError(
            f"funcamp.{api}: every one of the {len(flags)} parameters is frozen, so there is "
            f"nothing to train; {hint}"
        )
    return split_trainable(api, params, flags)


def _check_params(api: str, params: PyTree) -> list[torch.Tensor]:
    return flatten_params(api, params)[0]


def _check_float64_params(api: str, params: PyTree, pol: Policy) -> None:
    """float64 tensors are never cast (as in torch), so a float64 param under a policy whose
    ``param_dtype`` is not float64 would stay float64 and meet compute-dtype activations in its
    first matmul (``Half != double``): refuse it here instead."""
    if pol.param_dtype == torch.float64:
        return
    paths, leaves, _ = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
    for path, p in zip(paths, leaves):
        if isinstance(p, torch.Tensor) and p.dtype == torch.float64:
            raise TypeError(
                f"funcamp.{api}: `params` leaf {path_str(path)} must not be float64 under policy "
                f"{pol} (float64 tensors are never cast, so it would stay float64 and fail in "
                "the first op that meets a compute-dtype input), got a float64 tensor; cast the "
                "params first (funcamp.tree_cast(params, torch.float32)) or use a float64 policy"
            )


def params_and_buffers(
    module: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Return ``(params, buffers)``: detached ``{name: tensor}`` dicts of a module's state.

    The tensors share storage with the module (no copy); funcamp never modifies them. Pass them to
    ``torch.func.functional_call(module, (params, buffers), args)``. A parameter the module froze
    comes as a detached ``torch.nn.Parameter`` with ``requires_grad=False`` (a frozen embedding, a
    ``peft`` model's base weights). The others come as plain tensors. So :meth:`TrainState.create`
    keeps the frozen ones out of training.

    Example:
        >>> import torch, funcamp
        >>> params, buffers = funcamp.params_and_buffers(torch.nn.BatchNorm1d(3))
        >>> sorted(params), sorted(buffers)
        (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
        >>> params["weight"].requires_grad
        False
        >>> lin = torch.nn.Linear(2, 1)
        >>> _ = lin.bias.requires_grad_(False)
        >>> {k: type(v).__name__ for k, v in funcamp.params_and_buffers(lin)[0].items()}
        {'weight': 'Tensor', 'bias': 'Parameter'}
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"funcamp.params_and_buffers: `module` must be a torch.nn.Module, got "
            f"{describe(module)}"
        )
    params = {
        k: v.detach() if v.requires_grad else torch.nn.Parameter(v.detach(), requires_grad=False)
        for k, v in module.named_parameters()
    }
    buffers = {k: v.detach() for k, v in module.named_buffers()}
    return params, buffers


def load_into_module(
    module: torch.nn.Module,
    state: TrainState | PyTree,
    buffers: PyTree = None,
) -> torch.nn.Module:
    """Write trained params and buffers back into ``module``, in place, and return it.

    The inverse of :func:`params_and_buffers`: for inference, export, ``torch.save`` of the module
    or Hugging Face's ``save_pretrained``. Each value is copied into the module's own tensor
    (``copy_`` under ``no_grad``). So the module keeps its dtypes, devices and tensor identities,
    and an optimizer or hook holding them stays valid. Tied weights stay tied. A parameter shared
    by several names is one tensor, named once in ``params_and_buffers``'s dict and written once.
    (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``.)

    Params kept in a lower precision (``"bf16-true"``) are widened into float32 module tensors
    exactly. To keep the module in bfloat16, call ``module.to(torch.bfloat16)`` first. Sharded
    leaves (``funcamp.distributed.shard``) are gathered first, so every rank must call.

    Args:
        module: the module the params came from.
        state: a :class:`TrainState` (its ``params``, ``frozen`` and ``buffers`` are written),
            or a params dict as :func:`params_and_buffers` gives. Frozen parameters may be
            left out of the dict.
        buffers: with a params dict, an optional dict of buffers to write too.

    Returns:
        ``module``.

    Raises:
        ValueError: a name the module does not have; a module parameter (or buffer of a given
            dict) missing from ``state``; a shape that differs from the module's; or a donated
            state (or one whose donated step raised part-way). Nothing is written then.

    Example:
        >>> import torch, funcamp
        >>> model = torch.nn.Linear(2, 1)
        >>> params, buffers = funcamp.params_and_buffers(model)
        >>> trained = {k: torch.zeros_like(v) for k, v in params.items()}
        >>> funcamp.load_into_module(model, trained)(torch.ones(1, 2))
        tensor([[0.]], grad_fn=<AddmmBackward0>)
    """
    api = "load_into_module"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"funcamp.{api}: `module` must be a torch.nn.Module, got {describe(module)}"
        )
    if isinstance(state, TrainState):
        refuse_consumed(api, state.scaler)
        if buffers is not None:
            raise TypeError(
                f"funcamp.{api}: `buffers` must not be given with a TrainState (its buffers "
                "are written); pass the params dict instead to choose the buffers"
            )
        params, buffers = combine(state.params, state.frozen), state.buffers
    else:
        params = state
    targets = [("`state` params", params, dict(module.named_parameters()))]
    if buffers is not None:
        targets.append(
            (
                "`buffers`" if state is params else "`state` buffers",
                buffers,
                dict(module.named_buffers()),
            )
        )
    writes = []
    for what, given, own in targets:
        if not isinstance(given, dict):
            raise TypeError(
                f"funcamp.{api}: {what} must be a dict {{name: tensor}} as params_and_buffers "
                f"gives, got {describe(given)}"
            )
        unknown = sorted(set(given) - set(own))
        missing = sorted(
            n
            for n in set(own) - set(given)
            # a dict of params may leave out what the module froze (the trained part of a
            # LoRA model: state.params); a TrainState names them all (state.frozen)
            if given is not params or isinstance(state, TrainState) or own[n].requires_grad
        )
        if unknown or missing:
            names = ", ".join(repr(n) for n in (unknown or missing)[:3])
            raise ValueError(
                f"funcamp.{api}: {what} must name exactly the module's tensors (as "
                f"params_and_buffers gives them): {'unknown' if unknown else 'missing'} "
                f"{names}; nothing was written"
            )
        for name, target in own.items():
            if name not in given:  # a frozen parameter left out: not written
                continue
            value = given[name]
            if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                raise ValueError(
                    f"funcamp.{api}: {what} {name!r} must be a tensor of shape "
                    f"{tuple(target.shape)}, got {describe(value)}; nothing was written"
                )
            writes.append((target, value))
    with torch.no_grad():
        for target, value in writes:
            if hasattr(value, "full_tensor"):  # a DTensor from funcamp.distributed.shard
                value = value.full_tensor()
            target.copy_(value)
    return module


def check_train_state(
    api: str, state: TrainState, optimizer: Optimizer, policy: Policy | None = None
) -> None:
    """First-call check: ``opt_state`` must be what ``optimizer.init(params)`` builds.

    The structure and shapes are computed on the meta device, so nothing is allocated. With
    ``policy``, the state must be one built for it (:func:`check_fits_policy`).
    """
    _check_params(api, state.params)
    if not isinstance(state.scaler, ScalerState):
        raise TypeError(
            f"funcamp.{api}: `state.scaler` must be a funcamp.ScalerState, got "
            f"{describe(state.scaler)}"
        )
    if policy is not None:
        check_fits_policy(api, state, policy)
    if not isinstance(state.fp8, Fp8State):
        raise TypeError(
            f"funcamp.{api}: `state.fp8` must be a funcamp.Fp8State (TrainState.create builds "
            f"it), got {describe(state.fp8)}"
        )
    check_frozen(api, state.params, state.frozen)
    meta = optree.tree_map(
        lambda p: torch.empty_like(p, device="meta"), state.params, namespace=NAMESPACE
    )
    try:
        want_paths, want, want_spec = optree.tree_flatten_with_path(
            optimizer.init(meta), namespace=NAMESPACE
        )
    except Exception:  # an optimizer that cannot init on meta: leave the checks to it
        return
    _, got, got_spec = optree.tree_flatten_with_path(state.opt_state, namespace=NAMESPACE)
    hint = "build it with optimizer.init(params) or TrainState.create"
    if got_spec != want_spec:
        raise ValueError(
            f"funcamp.{api}: `state.opt_state` must match `state.params` and the optimizer "
            f"({hint}): expected structure {want_spec}, got {got_spec}"
        )
    for path, w, g in zip(want_paths, want, got):
        if isinstance(w, torch.Tensor) and (
            not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype
        ):
            raise ValueError(
                f"funcamp.{api}: `state.opt_state` leaf {path_str(path)} must be a "
                f"{w.dtype} tensor of shape {tuple(w.shape)} to match `state.params` ({hint}), "
                f"got {describe(g)}"
            )


def check_fits_policy(api: str, state: TrainState, policy: Policy) -> None:
    """Check that the state was built for ``policy``.

    Its trained params must be in ``policy.param_dtype`` (float64 and FP8 leaves aside, as
    :func:`funcamp.save` checks). A policy that computes or keeps params in float16 must have a
    loss scaler (not ``noop``).
    """
    fix = (
        f"build the state for this policy (TrainState.create(params, optimizer, {str(policy)!r})), "
        "or build the step with the state's policy"
    )
    found = off_policy_param(policy, state.params)
    if found is not None:
        where, leaf = found
        raise ValueError(
            f"funcamp.{api}: the step's policy {str(policy)!r} keeps params in "
            f"{policy.param_dtype}, but state.params{where} is {leaf.dtype}: the state was "
            f"built for another policy; {fix}"
        )
    needs = ScalerState.for_policy(policy).kind
    if needs == "dynamic" and state.scaler.kind == "noop":
        raise ValueError(
            f"funcamp.{api}: the step's policy {str(policy)!r} runs in float16 and needs a loss "
            f"scaler (ScalerState.dynamic(), what TrainState.create gives it), but state.scaler "
            f"is a 'noop' one: float16 gradients would underflow unscaled. The state was built "
            f"for another policy; {fix} (or pass scaler=ScalerState.dynamic() or .static(...))"
        )


def check_donation(api: str, state: TrainState) -> None:
    """With ``donate_state=True``, no two state tensors may share memory, and none may need grad.

    Two that share memory would clobber each other's writes.
    """
    trees = {
        "state.params": state.params,
        "state.buffers": state.buffers,
        "state.opt_state": state.opt_state,
        "state.frozen": state.frozen,  # never written, but a write through a shared one would
    }
    grad_leaf = first_leaf(trees, lambda x: isinstance(x, torch.Tensor) and x.requires_grad)
    if grad_leaf is not None:
        raise ValueError(
            f"funcamp.{api}: with donate_state=True (the default) the state's tensors are "
            f"written in place, but {grad_leaf} requires grad; detach it (params_and_buffers "
            "does) or build the step with donate_state=False"
        )
    shared = sharing_memory(trees)
    if shared is not None:
        raise ValueError(
            f"funcamp.{api}: with donate_state=True (the default) the state's tensors are "
            f"written in place, but {shared[0]} and {shared[1]} share memory; give each its own tensor "
            "(clone one) or build the step with donate_state=False"
        )


def check_overlap(api: str, state: TrainState) -> None:
    """With ``donate_state=True``, no state tensor may have elements that share memory.

    Such a tensor is an expanded one (stride 0). Torch refuses to write it in place, but only
    after the step's first writes. So this is checked once per state, before any write, naming
    the leaf.
    """
    trees = {
        "state.params": state.params,
        "state.buffers": state.buffers,
        "state.opt_state": state.opt_state,
    }
    leaf = first_leaf(
        trees,
        lambda x: isinstance(x, torch.Tensor) and self_overlapping(x, certain=True),
    )
    if leaf is not None:
        raise ValueError(
            f"funcamp.{api}: with donate_state=True (the default) the state's tensors are "
            f"written in place, but elements of {leaf} share memory (an expanded tensor, "
            "stride 0), which torch cannot write in place; give it its own memory "
            "(`.clone()` it, or `.contiguous()`) or build the step with donate_state=False"
        )
