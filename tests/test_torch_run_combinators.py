"""The combinators users port, over a whole run side by side with torch's own loop.

Each case is a torch training loop as its docs write it -- ``clip_grad_norm_`` before the step,
param groups, an ``lr_scheduler``, gradient accumulation over micro-batches -- under
``torch.autocast("cpu", bfloat16)`` (and float16 with a ``GradScaler``), and its funcamp port:
``chain(clip_by_global_norm(c), opt)``, ``multi_transform``/``masked``/``adamw(mask=)``, a
schedule from ``funcamp.optim.from_torch``, ``accumulate(opt, k, average=False)``, run by the
eager ``make_train_step``. After every optimizer step the params, the optimizer state and the
loss scale must be bit-identical (``torch.equal``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import funcamp

STEPS = 30
POLICIES = {
    torch.bfloat16: "params=float32,compute=bfloat16,output=float32,ops=autocast_cpu",
    torch.float16: "params=float32,compute=float16,output=float32,ops=autocast_cpu",
}
LRS = torch.optim.lr_scheduler


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _batch(i: int, dtype: torch.dtype, inf_at: int | None = None):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    if dtype == torch.float16 and i == inf_at:
        x[0, 0] = float("inf")
    return x, y


def _loss_fn(model):
    def loss_fn(params, buffers, batch):
        x, y = batch
        out = torch.func.functional_call(model, (params, buffers), (x,))
        return nn.functional.mse_loss(out, y)

    return loss_fn


def _compare(model, ours, state, torch_opt, scaler, where):
    for k, p in model.named_parameters():
        assert torch.equal(state.params[k], p.detach()), f"{where}: param {k}"
    if scaler is not None and scaler.is_enabled():
        assert torch.equal(state.scaler.scale, scaler._scale), f"{where}: scale"


def _run(make_torch, make_funcamp, dtype=torch.bfloat16, *, clip=None, every=1, inf_at=None):
    """torch's loop and funcamp's, side by side: ``make_torch(model) -> (optimizer,
    scheduler)``; ``make_funcamp(model, torch_optimizer, torch_scheduler) -> optimizer``
    (built before torch's loop steps)."""
    torch.manual_seed(0)
    model = Net()
    ours = copy.deepcopy(model)
    torch_opt, sched = make_torch(model)
    twin_opt, twin_sched = make_torch(ours)
    opt = make_funcamp(ours, twin_opt, twin_sched)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    policy = funcamp.get_policy(POLICIES[dtype])
    params, buffers = funcamp.params_and_buffers(ours)
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers)
    step = funcamp.make_train_step(_loss_fn(ours), opt, policy, compile=False)
    for i in range(STEPS * every):
        x, y = _batch(i, dtype, inf_at)
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x), y) / every
        scaler.scale(loss).backward()
        state, _ = step(state, (x, y))
        if (i + 1) % every:
            continue
        if clip is not None:
            scaler.unscale_(torch_opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(torch_opt)
        scaler.update()
        torch_opt.zero_grad()
        if sched is not None:
            sched.step()
        _compare(model, ours, state, torch_opt, scaler, f"step {i}")


# ------------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_clip_grad_norm_then_step(name, dtype):
    """word_language_model's loop: ``clip_grad_norm_(0.25)`` then SGD at lr 20 (and AdamW)."""
    kw = {"SGD": {"lr": 20.0}, "AdamW": {"lr": 1e-2}}[name]

    def make_torch(model):
        return getattr(torch.optim, name)(model.parameters(), **kw), None

    def make_funcamp(model, opt, sched):
        inner = funcamp.optim.from_torch(opt, dict(model.named_parameters()))
        return funcamp.chain(funcamp.clip_by_global_norm(0.25), inner)

    _run(make_torch, make_funcamp, dtype, clip=0.25, inf_at=5)


# ---------------------------------------------------------------------------- param groups


def _groups(model, wd):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


@pytest.mark.parametrize("port", ["from_torch", "mask", "multi_transform"])
def test_two_param_groups(port):
    """AdamW with decay on the weights only: from_torch's multi_transform, ``adamw(mask=)``
    and a hand-written ``multi_transform``."""

    def make_torch(model):
        return torch.optim.AdamW(_groups(model, 0.1), lr=1e-2), None

    def make_funcamp(model, opt, sched):
        if port == "from_torch":
            return funcamp.optim.from_torch(opt, dict(model.named_parameters()))
        if port == "mask":
            return funcamp.adamw(1e-2, weight_decay=0.1, mask=lambda path: path.endswith("weight"))
        return funcamp.multi_transform(
            {
                "decay": funcamp.adamw(1e-2, weight_decay=0.1),
                "rest": funcamp.adamw(1e-2, weight_decay=0.0),
            },
            lambda path: "decay" if path.endswith("weight") else "rest",
        )

    _run(make_torch, make_funcamp)


def test_masked_is_a_param_group_over_some_params():
    """``masked(opt, mask)``: torch's optimizer over the masked params only (the others keep
    no state and do not move)."""

    def make_torch(model):
        return torch.optim.SGD(model.fc1.parameters(), lr=0.1, momentum=0.9), None

    def make_funcamp(model, opt, sched):
        return funcamp.masked(funcamp.sgd(0.1, momentum=0.9), lambda p: p.startswith("fc1"))

    _run(make_torch, make_funcamp)


# ------------------------------------------------------------------------------ schedules

SCHEDULES = {
    "StepLR": lambda o: LRS.StepLR(o, step_size=4, gamma=0.5),
    "MultiStepLR": lambda o: LRS.MultiStepLR(o, milestones=[3, 9], gamma=0.3),
    "ExponentialLR": lambda o: LRS.ExponentialLR(o, gamma=0.93),
    "CosineAnnealingLR": lambda o: LRS.CosineAnnealingLR(o, T_max=11, eta_min=1e-4),
    "CosineAnnealingWarmRestarts": lambda o: LRS.CosineAnnealingWarmRestarts(o, T_0=5, T_mult=2),
    "LinearLR": lambda o: LRS.LinearLR(o, start_factor=0.1, total_iters=10),
    "ConstantLR": lambda o: LRS.ConstantLR(o, factor=0.3, total_iters=4),
    "PolynomialLR": lambda o: LRS.PolynomialLR(o, total_iters=20, power=1.7),
    "LambdaLR": lambda o: LRS.LambdaLR(o, lambda t: 0.97**t),
    "OneCycleLR": lambda o: LRS.OneCycleLR(o, max_lr=0.05, total_steps=STEPS + 1),
    "CyclicLR": lambda o: LRS.CyclicLR(o, base_lr=1e-3, max_lr=0.05, step_size_up=5),
}


@pytest.mark.parametrize("opt_name", ["SGD", "Adam", "AdamW"])
@pytest.mark.parametrize("sched_name", sorted(SCHEDULES))
def test_scheduler(sched_name, opt_name):
    """Every step-indexed scheduler, on SGD with momentum, Adam and AdamW, through
    ``from_torch(..., total_steps=)``; OneCycleLR and CyclicLR cycle the momentum (SGD's
    momentum, Adam's and AdamW's beta1), as they do by default."""
    kw = {"SGD": {"lr": 0.05, "momentum": 0.9}, "Adam": {"lr": 0.01}, "AdamW": {"lr": 0.01}}
    kw = kw[opt_name]

    def make_torch(model):
        opt = getattr(torch.optim, opt_name)(model.parameters(), **kw)
        return opt, SCHEDULES[sched_name](opt)

    def make_funcamp(model, opt, sched):
        names = dict(model.named_parameters())
        return funcamp.optim.from_torch(opt, names, sched, total_steps=STEPS)

    _run(make_torch, make_funcamp)


# --------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gradient_accumulation(dtype):
    """torch's accumulation loop: each micro-batch's loss divided by ``k``, ``backward`` adds
    into ``.grad``, one (scaled) step every ``k`` micro-batches; funcamp's ``accumulate(opt, k,
    average=False)`` sums the gradients of the same divided loss. An inf in one micro-batch
    skips its window."""
    every = 3

    def make_torch(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2), None

    def make_funcamp(model, opt, sched):
        inner = funcamp.optim.from_torch(opt, dict(model.named_parameters()))
        return funcamp.accumulate(inner, every, average=False)

    torch.manual_seed(0)
    model = Net()
    ours = copy.deepcopy(model)
    torch_opt, _ = make_torch(model)
    opt = make_funcamp(ours, make_torch(ours)[0], None)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    policy = funcamp.get_policy(POLICIES[dtype])
    params, buffers = funcamp.params_and_buffers(ours)
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers)

    def loss_fn(params, buffers, batch):
        return _loss_fn(ours)(params, buffers, batch) / every

    step = funcamp.make_train_step(loss_fn, opt, policy, compile=False)
    for i in range(STEPS * every):
        x, y = _batch(i, dtype, inf_at=7)
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x), y) / every
        scaler.scale(loss).backward()
        state, _ = step(state, (x, y))
        if (i + 1) % every == 0:
            scaler.step(torch_opt)
            scaler.update()
            torch_opt.zero_grad()
            _compare(model, ours, state, torch_opt, scaler, f"micro-step {i}")


