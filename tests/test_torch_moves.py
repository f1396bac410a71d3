"""A run that moves between torch and funcamp goes on as the run that never moved, bit for bit:
``TrainState.from_torch`` and ``TrainState.to_torch``, both ways, for every optimizer of torch's
optimizer database that funcamp translates.

Each configuration runs 30 steps three times: torch's loop alone (the reference; as in
tests/test_torch_runs.py: autocast, ``GradScaler`` for float16, ``optimizer.step()``, then
``scheduler.step()`` every iteration, as torch's docs teach), funcamp's eager step alone, and a
run that changes sides every 10 steps (torch -> funcamp -> torch, and funcamp -> torch ->
funcamp). After every step the moved run's params equal the reference's; at each move and at
the end, its optimizer state, loss scale and learning rate too. Each optimizer runs under a
scheduler (StepLR, CosineAnnealingLR, LambdaLR, SequentialLR, CosineAnnealingWarmRestarts,
ChainedScheduler, in turn). In float16 a batch with an inf makes GradScaler skip a step in the
first 10, so torch's scheduler runs one step ahead of the optimizer's count when the run moves.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import test_torch_runs as runs
import torch
import torch.nn as nn
from exhaustive import ON as EXHAUSTIVE

import funcamp
from funcamp.testing import assert_trees_equal

LRS = torch.optim.lr_scheduler
STEPS = 30  # the runs' length (runs.STEPS batches); a move every MOVE steps
MOVE = 10
IMPLS = ("foreach", "differentiable", "fused", "capturable")

SCHEDULERS = {
    "StepLR": lambda o: LRS.StepLR(o, step_size=4, gamma=0.5),
    "CosineAnnealingLR": lambda o: LRS.CosineAnnealingLR(o, T_max=12, eta_min=1e-4),
    "LambdaLR": lambda o: LRS.LambdaLR(o, lambda e: 1.0 / (1.0 + 0.1 * e)),
    "SequentialLR": lambda o: LRS.SequentialLR(
        o, [LRS.LinearLR(o, start_factor=0.5, total_iters=4), LRS.ExponentialLR(o, 0.9)], [5]
    ),
    "CosineAnnealingWarmRestarts": lambda o: LRS.CosineAnnealingWarmRestarts(o, T_0=4, T_mult=2),
    "ChainedScheduler": lambda o: LRS.ChainedScheduler(
        [LRS.ConstantLR(o, factor=0.5, total_iters=12), LRS.ExponentialLR(o, gamma=0.95)]
    ),
}


def _plain(kwargs: dict) -> bool:
    """A configuration of the default implementation with float hyperparameters."""
    return not any(kwargs.get(f) for f in IMPLS) and not any(
        isinstance(v, torch.Tensor) or (isinstance(v, tuple) and any(map(torch.is_tensor, v)))
        for v in kwargs.values()
    )


def _configs() -> list[tuple[str, str, dict]]:
    """Every plain configuration with EXHAUSTIVE; else each optimizer's one with the most
    hyperparameters set (its state is the largest: amsgrad, centered and momentum, ...)."""
    plain = [c for c in runs.CONFIGS if _plain(c[2])]
    if EXHAUSTIVE:
        return plain
    best: dict[str, tuple[str, str, dict]] = {}
    for c in plain:
        if c[0] not in best or len(c[2]) > len(best[c[0]][2]):
            best[c[0]] = c
    return list(best.values())


#: ASGD under a changing learning rate is not torch's (docs/differences.md: its step size reads
#: this step's learning rate, torch's the previous one's), moved or not: it runs without one.
CASES = [
    (name, desc, kwargs, None if name == "ASGD" else list(SCHEDULERS)[i % len(SCHEDULERS)],
     torch.bfloat16)
    for i, (name, desc, kwargs) in enumerate(_configs())
]  # fmt: skip
CASES.append(("Adam", "float16", {"lr": 0.01, "amsgrad": True}, "StepLR", torch.float16))
# the schedulers that cycle the momentum (SGD's momentum, Adam's beta1), as by default
SCHEDULERS["OneCycleLR"] = lambda o: LRS.OneCycleLR(o, max_lr=0.05, total_steps=STEPS + 1)
SCHEDULERS["CyclicLR"] = lambda o: LRS.CyclicLR(o, base_lr=1e-3, max_lr=0.05, step_size_up=4)
CASES += [
    ("SGD", "momentum", {"lr": 0.01, "momentum": 0.9}, "OneCycleLR", torch.bfloat16),
    ("Adam", "float16", {"lr": 0.01}, "OneCycleLR", torch.float16),
    ("SGD", "nesterov", {"lr": 0.01, "momentum": 0.9, "nesterov": True}, "CyclicLR",
     torch.bfloat16),
    ("AdamW", "betas", {"lr": 0.01}, "CyclicLR", torch.bfloat16),
]  # fmt: skip
IDS = [f"{n}-{d}-{s}-{'bf16' if t == torch.bfloat16 else 'fp16'}" for n, d, _, s, t in CASES]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


class Torch:
    """torch's objects for one run: model, optimizer, scheduler, GradScaler."""

    def __init__(self, name: str, kwargs: dict, sched: str, dtype: torch.dtype) -> None:
        torch.manual_seed(0)
        self.model = runs.Net(bias=name != "Muon")
        self.opt = getattr(torch.optim, name)(self.model.parameters(), **runs._kwargs(kwargs))
        self.sched = None if sched is None else SCHEDULERS[sched](self.opt)
        self.scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
        self.dtype = dtype

    def step(self, batch) -> None:
        x, y = batch
        self.opt.zero_grad()
        with torch.autocast("cpu", dtype=self.dtype):
            loss = nn.functional.mse_loss(self.model(x), y)
        self.scaler.scale(loss).backward()
        runs._step(self.opt, self.scaler, self.model)
        self.scaler.update()
        if self.sched is not None:
            with warnings.catch_warnings():  # a skipped first step: "scheduler.step() before"
                warnings.simplefilter("ignore", UserWarning)
                self.sched.step()

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def moved(self, policy):
        return funcamp.TrainState.from_torch(
            self.model, self.opt, policy, scheduler=self.sched, scaler=self.scaler,
            total_steps=STEPS,
        )  # fmt: skip


