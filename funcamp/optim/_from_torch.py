"""``funcamp.optim.from_torch``: a torch.optim optimizer (and its lr_scheduler) as a funcamp
optimizer, through two tables: :data:`OPTIMIZERS` (torch class -> translator of one param
group) and :data:`SCHEDULERS` (scheduler class -> translator of one group's schedule).
:data:`OPTIMIZERS` is derived from :data:`funcamp.optim.REGISTRY`: a registered optimizer with a
torch twin whose arguments are torch's by name (``betas`` as ``b1, b2``) needs nothing here;
one whose arguments differ has its translator in ``_TRANSLATORS``."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from funcamp._core.tree import describe
from funcamp.optim import _lr_schedulers as ls
from funcamp.optim._base import Optimizer
from funcamp.optim._lion import lion
from funcamp.optim._optimizers import adam, adamw
from funcamp.optim._plateau import reduce_on_plateau
from funcamp.optim._registry import REGISTRY
from funcamp.optim._schedules import _mark, chained_lr, join_schedules
from funcamp.optim._sgd import sgd
from funcamp.optim._transforms import multi_transform

__all__ = ["OPTIMIZERS", "SCHEDULERS", "from_torch"]

API = "optim.from_torch"
LRS = torch.optim.lr_scheduler

#: ``translate(group, lr, name) -> Optimizer``: one param group's hyper-parameters (the
#: group's dict; ``lr`` is the learning rate or schedule to use; ``name``: the torch class's
#: name, for messages).
Translator = Callable[[Mapping[str, Any], Any, str], Optimizer]
#: ``translate(scheduler, group_index, base_lr, total_steps) -> schedule`` (``total_steps``:
#: from_torch's, or None).
ScheduleTranslator = Callable[[Any, int, float, Any], Any]

#: group keys that do not change the numbers (the implementation flags, the schedulers' keys)
_IGNORED = {
    "params", "lr", "foreach", "capturable", "differentiable", "initial_lr", "max_lr",
    "min_lr", "max_momentum", "base_momentum", "param_names", "name",
}  # fmt: skip


def _refuse(what: str, why: str) -> ValueError:
    return ValueError(f"funcamp.{API}: {what} {why}")


def _floats(name: str, group: Mapping[str, Any], key: str, i: int) -> Any:
    value = group[key]
    items = value if isinstance(value, tuple) else (value,)
    if any(isinstance(x, torch.Tensor) for x in items):
        raise _refuse(
            f"{name} param group {i}'s `{key}`",
            f"holds tensors ({value!r}); funcamp's optimizers take floats: pass floats to "
            "torch.optim",
        )
    return value


#: torch optimizer -> which tensor betas (b1, b2) its foreach step fails on (torch 2.13:
#: NAdam's on either, RAdam's on b2, Adamax's on b1); its single-tensor step takes them all.
_FOREACH_REFUSES = {"NAdam": (True, True), "RAdam": (False, True), "Adamax": (True, False)}


def _foreach(group: Mapping[str, Any]) -> bool:
    """Whether torch runs the group's foreach step (``foreach=None``: torch's default for the
    group's params, foreach on CUDA, not on CPU)."""
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    params = list(group["params"])
    return _default_to_fused_or_foreach(params, bool(group.get("differentiable")), False)[1]


def _tensor_betas(name: str, group: Mapping[str, Any], i: int) -> tuple[Any, Any]:
    """A group's ``betas`` where funcamp's optimizer takes 0-d tensors as torch does: copies
    (the group's stay), detached unless torch differentiates through them; refused where
    torch's own step fails on them (a foreach step)."""
    betas = tuple(group["betas"])
    on = tuple(isinstance(b, torch.Tensor) for b in betas)
    if not any(on):
        return betas
    where = f"{name} param group {i}'s `betas`"
    refuses = _FOREACH_REFUSES.get(name, (False, False))
    if any(t and r for t, r in zip(on, refuses)) and _foreach(group):
        raise _refuse(
            where,
            f"holds tensors ({betas!r}), on which torch.optim.{name}'s foreach step fails: "
            f"build it with foreach=False (its single-tensor step, whose numbers funcamp's "
            "has) or with float betas",
        )
    if group.get("differentiable") and any(t and b.requires_grad for t, b in zip(on, betas)):
        raise _refuse(
            where,
            f"holds tensors that require grad ({betas!r}) in a differentiable group; funcamp "
            "reads a beta's value once and does not differentiate through it: pass detached "
            "betas",
        )
    return tuple(b.detach().clone() if t else b for t, b in zip(on, betas))


