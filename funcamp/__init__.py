"""funcamp: JAX-style functional mixed precision for PyTorch.

Pure transforms and immutable state. An ``amp`` transform is driven by an inspectable
``Policy``. A ``ScalerState`` is threaded explicitly through pure ``scale`` / ``unscale`` /
``update`` functions. Functional optimizers and a compiled, host-sync-free train step complete
the set.
"""

from funcamp import compiler as compiler  # the public funcamp.compiler submodule
from funcamp import distributed as distributed  # the public funcamp.distributed submodule
from funcamp import optim as optim  # the public funcamp.optim submodule
from funcamp._core.tree import all_finite, tree_cast, tree_select
from funcamp._core.version import __version__ as __version__
from funcamp.casting.amp import amp, full_precision, recompute_under
from funcamp.casting.fp8 import Fp8State, fp8_update, with_fp8_state
from funcamp.casting.fp8_matmul import Fp8Fallback, Fp8Record
from funcamp.casting.remat import remat
from funcamp.casting.trace import AmpTrace, OpRecord, OpStats, trace
from funcamp.checkpoints.format import CheckpointInfo
from funcamp.checkpoints.save import checkpoint_info, load, save
from funcamp.checkpoints.state_dict import load_state_dict, state_dict
from funcamp.optim._adafactor import adafactor
from funcamp.optim._adaptive import adadelta, adagrad, adamax, rmsprop
from funcamp.optim._asgd import asgd
from funcamp.optim._base import Optimizer, apply_updates, chain
from funcamp.optim._blocks import negate_gradients, scale_by_amsgrad
from funcamp.optim._lbfgs import lbfgs
from funcamp.optim._lion import lion
from funcamp.optim._muon import muon
from funcamp.optim._optimizers import adam, adamw
from funcamp.optim._schedules import (
    constant_schedule,
    cosine_decay_schedule,
    linear_schedule,
    linear_warmup_cosine_decay,
)
from funcamp.optim._sgd import sgd
from funcamp.optim._transforms import (
    accumulate,
    accumulate_applies,
    clip_by_global_norm,
    masked,
    multi_transform,
)
from funcamp.optim._variants import nadam, radam, rprop
from funcamp.policy.fp8 import Fp8Recipe
from funcamp.policy.ops import OpPolicy, OpRule
from funcamp.policy.policy import Policy, get_policy
from funcamp.scaling.guard import ScaleCollapseError, ScaleCollapseGuard
from funcamp.scaling.headroom import Headroom, headroom
from funcamp.scaling.ops import scale, unscale, update
from funcamp.scaling.state import ScalerState
from funcamp.scaling.step import StepInfo, unscale_and_step
from funcamp.search.policy_search import PolicyDecision, SearchReport, search_policy
from funcamp.train.config import Compile
from funcamp.train.eval import make_eval_step
from funcamp.train.loss import scaled_grad_and_value
from funcamp.train.state import TrainState, load_into_module, params_and_buffers
from funcamp.train.step import make_train_step

__all__ = [
    "AmpTrace",
    "CheckpointInfo",
    "Compile",
    "Fp8Fallback",
    "Fp8Recipe",
    "Fp8Record",
    "Fp8State",
    "Headroom",
    "OpPolicy",
    "OpRecord",
    "OpRule",
    "OpStats",
    "Optimizer",
    "Policy",
    "PolicyDecision",
    "ScaleCollapseError",
    "ScaleCollapseGuard",
    "ScalerState",
    "SearchReport",
    "StepInfo",
    "TrainState",
    "accumulate",
    "accumulate_applies",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "all_finite",
    "amp",
    "apply_updates",
    "asgd",
    "chain",
    "checkpoint_info",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "fp8_update",
    "full_precision",
    "get_policy",
    "headroom",
    "lbfgs",
    "linear_schedule",
    "linear_warmup_cosine_decay",
    "lion",
    "load",
    "load_into_module",
    "load_state_dict",
    "make_eval_step",
    "make_train_step",
    "masked",
    "multi_transform",
    "muon",
    "nadam",
    "negate_gradients",
    "params_and_buffers",
    "radam",
    "recompute_under",
    "remat",
    "rmsprop",
    "rprop",
    "save",
    "scale",
    "scale_by_amsgrad",
    "scaled_grad_and_value",
    "search_policy",
    "sgd",
    "state_dict",
    "trace",
    "tree_cast",
    "tree_select",
    "unscale",
    "unscale_and_step",
    "update",
    "with_fp8_state",
]

#: torch.optim classes funcamp has no optimizer for, with the reason and what to use instead.
_ABSENT = {
    "sparse_adam": (
        "funcamp has no SparseAdam: torch.optim.SparseAdam updates only the rows present in "
        "sparse gradients (nn.Embedding(sparse=True)), and funcamp's gradients are dense tensors "
        "of the params' shapes; use funcamp.adam (dense Adam: the moments of rows without "
        "gradient decay every step, unlike SparseAdam's), or funcamp.masked to leave whole "
        "leaves alone"
    ),
}


def __getattr__(name: str) -> object:
    """A clear error for torch.optim optimizers funcamp does not have (``funcamp.sparse_adam``)."""
    reason = _ABSENT.get(name.lower().replace("sparseadam", "sparse_adam"))
    if reason is not None:
        raise AttributeError(f"funcamp.{name}: {reason}")
    raise AttributeError(f"module 'funcamp' has no attribute {name!r}")
