"""A whole run side by side with torch: funcamp's eager train step against torch's own training
loop, step for step, for every CPU configuration of torch's optimizer database.

torch's loop is the one its docs teach: ``zero_grad``, a forward under ``torch.autocast``,
``backward``, ``optimizer.step()`` -- with a ``torch.amp.GradScaler`` for float16 (``scale``,
``step``, ``update``), where one step's batch holds an inf so that the scaler skips it. funcamp's
is ``make_train_step(..., compile=False)`` with the optimizer ``funcamp.optim.from_torch`` builds
from torch's and the policy whose casts are ``torch.autocast("cpu")``'s. After every step the
loss, the params and the optimizer state (torch's per-param state, its ``step`` included) must be
bit-identical (``torch.equal``), and so must the loss scale.

The configurations are torch's own (``optim_db``), with the implementation flags torch's tests
expand on CPU (``foreach``, ``differentiable``, ``fused``): each runs the implementation it names
in torch, and funcamp's optimizer is what ``from_torch`` gives for it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.testing._internal import common_optimizers

import funcamp
from funcamp.optim import REGISTRY

STEPS = 30
INF_STEP = 7  # float16 runs: this step's batch holds an inf (GradScaler skips it)
#: every registered optimizer whose twin is in torch.optim, by the twin's name, but L-BFGS (a
#: closure's loss)
TWINS = {
    e.torch.__name__: e
    for e in REGISTRY.values()
    if isinstance(e.torch, type) and e.torch.__module__.startswith("torch.optim") and not e.loss
}
NAMES = tuple(TWINS)
IMPLS = ("foreach", "differentiable", "fused")
POLICIES = {
    torch.bfloat16: "params=float32,compute=bfloat16,output=float32,ops=autocast_cpu",
    torch.float16: "params=float32,compute=float16,output=float32,ops=autocast_cpu",
}
#: funcamp's state field for torch's per-param state key, where the names differ; torch keys
#: funcamp computes from the count instead of keeping (ASGD's eta and mu) map to None.
FIELDS = {name: {**e.renamed, **dict.fromkeys(e.computed)} for name, e in TWINS.items()}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


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
            if "foreach" in info.supported_impls and not any(oi.kwargs.get(f) for f in IMPLS):
                out.append((name, f"{oi.desc} & foreach", {**oi.kwargs, "foreach": True}))
    return out


CONFIGS = _configs()
IDS = [f"{name}-{desc}" for name, desc, _ in CONFIGS]


class Net(nn.Module):
    """A small MLP; Muon takes matrices only, so its net has no biases."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8, bias=bias)
        self.fc2 = nn.Linear(8, 8, bias=bias)
        self.fc3 = nn.Linear(8, 3, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


def _batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(STEPS):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        if dtype == torch.float16 and i == INF_STEP:
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


def _kwargs(kwargs: dict) -> dict:
    kw = dict(kwargs)
    if isinstance(kw.get("lr"), torch.Tensor):
        kw["lr"] = kw["lr"].clone()
    for key in ("betas",):
        if key in kw:
            kw[key] = tuple(b.clone() if isinstance(b, torch.Tensor) else b for b in kw[key])
    return kw


def _state_pairs(name: str, torch_opt, model, state) -> list[tuple[str, torch.Tensor, object]]:
    """``(what, torch's tensor, funcamp's tensor)`` for every per-param state entry torch
    keeps (funcamp's step count against torch's ``step``)."""
    pairs = []
    rename = FIELDS.get(name, {})
    for k, p in model.named_parameters():
        for key, value in torch_opt.state[p].items():
            if key == "step":
                pairs.append((f"{k}.step", value, state.count))
                continue
            field = rename.get(key, key)
            if field is None:
                continue
            got = getattr(state, field)
            pairs.append((f"{k}.{key}", value, got if isinstance(got, torch.Tensor) else got[k]))
    return pairs


def _step(torch_opt, scaler, model) -> None:
    """``scaler.step(torch_opt)``. A ``differentiable=True`` optimizer steps with grad mode on
    (its own ``set_grad_enabled``), which refuses in-place work on leaf params: they stop
    requiring grad for the step, which then runs its differentiable code path on them."""
    if not torch_opt.defaults.get("differentiable"):
        scaler.step(torch_opt)
        return
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(False)
    try:
        scaler.step(torch_opt)
    finally:
        for p in params:
            p.requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("name", "desc", "kwargs"), CONFIGS, ids=IDS)
def test_eager_run_equals_torch(name, desc, kwargs, dtype):
    torch.manual_seed(0)
    model = Net(bias=name != "Muon")
    ours = copy.deepcopy(model)
    torch_opt = getattr(torch.optim, name)(model.parameters(), **_kwargs(kwargs))
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    fc_opt = funcamp.optim.from_torch(
        getattr(torch.optim, name)(ours.parameters(), **_kwargs(kwargs)),
        dict(ours.named_parameters()),
    )
    policy = funcamp.get_policy(POLICIES[dtype])
    params, buffers = funcamp.params_and_buffers(ours)

    def loss_fn(params, buffers, batch):
        x, y = batch
        out = torch.func.functional_call(ours, (params, buffers), (x,))
        return nn.functional.mse_loss(out, y)

    state = funcamp.TrainState.create(params, fc_opt, policy, buffers=buffers)
    step = funcamp.make_train_step(loss_fn, fc_opt, policy, compile=False)
    for i, (x, y) in enumerate(_batches(dtype)):
        torch_opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        _step(torch_opt, scaler, model)
        scaler.update()
        state, metrics = step(state, (x, y))
        where = f"{name} {desc} {dtype}, step {i}"
        assert torch.equal(metrics["loss"], loss.detach().float()) or (
            torch.isnan(loss) and torch.isnan(metrics["loss"])
        ), where
        if scaler.is_enabled():
            assert torch.equal(state.scaler.scale, scaler._scale), where
        for k, p in model.named_parameters():
            assert torch.equal(state.params[k], p.detach()), f"{where}: param {k}"
        for what, want, got in _state_pairs(name, torch_opt, model, state.opt_state):
            assert torch.equal(got.to(want.dtype), want), f"{where}: {what}"
