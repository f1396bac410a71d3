"""make_train_step(..., compile=Compile(cache_dir=...), donate_state=False): a compiled step saved
to disk and loaded by a later process without dynamo's trace -- and never loaded where it no
longer fits."""

import importlib
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters

import funcamp
from funcamp.stepcache.key import cache_support

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cache_model as cm  # noqa: E402

pytestmark = pytest.mark.skipif(
    cache_support() is not None, reason=f"no AOT precompile in this torch: {cache_support()}"
)

POLICY = "mixed_bfloat16"


def _train(step, model, batch=None, n=3, opt=None):
    opt = opt or funcamp.adam(1e-3)
    params, buffers = funcamp.params_and_buffers(model)
    state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers)
    for _ in range(n):
        state, metrics = step(state, batch if batch is not None else cm.make_batch())
    return state, metrics


def _step(model, cache_dir, loss_fn=None, backend="aot_eager", **kw):
    opt = kw.pop("optimizer", None) or funcamp.adam(1e-3)
    return funcamp.make_train_step(
        loss_fn or cm.make_loss(model),
        opt,
        POLICY,
        compile=funcamp.Compile(cache_dir=cache_dir, backend=backend),
        **{"donate_state": False, **kw},
    )


def _eager(model, loss_fn=None, **kw):
    opt = kw.pop("optimizer", None) or funcamp.adam(1e-3)
    return funcamp.make_train_step(
        loss_fn or cm.make_loss(model), opt, POLICY, compile=False, **{"donate_state": False, **kw}
    )


def _same(a, b):
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype
        and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        for x, y in zip(la, lb)
    )


def _entries(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".funcamp-step"))


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "funcamp"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One compile of the default model's step, saved: (its cache directory, the state after
    3 steps). Tests that start from this entry copy the directory (one compile, not one each)."""
    cache = tmp_path_factory.mktemp("saved")
    model = cm.make_model()
    state, _ = _train(_step(model, str(cache)), model)
    assert len(_entries(cache)) == 1
    return cache, state


def _copy(saved, tmp_path) -> str:
    """A test's own copy of the ``saved`` cache directory."""
    cache = tmp_path / "steps"
    shutil.copytree(saved[0], cache)
    return str(cache)


GUIDE = pathlib.Path(HERE).parent / "docs" / "guides" / "warm-starts.md"
_DUMP = """
from torch._dynamo.utils import counters
torch.save({"params": state.params, "loss": metrics["loss"],
            "captured": sum(counters["stats"].values()), "key": _key_digest()}, "out.pt")
"""


#: Defines ``_key_digest()`` in the guide's script (run in two processes): the step key of a
#: loss whose code holds a set constant.
_KEY = """
def _key_digest():
    import hashlib
    import sys
    from funcamp.stepcache.cache import step_key
    sys.path.insert(0, {here!r})
    import cache_model as cm

    def loss_fn(params, buffers, batch):
        x, y = batch
        mode = "sum" if "a" in {{"a", "b", "c", "d"}} else "mean"  # a frozenset constant
        return torch.nn.functional.mse_loss(x @ params["w"], y, reduction=mode)

    opt = funcamp.adam(1e-3)
    state = funcamp.TrainState.create({{"w": torch.zeros(16, 4)}}, opt, {policy!r})
    key = step_key(loss_fn, "settings", {{"backend": "inductor"}}, state, cm.make_batch())
    return hashlib.sha256(repr(key).encode()).hexdigest()
"""


def _guide_script() -> str:
    (block,) = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), re.MULTILINE | re.DOTALL)
    call = 'compile=funcamp.Compile(cache_dir="compiled-steps")'
    assert call in block
    # aot_eager: the trace and the save/load path are the same; inductor's codegen is skipped
    new = 'compile=funcamp.Compile(cache_dir="compiled-steps", backend="aot_eager")'
    return block.replace(call, new) + _KEY.format(here=HERE, policy=POLICY) + _DUMP


