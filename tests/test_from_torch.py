"""funcamp.optim.from_torch, and torch.optim's exact numbers on nanoGPT's loop."""

from __future__ import annotations

import copy

import nanogpt as ng
import pytest
import test_optim_db as db
import torch

import funcamp

LRS = torch.optim.lr_scheduler


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _funcamp_run(model, data, opt):
    params, buffers = funcamp.params_and_buffers(model)

    def loss_fn(p, b, batch):
        return torch.func.functional_call(model, (p, b), batch)

    state = funcamp.TrainState.create(params, opt, "autocast_cpu", buffers=buffers)
    step = funcamp.make_train_step(loss_fn, opt, "autocast_cpu", compile=False)
    lrs, norms = [], []
    for batch in data:
        lrs.append(funcamp.optim.learning_rate(opt, state.opt_state))
        state, m = step(state, batch)
        norms.append(m["grad_norm"])
    return state, lrs, norms


def _assert_bitwise(state, ref):
    named = dict(ref.named_parameters())
    assert list(state.params) == list(named)
    bad = [k for k, v in state.params.items() if not torch.equal(v, named[k].detach())]
    assert not bad, f"{len(bad)} of {len(named)} params differ: {bad[:3]}"


STEPS = 30


def test_nanogpt_loop_bit_identical_to_torch_optim():
    """nanoGPT's loop ported by hand: its get_lr (tabulated), AdamW(fused=True) with decay and
    no-decay groups, clip 0.25 (active at every step), bf16 autocast: the params after 30
    steps equal torch.optim + clip_grad_norm_ bit for bit. (Fails with the step size rounded
    to float32 before the division, or with the norms summed in sorted-key order.)"""
    data = ng.batches(STEPS)
    ref = ng.model()
    torch_norms = ng.torch_run(ref, data, ng.torch_optimizer(ref))
    opt = funcamp.chain(
        funcamp.clip_by_global_norm(ng.CLIP),
        funcamp.adamw(
            funcamp.optim.lambda_lr(1.0, ng.get_lr, total_steps=STEPS),
            b1=0.9,
            b2=0.95,
            weight_decay=ng.WD,
            mask=lambda p: {k: v.dim() >= 2 for k, v in p.items()},
            fused=True,
        ),
    )
    state, lrs, norms = _funcamp_run(ng.model(), data, opt)
    _assert_bitwise(state, ref)
    assert [x.item() for x in lrs] == [ng.get_lr(i) for i in range(STEPS)]
    # the grad_norm metric is clip_grad_norm_'s total norm, summed in the same order
    assert [x.item() for x in norms] == [x.item() for x in torch_norms]


def test_nanogpt_from_torch_with_sequential_scheduler_bit_identical():
    """The same loop with torch's own warm-up + cosine (SequentialLR of LinearLR and
    CosineAnnealingLR) translated by from_torch, groups and all."""
    data = ng.batches(STEPS)

    def sched(opt):
        return LRS.SequentialLR(
            opt,
            [
                LRS.LinearLR(opt, start_factor=0.1, total_iters=ng.WARMUP),
                LRS.CosineAnnealingLR(opt, T_max=STEPS - ng.WARMUP, eta_min=ng.MIN_LR),
            ],
            [ng.WARMUP],
        )

    ref = ng.model()
    torch_opt = ng.torch_optimizer(ref)
    torch_sched = sched(torch_opt)
    model = ng.model()
    mirror_opt = ng.torch_optimizer(model)  # the user's torch objects, translated
    opt = funcamp.chain(
        funcamp.clip_by_global_norm(ng.CLIP),
        funcamp.optim.from_torch(mirror_opt, dict(model.named_parameters()), sched(mirror_opt)),
    )
    torch_lrs = []
    for batch in data:  # the torch loop, recording its lr per step
        torch_lrs.append(torch_opt.param_groups[0]["lr"])
        ng.torch_run(ref, [batch], torch_opt, torch_sched, manual_lr=False)
    state, lrs, _ = _funcamp_run(model, data, opt)
    _assert_bitwise(state, ref)
    assert [x["group0"].item() for x in lrs] == pytest.approx(torch_lrs, rel=1e-13)


