"""A condition of the user's own skips a step: ``make_train_step(..., skip_if=...)``.

Large runs skip a step whose gradient norm spikes. With ``torch.amp.GradScaler`` that is a host
read of the norm after ``unscale_``, then ``step`` or not, then ``update`` either way:

    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    if get_total_norm(grads) <= BOUND:   # a host sync
        scaler.step(opt)
    scaler.update()

funcamp's step asks ``skip_if`` for a 0-d bool tensor and skips through the scaling layer's
``Skip``, as on an overflow: params, optimizer state and count (AdamW's bias correction reads it)
come back as they were, bit for bit torch's loop above over 30 steps; the scaler sees only
overflows, so its scale and growth tracker are torch's too. No host read on the device path.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from test_host_sync import _SKIP_FLAG, no_host_reads

import funcamp
from funcamp.scaling.skip import device_path

STEPS = 30
SPIKES = (4, 11, 12, 23)  # batches scaled up: their gradient norm passes BOUND
INF_STEP = 17  # an overflow too: the scaler skips it and backs off
BOUND = 5.0
LR = 1e-2
POLICY = "params=float32,compute=float16,output=float32,ops=autocast_cpu"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        if i in SPIKES:
            y = y * 15.0
        if i == INF_STEP:
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


def spike(metrics: dict[str, torch.Tensor]) -> torch.Tensor:
    return metrics["grad_norm"] > BOUND


class Trace:
    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []
        self.state: list[dict[str, torch.Tensor]] = []
        self.scaler: list[tuple[float, int]] = []
        self.skipped_by_user: list[bool] = []
        self.overflowed: list[bool] = []


def torch_run(model: nn.Module, steps: int = STEPS) -> Trace:
    """torch's loop, skipping by hand: a host read of the norm after ``unscale_``."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    out = Trace()
    for x, y in _batches(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        overflow = not bool(norm.isfinite())
        user = bool(norm > BOUND)
        if not user:
            scaler.step(opt)
        scaler.update()
        out.params.append({k: p.detach().clone() for k, p in model.named_parameters()})
        out.state.append(
            {
                f"{k}.{key}": v.clone()
                for k, p in model.named_parameters()
                for key, v in opt.state[p].items()
            }
        )
        out.scaler.append((scaler.get_scale(), int(scaler._growth_tracker)))
        out.skipped_by_user.append(user and not overflow)
        out.overflowed.append(overflow)
    return out


def _state_of(state: funcamp.TrainState) -> dict[str, torch.Tensor]:
    opt = state.opt_state
    out = {}
    for k in state.params:
        out[f"{k}.step"] = opt.count.float()  # torch keeps one float32 step per param
        out[f"{k}.exp_avg"] = opt.exp_avg[k]
        out[f"{k}.exp_avg_sq"] = opt.exp_avg_sq[k]
    return out


def funcamp_run(model: nn.Module, compile, donate: bool, steps: int = STEPS) -> Trace:
    model = copy.deepcopy(model)
    opt = funcamp.adamw(LR, fused=True)
    params, buffers = funcamp.params_and_buffers(model)

    def loss_fn(params, buffers, batch):
        x, y = batch
        out = torch.func.functional_call(model, (params, buffers), (x,))
        return nn.functional.mse_loss(out, y)

    scaler = funcamp.ScalerState.dynamic(2.0**10, growth_interval=4)
    state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers, scaler=scaler)
    step = funcamp.make_train_step(
        loss_fn, opt, POLICY, skip_if=spike, compile=compile, donate_state=donate
    )
    out = Trace()
    for batch in _batches(steps):
        state, metrics = step(state, batch)
        out.params.append({k: v.clone() for k, v in state.params.items()})
        out.state.append({k: v.clone() for k, v in _state_of(state).items()})
        out.scaler.append((float(state.scaler.scale), int(state.scaler.growth_tracker)))
        found = bool(metrics["found_inf"])
        out.skipped_by_user.append(bool(metrics["user_skip"]) and not found)
        out.overflowed.append(found)
        assert int(metrics["skipped"]) == sum(out.overflowed)  # the scaler counts overflows
    return out


