"""torch's optimizer database as a peer suite: every CPU configuration of ``optim_db`` for SGD,
Adam and AdamW, run through ``funcamp.sgd``/``adam``/``adamw`` with the same keyword arguments and
compared with ``torch.optim`` (params and state, rtol 1e-6, atol 1e-7) after several steps.

The configurations are torch's own: ``OptimizerInfo.optim_inputs_func("cpu")`` expanded with the
implementation flags as torch's tests expand them on CPU (``differentiable``, ``fused``), plus
``foreach=True`` (which torch's tests run on CUDA only). Each flag maps to funcamp's own path for
it and must not change the numerics:

* none, ``foreach`` -- ``opt.update`` + ``apply_updates``, eager (foreach kernels);
* ``differentiable`` -- the same on params autograd tracks (the traced path): values, and the
  gradient of the final params with respect to the initial ones, against torch's;
* ``fused`` -- ``unscale_and_step(..., donate_state=True)``: torch's fused kernel in place for
  ``adam``/``adamw(fused=True)`` and plain SGD, the donated in-place step for SGD with momentum.

Every eager configuration runs; compiled (``torch.compile(fullgraph=True)``) with aot_eager,
every configuration without the ``differentiable`` flag (one graph, no recompile over the
steps; most with ``FUNCAMP_TEST_EXHAUSTIVE=1`` only, see ``COMPILED``), and a few with inductor. A step with an all-zero gradient leaf is in every run; a
``None`` gradient (torch skips the param) is compared where funcamp has an equivalent.
"""

from __future__ import annotations

import inspect
import math

import optree
import pytest
import torch
import torch._dynamo.testing
from exhaustive import exhaustive
from torch.testing._internal import common_optimizers

import funcamp
from funcamp.optim import REGISTRY
from funcamp.testing import assert_trees_equal

RTOL, ATOL = 1e-6, 1e-7
STEPS = 4
ZERO_STEP, ZERO_LEAF = 1, "b"  # this leaf's gradient is all zeros on this step
SHAPES = {"w": (3, 4), "b": (5,), "v": (2, 1, 3)}
MATRICES = {"w": (3, 4), "b": (5, 2), "v": (2, 3)}  # Muon's: 2-D params only
#: the registered optimizers whose torch twin is in torch.optim, by the twin's name (LBFGS:
#: tests/test_optim_catalogue.py, with a closure)
TWINS = {
    e.torch.__name__: e
    for e in REGISTRY.values()
    if isinstance(e.torch, type) and e.torch.__module__.startswith("torch.optim") and not e.loss
}
NAMES = tuple(TWINS)
IMPLS = ("foreach", "differentiable", "fused")


def _configs() -> list[tuple[str, str, dict]]:
    out = []
    for info in common_optimizers.optim_db:
        name = info.optim_cls.__name__
        if name not in NAMES:
            continue
        inputs = common_optimizers._get_optim_inputs_including_global_cliquey_kwargs(
            "cpu", torch.float32, info
        )
        for oi in inputs:
            out.append((name, oi.desc, dict(oi.kwargs)))
            foreach = "foreach" in info.supported_impls  # Muon has none
            if foreach and not any(oi.kwargs.get(f) for f in IMPLS):  # the base: its foreach too
                out.append((name, f"{oi.desc} & foreach", {**oi.kwargs, "foreach": True}))
    return out


CONFIGS = _configs()
IDS = [f"{name}-{desc}" for name, desc, _ in CONFIGS]
CLASSES = {name: e.torch for name, e in TWINS.items()}
#: torch.optim's state per param, by funcamp state field (the buffers of the other optimizers).
STATE_FIELDS = {
    name: e.state_fields for name, e in TWINS.items() if name not in ("SGD", "Adam", "AdamW")
}
#: funcamp's optimizer for each of them, whose arguments are torch's by name (``betas`` is
#: split into ``b1, b2``).
FACTORIES = {name: e.factory for name, e in TWINS.items() if name in STATE_FIELDS}


def _impl(kwargs: dict) -> str:
    on = [f for f in IMPLS if kwargs.get(f)]
    assert len(on) <= 1, kwargs  # torch's expansion sets one at a time
    return on[0] if on else "plain"


def _torch_defaults(name: str) -> dict:
    sig = inspect.signature(CLASSES[name].__init__)
    return {k: p.default for k, p in sig.parameters.items() if k not in ("self", "params")}


