"""funcamp.lion against a plain reference of the paper's update; param groups (masked,
multi_transform) against torch.optim.AdamW with two param groups; both through the low-precision
modes, checkpoints and the compiled train step; capabilities kept by the combinators."""

from __future__ import annotations

from unittest import mock

import optree
import pytest
import torch
from torch import nn
from torch.func import functional_call

import funcamp
from funcamp.optim._paths import EagerOps
from funcamp.testing import assert_trees_equal

STEPS = 8


def _params(seed: int, away_from_zero: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"w": torch.randn(17, 9, generator=g), "b": torch.randn(9, generator=g)}
    if away_from_zero:  # p + (new_p - p) is new_p exactly when new_p is within 2x of p
        out = {k: v.sign() * (0.5 + v.abs()) for k, v in out.items()}
    return out


def _grads(params: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {k: 0.7 * p + torch.randn(p.shape, generator=g) for k, p in params.items()}


def _reference_lion(params, lr, b1, b2, weight_decay, steps=STEPS):
    """Chen et al. 2023 (Program 1) with decoupled weight decay, in plain torch ops on
    tensors, as the authors' PyTorch version (lion-pytorch) writes it (``weight_decay`` a float,
    or a dict of floats by param name)."""
    params = {k: v.clone() for k, v in params.items()}
    exp_avg = {k: torch.zeros_like(v) for k, v in params.items()}
    for step in range(steps):
        grads = _grads(params, step)
        for k, p in params.items():
            g, m = grads[k], exp_avg[k]
            wd = weight_decay[k] if isinstance(weight_decay, dict) else weight_decay
            if wd:
                p.mul_(1 - lr * wd)
            update = m.clone().mul_(b1).add(g, alpha=1 - b1).sign_()
            p.add_(update, alpha=-lr)
            m.mul_(b2).add_(g, alpha=1 - b2)
    return params, exp_avg


def _run(opt, params, step_fn=None, steps=STEPS):
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return funcamp.apply_updates(params, updates), state

    step_fn = step_fn(step) if step_fn is not None else step
    params, state = dict(params), opt.init(params)
    for i in range(steps):
        params, state = step_fn(params, state, _grads(params, i))
    return params, state


def _equal(a, b):
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if not isinstance(x, torch.Tensor):
            assert x == y
            continue
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lion_matches_the_papers_update_eager_and_compiled_bit_for_bit(weight_decay):
    params0 = _params(0, away_from_zero=weight_decay > 0)
    lr, b1, b2 = 3e-3, 0.9, 0.99
    ref_params, ref_m = _reference_lion(params0, lr, b1, b2, weight_decay)
    opt = funcamp.lion(lr, b1, b2, weight_decay)
    eager, state = _run(opt, params0)
    _equal(eager, ref_params)
    _equal(state.exp_avg, ref_m)
    torch._dynamo.reset()
    compiled, cstate = _run(
        opt, params0, lambda f: torch.compile(f, backend="aot_eager", fullgraph=True)
    )
    _equal(compiled, ref_params)
    _equal(cstate, state)


def test_lion_under_inductor_is_the_reference_bit_for_bit():
    """Inductor turns the interpolations into hardware fused multiply-adds: still the same bits
    as torch's eager kernels."""
    params0 = _params(1, away_from_zero=True)
    ref_params, _ = _reference_lion(params0, 1e-2, 0.8, 0.95, 0.05, steps=4)
    opt = funcamp.lion(1e-2, 0.8, 0.95, 0.05)
    torch._dynamo.reset()
    compiled, _ = _run(opt, params0, lambda f: torch.compile(f, fullgraph=True), steps=4)
    _equal(compiled, ref_params)


def test_lion_rejects_bad_hyperparameters():
    with pytest.raises(
        ValueError, match=r"funcamp\.lion: `b1` must be a finite real number in \[0.0, 1.0\)"
    ):
        funcamp.lion(1e-3, b1=1.0)
    with pytest.raises(
        ValueError, match=r"funcamp\.lion: `weight_decay` must be a finite real number >= 0"
    ):
        funcamp.lion(1e-3, weight_decay=-1.0)
    with pytest.raises(TypeError, match=r"funcamp\.lion: `state` must be a LionState"):
        funcamp.lion(1e-3).update({"w": torch.ones(1)}, (), {"w": torch.ones(1)})


# ------------------------------------------------------------------------- the train step

with torch.random.fork_rng():  # the same init in every run, whatever ran before the import
    torch.manual_seed(0)
    MODEL = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def loss_fn(params, buffers, batch):
    x, y = batch
    return nn.functional.cross_entropy(functional_call(MODEL, (params, buffers), (x,)), y)


def _batches(n: int):
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)
    ]


