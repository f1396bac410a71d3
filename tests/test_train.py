"""Tests for the train layer: TrainState, params_and_buffers, make_train_step."""

from __future__ import annotations

import copy
import itertools

import optree
import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.func import functional_call

import funcamp
import funcamp.train.loss
from funcamp.scaling.skip import device_path

#: The optree namespace funcamp documents for its state types (docs/concepts.md).
NAMESPACE = "funcamp"

POLICY = "mixed_float16"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


MODEL = _mlp()


def loss_fn(params, buffers, batch):
    x, y = batch
    return nn.functional.cross_entropy(functional_call(MODEL, (params, buffers), (x,)), y)


def _optimizer() -> funcamp.Optimizer:
    schedule = funcamp.linear_warmup_cosine_decay(3e-2, 10, 100, end_value=1e-3)
    return funcamp.chain(funcamp.clip_by_global_norm(5.0), funcamp.adam(schedule))


OPT = _optimizer()


def _state(policy: str = POLICY, **kw) -> funcamp.TrainState:
    params, buffers = funcamp.params_and_buffers(MODEL)
    scaler = kw.pop("scaler", funcamp.ScalerState.dynamic(2.0**12, growth_interval=4))
    return funcamp.TrainState.create(params, OPT, policy, buffers=buffers, scaler=scaler, **kw)


def _batches(n: int, *, bad_every: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(8, 6, generator=g)
        if bad_every and i % bad_every == bad_every - 1:
            x[0, 0] = float("inf")
        out.append((x, torch.randint(0, 3, (8,), generator=g)))
    return out


def _leaves(tree):
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def _assert_close(a, b, atol=1e-5):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, atol=atol, rtol=atol, equal_nan=True)