def _funcamp_step(opt, model, policy, donate=True):
    def loss_fn(params, buffers, batch):
        x, y = batch
        out = torch.func.functional_call(model, (params, buffers), (x,))
        return nn.functional.mse_loss(out, y)

    return funcamp.make_train_step(loss_fn, opt, policy, compile=False, donate_state=donate)


def _assert_params(got: dict, want: dict, where: str) -> None:
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{where}: param {k}"


def _assert_torch_state(got: Torch, want: Torch, where: str) -> None:
    """Optimizer state, loss scale and learning rates of two torch runs."""
    gp, wp = dict(got.model.named_parameters()), dict(want.model.named_parameters())
    for k in wp:
        a, b = got.opt.state[gp[k]], want.opt.state[wp[k]]
        assert list(a) == list(b), f"{where}: {k}'s state keys"
        for key in b:
            assert torch.equal(a[key], b[key]), f"{where}: {k}.{key}"
            assert a[key].dtype == b[key].dtype, f"{where}: {k}.{key} dtype"
    assert got.scaler.state_dict() == want.scaler.state_dict(), where
    if want.sched is not None:
        lrs = want.sched.get_last_lr()
        assert got.sched.get_last_lr() == pytest.approx(lrs, rel=1e-13), where
        assert _positions(got.sched) == _positions(want.sched), where


def _positions(s) -> list:
    """The scheduler's ``last_epoch`` and those of the schedulers it holds."""
    subs = getattr(s, "_schedulers", [])
    return [getattr(s, "last_epoch", None), *(x for sub in subs for x in _positions(sub))]


def _assert_funcamp_state(got, want, where: str) -> None:
    assert_trees_equal(got.opt_state, want.opt_state)
    # GradScaler keeps no count of skipped steps: the moved state's starts at 0
    assert got.scaler.to_grad_scaler_state_dict() == want.scaler.to_grad_scaler_state_dict(), where
    assert_trees_equal(got.params, want.params)