def _decay(path: str) -> str:
    return "no_decay" if path.endswith("bias") else "decay"


OPTIMIZERS = {
    "lion_sr": (funcamp.lion(1e-3, stochastic_rounding=True, seed=3), "bf16-true"),
    # Param groups: AdamW with Kahan on the weights; on the biases, Lion with master weights,
    # masked to the first layer's (the second layer's bias stays frozen).
    "groups": (
        funcamp.chain(
            funcamp.clip_by_global_norm(1.0),
            funcamp.multi_transform(
                {
                    "decay": funcamp.adamw(1e-2, weight_decay=0.1, kahan=True),
                    "no_decay": funcamp.masked(
                        funcamp.lion(1e-2, weight_decay=0.0, master_weights=True),
                        lambda path: path.startswith("0."),
                    ),
                },
                _decay,
            ),
        ),
        "bf16-true",
    ),
}


@pytest.fixture(scope="module")
def trained():
    """Each optimizer through make_train_step for 4 steps, eager; "groups" (Lion included)
    compiled as well (dynamo's fullgraph capture; inductor's bits are tested above)."""
    out = {}
    params, buffers = funcamp.params_and_buffers(MODEL)
    for name, (opt, policy) in OPTIMIZERS.items():
        states = []
        for compile in (False, True) if name == "groups" else (False,):
            how = funcamp.Compile(backend="eager") if compile else False
            step = funcamp.make_train_step(loss_fn, opt, policy, compile=how)
            state = funcamp.TrainState.create(params, opt, policy, buffers=buffers)
            for batch in _batches(4):
                state, _ = step(state, batch)
            states.append(state)
        out[name] = (opt, policy, states)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_train_step_in_low_precision(trained, name):
    _, _, states = trained[name]
    eager = states[0]
    if len(states) == 2:  # compiled: the same bits
        _equal(funcamp.state_dict(eager), funcamp.state_dict(states[1]))
    first = funcamp.params_and_buffers(MODEL)[0]
    moved = [not torch.equal(eager.params[k].float(), first[k].bfloat16().float()) for k in first]
    if name == "groups":  # the second layer's bias is frozen
        assert moved == [True, True, True, False]
        lion_state = eager.opt_state[1].inner["no_decay"].inner
        assert list(lion_state.low.master) == ["0.bias"]
        decay = eager.opt_state[1].inner["decay"]
        assert decay.low.compensation["2.weight"].dtype == torch.bfloat16
    else:
        assert all(moved)
    assert all(p.dtype == torch.bfloat16 for p in eager.params.values())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_checkpoints_round_trip(trained, name, tmp_path):
    opt, policy, states = trained[name]
    params, buffers = funcamp.params_and_buffers(MODEL)
    template = funcamp.TrainState.create(params, opt, policy, buffers=buffers)
    funcamp.save(tmp_path / "ckpt.pt", states[0], policy=policy)
    loaded = funcamp.load(tmp_path / "ckpt.pt", template, policy=policy)
    _equal(funcamp.state_dict(loaded), funcamp.state_dict(states[0]))


# ----------------------------------------------------------------------------- param groups


def _torch_two_groups(params0, lr, wd, steps=STEPS, b_lr_factor=3):
    tparams = {k: v.clone().requires_grad_(True) for k, v in params0.items()}
    opt = torch.optim.AdamW(
        [
            {"params": [tparams["w"]], "weight_decay": wd},
            {"params": [tparams["b"]], "weight_decay": 0.0, "lr": lr * b_lr_factor},
        ],
        lr=lr,
    )
    for step in range(steps):
        grads = _grads({k: v.detach() for k, v in tparams.items()}, step)
        for k, v in tparams.items():
            v.grad = grads[k]
        opt.step()
    return {k: v.detach() for k, v in tparams.items()}