def _assert_equal(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.fixture(scope="module")
def compiled_step():
    """A step compiled with aot_eager (tracing is what these tests check), shared."""
    return funcamp.make_train_step(
        loss_fn, OPT, POLICY, compile=funcamp.Compile(backend="aot_eager"), donate_state=False
    )


@pytest.fixture(scope="module")
def inductor_step():
    """The default (inductor) compiled step, float32 compute so it matches eager to 1e-5."""
    return funcamp.make_train_step(loss_fn, OPT, "float32", donate_state=False)


@pytest.fixture(scope="module")
def eager_step():
    return funcamp.make_train_step(loss_fn, OPT, POLICY, compile=False, donate_state=False)


# ------------------------------------------------------------------------------ construction


def test_train_state_create_casts_and_inits():
    params = {"w": torch.tensor([1.001, 2.0])}
    opt = funcamp.adam(1e-3, master_weights=True)
    state = funcamp.TrainState.create(params, opt, "bf16-true")
    assert state.params["w"].dtype == torch.bfloat16
    # masters come from the float32 params as given, not from the bf16 cast
    assert torch.equal(state.opt_state.low.master["w"], params["w"])
    assert state.scaler.kind == "noop" and state.buffers == {}
    assert funcamp.TrainState.create(params, opt, "mixed_float16").scaler.kind == "dynamic"


def test_train_state_create_errors():
    with pytest.raises(TypeError, match=r"funcamp.TrainState.create: `params` leaf \['i'\]"):
        funcamp.TrainState.create({"i": torch.arange(2)}, OPT, POLICY)
    with pytest.raises(TypeError, match=r"`optimizer` must be a funcamp.Optimizer"):
        funcamp.TrainState.create({"w": torch.ones(1)}, "adam", POLICY)
    with pytest.raises(TypeError, match="`policy` must be"):
        funcamp.TrainState.create({"w": torch.ones(1)}, OPT, 3)


def test_params_and_buffers():
    bn = nn.BatchNorm1d(3)
    params, buffers = funcamp.params_and_buffers(bn)
    assert set(params) == {"weight", "bias"}
    assert set(buffers) == {"running_mean", "running_var", "num_batches_tracked"}
    assert not params["weight"].requires_grad
    assert params["weight"].data_ptr() == bn.weight.data_ptr()
    with pytest.raises(TypeError, match=r"funcamp.params_and_buffers: `module` must be"):
        funcamp.params_and_buffers({"w": torch.ones(1)})


def test_train_state_is_a_pytree_for_both_registries():
    state = _state()
    leaves, spec = torch.utils._pytree.tree_flatten(state)
    assert torch.utils._pytree.tree_unflatten(leaves, spec).scaler.growth_interval == 4
    assert len(leaves) == len(_leaves(state))


# ------------------------------------------------------------------------------ compiled step


@pytest.mark.slow
def test_compiled_one_graph_no_recompiles_matches_eager(compiled_step, eager_step):
    """100 steps: LR schedule, growing/backing-off scale, injected overflows, 1 graph."""
    batches = _batches(100, bad_every=17)
    counters.clear()
    s_c = s_e = _state()
    scales, found = [], []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in batches:
            s_c, m_c = compiled_step(s_c, b)
            s_e, m_e = eager_step(s_e, b)
            scales.append(float(m_c["scale"]))
            found.append(bool(m_c["found_inf"]))
            _assert_close(m_c, m_e)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    assert len(set(scales)) > 2  # the scale grew and backed off
    assert sum(found) == int(s_c.scaler.skipped) >= 100 // 17
    _assert_close(s_c, s_e)
    # the schedule's count only counts applied steps
    assert int(s_c.opt_state[1].count) == 100 - sum(found)


@pytest.mark.slow
def test_inductor_matches_eager(inductor_step):
    eager = funcamp.make_train_step(loss_fn, OPT, "float32", compile=False, donate_state=False)
    s_c = s_e = _state("float32")
    counters.clear()
    for b in _batches(12, bad_every=5):
        s_c, m_c = inductor_step(s_c, b)
        s_e, m_e = eager(s_e, b)
        _assert_close(m_c, m_e)
    _assert_close(s_c, s_e)
    assert int(s_c.scaler.skipped) == 2
    assert counters["stats"]["unique_graphs"] == 1


def test_steps_do_not_share_graphs(compiled_step):
    """Each step has its own compiled code even though closure guards are filtered out."""
    doubled = funcamp.make_train_step(
        lambda p, b, batch: 2.0 * loss_fn(p, b, batch),
        OPT,
        POLICY,
        compile=funcamp.Compile(backend="aot_eager"),
        donate_state=False,
    )
    batch = _batches(1)[0]
    _, m1 = compiled_step(_state(), batch)
    _, m2 = doubled(_state(), batch)
    torch.testing.assert_close(m2["loss"], 2.0 * m1["loss"])


def test_metrics(compiled_step):
    state = _state()
    x, y = _batches(1)[0]
    _, m = compiled_step(state, (x, y))
    assert set(m) == {"loss", "grad_norm", "scale", "found_inf", "skipped", "lr"}
    assert m["loss"].dtype == torch.float32 and m["loss"].dim() == 0
    with torch.no_grad():
        ref = nn.functional.cross_entropy(MODEL(x), y)
    torch.testing.assert_close(m["loss"], ref, atol=2e-3, rtol=2e-3)  # float16 matmuls
    assert float(m["scale"]) == 2.0**12 and not bool(m["found_inf"]) and int(m["skipped"]) == 0
    assert float(m["grad_norm"]) > 0


def test_skipped_step_is_bit_identical(compiled_step, eager_step):
    state = _state()
    for b in _batches(3):
        state, _ = eager_step(state, b)
    bad = _batches(1, bad_every=1)[0]
    for step in (compiled_step, eager_step):
        new, m = step(state, bad)
        assert bool(m["found_inf"]) and int(m["skipped"]) == 1
        _assert_equal(new.params, state.params)
        _assert_equal(new.opt_state, state.opt_state)
        assert int(new.opt_state[1].count) == int(state.opt_state[1].count) == 3
        assert float(new.scaler.scale) == float(state.scaler.scale) / 2


def test_input_state_is_not_modified(eager_step):
    state = _state()
    before = copy.deepcopy(funcamp.state_dict(state))
    eager_step(state, _batches(1)[0])
    _assert_equal(funcamp.state_dict(state), before)


# ------------------------------------------------------------------------------ host sync


def _forbid_sync(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("host sync on the step path")

    for name in ("item", "__bool__", "tolist", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, boom)


def test_no_host_sync(inductor_step, monkeypatch):
    compiled_step = inductor_step
    state = _state("float32")
    batches = _batches(4, bad_every=2)
    compiled_step(state, batches[0])  # traced and compiled before the patch
    eager = funcamp.make_train_step(loss_fn, OPT, POLICY, compile=False, donate_state=False)
    eager(state, batches[0])  # first-call validation runs outside the patch
    # The eager step runs the device path: a CPU eager step reads its skip flag once, as
    # GradScaler.step does (test_host_sync pins that read); a CUDA step reads nothing.
    with monkeypatch.context() as mp, device_path():
        _forbid_sync(mp)
        s_c = s_e = state
        for b in batches:
            s_c, _ = compiled_step(s_c, b)
            s_e, _ = eager(s_e, b)
    assert int(s_c.scaler.skipped) == int(s_e.scaler.skipped) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_cuda():  # pragma: no cover - needs a GPU
    model = _mlp().cuda()

    def cuda_loss(params, buffers, batch):
        x, y = batch
        return nn.functional.cross_entropy(functional_call(model, (params, buffers), (x,)), y)

    params, buffers = funcamp.params_and_buffers(model)
    state = funcamp.TrainState.create(params, OPT, POLICY, buffers=buffers)
    batches = [tuple(t.cuda() for t in b) for b in _batches(4, bad_every=2)]
    for compile in (False, True):
        step = funcamp.make_train_step(cuda_loss, OPT, POLICY, compile=compile, donate_state=False)
        s, _ = step(state, batches[0])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for b in batches:
                s, _ = step(s, b)
        finally:
            torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------------ buffers


def _bn_model() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("returns_buffers", [False, True])
def test_batchnorm_buffers_match_torch(returns_buffers):
    model = _bn_model()
    ref = copy.deepcopy(model)
    params, buffers = funcamp.params_and_buffers(model)

    def bn_loss(p, b, batch):
        x, y = batch
        if returns_buffers:
            b = {k: v.clone() for k, v in b.items()}
        loss = nn.functional.mse_loss(functional_call(model, (p, b), (x,)), y)
        return (loss, b) if returns_buffers else loss

    opt = funcamp.sgd(0.1)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 5, generator=g), torch.randn(16, 2, generator=g)) for _ in range(5)]
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        torch_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        torch_opt.step()
    for kw in ({"compile": False}, {"compile": funcamp.Compile(backend="aot_eager")}):
        step = funcamp.make_train_step(
            bn_loss, opt, "float32", returns_buffers=returns_buffers, donate_state=False, **kw
        )
        state = funcamp.TrainState.create(params, opt, "float32", buffers=buffers)
        for b in batches:
            state, _ = step(state, b)
        for name, buf in ref.named_buffers():
            torch.testing.assert_close(state.buffers[name], buf, atol=1e-6, rtol=1e-6)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(state.params[name], p.detach(), atol=1e-6, rtol=1e-6)
    # the module's own buffers were never touched
    assert int(model[1].num_batches_tracked) == 0
    assert torch.equal(model[1].running_mean, torch.zeros(8))