@pytest.mark.parametrize(("name", "desc", "kwargs", "sched", "dtype"), CASES, ids=IDS)
def test_run_moves_torch_funcamp_torch(name, desc, kwargs, sched, dtype):
    policy = funcamp.get_policy(runs.POLICIES[dtype])
    batches = runs._batches(dtype)
    ref = Torch(name, kwargs, sched, dtype)
    want = []
    for i, batch in enumerate(batches):
        ref.step(batch)
        want.append(ref.params())
        if i == MOVE - 1:
            at_move = copy.deepcopy(ref)
    run = Torch(name, kwargs, sched, dtype)
    for batch in batches[:MOVE]:
        run.step(batch)
    state, opt = run.moved(policy)
    step = _funcamp_step(opt, run.model, policy)
    for i in range(MOVE, 2 * MOVE):
        state, _ = step(state, batches[i])
        _assert_params(state.params, want[i], f"{name} {desc}: funcamp step {i}")
    state.to_torch(run.model, run.opt, scheduler=run.sched, scaler=run.scaler)
    for i in range(2 * MOVE, STEPS):
        run.step(batches[i])
        _assert_params(run.params(), want[i], f"{name} {desc}: torch step {i}")
    _assert_torch_state(run, ref, f"{name} {desc}: after {STEPS} steps")
    # the state taken at the move is torch's there: to_torch gives it back as it was
    state, _ = at_move.moved(policy)
    back = Torch(name, kwargs, sched, dtype)
    state.to_torch(back.model, back.opt, scheduler=back.sched, scaler=back.scaler)
    _assert_params(back.params(), want[MOVE - 1], f"{name} {desc}: to_torch")


@pytest.mark.parametrize(("name", "desc", "kwargs", "sched", "dtype"), CASES, ids=IDS)
def test_run_moves_funcamp_torch_funcamp(name, desc, kwargs, sched, dtype):
    policy = funcamp.get_policy(runs.POLICIES[dtype])
    batches = runs._batches(dtype)
    fresh = Torch(name, kwargs, sched, dtype)  # funcamp's own run, from the same objects
    named = dict(fresh.model.named_parameters())
    opt = funcamp.optim.from_torch(fresh.opt, named, fresh.sched, total_steps=STEPS)
    params, buffers = funcamp.params_and_buffers(fresh.model)
    ref = funcamp.TrainState.create(params, opt, policy, buffers=buffers)
    step = _funcamp_step(opt, fresh.model, policy, donate=False)
    want, states = [], []
    for batch in batches:
        ref, _ = step(ref, batch)
        want.append({k: v.clone() for k, v in ref.params.items()})
        states.append(ref)
    run = Torch(name, kwargs, sched, dtype)
    state, opt = run.moved(policy)
    step = _funcamp_step(opt, run.model, policy)
    for i in range(MOVE):
        state, _ = step(state, batches[i])
        _assert_params(state.params, want[i], f"{name} {desc}: funcamp step {i}")
    state.to_torch(run.model, run.opt, scheduler=run.sched, scaler=run.scaler)
    for i in range(MOVE, 2 * MOVE):
        run.step(batches[i])
        _assert_params(run.params(), want[i], f"{name} {desc}: torch step {i}")
    state, opt = run.moved(policy)
    _assert_funcamp_state(state, states[2 * MOVE - 1], f"{name} {desc}: from_torch")
    step = _funcamp_step(opt, run.model, policy)
    for i in range(2 * MOVE, STEPS):
        state, _ = step(state, batches[i])
        _assert_params(state.params, want[i], f"{name} {desc}: funcamp step {i}")
    _assert_funcamp_state(state, ref, f"{name} {desc}: after {STEPS} steps")