# ---------------------------------------------------------------- scheduled hyperparameters


def _wave(lo: float, hi: float, period: int = 7, zero_at: int | None = None) -> list[float]:
    """A value per step moving between ``lo`` and ``hi`` (Python floats, as a scheduler writes
    them into a param group); 0 at the steps ``zero_at`` divides (torch skips a 0 term)."""
    out = [lo + (hi - lo) * (0.5 + 0.5 * math.sin(2 * math.pi * i / period)) for i in range(STEPS)]
    return [0.0 if zero_at and i % zero_at == zero_at - 1 else v for i, v in enumerate(out)]


class _GroupWriter:
    """Writes each step's hyperparameters into torch's param groups, as an lr_scheduler does
    (``"betas.0"``: the first entry of a tuple)."""

    def __init__(self, opt: torch.optim.Optimizer, values: dict[str, list[float]]) -> None:
        self.opt, self.values, self.n = opt, values, 0
        self._write()

    def _write(self) -> None:
        for group in self.opt.param_groups:
            for key, vs in self.values.items():
                name, _, index = key.partition(".")
                if index:
                    entries = list(group[name])
                    entries[int(index)] = vs[self.n]
                    group[name] = tuple(entries)
                else:
                    group[name] = vs[self.n]

    def step(self) -> None:
        self.n += 1
        if self.n < STEPS:
            self._write()