@pytest.mark.slow
def test_the_guide_run_twice_loads_the_step_without_tracing(tmp_path):
    """The guide's script, run as a file in two processes: the first compiles and saves, the
    second loads the step, traces nothing, and trains to the same bits (as eager does). The two
    processes also compute the key of a loss holding a set constant: sets (in torch's configs,
    in a function's constants) iterate in a per-process order (string hashing is salted per
    process), and the key must not depend on it (the same two processes: no third start)."""
    script = tmp_path / "train.py"
    script.write_text(_guide_script())
    runs = []
    for seed in ("1", "2"):  # string hashing salted differently, as in any two processes
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONHASHSEED": seed},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append((done.stderr, torch.load(tmp_path / "out.pt")))
    (log1, first), (log2, second) = runs
    assert "saved it to compiled-steps/loss_fn-" in log1, log1[-2000:]
    assert "loaded the compiled train step from compiled-steps/loss_fn-" in log2, log2[-2000:]
    assert first["captured"] > 0 and second["captured"] == 0  # no trace in the second process
    assert _same(first["params"], second["params"])
    assert torch.equal(first["loss"], second["loss"])
    assert len(first["key"]) == 64 and first["key"] == second["key"]  # under two hash seeds
    assert len(_entries(tmp_path / "compiled-steps")) == 1
    # and the bits are the eager step's
    namespace: dict = {}
    exec(
        compile(
            _guide_script()
            .replace(
                'compile=funcamp.Compile(cache_dir="compiled-steps", backend="aot_eager")',
                "compile=False",
            )
            .replace(_DUMP, ""),
            "guide",
            "exec",
        ),
        namespace,
    )
    assert _same(namespace["state"].params, first["params"])


@pytest.mark.slow
def test_a_changed_constant_is_not_loaded(saved, tmp_path, caplog, monkeypatch):
    cache = _copy(saved, tmp_path)  # an entry made with SCALE = 1
    model = cm.make_model()
    monkeypatch.setattr(cm, "SCALE", 3.0)
    with caplog.at_level(logging.INFO, logger="funcamp"):
        state, _ = _train(_step(model, cache), model)
    stale = [m for m in _messages(caplog) if "not using the cached train step" in m]
    assert stale and "SCALE" in stale[0], _messages(caplog)
    eager_state, _ = _train(_eager(model), model)
    assert _same(state.params, eager_state.params)  # trained with SCALE = 3, not 1
    monkeypatch.setattr(cm, "SCALE", 1.0)
    reference, _ = _train(_eager(model), model)
    assert not _same(state.params, reference.params)


@pytest.mark.slow
def test_a_changed_model_attribute_or_optimizer_is_not_loaded(saved, tmp_path, caplog):
    cache = _copy(saved, tmp_path)  # an entry made with the exact GELU and adam(1e-3)
    model = cm.make_model()
    model[1].approximate = "tanh"  # GELU's constant: same params, another graph
    with caplog.at_level(logging.INFO, logger="funcamp"):
        state, _ = _train(_step(model, cache), model)
    assert any("approximate" in m for m in _messages(caplog)), _messages(caplog)
    assert _same(state.params, _train(_eager(model), model)[0].params)
    caplog.clear()
    opt = funcamp.adam(3e-3)  # another learning rate, baked into the graph
    with caplog.at_level(logging.INFO, logger="funcamp"):
        state, _ = _train(_step(model, cache, optimizer=opt), model, opt=opt)
    assert not any("loaded the compiled" in m for m in _messages(caplog)), _messages(caplog)
    eager_state, _ = _train(_eager(model, optimizer=opt), model, opt=opt)
    assert _same(state.params, eager_state.params)