# --------------------------------------------------------------------------------------------
# from_torch on the three optimizers, with schedulers


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _grads(model, i):
    g = torch.Generator().manual_seed(i)
    return {k: torch.randn(v.shape, generator=g) for k, v in model.named_parameters()}


def _compare(make_opt, make_sched=None, steps=12, rtol=1e-6, exact=False, total_steps=None):
    ref = _model()
    torch_opt = make_opt(ref)
    torch_sched = make_sched(torch_opt) if make_sched else None
    model = _model()
    mirror = make_opt(model)
    opt = funcamp.optim.from_torch(
        mirror,
        dict(model.named_parameters()),
        make_sched(mirror) if make_sched else None,
        total_steps=total_steps,
    )
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = opt.init(params)
    for i in range(steps):
        lr = funcamp.optim.learning_rate(opt, state)
        lr = lr if isinstance(lr, torch.Tensor) else lr["group0"]
        assert lr.item() == pytest.approx(float(torch_opt.param_groups[0]["lr"]), rel=1e-12)
        grads = _grads(ref, i)
        updates, state = opt.update(grads, state, params)
        params = funcamp.apply_updates(params, updates)
        for k, p in ref.named_parameters():
            p.grad = grads[k].clone()
        torch_opt.step()
        if torch_sched is not None:
            torch_sched.step()
    for k, p in ref.named_parameters():
        if exact:
            assert torch.equal(params[k], p.detach()), k
        else:
            torch.testing.assert_close(params[k], p.detach(), rtol=rtol, atol=1e-7)


def _groups(m, **decay):
    return [
        {"params": [m[0].weight, m[2].weight], **decay},
        {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0},
    ]