def _table(values: list[float]):
    """The schedule of ``values``, one a count (``index_select``: it compiles)."""
    table = torch.tensor(values, dtype=torch.float64)
    return lambda count: torch.index_select(table, 0, count.long().reshape(1)).reshape(())


#: torch optimizer, its arguments, the funcamp optimizer, {torch group key: (funcamp argument,
#: values per step)}; the funcamp optimizer gets each as a schedule of the same values.
HYPER_CASES = {
    "SGD": (
        "SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
        lambda lr, **kw: funcamp.sgd(lr, **kw),
        {"momentum": ("momentum", _wave(0.5, 0.95, zero_at=9)),
         "dampening": ("dampening", _wave(0.0, 0.3, 5)),
         "weight_decay": ("weight_decay", _wave(0.0, 0.05, 4, zero_at=6))},
    ),
    "SGD-nesterov": (
        "SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True},
        lambda lr, **kw: funcamp.sgd(lr, nesterov=True, **kw),
        {"momentum": ("momentum", _wave(0.8, 0.95, zero_at=11))},
    ),
    "Adam": (
        "Adam", {"lr": 0.01, "weight_decay": 0.01},
        lambda lr, **kw: funcamp.adam(lr, **kw),
        {"betas.0": ("b1", _wave(0.85, 0.95)), "betas.1": ("b2", _wave(0.99, 0.999, 5)),
         "eps": ("eps", _wave(1e-8, 1e-6, 3)), "weight_decay": ("weight_decay", _wave(0, 0.1))},
    ),
    "AdamW": (
        "AdamW", {"lr": 0.01},
        lambda lr, **kw: funcamp.adamw(lr, **kw),
        {"betas.0": ("b1", _wave(0.85, 0.95)), "weight_decay": ("weight_decay", _wave(0, 0.1))},
    ),
    "RMSprop": (
        "RMSprop", {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.01},
        lambda lr, **kw: funcamp.rmsprop(lr, **kw),
        {"alpha": ("alpha", _wave(0.9, 0.99)), "momentum": ("momentum", _wave(0.3, 0.9, 5, 8)),
         "eps": ("eps", _wave(1e-8, 1e-6, 3)),
         "weight_decay": ("weight_decay", _wave(0.0, 0.05, 4, zero_at=6))},
    ),
    "RMSprop-centered": (
        "RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True},
        lambda lr, **kw: funcamp.rmsprop(lr, centered=True, **kw),
        {"alpha": ("alpha", _wave(0.9, 0.99)), "momentum": ("momentum", _wave(0.3, 0.9, 5))},
    ),
    "Adagrad": (
        "Adagrad", {"lr": 0.05, "weight_decay": 0.01},
        lambda lr, **kw: funcamp.adagrad(lr, **kw),
        {"lr_decay": ("lr_decay", _wave(0.0, 0.05)), "eps": ("eps", _wave(1e-10, 1e-6, 3)),
         "weight_decay": ("weight_decay", _wave(0.0, 0.05, 4, zero_at=6))},
    ),
    "Adadelta": (
        "Adadelta", {"lr": 0.5, "weight_decay": 0.01},
        lambda lr, **kw: funcamp.adadelta(lr, **kw),
        {"rho": ("rho", _wave(0.8, 0.95)), "eps": ("eps", _wave(1e-6, 1e-4, 3)),
         "weight_decay": ("weight_decay", _wave(0.0, 0.05, 4))},
    ),
    "Adamax": (
        "Adamax", {"lr": 0.01, "weight_decay": 0.01},
        lambda lr, **kw: funcamp.adamax(lr, **kw),
        {"betas.0": ("b1", _wave(0.85, 0.95)), "betas.1": ("b2", _wave(0.99, 0.999, 5)),
         "eps": ("eps", _wave(1e-8, 1e-6, 3)), "weight_decay": ("weight_decay", _wave(0, 0.1))},
    ),
    "Rprop": (
        "Rprop", {"lr": 0.01},
        lambda lr, **kw: funcamp.rprop(
            lr, etas=(kw["etaminus"], kw["etaplus"]), step_sizes=(kw["smin"], kw["smax"])
        ),
        {"etas.0": ("etaminus", _wave(0.3, 0.6)), "etas.1": ("etaplus", _wave(1.1, 1.3, 5)),
         "step_sizes.0": ("smin", _wave(1e-4, 1e-3, 4)),
         "step_sizes.1": ("smax", _wave(0.002, 0.02, 6))},
    ),
    "Muon": (
        "Muon", {"lr": 0.02},
        lambda lr, **kw: funcamp.muon(lr, **kw),
        {"momentum": ("momentum", _wave(0.85, 0.95)),
         "weight_decay": ("weight_decay", _wave(0.0, 0.1))},
    ),
}  # fmt: skip