@pytest.mark.slow
def test_changed_source_is_not_loaded(tmp_path, caplog, monkeypatch):
    """The model's forward is edited on disk between runs: the entry made from the old
    source is not loaded into the new one (the loss function itself is unchanged)."""
    source = """
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(16, 4)
            def forward(self, x):
                return self.lin(x) {op}
    """
    path = tmp_path / "edited_net.py"
    path.write_text(textwrap.dedent(source.format(op="* 2.0")))
    monkeypatch.syspath_prepend(str(tmp_path))
    cache = str(tmp_path / "steps")
    module = importlib.import_module("edited_net")
    torch.manual_seed(0)
    model = module.Net()
    _train(_step(model, cache), model)
    path.write_text(textwrap.dedent(source.format(op="+ 1.0")))
    module = importlib.reload(module)
    torch.manual_seed(0)
    model = module.Net()
    with caplog.at_level(logging.INFO, logger="funcamp"):
        state, _ = _train(_step(model, cache), model)
    stale = [m for m in _messages(caplog) if "not using the cached train step" in m]
    assert stale and "edited_net" in stale[0] and "changed" in stale[0], _messages(caplog)
    assert _same(state.params, _train(_eager(model), model)[0].params)
    sys.modules.pop("edited_net", None)


@pytest.mark.slow
def test_new_shapes_add_an_entry_and_both_are_reused(tmp_path, caplog):
    cache = str(tmp_path)
    model = cm.make_model()
    step = _step(model, cache)
    _train(step, model, cm.make_batch(8), n=1)
    _train(step, model, cm.make_batch(6), n=1)
    assert len(_entries(cache)) == 2
    before = sum(counters["stats"].values())
    _train(step, model, cm.make_batch(8), n=2)  # the first entry again: no trace
    assert sum(counters["stats"].values()) == before
    fresh = _step(model, cache)
    with caplog.at_level(logging.INFO, logger="funcamp"):
        small, _ = _train(fresh, model, cm.make_batch(6))
        big, _ = _train(fresh, model, cm.make_batch(8))
    # the batch-6 entry was compiled second, with the batch dimension dynamic (dynamo's
    # automatic dynamic shapes): it serves both sizes, as it did in the process that made it
    assert any("loaded the compiled" in m for m in _messages(caplog)), _messages(caplog)
    assert len(_entries(cache)) == 2
    assert sum(counters["stats"].values()) == before
    assert _same(small.params, _train(_eager(model), model, cm.make_batch(6))[0].params)
    assert _same(big.params, _train(_eager(model), model, cm.make_batch(8))[0].params)


@pytest.mark.slow
def test_a_corrupt_entry_is_compiled_again_and_replaced(saved, tmp_path, caplog):
    cache = _copy(saved, tmp_path)
    model = cm.make_model()
    reference = saved[1]  # the state the entry's first process trained
    (name,) = _entries(cache)
    with open(os.path.join(cache, name), "r+b") as f:
        f.seek(100)
        f.write(b"\x00" * 64)
    with caplog.at_level(logging.INFO, logger="funcamp"):
        state, _ = _train(_step(model, cache), model)
    assert any("cannot be read" in m for m in _messages(caplog)), _messages(caplog)
    assert _same(state.params, reference.params)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="funcamp"):
        state, _ = _train(_step(model, cache), model)
    assert any("loaded the compiled" in m for m in _messages(caplog)), _messages(caplog)
    assert _same(state.params, reference.params)


@pytest.mark.slow
def test_donated_state_through_the_cache(tmp_path):
    cache = str(tmp_path)
    model = cm.make_model()
    _train(_step(model, cache, donate_state=True), model)
    loaded, _ = _train(_step(model, cache, donate_state=True), model)
    eager, _ = _train(_eager(model, donate_state=True), model)
    assert _same(loaded.params, eager.params)
    assert len(_entries(cache)) == 1


@pytest.mark.slow
def test_inductor_entry_gives_the_compiled_bits(tmp_path, caplog):
    cache = str(tmp_path)
    model = cm.make_model()
    first, m1 = _train(_step(model, cache, backend="inductor"), model)
    with caplog.at_level(logging.INFO, logger="funcamp"):
        loaded, m2 = _train(_step(model, cache, backend="inductor"), model)
    assert any("loaded the compiled" in m for m in _messages(caplog)), _messages(caplog)
    assert _same(loaded.params, first.params) and torch.equal(m1["loss"], m2["loss"])


