"""make_train_step's front door: ``compile=funcamp.Compile(...)``, ``parallel=``, the one place for
what does not combine, and the old spelling translated with a warning."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch
import torch.distributed as dist

import funcamp
import funcamp.distributed as fd
from funcamp.testing import assert_trees_equal


def _loss_fn(params, buffers, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(torch.tanh(x @ params["w"]) + params["b"], y)


def _state(opt):
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.zeros(3)}
    return funcamp.TrainState.create(params, opt, "mixed_bfloat16")


def _run(step, opt, steps=3):
    state = _state(opt)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        batch = (torch.randn(8, 4, generator=gen), torch.randn(8, 3, generator=gen))
        state, metrics = step(state, batch)
        out.append(metrics["loss"])
    return state, out


def test_the_front_door_is_small():
    params = inspect.signature(funcamp.make_train_step).parameters
    keywords = [p for p in params.values() if p.kind is p.KEYWORD_ONLY]
    assert [p.name for p in keywords] == [
        "has_aux",
        "returns_buffers",
        "donate_state",
        "grad_norm",
        "headroom",
        "parallel",
        "compile",
    ]
    assert len(funcamp.make_train_step.__doc__.splitlines()) <= 45


def test_compile_is_a_frozen_value():
    cfg = funcamp.Compile(backend="aot_eager", specialize=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.backend = "inductor"  # type: ignore[misc]
    assert cfg.torch_options() == {"backend": "aot_eager"}
    assert funcamp.Compile().torch_options() == {}
    assert cfg == funcamp.Compile(backend="aot_eager", specialize=True)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"backend": "aot_eager"}, funcamp.Compile(backend="aot_eager")),
        (
            {"backend": "aot_eager", "specialize": True},
            funcamp.Compile(backend="aot_eager", specialize=True),
        ),
    ],
)
def test_the_old_spelling_warns_and_builds_the_same_step(old, new):
    opt = funcamp.adamw(1e-2)
    with pytest.warns(FutureWarning, match=r"pass compile=funcamp\.Compile\(backend='aot_eager'"):
        old_step = funcamp.make_train_step(_loss_fn, opt, "mixed_bfloat16", **old)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new_step = funcamp.make_train_step(_loss_fn, opt, "mixed_bfloat16", compile=new)
    a, la = _run(old_step, opt)
    b, lb = _run(new_step, opt)
    assert_trees_equal(a, b)
    assert_trees_equal(la, lb)


def test_the_old_eval_spelling_warns():
    opt = funcamp.sgd(0.1)
    state = _state(opt)
    x = torch.randn(2, 4)

    def fn(params, buffers, x):
        return x @ params["w"]

    with pytest.warns(FutureWarning, match=r"compile=funcamp\.Compile\(backend='eager'\)"):
        old = funcamp.make_eval_step(fn, "mixed_bfloat16", backend="eager")
    new = funcamp.make_eval_step(fn, "mixed_bfloat16", compile=funcamp.Compile(backend="eager"))
    assert torch.equal(old(state, x), new(state, x))


RULES = [
    (
        {"specialize": True, "guard_filter_fn": lambda g: [True] * len(g)},
        "give `specialize=True` or a `guard_filter_fn`, not both",
    ),
    (
        {"specialize": True, "mode": "max-autotune", "backend": "aot_eager"},
        r"`specialize=True` with mode='max-autotune' needs inductor",
    ),
    ({"cache_dir": "x", "fullgraph": False}, "`cache_dir` saves the step as one compiled graph"),
    (
        {"cache_dir": "x", "guard_filter_fn": lambda g: [True] * len(g)},
        "`cache_dir` and `guard_filter_fn` do not go together",
    ),
    (
        {"cache_dir": "x", "backend": lambda gm, ex: gm},
        "`cache_dir` needs the compile backend by name",
    ),
]


@pytest.mark.parametrize(("fields", "message"), RULES)
def test_every_rule_is_refused_in_both_spellings(fields, message):
    with pytest.raises(ValueError, match=r"funcamp\.Compile: " + message):
        funcamp.Compile(**fields)
    opt = funcamp.sgd(0.1)
    pattern = r"funcamp\.make_train_step: " + message
    with pytest.raises(ValueError, match=pattern), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        funcamp.make_train_step(_loss_fn, opt, "float32", **fields)


def test_compile_checks_its_fields():
    with pytest.raises(TypeError, match=r"funcamp\.Compile: `compiler_patches` must be"):
        funcamp.Compile(compiler_patches="yes")
    with pytest.raises(TypeError, match=r"funcamp\.Compile: `options` must be a dict"):
        funcamp.Compile(options=[("max_autotune", True)])


def test_a_mode_with_another_backend_keeps_specialize_or_refuses():
    """Before: the guard filter was dropped silently when `mode=` came with aot_eager."""
    with pytest.raises(ValueError, match="needs inductor"):
        funcamp.make_train_step(
            _loss_fn,
            funcamp.sgd(0.1),
            "float32",
            compile=funcamp.Compile(backend="aot_eager", mode="default", specialize=True),
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"compile": "yes"}, TypeError, r"`compile` must be True, False or a funcamp\.Compile"),
        ({"cahce_dir": "x"}, TypeError, r"unexpected keyword argument\(s\) \['cahce_dir'\]"),
        ({"compile": False, "specialize": True}, ValueError, "compile=False builds an eager"),
        ({"compile": False, "cache_dir": "x"}, ValueError, "compile=False builds an eager"),
        ({"compile": False, "backend": "eager"}, TypeError, "must not be given with"),
        ({"parallel": "pg"}, TypeError, r"`parallel` must be funcamp\.distributed"),
        ({"compiler_patches": "yes"}, TypeError, "`compiler_patches` must be 'auto', True"),
    ],
)
def test_bad_options_name_the_argument(kwargs, error, message):
    with warnings.catch_warnings(), pytest.raises(error, match=message):
        warnings.simplefilter("ignore", FutureWarning)
        funcamp.make_train_step(_loss_fn, funcamp.sgd(0.1), "float32", **kwargs)


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_parallel_as_an_object_equals_group(world):
    opt = funcamp.sgd(0.1)
    piece = fd.DataParallel(world)
    new = funcamp.make_train_step(_loss_fn, opt, "mixed_bfloat16", parallel=piece, compile=False)
    with pytest.warns(FutureWarning, match=r"parallel=funcamp\.distributed\.DataParallel\(group\)"):
        old = funcamp.make_train_step(_loss_fn, opt, "mixed_bfloat16", group=world, compile=False)
    assert_trees_equal(_run(new, opt), _run(old, opt))
    with pytest.raises(ValueError, match="give one of `parallel` and `group`"):
        funcamp.make_train_step(_loss_fn, opt, "float32", parallel=piece, group=world)
    cache = funcamp.Compile(cache_dir="x")
    with pytest.raises(
        ValueError, match=r"cache_dir does not compose with parallel=DataParallel\(group\)"
    ):
        funcamp.make_train_step(_loss_fn, opt, "float32", parallel=piece, compile=cache)


def test_the_suite_fails_on_the_old_spelling():
    """pyproject's ``filterwarnings`` makes the old spelling's warning an error, so a test that
    uses it outside ``pytest.warns`` fails; the old names of ``funcamp.compiler`` too."""
    with pytest.raises(FutureWarning, match=r"^funcamp\.make_train_step: backend= is the old"):
        funcamp.make_train_step(_loss_fn, funcamp.sgd(0.1), "float32", backend="eager")
    with pytest.raises(FutureWarning, match=r"^funcamp\.make_eval_step: backend= is the old"):
        funcamp.make_eval_step(_loss_fn, "float32", backend="eager")
    with pytest.raises(FutureWarning, match=r"^funcamp\.compiler\.release\(\) is renamed"):
        funcamp.compiler.release()