def check(got: Trace, want: Trace) -> None:
    assert got.overflowed == want.overflowed
    assert got.skipped_by_user == want.skipped_by_user
    assert sum(want.skipped_by_user) >= 3 and sum(want.overflowed) >= 1
    assert got.scaler == want.scaler
    for i, (a, b) in enumerate(zip(got.params, want.params)):
        for k in b:
            assert torch.equal(a[k], b[k]), f"step {i}: param {k}"
    for i, (a, b) in enumerate(zip(got.state, want.state)):
        for k in b:
            assert torch.equal(a[k].to(b[k].dtype), b[k]), f"step {i}: state {k}"


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


@pytest.fixture(scope="module")
def want(model) -> Trace:
    return torch_run(model)


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("donate", [True, False])
def test_eager_run_equals_torch_skipping_by_hand(model, want, donate, path):
    where = device_path() if path == "device" else contextlib.nullcontext()
    with where:
        check(funcamp_run(model, False, donate), want)


@pytest.mark.parametrize("donate", [True, False])
def test_compiled_run_equals_torch_skipping_by_hand(model, want, donate):
    check(funcamp_run(model, funcamp.Compile(backend="aot_eager"), donate), want)


def test_a_user_skip_leaves_the_scaler_alone(model):
    """The scale, its growth tracker and ``skipped`` move as though the step had applied:
    the scaler's trajectory is the scaler's own."""
    spiked = funcamp_run(model, False, True, steps=SPIKES[0] + 1)
    assert spiked.skipped_by_user[-1]
    scaler = funcamp.ScalerState.dynamic(2.0**10, growth_interval=4)
    for _ in range(SPIKES[0] + 1):
        scaler = funcamp.update(scaler, torch.tensor(False))
    assert spiked.scaler[-1] == (float(scaler.scale), int(scaler.growth_tracker))
    assert spiked.scaler[-1][0] > 2.0**10  # it grew on a spike step: no back-off


@pytest.mark.parametrize("path", ["cpu", "device"])
def test_no_host_read_but_the_skip_flag(model, path):
    where = device_path() if path == "device" else contextlib.nullcontext()
    params, buffers = funcamp.params_and_buffers(copy.deepcopy(model))
    opt = funcamp.adamw(LR)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    scaler = funcamp.ScalerState.dynamic(2.0**10)
    state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers, scaler=scaler)
    step = funcamp.make_train_step(loss_fn, opt, POLICY, skip_if=spike, compile=False)
    batches = _batches(SPIKES[0] + 1)[-2:]
    flags = []
    with where, no_host_reads() as seen:
        for b in batches:
            state, metrics = step(state, b)
            flags.append(metrics["user_skip"])
    assert seen == ([] if path == "device" else [_SKIP_FLAG] * 2)
    assert [bool(f) for f in flags] == [False, True]
    assert not bool(metrics["found_inf"])


def test_bad_arguments_are_refused_by_name():
    opt = funcamp.sgd(0.1)

    def loss_fn(params, buffers, batch):
        return (params["w"] * batch).sum()

    with pytest.raises(TypeError, match=r"make_train_step: `skip_if` must be callable or None"):
        funcamp.make_train_step(loss_fn, opt, "float32", skip_if=5.0)
    with pytest.raises(ValueError, match=r"`skip_if` .* grad_norm=False .* drop one"):
        funcamp.make_train_step(loss_fn, opt, "float32", skip_if=spike, grad_norm=False)
    state = funcamp.TrainState.create({"w": torch.ones(2)}, opt, "float32")
    for bad in (lambda m: True, lambda m: m["grad_norm"], lambda m: (m["loss"] > 0).reshape(1)):
        step = funcamp.make_train_step(loss_fn, opt, "float32", skip_if=bad, compile=False)
        with pytest.raises(TypeError, match=r"make_train_step: `skip_if` must return a 0-d bool"):
            step(state, torch.ones(2))
    assert torch.equal(state.params["w"], torch.ones(2))  # refused before any write