def test_bad_cache_dir(tmp_path, single_rank_group):
    model = cm.make_model()
    loss, opt = cm.make_loss(model), funcamp.sgd(0.1)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="`cache_dir` must be a directory"):
        funcamp.make_train_step(
            loss, opt, POLICY, compile=funcamp.Compile(cache_dir=str(a_file)), donate_state=False
        )
    with pytest.raises(TypeError, match="`cache_dir` must be a directory path"):
        funcamp.make_train_step(
            loss, opt, POLICY, compile=funcamp.Compile(cache_dir=3), donate_state=False
        )
    with pytest.raises(ValueError, match="fullgraph=False"):
        funcamp.make_train_step(
            loss,
            opt,
            POLICY,
            compile=funcamp.Compile(cache_dir=tmp_path, fullgraph=False),
            donate_state=False,
        )
    with pytest.raises(ValueError, match="`cache_dir` and `guard_filter_fn`"):
        funcamp.make_train_step(
            loss,
            opt,
            POLICY,
            compile=funcamp.Compile(cache_dir=tmp_path, guard_filter_fn=lambda e: e),
            donate_state=False,
        )
    with pytest.raises(ValueError, match="`cache_dir` and `guard_filter_fn`"):
        funcamp.make_train_step(
            loss,
            opt,
            POLICY,
            compile=funcamp.Compile(cache_dir=tmp_path, options={"guard_filter_fn": lambda e: e}),
            donate_state=False,
        )
    with pytest.raises(ValueError, match="backend by name"):
        funcamp.make_train_step(
            loss,
            opt,
            POLICY,
            compile=funcamp.Compile(cache_dir=tmp_path, backend=lambda gm, x: gm),
            donate_state=False,
        )
    with pytest.raises(
        ValueError,
        match=r"cache_dir does not compose with parallel=DataParallel\(group\) .*collectives",
    ):
        funcamp.make_train_step(
            loss,
            opt,
            POLICY,
            parallel=funcamp.distributed.DataParallel(single_rank_group),
            compile=funcamp.Compile(cache_dir=tmp_path),
            donate_state=False,
        )


def test_a_torch_without_precompile_warns_and_compiles(tmp_path, monkeypatch):
    import funcamp.stepcache.key as key

    monkeypatch.setattr(key, "cache_support", lambda: "torch 0.0 has none")
    model = cm.make_model()
    with pytest.warns(RuntimeWarning, match="`cache_dir` is ignored: torch 0.0 has none"):
        step = _step(model, str(tmp_path))
    state, _ = _train(step, model, n=1)
    assert _entries(tmp_path) == []
    assert _same(state.params, _train(_eager(model), model, n=1)[0].params)


#: A value other than the default for every option that enters the key: a new option fails
#: the test below until it has one here (and so enters the key) or says why it does not.
OTHER_VALUES = {
    "has_aux": True,
    "returns_buffers": True,
    "donate_state": False,
    "grad_norm": False,
    "skip_if": lambda metrics: metrics["grad_norm"] > 10.0,
    "headroom": lambda path: "weight" in path,
    "compile": False,
    "backend": "aot_eager",
    "mode": "max-autotune",
    "fullgraph": True,
    "dynamic": True,
    "options": {"max_autotune": True},
    "guard_filter_fn": lambda guards: [True] * len(guards),
    "compiler_patches": False,
}
NOT_IN_KEY = {"parallel", "cache_dir", "specialize"}