def _check_keys(name: str, group: Mapping[str, Any], known: set[str], i: int) -> None:
    for key, value in group.items():
        if key in _IGNORED or key in known:
            continue
        if isinstance(value, (bool, int, float, tuple, torch.Tensor)) or value is None:
            raise _refuse(
                f"{name} param group {i}'s `{key}`={value!r}",
                f"has no funcamp translation (funcamp.{API} knows {sorted(known)})",
            )


def _sgd(group: Mapping[str, Any], lr: Any, name: str, i: int = 0) -> Optimizer:
    _check_keys(name, group, {"momentum", "dampening", "weight_decay", "nesterov", "maximize",
                              "fused"}, i)  # fmt: skip
    return sgd(
        lr,
        momentum=_floats(name, group, "momentum", i),
        nesterov=bool(group["nesterov"]),
        weight_decay=_floats(name, group, "weight_decay", i),
        dampening=_floats(name, group, "dampening", i),
        maximize=bool(group["maximize"]),
        fused=bool(group.get("fused") or False),
    )


def _adam_like(decoupled: bool) -> Translator:
    def translate(group: Mapping[str, Any], lr: Any, name: str, i: int = 0) -> Optimizer:
        known = {"betas", "eps", "weight_decay", "amsgrad", "maximize", "fused",
                 "decoupled_weight_decay"}  # fmt: skip
        _check_keys(name, group, known, i)
        b1, b2 = _tensor_betas(name, group, i)
        make = adamw if decoupled or group.get("decoupled_weight_decay", False) else adam
        return make(
            lr,
            b1=b1,
            b2=b2,
            eps=_floats(name, group, "eps", i),
            weight_decay=_floats(name, group, "weight_decay", i),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            fused=bool(group.get("fused") or False),
            differentiable=bool(group.get("differentiable") or False),
        )

    return translate


def _lion(group: Mapping[str, Any], lr: Any, name: str, i: int = 0) -> Optimizer:
    _check_keys(name, group, {"betas", "weight_decay", "use_triton"}, i)
    if group.get("decoupled_weight_decay"):
        raise _refuse(
            f"{name} param group {i}'s `decoupled_weight_decay`=True",
            "(lion-pytorch's weight decay scaled by lr / initial lr) has no funcamp translation",
        )
    b1, b2 = _floats(name, group, "betas", i)
    return lion(lr, b1=b1, b2=b2, weight_decay=_floats(name, group, "weight_decay", i))


#: funcamp's arguments that are not torch hyper-parameters (the low-precision modes).
_FUNCAMP_ONLY = {"learning_rate", "master_weights", "kahan", "stochastic_rounding", "seed"}


def _same_names(
    make: Callable[..., Optimizer], accepted: tuple[str, ...] = (), tensor_betas: bool = False
) -> Translator:
    """The translator of a funcamp optimizer whose arguments are torch's, by name (``betas``
    split into ``b1, b2``); ``accepted``: group keys that do not change the numbers;
    ``tensor_betas``: ``make`` takes 0-d tensor betas as torch does."""
    args = [k for k in inspect.signature(make).parameters if k not in _FUNCAMP_ONLY]
    keys = ["betas" if k == "b1" else k for k in args if k != "b2"]

    def translate(group: Mapping[str, Any], lr: Any, name: str, i: int = 0) -> Optimizer:
        _check_keys(name, group, {*keys, *accepted}, i)
        kwargs = {
            k: _tensor_betas(name, group, i)
            if k == "betas" and tensor_betas
            else _floats(name, group, k, i)
            for k in keys
            if k in group
        }
        if "betas" in kwargs:
            kwargs["b1"], kwargs["b2"] = kwargs.pop("betas")
        if "foreach" in keys:  # the step torch runs: foreach=None resolved as torch does
            kwargs["foreach"] = _foreach(group)
        return make(lr, **kwargs)

    return translate


