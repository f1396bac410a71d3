"""Every built-in optimizer, declared once: :data:`REGISTRY`, funcamp's name -> its
:class:`OptimizerEntry`.

An entry holds the factory, its torch twin (the ``torch.optim`` class, or for one outside torch
its ``"module.QualName"``), how torch's per-param state maps to the factory's state, a
configuration that uses every buffer (:attr:`OptimizerEntry.example`) and what it cannot take
(matrices only, a loss function). Its keyword capabilities (``fused``, ``foreach``,
``differentiable``, ``mask``, the low-precision modes) are read from the factory's signature.

What reads it: :func:`funcamp.optim.from_torch` (``OPTIMIZERS``: each twin's translator),
``TrainState.from_torch``/``to_torch`` (``TORCH_STATES``: each twin's state keys) and the shared
optimizer tests, which parametrize by its names. A new optimizer is its module plus one line
here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from funcamp.optim._adafactor import adafactor
from funcamp.optim._adaptive import adadelta, adagrad, adamax, rmsprop
from funcamp.optim._asgd import asgd
from funcamp.optim._base import Optimizer
from funcamp.optim._lbfgs import lbfgs
from funcamp.optim._lion import lion
from funcamp.optim._muon import muon
from funcamp.optim._optimizers import adam, adamw
from funcamp.optim._sgd import sgd
from funcamp.optim._variants import nadam, radam, rprop

__all__ = ["REGISTRY", "OptimizerEntry"]

#: the low-precision modes' keyword arguments
_MODES = ("master_weights", "kahan", "stochastic_rounding")


@dataclass(frozen=True)
class OptimizerEntry:
    """One built-in optimizer: its factory, its torch twin and what it takes.

    Attributes:
        name: funcamp's name (``funcamp.<name>``).
        factory: the function that builds it, ``factory(learning_rate, ...)``.
        example: keyword arguments (``learning_rate`` included) that use every buffer.
        torch: the torch twin: a ``torch.optim`` class, ``"module.QualName"`` for one outside
            torch, or None.
        torch_state: torch's per-param state keys, in torch's order (``"step"`` where torch
            counts steps).
        renamed: torch key -> funcamp's state field, where the names differ.
        computed: torch keys funcamp computes from the count instead of keeping (ASGD's).
        tensor_betas: ``b1``/``b2`` take 0-d tensors, as torch's ``betas`` do.
        matrices: takes 2-D params only (Muon).
        loss: ``update`` needs the loss function (``value_fn=``; L-BFGS), not only gradients.

    Example:
        >>> import torch, funcamp
        >>> entry = funcamp.optim.REGISTRY["nadam"]
        >>> entry.torch, entry.takes("foreach"), entry.state_fields
        (<class 'torch.optim.nadam.NAdam'>, True, ('mu_product', 'exp_avg', 'exp_avg_sq'))
        >>> opt = entry.make(master_weights=True)
        >>> state = opt.init({"w": torch.zeros(3, dtype=torch.bfloat16)})
        >>> type(state).__name__, state.low.master["w"].dtype
        ('NadamState', torch.float32)
    """

    name: str
    factory: Callable[..., Optimizer]
    example: Mapping[str, Any]
    torch: type | str | None = None
    torch_state: tuple[str, ...] = ()
    renamed: Mapping[str, str] = field(default_factory=dict)
    computed: tuple[str, ...] = ()
    tensor_betas: bool = False
    matrices: bool = False
    loss: bool = False

    def takes(self, argument: str) -> bool:
        """Whether the factory has the keyword ``argument`` (``"fused"``, ``"foreach"``,
        ``"differentiable"``, ``"mask"``, ``"master_weights"``, ...)."""
        return argument in inspect.signature(self.factory).parameters

    @property
    def modes(self) -> bool:
        """Whether it takes the low-precision modes (master weights, Kahan, stochastic
        rounding)."""
        return all(self.takes(m) for m in _MODES)

    @property
    def skips(self) -> bool:
        """Whether ``unscale_and_step`` and the train step can skip its step (every optimizer
        of gradients)."""
        return not self.loss

    @property
    def state_fields(self) -> tuple[str, ...]:
        """funcamp's state fields that hold torch's per-param state (not ``step``, not the
        computed keys)."""
        skip = {"step", *self.computed}
        return tuple(self.renamed.get(k, k) for k in self.torch_state if k not in skip)

    def make(self, **overrides: Any) -> Optimizer:
        """The optimizer of :attr:`example`, with ``overrides``."""
        return self.factory(**{**self.example, **overrides})


_ADAM = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_E = OptimizerEntry
_ENTRIES = (
    _E("sgd", sgd, {"learning_rate": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
       torch.optim.SGD, ("momentum_buffer",), {"momentum_buffer": "momentum"}),
    _E("adam", adam, {"learning_rate": 0.01, "weight_decay": 0.1, "amsgrad": True},
       torch.optim.Adam, _ADAM, tensor_betas=True),
    _E("adamw", adamw, {"learning_rate": 0.01, "weight_decay": 0.1, "amsgrad": True},
       torch.optim.AdamW, _ADAM, tensor_betas=True),
    _E("rmsprop", rmsprop,
       {"learning_rate": 0.01, "centered": True, "momentum": 0.5, "weight_decay": 0.1},
       torch.optim.RMSprop, ("step", "square_avg", "momentum_buffer", "grad_avg")),
    _E("adagrad", adagrad,
       {"learning_rate": 0.01, "lr_decay": 0.5, "weight_decay": 0.1,
        "initial_accumulator_value": 0.1},
       torch.optim.Adagrad, ("step", "sum")),
    _E("adadelta", adadelta, {"learning_rate": 1.0, "weight_decay": 0.1},
       torch.optim.Adadelta, ("step", "square_avg", "acc_delta")),
    _E("adamax", adamax, {"learning_rate": 0.002, "weight_decay": 0.1},
       torch.optim.Adamax, ("step", "exp_avg", "exp_inf"), tensor_betas=True),
    _E("nadam", nadam,
       {"learning_rate": 0.002, "weight_decay": 0.1, "decoupled_weight_decay": True},
       torch.optim.NAdam, ("step", "mu_product", "exp_avg", "exp_avg_sq"), tensor_betas=True),
    _E("radam", radam, {"learning_rate": 0.001, "weight_decay": 0.1},
       torch.optim.RAdam, ("step", "exp_avg", "exp_avg_sq"), tensor_betas=True),
    _E("asgd", asgd, {"learning_rate": 0.01, "t0": 1, "weight_decay": 0.1},
       torch.optim.ASGD, ("step", "eta", "mu", "ax"), computed=("eta", "mu")),
    _E("rprop", rprop, {"learning_rate": 0.01},
       torch.optim.Rprop, ("step", "prev", "step_size")),
    _E("muon", muon, {"learning_rate": 0.02, "weight_decay": 0.1},
       torch.optim.Muon, ("momentum_buffer",), matrices=True),
    _E("adafactor", adafactor, {"learning_rate": 0.01, "weight_decay": 0.1},
       torch.optim.Adafactor, ("step", "row_var", "col_var", "variance")),
    _E("lbfgs", lbfgs, {"learning_rate": 1.0, "history_size": 4}, torch.optim.LBFGS, loss=True),
    _E("lion", lion, {"learning_rate": 0.001, "weight_decay": 0.1},
       "lion_pytorch.lion_pytorch.Lion", ("exp_avg",)),  # lucidrains' lion-pytorch
)  # fmt: skip


class _Registry(Mapping[str, OptimizerEntry]):
    """funcamp's name -> :class:`OptimizerEntry`, for every built-in optimizer, in a fixed order
    (read only).

    Example:
        >>> import funcamp
        >>> [name for name, e in funcamp.optim.REGISTRY.items() if e.takes("fused")]
        ['sgd', 'adam', 'adamw', 'adagrad']
        >>> funcamp.optim.REGISTRY["lion"].torch  # lucidrains' lion-pytorch
        'lion_pytorch.lion_pytorch.Lion'
    """

    def __init__(self, entries: tuple[OptimizerEntry, ...]) -> None:
        self._entries = MappingProxyType({e.name: e for e in entries})

    def __getitem__(self, name: str) -> OptimizerEntry:
        if name not in self._entries:
            raise KeyError(
                f"funcamp.optim.REGISTRY has no optimizer {name!r}; it holds {list(self._entries)}"
            )
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


REGISTRY: Mapping[str, OptimizerEntry] = _Registry(_ENTRIES)