def test_unscale_and_step_takes_the_condition_too():
    """The scaling layer's own entry: ``skip_if`` of the norm, ``info.user_skip``; the count
    stays."""
    opt = funcamp.adamw(0.1)
    params = {"w": torch.ones(3)}
    opt_state = opt.init(params)
    scaler = funcamp.ScalerState.dynamic(4.0)
    big = {"w": torch.full((3,), 400.0)}
    new, new_state, info = funcamp.unscale_and_step(
        scaler, opt, big, opt_state, params, skip_if=lambda n: n > 10.0
    )
    assert bool(info.user_skip) and not bool(info.found_inf)
    assert torch.equal(new["w"], params["w"]) and int(new_state.count) == 0
    with pytest.raises(TypeError, match=r"unscale_and_step: `skip_if` must be callable"):
        funcamp.unscale_and_step(scaler, opt, big, opt_state, params, skip_if="norm > 10")


# -- under funcamp.accumulate: the condition decides the window, on the accumulated gradient --


def accumulated_torch_run(steps: int, bound: float):
    """torch.amp's accumulation recipe, skipping a window by hand on its gradient's norm."""
    from test_accumulate_scaler import GROWTH_INTERVAL, INIT_SCALE, K, _loss, init_params
    from test_accumulate_scaler import micro_batch as batch

    w = init_params()["w"].requires_grad_()
    opt = torch.optim.AdamW([w], lr=LR, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    out = []
    for i in range(steps * K):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(w, *batch(i)) / K
        scaler.scale(loss).backward()
        if (i + 1) % K:
            continue
        scale = scaler.get_scale()
        scaler.unscale_(opt)
        norm = torch.nn.utils.get_total_norm([w.grad], foreach=True)
        user = bool(norm > bound)
        if not user:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        step = opt.state[w].get("step", torch.tensor(0.0))
        out.append((scale, user and bool(norm.isfinite()), w.detach().clone(), step.clone()))
    return out


def accumulated_funcamp_run(steps: int, bound: float, compile):
    from test_accumulate_scaler import GROWTH_INTERVAL, INIT_SCALE, K, init_params, loss_fn
    from test_accumulate_scaler import micro_batch as batch

    opt = funcamp.accumulate(funcamp.adamw(LR, fused=True), every=K)
    scaler = funcamp.ScalerState.dynamic(INIT_SCALE / K, growth_interval=GROWTH_INTERVAL)
    state = funcamp.TrainState.create(init_params(), opt, "mixed_float16", scaler=scaler)
    step = funcamp.make_train_step(
        loss_fn,
        opt,
        "mixed_float16",
        skip_if=lambda m: m["grad_norm"] > bound,
        compile=compile,
    )
    out = []
    for i in range(steps * K):
        scale = float(state.scaler.scale) * K
        state, metrics = step(state, batch(i))
        if (i + 1) % K:
            assert not bool(metrics["user_skip"])  # only the update that closes a window
            continue
        user = bool(metrics["user_skip"]) and not bool(metrics["found_inf"])
        count = state.opt_state.inner.count
        out.append((scale, user, state.params["w"].clone(), count.float()))
    return out


@pytest.mark.parametrize("compile", [False, funcamp.Compile(backend="aot_eager")])
def test_an_accumulated_window_is_skipped_on_its_gradient_norm(compile):
    """The window's update, its count and the scaler, against torch's recipe with the skip
    by hand: a skipped window starts afresh, as an overflowed one does."""
    steps, bound = 14, 15.0
    want = accumulated_torch_run(steps, bound)
    got = accumulated_funcamp_run(steps, bound, compile)
    assert sum(user for _, user, _, _ in want) >= 2
    for i, (a, b) in enumerate(zip(got, want)):
        assert a[0] == b[0] and a[1] == b[1], f"window {i}: scale, user skip"
        assert torch.equal(a[2], b[2]), f"window {i}: params"
        assert torch.equal(a[3], b[3]), f"window {i}: count"