def _refused(alternative: str) -> Callable[..., Optimizer]:
    def translate(group: Mapping[str, Any], lr: Any, name: str, i: int = 0) -> Optimizer:
        raise _refuse(f"`optimizer` {name}", alternative)

    return translate


#: the translators of the registered optimizers whose arguments are not torch's by name
_TRANSLATORS: dict[str, Translator] = {
    "sgd": _sgd,
    "adam": _adam_like(False),
    "adamw": _adam_like(True),
    "lion": _lion,
}

#: optimizer class (or, for one outside torch, ``"module.QualName"``) -> translator of one
#: param group: every registered optimizer's torch twin (LBFGS's ``update`` takes the
#: closure's loss as a function: ``update(None, state, params, value_fn=loss_fn)``), and the
#: refused ones.
OPTIMIZERS: dict[type | str, Callable[..., Optimizer]] = {
    **{
        e.torch: _TRANSLATORS.get(e.name) or _same_names(e.factory, tensor_betas=e.tensor_betas)
        for e in REGISTRY.values()
        if e.torch is not None
    },
    torch.optim.SparseAdam: _refused(
        "takes sparse gradients (embeddings with sparse=True), which funcamp's optimizers do "
        "not: use dense gradients and funcamp.adam (its moments decay on every row, where "
        "SparseAdam's move only on the rows a step's gradient holds)"
    ),
}


def _translator(optimizer: Any) -> Any:
    cls = type(optimizer)
    return OPTIMIZERS.get(cls) or OPTIMIZERS.get(f"{cls.__module__}.{cls.__qualname__}")


def _cycles_momentum(s: Any) -> bool:
    return isinstance(s, (LRS.CyclicLR, LRS.OneCycleLR)) and bool(s.cycle_momentum)


def _cyclic_shape(s: Any) -> tuple[int, int, Any]:
    up = round(s.total_size * s.step_ratio)
    return up, int(s.total_size) - up, s._scale_fn_custom


def _cyclic(s: Any, i: int, base: float, n: int | None) -> Any:
    up, down, custom = _cyclic_shape(s)
    return ls.cyclic_lr(
        s.base_lrs[i], s.max_lrs[i], up, down, s.mode, s.gamma, scale_fn=custom,
        scale_mode=s.scale_mode,
    )  # fmt: skip


def _one_cycle_record(s: Any) -> tuple[list[list[float]], list[list[float]]]:
    """OneCycleLR's learning rates and momenta (``[step][group]``) at each of its
    ``total_steps + 1`` positions: its own ``get_lr`` at each ``last_epoch``, run on a copy
    whose param groups are copies (its side effect, the momentum, lands there)."""
    view = copy.copy(s)
    view.optimizer = SimpleNamespace(param_groups=[dict(g) for g in s.optimizer.param_groups])
    view._get_lr_called_within_step = True  # get_lr's "use get_last_lr()" warning
    lrs, momenta = [], []
    for k in range(int(s.total_steps) + 1):
        view.last_epoch = k
        lrs.append([float(x) for x in view.get_lr()])
        if view.cycle_momentum:  # (use_beta1 is set only then)
            beta1, groups = view.use_beta1, view.optimizer.param_groups
            momenta.append([float(g["betas"][0] if beta1 else g["momentum"]) for g in groups])
    return lrs, momenta


def _one_cycle(s: Any, i: int, base: float, n: int | None) -> Any:
    group = s.optimizer.param_groups[i]
    lrs = _one_cycle_record(s)[0]
    return _mark(ls._tabulate("optim.from_torch", [v[i] for v in lrs]), group["initial_lr"])