CONFIGS = {
    "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), None),
    "sgd_momentum_nesterov_wd": (
        lambda m: torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
        ),
        lambda o: LRS.StepLR(o, step_size=3, gamma=0.5),
    ),
    "sgd_dampening_maximize": (
        lambda m: torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.5, dampening=0.3, maximize=True
        ),
        lambda o: LRS.ExponentialLR(o, 0.9),
    ),
    "sgd_groups": (
        lambda m: torch.optim.SGD(_groups(m, weight_decay=0.1, lr=0.2), lr=0.05, momentum=0.9),
        lambda o: LRS.LinearLR(o, start_factor=0.4, end_factor=0.6, total_iters=4),
    ),
    "adam": (
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
        lambda o: LRS.CosineAnnealingLR(o, T_max=5, eta_min=1e-3),
    ),
    "adam_amsgrad_wd_maximize": (
        lambda m: torch.optim.Adam(
            m.parameters(), lr=0.01, weight_decay=0.1, amsgrad=True, maximize=True
        ),
        lambda o: LRS.PolynomialLR(o, power=0.9, total_iters=4),
    ),
    "adam_decoupled": (
        lambda m: torch.optim.Adam(
            m.parameters(), lr=0.01, weight_decay=0.1, decoupled_weight_decay=True
        ),
        lambda o: LRS.ChainedScheduler(
            [LRS.ConstantLR(o, factor=0.4, total_iters=4), LRS.ExponentialLR(o, gamma=0.9)]
        ),
    ),
    "adamw_groups": (
        lambda m: torch.optim.AdamW(_groups(m, weight_decay=0.1), lr=0.01, betas=(0.8, 0.9)),
        lambda o: LRS.OneCycleLR(o, max_lr=[0.02, 0.01], total_steps=12, cycle_momentum=False),
    ),
    "adamw_groups_one_cycle_momentum": (
        lambda m: torch.optim.AdamW(_groups(m, weight_decay=0.1), lr=0.01, betas=(0.8, 0.9)),
        lambda o: LRS.OneCycleLR(o, max_lr=[0.02, 0.01], total_steps=12),
    ),
    "sgd_cyclic_momentum": (
        lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, nesterov=True),
        lambda o: LRS.CyclicLR(o, 1e-3, 1e-2, step_size_up=3, mode="triangular2"),
    ),
    "rmsprop_one_cycle_momentum": (
        lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5),
        lambda o: LRS.OneCycleLR(o, max_lr=0.02, total_steps=12, three_phase=True),
    ),
    "adamw_foreach_cyclic": (
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, foreach=True, eps=1e-6),
        lambda o: LRS.CyclicLR(o, 1e-3, 1e-2, step_size_up=3, cycle_momentum=False),
    ),
    "adamw_warm_restarts_lambda": (
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
        lambda o: LRS.SequentialLR(
            o,
            [
                LRS.LambdaLR(o, lambda t: 1 / (1 + t)),
                LRS.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2),
            ],
            [3],
        ),
    ),
    "adam_multistep_tensor_lr": (
        lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01)),
        None,
    ),
    "adam_tensor_betas": (
        lambda m: torch.optim.Adam(
            m.parameters(), lr=0.01, betas=(torch.tensor(0.8), torch.tensor(0.99))
        ),
        lambda o: LRS.StepLR(o, step_size=3, gamma=0.5),
    ),
    # tensor betas where torch's step takes them (NAdam/RAdam/Adamax: its single-tensor step,
    # foreach=None on CPU; RAdam's foreach step a tensor b1; Adam's a beta requiring grad)
    "nadam_tensor_betas": (
        lambda m: torch.optim.NAdam(
            m.parameters(),
            lr=0.01,
            betas=(torch.tensor(0.8), torch.tensor(0.99)),
            weight_decay=0.1,
        ),
        lambda o: LRS.StepLR(o, step_size=3, gamma=0.5),
    ),
    "radam_tensor_b1_foreach": (
        lambda m: torch.optim.RAdam(
            m.parameters(), lr=0.01, betas=(torch.tensor(0.8), 0.99), foreach=True
        ),
        None,
    ),
    "adamax_tensor_betas_groups": (
        lambda m: torch.optim.Adamax(
            _groups(m, weight_decay=0.1),
            lr=0.01,
            betas=(torch.tensor(0.8, dtype=torch.float64), torch.tensor(0.9)),
        ),
        lambda o: LRS.LinearLR(o, start_factor=0.5, total_iters=4),
    ),
    "adam_tensor_betas_requiring_grad": (
        lambda m: torch.optim.Adam(
            m.parameters(),
            lr=0.01,
            betas=(torch.tensor(0.8, requires_grad=True), torch.tensor(0.99)),
        ),
        None,
    ),
    # torch.optim's other optimizers: groups and schedules through each translator
    "rmsprop_groups_centered": (
        lambda m: torch.optim.RMSprop(
            _groups(m, weight_decay=0.1), lr=0.01, momentum=0.5, centered=True, alpha=0.9
        ),
        lambda o: LRS.StepLR(o, step_size=3, gamma=0.5),
    ),
    "adagrad_lr_decay_fused": (
        lambda m: torch.optim.Adagrad(
            m.parameters(), lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, fused=True
        ),
        lambda o: LRS.CosineAnnealingLR(o, T_max=5),
    ),
    "adadelta_maximize": (
        lambda m: torch.optim.Adadelta(m.parameters(), lr=0.5, rho=0.8, maximize=True),
        lambda o: LRS.ExponentialLR(o, 0.9),
    ),
    "adamax_groups": (
        lambda m: torch.optim.Adamax(_groups(m, weight_decay=0.1), lr=0.01, betas=(0.8, 0.9)),
        lambda o: LRS.LinearLR(o, start_factor=0.5, total_iters=4),
    ),
    "nadam_decoupled": (
        lambda m: torch.optim.NAdam(
            m.parameters(),
            lr=0.01,
            weight_decay=0.1,
            momentum_decay=0.006,
            decoupled_weight_decay=True,
        ),
        lambda o: LRS.MultiStepLR(o, milestones=[2, 6], gamma=0.5),
    ),
    "radam_decoupled": (
        lambda m: torch.optim.RAdam(
            m.parameters(), lr=0.01, weight_decay=0.1, decoupled_weight_decay=True
        ),
        lambda o: LRS.PolynomialLR(o, power=0.9, total_iters=8),
    ),
    "asgd_t0": (
        lambda m: torch.optim.ASGD(m.parameters(), lr=0.05, lambd=0.01, t0=3, weight_decay=0.1),
        None,
    ),
    "rprop_etas": (
        lambda m: torch.optim.Rprop(m.parameters(), lr=0.01, etas=(0.4, 1.3), maximize=True),
        None,
    ),
    "adafactor_wd": (
        lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01, weight_decay=0.1, d=1.5),
        lambda o: LRS.ConstantLR(o, factor=0.5, total_iters=3),
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_from_torch_matches_torch_optim(name):
    _compare(*CONFIGS[name])