def test_every_option_enters_the_key_or_says_why_not():
    """Each field of StepOptions and Compile changes the settings a saved step is filed under,
    unless its declaration says why not: else a step built with a new option would load an
    entry compiled without it."""
    import dataclasses

    from funcamp.stepcache.key import describe_settings
    from funcamp.train.config import Compile, StepOptions, build
    from funcamp.train.step import cache_settings

    policy = funcamp.get_policy(POLICY)

    def key(**options):
        return describe_settings(cache_settings(policy, build(StepOptions, "t", options)))

    for cls in (StepOptions, Compile):
        for field in dataclasses.fields(cls):
            if field.metadata["not_in_key"] is not None:
                assert field.name in NOT_IN_KEY, field.name
                continue
            assert field.name in OTHER_VALUES, f"{cls.__name__}.{field.name}: not in the test"
            other = {field.name: OTHER_VALUES[field.name]}
            changed = key(**other) if cls is StepOptions else key(compile=Compile(**other))
            assert changed != key(), field.name
    assert key(headroom=lambda p: True) == key(headroom=lambda p: True)  # not by address


def test_descriptions_compare_values_not_only_types():
    from funcamp.stepcache.key import describe_value, is_opaque

    d = describe_value
    assert d({"half", "x"}) != d({"double", "x"})
    assert d(frozenset({1, 2})) == d(frozenset({2, 1}))
    assert d((*tuple(range(70)), 2)) != d((*tuple(range(70)), 5))
    assert d(torch.ops.aten.relu.default) != d(torch.ops.aten.sigmoid.default)
    assert d(0.1) != d(0.1 + 2**-55) and d(float("nan")) == d(float("nan"))
    assert d(torch.zeros(2, 3)) != d(torch.zeros(3, 2)) != d(torch.zeros(3, 2).t())
    assert d(torch.nn.functional.gelu) == d(torch.nn.functional.gelu)
    assert not is_opaque(d({"a": [1, (2.0, "x")], "b": torch.float32}))
    assert is_opaque(d([1, object()])) and is_opaque(d(torch.nn.Linear(1, 1)))


def test_checks_look_at_what_each_guard_looks_at():
    from funcamp.stepcache.key import NO_PARAM, guard_views

    env = {"A": "1", "B": "2", "PATH": "/bin"}
    contains = {"DICT_CONTAINS": ["A", "B"]}  # two keys guarded on one dict: both compared
    assert guard_views(contains, env) == guard_views(contains, {**env, "PATH": "/usr/bin"})
    assert guard_views(contains, env) != guard_views(contains, {"A": "1", "PATH": "/bin"})
    type_only = {"TYPE_MATCH": [NO_PARAM]}  # a type guard: the contents do not matter
    assert guard_views(type_only, env) == guard_views(type_only, {"X": 3})
    assert guard_views(type_only, env) != guard_views(type_only, [1])
    value = {"CONSTANT_MATCH": [NO_PARAM]}
    assert guard_views(value, (1, 2.5)) != guard_views(value, (1, 2.25))
    keys = {"DICT_KEYS_MATCH": [NO_PARAM]}
    assert guard_views(keys, {"a": 1, "b": 2}) == guard_views(keys, {"a": 5, "b": 6})
    assert guard_views(keys, {"a": 1, "b": 2}) != guard_views(keys, {"b": 2, "a": 1})


@pytest.mark.slow
def test_tensors_passed_twice_are_part_of_the_key(tmp_path):
    """A state with two params that are one tensor (tied weights) compiles to a graph that
    reads it once; an untied state of the same shapes must not reuse it."""
    cache = str(tmp_path)
    w = torch.ones(16, 4)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(x @ params["a"] + 2 * (x @ params["b"]), y)

    opt = funcamp.adam(1e-2)
    step = funcamp.make_train_step(
        loss_fn,
        opt,
        POLICY,
        compile=funcamp.Compile(cache_dir=cache, backend="aot_eager"),
        donate_state=False,
    )
    eager = funcamp.make_train_step(loss_fn, opt, POLICY, compile=False, donate_state=False)
    for params in ({"a": w, "b": w}, {"a": w.clone(), "b": w.clone()}):
        s1 = s2 = funcamp.TrainState.create(params, opt, POLICY)
        for _ in range(2):  # the tied state unties after its first step
            s1, _ = step(s1, cm.make_batch())
            s2, _ = eager(s2, cm.make_batch())
        assert _same(s1.params, s2.params)
    assert len(_entries(cache)) == 2