@pytest.mark.parametrize("labels", ["tree", "callable"])
def test_multi_transform_is_adamw_with_two_param_groups(labels):
    params0 = _params(5)
    lr, wd = 1e-2, 0.1
    expected = _torch_two_groups(params0, lr, wd)
    opt = funcamp.multi_transform(
        {
            "decay": funcamp.adamw(lr, weight_decay=wd),
            "no_decay": funcamp.adamw(lr * 3, weight_decay=0.0),
        },
        {"w": "decay", "b": "no_decay"}
        if labels == "tree"
        else lambda path: {"w": "decay"}.get(path, "no_decay"),
    )
    got, state = _run(opt, params0)
    # Within an ulp or two: torch's eager float32 sqrt is not correctly rounded (funcamp's is).
    for k in got:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-6, atol=1e-7)
    assert sorted(state.inner) == ["decay", "no_decay"]
    assert list(state.inner["decay"].exp_avg) == ["w"] and int(state.inner["decay"].count) == STEPS


def test_masked_freezes_the_rest_and_keeps_no_state_for_it():
    params0 = _params(6)
    opt = funcamp.masked(funcamp.sgd(0.1, momentum=0.9), {"w": True, "b": False})
    got, state = _run(opt, params0, steps=3)
    assert torch.equal(got["b"], params0["b"]) and not torch.equal(got["w"], params0["w"])
    assert list(state.inner.momentum) == ["w"]
    alone, _ = _run(funcamp.sgd(0.1, momentum=0.9), {"w": params0["w"]}, steps=3)
    _equal(got["w"], alone["w"])


_MASKS = {
    "tree": {"w": True, "b": False},
    "callable": lambda params: {k: p.ndim > 1 for k, p in params.items()},  # optax's idiom
}


def _torch_sqrt(self, xs, into=None):
    return self._fresh([torch.sqrt(x) for x in xs])


@pytest.mark.parametrize("mask", sorted(_MASKS))
def test_adamw_mask_is_torch_adamw_with_a_no_decay_group(mask):
    """adamw(weight_decay=wd, mask=m) is torch.optim.AdamW with the groups {m: wd, not m: 0}: bit
    for bit with torch's own float32 square root swapped in (funcamp's is correctly rounded, see
    test_optim.py) and params away from zero (where p + (new_p - p) is new_p exactly); one
    state, one count. optax.adamw(mask=) decays the same leaves (its decay, added to the Adam
    direction before the learning rate, rounds differently)."""
    params0 = _params(8, away_from_zero=True)
    lr, wd, steps = 1e-2, 0.1, 50
    expected = _torch_two_groups(params0, lr, wd, steps=steps, b_lr_factor=1)
    opt = funcamp.adamw(lr, weight_decay=wd, mask=_MASKS[mask])
    with mock.patch.object(EagerOps, "sqrt", _torch_sqrt):
        got, state = _run(opt, params0, steps=steps)
    _equal(got, expected)
    assert isinstance(state, funcamp.optim.AdamState) and int(state.count) == steps
    # and, with funcamp's own square root, exactly the two-group multi_transform
    groups = funcamp.multi_transform(
        {"decay": funcamp.adamw(lr, weight_decay=wd), "plain": funcamp.adamw(lr, weight_decay=0.0)},
        {"w": "decay", "b": "plain"},
    )
    _equal(_run(opt, params0)[0], _run(groups, params0)[0])


def test_lion_mask_is_the_reference_with_no_decay_where_false_eager_and_compiled():
    params0 = _params(9, away_from_zero=True)
    lr, b1, b2, wd = 3e-3, 0.9, 0.99, 0.1
    ref_params, ref_m = _reference_lion(params0, lr, b1, b2, {"w": wd, "b": 0.0})
    opt = funcamp.lion(lr, b1, b2, wd, mask={"w": True, "b": False})
    eager, state = _run(opt, params0)
    _equal(eager, ref_params)
    _equal(state.exp_avg, ref_m)
    torch._dynamo.reset()
    compiled, cstate = _run(
        opt, params0, lambda f: torch.compile(f, backend="aot_eager", fullgraph=True)
    )
    _equal(compiled, ref_params)
    _equal(cstate, state)


