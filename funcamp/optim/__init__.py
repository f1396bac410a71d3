"""Functional optimizers in optax's shape, and the building blocks to write one.

``init(params) -> state``, ``update(grads, state, params) -> (updates, state)`` and
:func:`funcamp.apply_updates`. The optimizers themselves (``funcamp.sgd``, ``adam``, ``adamw``,
``lion``, and torch.optim's others: ``rmsprop``, ``adagrad``, ``adadelta``, ``adamax``, ``nadam``,
``radam``, ``asgd``, ``rprop``) and the combinators (``chain``, ``clip_by_global_norm``, ``accumulate``, ``masked``,
``multi_transform``) are importable from ``funcamp``; this module holds their state types, the
:class:`SetParam` update leaf, the fast-path hook's :class:`Prepared` and :class:`Writes`, and
the public building blocks for writing an optimizer: :func:`elementwise` and the :class:`Ops` its algorithm uses.

All states are NamedTuples of tensors (no ``None`` leaves), so they compile, ``vmap``, select
with :func:`funcamp.tree_select` and checkpoint. Every optimizer keeps a 0-d int32 ``count``:
the number of updates applied before this one, which is what a learning-rate schedule receives
(0 on the first step). A skipped step -- the caller keeps the old state -- does not advance it.
Nothing on the update path syncs with the host; Python floats are fixed when an optimizer is
built, tensors (schedules) may change every step without recompiling.

Layout (the package's private modules, one idea each):

* ``_base`` -- :class:`~funcamp.Optimizer`, its fast-path hook (:class:`Prepared`,
  :class:`Writes`), :class:`SetParam`, ``apply_updates`` and ``chain``;
* ``_elementwise`` -- :func:`elementwise`: an algorithm plus everything around it (validation,
  learning rates, count, buffers, low-precision modes, the fast path);
* ``_states`` -- the optimizers' state types;
* ``_optimizers`` -- each optimizer's algorithm, written once (``sgd``, ``adam``/``adamw``,
  ``lion``);
* ``_adaptive``, ``_variants`` -- torch.optim's other elementwise optimizers, each built with
  :func:`elementwise` alone (``rmsprop``, ``adagrad``, ``adadelta``, ``adamax``; ``nadam``,
  ``radam``, ``asgd``, ``rprop``);
* ``_shared`` -- what the built-in elementwise optimizers share: the factory that builds one
  from its step and the low-precision-mode arguments, the common checks and step pieces;
* ``_muon``, ``_adafactor`` -- ``muon`` (elementwise, its step orthogonalises each matrix) and
  ``adafactor`` (a plain ``(init, update)`` pair: its statistics are factored);
* ``_lbfgs`` -- ``lbfgs``: torch.optim.LBFGS's step on a flat copy of the params, given the loss
  function (eager only);
* ``_blocks`` -- ``negate_gradients`` and ``scale_by_amsgrad``, torch.optim's ``maximize`` and
  ``amsgrad`` as transforms of their own;
* ``_transforms`` -- ``clip_by_global_norm``, ``accumulate``, ``masked``, ``multi_transform``;
* ``_modes`` -- the low-precision modes;
* ``_numerics`` -- float32 scalars, math dtypes, the ``funcamp::fma`` and ``funcamp::sqrt`` ops;
* ``_paths`` -- the two execution paths (eager, traced), chosen in one place;
* ``_schedules`` / ``_lr_schedulers`` -- optax's schedules and joins / torch.optim.lr_scheduler's
  (``step_lr``, ``one_cycle_lr``, ...), float64 functions of the count;
* ``_plateau`` -- ``reduce_on_plateau``/``plateau_step`` (``ReduceLROnPlateau``);
* ``_ema`` -- ``with_ema``, an average of the weights in the optimizer state;
* ``_from_torch`` -- ``from_torch``: a torch.optim optimizer and scheduler, by table.

See the internals page of the docs for each operation's paths and their invariants.

``sgd``, ``adam``, ``adamw`` do torch.optim's operations in torch.optim's order and round as
its CPU kernels do: ``add(alpha=)``, ``lerp`` and ``addcmul`` are fused multiply-adds (one
rounding), in eager code through torch's own kernels and in compiled code through an op that
inductor turns into the hardware instruction. Square roots are correctly rounded everywhere, so
eager and compiled updates agree bit for bit. Against torch.optim: within 1e-5 relative over 50
steps (tested with Hypothesis-generated shapes and hyperparameters), and every CPU configuration
of torch's own optimizer database for SGD, Adam and AdamW -- ``maximize`` and ``amsgrad``
included, the ``foreach``/``differentiable``/``fused`` flags mapped to funcamp's paths -- within
rtol 1e-6, eager and compiled (``tests/test_optim_db.py``; docs/differences.md).

``adam``/``adamw`` with ``fused=True`` run torch's fused kernel instead (what
``torch.optim.Adam``/``AdamW(fused=True)`` run), eager and compiled, and give its params and
moments bit for bit; a compiled step calls the kernel as it is rather than generating code for
the update (a shorter first call on the CPU, where every generated kernel is a C++ build:
docs/benchmarks.md).
Contiguous float32 params only, outside ``torch.func`` transforms.

Low-precision parameters
------------------------
For float16/bfloat16 params the optimizer math runs in float32 (the moments are float32) and
every optimizer built with :func:`elementwise` (``sgd``/``adam``/``adamw``/``lion``) accepts one
of three modes that keep small updates from being lost to rounding:

* ``master_weights=True`` -- a float32 copy of each half param lives in the state; the update is
  added to it and the param becomes the copy rounded to nearest.
* ``kahan=True`` -- a compensation buffer in the param dtype carries the rounding error of each
  step into the next (Kahan summation, as in optimi).
* ``stochastic_rounding=True`` -- the new param is rounded up or down at random with probability
  given by the distance, so it is unbiased. The random bits are a counter-based hash of (seed,
  count, leaf index, element index) -- never the global RNG -- so results are deterministic,
  identical on every rank and identical eager vs compiled.

In these modes the optimizer itself computes the new half param, and its update leaf for that
param is a :class:`SetParam` holding it; :func:`funcamp.apply_updates` installs it as is. An
additive float32 delta cannot do this exactly: with a param of 1.0 no float32 ``u`` makes
``round(1.0 + u)`` equal a target of 1e-10, while Kahan's compensation needs the exact rounded
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

(The param itself is 4 B or 2 B on top.) ``adafactor`` keeps 4 B per row and per column of a
matrix (of each trailing matrix of a param with more dimensions), not per element. Each algorithm buffer costs 4 B per element (8 B for
float64 params); a mode adds 4 B (master), 2 B (Kahan) or nothing (SR) for half params.
"""

from funcamp.optim._base import Prepared, SetParam, Writes, learning_rate, prepare_update
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
    "Ops",
    "PlateauState",
    "Prepared",
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


def __getattr__(name: str) -> object:
    """A clear error for the removed ``Capabilities`` (see CHANGELOG.md)."""
    if name == "Capabilities":
        raise AttributeError(
            "funcamp.optim.Capabilities was replaced by one fast-path hook: build "
            "Optimizer(init, update, prepare=..., learning_rate=...), where prepare(grads, state, "
            "params) returns a funcamp.optim.Prepared (see CHANGELOG.md); Optimizer(init, update) "
            "needs nothing else"
        )
    raise AttributeError(f"module 'funcamp.optim' has no attribute {name!r}")