@pytest.mark.slow
def test_object_leaves_run_uncached(tmp_path, caplog):
    class Scale:
        def __init__(self, k):
            self.k = k

    def loss_fn(params, buffers, batch):
        x, y, scale = batch
        return scale.k * torch.nn.functional.mse_loss(x @ params["w"], y)

    opt = funcamp.sgd(0.1)
    step = funcamp.make_train_step(
        loss_fn,
        opt,
        POLICY,
        compile=funcamp.Compile(cache_dir=tmp_path, backend="aot_eager"),
        donate_state=False,
    )
    eager = funcamp.make_train_step(loss_fn, opt, POLICY, compile=False, donate_state=False)
    s1 = s2 = funcamp.TrainState.create({"w": torch.zeros(16, 4)}, opt, POLICY)
    with caplog.at_level(logging.INFO, logger="funcamp"):
        for k in (1.0, 5.0):
            batch = (*cm.make_batch(), Scale(k))
            s1, _ = step(s1, batch)
            s2, _ = eager(s2, batch)
    assert _same(s1.params, s2.params)
    assert any("compiles as usual (unsaved)" in m for m in _messages(caplog))
    assert _entries(tmp_path) == []


def test_code_without_a_source_file_is_not_saved(tmp_path, caplog):
    namespace = {"torch": torch, "F": torch.nn.functional}
    exec(  # as a notebook cell would define it: no file to check an entry against later
        "def loss_fn(params, buffers, batch):\n"
        "    x, y = batch\n"
        "    return F.mse_loss(x @ params['w'], y)\n",
        namespace,
    )
    opt = funcamp.sgd(0.1)
    step = funcamp.make_train_step(
        namespace["loss_fn"],
        opt,
        POLICY,
        compile=funcamp.Compile(cache_dir=tmp_path, backend="aot_eager"),
        donate_state=False,
    )
    state = funcamp.TrainState.create({"w": torch.zeros(16, 4)}, opt, POLICY)
    with caplog.at_level(logging.INFO, logger="funcamp"):
        state, _ = step(state, cm.make_batch())
        state, _ = step(state, cm.make_batch())
    assert any("no source file" in m for m in _messages(caplog)), _messages(caplog)
    assert _entries(tmp_path) == []


@pytest.mark.slow
def test_a_function_mode_is_part_of_the_key(tmp_path):
    model = cm.make_model()
    step = _step(model, str(tmp_path))
    eager = _eager(model)
    plain, _ = _train(step, model, n=1)
    with cm.Doubled():
        doubled, _ = _train(step, model, n=1)
        reference, _ = _train(eager, model, n=1)
    assert _same(doubled.params, reference.params)
    assert not _same(doubled.params, plain.params)
    assert len(_entries(tmp_path)) == 2
    again, _ = _train(step, model, n=1)  # the mode is gone: the first entry again
    assert _same(again.params, plain.params)


@pytest.mark.slow
def test_a_hugging_face_model_is_saved_and_loaded(tmp_path, caplog):
    """What dynamo guards in a transformers model (a config object shared by the layers, code
    objects in closures, os.environ read by the attention dispatch) can all be checked."""
    hf_models = pytest.importorskip("hf_models")
    model, batch = hf_models.llama(torch.Generator().manual_seed(0), layers=1)

    def loss_fn(params, buffers, batch):
        return torch.func.functional_call(model, (params, buffers), (), batch).loss

    opt = funcamp.adamw(1e-3)
    params, buffers = funcamp.params_and_buffers(model)
    results = []
    with caplog.at_level(logging.INFO, logger="funcamp"):
        for _ in range(2):  # a new step: the first saves, the second loads
            step = funcamp.make_train_step(
                loss_fn,
                opt,
                POLICY,
                compile=funcamp.Compile(cache_dir=tmp_path, backend="aot_eager"),
                donate_state=False,
            )
            state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers)
            for _ in range(2):
                state, _ = step(state, batch)
            results.append(state)
    messages = _messages(caplog)
    assert any("saved it to" in m for m in messages), messages
    assert any("loaded the compiled train step" in m for m in messages), messages
    assert _same(results[0].params, results[1].params)


