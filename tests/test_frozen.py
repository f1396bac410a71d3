"""Frozen parameters (``requires_grad=False``): neither differentiated nor updated, no optimizer
state, no weight decay, in every kind of step -- against torch.optim over
``filter(lambda p: p.requires_grad, model.parameters())`` under torch.autocast."""

from __future__ import annotations

import copy
import io

import optree
import pytest
import torch
from exhaustive import exhaustive

import funcamp
import funcamp.distributed as fd
from funcamp.checkpoints.format import state_checksum
from funcamp.testing import assert_trees_equal

POLICY = "autocast_cpu"  # torch.autocast("cpu", bfloat16)'s lists, bit for bit
LR, WD = 1e-2, 0.1
STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8),
        torch.nn.Linear(8, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 1),
    )
    model[0].weight.requires_grad_(False)  # a frozen embedding table
    model[3].bias.requires_grad_(False)  # and a frozen bias
    return model


FROZEN = ["0.weight", "3.bias"]


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 10, (12,), generator=g), torch.randn(12, 1, generator=g))
        for _ in range(n)
    ]


def _loss_for(model):
    def loss_fn(params, buffers, batch):
        ids, y = batch
        out = torch.func.functional_call(model, (params, buffers), (ids,))
        return torch.nn.functional.mse_loss(out.float(), y)

    return loss_fn


def _torch_reference(model, batches, autocast=True):
    """torch.optim over the trainable params under torch.autocast: the model after the steps."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], LR, weight_decay=WD)
    for ids, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = ref(ids)
        torch.nn.functional.mse_loss(out.float(), y).backward()
        opt.step()
    return ref


def _check_against(model, state, ref, start):
    named = dict(ref.named_parameters())
    assert sorted(state.frozen) == FROZEN
    assert sorted(state.params) == sorted(set(named) - set(FROZEN))
    for name in FROZEN:  # frozen: bit for bit where they started, in the state and the module
        assert torch.equal(state.frozen[name], start[name])
        assert torch.equal(dict(model.named_parameters())[name], start[name])
    for name, value in state.params.items():
        torch.testing.assert_close(value, named[name].detach(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(value, start[name])  # it trained


@pytest.mark.parametrize(
    ("compile", "donate"),
    [(False, True), (False, False), (True, True), pytest.param(True, False, marks=exhaustive)],
)
def test_frozen_params_stay_put_and_the_rest_trains_as_torch_optim(compile, donate):
    model = _model()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    params, buffers = funcamp.params_and_buffers(model)
    opt = funcamp.adamw(LR, weight_decay=WD)
    state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers)
    how = funcamp.Compile(backend="aot_eager") if compile else False
    step = funcamp.make_train_step(_loss_for(model), opt, POLICY, compile=how, donate_state=donate)
    batches = _batches()
    for batch in batches:
        state, _ = step(state, batch)
    _check_against(model, state, _torch_reference(_model(), batches), start)
    # optimizer state only for the trained params: AdamW's two moments of each
    moments = optree.tree_leaves(state.opt_state.exp_avg) + optree.tree_leaves(
        state.opt_state.exp_avg_sq
    )
    assert sum(m.numel() for m in moments) == 2 * sum(p.numel() for p in state.params.values())


@pytest.mark.slow
def test_frozen_params_under_inductor():
    """The default compiled step (inductor), in float32: against torch.optim to rounding."""
    model = _model()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    params, buffers = funcamp.params_and_buffers(model)
    opt = funcamp.adamw(LR, weight_decay=WD)
    state = funcamp.TrainState.create(params, opt, "float32", buffers=buffers)
    step = funcamp.make_train_step(_loss_for(model), opt, "float32")
    batches = _batches()
    for batch in batches:
        state, _ = step(state, batch)
    _check_against(model, state, _torch_reference(_model(), batches, autocast=False), start)


def test_no_weight_decay_on_frozen_and_zero_loss_grad_moves_nothing():
    """A frozen param gets no weight decay even where its loss gradient is zero (decay alone
    would move it), as torch.optim skips a param whose grad is None."""
    model = _model()
    w0 = model[0].weight.detach().clone()
    params, buffers = funcamp.params_and_buffers(model)
    opt = funcamp.adamw(0.5, weight_decay=0.9)
    state = funcamp.TrainState.create(params, opt, "float32", buffers=buffers)
    step = funcamp.make_train_step(_loss_for(model), opt, "float32", compile=False)
    for batch in _batches(3):
        state, _ = step(state, batch)
    assert torch.equal(state.frozen["0.weight"], w0)


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda o: funcamp.accumulate(o, every=2), id="accumulate"),
        pytest.param(lambda o: funcamp.masked(o, lambda path: path != "1.bias"), id="masked"),
        pytest.param(
            lambda o: funcamp.multi_transform(
                {"a": o, "b": funcamp.sgd(0.1)}, lambda path: "b" if path == "3.weight" else "a"
            ),
            id="multi_transform",
        ),
        pytest.param(lambda o: funcamp.chain(funcamp.clip_by_global_norm(1.0), o), id="chain"),
    ],
)
def test_combinators_see_only_the_trained_params(wrap):
    model = _model()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    params, buffers = funcamp.params_and_buffers(model)
    opt = wrap(funcamp.adamw(LR, weight_decay=WD))
    state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers)
    step = funcamp.make_train_step(_loss_for(model), opt, POLICY, compile=False)
    for batch in _batches(4):
        state, _ = step(state, batch)
    for name in FROZEN:
        assert torch.equal(state.frozen[name], start[name])
    held = {
        str(path[-1])
        for path in optree.tree_paths(state.opt_state)
        if path and isinstance(path[-1], str)
    }
    assert not held & set(FROZEN)  # no optimizer state anywhere for a frozen param


def test_accumulate_matches_torch_over_the_trainable_params():
    """accumulate(every=2) with frozen params is torch.optim stepping every second batch on the
    mean of two batches' gradients, over the trainable params only."""
    model = _model()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    params, buffers = funcamp.params_and_buffers(model)
    opt = funcamp.accumulate(funcamp.adamw(LR, weight_decay=WD), every=2)
    state = funcamp.TrainState.create(params, opt, "float32", buffers=buffers)
    step = funcamp.make_train_step(_loss_for(model), opt, "float32", compile=False)
    batches = _batches(4)
    for batch in batches:
        state, _ = step(state, batch)
    ref = copy.deepcopy(_model())
    torch_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], LR, weight_decay=WD
    )
    for i, (ids, y) in enumerate(batches):
        (torch.nn.functional.mse_loss(ref(ids), y) / 2).backward()
        if i % 2 == 1:
            torch_opt.step()
            torch_opt.zero_grad()
    _check_against(model, state, ref, start)