def _funcamp_opt(name: str, kwargs: dict) -> funcamp.Optimizer:
    """funcamp's optimizer for torch's kwargs (torch's defaults filled in: funcamp's own
    defaults are not what is tested here). A kwarg this does not know fails the test."""
    kw = {**_torch_defaults(name), **kwargs}
    fused = bool(kw.pop("fused", None) or False)
    for flag in ("foreach", "differentiable", "capturable"):
        kw.pop(flag, None)
    lr = kw.pop("lr")
    lr = lr.clone() if isinstance(lr, torch.Tensor) else lr
    if name in FACTORIES:
        if "betas" in kw:
            kw["b1"], kw["b2"] = kw.pop("betas")
        return FACTORIES[name](lr, **kw)
    if name == "SGD":
        args = {k: kw.pop(k) for k in ("momentum", "dampening", "weight_decay", "nesterov")}
        args["maximize"] = kw.pop("maximize")
        assert not kw, f"unmapped SGD kwargs {kw}"
        return funcamp.sgd(lr, **args)
    b1, b2 = kw.pop("betas")
    args = {k: kw.pop(k) for k in ("eps", "weight_decay", "amsgrad", "maximize")}
    kw.pop("decoupled_weight_decay", None)  # Adam's flag (AdamW is Adam with it set)
    assert not kw, f"unmapped {name} kwargs {kw}"
    make = funcamp.adam if name == "Adam" else funcamp.adamw
    return make(lr, b1, b2, fused=fused, **args)


def _shapes(name: str | None) -> dict[str, tuple[int, ...]]:
    return MATRICES if name == "Muon" else SHAPES


def _params(name: str | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen) for k, s in _shapes(name).items()}