def test_has_aux():
    def aux_loss(p, b, batch):
        x, y = batch
        logits = functional_call(MODEL, (p, b), (x,))
        return nn.functional.cross_entropy(logits, y), {"acc": (logits.argmax(1) == y).float()}

    step = funcamp.make_train_step(
        aux_loss, OPT, POLICY, has_aux=True, compile=False, donate_state=False
    )
    _, m = step(_state(), _batches(1)[0])
    assert m["aux"]["acc"].shape == (8,)


# ------------------------------------------------------------------------------ errors


def _eager_and_compiled(fn, **kw):
    return [
        funcamp.make_train_step(fn, OPT, POLICY, compile=False, donate_state=False, **kw),
        funcamp.make_train_step(
            fn, OPT, POLICY, compile=funcamp.Compile(backend="aot_eager"), donate_state=False, **kw
        ),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        lambda p, b, batch: loss_fn(p, b, batch).reshape(1),
        lambda p, b, batch: loss_fn(p, b, batch).long(),
        lambda p, b, batch: 1.0,
    ],
    ids=["non-scalar", "integer", "float"],
)
def test_bad_loss(bad):
    for step in _eager_and_compiled(bad):
        with pytest.raises(
            TypeError, match=r"funcamp.make_train_step: `loss_fn` must return a 0-d"
        ):
            step(_state(), _batches(1)[0])


def test_has_aux_without_tuple():
    for step in _eager_and_compiled(loss_fn, has_aux=True):
        with pytest.raises(TypeError, match=r"must return a tuple \(loss, aux\) with has_aux"):
            step(_state(), _batches(1)[0])


def test_mismatched_opt_state():
    state = _state()
    other = funcamp.adam(1e-3).init({"w": torch.zeros(3)})
    bad = state._replace(opt_state=(state.opt_state[0], other))
    for step in _eager_and_compiled(loss_fn):
        with pytest.raises(ValueError, match=r"funcamp.make_train_step: `state.opt_state` must"):
            step(bad, _batches(1)[0])
    bad = state._replace(params={**state.params, "0.weight": torch.zeros(16, 7)})
    with pytest.raises(ValueError, match=r"`state.opt_state` leaf .*shape \(16, 7\)"):
        funcamp.make_train_step(loss_fn, OPT, POLICY, compile=False, donate_state=False)(
            bad, _batches(1)[0]
        )


def test_batch_structure_change():
    step = funcamp.make_train_step(loss_fn, OPT, POLICY, compile=False, donate_state=False)
    x, y = _batches(1)[0]
    state, _ = step(_state(), (x, y))
    with pytest.raises(ValueError, match="`batch` must keep the structure of the first batch"):
        step(state, [x, y])
    with pytest.raises(ValueError, match="`batch` must keep the structure"):
        step(state, (x, y, y))


def test_argument_errors():
    with pytest.raises(TypeError, match=r"funcamp.make_train_step: `loss_fn` must be callable"):
        funcamp.make_train_step(3, OPT, POLICY, donate_state=False)
    with pytest.raises(TypeError, match=r"`optimizer` must be a funcamp.Optimizer"):
        funcamp.make_train_step(loss_fn, torch.optim.SGD, POLICY, donate_state=False)
    with pytest.raises(TypeError, match="`has_aux` must be a bool"):
        funcamp.make_train_step(loss_fn, OPT, POLICY, has_aux=1, donate_state=False)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'mode'"):
        funcamp.make_train_step(loss_fn, OPT, POLICY, compile=False, mode="max-autotune")
    if not torch.distributed.is_initialized():  # group= is tested in test_distributed.py
        with pytest.raises(RuntimeError, match=r"`group` needs torch\.distributed initialized"):
            funcamp.make_train_step(
                loss_fn,
                OPT,
                POLICY,
                parallel=funcamp.distributed.DataParallel(object()),
                donate_state=False,
            )
    step = funcamp.make_train_step(loss_fn, OPT, POLICY, compile=False, donate_state=False)
    with pytest.raises(TypeError, match=r"`state` must be a funcamp.TrainState"):
        step(tuple(_state()), _batches(1)[0])