@pytest.mark.slow
def test_adamw_mask_compiled_is_eager_and_masks_broadcast_like_optax():
    """A compiled masked update (fullgraph: the mask resolves while tracing) gives the eager
    bits; a prefix mask (one bool per subtree, as optax allows) is the expanded mask; True
    everywhere is no mask; False everywhere selects nothing and is refused."""
    g = torch.Generator().manual_seed(3)
    params0 = {
        "enc": {"w": torch.randn(5, 4, generator=g), "b": torch.randn(4, generator=g)},
        "head": {"w": torch.randn(4, 2, generator=g)},
    }

    def grads_at(params, step):
        gen = torch.Generator().manual_seed(50 + step)
        return optree.tree_map(lambda p: 0.5 * p + torch.randn(p.shape, generator=gen), params)

    def run(opt, compile=False):
        def step(params, state, grads):
            updates, state = opt.update(grads, state, params)
            return funcamp.apply_updates(params, updates), state

        if compile:
            torch._dynamo.reset()
            step = torch.compile(step, backend="aot_eager", fullgraph=True)
        params, state = params0, opt.init(params0)
        for i in range(4):
            params, state = step(params, state, grads_at(params, i))
        return params, state

    full = {"enc": {"w": False, "b": False}, "head": {"w": True}}
    for make in (funcamp.adamw, funcamp.lion):
        eager = run(make(1e-2, weight_decay=0.3, mask=full))
        _equal(run(make(1e-2, weight_decay=0.3, mask=full), compile=True), eager)
        by_shape = lambda ps: optree.tree_map(lambda p: p.ndim > 1 and p.shape[1] < 4, ps)  # noqa: E731
        _equal(run(make(1e-2, weight_decay=0.3, mask=by_shape), compile=True), eager)
        _equal(run(make(1e-2, weight_decay=0.3, mask={"enc": False, "head": True})), eager)
        _equal(run(make(1e-2, weight_decay=0.3, mask=True)), run(make(1e-2, weight_decay=0.3)))
        # False everywhere selects nothing: refused, naming weight_decay=0.0 as the way out
        with pytest.raises(ValueError, match=r"selects none .*weight_decay=0\.0"):
            make(1e-2, weight_decay=0.3, mask=False).init(params0)
        assert not torch.equal(
            eager[0]["head"]["w"], run(make(1e-2, weight_decay=0.0))[0]["head"]["w"]
        )


def test_weight_decay_mask_errors_name_the_argument():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    with pytest.raises(ValueError, match=r"funcamp\.adamw: `mask` must be a pytree of bools with"):
        funcamp.adamw(0.1, mask={"w": True}).init(params)
    with pytest.raises(TypeError, match=r"funcamp\.lion: `mask` must hold Python bools .* \['b'\]"):
        funcamp.lion(0.1, mask={"w": True, "b": torch.tensor(True)}).init(params)
    with pytest.raises(ValueError, match=r"funcamp\.adamw: `mask` must be a pytree"):
        funcamp.adamw(0.1, mask=lambda ps: [True, False]).init(params)


def test_masked_freezes_where_optax_passes_grads_through_and_how_to_pass_them():
    """funcamp.masked: masked-off leaves get zero updates. optax.masked passes their grads
    through unchanged; in funcamp that is multi_transform with the identity (chain())."""
    params = _params(10)
    grads = _grads(params, 0)
    inner = funcamp.sgd(0.1, momentum=0.9)
    frozen = funcamp.masked(inner, {"w": True, "b": False})
    updates, _ = frozen.update(grads, frozen.init(params), params)
    assert torch.equal(updates["b"], torch.zeros_like(grads["b"]))
    passing = funcamp.multi_transform(
        {"on": inner, "off": funcamp.chain()}, {"w": "on", "b": "off"}
    )
    through, state = passing.update(grads, passing.init(params), params)
    assert torch.equal(through["b"], grads["b"])  # the raw gradient, as optax.masked gives it
    _equal(through["w"], updates["w"])  # the inner optimizer's update where the mask is True
    assert state.inner["off"] == ()