def _grads(step: int, name: str | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    out = {k: torch.randn(s, generator=gen) for k, s in _shapes(name).items()}
    if step == ZERO_STEP:
        out[ZERO_LEAF] = torch.zeros(_shapes(name)[ZERO_LEAF])
    return out


def _torch_kwargs(kwargs: dict) -> dict:
    kw = dict(kwargs)
    if isinstance(kw.get("lr"), torch.Tensor):
        kw["lr"] = kw["lr"].clone()
    return kw


def _torch_run(name: str, kwargs: dict, steps: int = STEPS, *, params=None, none=None):
    """torch.optim's params and per-param state after ``steps`` steps (differentiable: the
    params are clones of leaves that require grad, as torch's own tests make them); ``none(i,
    k)``: leaf ``k``'s gradient is None on step ``i``."""
    diff = bool(kwargs.get("differentiable"))
    leaves = {k: v.requires_grad_(diff) for k, v in (params or _params(name)).items()}
    ps = {k: v.clone() if diff else v for k, v in leaves.items()}
    opt = CLASSES[name](list(ps.values()), **_torch_kwargs(kwargs))
    for i in range(steps):
        grads = _grads(i, name)
        for k, p in ps.items():
            p.grad = None if none is not None and none(i, k) else grads[k]
        opt.step()
    return leaves, ps, {k: opt.state[p] for k, p in ps.items()}


def _step_fn(opt: funcamp.Optimizer, impl: str, device: torch.device | None = None):
    """One update of ``opt`` (fused: the donated ``unscale_and_step``, the scaler on
    ``device``)."""
    scaler = funcamp.ScalerState.noop(device=device)

    def step(params, state, grads):
        if impl == "fused":
            params, state, _ = funcamp.unscale_and_step(
                scaler, opt, grads, state, params, donate_state=True, grad_norm=False
            )
            return params, state
        updates, state = opt.update(grads, state, params)
        return funcamp.apply_updates(params, updates), state

    return step


def _funcamp_run(name: str, kwargs: dict, *, backend: str | None = None, steps: int = STEPS):
    opt = _funcamp_opt(name, kwargs)
    impl = _impl(kwargs)
    leaves = {k: v.requires_grad_(impl == "differentiable") for k, v in _params(name).items()}
    params = {k: v.clone() for k, v in leaves.items()}
    state = opt.init({k: v.detach() for k, v in params.items()})
    step = _step_fn(opt, impl)
    counter = None
    if backend is not None:
        counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
        step = torch.compile(step, fullgraph=True, backend=counter)
    for i in range(steps):
        params, state = step(params, state, _grads(i, name))
    return leaves, params, state, counter


def _expected_state(name: str, kwargs: dict, state: dict) -> dict:
    """torch's per-param state in the fields of funcamp's state."""
    out: dict = {}
    if name == "Adafactor":  # what torch keeps for a param, and an empty tensor for the rest
        for field in STATE_FIELDS[name]:
            out[field] = {
                k: s[field]
                if field in s
                else torch.zeros(0, device=s["row_var" if "row_var" in s else "variance"].device)
                for k, s in state.items()
            }
        return out
    if name in STATE_FIELDS:
        for field in STATE_FIELDS[name]:
            if all(field in s for s in state.values()):
                out[field] = {k: s[field] for k, s in state.items()}
        if name == "NAdam":  # one per param in torch, all equal: one in funcamp
            out["mu_product"] = next(iter(out["mu_product"].values()))
        return out
    if name == "SGD":
        if kwargs.get("momentum", 0.0):
            out["momentum"] = {k: s["momentum_buffer"] for k, s in state.items()}
        return out
    out["exp_avg"] = {k: s["exp_avg"] for k, s in state.items()}
    out["exp_avg_sq"] = {k: s["exp_avg_sq"] for k, s in state.items()}
    if kwargs.get("amsgrad"):
        out["max_exp_avg_sq"] = {k: s["max_exp_avg_sq"] for k, s in state.items()}
    return out


def _check(name: str, kwargs: dict, params: dict, state, steps: int = STEPS) -> None:
    _, tps, tstate = _torch_run(name, kwargs, steps)
    torch.testing.assert_close(
        {k: v.detach() for k, v in params.items()},
        {k: v.detach() for k, v in tps.items()},
        rtol=RTOL,
        atol=ATOL,
    )
    for s in tstate.values():  # torch's step counter per param; funcamp's one count
        if "step" in s:
            assert float(s["step"]) == float(state.count) == steps
    expected = _expected_state(name, kwargs, tstate)
    for field in state._fields[1:-1]:  # the buffers: those not in use hold ()
        got = getattr(state, field)
        if field not in expected:
            assert got == (), (field, got)
            continue
        got = optree.tree_map(lambda x: x.detach(), got)
        want = optree.tree_map(lambda x: x.detach(), expected[field])
        torch.testing.assert_close(
            got, want, rtol=RTOL, atol=ATOL, msg=lambda m, f=field: f"{f}: {m}"
        )
    assert state.low == ()


@pytest.mark.parametrize(("name", "desc", "kwargs"), CONFIGS, ids=IDS)
def test_eager_matches_torch_optim(name, desc, kwargs):
    _, params, state, _ = _funcamp_run(name, kwargs)
    _check(name, kwargs, params, state)
    if _impl(kwargs) == "differentiable":
        _check_gradients(name, kwargs)


def _check_gradients(name: str, kwargs: dict) -> None:
    """The step is differentiable as torch's is: the gradient of the final params (weighted)
    with respect to the initial ones, through every step, against torch's.

    Two of torch's own limits: its amsgrad is differentiable through one step only (its
    ``torch.maximum`` saves ``exp_avg_sq``, which the next step changes in place, and backward
    raises), so it is compared after one step -- as are Adamax (its ``exp_inf.mul_``) and
    centered RMSprop (its ``grad_avg.lerp_``), for the same reason; and SGD detaches its first momentum buffer
    (``torch.clone(grad).detach()``), which drops the weight decay's term of the first step
    from the gradient: with momentum and weight decay funcamp's gradient is checked against
    finite differences instead (float64), and torch's is pinned as different
    (docs/differences.md)."""
    one_step = kwargs.get("amsgrad") or name == "Adamax" or kwargs.get("centered")
    steps = 1 if one_step else STEPS
    weights = {k: torch.linspace(-1.0, 2.0, math.prod(s)).reshape(s) for k, s in SHAPES.items()}

    def grad(leaves: dict, params: dict) -> tuple:
        loss = sum((params[k] * weights[k]).sum() for k in SHAPES)
        return torch.autograd.grad(loss, list(leaves.values()))

    ours = grad(*_funcamp_run(name, kwargs, steps=steps)[:2])
    theirs = grad(*_torch_run(name, kwargs, steps)[:2])
    if name == "SGD" and kwargs.get("momentum") and kwargs.get("weight_decay"):
        assert not torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)  # torch detaches
        assert torch.autograd.gradcheck(_float64_run(name, kwargs), tuple(_float64_params()))
        return
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _float64_params() -> list[torch.Tensor]:
    return [v.double().requires_grad_() for v in _params().values()]