def test_data_parallel_and_sharded_one_rank_match_the_plain_step(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    batches = _batches()
    opt = funcamp.adamw(LR, weight_decay=WD)

    def run(parallel=None):
        model = _model()
        params, buffers = funcamp.params_and_buffers(model)
        state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers)
        if isinstance(parallel, fd.Sharded):
            state = fd.shard(state, mesh)
        step = funcamp.make_train_step(
            _loss_for(model), opt, POLICY, parallel=parallel, compile=False, donate_state=False
        )
        for batch in batches:
            state, _ = step(state, batch)
        return state

    plain = run()
    dp = run(fd.DataParallel(single_rank_group))
    sharded = run(fd.Sharded(mesh))
    assert_trees_equal(funcamp.state_dict(plain), funcamp.state_dict(dp))
    assert sorted(sharded.frozen) == FROZEN
    assert not any(hasattr(x, "full_tensor") for x in sharded.frozen.values())  # kept whole
    full = optree.tree_map(
        lambda x: x.full_tensor() if hasattr(x, "full_tensor") else x, sharded.params
    )
    assert_trees_equal(plain.params, full)
    assert_trees_equal(plain.frozen, sharded.frozen)


def test_trainable_by_pattern_callable_and_true():
    model = _model()
    params, _ = funcamp.params_and_buffers(model)
    opt = funcamp.sgd(0.1)
    by_glob = funcamp.TrainState.create(params, opt, "float32", trainable="3.*")
    assert sorted(by_glob.params) == ["3.bias", "3.weight"]  # the pattern wins over the module
    by_list = funcamp.TrainState.create(params, opt, "float32", trainable=["1.*", "3.weight"])
    assert sorted(by_list.params) == ["1.bias", "1.weight", "3.weight"]
    by_fn = funcamp.TrainState.create(params, opt, "float32", trainable=lambda p: p == "1.bias")
    assert sorted(by_fn.params) == ["1.bias"]
    everything = funcamp.TrainState.create(params, opt, "float32", trainable=True)
    assert everything.frozen == {} and len(everything.params) == 5
    plain = {k: v.detach().clone() for k, v in model.named_parameters()}  # plain tensors train
    assert funcamp.TrainState.create(plain, opt, "float32").frozen == {}
    # nested dicts split by key, in the params' order
    nested = {"enc": {"w": params["0.weight"], "b": torch.zeros(2)}, "head": torch.ones(3)}
    state = funcamp.TrainState.create(nested, opt, "float32")
    assert list(state.params) == ["enc", "head"] and list(state.params["enc"]) == ["b"]
    assert list(state.frozen) == ["enc"] and list(state.frozen["enc"]) == ["w"]


