"""Functional optimizers in optax's shape, and the building blocks to write one.

An optimizer is ``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``;
:func:`funcamp.apply_updates` adds the updates to the params. The optimizers are importable from
``funcamp``: ``sgd``, ``adam``, ``adamw``, ``lion``, and torch.optim's others (``rmsprop``,
``adagrad``, ``adadelta``, ``adamax``, ``nadam``, ``radam``, ``asgd``, ``rprop``). So are the
combinators: ``chain``, ``clip_by_global_norm``, ``accumulate``, ``masked``, ``multi_transform``.
This module holds their state types, the :class:`SetParam` update leaf and :data:`REGISTRY`
(each built-in optimizer's factory, torch twin and capabilities). It also holds the
fast-path hook's :class:`Prepared` and :class:`Writes`, and the building blocks for writing an
optimizer: :func:`elementwise` and the :class:`Ops` its algorithm uses.

All states are NamedTuples of tensors (no ``None`` leaves). So they compile, ``vmap``, select
with :func:`funcamp.tree_select` and checkpoint. Every optimizer keeps a 0-d int32 ``count``.
It is the number of updates applied before this one (0 on the first step), and it is what a
learning-rate schedule receives. A skipped step keeps the old state, so it does not advance the
count. Nothing on the update path syncs with the host. Python floats are fixed when an optimizer
is built; tensors (schedules) may change every step without recompiling.

Layout (the package's private modules, one idea each):

* ``_base``: :class:`~funcamp.Optimizer`, its fast-path hook (:class:`Prepared`,
  :class:`Writes`), :class:`SetParam`, ``apply_updates`` and ``chain``;
* ``_elementwise``: :func:`elementwise`, an algorithm plus everything around it (validation,
  learning rates, count, buffers, low-precision modes, the fast path);
* ``_states``: the optimizers' state types;
* ``_sgd``, ``_optimizers``, ``_lion``: ``sgd``, ``adam``/``adamw`` and ``lion``, each
  algorithm written once;
* ``_adaptive``, ``_variants``, ``_asgd``: torch.optim's other elementwise optimizers, each
  built with :func:`elementwise` alone (``rmsprop``, ``adagrad``, ``adadelta``, ``adamax``;
  ``nadam``, ``radam``, ``rprop``; ``asgd``);
* ``_shared``: what the built-in elementwise optimizers share (their factory, the common
  checks and step pieces);
* ``_muon``, ``_adafactor``: ``muon`` (elementwise; its step orthogonalises each matrix) and
  ``adafactor`` (a plain ``(init, update)`` pair; its statistics are factored);
* ``_lbfgs``: ``lbfgs``, torch.optim.LBFGS's step on a flat copy of the params (eager only);
* ``_blocks``: ``negate_gradients`` and ``scale_by_amsgrad``, torch.optim's ``maximize`` and
  ``amsgrad`` as transforms of their own;
* ``_transforms``: ``clip_by_global_norm``, ``accumulate``, ``masked``, ``multi_transform``;
* ``_modes``: the low-precision modes;
* ``_paths``: the two execution paths (eager, traced), chosen in one place;
* ``_schedules`` / ``_lr_schedulers``: optax's schedules and joins, and
  torch.optim.lr_scheduler's (``step_lr``, ``one_cycle_lr``, ...), as float64 functions of the
  count;
* ``_plateau``: ``reduce_on_plateau``/``plateau_step`` (``ReduceLROnPlateau``);
* ``_ema``: ``with_ema``, an average of the weights in the optimizer state;
* ``_registry``: :data:`REGISTRY`, every built-in optimizer declared once (factory, torch
  twin, torch's state keys, an example configuration), which the tables below and the shared
  optimizer tests read;
* ``_from_torch``: ``from_torch``, a torch.optim optimizer and scheduler, by table.
* ``_torch_state``, ``_torch_schedulers``: torch.optim's per-param state and an
  lr_scheduler's position as funcamp's state and count, and back (what
  ``TrainState.from_torch``/``to_torch`` move), by table.

See the internals page of the docs for each operation's paths and their invariants.

``sgd``, ``adam`` and ``adamw`` do torch.optim's operations in torch.optim's order. They round
as its CPU kernels do: ``add(alpha=)``, ``lerp`` and ``addcmul`` are fused multiply-adds (one
rounding). Square roots are correctly rounded everywhere. So eager and compiled updates agree
bit for bit. Against torch.optim they agree within 1e-5 relative over 50 steps (tested with
Hypothesis-generated shapes and hyperparameters). Every CPU configuration of torch's own
optimizer database for SGD, Adam and AdamW agrees within rtol 1e-6, eager and compiled. That
includes ``maximize`` and ``amsgrad``, with the ``foreach``/``differentiable``/``fused`` flags
mapped to funcamp's paths (``tests/test_optim_db.py``; docs/differences.md).

``adam``/``adamw`` with ``fused=True`` run torch's fused kernel instead, eager and compiled. It
is the kernel ``torch.optim.Adam``/``AdamW(fused=True)`` run, so params and moments match it bit
for bit. A compiled step calls the kernel as it is, which shortens the first call on the CPU.
Contiguous float32 params only, outside ``torch.func`` transforms.

Low-precision parameters
------------------------
For float16/bfloat16 params the optimizer math runs in float32 (the moments are float32). Every
optimizer built with :func:`elementwise` (``sgd``/``adam``/``adamw``/``lion``) accepts one of
three modes that keep small updates from being lost to rounding:

* ``master_weights=True``: a float32 copy of each half param lives in the state. The update is
  added to it, and the param becomes the copy rounded to nearest.
* ``kahan=True``: a compensation buffer in the param dtype carries the rounding error of each
  step into the next (Kahan summation, as in optimi).
* ``stochastic_rounding=True``: the new param is rounded up or down at random, with probability
  given by the distance, so it is unbiased. The random bits are a counter-based hash of (seed,
  count, leaf index, element index), never the global RNG. So results are deterministic, the
  same on every rank, and the same eager and compiled.

In these modes the optimizer computes the new half param itself. Its update leaf for that param
is a :class:`SetParam` holding it, which :func:`funcamp.apply_updates` installs as is. An
additive float32 delta cannot do this exactly. With a param of 1.0, no float32 ``u`` makes
``round(1.0 + u)`` equal a target of 1e-10, and Kahan's compensation needs the exact rounded
result anyway. The modes do nothing for float32/float64 params (their update leaves are plain
deltas), so a mixed tree works. All rounding is done on the float32 bit pattern, so eager and
inductor agree bit for bit. A mode optimizer must be the last transform of a ``chain``.

Optimizer state per parameter element (the 0-d ``count``/``seed`` scalars aside):

==========================  =============  ================  ==================
optimizer                   float32 param  bf16/f16 param    bf16/f16 + mode
==========================  =============  ================  ==================
``sgd`` (momentum=0)        0 B            0 B               master 4, kahan 2, SR 0
``sgd`` (momentum>0)        4 B            4 B               master 8, kahan 6, SR 4
``adam`` / ``adamw``        8 B            8 B               master 12, kahan 10, SR 8
``adam(amsgrad=True)``      12 B           12 B              master 16, kahan 14, SR 12
``lion``                    4 B            4 B               master 8, kahan 6, SR 4
``rmsprop``                 4-12 B         4-12 B            + 4 / 2 / 0
``adagrad`` / ``asgd``      4 B            4 B               + 4 / 2 / 0
``adadelta`` / ``adamax``   8 B            8 B               + 4 / 2 / 0
``nadam`` / ``radam``       8 B            8 B               + 4 / 2 / 0
``rprop``                   8 B            8 B               + 4 / 2 / 0
``muon``                    4 B            4 B               + 4 / 2 / 0
``adafactor`` (a vector)    4 B            4 B               + 4 / 2 / 0
``accumulate(opt, k)``      opt + 4 B      opt + 4 B         opt + 4 B
==========================  =============  ================  ==================

The param itself is 4 B or 2 B on top. ``adafactor`` keeps 4 B per row and per column of a
matrix (of each trailing matrix of a param with more dimensions), not per element. Each
algorithm buffer costs 4 B per element (8 B for float64 params). A mode adds 4 B (master), 2 B
(Kahan) or nothing (SR) for half params.
"""