# ------------------------------------------------------------------------------ donate_state


def _own(state: funcamp.TrainState) -> funcamp.TrainState:
    """The state with every tensor copied (``_state`` shares MODEL's parameter memory)."""
    return optree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state, namespace=NAMESPACE
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_donated_step_matches_and_reuses_the_input_tensors(backend, inductor_step, compiled_step):
    kw = {"compile": False} if backend is None else {"compile": funcamp.Compile(backend=backend)}
    policy = POLICY
    # against the module's plain steps of the same settings: one compile less
    if backend == "inductor":
        policy, plain = "float32", inductor_step
    elif backend == "aot_eager":
        plain = compiled_step
    else:
        plain = funcamp.make_train_step(loss_fn, OPT, policy, donate_state=False, **kw)
    donated = funcamp.make_train_step(loss_fn, OPT, policy, donate_state=True, **kw)
    s_p, s_d = _own(_state(policy)), _own(_state(policy))
    module_params = [p.detach().clone() for p in MODEL.parameters()]
    for b in _batches(12, bad_every=5):
        old = s_d
        s_p, m_p = plain(s_p, b)
        s_d, m_d = donated(s_d, b)
        _assert_close(m_d, m_p, atol=0)  # bit for bit (a skipped step's grad_norm is nan)
        _assert_equal(s_d, s_p)  # skipped steps (every 5th) included
        # the new params and optimizer state live in the input state's tensors
        for new, prev in zip(_leaves((s_d.params, s_d.opt_state)), _leaves(old[::2])):
            assert new is prev
        assert s_d.scaler.scale is not old.scaler.scale
    assert int(s_d.scaler.skipped) == 2
    for p, q in zip(MODEL.parameters(), module_params):  # _own: MODEL was not written to
        assert torch.equal(p, q)


@pytest.mark.slow
def test_donated_step_writes_batchnorm_buffers_in_place():
    model = _bn_model()

    def bn_loss(p, b, batch):
        x, y = batch
        return nn.functional.mse_loss(functional_call(model, (p, b), (x,)), y)

    opt = funcamp.sgd(0.1, momentum=0.9)
    params, buffers = funcamp.params_and_buffers(model)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 5, generator=g), torch.randn(16, 2, generator=g)) for _ in range(4)]
    plain = funcamp.make_train_step(
        bn_loss, opt, "float32", compile=funcamp.Compile(backend="aot_eager"), donate_state=False
    )
    donated = funcamp.make_train_step(
        bn_loss, opt, "float32", compile=funcamp.Compile(backend="aot_eager"), donate_state=True
    )
    s_p = funcamp.TrainState.create(params, opt, "float32", buffers=buffers)
    s_d = _own(s_p)
    mean = s_d.buffers["1.running_mean"]
    for b in batches:
        s_p, _ = plain(s_p, b)
        s_d, _ = donated(s_d, b)
    _assert_equal(s_d, s_p)
    assert s_d.buffers["1.running_mean"] is mean and int(s_d.buffers["1.num_batches_tracked"]) == 4


def test_donate_state_errors():
    with pytest.raises(TypeError, match="`donate_state` must be a bool"):
        funcamp.make_train_step(loss_fn, OPT, POLICY, donate_state=1)
    step = funcamp.make_train_step(loss_fn, OPT, POLICY, compile=False, donate_state=True)
    state = _own(_state())
    w = state.params["0.weight"]
    shared = state._replace(params={**state.params, "2.weight": w.view(-1)[:48].view(3, 16)})
    before = _leaves(state)
    with pytest.raises(ValueError, match=r"state.params\['0.weight'\] and .* share memory"):
        step(shared, _batches(1)[0])
    needs_grad = state._replace(params={**state.params, "0.bias": torch.zeros(16).requires_grad_()})
    with pytest.raises(ValueError, match=r"state.params\['0.bias'\] requires grad"):
        step(needs_grad, _batches(1)[0])
    for x, y in zip(before, _leaves(state)):  # nothing was written before the errors
        assert torch.equal(x, y)


# --------------------------------------------------------------- errors from a compiled step
def _graph_breaking_loss(params, buffers, batch):
    x, y = batch
    torch._dynamo.graph_break()  # stands in for a model call dynamo cannot trace
    return ((x @ params["w"]) - y).pow(2).mean()