def _compare_state(model, state, torch_opt, where):
    """torch's per-param state (by funcamp's table of state keys) equals funcamp's."""
    keys = funcamp.optim._torch_state.state_keys("test", torch_opt)
    opt_state = state.opt_state
    opt_state = getattr(opt_state, "inner", opt_state)  # masked
    names = {id(p): k for k, p in model.named_parameters()}
    for p, torch_state in torch_opt.state.items():
        for key, value in torch_state.items():
            if key == "step" or value is None:
                continue
            field = getattr(opt_state, keys.rename.get(key, key))
            assert torch.equal(field[names[id(p)]], value), f"{where}: {key} of {names[id(p)]}"


@pytest.mark.parametrize("case", sorted(HYPER_CASES))
def test_scheduled_momentum_betas_and_weight_decay(case):
    """Hyperparameters changed between steps in torch's param groups (as a scheduler does),
    and the same values as funcamp schedules: params and optimizer state equal torch's at
    every step (bf16 autocast)."""
    torch_name, kw, make, hyper = HYPER_CASES[case]
    values = {key: vs for key, (_, vs) in hyper.items()}
    weights_only = torch_name == "Muon"

    def make_torch(model):
        ps = [p for n, p in model.named_parameters() if n.endswith("weight") or not weights_only]
        opt = getattr(torch.optim, torch_name)(ps, **kw)
        return opt, _GroupWriter(opt, values)

    def make_funcamp(model, opt, sched):
        args = {name: _table(vs) for name, vs in hyper.values()}
        ours = make(kw["lr"], **args)
        return funcamp.masked(ours, lambda p: p.endswith("weight")) if weights_only else ours

    torch.manual_seed(0)
    model = Net()
    ours = copy.deepcopy(model)
    torch_opt, writer = make_torch(model)
    opt = make_funcamp(ours, None, None)
    policy = funcamp.get_policy(POLICIES[torch.bfloat16])
    params, buffers = funcamp.params_and_buffers(ours)
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers)
    step = funcamp.make_train_step(_loss_fn(ours), opt, policy, compile=False)
    for i in range(STEPS):
        x, y = _batch(i, torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        state, _ = step(state, (x, y))
        torch_opt.step()
        torch_opt.zero_grad()
        writer.step()
        _compare(model, ours, state, torch_opt, None, f"step {i}")
        _compare_state(model, state, torch_opt, f"step {i}")


def test_scheduled_hyperparameter_refusals_and_skips():
    """A schedule is probed when the optimizer is built (a clear error naming the argument);
    a value out of range at run time skips the step, as an unusable learning rate does."""
    with pytest.raises(TypeError, match=r"funcamp.sgd: `momentum` schedule must return a 0-d"):
        funcamp.sgd(0.1, momentum=lambda c: 0.9)
    with pytest.raises(ValueError, match=r"`b1` must be .* in \[0.0, 1.0\), got 1.5 from its"):
        funcamp.adam(0.1, b1=lambda c: torch.tensor(1.5))
    with pytest.raises(ValueError, match=r"`momentum` is a schedule, but torch's fused kernel"):
        funcamp.sgd(0.1, momentum=_table([0.9]), fused=True)
    values = [0.9, 0.9, float("nan"), 0.9] + [0.9] * STEPS
    torch.manual_seed(0)
    model = Net()
    opt = funcamp.sgd(0.05, momentum=_table(values))
    policy = funcamp.get_policy(POLICIES[torch.bfloat16])
    params, buffers = funcamp.params_and_buffers(model)
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers)
    step = funcamp.make_train_step(_loss_fn(model), opt, policy, compile=False)
    for i in range(4):
        before = {k: v.clone() for k, v in state.params.items()}  # the state is donated
        state, metrics = step(state, _batch(i, torch.bfloat16))
        skipped = i >= 2  # the count stays at 2: its value skips every step from there
        assert bool(metrics["found_inf"]) == skipped, i
        same = all(torch.equal(state.params[k], before[k]) for k in params)
        assert same == skipped, i
    assert int(state.opt_state.count) == 2  # a skipped step does not count