from funcamp.optim._base import (
    NewParams,
    Prepared,
    SetParam,
    Writes,
    learning_rate,
    prepare_update,
)
from funcamp.optim._elementwise import elementwise
from funcamp.optim._ema import EmaState, ema_params, with_ema
from funcamp.optim._from_torch import from_torch
from funcamp.optim._lr_schedulers import (
    constant_lr,
    cosine_annealing_lr,
    cosine_annealing_warm_restarts,
    cyclic_lr,
    exponential_lr,
    lambda_lr,
    linear_lr,
    multi_step_lr,
    multiplicative_lr,
    one_cycle_lr,
    polynomial_lr,
    step_lr,
)
from funcamp.optim._modes import KahanState, MasterWeightsState, StochasticRoundingState
from funcamp.optim._muon import newton_schulz
from funcamp.optim._paths import Ops
from funcamp.optim._plateau import PlateauState, plateau_step, reduce_on_plateau
from funcamp.optim._registry import REGISTRY, OptimizerEntry
from funcamp.optim._schedules import chained_lr, join_schedules
from funcamp.optim._states import (
    AdadeltaState,
    AdafactorState,
    AdagradState,
    AdamaxState,
    AdamState,
    AsgdState,
    LbfgsState,
    LionState,
    MuonState,
    NadamState,
    RadamState,
    RmspropState,
    RpropState,
    SgdState,
)
from funcamp.optim._transforms import AccumulateState, MaskedState, MultiTransformState

__all__ = [
    "AccumulateState",
    "AdadeltaState",
    "AdafactorState",
    "AdagradState",
    "AdamState",
    "AdamaxState",
    "AsgdState",
    "EmaState",
    "KahanState",
    "LbfgsState",
    "LionState",
    "MaskedState",
    "MasterWeightsState",
    "MultiTransformState",
    "MuonState",
    "NadamState",
    "NewParams",
    "Ops",
    "OptimizerEntry",
    "PlateauState",
    "Prepared",
    "REGISTRY",
    "RadamState",
    "RmspropState",
    "RpropState",
    "SetParam",
    "SgdState",
    "StochasticRoundingState",
    "Writes",
    "chained_lr",
    "constant_lr",
    "cosine_annealing_lr",
    "cosine_annealing_warm_restarts",
    "cyclic_lr",
    "elementwise",
    "ema_params",
    "exponential_lr",
    "from_torch",
    "join_schedules",
    "lambda_lr",
    "learning_rate",
    "linear_lr",
    "multi_step_lr",
    "multiplicative_lr",
    "newton_schulz",
    "one_cycle_lr",
    "plateau_step",
    "polynomial_lr",
    "prepare_update",
    "reduce_on_plateau",
    "step_lr",
    "with_ema",
]