def _cycled_momentum(s: Any, i: int) -> Any:
    """Group ``i``'s momentum (or first beta) as the scheduler cycles it: CyclicLR's in closed
    form (its learning rate's, from ``max_momentum`` down to ``base_momentum``: the same
    doubles), OneCycleLR's recorded at each of its positions."""
    if isinstance(s, LRS.CyclicLR):
        up, down, custom = _cyclic_shape(s)
        return ls.cyclic_lr(
            s.max_momentums[i], s.base_momentums[i], up, down, s.mode, s.gamma,
            scale_fn=custom, scale_mode=s.scale_mode,
        )  # fmt: skip
    momenta = _one_cycle_record(s)[1]
    return ls._tabulate("optim.from_torch", [v[i] for v in momenta])


def _inner_cycle(s: Any) -> Any:
    """The first scheduler inside ``s`` (SequentialLR, ChainedScheduler) that cycles the
    momentum, or None."""
    for sub in getattr(s, "_schedulers", None) or ():
        found = sub if _cycles_momentum(sub) else _inner_cycle(sub)
        if found is not None:
            return found
    return None


def cycled_group(s: Any, group: Mapping[str, Any], i: int) -> Mapping[str, Any]:
    """``group`` with the momentum (``"momentum"``, or ``"betas"``' first entry) that the
    scheduler ``s`` cycles, as a schedule; ``group`` itself where ``s`` cycles none."""
    if s is None or isinstance(s, LRS.ReduceLROnPlateau):
        return group
    inner = _inner_cycle(s)
    if inner is not None:
        raise _refuse(
            f"a {type(inner).__name__}(cycle_momentum=True) inside a {type(s).__name__}",
            "has no funcamp translation (its momentum schedule would have to be joined with "
            "the fixed momentum around it): build it with cycle_momentum=False",
        )
    if not _cycles_momentum(s):
        return group
    momentum = _cycled_momentum(s, i)
    if s.use_beta1:
        return {**group, "betas": (momentum, *tuple(group["betas"])[1:])}
    return {**group, "momentum": momentum}


def _sequential(s: Any, i: int, base: float, n: int | None) -> Any:
    return join_schedules([_schedule(x, i, n) for x in s._schedulers], list(s._milestones))


def _chained(s: Any, i: int, base: float, n: int | None) -> Any:
    return chained_lr(*[_schedule(x, i, n) for x in s._schedulers])


def _multiplicative(s: Any, i: int, base: float, n: int | None) -> Any:
    if n is None:
        raise _refuse(
            "a MultiplicativeLR",
            "is a running product with no closed form: pass total_steps= to tabulate it",
        )
    return ls.multiplicative_lr(base, s.lr_lambdas[i], n)


def _refused_schedule(alternative: str) -> ScheduleTranslator:
    def translate(s: Any, i: int, base: float, n: int | None) -> Any:
        raise _refuse(f"a {type(s).__name__}", alternative)

    return translate


#: lr_scheduler class -> translator of one param group's schedule.
SCHEDULERS: dict[type, ScheduleTranslator] = {
    LRS.StepLR: lambda s, i, b, n: ls.step_lr(b, s.step_size, s.gamma),
    LRS.MultiStepLR: lambda s, i, b, n: ls.multi_step_lr(b, list(s.milestones.elements()), s.gamma),
    LRS.ExponentialLR: lambda s, i, b, n: ls.exponential_lr(b, s.gamma),
    LRS.CosineAnnealingLR: lambda s, i, b, n: ls.cosine_annealing_lr(b, s.T_max, s.eta_min),
    LRS.CosineAnnealingWarmRestarts: lambda s, i, b, n: ls.cosine_annealing_warm_restarts(
        b, s.T_0, s.T_mult, s.eta_min
    ),
    LRS.LinearLR: lambda s, i, b, n: ls.linear_lr(b, s.start_factor, s.end_factor, s.total_iters),
    LRS.ConstantLR: lambda s, i, b, n: ls.constant_lr(b, s.factor, s.total_iters),
    LRS.PolynomialLR: lambda s, i, b, n: ls.polynomial_lr(b, s.total_iters, s.power),
    LRS.LambdaLR: lambda s, i, b, n: ls.lambda_lr(b, s.lr_lambdas[i], n),
    LRS.CyclicLR: _cyclic,
    LRS.OneCycleLR: _one_cycle,
    LRS.SequentialLR: _sequential,
    LRS.ChainedScheduler: _chained,
    LRS.MultiplicativeLR: _multiplicative,
    LRS.ReduceLROnPlateau: _refused_schedule(
        "reads a metric, which a schedule of the step count cannot: pass it as `scheduler` "
        "alone (from_torch wraps the optimizer in funcamp.optim.reduce_on_plateau)"
    ),
}