def test_a_failed_trace_leaves_a_donated_state_as_it_was():
    """The eager re-run that explains a failed trace runs on copies of a donated state (made
    only then, not on every call): the caller's state is untouched and can be used again."""
    opt = funcamp.adam(0.1)
    state = funcamp.TrainState.create({"w": torch.randn(3, 2)}, opt, "float32")
    before = [x.clone() for x in _leaves(state)]
    w = state.params["w"].clone()
    strict = funcamp.Compile(backend="eager", fullgraph=True)
    step = funcamp.make_train_step(_graph_breaking_loss, opt, "float32", compile=strict)
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    with pytest.raises(RuntimeError, match="cannot be compiled as one graph"):
        step(state, batch)
    for x, y in zip(before, _leaves(state)):
        assert torch.equal(x, y)
    eager = funcamp.make_train_step(_graph_breaking_loss, opt, "float32", compile=False)
    new, _ = eager(state, batch)  # not refused as donated: the failed call wrote nothing
    assert not torch.equal(new.params["w"], w)


def _shape_bug_loss(params, buffers, batch):
    x, y = batch
    return ((x @ params["w"].T) - y).pow(2).mean()


def test_graph_break_in_loss_fn_is_one_paragraph_naming_the_call_and_the_ways_out():
    opt = funcamp.sgd(0.1)
    state = funcamp.TrainState.create({"w": torch.randn(3, 2)}, opt, "float32")
    step = funcamp.make_train_step(
        _graph_breaking_loss,
        opt,
        "float32",
        compile=funcamp.Compile(backend="eager", fullgraph=True),
        donate_state=False,
    )
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    with pytest.raises(RuntimeError) as info:
        step(state, batch)
    message = str(info.value)
    assert message.startswith("funcamp.make_train_step: the step cannot be compiled as one graph")
    assert "test_train.py" in message and "_graph_breaking_loss" in message
    assert "torch._dynamo.graph_break()" in message
    assert "fullgraph='auto'" in message and "compile=False" in message
    assert "\n" not in message  # one paragraph; dynamo's report is chained
    assert isinstance(info.value.__cause__, torch._dynamo.exc.Unsupported)
    # the ways out it names work
    eager = funcamp.make_train_step(
        _graph_breaking_loss, opt, "float32", compile=False, donate_state=False
    )
    _, metrics = eager(state, batch)
    assert torch.isfinite(metrics["loss"])


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        h = self.lin(x)
        if h.mean().item() > 100:  # a Python branch on a value: no single graph holds it
            h = h * 0
        return h


_BRANCHY = _Branchy()


def _branchy_loss(params, buffers, batch):
    x, y = batch
    return nn.functional.mse_loss(functional_call(_BRANCHY, (params, buffers), (x,)), y)


def _plain_loss(params, buffers, batch):
    x, y = batch
    return ((x @ params["w"]) - y).pow(2).mean()


def _failing_backend(gm, example_inputs):
    raise NotImplementedError("a backend that cannot compile this graph")


@pytest.mark.parametrize(
    ("loss", "backend", "cause", "what", "where", "way_out"),
    [
        (
            _branchy_loss,
            "aot_eager",
            torch._dynamo.exc.UserError,
            "a Python branch on a tensor's value",
            "if h.mean().item() > 100:",
            "torch.where",
        ),
        (
            _plain_loss,
            _failing_backend,
            torch._dynamo.exc.BackendCompilerFailed,
            "the compiler backend failed",
            None,
            "compile=funcamp.Compile(backend='aot_eager')",
        ),
    ],
    ids=["data-dependent-branch", "backend-failure"],
)
def test_every_compile_failure_is_one_paragraph(loss, backend, cause, what, where, way_out):
    """Failures other than a graph break, too: what failed, where in the user's code, and the
    way out -- each a paragraph of funcamp's, with dynamo's report chained."""
    params = funcamp.params_and_buffers(_BRANCHY)[0] if loss is _branchy_loss else None
    params = params or {"w": torch.randn(3, 2)}
    opt = funcamp.sgd(0.1)
    state = funcamp.TrainState.create(params, opt, "float32")
    strict = funcamp.Compile(backend=backend, fullgraph=True)  # the default compiles in pieces
    step = funcamp.make_train_step(loss, opt, "float32", compile=strict, donate_state=False)
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    with pytest.raises(RuntimeError) as info:
        step(state, batch)
    message = str(info.value)
    assert message.startswith("funcamp.make_train_step: the step cannot be compiled as one graph")
    assert f"What: {what}" in message and way_out in message and "compile=False" in message
    if where is not None:
        assert "test_train.py" in message and where in message
    assert "\n" not in message
    assert isinstance(info.value.__cause__, cause)
    _, metrics = funcamp.make_train_step(loss, opt, "float32", compile=False, donate_state=False)(
        state, batch
    )
    assert torch.isfinite(metrics["loss"])  # the eager step, the way out named, runs


@torch.library.custom_op("funcamp_test::double_mm", mutates_args=())
def _double_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w) * 2


@_double_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


def _double_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _double_mm_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return (grad @ w.T) * 2, (x.T @ grad) * 2


_double_mm.register_autograd(_double_mm_backward, setup_context=_double_mm_setup)