# ------------------------------------------------------------------- groups, plateau, refusals


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over two param groups; ``fc1`` is in neither (frozen)."""
    return torch.optim.AdamW(
        [
            {"params": [model.fc2.weight, model.fc3.weight], "weight_decay": 0.1},
            {"params": [model.fc2.bias, model.fc3.bias], "weight_decay": 0.0, "lr": 0.02},
        ],
        lr=0.01,
    )


def _grads_step(model, opt, batch) -> None:
    x, y = batch
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_param_groups_and_frozen_params_move():
    """Two groups (a multi_transform of two states, each with its count) and a param in no
    group (frozen): 5 torch steps, 5 funcamp steps, 5 torch steps equal 15 torch steps."""
    batches = runs._batches(torch.float32)[:15]
    torch.manual_seed(0)
    ref = runs.Net()
    model = copy.deepcopy(ref)
    ref_opt, opt = _two_groups(ref), _two_groups(model)
    for batch in batches:
        _grads_step(ref, ref_opt, batch)
    for batch in batches[:5]:
        _grads_step(model, opt, batch)
    state, fopt = funcamp.TrainState.from_torch(model, opt, "float32")
    assert sorted(state.frozen) == ["fc1.bias", "fc1.weight"]
    assert [int(s.count) for s in state.opt_state.inner.values()] == [5, 5]
    step = _funcamp_step(fopt, model, "float32")
    for batch in batches[5:10]:
        state, _ = step(state, batch)
    state.to_torch(model, opt)
    for batch in batches[10:]:
        _grads_step(model, opt, batch)
    _assert_params(dict(model.named_parameters()), dict(ref.named_parameters()), "groups")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert list(opt.state[p]) == list(ref_opt.state[q])
        for key, value in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


def test_reduce_on_plateau_moves():
    """ReduceLROnPlateau's best metric, bad epochs and cooldown go both ways, and the reduced
    learning rate with them."""
    torch.manual_seed(0)
    model = runs.Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plateau = LRS.ReduceLROnPlateau(opt, factor=0.5, patience=1, cooldown=2)
    for metric in (1.0, 2.0, 2.0, 0.5, 3.0):
        _grads_step(model, opt, runs._batches(torch.float32)[0])
        plateau.step(metric)
    state, fopt = funcamp.TrainState.from_torch(model, opt, "float32", scheduler=plateau)
    assert float(funcamp.optim.learning_rate(fopt, state.opt_state)) == opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["lr"] == 0.05  # reduced once
    got = state.opt_state
    assert (float(got.best), int(got.num_bad), int(got.cooldown)) == (
        plateau.best, plateau.num_bad_epochs, plateau.cooldown_counter
    )  # fmt: skip
    state = state._replace(opt_state=funcamp.optim.plateau_step(fopt, state.opt_state, 3.0))
    fresh = runs.Net()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh_plateau = LRS.ReduceLROnPlateau(fresh_opt, factor=0.5, patience=1, cooldown=2)
    state.to_torch(fresh, fresh_opt, scheduler=fresh_plateau)
    plateau.step(3.0)
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for key in ("best", "num_bad_epochs", "cooldown_counter"):
        assert getattr(fresh_plateau, key) == getattr(plateau, key), key


def _stepped_adam(lr: float = 0.01):
    torch.manual_seed(0)
    model = runs.Net()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    _grads_step(model, opt, runs._batches(torch.float32)[0])
    return model, opt


def test_refusals_name_the_cause():
    model, opt = _stepped_adam()
    opt.state[model.fc1.weight]["step"] += 1
    with pytest.raises(ValueError, match=r"different numbers of steps \('fc1.weight': 2, "):
        funcamp.TrainState.from_torch(model, opt, "float32")
    model, opt = _stepped_adam()
    del opt.state[model.fc2.bias]
    with pytest.raises(ValueError, match=r"holds state for 'fc1.weight' but none for 'fc2.bias'"):
        funcamp.TrainState.from_torch(model, opt, "float32")
    model, opt = _stepped_adam()
    opt.state[model.fc1.bias]["max_exp_avg_sq"] = torch.zeros(8)
    with pytest.raises(ValueError, match=r"'max_exp_avg_sq'.*hyperparameters do not use"):
        funcamp.TrainState.from_torch(model, opt, "float32")
    model, opt = _stepped_adam()
    opt.state[model.fc1.bias]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"state\['exp_avg'\] for 'fc1.bias' must be a tensor"):
        funcamp.TrainState.from_torch(model, opt, "float32")
    torch.manual_seed(0)
    model = runs.Net()
    opt = torch.optim.NAdam(model.parameters())
    _grads_step(model, opt, runs._batches(torch.float32)[0])
    opt.state[model.fc3.bias]["mu_product"] *= 2
    with pytest.raises(ValueError, match=r"state\['mu_product'\] differs between the params"):
        funcamp.TrainState.from_torch(model, opt, "float32")
    model, opt = _stepped_adam()
    sched = LRS.StepLR(opt, step_size=2)  # built after the step: behind the optimizer
    with pytest.raises(ValueError, match="scheduler` has stepped 0 times but `optimizer`"):
        funcamp.TrainState.from_torch(model, opt, "float32", scheduler=sched)
    model, opt = _stepped_adam()
    with pytest.raises(ValueError, match="must be an lr_scheduler of `optimizer`"):
        funcamp.TrainState.from_torch(
            model, opt, "float32", scheduler=LRS.StepLR(_stepped_adam()[1], 2)
        )
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="LBFGS's state has no funcamp translation"):
        funcamp.TrainState.from_torch(model, lbfgs, "float32")
    with pytest.raises(ValueError, match=r"group 0's param 0 .* is not a parameter of `module`"):
        funcamp.TrainState.from_torch(runs.Net(), opt, "float32")
    with pytest.raises(TypeError, match=r"`scaler` must be a torch.amp.GradScaler"):
        funcamp.TrainState.from_torch(model, opt, "float32", scaler=funcamp.ScalerState.noop())


def test_to_torch_refuses_what_does_not_fit():
    model, opt = _stepped_adam()
    state, fopt = funcamp.TrainState.from_torch(model, opt, "float32")
    with pytest.raises(ValueError, match="noop' one, but `scaler` is an enabled GradScaler"):
        state.to_torch(model, opt, scaler=torch.amp.GradScaler("cpu"))
    other = nn.Linear(6, 3)
    with pytest.raises(ValueError, match="is not a parameter of `module`"):
        state.to_torch(other, opt)
    two = torch.optim.Adam([{"params": [p]} for p in model.parameters()])
    with pytest.raises(ValueError, match="must have the param groups the state was built for"):
        state.to_torch(model, two)
    grouped, _ = funcamp.TrainState.from_torch(model, _two_groups(model), "float32")
    swapped = _two_groups(model)
    swapped.param_groups.reverse()
    with pytest.raises(ValueError, match="param group 0 must hold the params of the state's"):
        grouped.to_torch(model, swapped)
    with pytest.raises(ValueError, match="disabled GradScaler, but the state's scaler is a 'dyn"):
        funcamp.TrainState.from_torch(model, opt, "mixed_float16")[0].to_torch(
            model, opt, scaler=torch.amp.GradScaler("cpu", enabled=False)
        )
    assert not swapped.state  # nothing was written
    _funcamp_step(fopt, model, "float32")(state, runs._batches(torch.float32)[0])  # donated
    with pytest.raises(ValueError, match="donated"):
        state.to_torch(model, opt)


def test_lion_pytorch_state_moves():
    """lion-pytorch's Lion keeps ``exp_avg`` and no step: it moves both ways (the count is the
    scheduler's position)."""
    from test_from_torch import Lion

    torch.manual_seed(0)
    model = runs.Net()
    opt = Lion(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = LRS.StepLR(opt, step_size=2, gamma=0.5)
    for batch in runs._batches(torch.float32)[:3]:
        _grads_step(model, opt, batch)
        sched.step()
    state, fopt = funcamp.TrainState.from_torch(model, opt, "float32", scheduler=sched)
    assert int(state.opt_state.count) == 3
    assert float(funcamp.optim.learning_rate(fopt, state.opt_state)) == sched.get_last_lr()[0]
    for k, p in model.named_parameters():
        assert torch.equal(state.opt_state.exp_avg[k], opt.state[p]["exp_avg"]), k
    fresh = runs.Net()
    fresh_opt = Lion(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    fresh_sched = LRS.StepLR(fresh_opt, step_size=2, gamma=0.5)
    state.to_torch(fresh, fresh_opt, scheduler=fresh_sched)
    assert fresh_sched.last_epoch == 3 and fresh_sched.get_last_lr() == sched.get_last_lr()
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(p, q) and torch.equal(
            fresh_opt.state[p]["exp_avg"], opt.state[q]["exp_avg"]
        )