def test_from_torch_tabulates_python_lambdas_with_total_steps():
    """LambdaLR with a Python function (branches: not traceable) and MultiplicativeLR: torch's
    learning rate exactly, and with fused AdamW the params bit for bit."""

    def warmup(it):
        return (it + 1) / 4 if it < 3 else 0.5 ** (it - 3)

    for make_sched in (
        lambda o: LRS.LambdaLR(o, warmup),
        lambda o: LRS.MultiplicativeLR(o, lambda t: 0.9 if t % 2 else 0.97),
    ):
        _compare(
            lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, fused=True),
            make_sched,
            exact=True,
            total_steps=12,
        )


def test_from_torch_fused_adamw_groups_bit_identical():
    _compare(
        lambda m: torch.optim.AdamW(_groups(m, weight_decay=0.1), lr=0.01, fused=True),
        lambda o: LRS.MultiStepLR(o, milestones=[2, 5, 5], gamma=0.5),
        exact=True,
    )


def test_from_torch_groups_become_multi_transform_by_identity():
    m = _model()
    opt = funcamp.optim.from_torch(
        torch.optim.AdamW(_groups(m, weight_decay=0.1), lr=0.01), dict(m.named_parameters())
    )
    state = opt.init({k: v.detach() for k, v in m.named_parameters()})
    assert sorted(state.inner) == ["group0", "group1"]
    assert sorted(state.inner["group0"].exp_avg) == ["0.weight", "2.weight"]


class _Mine(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m, p: (_Mine(m.parameters()), p, None), r"`optimizer` _Mine has no funcamp"),
        (
            lambda m, p: (torch.optim.SGD(m.parameters(), lr=0.1), {"w": p["0.weight"]}, None),
            r"param group 0's param 1 .* is not in `params`",
        ),
        (
            lambda m, p: (torch.optim.SGD(list(m.parameters())[:2], lr=0.1), p, None),
            r"`params` holds \['2.weight', '2.bias'\] which no param group",
        ),
        (
            lambda m, p: (
                o := torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                p,
                LRS.SequentialLR(
                    o,
                    [LRS.OneCycleLR(o, max_lr=0.1, total_steps=5), LRS.ConstantLR(o)],
                    [5],
                ),
            ),
            r"OneCycleLR\(cycle_momentum=True\) inside a SequentialLR has no funcamp",
        ),
        (
            lambda m, p: (
                o := torch.optim.SGD(_groups(m), lr=0.1),
                p,
                LRS.ReduceLROnPlateau(o),
            ),
            r"ReduceLROnPlateau over 2 param groups has no translation",
        ),
        (
            lambda m, p: (
                o := torch.optim.SGD(m.parameters(), lr=0.1),
                p,
                LRS.MultiplicativeLR(o, lambda t: 0.9),
            ),
            r"MultiplicativeLR is a running product .* pass total_steps=",
        ),
        (
            lambda m, p: (o := torch.optim.SGD(m.parameters(), lr=0.1), p, _stepped(o)),
            r"has been stepped \(2 times\)",
        ),
        (
            lambda m, p: (
                torch.optim.SGD(m.parameters(), lr=0.1),
                p,
                LRS.StepLR(torch.optim.SGD(m.parameters(), lr=0.1), 2),
            ),
            r"`scheduler` must be an lr_scheduler of `optimizer`",
        ),
    ],
)
def test_from_torch_refuses_by_name(make, match):
    m = _model()
    args = make(m, dict(m.named_parameters()))
    with pytest.raises((ValueError, TypeError), match=r"funcamp.optim.from_torch: .*" + match):
        funcamp.optim.from_torch(*args)


