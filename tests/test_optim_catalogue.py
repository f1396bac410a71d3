"""torch.optim's other elementwise optimizers (``funcamp.rmsprop``, ``adagrad``, ``adadelta``,
``adamax``, ``nadam``, ``radam``, ``asgd``, ``rprop``) beyond torch's own configurations
(``tests/test_optim_db.py``): the branches its few steps do not reach (RAdam's rectified step,
ASGD's averaging), low-precision params, ``accumulate``, ``multi_transform`` and checkpoints.
"""

from __future__ import annotations

import math

import pytest
import torch

import funcamp
from funcamp.testing import assert_trees_equal
from tests.test_optim_db import _check, _funcamp_opt, _funcamp_run, _grads, _params

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


HALF = ["RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adafactor"]
KWARGS = {
    "RMSprop": {"centered": True, "momentum": 0.5, "weight_decay": 0.1},
    "NAdam": {"weight_decay": 0.1, "decoupled_weight_decay": True},
    "ASGD": {"t0": 1},
    "Adafactor": {"weight_decay": 0.1},
}


@pytest.mark.parametrize("name", HALF)
def test_master_weights_follow_the_float32_run(name):
    """bfloat16 params with ``master_weights=True``: the float32 masters are the float32 run
    from the rounded initial params bit for bit, and the params are the masters rounded."""
    kwargs = KWARGS.get(name, {})
    start = {k: v.bfloat16() for k, v in _params().items()}
    plain = _funcamp_opt(name, kwargs)
    fl = {k: v.float() for k, v in start.items()}
    fl_state = plain.init(fl)
    for i in range(4):
        updates, fl_state = plain.update(_grads(i), fl_state, fl)
        fl = funcamp.apply_updates(fl, updates)
    mw = _with_modes(name, kwargs, master_weights=True)
    ps, state = start, mw.init(start)
    for i in range(4):
        updates, state = mw.update(_grads(i), state, ps)
        ps = funcamp.apply_updates(ps, updates)
    assert_trees_equal(state.low.master, fl)
    assert_trees_equal(ps, {k: v.bfloat16() for k, v in fl.items()})


def _with_modes(name: str, kwargs: dict, **modes):
    from tests.test_optim_db import FACTORIES, _torch_defaults

    kw = {**_torch_defaults(name), **kwargs}
    for flag in ("foreach", "differentiable", "capturable", "fused"):
        kw.pop(flag, None)
    lr = kw.pop("lr")
    if "betas" in kw:
        kw["b1"], kw["b2"] = kw.pop("betas")
    return FACTORIES[name](lr, **kw, **modes)


@pytest.mark.parametrize("mode", ["kahan", "stochastic_rounding"])
def test_other_modes_run_for_half_params(mode):
    for name in HALF:
        opt = _with_modes(name, KWARGS.get(name, {}), **{mode: True})
        ps = {k: v.bfloat16() for k, v in _params().items()}
        state = opt.init(ps)
        for i in range(3):
            updates, state = opt.update(_grads(i), state, ps)
            ps = funcamp.apply_updates(ps, updates)
        assert all(v.dtype == torch.bfloat16 and v.isfinite().all() for v in ps.values())


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


BITWISE = [
    ("RMSprop", {"weight_decay": 0.1, "centered": True, "momentum": 0.1}),
    ("Adagrad", {"lr_decay": 0.5, "weight_decay": 0.1}),
    ("Adadelta", {"weight_decay": 0.1}),
    ("Adamax", {"weight_decay": 0.1}),
    ("NAdam", {"weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("RAdam", {"weight_decay": 0.1}),
    ("ASGD", {"t0": 1, "weight_decay": 0.1}),
    ("Rprop", {}),
    ("Muon", {}),
    ("Adafactor", {"weight_decay": 0.1}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kwargs"), BITWISE, ids=[c[0] for c in BITWISE])
def test_eager_and_compiled_agree_bit_for_bit(name, kwargs):
    """Eight steps (RAdam rectified, ASGD averaging) eager and compiled (aot_eager): the same
    params and state, bit for bit."""
    eager = _funcamp_run(name, kwargs, steps=8)[1:3]
    torch._dynamo.reset()
    compiled = _funcamp_run(name, kwargs, backend="aot_eager", steps=8)[1:3]
    assert_trees_equal(eager, compiled)
