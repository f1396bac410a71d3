"""``funcamp.asgd(foreach=True)`` and ``funcamp.adafactor(foreach=True)`` against torch.optim's
foreach steps (``_multi_tensor_asgd``, ``_multi_tensor_adafactor``), which round otherwise than
its for-loop steps: 30 steps, params and state bit for bit, on the eager path, the traced path
(params autograd tracks) and compiled (aot_eager). The flag as ``from_torch`` maps it is in
``tests/test_torch_runs.py``; here are hyperparameters torch's database leaves out (``t0``
reached, ``lambd`` 0, ``alpha`` 0.5, Adafactor's ``d``, ``beta2_decay``, ``eps``) and a 3-d
param.
"""

from __future__ import annotations

import pytest
import torch

import funcamp
from funcamp.optim._torch_state import _asgd

STEPS = 30
CASES = [
    ("ASGD", {}),
    ("ASGD", {"t0": 3.0, "lambd": 0.05}),
    ("ASGD", {"lr": 0.3, "lambd": 0.07, "alpha": 0.5, "t0": 0.0}),
    ("ASGD", {"weight_decay": 0.1, "maximize": True, "t0": 5.0}),
    ("ASGD", {"weight_decay": 0.1, "lambd": 0.0}),
    ("Adafactor", {}),
    ("Adafactor", {"weight_decay": 0.1, "d": 1.5}),
    ("Adafactor", {"lr": 0.5, "beta2_decay": -0.5, "maximize": True}),
    ("Adafactor", {"eps": (1e-4, 1e-2), "weight_decay": 0.05}),
]
IDS = [f"{name}-{'-'.join(kw) or 'default'}" for name, kw in CASES]
FUNCAMP = {"ASGD": funcamp.asgd, "Adafactor": funcamp.adafactor}
KEYS = {"ASGD": ("ax",), "Adafactor": ("row_var", "col_var", "variance")}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


def _params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (5, 4), "b": (4,), "k": (2, 3, 4), "v": (7,)}
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()}


def _grads(step: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Random gradients; one leaf all zero on step 4."""
    g = torch.Generator().manual_seed(100 + step)
    out = {k: torch.randn(p.shape, generator=g).to(p.dtype) for k, p in params.items()}
    if step == 4:
        out["b"] = torch.zeros_like(out["b"])
    return out


def _torch_run(name: str, kwargs: dict, dtype: torch.dtype) -> list[tuple[dict, dict]]:
    """torch's params and per-param state after each step, ``foreach=True``."""
    params = {k: torch.nn.Parameter(v) for k, v in _params(dtype).items()}
    opt = getattr(torch.optim, name)(list(params.values()), foreach=True, **kwargs)
    out = []
    for i in range(STEPS):
        for k, g in _grads(i, params).items():
            params[k].grad = g
        opt.step()
        state = {k: dict(opt.state[p]) for k, p in params.items()}
        out.append(({k: p.detach().clone() for k, p in params.items()}, _clone(state)))
    if name == "ASGD":  # funcamp's own eta for torch's foreach group is torch's
        for k, p in params.items():
            eta = _asgd(opt.param_groups[0], STEPS)["eta"]
            assert torch.equal(eta.to(opt.state[p]["eta"].dtype), opt.state[p]["eta"]), k
    return out


def _clone(state: dict) -> dict:
    return {
        k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
        for k, s in state.items()
    }


def _check(name: str, want: tuple[dict, dict], params: dict, state, where: str) -> None:
    want_params, want_state = want
    for k, p in want_params.items():
        assert torch.equal(params[k].detach(), p), f"{where}: param {k}"
    for k, s in want_state.items():
        for field in KEYS[name]:
            if s.get(field) is not None:
                got = getattr(state, field)[k].detach()
                assert torch.equal(got, s[field]), f"{where}: {field} of {k}"


def _lr_and_rest(name: str, kwargs: dict) -> tuple[float, dict]:
    kw = dict(kwargs)
    return kw.pop("lr", 0.01), kw


@pytest.mark.parametrize("path", ["eager", "donated", "traced"])
@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_foreach_steps_equal_torch_foreach(name, kwargs, path):
    """Each of 30 steps through ``unscale_and_step`` (no scaling), donated or not: the params
    and the state torch's foreach step leaves, bit for bit."""
    dtype = torch.float32
    want = _torch_run(name, kwargs, dtype)
    lr, kw = _lr_and_rest(name, kwargs)
    opt = FUNCAMP[name](lr, foreach=True, **kw)
    scaler = funcamp.ScalerState.noop()
    params = _params(dtype)
    state = opt.init(params)
    for i in range(STEPS):
        grads = _grads(i, params)
        if path == "traced":  # params autograd tracks: the per-leaf ops, nothing in place
            params = {k: p.detach().requires_grad_(True) for k, p in params.items()}
        params, state, _ = funcamp.unscale_and_step(
            scaler, opt, grads, state, params, donate_state=path == "donated", grad_norm=False
        )
        _check(name, want[i], params, state, f"{name} {kwargs} {path}, step {i}")


def _run(opt: funcamp.Optimizer, steps: int, step=None) -> list[tuple[dict, object]]:
    """``opt``'s params and state after each of ``steps`` steps of ``unscale_and_step``."""
    scaler = funcamp.ScalerState.noop()

    def one(params, state, grads):
        return funcamp.unscale_and_step(scaler, opt, grads, state, params, grad_norm=False)[:2]

    step = one if step is None else step(one)
    params = _params(torch.float32)
    state = opt.init(params)
    out = []
    for i in range(steps):
        params, state = step(params, state, _grads(i, params))
        out.append((params, state))
    return out


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_the_for_loop_step_differs_from_foreach(name, kwargs):
    """The default (``foreach=None``) is torch's for-loop step: within 30 steps its params or
    state differ from the foreach step's, so the flag is what makes the foreach run equal."""
    lr, kw = _lr_and_rest(name, kwargs)
    ends = [_run(FUNCAMP[name](lr, foreach=f, **kw), STEPS)[-1] for f in (None, True)]
    trees = [{"params": p, **{f: getattr(s, f) for f in KEYS[name]}} for p, s in ends]
    assert any(
        not torch.equal(trees[0][t][k], trees[1][t][k]) for t in trees[0] for k in trees[0][t]
    )


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kwargs"), [CASES[1], CASES[6]], ids=[IDS[1], IDS[6]])
def test_compiled_foreach_steps_equal_torch_foreach(name, kwargs):
    """The step compiled (aot_eager, fullgraph): torch's foreach numbers, 8 steps."""
    want = _torch_run(name, kwargs, torch.float32)
    lr, kw = _lr_and_rest(name, kwargs)
    torch._dynamo.reset()
    compiled = torch.compile
    got = _run(
        FUNCAMP[name](lr, foreach=True, **kw),
        8,
        lambda one: compiled(one, backend="aot_eager", fullgraph=True),
    )
    for i, (params, state) in enumerate(got):
        _check(name, want[i], params, state, f"{name} {kwargs} compiled, step {i}")


@pytest.mark.parametrize("make", [funcamp.asgd, funcamp.adafactor])
def test_foreach_must_be_a_bool_or_none(make):
    with pytest.raises(TypeError, match=r"`foreach` must be a bool"):
        make(0.01, foreach="yes")
