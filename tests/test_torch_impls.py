"""The torch implementations funcamp's optimizers select by keyword: ``foreach=True`` (NAdam,
RAdam: torch's ``_multi_tensor_*`` step) and ``differentiable=True`` (Adam, AdamW, NAdam: torch's
``differentiable`` single-tensor step), built directly with funcamp's factories, against
torch.optim built with the same flag: params and state bit for bit at every step, on the eager
path and on the traced one (params autograd tracks). Also Muon's tensor learning rate, and the
flags' bad input."""

from __future__ import annotations

import pytest
import torch

import funcamp

STEPS = 40
SHAPES = {"w": (6, 8), "b": (3,), "v": (8, 8)}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


def _copy(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


#: case -> (torch.optim class name, the keyword arguments of both; funcamp's take ``betas``
#: as ``b1, b2``)
CASES = {
    "adam_differentiable": ("Adam", {"weight_decay": 0.1, "differentiable": True}),
    "adam_differentiable_amsgrad_maximize": (
        "Adam",
        {"amsgrad": True, "maximize": True, "differentiable": True},
    ),
    "adam_differentiable_tensor_lr": ("Adam", {"lr": torch.tensor(0.01), "differentiable": True}),
    "adamw_differentiable": ("AdamW", {"weight_decay": 0.1, "differentiable": True}),
    "nadam_differentiable": ("NAdam", {"momentum_decay": 6e-3, "differentiable": True}),
    "nadam_differentiable_decoupled": (
        "NAdam",
        {"weight_decay": 0.1, "decoupled_weight_decay": True, "differentiable": True},
    ),
    "nadam_differentiable_tensor_lr": ("NAdam", {"lr": torch.tensor(0.01), "differentiable": True}),
    "nadam_foreach": ("NAdam", {"weight_decay": 0.1, "maximize": True, "foreach": True}),
    "nadam_foreach_tensor_lr": ("NAdam", {"lr": torch.tensor(0.01), "foreach": True}),
    "radam_foreach": ("RAdam", {"weight_decay": 0.1, "maximize": True, "foreach": True}),
    "radam_foreach_decoupled": (
        "RAdam",
        {"weight_decay": 0.1, "decoupled_weight_decay": True, "foreach": True},
    ),
    "radam_foreach_tensor_lr": ("RAdam", {"lr": torch.tensor(0.01), "foreach": True}),
    "radam_foreach_tensor_b1": (
        "RAdam",
        {"betas": (torch.tensor(0.8), 0.99), "weight_decay": 0.1, "foreach": True},
    ),
    "radam_foreach_tensor_b1_lr": (
        "RAdam",
        {
            "lr": torch.tensor(0.01),
            "betas": (torch.tensor(0.8, dtype=torch.float64), 0.99),
            "foreach": True,
        },
    ),
    "muon_tensor_lr": ("Muon", {"lr": torch.tensor(0.01)}),
    "muon_tensor_lr_no_decay": ("Muon", {"lr": torch.tensor(0.02), "weight_decay": 0.0}),
}
FACTORIES = {
    "Adam": funcamp.adam,
    "AdamW": funcamp.adamw,
    "NAdam": funcamp.nadam,
    "RAdam": funcamp.radam,
    "Muon": funcamp.muon,
}


def _shapes(name: str) -> dict[str, tuple[int, ...]]:
    return {"w": (6, 8), "v": (8, 8), "u": (3, 8)} if name == "Muon" else SHAPES


def _update(opt, grads, state, params):
    """The update as a train step makes it: the new params themselves where the algorithm
    computed them (torch's last in-place op on the param rounds once)."""
    prepared = opt.prepare(grads, state, params)
    return prepared.run(grads, funcamp.optim.Writes(new_params=True))


def _run(case: str, traced: bool) -> None:
    name, kwargs = CASES[case]
    kwargs = {"lr": 0.03, **kwargs}
    gen = torch.Generator().manual_seed(0)
    p0 = {k: torch.randn(s, generator=gen) for k, s in _shapes(name).items()}
    ref_params = {k: v.clone() for k, v in p0.items()}  # plain leaves: torch's step on them
    ref = getattr(torch.optim, name)(list(ref_params.values()), **{
        k: tuple(_copy(b) for b in v) if k == "betas" else _copy(v) for k, v in kwargs.items()
    })  # fmt: skip
    ours = dict(kwargs)
    lr = ours.pop("lr")
    if "betas" in ours:
        ours["b1"], ours["b2"] = (_copy(b) for b in ours.pop("betas"))
    opt = FACTORIES[name](_copy(lr), **ours)
    params = {k: v.clone() for k, v in p0.items()}
    state = opt.init(params)
    for i in range(STEPS):
        grads = {k: torch.randn(s, generator=gen) for k, s in _shapes(name).items()}
        if i == 1:
            grads["w"] = torch.zeros_like(grads["w"])
        for k, p in ref_params.items():
            p.grad = grads[k].clone()
        ref.step()
        if traced:  # params autograd tracks: funcamp's traced path, leaf by leaf
            tracked = {k: v.clone().requires_grad_() for k, v in params.items()}
            updates, state = _update(opt, grads, state, tracked)
            params = {k: v.detach() for k, v in funcamp.apply_updates(tracked, updates).items()}
            state = torch.utils._pytree.tree_map(
                lambda x: x.detach() if isinstance(x, torch.Tensor) else x, state
            )
        else:
            updates, state = _update(opt, grads, state, params)
            params = funcamp.apply_updates(params, updates)
        for k, p in ref_params.items():
            assert torch.equal(params[k], p), f"{case} step {i}: param {k}"
            for key, want in ref.state[p].items():
                if key == "step":
                    assert torch.equal(state.count.to(want.dtype), want), f"{case} step {i}"
                    continue
                got = getattr(state, key)
                got = got if isinstance(got, torch.Tensor) else got[k]
                assert torch.equal(got.to(want.dtype), want), f"{case} step {i}: {key} of {k}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_eager_step_equals_torch_implementation(case):
    _run(case, traced=False)


@pytest.mark.parametrize(
    "case", ["adam_differentiable", "nadam_differentiable", "nadam_foreach", "radam_foreach"]
)
def test_traced_step_equals_torch_implementation(case):
    _run(case, traced=True)


@pytest.mark.parametrize(
    ("make", "kwargs", "error", "match"),
    [
        (funcamp.nadam, {"foreach": "yes"}, TypeError, r"`foreach` must be a bool"),
        (funcamp.radam, {"foreach": 1}, TypeError, r"`foreach` must be a bool"),
        (funcamp.adam, {"differentiable": None}, TypeError, r"`differentiable` must be a bool"),
        (
            funcamp.nadam,
            {"foreach": True, "differentiable": True},
            ValueError,
            r"`foreach=True` and `differentiable=True` .* pass one of them",
        ),
        (
            funcamp.adamw,
            {"fused": True, "differentiable": True},
            ValueError,
            r"`fused=True` and `differentiable=True` .* pass one of them",
        ),
        (
            funcamp.radam,
            {"b2": torch.tensor(0.99), "foreach": True},
            ValueError,
            r"`foreach=True` takes a float b2 .* float\(b2\), or foreach=None",
        ),
        (
            funcamp.nadam,
            {"b1": torch.tensor(0.9), "differentiable": True},
            ValueError,
            r"`differentiable=True` takes a float b1 .* float\(b1\)",
        ),
    ],
    ids=[
        "foreach_str",
        "foreach_int",
        "differentiable_none",
        "foreach_and_differentiable",
        "fused_and_differentiable",
        "foreach_tensor_beta",
        "differentiable_tensor_b1",
    ],
)
def test_implementation_flags_refused_clearly(make, kwargs, error, match):
    with pytest.raises(error, match=rf"funcamp\.{make.__name__}: {match}"):
        make(0.01, **kwargs)


@pytest.mark.parametrize("name", ["NAdam", "RAdam"])
def test_from_torch_maps_foreach(name):
    """from_torch gives the foreach math for a torch optimizer built with foreach=True, and
    the single-tensor math for foreach=None on CPU params (torch's default there): the two
    differ, each equal to its torch implementation."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    named = dict(model.named_parameters())
    runs = {}
    for foreach in (None, True):
        ref_model = torch.nn.Linear(8, 4)
        ref_model.load_state_dict(model.state_dict())
        ref = getattr(torch.optim, name)(ref_model.parameters(), lr=0.05, foreach=foreach)
        opt = funcamp.optim.from_torch(
            getattr(torch.optim, name)(model.parameters(), lr=0.05, foreach=foreach), named
        )
        params = {k: v.detach().clone() for k, v in named.items()}
        state = opt.init(params)
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
            for k, p in ref_model.named_parameters():
                p.grad = grads[k].clone()
            ref.step()
            updates, state = _update(opt, grads, state, params)
            params = funcamp.apply_updates(params, updates)
        for k, p in ref_model.named_parameters():
            assert torch.equal(params[k], p.detach()), (name, foreach, k)
        runs[foreach] = params
    assert any(not torch.equal(runs[None][k], runs[True][k]) for k in named)