def test_param_group_errors_name_the_argument():
    params = {"w": torch.ones(2), "b": torch.ones(1)}
    with pytest.raises(ValueError, match=r"funcamp\.multi_transform: `labels` must be keys of"):
        funcamp.multi_transform({"a": funcamp.sgd(0.1)}, {"w": "a", "b": "z"}).init(params)
    with pytest.raises(
        TypeError, match=r"funcamp\.masked: `mask` must hold Python bools .* \['b'\]"
    ):
        funcamp.masked(funcamp.sgd(0.1), {"w": True, "b": 1}).init(params)
    with pytest.raises(ValueError, match=r"funcamp\.masked: `mask` must have the tree structure"):
        funcamp.masked(funcamp.sgd(0.1), {"w": True}).init(params)
    with pytest.raises(
        TypeError, match=r"funcamp\.multi_transform: `transforms` must be a non-empty"
    ):
        funcamp.multi_transform({}, {})
    with pytest.raises(TypeError, match=r"funcamp\.masked: `optimizer` must be an Optimizer"):
        funcamp.masked("sgd", {"w": True})


# ----------------------------------------------------------------------------- the fast path


def test_combinators_keep_the_fast_path():
    """Each combinator prepares its parts: fresh when they are, the update the plain one's
    (bit for bit) when run writing into grads the caller owns."""
    sgd = funcamp.sgd(0.1)
    params = _params(3)
    grads = {k: v * 0.5 for k, v in params.items()}
    for opt in (
        funcamp.chain(funcamp.clip_by_global_norm(1.0), sgd),
        funcamp.accumulate(funcamp.adam(0.1), 1),
        funcamp.masked(sgd, {"w": True, "b": False}),
        funcamp.multi_transform({"a": sgd, "b": funcamp.adam(0.1)}, {"w": "a", "b": "b"}),
    ):
        state = opt.init(params)
        prepared = funcamp.optim.prepare_update(opt, grads, state, params)
        assert prepared.fresh and opt.prepare is not None
        owned = {k: v.clone() for k, v in grads.items()}
        got = prepared.run(owned, funcamp.optim.Writes(list(owned.values())))
        assert_trees_equal(got, opt.update(grads, state, params))
    plain = funcamp.Optimizer(sgd.init, sgd.update)  # no hook: the pure path
    assert plain.prepare is None and plain.learning_rate is None
    state = funcamp.chain(plain, sgd).init(params)
    assert not funcamp.optim.prepare_update(funcamp.chain(plain, sgd), grads, state, params).fresh


def _pure(opt: funcamp.Optimizer) -> funcamp.Optimizer:
    """``opt`` whose prepared update writes nothing in place (no owned grads, no donated
    state): only the new params where it computes them, as the step installs them."""

    def prepare(grads, state, params=None):
        inner = funcamp.optim.prepare_update(opt, grads, state, params)

        def run(g, writes):
            return inner.run(g, funcamp.optim.Writes(new_params=writes.new_params))

        return inner._replace(run=run, fresh=False)

    return funcamp.Optimizer(opt.init, opt.update, prepare, opt.learning_rate)


@pytest.mark.parametrize("donate", [False, True])
def test_unscale_and_step_gives_the_same_bits_through_the_combinators(donate):
    params0 = _params(7)
    scaler = funcamp.ScalerState.dynamic(4.0)
    for opt in (
        funcamp.chain(funcamp.clip_by_global_norm(1.0), funcamp.adamw(1e-2)),
        funcamp.multi_transform(
            {"a": funcamp.sgd(0.1, momentum=0.9), "b": funcamp.lion(1e-3)}, {"w": "a", "b": "b"}
        ),
        funcamp.adamw(1e-2, weight_decay=0.1, mask={"w": True, "b": False}),
        funcamp.lion(1e-3, weight_decay=0.1, mask=lambda ps: {"w": False, "b": True}),
    ):
        results = []
        for wrap in (lambda o: o, _pure):
            o = wrap(opt)
            params, state = dict(params0), o.init(params0)
            for i in range(3):
                grads = {k: 4.0 * v for k, v in _grads(params, i).items()}
                if i == 1:
                    grads["b"][0] = float("inf")
                params, state, _ = funcamp.unscale_and_step(
                    scaler, o, grads, state, params, donate_grads=donate
                )
            results.append((params, state))
        _equal(*results)


def test_a_prepare_hook_that_is_not_callable_is_refused():
    sgd = funcamp.sgd(0.1)
    with pytest.raises(TypeError, match=r"`transforms\[0\].prepare` must be callable"):
        funcamp.chain(funcamp.Optimizer(sgd.init, sgd.update, object()))
