"""The shared optimizer tests, parametrized by :data:`funcamp.optim.REGISTRY`'s names: every
registered optimizer -- one torch lacks (``lion``) too -- through the low-precision modes, a
skipped step, eager against compiled, its bad input. A new optimizer joins them with its registry
line. Then torch.optim's other optimizers beyond torch's own configurations
(``tests/test_optim_db.py``): the branches its few steps do not reach (RAdam's rectified step,
ASGD's averaging), ``accumulate``, ``multi_transform``, checkpoints, L-BFGS with a closure.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch

import funcamp
from funcamp.optim import REGISTRY
from funcamp.testing import assert_trees_equal
from tests.test_optim_db import MATRICES, SHAPES, _check, _funcamp_run, _grads, _params

#: the registered optimizers of gradients (L-BFGS reads a closure's loss: tested below)
GRADIENT = [name for name, e in REGISTRY.items() if not e.loss]
#: those with the low-precision modes
MODED = [name for name, e in REGISTRY.items() if e.modes]
STEPS = 4
BAD_STEP = 2  # an inf in one gradient: the step is skipped (GradScaler's rule)


def _shapes(name: str) -> dict[str, tuple[int, ...]]:
    return MATRICES if REGISTRY[name].matrices else SHAPES


def _start(name: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in _shapes(name).items()}


def _gradients(name: str, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {k: torch.randn(s, generator=gen) for k, s in _shapes(name).items()}


def _updated(opt, name: str, params: dict, steps: int = STEPS, step_fn=None):
    """``steps`` updates of ``params`` (``step_fn(params, state, grads)``, else the update and
    ``apply_updates``)."""

    def plain(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return funcamp.apply_updates(params, updates), state

    step = step_fn or plain
    state = opt.init(params)
    for i in range(steps):
        params, state = step(params, state, _gradients(name, i))
    return params, state


LONG = [  # RAdam rectifies from step 6 (b2 = 0.999); ASGD averages from step t0 + 2
    ("RAdam", {"weight_decay": 0.1, "decoupled_weight_decay": True}, 9),
    ("RAdam", {"betas": (0.8, 0.9), "weight_decay": 0.1}, 7),
    ("ASGD", {"t0": 1, "lambd": 0.1, "weight_decay": 0.1}, 6),
    ("NAdam", {"momentum_decay": 0.1}, 9),
    ("Adagrad", {"lr_decay": 0.5, "initial_accumulator_value": 0.1}, 6),
]


@pytest.mark.parametrize(("name", "kwargs", "steps"), LONG, ids=[c[0] for c in LONG])
def test_longer_runs_match_torch_optim(name, kwargs, steps):
    _, params, state, _ = _funcamp_run(name, kwargs, steps=steps)
    _check(name, kwargs, params, state, steps=steps)


#: funcamp.optim's state types that are not an optimizer's own (combinators, modes, wrappers)
NOT_OPTIMIZERS = {
    "AccumulateState", "EmaState", "KahanState", "MaskedState", "MasterWeightsState",
    "MultiTransformState", "PlateauState", "StochasticRoundingState",
}  # fmt: skip


def test_the_registry_declares_every_optimizer_once():
    """Every optimizer state type funcamp.optim exports is some registered optimizer's, each
    entry's factory is ``funcamp.<name>``, and from_torch and the state moves know each torch
    twin: torch's state keys name fields of the optimizer's state, and each computed key has
    its function."""
    from funcamp.optim._from_torch import OPTIMIZERS
    from funcamp.optim._torch_state import _DERIVED, TORCH_STATES

    made = set()
    for name, entry in REGISTRY.items():
        assert entry.name == name and getattr(funcamp, name) is entry.factory
        state = entry.make().init(_start(name))
        made.add(type(state).__name__)
        assert set(entry.state_fields) <= set(state._fields), name
        assert bool(entry.computed) == (name in _DERIVED), name
        if entry.torch is not None:
            assert entry.torch in OPTIMIZERS
            assert (entry.torch in TORCH_STATES) == bool(entry.torch_state), name
    exported = {n for n in funcamp.optim.__all__ if n.endswith("State")} - NOT_OPTIMIZERS
    assert exported == made


@pytest.mark.parametrize("name", MODED)
def test_master_weights_follow_the_float32_run(name):
    """bfloat16 params with ``master_weights=True``: the float32 masters are the float32 run
    from the rounded initial params bit for bit, and the params are the masters rounded."""
    entry = REGISTRY[name]
    start = _start(name, torch.bfloat16)
    fl, _ = _updated(entry.make(), name, {k: v.float() for k, v in start.items()})
    ps, state = _updated(entry.make(master_weights=True), name, start)
    assert_trees_equal(state.low.master, fl)
    assert_trees_equal(ps, {k: v.bfloat16() for k, v in fl.items()})


@pytest.mark.parametrize("mode", ["kahan", "stochastic_rounding"])
@pytest.mark.parametrize("name", MODED)
def test_other_modes_run_for_half_params(name, mode):
    """Kahan summation and stochastic rounding keep bfloat16 params bfloat16 and finite, and
    move them where the plain bfloat16 run moves them (within a few bfloat16 ulps)."""
    entry = REGISTRY[name]
    start = _start(name, torch.bfloat16)
    ps, _ = _updated(entry.make(**{mode: True}), name, start, steps=3)
    assert all(v.dtype == torch.bfloat16 and v.isfinite().all() for v in ps.values())
    fl, _ = _updated(entry.make(), name, {k: v.float() for k, v in start.items()}, steps=3)
    for k in ps:
        torch.testing.assert_close(ps[k].float(), fl[k], rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", [n for n, e in REGISTRY.items() if e.skips])
def test_an_overflowing_step_keeps_everything_and_the_run_goes_on(name, donate):
    """``unscale_and_step`` on an overflow keeps the params and the whole state bit for bit
    (donated or not), and the run is the one that never saw that step, bit for bit."""
    opt = REGISTRY[name].make()
    scaler = funcamp.ScalerState.static(1.0)

    def step(params, state, grads):
        params, state, info = funcamp.unscale_and_step(
            scaler, opt, grads, state, params, donate_state=donate, grad_norm=False
        )
        return params, state, bool(info.found_inf)

    params, state = _start(name), opt.init(_start(name))
    for i in range(STEPS):
        grads = _gradients(name, i)
        if i == BAD_STEP:
            grads["w"][1, 2] = math.inf
        before = optree.tree_map(torch.clone, (params, state), namespace="funcamp")
        params, state, skipped = step(params, state, grads)
        assert skipped == (i == BAD_STEP)
        if skipped:
            assert_trees_equal((params, state), before)
    ref, ref_state = _start(name), opt.init(_start(name))
    for i in range(STEPS):
        if i != BAD_STEP:
            ref, ref_state, _ = step(ref, ref_state, _gradients(name, i))
    assert_trees_equal((params, state), (ref, ref_state))
    assert int(state.count) == STEPS - 1


@pytest.mark.parametrize("name", list(REGISTRY))
def test_bad_input_names_the_optimizer(name):
    """A negative learning rate, another optimizer's state and grads of another structure are
    refused before anything runs, naming the optimizer and the argument."""
    entry = REGISTRY[name]
    with pytest.raises(ValueError, match=rf"funcamp\.{name}: `learning_rate` must be >= 0"):
        entry.make(learning_rate=-1.0)
    if entry.loss:
        return
    opt, params = entry.make(), _start(name)
    grads = _gradients(name, 0)
    with pytest.raises(TypeError, match=rf"funcamp\.{name}: `state` must be an? \w+State"):
        opt.update(grads, (), params)
    state = opt.init(params)
    with pytest.raises(ValueError, match=rf"funcamp\.{name}: `grads` must have the structure"):
        opt.update({"w": grads["w"]}, state, params)


def test_accumulate_and_multi_transform_compose():
    """``accumulate(rmsprop, 2)`` is rmsprop on the mean of two gradients; a
    ``multi_transform`` of nadam and rprop is each on its own leaves."""
    opt = funcamp.accumulate(funcamp.rmsprop(1e-2, centered=True), 2)
    ref = funcamp.rmsprop(1e-2, centered=True)
    ps, state = _params(), opt.init(_params())
    rp, rstate = _params(), ref.init(_params())
    for i in range(4):
        updates, state = opt.update(_grads(i), state, ps)
        ps = funcamp.apply_updates(ps, updates)
        if i % 2 == 1:
            mean = {k: (_grads(i - 1)[k] + _grads(i)[k]) / 2 for k in ps}
            updates, rstate = ref.update(mean, rstate, rp)
            rp = funcamp.apply_updates(rp, updates)
    torch.testing.assert_close(ps, rp, rtol=1e-6, atol=1e-7)

    labels = {"w": "nadam", "b": "rprop", "v": "rprop"}
    opts = {"nadam": funcamp.nadam(1e-2), "rprop": funcamp.rprop(1e-2)}
    mt = funcamp.multi_transform(opts, labels)
    ps, state = _params(), mt.init(_params())
    alone = {name: (_params(), o.init(_params())) for name, o in opts.items()}
    for i in range(3):
        updates, state = mt.update(_grads(i), state, ps)
        ps = funcamp.apply_updates(ps, updates)
        for name, o in opts.items():
            p, s = alone[name]
            u, s = o.update(_grads(i), s, p)
            alone[name] = (funcamp.apply_updates(p, u), s)
    assert_trees_equal(ps["w"], alone["nadam"][0]["w"])
    assert_trees_equal(ps["b"], alone["rprop"][0]["b"])


def test_state_checkpoints_and_resumes(tmp_path):
    """The states -- NAdam's 0-d ``mu_product`` and Adafactor's factored statistics included --
    save and load with
    :func:`funcamp.save`/:func:`funcamp.load`, and a resumed run is the uninterrupted one."""
    makers = (lambda: funcamp.nadam(1e-2), lambda: funcamp.rprop(1e-2), funcamp.adadelta)
    for make in (*makers, funcamp.adafactor):  # Adafactor's empty tensors for unkept stats
        opt = make()
        params, state = _params(), opt.init(_params())
        for i in range(2):
            updates, state = opt.update(_grads(i), state, params)
            params = funcamp.apply_updates(params, updates)
        path = tmp_path / "ckpt.pt"
        funcamp.save(path, {"params": params, "opt": state}, policy="float32")
        loaded = funcamp.load(path, {"params": _params(), "opt": opt.init(_params())})
        assert_trees_equal(loaded, {"params": params, "opt": state})
        assert not any(x is None for x in torch.utils._pytree.tree_leaves(tuple(state)))


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r"funcamp.rprop: `etas`"):
        funcamp.rprop(0.1, etas=(1.0, 0.5))
    with pytest.raises(ValueError, match=r"funcamp.rprop: `step_sizes`"):
        funcamp.rprop(0.1, step_sizes=(1.0, 0.5))
    with pytest.raises(ValueError, match=r"funcamp.adamax: `b2`"):
        funcamp.adamax(0.1, b2=1.0)
    with pytest.raises(ValueError, match=r"funcamp.adagrad: `lr_decay`"):
        funcamp.adagrad(0.1, lr_decay=-0.5)
    with pytest.raises(ValueError, match=r"funcamp.asgd: `weight_decay`"):
        funcamp.asgd(0.1, weight_decay=-0.5)
    with pytest.raises(ValueError, match=r"funcamp.rmsprop: `momentum`"):
        funcamp.rmsprop(0.1, momentum=-1.0)


def test_muon_for_hidden_matrices_adamw_for_the_rest():
    """The usual pairing: ``multi_transform`` of Muon (the hidden matrices) and AdamW (the
    embedding, the head, the biases) is ``torch.optim.Muon`` and ``torch.optim.AdamW`` stepped
    side by side."""
    gen = torch.Generator().manual_seed(5)
    shapes = {"embed": (10, 4), "h0.w": (4, 6), "h0.b": (6,), "h1.w": (6, 4), "head": (4, 10)}
    hidden = {"h0.w", "h1.w"}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(3)]
    opt = funcamp.multi_transform(
        {"muon": funcamp.muon(0.02), "adamw": funcamp.adamw(1e-3, weight_decay=0.1)},
        {k: "muon" if k in hidden else "adamw" for k in shapes},
    )
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    topts = [
        torch.optim.Muon([ps[k] for k in shapes if k in hidden], lr=0.02),
        torch.optim.AdamW([ps[k] for k in shapes if k not in hidden], lr=1e-3, weight_decay=0.1),
    ]
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = funcamp.apply_updates(params, updates)
        for k, p in ps.items():
            p.grad = g[k]
        for t in topts:
            t.step()
    torch.testing.assert_close(params, {k: v.detach() for k, v in ps.items()}, rtol=1e-6, atol=1e-7)


def test_muon_refuses_what_is_not_a_matrix():
    with pytest.raises(ValueError, match=r"funcamp.muon: every param must be a 2-D matrix"):
        funcamp.muon(0.02).init({"w": torch.zeros(2, 2), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"funcamp.muon: `adjust_lr_fn`"):
        funcamp.muon(0.02, adjust_lr_fn="arbitrary")


def _lbfgs_configs() -> list:
    from torch.testing._internal import common_optimizers

    (info,) = [i for i in common_optimizers.optim_db if i.optim_cls is torch.optim.LBFGS]
    return [pytest.param(dict(oi.kwargs), id=oi.desc) for oi in info.optim_inputs_func("cpu")]


def _rosenbrock(params: dict) -> torch.Tensor:
    """A non-quadratic loss over a dict of leaves (line searches and curvature pairs vary)."""
    x = torch.cat([params[k].reshape(-1) for k in sorted(params)])
    return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()


@pytest.mark.parametrize("kwargs", _lbfgs_configs())
def test_lbfgs_matches_torch_optim_with_a_closure(kwargs):
    """Every CPU configuration of optim_db for LBFGS: ``funcamp.lbfgs`` with the loss function
    gives torch.optim.LBFGS's params, loss and state (history included) over three updates,
    bit for bit, its state restored from tensors between them."""
    start = {"w": torch.tensor([[-1.2, 1.0], [0.5, -0.3]]), "b": torch.tensor([0.8, 1.1, -0.4])}
    torch_kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    ours_kwargs = dict(torch_kwargs)
    lr = ours_kwargs.pop("lr", 1.0)
    opt = funcamp.lbfgs(lr.clone() if isinstance(lr, torch.Tensor) else lr, **ours_kwargs)
    ps = {k: torch.nn.Parameter(start[k].clone()) for k in sorted(start)}  # funcamp's order
    ref = torch.optim.LBFGS(list(ps.values()), **torch_kwargs)

    def closure():
        ref.zero_grad()
        loss = _rosenbrock(ps)
        loss.backward()
        return loss

    params, state = start, opt.init(start)
    for _ in range(3):
        updates, state = opt.update(None, state, params, value_fn=_rosenbrock)
        params = funcamp.apply_updates(params, updates)
        loss = ref.step(closure)
        ours_loss, their_loss = float(state.loss), float(loss.detach())
        assert ours_loss == their_loss or (math.isnan(ours_loss) and math.isnan(their_loss))
    assert_trees_equal(params, {k: v.detach() for k, v in ps.items()})
    theirs = ref.state[ps["b"]]
    assert int(state.func_evals) == theirs["func_evals"] and int(state.n_iter) == theirs["n_iter"]
    assert torch.allclose(state.d, theirs["d"], rtol=0, atol=0, equal_nan=True)
    t_ours, t_theirs = float(state.t), float(theirs["t"])
    assert t_ours == t_theirs or (math.isnan(t_ours) and math.isnan(t_theirs))
    k = int(state.history)
    assert k == len(theirs["old_dirs"])  # 0 where the run diverged (maximize on torch 2.14)
    assert k > 0 or kwargs.get("maximize")  # only a maximized run may diverge
    if k:
        assert torch.allclose(
            state.old_dirs[:k], torch.stack(theirs["old_dirs"]), rtol=0, atol=0, equal_nan=True
        )
        assert torch.allclose(
            state.ro[:k], torch.stack(theirs["ro"]), rtol=0, atol=0, equal_nan=True
        )


def test_lbfgs_needs_the_loss_function_and_checkpoints(tmp_path):
    opt = funcamp.lbfgs(history_size=4)
    params = {"w": torch.tensor([[-1.2, 1.0]]), "b": torch.tensor([0.8])}
    state = opt.init(params)
    with pytest.raises(TypeError, match=r"funcamp.lbfgs: `value_fn` must be a function"):
        opt.update(None, state, params)
    updates, state = opt.update(None, state, params, value_fn=_rosenbrock)
    params = funcamp.apply_updates(params, updates)
    funcamp.save(tmp_path / "l.pt", {"p": params, "s": state}, policy="float32")
    loaded = funcamp.load(tmp_path / "l.pt", {"p": params, "s": opt.init(params)})
    a = opt.update(None, state, params, value_fn=_rosenbrock)
    b = opt.update(None, loaded["s"], loaded["p"], value_fn=_rosenbrock)
    assert_trees_equal(a, b)


@pytest.mark.parametrize("name", ["sparse_adam", "SparseAdam"])
def test_sparse_adam_is_refused_naming_the_alternative(name):
    with pytest.raises(AttributeError, match=r"funcamp has no SparseAdam.*use funcamp.adam"):
        getattr(funcamp, name)
    assert not hasattr(funcamp, "no_such_name")


@pytest.mark.slow
@pytest.mark.parametrize("name", GRADIENT)
def test_eager_and_compiled_agree_bit_for_bit(name):
    """Eight steps (RAdam rectified, ASGD averaging) eager and compiled (aot_eager): the same
    params and state, bit for bit."""
    opt = REGISTRY[name].make()

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return funcamp.apply_updates(params, updates), state

    eager = _updated(opt, name, _start(name), steps=8)
    torch._dynamo.reset()
    compiled_step = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled = _updated(opt, name, _start(name), steps=8, step_fn=compiled_step)
    assert_trees_equal(eager, compiled)