@torch._dynamo.assume_constant_result
def _folded_factor() -> float:
    return cm.SCALE + 1.0


def test_a_value_assumed_constant_is_not_saved(tmp_path, caplog):
    """A function marked assume_constant_result is called once while tracing and its result
    put in the graph, with no guard: no later process could check it."""

    def loss_fn(params, buffers, batch):
        x, y = batch
        return _folded_factor() * torch.nn.functional.mse_loss(x @ params["w"], y)

    opt = funcamp.sgd(0.1)
    cache = tmp_path / "steps"  # not there yet: the note makes it
    step = funcamp.make_train_step(
        loss_fn,
        opt,
        POLICY,
        compile=funcamp.Compile(cache_dir=cache, backend="aot_eager"),
        donate_state=False,
    )
    state = funcamp.TrainState.create({"w": torch.zeros(16, 4)}, opt, POLICY)
    with caplog.at_level(logging.INFO, logger="funcamp"):
        first, _ = step(state, cm.make_batch())
    assert any("assume_constant_result" in m for m in _messages(caplog)), _messages(caplog)
    assert _entries(cache) == []
    (note,) = [f for f in os.listdir(cache) if f.endswith(".funcamp-unsaved")]
    assert "assume_constant_result" in (cache / note).read_text()
    # A later process with the same key reads the note and compiles as usual at once: no
    # precompile (which misses torch's compile caches) only to fail to save again.
    caplog.clear()
    again = funcamp.make_train_step(
        loss_fn,
        opt,
        POLICY,
        compile=funcamp.Compile(cache_dir=cache, backend="aot_eager"),
        donate_state=False,
    )
    with caplog.at_level(logging.INFO, logger="funcamp"):
        second, _ = again(state, cm.make_batch())
    messages = _messages(caplog)
    assert any("an earlier process found that it cannot be saved" in m for m in messages)
    assert not any("did not save it" in m for m in messages), messages
    assert _same(first.params, second.params)


def test_a_note_that_a_step_cannot_be_saved_is_respected_until_deleted(tmp_path, caplog):
    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(x @ params["w"], y)

    opt = funcamp.sgd(0.1)
    state = funcamp.TrainState.create({"w": torch.zeros(16, 4)}, opt, POLICY)

    def run():
        step = funcamp.make_train_step(
            loss_fn,
            opt,
            POLICY,
            compile=funcamp.Compile(cache_dir=tmp_path, backend="aot_eager"),
            donate_state=False,
        )
        return step(state, cm.make_batch())

    run()
    (entry,) = _entries(tmp_path)
    (tmp_path / entry).unlink()
    note = tmp_path / (entry[: -len(".funcamp-step")] + ".funcamp-unsaved")
    note.write_text("a reason from an earlier process")
    with caplog.at_level(logging.INFO, logger="funcamp"):
        run()
    assert any("a reason from an earlier process" in m for m in _messages(caplog))
    assert _entries(tmp_path) == []
    note.unlink()  # deleted: the next process saves the step again
    run()
    assert _entries(tmp_path) == [entry]
    assert not note.exists()


def test_values_dynamo_folds_without_a_guard_are_in_the_key():
    """Autocast dtypes, the default dtype, distributed rank and world size, GPU availability:
    dynamo bakes them into a graph unguarded, so two processes that differ get two keys."""
    from funcamp.stepcache.key import step_key

    opt = funcamp.sgd(0.1)
    state = funcamp.TrainState.create({"w": torch.zeros(16, 4)}, opt, POLICY)

    def key():
        return step_key(cm.make_loss, "s", {}, state, cm.make_batch())

    before = key()
    saved = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        assert key() != before
    finally:
        torch.set_autocast_dtype("cpu", saved)
    assert key() == before