class _OldStyleSin(torch.autograd.Function):
    """An autograd function written the old way (no setup_context)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


def _custom_op_loss(params, buffers, batch):
    x, y = batch
    return (torch.ops.funcamp_test.double_mm(x, params["w"]) - y).pow(2).mean()


def _old_style_loss(params, buffers, batch):
    x, y = batch
    return (_OldStyleSin.apply(x @ params["w"]) - y).pow(2).mean()


@pytest.mark.parametrize("loss", [_custom_op_loss, _old_style_loss], ids=["custom-op", "old-style"])
def test_a_model_torch_func_refuses_trains_compiled_in_one_graph(loss, caplog):
    """A custom op's registered autograd formula (how Hugging Face's MoE grouped_mm fallback is
    written) and an old-style autograd function: eager torch.func.grad refuses both. Compiled,
    dynamo differentiates the old-style function under torch.func itself, while the custom op
    makes the step take its gradients from torch.autograd inside the same graph (said once);
    either way equal to the eager step bit for bit, in one graph."""
    opt = funcamp.adam(1e-2)
    params = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(0))}
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda p: loss(p, {}, batch))(params)
    eager = funcamp.make_train_step(loss, opt, "mixed_bfloat16", compile=False, donate_state=False)
    counters.clear()
    compiled = funcamp.make_train_step(
        loss,
        opt,
        "mixed_bfloat16",
        compile=funcamp.Compile(backend="aot_eager"),
        donate_state=False,
    )
    a = b = funcamp.TrainState.create(params, opt, "mixed_bfloat16")
    with caplog.at_level("INFO", logger="funcamp"):
        for _ in range(3):
            a, ma = eager(a, batch)
            b, mb = compiled(b, batch)
            assert torch.equal(ma["loss"], mb["loss"])
    assert torch.equal(a.params["w"], b.params["w"])
    assert counters["stats"]["unique_graphs"] == 1
    switched = any("torch.func cannot differentiate" in r.message for r in caplog.records)
    assert switched == (loss is _custom_op_loss)


def _mlp_loss_with_break(params, buffers, batch):
    x, y = batch
    h = torch.relu(x @ params["w1"] + params["b1"])
    torch._dynamo.graph_break()  # e.g. a logging call inside a model
    return torch.nn.functional.mse_loss(h @ params["w2"], y)


@pytest.mark.slow
def test_fullgraph_false_compiles_a_breaking_loss_fn_in_pieces_equal_to_eager():
    # The way out the graph-break message names: compiled in pieces around the break, with
    # gradients from torch.autograd (dynamo cannot resume inside torch.func.grad), bit for
    # bit equal to the eager step (same ops, same order) under a bfloat16 policy.
    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(8, 16, generator=g),
        "b1": torch.randn(16, generator=g),
        "w2": torch.randn(16, 4, generator=g),
        "unused": torch.randn(3, generator=g),  # no gradient: zeros, as torch.func gives
    }
    batch = (torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g))
    opt = funcamp.adamw(1e-2)
    state = funcamp.TrainState.create(params, opt, "mixed_bfloat16")
    eager = funcamp.make_train_step(
        _mlp_loss_with_break, opt, "mixed_bfloat16", compile=False, donate_state=False
    )
    pieces = funcamp.make_train_step(
        _mlp_loss_with_break,
        opt,
        "mixed_bfloat16",
        compile=funcamp.Compile(fullgraph=False, backend="aot_eager"),
        donate_state=False,
    )
    counters.clear()
    a = b = state
    for _ in range(3):
        a, ma = eager(a, batch)
        b, mb = pieces(b, batch)
        assert torch.equal(ma["loss"], mb["loss"]) and torch.equal(ma["grad_norm"], mb["grad_norm"])
    assert sum(counters["graph_break"].values()) >= 1  # it really was compiled in pieces
    for x, y in zip(optree.tree_leaves(a.params), optree.tree_leaves(b.params)):
        assert torch.equal(x, y)


def test_shape_error_in_compiled_step_is_the_plain_torch_error(capfd):
    opt = funcamp.sgd(0.1)
    state = funcamp.TrainState.create({"w": torch.randn(3, 2)}, opt, "float32")
    step = funcamp.make_train_step(
        _shape_bug_loss,
        opt,
        "float32",
        compile=funcamp.Compile(backend="eager"),
        donate_state=False,
    )
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    with pytest.raises(RuntimeError, match=r"^mat1 and mat2 shapes cannot be multiplied"):
        step(state, batch)
    err = capfd.readouterr().err
    assert "fake_tensor" not in err and "Traceback" not in err, err[:500]


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True])
def test_grad_norm_false_leaves_the_metric_out_and_changes_nothing_else(compile: bool) -> None:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 3, generator=g), "b": torch.randn(3, generator=g)}
    batch = (torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g))

    def loss_fn(p, buffers, b):
        return torch.nn.functional.mse_loss(b[0] @ p["w"] + p["b"], b[1])

    opt = funcamp.chain(funcamp.clip_by_global_norm(0.5), funcamp.adamw(1e-2))
    kw = {"compile": funcamp.Compile(backend="aot_eager")} if compile else {"compile": False}
    state = funcamp.TrainState.create(params, opt, "mixed_bfloat16")
    with_norm = funcamp.make_train_step(loss_fn, opt, "mixed_bfloat16", donate_state=False, **kw)
    without = funcamp.make_train_step(
        loss_fn, opt, "mixed_bfloat16", grad_norm=False, donate_state=False, **kw
    )
    a = b = state
    for _ in range(2):
        a, ma = with_norm(a, batch)
        b, mb = without(b, batch)
    assert "grad_norm" in ma and "grad_norm" not in mb
    assert set(ma) - set(mb) == {"grad_norm"}
    for x, y in zip(
        optree.tree_leaves(a, namespace=NAMESPACE), optree.tree_leaves(b, namespace=NAMESPACE)
    ):  # clipping unaffected
        assert torch.equal(x, y)
    with pytest.raises(TypeError, match=r"`grad_norm` must be a bool"):
        funcamp.make_train_step(loss_fn, opt, "float32", grad_norm="no", donate_state=False)


def _tied_bn_loss(params, buffers, batch):
    # a weight used twice (its gradient accumulates), a BatchNorm updating its buffers in
    # place, and an unused leaf
    x, y = batch
    h = torch.nn.functional.batch_norm(
        x @ params["w"], buffers["mean"], buffers["var"], training=True, momentum=0.1
    )
    return torch.nn.functional.mse_loss(torch.tanh(h) @ params["w"].T, y)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_eager_step_takes_grads_from_autograd_equal_to_torch_func(monkeypatch, policy):
    # A plain eager step differentiates with torch.autograd (faster than torch.func.grad in
    # eager); forced back onto torch.func.grad_and_value it gives the same bits.
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 6, generator=g), "unused": torch.randn(2, generator=g)}
    buffers = {"mean": torch.zeros(6), "var": torch.ones(6)}
    batch = (torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g))
    opt = funcamp.adamw(1e-2)
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers)
    calls = []
    real = funcamp.train.loss.autograd_grad_and_value

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(funcamp.train.loss, "autograd_grad_and_value", spy)
    fast = funcamp.make_train_step(_tied_bn_loss, opt, policy, compile=False, donate_state=False)
    a = state
    for _ in range(3):
        a, ma = fast(a, batch)
    assert len(calls) == 3  # the autograd path really ran
    monkeypatch.setattr(
        funcamp.train.loss,
        "autograd_grad_and_value",
        lambda fn, backward, **kw: torch.func.grad_and_value(fn, **kw),
    )
    reference = funcamp.make_train_step(
        _tied_bn_loss, opt, policy, compile=False, donate_state=False
    )
    b = state
    for _ in range(3):
        b, mb = reference(b, batch)
    for key in ("loss", "grad_norm"):
        assert torch.equal(ma[key], mb[key])
    for x, y in zip(
        optree.tree_leaves(a, namespace=NAMESPACE), optree.tree_leaves(b, namespace=NAMESPACE)
    ):
        assert torch.equal(x, y)
    assert not torch.equal(a.buffers["mean"], state.buffers["mean"])  # buffers were updated


def test_eager_step_of_a_loss_that_ignores_the_params_has_zero_grads():
    opt = funcamp.sgd(0.1)
    state = funcamp.TrainState.create({"w": torch.ones(3)}, opt, "float32")
    step = funcamp.make_train_step(
        lambda p, b, batch: batch.sum(), opt, "float32", compile=False, donate_state=False
    )
    new, metrics = step(state, torch.ones(2))
    assert torch.equal(new.params["w"], state.params["w"]) and float(metrics["grad_norm"]) == 0.0


def test_load_into_module_writes_params_and_buffers_in_place():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    weight = model[0].weight
    params, buffers = funcamp.params_and_buffers(model)
    new_params = {k: torch.randn_like(v) for k, v in params.items()}
    new_buffers = {k: v + 1 for k, v in buffers.items()}
    state = funcamp.TrainState.create(
        new_params, funcamp.sgd(0.1), "bf16-true", buffers=new_buffers
    )
    funcamp.load_into_module(model, state)
    assert model[0].weight is weight and weight.dtype == torch.float32  # same tensor, same dtype
    # bfloat16 state values, widened exactly into the float32 module tensors
    assert torch.equal(weight, state.params["0.weight"].float())
    assert torch.equal(model[1].running_mean, state.buffers["1.running_mean"].float())
    assert int(model[1].num_batches_tracked) == 1
    x = torch.randn(5, 3)
    model.eval()
    want = functional_call(model, (state.params, state.buffers), (x.bfloat16(),))
    assert torch.equal(model.bfloat16()(x.bfloat16()), want)


def test_load_into_module_checks_names_and_shapes_before_writing():
    model = nn.Linear(2, 2)
    params, _ = funcamp.params_and_buffers(model)
    original = {k: v.clone() for k, v in params.items()}
    with pytest.raises(ValueError, match=r"missing 'bias'"):
        funcamp.load_into_module(model, {"weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"unknown 'extra'"):
        funcamp.load_into_module(model, {**params, "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'bias' must be a tensor of shape \(2,\)"):
        funcamp.load_into_module(model, {"weight": torch.zeros(2, 2), "bias": torch.zeros(3)})
    with pytest.raises(TypeError, match=r"`module` must be a torch\.nn\.Module"):
        funcamp.load_into_module(params, model)
    assert all(torch.equal(params[k], original[k]) for k in params)  # nothing was written


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "aot_eager"])
def test_metrics_report_the_learning_rate_each_step_applied(compile):
    """``metrics["lr"]`` is the schedule at the count of updates applied before the step (a
    skipped step applies none, so the next reports the same rate again), through chain."""
    schedule = funcamp.linear_schedule(0.1, 0.0, 8)
    opt = funcamp.chain(funcamp.clip_by_global_norm(5.0), funcamp.adam(schedule))
    params, buffers = funcamp.params_and_buffers(MODEL)
    state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers)
    kw = {"compile": funcamp.Compile(backend="aot_eager")} if compile else {"compile": False}
    step = funcamp.make_train_step(loss_fn, opt, POLICY, donate_state=False, **kw)
    lrs, applied = [], 0
    for batch in _batches(6, bad_every=3):
        state, m = step(state, batch)
        lrs.append(m["lr"])
        assert torch.equal(m["lr"], schedule(torch.tensor(applied, dtype=torch.int32)))
        applied += not bool(m["found_inf"])
    assert [bool(torch.equal(a, b)) for a, b in itertools.pairwise(lrs)] == [0, 0, 1, 0, 0]


def test_metrics_lr_by_label_and_none_without_a_rate():
    opt = funcamp.multi_transform(
        {"a": funcamp.sgd(0.5), "b": funcamp.adam(0.25)}, lambda p: "a" if "0." in p else "b"
    )
    params, buffers = funcamp.params_and_buffers(MODEL)
    state = funcamp.TrainState.create(params, opt, "float32", buffers=buffers)
    _, m = funcamp.make_train_step(loss_fn, opt, "float32", compile=False, donate_state=False)(
        state, _batches(1)[0]
    )
    assert {k: float(v) for k, v in m["lr"].items()} == {"a": 0.5, "b": 0.25}
    clip = funcamp.clip_by_global_norm(1.0)
    state = funcamp.TrainState.create(params, clip, "float32", buffers=buffers)
    _, m = funcamp.make_train_step(loss_fn, clip, "float32", compile=False, donate_state=False)(
        state, _batches(1)[0]
    )
    assert "lr" not in m and funcamp.optim.learning_rate(clip, state.opt_state) is None


def test_the_default_step_donates_and_refuses_a_donated_state_again():
    """make_train_step donates its input by default (jax.jit's donate_argnums=0): the new state
    lives in the old tensors, and handing the old state to a train step again -- this one or
    another -- is an error naming the fix, as JAX refuses a donated buffer."""
    state = _own(_state())
    step = funcamp.make_train_step(loss_fn, OPT, POLICY, compile=False)
    other = funcamp.make_train_step(loss_fn, OPT, POLICY, compile=False, donate_state=False)
    batch = _batches(1)[0]
    w = state.params["0.weight"]
    new, _ = step(state, batch)
    assert new.params["0.weight"] is w  # written in place
    for again in (step, other):
        with pytest.raises(
            ValueError,
            match=r"`state` was donated to an earlier train step.*"
            r"donate_state=False",
        ):
            again(state, batch)
    newer, _ = step(new, batch)  # the returned state is the one to use
    pure_a, _ = other(newer, batch)
    pure_b, _ = other(newer, batch)  # the pure step leaves its input alone: reusable
    _assert_equal(pure_a.params, pure_b.params)


class _SetsUpOnFirstCall(nn.Module):
    """Sets itself up on its first call under a lock, as transformers installs the hooks that
    record a model's outputs (Mixtral's router logits): dynamo cannot trace the lock."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.lock = __import__("threading").Lock()
        self.ready = False

    def forward(self, x):
        if not self.ready:
            with self.lock:
                self.ready = True
        return self.lin(x)


def test_a_model_that_sets_itself_up_on_its_first_call_compiles_after_it():
    model = _SetsUpOnFirstCall()

    def loss(params, buffers, batch):
        x, y = batch
        return nn.functional.mse_loss(functional_call(model, (params, buffers), (x,)), y)

    opt = funcamp.sgd(0.1)
    params = {k: v.clone() for k, v in funcamp.params_and_buffers(model)[0].items()}
    state = funcamp.TrainState.create(params, opt, "float32")
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    counters.clear()
    step = funcamp.make_train_step(
        loss, opt, "float32", compile=funcamp.Compile(backend="aot_eager")
    )
    new, metrics = step(state, batch)  # traced again after the eager run set the model up
    assert model.ready and counters["stats"]["unique_graphs"] == 1
    assert torch.isfinite(metrics["loss"])
    step(new, batch)  # and runs compiled from then on
    assert counters["stats"]["unique_graphs"] == 1