def _stepped(o):
    s = LRS.StepLR(o, 2)
    for _ in range(2):
        o.step()
        s.step()
    return s


def test_from_torch_keeps_the_loop_unchanged_by_a_copy():
    """The translation reads the torch objects and changes nothing in them."""
    m = _model()
    o = torch.optim.AdamW(m.parameters(), lr=0.01)
    s = LRS.StepLR(o, 2)
    before = copy.deepcopy((o.state_dict(), s.state_dict()))
    funcamp.optim.from_torch(o, dict(m.named_parameters()), s)
    assert (o.state_dict(), s.state_dict()) == before


@pytest.mark.parametrize("nested", [False, True])
def test_clip_by_global_norm_sums_in_the_params_order(nested):
    """torch sums the per-tensor norms in model.parameters() order; funcamp in the params
    dict's insertion order (not optree's sorted keys): the clipped grads are bit-identical."""
    names = [f"{c}{i}" for i, c in enumerate("zyxwvutsrqponmlkjihg")]
    clip = funcamp.clip_by_global_norm(1.0)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        grads = {n: torch.randn(7, generator=g) * 10 ** (i % 5 - 2) for i, n in enumerate(names)}
        tree = grads
        if nested:  # {"b": names[10:], "a": names[:10]}: model.parameters() in that order
            items = list(grads.items())
            tree = {"b": dict(items[10:]), "a": dict(items[:10])}
            grads = {**tree["b"], **tree["a"]}
        ps = [torch.nn.Parameter(torch.zeros(7)) for _ in names]
        for p, x in zip(ps, grads.values()):
            p.grad = x.clone()
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
        ref = [p.grad for p in ps]
        out, _ = clip.update(tree, clip.init(tree), tree)
        leaves = [v for d in out.values() for v in d.values()] if nested else list(out.values())
        assert all(torch.equal(a, b) for a, b in zip(leaves, ref)), seed


