"""make_train_step's front door: its keywords are the fields of one declaration
(``StepOptions``), ``compile=funcamp.Compile(...)`` and ``parallel=`` are values, and what does
not combine is refused in one place. There is no old spelling."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed as dist

import funcamp
import funcamp.distributed as fd
from funcamp.train.config import StepOptions


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


def test_the_keywords_are_the_fields_of_step_options():
    """A new option is a field of StepOptions (with its check and key) and the same keyword,
    with the same default and type, documented in the docstring's Args."""
    params = inspect.signature(funcamp.make_train_step).parameters
    keywords = [p for p in params.values() if p.kind is p.KEYWORD_ONLY]
    fields = dataclasses.fields(StepOptions)
    assert [(p.name, p.default, p.annotation) for p in keywords] == [
        (f.name, f.default, f.type) for f in fields
    ]
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    doc = funcamp.make_train_step.__doc__
    assert all(f"        {f.name}: " in doc for f in fields)
    assert len(doc.splitlines()) <= 45


def test_no_builder_takes_other_keywords():
    for builder in (funcamp.make_train_step, funcamp.make_eval_step):
        kinds = {p.kind for p in inspect.signature(builder).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds
    with pytest.raises(TypeError, match="unexpected keyword argument 'backend'"):
        funcamp.make_train_step(_loss_fn, funcamp.sgd(0.1), "float32", backend="eager")
    with pytest.raises(TypeError, match="unexpected keyword argument 'group'"):
        funcamp.make_train_step(_loss_fn, funcamp.sgd(0.1), "float32", group=None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'specialize'"):
        funcamp.make_eval_step(_loss_fn, "float32", specialize=True)
    assert not hasattr(funcamp.compiler, "release")


def test_compile_is_a_frozen_value():
    cfg = funcamp.Compile(backend="aot_eager", specialize=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.backend = "inductor"  # type: ignore[misc]
    assert cfg.torch_options() == {"backend": "aot_eager"}
    assert funcamp.Compile().torch_options() == {}
    assert funcamp.Compile().fullgraph == "auto"
    assert cfg == funcamp.Compile(backend="aot_eager", specialize=True)


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
def test_every_rule_is_refused(fields, message):
    with pytest.raises(ValueError, match=r"funcamp\.Compile: " + message):
        funcamp.Compile(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"compiler_patches": "yes"}, "`compiler_patches` must be 'auto', True or False"),
        ({"options": [("max_autotune", True)]}, "`options` must be a dict of inductor options"),
        ({"fullgraph": "yes"}, "`fullgraph` must be 'auto', True or False"),
        ({"fullgraph": 1}, "`fullgraph` must be 'auto', True or False"),
        ({"dynamic": "x"}, "`dynamic` must be True, False or None"),
        ({"specialize": 1}, "`specialize` must be a bool"),
        ({"cache_dir": 3}, r"`cache_dir` must be a directory path \(str or os\.PathLike\)"),
    ],
)
def test_compile_checks_its_fields(fields, message):
    with pytest.raises(TypeError, match=r"funcamp\.Compile: " + message):
        funcamp.Compile(**fields)


def test_a_mode_with_another_backend_keeps_specialize_or_refuses():
    """Before: the guard filter was dropped silently when `mode=` came with aot_eager."""
    with pytest.raises(ValueError, match="needs inductor"):
        funcamp.Compile(backend="aot_eager", mode="default", specialize=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compile": "yes"}, r"`compile` must be True, False or a funcamp\.Compile"),
        ({"parallel": "pg"}, r"`parallel` must be funcamp\.distributed"),
        ({"has_aux": 1}, "`has_aux` must be a bool"),
        ({"donate_state": None}, "`donate_state` must be a bool"),
        ({"headroom": 3}, "`headroom` must be a bool or a callable of the leaf path"),
    ],
)
def test_bad_options_name_the_argument(kwargs, message):
    with pytest.raises(TypeError, match=r"^funcamp\.make_train_step: " + message):
        funcamp.make_train_step(_loss_fn, funcamp.sgd(0.1), "float32", **kwargs)


def test_eval_checks_compile():
    with pytest.raises(TypeError, match=r"^funcamp\.make_eval_step: `compile` must be True"):
        funcamp.make_eval_step(_loss_fn, "float32", compile="yes")


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_parallel_is_a_value(world):
    opt = funcamp.sgd(0.1)
    piece = fd.DataParallel(world)
    parallel = funcamp.make_train_step(
        _loss_fn, opt, "mixed_bfloat16", parallel=piece, compile=False
    )
    alone = funcamp.make_train_step(_loss_fn, opt, "mixed_bfloat16", compile=False)
    (a, la), (b, lb) = _run(parallel, opt), _run(alone, opt)  # one rank: the same run
    torch.testing.assert_close(a.params, b.params)
    torch.testing.assert_close(la, lb)
    cache = funcamp.Compile(cache_dir="x")
    with pytest.raises(
        ValueError, match=r"cache_dir does not compose with parallel=DataParallel\(group\)"
    ):
        funcamp.make_train_step(_loss_fn, opt, "float32", parallel=piece, compile=cache)