def test_bad_trainable_and_all_frozen_are_clear_errors():
    model = _model()
    params, _ = funcamp.params_and_buffers(model)
    opt = funcamp.sgd(0.1)
    with pytest.raises(ValueError, match=r"`trainable` pattern 'decoder\.\*' matches no parameter"):
        funcamp.TrainState.create(params, opt, "float32", trainable=["3.*", "decoder.*"])
    with pytest.raises(ValueError, match=r"every one of the 5 parameters is frozen"):
        funcamp.TrainState.create(params, opt, "float32", trainable=lambda p: False)
    with pytest.raises(ValueError, match=r"`trainable` must name at least one pattern"):
        funcamp.TrainState.create(params, opt, "float32", trainable=[])
    with pytest.raises(TypeError, match=r"`trainable` must return a bool .* got int"):
        funcamp.TrainState.create(params, opt, "float32", trainable=lambda p: 1)
    with pytest.raises(TypeError, match=r"`trainable` must be None"):
        funcamp.TrainState.create(params, opt, "float32", trainable=3)
    frozen_model = _model().requires_grad_(False)
    with pytest.raises(ValueError, match=r"every one of the 5 parameters is frozen.*unfreeze"):
        funcamp.TrainState.create(funcamp.params_and_buffers(frozen_model)[0], opt, "float32")
    listed = [params["0.weight"], params["1.weight"]]  # a frozen leaf not in a dict
    with pytest.raises(TypeError, match=r"frozen parameters must sit in dicts"):
        funcamp.TrainState.create(listed, opt, "float32")


def test_a_state_whose_frozen_names_overlap_the_params_is_refused():
    model = _model()
    params, buffers = funcamp.params_and_buffers(model)
    opt = funcamp.sgd(0.1)
    state = funcamp.TrainState.create(params, opt, "float32", buffers=buffers)
    bad = state._replace(frozen={**state.frozen, "1.weight": state.params["1.weight"].clone()})
    step = funcamp.make_train_step(_loss_for(model), opt, "float32", compile=False)
    with pytest.raises(ValueError, match=r"'1\.weight' is both in `state\.params` and in"):
        step(bad, _batches(1)[0])


def test_checkpoints_load_into_module_and_old_checkpoints():
    model = _model()
    params, buffers = funcamp.params_and_buffers(model)
    opt = funcamp.adamw(LR, weight_decay=WD)
    state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers)
    step = funcamp.make_train_step(_loss_for(model), opt, POLICY, compile=False, donate_state=False)
    state, _ = step(state, _batches(1)[0])
    buf = io.BytesIO()
    torch.save(funcamp.state_dict(state), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sorted(sd["frozen"]) == FROZEN
    template = funcamp.TrainState.create(*[funcamp.params_and_buffers(_model())[0]], opt, POLICY)
    back = funcamp.load_state_dict(template._replace(buffers=state.buffers), sd)
    assert_trees_equal(funcamp.state_dict(back), sd)

    # load_into_module writes params and frozen params; a dict of the trained ones alone is
    # enough (a frozen parameter left out is not written)
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    funcamp.load_into_module(other, state)
    for name, p in other.named_parameters():
        want = state.frozen[name] if name in state.frozen else state.params[name]
        assert torch.equal(p, want)
    third = _model()
    funcamp.load_into_module(third, state.params)
    assert torch.equal(third[1].weight, state.params["1.weight"])
    missing = {k: v for k, v in state.params.items() if k != "1.weight"}
    with pytest.raises(ValueError, match=r"missing '1\.weight'"):
        funcamp.load_into_module(_model(), missing)


def test_a_checkpoint_without_frozen_params(tmp_path):
    """Written before TrainState.frozen (no 'frozen' key, every param trained): it loads into a
    template without frozen params as before, and into one with frozen params the error says
    how to load it; nothing is changed on failure."""
    model = _model()
    params, buffers = funcamp.params_and_buffers(model)
    opt = funcamp.adamw(LR)
    old = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers, trainable=True)
    path = tmp_path / "old.pt"
    funcamp.save(path, old, policy=POLICY)
    raw = torch.load(path, weights_only=True)
    raw["state"].pop("frozen")  # as a checkpoint of the release before this field
    raw["checksum"] = state_checksum([raw["info"], raw["state"]])
    torch.save(raw, path)
    like_before = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers, trainable=True)
    loaded = funcamp.load(path, like_before, policy=POLICY)
    assert_trees_equal(loaded.params, old.params)
    template = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers)
    before = funcamp.state_dict(template)
    with pytest.raises(ValueError, match=r"trainable=True\) to resume it as it was trained"):
        funcamp.load(path, template, policy=POLICY)
    assert_trees_equal(funcamp.state_dict(template), before)