class Lion(torch.optim.Optimizer):
    """lion-pytorch's Lion (lucidrains, lion_pytorch/lion_pytorch.py), its update as written
    there, under its module's name (the package is not a test dependency)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, lr, wd = p.grad, group["lr"], group["weight_decay"]
                beta1, beta2 = group["betas"]
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.data.mul_(1.0 - lr * wd)
                update = exp_avg.clone().mul_(beta1).add(grad, alpha=1.0 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)


Lion.__module__ = "lion_pytorch.lion_pytorch"


def test_from_torch_lion_pytorch():
    _compare(
        lambda m: Lion(m.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
        lambda o: LRS.CosineAnnealingLR(o, T_max=8),
        rtol=1e-6,
    )


@pytest.mark.parametrize(("name", "desc", "kwargs"), db.CONFIGS, ids=db.IDS)
def test_from_torch_every_optim_db_configuration(name, desc, kwargs):
    """Every CPU configuration of torch's optim_db (SGD, Adam, AdamW, RMSprop, Adagrad,
    Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop, Muon, Adafactor; the implementation flags
    included), translated from the torch optimizer itself: torch.optim's params after four
    steps (one with a zero grad)."""
    params = db._params(name)
    torch_opt = db.CLASSES[name](list(params.values()), **db._torch_kwargs(kwargs))
    opt = funcamp.optim.from_torch(torch_opt, params)
    ps = {k: v.clone() for k, v in params.items()}
    state = opt.init(ps)
    for i in range(db.STEPS):
        updates, state = opt.update(db._grads(i, name), state, ps)
        ps = funcamp.apply_updates(ps, updates)
    _, want, _ = db._torch_run(name, kwargs)
    torch.testing.assert_close(
        ps, {k: v.detach() for k, v in want.items()}, rtol=db.RTOL, atol=db.ATOL
    )


def test_from_torch_knows_every_optim_db_optimizer():
    """Every optimizer of torch's optim_db has an entry: a translation or a refusal."""
    names = {info.optim_cls for info in db.common_optimizers.optim_db}
    assert names <= set(funcamp.optim._from_torch.OPTIMIZERS)


@pytest.mark.parametrize("line_search_fn", [None, "strong_wolfe"])
def test_from_torch_lbfgs_takes_the_closure_as_value_fn(line_search_fn):
    """LBFGS: ``update(None, state, params, value_fn=loss)`` is torch's ``step(closure)``."""
    target = torch.tensor([1.0, -2.0, 0.5])

    def loss(w, b):
        return ((w @ target - 1.0) ** 2).sum() + (w**2).sum() * 0.1 + ((b - 0.3) ** 2).sum()

    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(2))
    params = {"w": w, "b": b}
    kwargs = dict(lr=0.5, max_iter=4, history_size=3, line_search_fn=line_search_fn)
    opt = funcamp.optim.from_torch(torch.optim.LBFGS([w, b], **kwargs), params)
    ps = {k: v.detach().clone() for k, v in params.items()}
    state = opt.init(ps)
    torch_opt = torch.optim.LBFGS([w, b], **kwargs)

    def closure():
        torch_opt.zero_grad()
        out = loss(w, b)
        out.backward()
        return out

    for _ in range(3):
        want = torch_opt.step(closure)
        updates, state = opt.update(None, state, ps, value_fn=lambda p: loss(p["w"], p["b"]))
        ps = funcamp.apply_updates(ps, updates)
        assert state.loss.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(ps, {k: v.detach() for k, v in params.items()})


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda ps: torch.optim.SparseAdam(ps, lr=0.01),
            r"`optimizer` SparseAdam takes sparse gradients .* funcamp.adam",
        ),
        (
            lambda ps: torch.optim.NAdam(ps, betas=(0.9, torch.tensor(0.99)), foreach=True),
            r"NAdam param group 0's `betas` holds tensors .* foreach step fails: .*foreach=False",
        ),
        (
            lambda ps: torch.optim.RAdam(ps, betas=(0.9, torch.tensor(0.99)), foreach=True),
            r"RAdam param group 0's `betas` holds tensors .* foreach step fails",
        ),
        (
            lambda ps: torch.optim.Adamax(ps, betas=(torch.tensor(0.9), 0.99), foreach=True),
            r"Adamax param group 0's `betas` holds tensors .* foreach step fails",
        ),
        (
            lambda ps: torch.optim.NAdam(
                ps, betas=(torch.tensor(0.9, requires_grad=True), 0.99), differentiable=True
            ),
            r"NAdam param group 0's `betas` holds tensors that require grad .* differentiable",
        ),
        (
            lambda ps: torch.optim.RMSprop([{"params": ps, "ema_decay": 0.9}]),
            r"RMSprop param group 0's `ema_decay`=0.9 has no funcamp translation",
        ),
        (
            lambda ps: torch.optim.Adafactor([{"params": ps, "beta1": 0.9}]),
            r"Adafactor param group 0's `beta1`=0.9 has no funcamp translation",
        ),
    ],
    ids=[
        "sparse_adam",
        "nadam_tensor_betas_foreach",
        "radam_tensor_b2_foreach",
        "adamax_tensor_b1_foreach",
        "nadam_differentiable_betas",
        "rmsprop_extra_key",
        "adafactor_extra_key",
    ],
)
def test_from_torch_refuses_other_optimizers_by_name(make, match):
    """What funcamp cannot express is refused with the option named: SparseAdam (sparse
    gradients; funcamp.adam is the alternative), tensor betas where torch's own step fails on
    them (NAdam's foreach step on either, RAdam's on b2, Adamax's on b1; torch 2.13) or
    differentiates through them, and a numeric group key no translator knows (it would change
    the numbers)."""
    m = _model()
    with pytest.raises(ValueError, match=r"funcamp.optim.from_torch: .*" + match):
        funcamp.optim.from_torch(make(list(m.parameters())), dict(m.named_parameters()))