def _float64_run(name: str, kwargs: dict):
    """The final params as a function of the initial ones, in float64 (for gradcheck)."""
    opt = _funcamp_opt(name, kwargs)

    def run(*leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = dict(zip(SHAPES, leaves))
        state = opt.init({k: v.detach() for k, v in params.items()})
        for i in range(STEPS):
            grads = {k: g.double() for k, g in _grads(i).items()}
            updates, state = opt.update(grads, state, params)
            params = funcamp.apply_updates(params, updates)
        return tuple(params.values())

    return run


# foreach=True is the unflagged path in funcamp: compiled once, as the configuration without it.
# The suite compiles every unflagged configuration and the fused ones of the defaults, maximize
# and amsgrad; the other fused ones (the same kernels with other hyperparameters) are an
# exhaustive sweep (FUNCAMP_TEST_EXHAUSTIVE=1). The other optimizers: one configuration each in
# the suite (the one with the most options), the rest slow; exhaustive where torch's database
# also has the configuration with the differentiable flag (which runs funcamp's traced path
# eagerly, so what compiling adds is one graph): all but Muon and Adafactor.
_NO_DIFFERENTIABLE = ("Muon", "Adafactor")
COMPILED_FUSED = ("default & fused", "maximize & fused", "amsgrad & fused")
COMPILED_OTHERS = (
    "RMSprop-maximize, centered, weight_decay, w/ momentum",
    "Adagrad-lr_decay",
    "Adadelta-rho",
    "Adamax-maximize, weight_decay",
    "NAdam-decoupled_weight_decay",
    "RAdam-maximize",
    "ASGD-maximize, nonzero weight_decay",
    "Rprop-non-default etas",
    "Muon-non-default weight_decay",
    "Adafactor-maximize",
)


def _compiled_in_ci(name: str, desc: str, kwargs: dict) -> bool:
    if name in FACTORIES:
        return f"{name}-{desc}" in COMPILED_OTHERS
    return _impl(kwargs) == "plain" or desc in COMPILED_FUSED


def _compiled_marks(name: str, desc: str, kwargs: dict) -> tuple:
    if _compiled_in_ci(name, desc, kwargs):
        return ()
    return (pytest.mark.slow,) if name in _NO_DIFFERENTIABLE else (pytest.mark.slow, exhaustive)


COMPILED = [
    pytest.param(*c, id=i, marks=_compiled_marks(*c))
    for c, i in zip(CONFIGS, IDS)
    if _impl(c[2]) in ("plain", "fused") and not c[2].get("foreach")
]


@pytest.mark.parametrize(("name", "desc", "kwargs"), COMPILED)
def test_compiled_matches_torch_optim(name, desc, kwargs):
    torch._dynamo.reset()
    _, params, state, counter = _funcamp_run(name, kwargs, backend="aot_eager")
    assert counter.frame_count == 1  # one graph over every step: no recompile
    _check(name, kwargs, params, state)


INDUCTOR = ["Adam-amsgrad", "AdamW-maximize & fused"]  # generated code; the extern kernel


@pytest.mark.parametrize("config_id", INDUCTOR)
def test_inductor_matches_torch_optim(config_id):
    name, _, kwargs = CONFIGS[IDS.index(config_id)]
    torch._dynamo.reset()
    _, params, state, counter = _funcamp_run(name, kwargs, backend="inductor")
    assert counter.frame_count == 1
    _check(name, kwargs, params, state)


# ----------------------------------------------------------------------------- None gradients

BASE = [(c, i) for c, i in zip(CONFIGS, IDS) if _impl(c[2]) == "plain" and not c[2].get("foreach")]


@pytest.mark.parametrize(("name", "desc", "kwargs"), [c for c, _ in BASE], ids=[i for _, i in BASE])
def test_a_param_without_gradients_is_a_masked_leaf(name, desc, kwargs):
    """A param whose ``.grad`` stays None: torch.optim never touches it and keeps no state for
    it; in funcamp it is a leaf outside the mask of :func:`funcamp.masked` (zero updates, no
    state), or a frozen param of a ``TrainState``. The other leaves match as before. For plain
    SGD (no momentum, no weight decay), a None gradient on one step is a zero gradient."""
    extra = torch.linspace(-1.0, 1.0, 4).reshape(2, 2)
    params = {**_params(name), "n": extra.clone()}
    _, tps, tstate = _torch_run(name, kwargs, params=params, none=lambda i, k: k == "n")
    opt = funcamp.masked(_funcamp_opt(name, kwargs), {**dict.fromkeys(SHAPES, True), "n": False})
    ours = {**_params(name), "n": extra.clone()}
    state = opt.init(ours)
    for i in range(STEPS):
        updates, state = opt.update({**_grads(i, name), "n": torch.zeros(2, 2)}, state, ours)
        ours = funcamp.apply_updates(ours, updates)
    torch.testing.assert_close(ours, tps, rtol=RTOL, atol=ATOL)
    assert torch.equal(ours["n"], extra)
    # torch keeps no state for it -- Adagrad's, made when it is built, stays at step 0
    assert tstate["n"] == {} or (name == "Adagrad" and float(tstate["n"]["step"]) == 0)
    for field in state.inner._fields[1:-1]:
        tree = getattr(state.inner, field)
        assert isinstance(tree, torch.Tensor) or "n" not in (tree or {})  # or one scalar
    if name == "SGD" and not kwargs.get("momentum") and not kwargs.get("weight_decay"):
        _, tps, _ = _torch_run(name, kwargs, none=lambda i, k: (i, k) == (ZERO_STEP, ZERO_LEAF))
        _, params, _, _ = _funcamp_run(name, kwargs)  # a zero gradient there
        torch.testing.assert_close(params, tps, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------- amsgrad's maximum is optimizer state

BAD_STEP = 2  # an inf in one gradient: the step is skipped (GradScaler's rule)
SKIPPING = [
    ("RMSprop", {"weight_decay": 0.1, "centered": True, "momentum": 0.1}, True, None),
    ("RMSprop", {"centered": True, "momentum": 0.1, "maximize": True}, False, None),
    ("RMSprop", {"centered": True, "momentum": 0.1}, True, "aot_eager"),  # compiled, donated
    ("Adagrad", {"initial_accumulator_value": 0.1, "lr_decay": 0.5}, True, None),
    ("Adadelta", {"weight_decay": 0.1}, False, None),
    ("Adamax", {"weight_decay": 0.1}, True, None),
    ("NAdam", {"weight_decay": 0.1, "decoupled_weight_decay": True}, True, None),
    ("NAdam", {"momentum_decay": 0.006}, False, "aot_eager"),
    ("RAdam", {"weight_decay": 0.1}, True, None),
    ("ASGD", {"t0": 1, "lambd": 0.1}, True, None),
    ("Rprop", {"etas": (0.5, 1.5)}, True, None),
    ("Muon", {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"}, True, None),
    ("Adafactor", {"weight_decay": 0.1, "d": 1.5}, True, None),
    ("Adam", {"weight_decay": 0.1, "amsgrad": True}, False, None),
    ("AdamW", {"weight_decay": 0.1, "amsgrad": True, "maximize": True}, True, None),
    ("AdamW", {"weight_decay": 0.1, "amsgrad": True}, False, None),
    ("Adam", {"amsgrad": True, "fused": True}, True, None),
    ("Adam", {"amsgrad": True, "fused": True}, True, "aot_eager"),
    ("AdamW", {"weight_decay": 0.1, "amsgrad": True}, True, "aot_eager"),
    ("SGD", {"momentum": 0.9, "weight_decay": 0.1, "maximize": True}, True, None),
    ("SGD", {"weight_decay": 0.1, "maximize": True}, True, None),  # torch's fused SGD kernel
]


def _bad_grads(step: int, name: str | None = None) -> dict[str, torch.Tensor]:
    grads = _grads(step, name)
    if step == BAD_STEP:
        grads["w"][1, 2] = math.inf
    return grads


@pytest.mark.parametrize(("name", "kwargs", "donate", "backend"), SKIPPING)
def test_an_overflowing_step_skips_every_buffer(name, kwargs, donate, backend):
    """``unscale_and_step`` on an overflow keeps the whole state -- ``max_exp_avg_sq`` too --
    bit for bit (donated or not, in place through torch's fused kernel, compiled), and the run
    matches torch.optim whose step GradScaler skipped there."""
    opt = _funcamp_opt(name, kwargs)
    scaler = funcamp.ScalerState.static(1.0)

    def step(params, state, grads):
        params, state, info = funcamp.unscale_and_step(
            scaler, opt, grads, state, params, donate_state=donate, grad_norm=False
        )
        return params, state, info.found_inf

    if backend is not None:
        torch._dynamo.reset()
        step = torch.compile(step, fullgraph=True, backend=backend)
    params = _params(name)
    state = opt.init(params)
    for i in range(STEPS):
        before = optree.tree_map(torch.clone, (params, state), namespace="funcamp")
        params, state, found_inf = step(params, state, _bad_grads(i, name))
        assert bool(found_inf) == (i == BAD_STEP)
        if i == BAD_STEP:
            assert_trees_equal((params, state), before)
    ps = {k: torch.nn.Parameter(v) for k, v in _params(name).items()}
    topt = CLASSES[name](list(ps.values()), **kwargs)
    for i in range(STEPS):
        if i != BAD_STEP:
            for k, g in _grads(i, name).items():
                ps[k].grad = g
            topt.step()
    expected = _expected_state(name, kwargs, {k: topt.state[p] for k, p in ps.items()})
    torch.testing.assert_close(params, {k: v.detach() for k, v in ps.items()}, rtol=RTOL, atol=ATOL)
    for field, want in expected.items():
        torch.testing.assert_close(getattr(state, field), want, rtol=RTOL, atol=ATOL)
    assert int(state.count) == STEPS - 1


def test_amsgrad_state_checkpoints_and_resumes(tmp_path):
    """``max_exp_avg_sq`` is saved and loaded with the rest (state_dict, save/load), and a
    resumed run is the uninterrupted one bit for bit; a state without amsgrad keeps ``()``
    there, so a checkpoint written before the field existed (no such key) still loads."""
    opt = funcamp.adamw(1e-2, weight_decay=0.1, amsgrad=True)
    params = _params()
    state = opt.init(params)
    step = _step_fn(opt, "plain")
    for i in range(2):
        params, state = step(params, state, _grads(i))
    sd = funcamp.state_dict({"params": params, "opt": state})
    assert set(sd["opt"]["max_exp_avg_sq"]) == set(SHAPES)
    template = {"params": _params(), "opt": opt.init(_params())}
    path = tmp_path / "ckpt.pt"
    funcamp.save(path, {"params": params, "opt": state}, policy="float32")
    loaded = funcamp.load(path, template, policy="float32")
    assert_trees_equal(loaded, {"params": params, "opt": state})
    a, b = (params, state), (loaded["params"], loaded["opt"])
    for i in range(2, STEPS):
        a, b = step(*a, _grads(i)), step(*b, _grads(i))
    assert_trees_equal(a, b)
    _check("AdamW", {"weight_decay": 0.1, "amsgrad": True, "lr": 1e-2}, *a)
    plain = funcamp.adamw(1e-2).init(_params())
    old = funcamp.state_dict(plain)
    del old["max_exp_avg_sq"]  # as written before the field existed
    assert_trees_equal(funcamp.load_state_dict(plain, old), plain)


def test_amsgrad_state_is_sharded_like_the_moments(single_rank_group):
    """On a mesh, ``max_exp_avg_sq`` is sharded as the moments (by the params' shapes), and the
    sharded step is the unsharded one bit for bit, through an overflow."""
    from torch.distributed.device_mesh import init_device_mesh

    import funcamp.distributed as fd

    mesh = init_device_mesh("cpu", (1,))
    opt = funcamp.adamw(1e-2, weight_decay=0.1, amsgrad=True)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(x @ params["w"] + params["b"][:4], y)

    def batches():
        gen = torch.Generator().manual_seed(3)
        out = [
            (torch.randn(6, 3, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(4)
        ]
        out[BAD_STEP][0][0, 0] = math.inf
        return out

    def init():
        return funcamp.TrainState.create(
            {"w": torch.randn(3, 4), "b": torch.randn(5)}, opt, "float32"
        )

    torch.manual_seed(0)
    state = init()
    sharded = fd.shard(optree.tree_map(torch.clone, state, namespace="funcamp"), mesh)
    ms, m = sharded.opt_state.max_exp_avg_sq, sharded.opt_state.exp_avg
    assert {k: v.placements for k, v in ms.items()} == {k: v.placements for k, v in m.items()}
    plain = funcamp.make_train_step(loss_fn, opt, "float32", compile=False, donate_state=False)
    on_mesh = funcamp.make_train_step(
        loss_fn,
        opt,
        "float32",
        compile=False,
        parallel=funcamp.distributed.Sharded(mesh),
        donate_state=False,
    )
    for batch in batches():
        state, ma = plain(state, batch)
        sharded, mb = on_mesh(sharded, batch)
        assert bool(ma["found_inf"]) == bool(mb["found_inf"])
    full = optree.tree_map(
        lambda x: x.full_tensor() if hasattr(x, "full_tensor") else x, sharded, namespace="funcamp"
    )
    assert_trees_equal(funcamp.state_dict(full), funcamp.state_dict(state))
    assert int(state.opt_state.count) == 3  # the overflow skipped


# ---------------------------------------------------------------- the optax way: composed blocks


@pytest.mark.parametrize("name", [n for n in NAMES if n != "Muon"])  # Muon has no maximize
def test_negate_gradients_in_front_is_maximize_bit_for_bit(name):
    kwargs = {"weight_decay": 0.1, "momentum": 0.9} if name == "SGD" else {"weight_decay": 0.1}
    kwargs = {} if name == "Rprop" else kwargs  # no weight decay
    one = _funcamp_opt(name, {**kwargs, "maximize": True})
    two = funcamp.chain(funcamp.negate_gradients(), _funcamp_opt(name, kwargs))
    runs = []
    for opt in (one, two):
        params = _params()
        state = opt.init(params)
        for i in range(STEPS):
            params, state = _step_fn(opt, "plain")(params, state, _grads(i))
        runs.append((params, state if opt is one else state[1]))
    assert_trees_equal(runs[1], runs[0])
    _check(name, {**kwargs, "maximize": True}, *runs[0])


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_scale_by_amsgrad_then_sgd_is_torch_amsgrad(backend):
    """``chain(negate_gradients(), scale_by_amsgrad(b1, b2, eps), sgd(lr))`` is
    ``torch.optim.Adam(lr, (b1, b2), eps, amsgrad=True, maximize=True)`` (within rounding),
    its maximum the same buffer; eager and compiled."""
    kwargs = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "amsgrad": True, "maximize": True}
    opt = funcamp.chain(
        funcamp.negate_gradients(), funcamp.scale_by_amsgrad(0.8, 0.99, 1e-6), funcamp.sgd(1e-2)
    )
    step = _step_fn(opt, "plain")
    if backend is not None:
        torch._dynamo.reset()
        step = torch.compile(step, fullgraph=True, backend=backend)
    params = _params()
    state = opt.init(params)
    for i in range(STEPS):
        params, state = step(params, state, _grads(i))
    _check("Adam", kwargs, params, state[1])
    # sgd's (the block has none), torch's lr: a double
    assert funcamp.optim.learning_rate(opt, state) == torch.tensor(1e-2, dtype=torch.float64)


TENSOR_BETAS = [
    ("Adam", {}),
    ("Adam", {"weight_decay": 0.1, "amsgrad": True, "lr": torch.tensor(0.01)}),
    ("AdamW", {"weight_decay": 0.1, "maximize": True}),
]


@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize(("name", "kwargs"), TENSOR_BETAS)
def test_tensor_betas_match_torch_optim(name, kwargs, backend):
    """``betas`` as 0-d tensors, which torch.optim.Adam/AdamW accept on their single-tensor
    path (their bias corrections then run as float32 tensor math): funcamp's ``b1``/``b2``
    take them too, eager and compiled."""
    kwargs = {**kwargs, "betas": (torch.tensor(0.8), torch.tensor(0.99)), "foreach": False}
    if backend is not None:
        torch._dynamo.reset()
    _, params, state, counter = _funcamp_run(name, kwargs, backend=backend)
    _check(name, kwargs, params, state)
    if counter is not None:
        assert counter.frame_count == 1


#: 0-d tensor betas as torch.optim's NAdam, RAdam and Adamax take them on their single-tensor
#: step: both, one or the other, float64 (the bias corrections and NAdam's ``mu`` then run as
#: tensor math in the beta's dtype), with a tensor ``lr`` too (with float betas as well: the
#: step sizes are then tensor math in the lr's dtype).
BETA_FORMS = {
    "both": lambda: {"betas": (torch.tensor(0.9), torch.tensor(0.999))},
    "b1": lambda: {"betas": (torch.tensor(0.9), 0.999)},
    "b2": lambda: {"betas": (0.9, torch.tensor(0.999))},
    "float64": lambda: {
        "betas": (torch.tensor(0.8, dtype=torch.float64), torch.tensor(0.99, dtype=torch.float64))
    },
    "tensor_lr": lambda: {
        "betas": (torch.tensor(0.8), torch.tensor(0.99)),
        "lr": torch.tensor(0.03),
    },
    "float_tensor_lr": lambda: {"betas": (0.8, 0.99), "lr": torch.tensor(0.03)},
}
BETA_OPTIONS = {
    "NAdam": {"weight_decay": 0.1, "decoupled_weight_decay": True},
    "RAdam": {"weight_decay": 0.1, "maximize": True},
    "Adamax": {"weight_decay": 0.1},
}
BETA_STEPS = 8  # a zero gradient leaf on step 1; RAdam rectified from step 6


def _beta_kwargs(name: str, form: str) -> dict:
    return {"lr": 0.03, **BETA_OPTIONS[name], **BETA_FORMS[form](), "foreach": False}


@pytest.mark.parametrize("form", sorted(BETA_FORMS))
@pytest.mark.parametrize("name", sorted(BETA_OPTIONS))
def test_tensor_betas_of_nadam_radam_adamax_match_torch_bit_for_bit(name, form):
    """funcamp's ``b1``/``b2`` take 0-d tensors as torch.optim's NAdam, RAdam and Adamax do, with
    torch's numbers after several steps: Adamax's and RAdam's params and state bit for bit;
    NAdam's within the suite's tolerance (its float32 square root of ``exp_avg_sq /
    bias_correction2`` is correctly rounded, torch's not always: docs/differences.md) and its
    ``mu_product``, all tensor math in the beta's dtype, bit for bit."""
    kwargs = _beta_kwargs(name, form)
    _, params, state, _ = _funcamp_run(name, kwargs, steps=BETA_STEPS)
    _, tps, tstate = _torch_run(name, kwargs, BETA_STEPS)
    _check(name, kwargs, params, state, BETA_STEPS)
    expected = _expected_state(name, kwargs, tstate)
    if name == "NAdam":
        assert_trees_equal(state.mu_product, expected["mu_product"])
        return
    assert_trees_equal(params, {k: v.detach() for k, v in tps.items()})
    for field, want in expected.items():
        assert_trees_equal(getattr(state, field), want)


@pytest.mark.parametrize("name", ["NAdam", pytest.param("RAdam", marks=pytest.mark.slow), "Adamax"])
def test_tensor_betas_of_nadam_radam_adamax_compiled(name):
    """Compiled (aot_eager, one graph over every step) the same numbers as eager."""
    torch._dynamo.reset()
    kwargs = _beta_kwargs(name, "both")
    _, params, state, counter = _funcamp_run(name, kwargs, backend="aot_eager", steps=BETA_STEPS)
    assert counter.frame_count == 1
    _, eager, eager_state, _ = _funcamp_run(name, kwargs, steps=BETA_STEPS)
    assert_trees_equal((params, state), (eager, eager_state))
    _check(name, kwargs, params, state, BETA_STEPS)


@pytest.mark.parametrize("factory", [funcamp.nadam, funcamp.radam, funcamp.adamax])
@pytest.mark.parametrize(
    ("beta", "error", "match"),
    [
        (torch.tensor([0.9]), TypeError, r"`b1` must be a float or a 0-d float32 or float64"),
        (torch.tensor(0.9, dtype=torch.bfloat16), TypeError, r"`b1` .* 0-d float32 or float64"),
        (torch.tensor(0.9, requires_grad=True), TypeError, r"`b1` .* without grad .* b1.detach"),
        (torch.tensor(1.0), ValueError, r"`b1` must be .* in \[0.0, 1.0\), got 1.0"),
    ],
    ids=["1-d", "bfloat16", "requires_grad", "one"],
)
def test_tensor_betas_refused_clearly(factory, beta, error, match):
    """What torch.optim's NAdam/RAdam/Adamax refuse (a beta of 1; a beta of another shape fails
    in their step) and what funcamp does not take (half dtypes, a beta to differentiate) is
    refused when the optimizer is built, naming the fix."""
    with pytest.raises(error, match=rf"funcamp\.{factory.__name__}: {match}"):
        factory(0.01, beta, 0.99)


@pytest.mark.parametrize(
    "form",
    [
        {"betas": (0.8, 0.99), "lr": torch.tensor(0.03)},
        {"betas": (torch.tensor(0.8), torch.tensor(0.99)), "lr": torch.tensor(0.03)},
        {"betas": (torch.tensor(0.8), torch.tensor(0.99)), "lr": 0.03},
    ],
    ids=["float_betas_tensor_lr", "tensor_betas_tensor_lr", "tensor_betas"],
)
@pytest.mark.parametrize("name", ["RAdam", "Adamax"])
def test_tensor_step_sizes_bit_for_bit_over_many_steps(name, form):
    """The step sizes torch computes as tensor math (a tensor beta's bias corrections, a tensor
    lr's ``lr / bias_correction``), step after step: 100 steps of a small param, bit for bit
    at every step."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(4, generator=gen)
    p = torch.nn.Parameter(p0.clone())
    copy = lambda x: x.clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    betas = tuple(copy(b) for b in form["betas"])
    ref = CLASSES[name]([p], lr=copy(form["lr"]), betas=betas, foreach=False)
    opt = FACTORIES[name](form["lr"], *form["betas"])
    params = {"w": p0.clone()}
    state = opt.init(params)
    for i in range(100):
        g = torch.randn(4, generator=gen)
        p.grad = g.clone()
        ref.step()
        updates, state = opt.update({"w": g}, state, params)
        params = funcamp.apply_updates(params, updates)
        assert torch.equal(params["w"], p.detach()), i