def _schedule(s: Any, i: int, n: int | None = None) -> Any:
    translate = SCHEDULERS.get(type(s))
    if translate is None:
        raise _refuse(
            f"`scheduler` {type(s).__name__}",
            f"has no funcamp translation (it knows {sorted(c.__name__ for c in SCHEDULERS)})",
        )
    if getattr(s, "last_epoch", 0) not in (0, -1):
        raise _refuse(
            f"`scheduler` {type(s).__name__}",
            f"has been stepped ({s.last_epoch} times); translate it before the first "
            "scheduler.step()",
        )
    base_lrs = getattr(s, "base_lrs", None)
    base = base_lrs[i] if base_lrs else s.optimizer.param_groups[i].get("initial_lr")
    return translate(s, i, base, n)


def from_torch(
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, torch.Tensor],
    scheduler: Any = None,
    *,
    total_steps: int | None = None,
) -> Optimizer:
    """The funcamp optimizer of a torch.optim optimizer (and of its lr_scheduler): its
    ``init``/``update`` over a params dict with the names of ``params`` give torch.optim's
    numbers, and :func:`funcamp.optim.learning_rate` torch's learning rate at every step.

    Each param group becomes the funcamp optimizer of the group's hyper-parameters; several
    groups become a :func:`funcamp.multi_transform` labelled ``"group0"``, ``"group1"``, ...
    by identity (which tensor of ``params`` is in which group). Adam/AdamW's ``fused=True``
    maps to funcamp's ``fused=True`` (torch's kernel, bit for bit), Adagrad's to the same
    operations. NAdam's and RAdam's ``foreach`` (``None`` resolved as torch resolves it) and
    Adam's, AdamW's and NAdam's ``differentiable`` map to funcamp's keywords of the same name:
    the numbers of the step torch runs. Elsewhere ``foreach``, ``capturable`` and
    ``differentiable`` do not change the numbers.
    0-d tensor betas are translated where funcamp's optimizer takes them (Adam, AdamW, NAdam,
    RAdam, Adamax) and torch's step does. What has no translation is refused by name: tensor
    betas elsewhere or on a foreach step that fails on them, a group key no translator knows,
    a param in no group or in two, a scheduler stepped already, one that cycles the momentum
    inside a ``SequentialLR``/``ChainedScheduler``, ``SparseAdam``. ``OneCycleLR`` and
    ``CyclicLR`` that cycle the momentum (their default) make it a schedule of the group's
    ``momentum`` or first beta. A ``ReduceLROnPlateau`` wraps the
    optimizer in :func:`funcamp.optim.reduce_on_plateau` (feed it with
    :func:`funcamp.optim.plateau_step`).

    Supported (:data:`OPTIMIZERS`): every torch.optim optimizer but ``SparseAdam`` -- ``SGD``,
    ``Adam``, ``AdamW``, ``RMSprop``, ``Adagrad``, ``Adadelta``, ``Adamax``, ``NAdam``,
    ``RAdam``, ``ASGD``, ``Rprop``, ``Adafactor``, ``Muon``, ``LBFGS`` (whose ``update`` takes
    the closure's loss as ``value_fn``: see :func:`funcamp.lbfgs`) -- and lion-pytorch's
    ``Lion``; every step-indexed lr_scheduler (:data:`SCHEDULERS`). Two torch optimizers (Muon
    for the hidden matrices, AdamW for the rest) are two ``from_torch`` calls, each given its
    optimizer's params, joined by :func:`funcamp.multi_transform` on the param names.

    Args:
        optimizer: a ``torch.optim`` optimizer.
        params: the names of the tensors in its param groups, as
            ``dict(model.named_parameters())`` (every tensor of a group must be in it).
        scheduler: an ``lr_scheduler`` on ``optimizer``, not stepped yet, or None (the groups'
            ``lr``).
        total_steps: the run's length: ``LambdaLR``'s and ``MultiplicativeLR``'s Python
            functions are then tabulated over it, as torch calls them (torch's numbers
            exactly; without it a ``LambdaLR`` function gets the count as a tensor).

    Returns:
        An :class:`~funcamp.Optimizer`.

    Example:
        >>> import torch, funcamp
        >>> model = torch.nn.Linear(2, 1)
        >>> torch_opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=10)
        >>> opt = funcamp.optim.from_torch(torch_opt, dict(model.named_parameters()), sched)
        >>> params = {k: v.detach().clone() for k, v in model.named_parameters()}
        >>> state = opt.init(params)
        >>> funcamp.optim.learning_rate(opt, state)
        tensor(0.1000, dtype=torch.float64)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"funcamp.{API}: `optimizer` must be a torch.optim.Optimizer, got {describe(optimizer)}"
        )
    name = type(optimizer).__name__
    translate = _translator(optimizer)
    if translate is None:
        known = sorted(c if isinstance(c, str) else c.__name__ for c in OPTIMIZERS)
        raise _refuse(f"`optimizer` {name}", f"has no funcamp translation yet (it knows {known})")
    if not isinstance(params, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items()
    ):
        raise TypeError(
            f"funcamp.{API}: `params` must be a dict of names to the tensors in the optimizer's "
            f"param groups (dict(model.named_parameters())), got {describe(params)}"
        )
    if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
        raise _refuse("`scheduler`", "must be an lr_scheduler of `optimizer`")
    plateau = scheduler if isinstance(scheduler, LRS.ReduceLROnPlateau) else None
    if plateau is not None:
        if len(optimizer.param_groups) != 1:
            raise _refuse(
                "a ReduceLROnPlateau",
                f"over {len(optimizer.param_groups)} param groups has no translation (one "
                "factor for one group); use one param group",
            )
        scheduler = None
    names = {id(v): k for k, v in params.items()}
    labels: dict[str, str] = {}
    parts: dict[str, Optimizer] = {}
    for i, group in enumerate(optimizer.param_groups):
        label = f"group{i}"
        for j, p in enumerate(group["params"]):
            key = names.get(id(p))
            if key is None:
                raise _refuse(
                    f"{name} param group {i}'s param {j} ({describe(p)})",
                    "is not in `params`; pass dict(model.named_parameters())",
                )
            if key in labels:
                raise _refuse(f"`params`' {key!r}", "is in two param groups")
            labels[key] = label
        lr = group["lr"] if scheduler is None else _schedule(scheduler, i, total_steps)
        if not isinstance(lr, torch.Tensor) and not callable(lr):
            lr = float(lr)
        parts[label] = translate(cycled_group(scheduler, group, i), lr, name, i)
    missing = [k for k in params if k not in labels]
    if missing:
        raise _refuse(
            f"`params` holds {missing[:3]}",
            "which no param group of the optimizer holds; leave them out of `params` (and out "
            "of the params the optimizer updates: funcamp.TrainState's frozen params)",
        )
    if len(parts) > 1:
        return multi_transform(parts, {k: labels[k] for k in params})
    if plateau is None:
        return parts["group0"]
    return reduce_on_plateau(
        parts["group0"],
        mode=plateau.mode,
        factor=plateau.factor,
        patience=plateau.patience,
        threshold=plateau.threshold,
        threshold_mode=plateau.threshold_mode,
        cooldown=plateau.cooldown,
        min_lr=float(plateau.min_lrs[0]),
        eps=plateau.eps,
    )