def test_donated_state_refused_after_40_steps_eager_and_compiled():
    for compile in (False, True):
        model = _model()
        params, buffers = funcamp.params_and_buffers(model)
        opt = funcamp.sgd(1e-3)
        start = funcamp.TrainState.create(params, opt, "float32", buffers=buffers)
        how = funcamp.Compile(backend="eager") if compile else False
        step = funcamp.make_train_step(_loss_for(model), opt, "float32", compile=how)
        batch = _batches(1)[0]
        state = start
        seen = [start]
        for _ in range(41):
            state, _ = step(state, batch)
            seen.append(state)
        for old in (seen[0], seen[1], seen[20], seen[40]):
            with pytest.raises(ValueError, match=r"`state` was donated to an earlier train step"):
                step(old, batch)
        state, _ = step(state, batch)  # the newest state still steps


def test_the_donation_registry_keeps_no_state_alive():
    import gc
    import weakref

    model = torch.nn.Linear(3, 1)
    params, _ = funcamp.params_and_buffers(model)
    opt = funcamp.sgd(0.1)
    step = funcamp.make_train_step(
        lambda p, b, x: torch.func.functional_call(model, p, (x,)).sum(),
        opt,
        "float32",
        compile=False,
    )
    state = funcamp.TrainState.create(params, opt, "float32")
    first = weakref.ref(state.scaler)
    for _ in range(3):
        state, _ = step(state, torch.ones(2, 3))
    gc.collect()
    assert first() is None  # the donated states' scalers are gone


def test_states_from_one_scaler_object_are_told_apart():
    """TrainState.create gives each state its own scaler object: donating one state built from
    a shared ScalerState does not refuse another built from it."""
    scaler = funcamp.ScalerState.dynamic(init_scale=8.0)
    opt = funcamp.sgd(0.1)
    loss = lambda p, b, x: (p["w"] * x).sum()  # noqa: E731
    step = funcamp.make_train_step(loss, opt, "float32", compile=False)
    a = funcamp.TrainState.create({"w": torch.ones(2)}, opt, "float32", scaler=scaler)
    b = funcamp.TrainState.create({"w": torch.ones(2)}, opt, "float32", scaler=scaler)
    step(a, torch.ones(2))
    step(b, torch.ones(2))


def test_roformer_keeps_its_frozen_sinusoidal_table():
    """transformers' RoFormer freezes its sinusoidal position table (requires_grad=False):
    it stays bit-identical through a compiled step, as under torch.optim."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.RoFormerConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, embedding_size=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.RoFormerForMaskedLM(config)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen  # the sinusoidal table
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    params, buffers = funcamp.params_and_buffers(model)
    opt = funcamp.adamw(1e-2, weight_decay=0.1)
    state = funcamp.TrainState.create(params, opt, "mixed_bfloat16", buffers=buffers)
    assert sorted(state.frozen) == sorted(frozen)

    def loss_fn(p, b, batch):
        return torch.func.functional_call(model, (p, b), (), batch).loss

    step = funcamp.make_train_step(
        loss_fn, opt, "mixed_bfloat16", compile=funcamp.Compile(backend="aot_eager")
    )
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        state, _ = step(state, {"input_ids": ids, "labels": ids})
    for name in frozen:
        assert torch.equal(state.frozen[name], start[name])
        assert torch.equal(dict(model.named_parameters())[name], start[name])
    assert not torch.equal(state.params[sorted(state.params)[0]], start[sorted(state.params)[0]])