def test_from_torch_muon_for_matrices_adamw_for_the_rest():
    """The usual Muon recipe is two torch optimizers (Muon takes 2-D params only): one
    from_torch each, joined by multi_transform on the param names, gives both torch.optim
    steps (Muon's schedule included)."""
    ref, model = _model(), _model()

    def torch_opts(m):
        hidden = [p for p in m.parameters() if p.dim() == 2]
        rest = [p for p in m.parameters() if p.dim() != 2]
        muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        return muon, torch.optim.AdamW(rest, lr=0.01), LRS.StepLR(muon, step_size=2, gamma=0.5)

    torch_muon, torch_adamw, torch_sched = torch_opts(ref)
    mirror_muon, mirror_adamw, mirror_sched = torch_opts(model)
    named = dict(model.named_parameters())
    labels = {k: "muon" if v.dim() == 2 else "adamw" for k, v in named.items()}
    opt = funcamp.multi_transform(
        {
            "muon": funcamp.optim.from_torch(
                mirror_muon, {k: v for k, v in named.items() if labels[k] == "muon"}, mirror_sched
            ),
            "adamw": funcamp.optim.from_torch(
                mirror_adamw, {k: v for k, v in named.items() if labels[k] == "adamw"}
            ),
        },
        labels,
    )
    params = {k: v.detach().clone() for k, v in named.items()}
    state = opt.init(params)
    for i in range(6):
        grads = _grads(ref, i)
        updates, state = opt.update(grads, state, params)
        params = funcamp.apply_updates(params, updates)
        for k, p in ref.named_parameters():
            p.grad = grads[k].clone()
        torch_muon.step()
        torch_adamw.step()
        torch_sched.step()
    want = {k: p.detach() for k, p in ref.named_parameters()}
    torch.testing.assert_close(params, want, rtol=db.RTOL, atol=db.ATOL)


@pytest.mark.parametrize("name", ["NAdam", "RAdam", "Adamax"])
@pytest.mark.parametrize("tensors", [(True, True), (True, False), (False, True)])
def test_torch_foreach_refuses_the_tensor_betas_from_torch_refuses(name, tensors):
    """from_torch's table of the tensor betas torch's foreach step fails on is torch's own
    (torch 2.13): the step fails exactly there; the single-tensor step takes them all."""
    cls = getattr(torch.optim, name)
    betas = tuple(torch.tensor(b) if t else b for b, t in zip((0.9, 0.99), tensors))
    refuses = funcamp.optim._from_torch._FOREACH_REFUSES[name]
    fails = any(t and r for t, r in zip(tensors, refuses))
    for foreach in (False, True):
        p = torch.nn.Parameter(torch.ones(3))
        opt = cls([p], lr=0.01, betas=betas, foreach=foreach)
        p.grad = torch.ones(3)
        if foreach and fails:
            with pytest.raises((RuntimeError, TypeError)):
                opt.step()
        else:
            opt.step()
